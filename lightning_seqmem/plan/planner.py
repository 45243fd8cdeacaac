"""``SeqMemPlanner``: every decision of the callback, on plain values (no torch, no Lightning).

The callback measures, applies and agrees across ranks; the planner decides. Its protocol
(:class:`~lightning_seqmem.plan.protocol.Planner`) is a few methods over parts that each own and
checkpoint one state, read by name: ``settings``, ``schedule`` (which steps are warm-ups, measured,
traced), ``evidence`` (:mod:`.evidence`), ``ladder``, ``course`` (where the curriculum stands) and
``advice``. The budget holds at every step, on every path (:mod:`.judging`, :mod:`.decisions`); no
length past the model's limit (``length_limit``) is dry-run, forecast or proposed.

Example (a model whose step peaks at 1 MB + 4·(3000·L + L²) bytes, and a 3.5 MB budget):
    >>> from lightning_seqmem.core.records import StepMemory
    >>> course = Curriculum(start=64, target=256, steps_per_stage=3, multiple_of=16)
    >>> p = SeqMemPlanner(curriculum=course, memory_budget_bytes=3_500_000, safety_margin=0.0,
    ...                   warmup_steps=1)
    >>> no_rung = {name: (False, "not in this example") for name in MITIGATIONS}
    >>> lengths = []
    >>> for step in range(9):
    ...     d = p.decide((4, 256), no_rung)
    ...     p.commit(d)
    ...     s = p.begin_step(d.seq_len, 4, optimizer_steps=True, global_step=step)
    ...     peak = 1_000_000 + 4 * (3000 * s.seq_len + s.seq_len ** 2)
    ...     _ = p.observe(s, StepMemory(peak, {"forward": peak}, 1_000_000, 1_000_000))
    ...     p.course.end_batch()
    ...     lengths.append((d.action, s.seq_len))
    >>> lengths[2:6]   # 128 judged from one length is over: probe 32; then forecast over too: cap
    [('run', 64), ('probe', 32), ('run', 32), ('cap', 112)]
    >>> max(r.peak_bytes for r in p.evidence.measured.records) <= p.settings.usable_budget_bytes
    True
    >>> [a.kind for a in p.advice.take_advice()][:1]
    ['stage_over_budget']
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

from lightning_seqmem.core import advice as A
from lightning_seqmem.core.config import SeqMemConfig
from lightning_seqmem.core.curriculum import Curriculum
from lightning_seqmem.core.records import StepMemory, StepRecord
from lightning_seqmem.core.rungs import MITIGATIONS
from lightning_seqmem.plan.advice_queue import AdviceQueue
from lightning_seqmem.plan.checkpoint import reconcile
from lightning_seqmem.plan.choose import Applicability
from lightning_seqmem.plan.curriculum_state import CurriculumState
from lightning_seqmem.plan.decisions import Decider, Decision
from lightning_seqmem.plan.evidence import Evidence
from lightning_seqmem.plan.ladder_state import LadderState
from lightning_seqmem.plan.schedule import MeasurementSchedule, PendingStep
from lightning_seqmem.plan.settings import (SETTING_NAMES, PlannerSettings, RunFacts,
                                            planner_config, setting_write_error)
from lightning_seqmem.plan.view import PlanView

DryRun = Callable[[int, int, "tuple[str, ...]"], "tuple[int, dict[str, int]]"]
"""``(seq_len, batch_size, mitigations) -> (peak_bytes, phase_peak_bytes)``, or with a third
value, the :class:`~lightning_seqmem.core.peak.PeakSite` of that step (None: not known)."""

RUNG_EVENTS = ("before", "on", "failed", "off", "dropped")
"""What :meth:`SeqMemPlanner.on_rung` is told happened to a rung."""


class SeqMemPlanner:
    """The callback's decisions on plain values; arguments as
    :class:`~lightning_seqmem.SeqMemCallback`'s. ``compare_reserved``: judge against reserved
    memory (CUDA); ``block_bytes``: allocation granularity of traced steps (512 for CUDA);
    ``config``: a :class:`~lightning_seqmem.core.config.SeqMemConfig` instead of the keywords."""

    def __init__(
        self,
        warmup_steps: int = 2,
        tolerance: float = 0.15,
        memory_budget_bytes: Optional[int] = None,
        safety_margin: float = 0.1,
        curriculum: Optional[Curriculum] = None,
        warmup_steps_after_change: int = 1,
        trace_lengths: int = 3,
        measure_every_n_steps: int = 1,
        mitigations: Sequence[str] = MITIGATIONS,
        compare_reserved: bool = False,
        block_bytes: int = 1,
        precision: str = "32-true",
        dry_runner: Optional[DryRun] = None,
        config: Optional[SeqMemConfig] = None,
    ) -> None:
        config = planner_config(
            config, warmup_steps=warmup_steps, tolerance=tolerance,
            memory_budget=memory_budget_bytes, safety_margin=safety_margin, curriculum=curriculum,
            warmup_steps_after_change=warmup_steps_after_change, trace_lengths=trace_lengths,
            measure_every_n_steps=measure_every_n_steps, mitigations=mitigations)
        facts = RunFacts.of(config, compare_reserved=compare_reserved, block_bytes=block_bytes,
                            precision=precision, dry_runner=dry_runner)
        self.settings = PlannerSettings(config, facts)
        self.ladder = LadderState(config.mitigations)  # the rungs left to this run
        self._reset()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SETTING_NAMES:  # a setting written on the planner would change nothing: say so
            raise setting_write_error("SeqMemPlanner", name)
        super().__setattr__(name, value)

    def _reset(self) -> None:
        """Everything a run accumulates (what :meth:`state_dict` saves), as before the first step:
        fresh parts (the settings and the rungs left to the run stay)."""
        self.advice = AdviceQueue()
        self.ladder = LadderState(self.ladder.allowed)
        self.course = CurriculumState(self.settings.curriculum)
        self.evidence = Evidence(self.settings, self.ladder, self.advice)
        self.schedule = MeasurementSchedule()  # which batches are warm-ups, measured, traced

    def bind_run(self, **facts: Any) -> None:
        """Bind what the run decides at set-up (:class:`~lightning_seqmem.plan.settings.RunFacts`
        fields). A ``length_limit`` (the model's longest sequence) drops the curriculum stages past
        it (the last becomes the limit rounded down to ``multiple_of``), said once.

        >>> p = SeqMemPlanner(curriculum=Curriculum(start=64, target=1024, multiple_of=64))
        >>> p.bind_run(length_limit=300, length_limit_reason="max_position_embeddings=300")
        >>> p.course.stages, p.settings.within_limit(300), p.settings.within_limit(301)
        ((64, 128, 256), True, False)
        >>> p.advice.take_advice()[0].kind
        'length_limit'
        """
        if facts.get("length_limit") is not None:
            facts["length_limit"] = int(facts["length_limit"])
        self.settings.bind_run(**facts)
        limit = self.settings.length_limit
        if "length_limit" not in facts or limit is None:
            return
        dropped = self.course.drop_past(limit)
        if dropped:
            reason = self.settings.length_limit_reason
            self.advice.advise(A.length_limit(limit, reason, dropped, self.course.stages[-1]))

    # -- decisions ------------------------------------------------------------------------------
    def decide(self, shape: tuple[int, int], applicable: Applicability) -> Decision:
        """What to do before a batch of ``shape`` ``(batch_size, seq_len)``; ``applicable``: each
        rung not on -> ``(applies, reason)`` (on every rank). Pure: :meth:`commit` changes state."""
        batch_size, seq_len = int(shape[0]), int(shape[1])
        self.evidence.dry.see_length(seq_len)  # (a cache: a length the data has)
        return Decider(self.settings, self.evidence, self.ladder, self.course).decide(
            seq_len, batch_size, applicable)

    def commit(self, decision: Decision) -> None:
        """Take ``decision`` (every rank, the same one). A rung is recorded in :meth:`on_rung`."""
        self.course.commit(decision)
        for item in decision.advice:
            self.advice.advise(item)

    # -- rungs ----------------------------------------------------------------------------------
    def on_rung(self, event: str, name: "str | Sequence[str]", detail: str = "",
                seq_len: Optional[int] = None, batch_size: Optional[int] = None,
                pending: Optional[PendingStep] = None) -> None:
        """What happened to rung ``name`` (every rank, the same): ``"before"`` it goes on at
        ``(seq_len, batch_size)`` (dry runs only this moment allows), ``"on"`` (``detail``: how),
        ``"failed"`` (not tried again), ``"off"`` again (``pending``, the step that found out, ran
        without it) or ``"dropped"`` (rungs, a sequence, this run cannot take at set-up)."""
        if event not in RUNG_EVENTS:
            raise ValueError(f"`event` is {event!r}: pass one of {', '.join(RUNG_EVENTS)}")
        if event == "dropped":
            if name:
                self.ladder.drop(name)
                self.advice.advise(A.mitigations_dropped(name, detail))
            return
        assert isinstance(name, str)
        if event == "before":
            assert seq_len is not None and batch_size is not None
            self.evidence.verification.dry_before_rung(name, seq_len, batch_size)
        elif event == "on":
            before, method = self.evidence.verification.peak_before(seq_len, batch_size)
            self.ladder.switched_on(name, self.course.step, seq_len, batch_size, detail, before,
                                    method)
            self.evidence.forecaster  # noqa: B018 - a fresh fit for the new setting
        else:
            if event == "failed":
                self.ladder.failed(name)
            else:
                if pending is not None:
                    pending.mitigations = tuple(m for m in pending.mitigations if m != name)
                self.ladder.removed(name, detail)
            self.course.replan()
            self.advice.advise(A.mitigation_failed(name, detail))

    def restart(self, allowed: Sequence[str], still_on: Sequence[str] = ()) -> None:
        """A fresh run that may use the rungs ``allowed``, with ``still_on`` on already (found on
        the module: never reported as off), fitted as a setting of its own."""
        self._reset()
        self.ladder.allow(allowed)
        self.ladder.keep_on(still_on)
        self.evidence.forecaster  # noqa: B018 - that setting's own (empty) fit

    # -- measurement ----------------------------------------------------------------------------
    def begin_step(self, seq_len: int, batch_size: int, optimizer_steps: bool = True,
                   global_step: int = 0, epoch: int = 0) -> PendingStep:
        """The next batch's schedule at ``(seq_len, batch_size)``: warm-up, measured, traced."""
        s, on = self.settings, self.ladder.applied
        key = (seq_len, batch_size, on)
        warmup, measure, count = self.schedule.next(
            key, self.course.step, s.warmup_steps, s.warmup_steps_after_change,
            s.measure_every_n_steps, global_step, self.evidence.measured.covered(*key))
        if count == 0:  # kept to verify against the measurement
            self.evidence.verification.keep_forecast(seq_len, batch_size)
        # only steps ending in an optimizer step are traced (accumulating ones run another program)
        traced = (measure and not warmup and optimizer_steps
                  and self.evidence.forecaster.wants_trace(seq_len, batch_size, s.trace_lengths))
        events = self.ladder.take_pending_events()
        stage = self.course.stage if self.course.stages else None
        return PendingStep(self.course.step, global_step, epoch, seq_len, batch_size, warmup,
                           measure, traced, stage, on, events,
                           optimizer_steps=bool(optimizer_steps))

    def observe(self, pending: PendingStep, memory: StepMemory, seq_len: Optional[int] = None,
                batch_size: Optional[int] = None,
                trace: Optional[tuple[int, int, StepMemory]] = None, rank: Optional[int] = None,
                step_seconds: Optional[float] = None, trained: bool = True) -> StepRecord:
        """Record a measured step, fit, verify; returns the record
        (:meth:`lightning_seqmem.plan.verification.Verification.observe`)."""
        return self.evidence.verification.observe(pending, memory, seq_len, batch_size, trace,
                                                  rank, step_seconds, trained)

    # -- checkpointing --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Flat plain values, each part's own keys; the records are bounded
        (:func:`~lightning_seqmem.plan.checkpoint.compact_records`, ``checkpoint_records``)."""
        return {**self.course.state_dict(), **self.evidence.state_dict(),
                **self.schedule.state_dict(), **self.advice.state_dict(),
                **self.ladder.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any],
                        run_config: Optional[Mapping[str, Any]] = None
                        ) -> tuple[list[str], tuple[str, ...]]:
        """Restore :meth:`state_dict`, all or nothing (raises on a state this version cannot read);
        with the ``run_config`` this run resumes under, reconcile it and return its
        ``(phrases, removed_rungs)`` (:func:`~lightning_seqmem.plan.checkpoint.reconcile`)."""
        allowed = self.ladder.allowed  # the ladder less the rungs this run cannot take
        fresh = type(self).__new__(type(self))
        fresh.__dict__.update(self.__dict__)
        fresh._reset()
        fresh.course.load_state_dict(state)
        fresh.ladder.load_state_dict(state)
        fresh.evidence.load_state_dict(state)
        fresh.advice.load_state_dict(state)
        fresh.schedule.load_state_dict(
            state, resume_warmup=max(1, self.settings.warmup_steps_after_change))
        changed: tuple[list[str], tuple[str, ...]] = ([], ())
        if run_config is not None:
            changed = reconcile(state.get("config"), run_config, allowed,
                                state.get("mitigations_left"), PlanView.of(fresh))
        self.__dict__.update(fresh.__dict__)
        return changed


__all__ = ["RUNG_EVENTS", "SeqMemPlanner"]
