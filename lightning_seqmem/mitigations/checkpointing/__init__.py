"""Activation checkpointing of the repeated blocks: all, the first k of N, or selective.

What it does: each checkpointed block keeps its input and recomputes the rest in backward.
When it helps: activations saved by the blocks hold the peak (every ``L``-proportional term).
Cost: about one more forward, ~1/3 of a step (prior 0.33; ``k/N`` scales it; selective 0.15,
measured on CPU by ``benchmarks/checkpointing_levels.py``).
Files: :mod:`.checkpointing` (the rung), :mod:`.checkpointing_levels` (partial and selective
levels), :mod:`.checkpointing_spec`.
"""
