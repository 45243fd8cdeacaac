"""The ``"fused_loss"`` rung's spec: what the torch-free planner knows of it (see
:class:`~lightning_seqmem.core.rung_spec.RungSpec`), its step-time prior with where it was measured."""

from __future__ import annotations

from lightning_seqmem.core.rung_spec import RungSpec

__all__ = ["SPEC"]

# the causal-LM loss from hidden states and lm_head.weight in token shards: no [tokens, vocab] logits;
# the same matmuls (logits once, both gradients in the forward), a Python loop over the shards
# on CPU it runs DeepSpeed's eager tiled loss: measured by benchmarks/longest_length.py (32K vocabulary,
# hidden 256, 512 tokens x 2) at 0.515 s against 0.426 s for SDPA + full checkpointing (+33%): ~+60%
SPEC = RungSpec("fused_loss", "compute the loss with a fused linear cross-entropy (allow the fused_loss rung)", 0.05,
                device_priors=(("cpu", 0.6),))
