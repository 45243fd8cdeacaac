"""The decisions before a batch: :class:`Decider` reads the planner's parts and returns a
:class:`Decision`; it writes nothing (the state changes only when the planner commits it).

Over the budget the fastest setting the dry run says fits goes on; without one, the next applicable
rung, shorter lengths re-measured with it before growing; else the curriculum is capped at the
longest multiple of ``multiple_of`` judged to fit. A stage is entered only if forecast to fit.

Example (no budget: every batch runs as it comes):
    >>> from lightning_seqmem.plan.advice_queue import AdviceQueue
    >>> settings, ladder = PlannerSettings(), LadderState(())
    >>> evidence = Evidence(settings, ladder, AdviceQueue())
    >>> Decider(settings, evidence, ladder, CurriculumState(None)).decide(512, 4, {}).action
    'run'
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from lightning_seqmem.core import advice as A
from lightning_seqmem.core.search import bisect_last
from lightning_seqmem.core.units import format_bytes
from lightning_seqmem.plan import choose, pricing
from lightning_seqmem.plan.choose import Applicability
from lightning_seqmem.plan.curriculum_state import CurriculumState
from lightning_seqmem.plan.evidence import Evidence
from lightning_seqmem.plan.judging import Verdict
from lightning_seqmem.plan.ladder_state import LadderState
from lightning_seqmem.plan.settings import PlannerSettings

__all__ = ["Decider", "Decision", "inapplicable"]


@dataclass(frozen=True)
class Decision:
    """What happens before a batch runs: taken on rank zero, applied on every rank. ``action``:
    ``"run"``, ``"advance"`` (the next stage), ``"probe"`` (a shorter cut first), ``"mitigate"``
    (``rungs`` on first), ``"cap"`` (the curriculum stops at ``stages[-1]``), ``"over"`` (runs over,
    warned) or ``"stop"`` (training stops, ``advice[0]`` says why; never committed). ``seq_len``:
    the length to cut to (None: the batch's own); the curriculum fields: its state after it."""

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


class Decider:
    """The decision before each batch, from the settings, evidence, ladder and ``course`` (where
    the curriculum stands) it reads and never writes."""

    def __init__(self, settings: PlannerSettings, evidence: Evidence, ladder: LadderState,
                 course: CurriculumState) -> None:
        self.settings, self.evidence, self.ladder, self.course = settings, evidence, ladder, course

    def decide(self, seq_len: int, batch_size: int, applicable: Applicability) -> Decision:
        """What to do before a batch of ``(batch_size, seq_len)``; ``applicable`` maps each rung
        not on yet to ``(applies, reason)``."""
        if self.settings.curriculum is None:
            return self.decide_free(seq_len, batch_size, applicable)
        return self.decide_curriculum(seq_len, batch_size, applicable)

    def decide_free(self, seq_len: int, batch_size: int, applicable: Applicability) -> Decision:
        """Without a curriculum: a batch judged over switches the fastest setting that fits on, else
        the next rung, else runs over with a warning."""
        verdict = self.evidence.judge(seq_len, batch_size)
        if verdict.kind != "over":
            return self.decision()
        budget, usable = self.settings.budget_bytes, self.settings.usable_budget_bytes
        assert budget is not None and usable is not None
        plan = self.choose_setting(seq_len, batch_size, applicable)
        if plan is not None:
            rungs, fits = plan.rungs, plan.fits
        else:
            rung, _ = self.ladder.next_rung(applicable)
            rungs, fits = ((rung,) if rung else ()), True
        words = A.over_budget_batch(seq_len, batch_size, verdict.peak_bytes or 0,
                                    verdict.bound_bytes or 0, verdict.method, usable, budget,
                                    self.settings.safety_margin,
                                    self.checked_fit(seq_len, batch_size), self.ladder.applied,
                                    rungs, verdict.measured, still_over=not fits,
                                    inapplicable=inapplicable(applicable),
                                    device=self.settings.device_type)
        return self.decision(action="mitigate" if rungs else "over", rungs=rungs,
                             advice=(choose.with_why(words, plan),))

    def decide_curriculum(self, source_len: int, source_batch: int,
                          applicable: Applicability) -> Decision:
        """What to do before a batch of ``(source_batch, source_len)`` under a curriculum: the
        queued length, the next stage when due, else the current one; judged, and over the budget
        handed to :meth:`over_in_curriculum` (or, judged by a one-point bound only, a probe)."""
        assert self.settings.curriculum is not None
        queue, advance = list(self.course.refit_queue), False
        if queue:
            seq_len = queue.pop(0)
        elif ((self.course.decide_now
               or self.course.stage_steps >= self.settings.curriculum.steps_per_stage)
              and self.course.next_stage is not None):
            seq_len, advance = self.course.next_stage, True
        else:
            seq_len = self.course.stages[self.course.stage]
        # the last re-measurement: decide right after
        after_queue = bool(self.course.refit_queue) and not queue
        batch_size = self.course.batch_at(source_batch, source_len, seq_len)
        verdict = self.evidence.judge(seq_len, batch_size)
        go = self.decision(action="advance" if advance else "run", seq_len=seq_len,
                           refit_queue=tuple(queue), stage=self.course.stage + advance,
                           decide_now=after_queue, reset_stage_steps=advance)
        if verdict.kind == "fits":
            return go
        if verdict.kind == "unknown":  # nothing fitted yet with these mitigations: hold the stage
            return go if not advance else self.decision(
                seq_len=self.course.stages[self.course.stage], decide_now=True)
        if (advance and verdict.method in ("one-point bound", "previous setting")
                and not self.evidence.forecaster.ready):
            probe = self.probe_length(batch_size)
            if probe is not None:  # a real fit of this setting before judging the stage over
                steps = [probe] * (max(1, self.settings.warmup_steps_after_change) + 1)
                return self.decision(action="probe", seq_len=probe, refit_queue=tuple(steps[1:]),
                                     decide_now=False)
        return self.over_in_curriculum(seq_len, batch_size, verdict, applicable,
                                       lambda L: self.course.batch_at(source_batch, source_len, L))

    def over_in_curriculum(self, seq_len: int, batch_size: int, verdict: Verdict,
                           applicable: Applicability,
                           batch_of: Optional[Callable[[int], int]] = None) -> Decision:
        """Over the budget at ``seq_len`` (the next stage, or the one running): rungs, or a cap.
        Every cap is the largest multiple of ``multiple_of`` that
        :func:`~lightning_seqmem.plan.judging.judge` says fits, and the words name that length."""
        assert (self.settings.curriculum is not None and self.settings.budget_bytes is not None
                and self.settings.usable_budget_bytes is not None)
        m, current = self.settings.curriculum.multiple_of, self.course.stages[self.course.stage]
        rung, skipped = self.ladder.next_rung(applicable)
        plan = self.choose_setting(seq_len, batch_size, applicable)
        words = dict(seq_len=seq_len, peak=verdict.peak_bytes or 0, bound=verdict.bound_bytes or 0,
                     method=verdict.method, usable=self.settings.usable_budget_bytes,
                     budget=self.settings.budget_bytes, margin=self.settings.safety_margin, fit=0,
                     skipped=skipped, measured=verdict.measured, applied=self.ladder.applied)
        advance = seq_len > current and seq_len in self.course.stages
        held = self.evidence.measured.held_bytes()
        # no rung lowers what a step begins with: stop rather than run over
        if held > self.settings.usable_budget_bytes:
            return self.decision(action="stop", seq_len=None, advice=(A.held_over_budget(
                held, self.settings.usable_budget_bytes, self.settings.budget_bytes,
                self.settings.safety_margin, self.settings.device_type),))
        low = current if seq_len > current else 1  # the next stage over: stay between the two

        def cap_at(found: Optional[int], setting: tuple[str, ...], rungs: tuple[str, ...],
                   lead: str) -> Decision:
            """The curriculum capped at ``found`` (None: the stage running, or the shortest, is
            measured first), ``rungs`` switched on first (``setting``: the rungs on then)."""
            words["fit"] = found or 0  # the length checked; 0: "no length is forecast to fit"
            cap = found if found is not None else (current if seq_len > current else m)
            stages = tuple(s for s in self.course.stages[: self.course.stage + 1]
                           if s < cap) + (cap,)
            further = A.remaining_advice(setting, inapplicable(applicable),
                                         self.settings.device_type)
            action = f"{lead} curriculum stays at seq_len={cap}. To go further: {further}"
            return self.decision(action="cap", rungs=rungs, seq_len=cap, stages=stages,
                                 stage=len(stages) - 1, refit_queue=(), decide_now=False,
                                 reset_stage_steps=cap != current,
                                 advice=(A.over_budget_stage(action=action, **words),))

        if plan is not None and plan.fits:  # the dry run says which rungs make it fit: on first
            words["fit"] = self.dry_fit(1, seq_len, batch_size, self.ladder.applied, batch_of) or 0
            action = (f"Switching on {', '.join(map(repr, plan.rungs))} before it runs (dry run: "
                      f"it then fits; chosen as the fastest setting that fits: {plan.why})")
            return self.decision(action="mitigate", rungs=plan.rungs, seq_len=seq_len,
                                 refit_queue=(), decide_now=False,
                                 stage=(self.course.stages.index(seq_len) if advance
                                        else self.course.stage), reset_stage_steps=advance,
                                 advice=(A.over_budget_stage(action=action, **words),))
        if plan is not None:  # nothing fits here even with every rung: all on, the longest fitting
            setting = plan.setting
            cap = self.dry_fit(low, seq_len, batch_size, setting, batch_of)
            if cap is None and seq_len <= current:  # not even the shortest fits with every rung
                every = self.evidence.judge(seq_len, batch_size, setting)
                return self.stop(seq_len, batch_size, every if every.bound_bytes else verdict,
                                 setting)
            return cap_at(cap, setting, plan.rungs,
                          f"Switching on {', '.join(map(repr, plan.rungs))}; the")
        if rung is not None:
            words["fit"] = self.dry_fit(1, seq_len, batch_size, self.ladder.applied, batch_of) or 0
            base = min(current, seq_len)
            lengths = sorted({self.settings.curriculum.round_down(max(base // d, m))
                              for d in (4, 2, 1)})
            # warm-up, then one fitted step per length
            steps = max(1, self.settings.warmup_steps_after_change) + 1
            queue = [L for L in lengths for _ in range(steps)]
            action = (f"Switching on the next mitigation, {rung!r}, then re-measuring at seq_len "
                      f"{lengths} before growing")
            return self.decision(action="mitigate", rungs=(rung,), seq_len=queue[0],
                                 refit_queue=tuple(queue[1:]), decide_now=False,
                                 advice=(A.over_budget_stage(action=action, **words),))
        # no rung left: the longest length in [low, seq_len) judged to fit
        found = self.dry_fit(low, seq_len, batch_size, self.ladder.applied, batch_of)
        if (found is None and seq_len <= current
                and (self.evidence.forecaster.ready or seq_len <= m)):
            # nothing fits: a fit says so, or the shortest ran over
            return self.stop(seq_len, batch_size, verdict, self.ladder.applied)
        return cap_at(found, self.ladder.applied, (), "The")  # else the shortest is measured first

    def probe_length(self, batch_size: int) -> Optional[int]:
        """A length shorter than the current stage not yet fitted with these rungs, or None."""
        assert self.settings.curriculum is not None
        m = self.settings.curriculum.multiple_of
        fitted = {r.seq_len for r in self.evidence.measured.records
                  if not r.warmup and r.mitigations == self.ladder.applied
                  and r.batch_size == batch_size}
        length = self.course.stages[self.course.stage] // 2
        while length >= m:
            candidate = self.settings.curriculum.round_down(length)
            if candidate not in fitted and candidate < self.course.stages[self.course.stage]:
                return candidate
            length //= 2
        return None

    def choose_setting(self, seq_len: int, batch_size: int,
                       applicable: Applicability) -> Optional[choose.Choice]:
        """The setting that fits at ``(seq_len, batch_size)`` with the least predicted step time
        (:func:`~lightning_seqmem.plan.choose.choose`, judged by dry run); every rung on and
        ``fits=False`` when none fits; None where the dry run cannot answer."""
        if self.evidence.dry.peak(seq_len, batch_size) is None:
            return None
        timed = pricing.timed_records(self.evidence.measured.records)  # filtered once
        return choose.choose(self.ladder.applied, self.ladder.allowed, applicable,
                             lambda s: self.evidence.judge(seq_len, batch_size, s),
                             lambda s: pricing.predict_step(timed, s, seq_len, batch_size,
                                                            self.settings.device_type,
                                                            self.settings.rung_specs).key,
                             fmt=format_bytes, usable=self.settings.usable_budget_bytes)

    def dry_fit(self, low: int, high: int, batch_size: int, setting: tuple[str, ...],
                batch_of: Optional[Callable[[int], int]] = None) -> Optional[int]:
        """Largest multiple of the curriculum's ``multiple_of`` in ``[low, high)`` (and within the
        model's ``length_limit``) that :func:`~lightning_seqmem.plan.judging.judge` says fits with
        ``setting``, or None. ``batch_of(L)``: the batch size at ``L`` (``truncate=False`` reshapes
        rows), else ``batch_size`` at every length."""
        assert self.settings.curriculum is not None
        m = self.settings.curriculum.multiple_of
        # in units of m: multiples in [low, high), within the limit
        lo, hi = max(-(-low // m), 1), self.settings.clip_to_limit(high - 1) // m

        def judged(k: int) -> Verdict:
            L = k * m
            return self.evidence.judge(L, batch_of(L) if batch_of else batch_size, setting)

        if hi < lo or judged(lo).kind != "fits":
            return None
        budget = self.settings.usable_budget_bytes
        assert budget is not None

        def judged_bound(k: int) -> Optional[int]:  # the judgement's bound: agrees with judged()
            verdict = judged(k)
            if verdict.kind == "unknown":
                return None
            return (verdict.bound_bytes if verdict.bound_bytes is not None
                    else (0 if verdict.kind == "fits" else budget + 1))

        return m * self.evidence.dry.search(lo, hi, m, batch_size, tuple(setting), budget,
                                            judged_bound)

    def checked_fit(self, high: int, batch_size: int) -> int:
        """Largest length below ``high`` judged to fit with the rungs on now (what a warning names
        "the largest length forecast to fit"): a multiple of the curriculum's ``multiple_of``;
        without one, the forecast's largest length, checked by the same judgement (bisected below
        it when that is over); 0 if none."""
        if self.settings.curriculum is not None:
            return self.dry_fit(1, high, batch_size, self.ladder.applied) or 0
        guess = min(self.safe_fit(batch_size), self.settings.clip_to_limit(high - 1))
        fits = lambda L: self.evidence.judge(L, batch_size).kind == "fits"  # noqa: E731
        if guess < 1 or fits(guess):
            return max(guess, 0)
        return 0 if not fits(1) else bisect_last(fits, 1, guess)

    def safe_fit(self, batch_size: int) -> int:
        """:meth:`~lightning_seqmem.plan.evidence.Evidence.fit_now`, or 0 where it cannot say."""
        try:
            return self.evidence.fit_now(batch_size)
        except Exception:  # noqa: BLE001 - only words depend on it
            return 0

    def stop(self, seq_len: int, batch_size: int, verdict: Verdict,
             setting: tuple[str, ...]) -> Decision:
        """Nothing meets the budget at ``seq_len`` with ``setting`` (every rung this run takes)."""
        assert (self.settings.curriculum is not None and self.settings.budget_bytes is not None
                and self.settings.usable_budget_bytes is not None)
        words = A.budget_unreachable(seq_len, batch_size, verdict.bound_bytes or 0, verdict.method,
                                     self.settings.usable_budget_bytes, self.settings.budget_bytes,
                                     self.settings.safety_margin, setting,
                                     self.settings.curriculum.multiple_of,
                                     self.settings.device_type)
        return self.decision(action="stop", seq_len=None, advice=(words,))

    def decision(self, **changes: Any) -> Decision:
        """The decision that keeps the curriculum state as it is, with ``changes``."""
        base = Decision("run", None, stages=self.course.stages, stage=self.course.stage,
                        refit_queue=tuple(self.course.refit_queue),
                        decide_now=self.course.decide_now)
        return replace(base, **changes)
