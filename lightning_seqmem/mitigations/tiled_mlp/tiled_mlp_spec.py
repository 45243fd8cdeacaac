"""The ``"tiled_mlp"`` rung's :class:`.RungSpec` (torch-free) and step-time prior."""

from __future__ import annotations

from lightning_seqmem.core.rung_spec import RungSpec

__all__ = ["SPEC"]

# DeepSpeed's TiledMLP: the MLPs run again in backward, tile by tile: about one more forward of the
# MLPs (~2/3 of a block's matmuls) on top of a step of ~3 forwards: ~0.2 (ALST, arXiv 2506.13996)
SPEC = RungSpec("tiled_mlp",
                "tile the MLPs along the sequence (allow \"tiled_mlp\"; the `tiled` extra)", 0.2)
