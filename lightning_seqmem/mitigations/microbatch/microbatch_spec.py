"""The ``"microbatch"`` rung's spec: what the torch-free planner knows of it (see
:class:`~lightning_seqmem.core.rung_spec.RungSpec`), its step-time prior with where it was measured."""

from __future__ import annotations

from lightning_seqmem.core.rung_spec import RungSpec

__all__ = ["SPEC"]

# micro-batches of one sample: the same FLOPs in smaller kernels; the first split step checks the loss
SPEC = RungSpec("microbatch", "train with batch size 1 and gradient accumulation", 0.1, first_step_check=True,
                engine_feature="gradient_accumulation")
