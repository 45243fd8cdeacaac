"""Forecasts between and past the lengths dry-run, from the dry runs cached (no new dry run).

A dry run costs about a second per length at real model sizes; a report or figure would otherwise
dry-run every length it shows. A step's peak is piecewise quadratic in the length, so the dry runs
(with fewer than two, the measured steps plus the dry run's margin) are interpolated by
:func:`~lightning_seqmem.plan.dry_search.fitted_bytes`. Such a forecast has the method
:data:`DRY_RUN_FIT` and a detail naming its lengths: it is never presented as a dry run.

Example:
    >>> from lightning_seqmem.plan.planner import SeqMemPlanner
    >>> run = lambda L, B, m: (1_000 + 3 * L * L, {"forward": 1_000 + 3 * L * L})
    >>> p = SeqMemPlanner(memory_budget_bytes=10**7, dry_runner=run)
    >>> _ = p.evidence.dry.peak(256, 2), p.evidence.dry.peak(512, 2), p.evidence.dry.peak(1024, 2)
    >>> fc = dry_fit_forecast(p, 768, 2)
    >>> fc.method, fc.peak_bytes == 1_000 + 3 * 768**2, fc.detail  # doctest: +NORMALIZE_WHITESPACE
    ('dry_run_fit', True, 'quadratic through the dry runs at seq_len [256, 512, 1024] (batch 2):
    a fit, not a dry run at 768')
    >>> dry_fit_forecast(p, 512, 2).method   # a length dry-run already: that dry run
    'dry_run'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from lightning_seqmem.core.forecast import Forecast
from lightning_seqmem.core.records import PHASES
from lightning_seqmem.plan.dry_search import fitted_bytes

if TYPE_CHECKING:  # pragma: no cover
    from lightning_seqmem.plan.view import PlanView

__all__ = ["DRY_RUN_FIT", "dry_fit_anchors", "dry_fit_forecast"]

DRY_RUN_FIT = "dry_run_fit"
"""``Forecast.method`` of a forecast interpolated from the dry runs cached (none at its length)."""


def dry_fit_anchors(view: "PlanView", batch_size: int) -> dict[int, Forecast]:
    """``seq_len -> Forecast`` of the dry runs cached at ``batch_size``, rungs on now; with fewer
    than two, also of that setting's measured steps after the first (method ``"measured"``)."""
    out: dict[int, Forecast] = {L: fc for L in view.evidence.dry.answered(batch_size)  # cached
                                if (fc := view.evidence.dry.forecast(L, batch_size)) is not None}
    if len(out) >= 2:
        return out
    margin = 1 + view.evidence.measured.dry_margin()
    dried = set(out)
    for r in view.evidence.measured.records:
        if (r.mitigations != view.ladder.applied or r.batch_size != batch_size or r.seq_len in dried
                or r.step < 1):  # (the first step has no optimizer state yet)
            continue
        if r.seq_len in out and out[r.seq_len].peak_bytes >= r.peak_bytes:
            continue
        upper = int(r.peak_bytes * margin)
        reserved = (int(upper * (r.reserved_bytes / r.peak_bytes))
                    if r.reserved_bytes and r.peak_bytes else upper)
        phases = {ph: int(v) for ph in PHASES
                  if (v := getattr(r, f"{ph}_peak_bytes", None)) is not None}
        out[r.seq_len] = Forecast(r.seq_len, batch_size, r.peak_bytes, upper, reserved, "measured",
                                  phases)
    return out


def dry_fit_forecast(view: "PlanView", seq_len: int, batch_size: int,
                     anchors: Optional[dict[int, Forecast]] = None) -> Optional[Forecast]:
    """The forecast at ``(seq_len, batch_size)``, rungs on now: the cached dry run's at a length
    dry-run, else the fit through :func:`dry_fit_anchors` (None with fewer than two). No dry run."""
    anchors = dry_fit_anchors(view, batch_size) if anchors is None else anchors
    if seq_len in anchors and anchors[seq_len].method == "dry_run":
        return anchors[seq_len]
    if len(anchors) < 2:
        return None

    def fit(value: str) -> int:
        return int(fitted_bytes({L: getattr(fc, value) for L, fc in anchors.items()}, seq_len) or 0)

    phases = {}
    for ph in set.intersection(*(set(fc.phase_peak_bytes) for fc in anchors.values())):
        phases[ph] = int(fitted_bytes({L: fc.phase_peak_bytes[ph] for L, fc in anchors.items()},
                                      seq_len) or 0)
    kinds = sorted({fc.method for fc in anchors.values()})
    source = " and ".join({"dry_run": "the dry runs", "measured": "the measured steps"}.get(k, k)
                          for k in kinds)
    detail = (f"quadratic through {source} at seq_len {sorted(anchors)} (batch {batch_size}): "
              f"a fit, not a dry run at {seq_len}")
    return Forecast(int(seq_len), int(batch_size), fit("peak_bytes"), fit("upper_bytes"),
                    fit("reserved_upper_bytes"), DRY_RUN_FIT, phases, detail)
