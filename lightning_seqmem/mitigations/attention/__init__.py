"""Attention kernel: eager → SDPA (→ flash-attn on CUDA, fp16/bf16, where installed).

What it does: switches the model's attention to a fused kernel that recomputes the scores
blockwise in backward instead of keeping the ``[batch, heads, L, L]`` weights.
When it helps: an eager attention whose score matrix holds the peak (the ``L²`` term).
Cost: none measured (prior 0): the same FLOPs, no state to migrate; results equal up to rounding.
Undo: the backend is switched back (numerics change by rounding only, so it may also stay).
Files: :mod:`.attention` (the switch, the rung), :mod:`.attention_spec` (prior 0.0).
"""
