"""The ``"activation_offload"`` rung's :class:`.RungSpec` (torch-free) and step-time prior."""

from __future__ import annotations

from lightning_seqmem.core.rung_spec import RungSpec

__all__ = ["SPEC"]

# two copies of the saved activations over the host link, on the compute stream; a guess until
# measured (ALST reports a few % at 650K tokens, more at short lengths)
SPEC = RungSpec("activation_offload", "offload saved activations to pinned host memory (CUDA)",
                0.15, training_only=True)
