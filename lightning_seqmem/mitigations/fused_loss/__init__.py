"""Fused linear cross-entropy: a causal LM's loss without its logits materialised whole.

What it does: the loss and its gradients from the hidden states and ``lm_head.weight``, a block of
tokens at a time (Apple's ``cut-cross-entropy`` or Liger on CUDA, DeepSpeed's tiled loss on CPU).
When it helps: the ``[tokens, vocab]`` logits (and their log-softmax and gradient) hold the peak.
Cost: prior 0.05 on CUDA, 0.6 on CPU (measured by ``benchmarks/longest_length.py``). Opt-in.
Files: :mod:`.fused_loss` (the rung), :mod:`.fused_loss_hf` (HF models), :mod:`.fused_loss_spec`.
"""
