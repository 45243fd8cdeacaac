"""The ``"microbatch"`` rung's :class:`.RungSpec` (torch-free) and step-time prior."""

from __future__ import annotations

from lightning_seqmem.core.rung_spec import RungSpec

__all__ = ["SPEC"]

# one-sample micro-batches: the same FLOPs in smaller kernels; the first split step checks the loss
SPEC = RungSpec("microbatch", "train with batch size 1 and gradient accumulation", 0.1,
                first_step_check=True, engine_feature="gradient_accumulation",
                training_only=True)
