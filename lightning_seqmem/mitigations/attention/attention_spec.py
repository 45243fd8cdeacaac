"""The ``"attention"`` rung's :class:`.RungSpec` (torch-free) and step-time prior."""

from __future__ import annotations

from lightning_seqmem.core.rung_spec import RungSpec

__all__ = ["SPEC"]

# eager -> SDPA/flash-attn: no L^2 matrix, no extra compute
SPEC = RungSpec("attention", "switch attention to SDPA or flash-attn", 0.0,
                linearises_attention=True, engine_feature="sdpa_attention")
