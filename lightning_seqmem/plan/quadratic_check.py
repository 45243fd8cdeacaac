"""Whether a switch took the L² term away: bytes per token² before and after it, from the fits of
the two settings (the planner warns when an attention switch left attention quadratic)."""

from __future__ import annotations

from typing import Optional

from lightning_seqmem.core.forecast import MemoryForecaster

__all__ = ["quadratic_terms"]


def quadratic_terms(old: Optional[MemoryForecaster],
                    new: MemoryForecaster) -> Optional[tuple[float, float]]:
    """Bytes per token² (per sample) before and after a change, measured the same way, or None:
    from the timeline replays (exact), else from quadratic fits of three or more lengths (a
    two-point fit is C + b·L² by construction)."""
    if old is None:
        return None
    if old.timeline is not None and new.timeline is not None:
        return tuple(  # type: ignore[return-value]
            float(f.timeline.coefficients[2].clip(min=0).sum()) for f in (old, new))
    fits = [f.quadratic for f in (old, new)]
    if any(q is None for q in fits) or any(len({L for L, _ in f.points}) < 3 for f in (old, new)):
        return None
    return tuple(max(c.quadratic_bytes_per_token2  # type: ignore[union-attr,return-value]
                     for c in q.coefficients.values()) for q in fits)
