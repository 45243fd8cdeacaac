"""Judging a batch against the usable budget: the :class:`Verdict` and :func:`judge`, pure (plain
values and callables, no planner part).

Before a batch runs at ``(L, B)`` under the mitigations now on, :func:`judge` says whether it fits:

1. measured already at ``(L, B)`` with these mitigations: over if any step (warm-up included)
   went over, fits if a fitted step did not;
2. else the dry run (this shape's, or a bound from a larger shape's:
   :meth:`~lightning_seqmem.plan.dry_evidence.DryEvidence.judged`);
3. otherwise the smallest of the upper bounds available: this setting's forecast, the forecast of
   the setting before the last rung (a mitigation adds no memory, unless a shape measured under
   both settings peaked higher with it:
   :meth:`~lightning_seqmem.plan.measured.MeasuredEvidence.memory_added`), and a one-point bound
   from this setting's nearest shorter measurement (``static + dynamic·(L/L₀)²·B/B₀``: activations
   grow at most quadratically in the length and linearly in the batch);
4. nothing measured yet: unknown (the first steps), and the batch runs.

The dry run and the bounds are asked only where the measurements do not decide (callables), so
that a measured shape costs no dry run. :meth:`~lightning_seqmem.plan.evidence.Evidence.judge`
gathers them from the evidence.

Example:
    >>> judge(None, [], lambda: None, list)   # no budget: everything fits
    Verdict(kind='fits', bound_bytes=None, peak_bytes=None, method='', measured=False)
    >>> judge(1000, [(900, 880, False)], lambda: None, list)   # a fitted step at this shape within it
    Verdict(kind='fits', bound_bytes=900, peak_bytes=880, method='measured', measured=True)
    >>> judge(1000, [], lambda: (1200, 1150), list).kind, judge(1000, [], lambda: None, lambda: [(990, 950, "quadratic")]).kind
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
    """What a dry run's ``peak_bytes`` is compared with the usable budget as: its upper bound, the
    peak plus the dry run's margin. The callback judges a dry-run answer so before its first steps,
    and ``seqmem plan`` judges every row so: the plan says "fits" where the callback will run the
    step without a rung.

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
    method: str = ""  # "measured", "dry_run", "replay", "quadratic", "one-point bound", "previous setting"
    measured: bool = False

    @staticmethod
    def of(bound: Bound, budget: int, method: str, measured: bool = False) -> "Verdict":
        """``fits`` where ``bound[0]`` is within ``budget``, else ``over``."""
        return Verdict("fits" if bound[0] <= budget else "over", bound[0], bound[1], method, measured)


def judge(budget_bytes: Optional[int], measured_here: Sequence[tuple[int, int, bool]],
          dry: Callable[[], Optional[Bound]], bounds: Callable[[], list[tuple[int, int, str]]]) -> Verdict:
    """The verdict for one shape (see the module doc): ``measured_here``, the ``(bound, peak,
    warmup)`` of every step measured at it; ``dry()``, the dry run's ``(bound, peak)`` or None;
    ``bounds()``, the other upper bounds ``(bound, peak, method)``."""
    if budget_bytes is None:
        return Verdict("fits")
    if measured_here:
        worst = max(measured_here, key=lambda m: m[0])  # the first of the highest, in the order measured
        if worst[0] > budget_bytes:
            return Verdict.of(worst[:2], budget_bytes, "measured", measured=True)
        if any(not warmup for _, _, warmup in measured_here):
            return Verdict.of(worst[:2], budget_bytes, "measured", measured=True)
    answer = dry()
    if answer is not None:  # the exact program at this length (or a bound from a larger one): before any extrapolation
        return Verdict.of(answer, budget_bytes, "dry_run")
    known = bounds()
    if not known:
        return Verdict("unknown")
    bound, peak, method = min(known)
    return Verdict.of((bound, peak), budget_bytes, method)
