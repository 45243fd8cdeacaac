"""Sequence-tiled MLPs with recompute: DeepSpeed's ``TiledMLP`` on every block.

What it does: runs each block's MLP on sequence tiles, saving only its input, recomputed tile
by tile in backward (ALST, arXiv 2506.13996).
When it helps: the MLPs' wide intermediate activations hold the peak (after SDPA and a fused loss).
Cost: one more forward of the MLPs, ~20% of a step (prior 0.2). Opt-in; the ``tiled`` extra.
Files: :mod:`.tiled_mlp` (the rung), :mod:`.tiled_mlp_spec`.
"""
