"""The ``"activation_offload"`` rung's spec: what the torch-free planner knows of it (see
:class:`~lightning_seqmem.core.rung_spec.RungSpec`), its step-time prior with where it was measured."""

from __future__ import annotations

from lightning_seqmem.core.rung_spec import RungSpec

__all__ = ["SPEC"]

# saved activations to pinned host memory and back (CUDA only): two copies of them over the host link, on
# the compute stream; a guess until measured (ALST reports a few % at 650K tokens, more at short lengths)
SPEC = RungSpec("activation_offload", "offload saved activations to pinned host memory (CUDA)", 0.15)
