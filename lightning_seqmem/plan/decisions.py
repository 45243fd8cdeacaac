"""The planner's decisions before a batch, as functions of the planner's state (read, never
written: the state changes only in :meth:`~lightning_seqmem.plan.planner.SeqMemPlanner.commit`).

``p`` is the :class:`~lightning_seqmem.plan.planner.SeqMemPlanner` façade: its judgement
(:meth:`~lightning_seqmem.plan.evidence.Evidence.judge`), its ladder, its curriculum state. Without a
curriculum :func:`decide_free` decides; with one, :func:`~lightning_seqmem.plan.curriculum_state.decide_curriculum`.
Over the budget, :func:`choose_setting` picks the fastest setting the dry run says fits
(:mod:`.choose`, priced by :mod:`.pricing`), :func:`dry_fit` the longest length that fits.

Example (no budget: every batch runs as it comes):
    >>> from lightning_seqmem.plan.planner import SeqMemPlanner
    >>> decide_free(SeqMemPlanner(), 512, 4, {}).action
    'run'
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from lightning_seqmem.core import advice as A
from lightning_seqmem.core.search import bisect_last
from lightning_seqmem.core.units import format_bytes
from lightning_seqmem.plan import choose, pricing
from lightning_seqmem.plan.judging import Verdict

if TYPE_CHECKING:  # pragma: no cover
    from lightning_seqmem.plan.planner import SeqMemPlanner

__all__ = ["Decision", "checked_fit", "choose_setting", "decide_free", "decision", "dry_fit", "inapplicable", "stop"]

Applicability = Mapping[str, "tuple[bool, str]"]


@dataclass(frozen=True)
class Decision:
    """What happens before a batch runs: taken once (rank zero), applied on every rank.

    ``action`` is ``"run"`` (stay), ``"advance"`` (enter the next stage), ``"probe"`` (measure a
    shorter cut first, to fit the next stage), ``"mitigate"`` (switch ``rungs`` on first),
    ``"cap"`` (stop the curriculum at ``stages[-1]``; ``rungs`` may go on with it), ``"over"`` (no curriculum and nothing left
    to switch on: the batch runs over the forecast budget, with a warning) or ``"stop"`` (nothing can
    meet the budget: training stops before the batch, ``advice[0]`` says why; never committed). ``seq_len`` is the
    length to cut the batch to (``None``: the batch's own). The curriculum fields are its state
    after the decision.
    """

    action: str
    seq_len: Optional[int]
    rungs: tuple[str, ...] = ()  # switched on, in this order, before the batch
    stages: tuple[int, ...] = ()
    stage: int = 0
    refit_queue: tuple[int, ...] = ()
    decide_now: bool = False
    reset_stage_steps: bool = False
    advice: tuple[A.Advice, ...] = ()

    @property
    def rung(self) -> Optional[str]:
        """The first rung to switch on, or None."""
        return self.rungs[0] if self.rungs else None


def inapplicable(applicable: Applicability) -> tuple[str, ...]:
    """The rungs checked and found not to apply (never advised: attention already on SDPA)."""
    return tuple(name for name, (ok, _) in applicable.items() if not ok)


def decision(p: "SeqMemPlanner", **changes: Any) -> Decision:
    """The decision that keeps the curriculum state as it is, with ``changes``."""
    base = Decision("run", None, stages=p.stages, stage=p.stage, refit_queue=tuple(p.refit_queue),
                    decide_now=p.decide_now)
    return replace(base, **changes)


def choose_setting(p: "SeqMemPlanner", seq_len: int, batch_size: int, applicable: Applicability) -> Optional[choose.Choice]:
    """The setting that fits at ``(seq_len, batch_size)`` with the least predicted step time
    (:func:`~lightning_seqmem.plan.choose.choose`: what is on plus at most one applicable variant
    per rung left or an upgrade, judged by dry run, priced by :meth:`~lightning_seqmem.plan.planner.SeqMemPlanner.price`); every rung on and
    ``fits=False`` when none fits; None where the dry run cannot answer."""
    if p.dry_peak(seq_len, batch_size) is None:
        return None
    timed = pricing.timed_records(p.records)  # filtered once: every candidate is priced
    return choose.choose(p.applied_mitigations, p.mitigations, applicable,
                         lambda s: p.judge(seq_len, batch_size, s),
                         lambda s: pricing.predict_step(timed, s, seq_len, batch_size, p.device_type).key,
                         fmt=format_bytes, usable=p.usable_budget_bytes)


def dry_fit(p: "SeqMemPlanner", low: int, high: int, batch_size: int, setting: tuple[str, ...],
            batch_of: Optional[Callable[[int], int]] = None) -> Optional[int]:
    """Largest multiple of the curriculum's ``multiple_of`` in ``[low, high)`` (and within the
    model's ``length_limit``) that :func:`~lightning_seqmem.plan.judging.judge` says fits with ``setting``, or None (bisection: a
    handful of judgements, each the dry run where it answers, cached). ``batch_of(L)``: the batch
    size at ``L`` (``truncate=False`` reshapes rows), else ``batch_size`` at every length."""
    assert p.curriculum is not None
    m = p.curriculum.multiple_of
    if p.length_limit is not None:
        high = min(high, p.length_limit + 1)
    lo, hi = max(-(-low // m), 1), (high - 1) // m  # in units of m: multiples in [low, high)

    def fits(k: int) -> bool:
        L = k * m
        return p.judge(L, batch_of(L) if batch_of else batch_size, setting).kind == "fits"

    if hi < lo or not fits(lo):
        return None
    budget = p.usable_budget_bytes
    assert budget is not None

    def judged_bound(k: int) -> Optional[int]:  # the judgement's bound, so the search agrees with fits()
        L = k * m
        verdict = p.judge(L, batch_of(L) if batch_of else batch_size, setting)
        if verdict.kind == "unknown":
            return None
        return verdict.bound_bytes if verdict.bound_bytes is not None else (0 if verdict.kind == "fits" else budget + 1)

    return m * p.evidence._dry_search(lo, hi, m, batch_size, tuple(setting), budget, judged_bound)


def checked_fit(p: "SeqMemPlanner", high: int, batch_size: int) -> int:
    """Largest length below ``high`` that :func:`~lightning_seqmem.plan.judging.judge` says fits with the rungs on now (what a
    warning names as "the largest length forecast to fit"): a multiple of the curriculum's
    ``multiple_of``; without one, the forecast's largest length, checked by the same judgement
    (bisected below it when that is over); 0 if none."""
    if p.curriculum is not None:
        return dry_fit(p, 1, high, batch_size, p.applied_mitigations) or 0
    high = high if p.length_limit is None else min(high, p.length_limit + 1)
    guess = min(safe_fit(p, batch_size), high - 1)
    fits = lambda L: p.judge(L, batch_size).kind == "fits"  # noqa: E731
    if guess < 1 or fits(guess):
        return max(guess, 0)
    return 0 if not fits(1) else bisect_last(fits, 1, guess)


def decide_free(p: "SeqMemPlanner", seq_len: int, batch_size: int, applicable: Applicability) -> Decision:
    """Without a curriculum (the data sets the length): a batch judged over switches the fastest
    setting that fits on, else the next rung, else runs over with a warning."""
    verdict = p.judge(seq_len, batch_size)
    if verdict.kind != "over":
        return decision(p)
    budget, usable = p.budget_bytes, p.usable_budget_bytes
    assert budget is not None and usable is not None
    plan = choose_setting(p, seq_len, batch_size, applicable)
    if plan is not None:
        rungs, fits = plan.rungs, plan.fits
    else:
        rung, _ = p.ladder.next_rung(applicable)
        rungs, fits = ((rung,) if rung else ()), True
    words = A.over_budget_batch(seq_len, batch_size, verdict.peak_bytes or 0, verdict.bound_bytes or 0,
                                verdict.method, usable, budget, p.safety_margin, checked_fit(p, seq_len, batch_size),
                                p.applied_mitigations, rungs, verdict.measured, still_over=not fits,
                                inapplicable=inapplicable(applicable), device=p.device_type)
    return decision(p, action="mitigate" if rungs else "over", rungs=rungs, advice=(choose.with_why(words, plan),))


def safe_fit(p: "SeqMemPlanner", batch_size: int) -> int:
    """:meth:`~lightning_seqmem.plan.evidence.Evidence.fit_now`, or 0 where it cannot say (only words depend on it)."""
    try:
        return p.evidence.fit_now(batch_size)
    except Exception:  # noqa: BLE001 - only words depend on it
        return 0


def stop(p: "SeqMemPlanner", seq_len: int, batch_size: int, verdict: Verdict, setting: tuple[str, ...]) -> Decision:
    """Nothing can meet the budget at ``seq_len`` with ``setting`` (every rung this run can take)."""
    assert p.curriculum is not None and p.budget_bytes is not None and p.usable_budget_bytes is not None
    words = A.budget_unreachable(seq_len, batch_size, verdict.bound_bytes or 0, verdict.method,
                                 p.usable_budget_bytes, p.budget_bytes, p.safety_margin, setting,
                                 p.curriculum.multiple_of, p.device_type)
    return decision(p, action="stop", seq_len=None, advice=(words,))
