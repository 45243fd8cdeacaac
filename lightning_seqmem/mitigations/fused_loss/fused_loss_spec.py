"""The ``"fused_loss"`` rung's :class:`.RungSpec` (torch-free) and step-time prior."""

from __future__ import annotations

from lightning_seqmem.core.rung_spec import RungSpec

__all__ = ["SPEC"]

# the same matmuls (logits once, both gradients in the forward), a Python loop over token shards.
# CPU runs DeepSpeed's eager tiled loss: benchmarks/longest_length.py (32K vocabulary, hidden 256,
# 512 tokens x 2) 0.515 s against 0.426 s for SDPA + full checkpointing (+33%): ~+60%
SPEC = RungSpec("fused_loss",
                "compute the loss with a fused linear cross-entropy (allow the fused_loss rung)",
                0.05, device_priors=(("cpu", 0.6),))
