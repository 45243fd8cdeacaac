"""Judging a batch against the usable budget: :class:`Verdict` and :func:`judge`, pure (plain
values and callables). Before a batch runs at ``(L, B)`` under the rungs on, it is judged by:

1. measured at ``(L, B)`` with these rungs: over if any step (warm-up included) went over, fits
   if a fitted step did not;
2. else the dry run (this shape's, or a larger shape's bound: :mod:`.dry_evidence`);
3. else the smallest upper bound: this setting's forecast, the forecast of the setting before the
   last rung (unless a rung added memory: :mod:`.measured`), a one-point bound from the nearest
   shorter measurement (``static + dynamic·(L/L₀)²·B/B₀``);
4. nothing measured yet: unknown, and the batch runs.

The dry run and the bounds are callables, asked only where the measurements do not decide.

Example:
    >>> judge(None, [], lambda: None, list)   # no budget: everything fits
    Verdict(kind='fits', bound_bytes=None, peak_bytes=None, method='', measured=False)
    >>> judge(1000, [(900, 880, False)], lambda: None, list)   # a fitted step here within it
    Verdict(kind='fits', bound_bytes=900, peak_bytes=880, method='measured', measured=True)
    >>> dry, quadratic = lambda: (1200, 1150), lambda: [(990, 950, "quadratic")]
    >>> judge(1000, [], dry, list).kind, judge(1000, [], lambda: None, quadratic).kind
    ('over', 'fits')
    >>> judge(1000, [], lambda: None, list).kind   # nothing known: the batch runs (the first steps)
    'unknown'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

__all__ = ["DRY_RUN_MARGIN", "Verdict", "dry_run_bound", "judge"]

Bound = tuple[int, int]  # (what is compared with the budget, the peak behind it), bytes
DRY_RUN_MARGIN = 0.02
"""The dry run's margin before any measured step widens it (by its largest under-prediction:
:meth:`~lightning_seqmem.plan.measured.MeasuredEvidence.dry_margin`)."""


def dry_run_bound(peak_bytes: int, margin: float = DRY_RUN_MARGIN) -> int:
    """What a dry run's ``peak_bytes`` is compared with the usable budget as: the peak plus the
    margin, in the callback and in ``seqmem plan`` alike (so their "fits" agree).

    >>> dry_run_bound(1_000_000)
    1020000
    """
    return int(peak_bytes * (1 + margin))


@dataclass(frozen=True)
class Verdict:
    """Whether ``(seq_len, batch_size)`` fits the usable budget under the mitigations now on."""

    kind: str  # "fits", "over" or "unknown"
    bound_bytes: Optional[int] = None  # what was compared with the budget
    peak_bytes: Optional[int] = None  # the measured or forecast peak behind it
    method: str = ""  # measured, dry_run, replay, quadratic, one-point bound, previous setting
    measured: bool = False

    @staticmethod
    def of(bound: Bound, budget: int, method: str, measured: bool = False) -> "Verdict":
        """``fits`` where ``bound[0]`` is within ``budget``, else ``over``."""
        return Verdict("fits" if bound[0] <= budget else "over", bound[0], bound[1], method,
                       measured)


def judge(budget_bytes: Optional[int], measured_here: Sequence[tuple[int, int, bool]],
          dry: Callable[[], Optional[Bound]],
          bounds: Callable[[], list[tuple[int, int, str]]]) -> Verdict:
    """The verdict for one shape (see the module doc): ``measured_here``, the ``(bound, peak,
    warmup)`` of every step measured at it; ``dry()``, the dry run's ``(bound, peak)`` or None;
    ``bounds()``, the other upper bounds ``(bound, peak, method)``."""
    if budget_bytes is None:
        return Verdict("fits")
    if measured_here:
        worst = max(measured_here, key=lambda m: m[0])  # the first of the highest, in order
        if worst[0] > budget_bytes or any(not warmup for _, _, warmup in measured_here):
            return Verdict.of(worst[:2], budget_bytes, "measured", measured=True)
    answer = dry()
    if answer is not None:  # the exact program here (or a larger one's bound): before extrapolating
        return Verdict.of(answer, budget_bytes, "dry_run")
    known = bounds()
    if not known:
        return Verdict("unknown")
    bound, peak, method = min(known)
    return Verdict.of((bound, peak), budget_bytes, method)
