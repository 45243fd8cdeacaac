"""``SeqMemPlanner``: every decision of the callback, on plain values (no torch, no Lightning).

The callback measures, applies and agrees across ranks; the planner decides. It is a façade over
parts that each own one state:

* :class:`~lightning_seqmem.plan.settings.PlannerSettings`: its arguments and what the run binds at
  set-up (:meth:`SeqMemPlanner.bind_run`);
* :class:`~lightning_seqmem.plan.schedule.MeasurementSchedule` (:meth:`begin_step`): warm-up steps,
  warm-up after a change of shape or mitigations, ``measure_every_n_steps``, which steps are traced;
* :class:`~lightning_seqmem.plan.evidence.Evidence`: the records, one
  :class:`~lightning_seqmem.core.forecast.MemoryForecaster` per set of mitigations fed by
  :meth:`observe`, the dry-run cache, the forecasts, the judgement against the budget
  (:mod:`.judging`) and the verification of every forecast when its length runs (:mod:`.verification`);
* :class:`~lightning_seqmem.plan.ladder_state.LadderState`: the rungs on, allowed, not applicable, and
  what happened to each;
* :class:`~lightning_seqmem.plan.curriculum_state.CurriculumState`: stage, cap, the queue of shorter
  lengths measured before growing;
* the decisions before every batch (:meth:`decide` → :class:`Decision`, functions of
  :mod:`.decisions` and :mod:`.curriculum_state`, applied on every rank with :meth:`commit`), the
  advice they give (:class:`~lightning_seqmem.plan.advice_queue.AdviceQueue`), the logged metrics
  (:mod:`.metrics`) and the checkpoint state (:mod:`.planner_state`).

The budget holds at every step, on every path. Before a batch runs at ``(L, B)`` under the
mitigations now on, :meth:`judge` says whether it fits the usable budget:

1. measured already at ``(L, B)`` with these mitigations: over if any step (warm-up included)
   went over, fits if a fitted step did not;
2. otherwise the smallest of the upper bounds available: this setting's forecast, the forecast of
   the setting before the last rung (a mitigation adds no memory, unless a step showed it does), and a one-point bound from
   this setting's nearest shorter measurement (``static + dynamic·(L/L₀)²·B/B₀``: activations grow
   at most quadratically in the length and linearly in the batch);
3. nothing measured yet: unknown (the first steps), and the batch runs.

A curriculum stage is entered only on a forecast that fits: while the next stage can be judged
only by the one-point bound, a shorter cut of the batch is measured first, so the stage gets a
real fit. Over the budget, the fastest setting the dry run says fits is switched on (:mod:`.choose`,
priced by :mod:`.pricing`; without a dry run the next applicable rung, and shorter lengths are
re-measured with it before growing), else the curriculum is capped at the longest multiple of
``multiple_of`` that :meth:`judge` (the dry run where it answers: the predictor that judged the
stage) says fits — below the current stage if the current stage itself is over — and the warning
names that length. No length past the model's own limit (``length_limit``, its positions) is
dry-run, forecast or proposed. Without a
curriculum the data sets the length: a batch judged over switches the next rung on before it
runs, or, with no rung left, warns once.

Example (a model whose step peaks at 1 MB + 4·(3000·L + L²) bytes, and a 3.5 MB budget):
    >>> from lightning_seqmem.core.records import StepMemory
    >>> p = SeqMemPlanner(curriculum=Curriculum(start=64, target=256, steps_per_stage=3, multiple_of=16),
    ...                   memory_budget_bytes=3_500_000, safety_margin=0.0, warmup_steps=1)
    >>> no_rung = {name: (False, "not in this example") for name in MITIGATIONS}
    >>> lengths = []
    >>> for step in range(9):
    ...     d = p.decide((4, 256), no_rung)
    ...     p.commit(d)
    ...     s = p.begin_step(d.seq_len, 4, optimizer_steps=True, global_step=step)
    ...     peak = 1_000_000 + 4 * (3000 * s.seq_len + s.seq_len ** 2)
    ...     _ = p.observe(s, StepMemory(peak, {"forward": peak}, 1_000_000, 1_000_000))
    ...     p.end_batch()
    ...     lengths.append((d.action, s.seq_len))
    >>> lengths[2:6]   # 128 judged from one length only is over: probe 32; then 128 is forecast over too: cap
    [('run', 64), ('probe', 32), ('run', 32), ('cap', 112)]
    >>> max(r.peak_bytes for r in p.records) <= p.usable_budget_bytes, [a.kind for a in p.take_advice()][:1]
    (True, ['stage_over_budget'])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from lightning_seqmem.core import advice as A
from lightning_seqmem.core.curriculum import Curriculum
from lightning_seqmem.core.records import StepMemory, StepRecord
from lightning_seqmem.core.config import SeqMemConfig
from lightning_seqmem.core.rungs import MITIGATIONS
from lightning_seqmem.plan import decisions, pricing
from lightning_seqmem.plan import metrics as plan_metrics
from lightning_seqmem.plan.advice_queue import AdviceQueue
from lightning_seqmem.plan.curriculum_state import CurriculumState, decide_curriculum
from lightning_seqmem.plan.decisions import Decision
from lightning_seqmem.plan.evidence import Evidence
from lightning_seqmem.plan.forward import Forward
from lightning_seqmem.plan.judging import Verdict
from lightning_seqmem.plan.ladder_state import LadderState
from lightning_seqmem.plan.planner_state import load_planner_state, planner_state
from lightning_seqmem.plan.quadratic_check import quadratic_terms
from lightning_seqmem.plan.schedule import MeasurementSchedule
from lightning_seqmem.plan.settings import BoundForward, PlannerSettings, RunFacts, planner_config

Applicability = Mapping[str, "tuple[bool, str]"]
DryRun = Callable[[int, int, "tuple[str, ...]"], "tuple[int, dict[str, int]]"]
"""``(seq_len, batch_size, mitigations) -> (peak_bytes, phase_peak_bytes)``, or with a third value, the
:class:`~lightning_seqmem.core.peak.PeakSite` of that step (None: not known): said in the forecast's detail."""


@dataclass
class PendingStep:
    """What :meth:`SeqMemPlanner.begin_step` decided for the batch about to run."""

    step: int
    global_step: int
    epoch: int
    seq_len: int
    batch_size: int
    warmup: bool
    measure: bool
    traced: bool
    stage: Optional[int]
    mitigations: tuple[str, ...]
    events: list[str] = field(default_factory=list)
    # the batch ends with an optimizer step: under gradient accumulation the window's last, which
    # the predictors model (the highest: the earlier batches' gradients alive through its backward)
    optimizer_steps: bool = True


class SeqMemPlanner:
    """The callback's decisions on plain values. Arguments as :class:`~lightning_seqmem.SeqMemCallback`'s.

    Args:
        memory_budget_bytes: the budget in bytes, or None (forecasts are then informational).
        compare_reserved: judge against reserved memory (the CUDA caching allocator: an OOM happens
            at the reserved level); the tracker has no reserved memory.
        block_bytes: allocation granularity of traced steps (512 for CUDA, 1 for the tracker).
        config: a :class:`~lightning_seqmem.core.config.SeqMemConfig` (the callback's) instead of
            the keywords it holds; without one, they make one (unchecked, as they always were).

    Its state is in its parts (``settings``, ``schedule``, ``evidence``, ``ladder``, ``course``,
    ``advice``); the names below read and write theirs. The settings are read-only: a write of
    a configured one raises, a write of a run fact is a :meth:`bind_run` (``p.dry_run = fn``).
    """

    # the settings (PlannerSettings): the arguments (a frozen SeqMemConfig: writes raise), and what the
    # run binds at set-up (RunFacts: a write is a bind_run)
    config = Forward("settings")
    run_facts = Forward("settings")
    warmup_steps = Forward("settings")
    tolerance = Forward("settings")
    budget_bytes = BoundForward("settings")
    safety_margin = Forward("settings")
    curriculum = Forward("settings")
    warmup_steps_after_change = Forward("settings")
    trace_lengths = Forward("settings")
    measure_every_n_steps = BoundForward("settings")
    compare_reserved = BoundForward("settings")
    block_bytes = BoundForward("settings")
    precision = BoundForward("settings")
    dry_run = BoundForward("settings")
    device_type = BoundForward("settings")
    checkpoint_records = BoundForward("settings")
    memory_records = BoundForward("settings")
    length_limit = BoundForward("settings")
    length_limit_reason = BoundForward("settings")
    budget = Forward("settings")
    usable_budget_bytes = Forward("settings")
    within_limit = Forward("settings", method=True)
    bind_run = Forward("settings", method=True)
    # the measurement schedule (checkpointed: the occurrences per shape)
    _key_counts = Forward("schedule", "counts")
    resume_warmup = Forward("schedule")
    # the evidence: records, fits, dry-run answers, forecasts, judgement, verification
    records = Forward("evidence")
    forecasters = Forward("evidence")
    forecaster = Forward("evidence")
    last_batch_size = Forward("evidence")
    last_verification_error = Forward("evidence")
    replay_checks = Forward("evidence")
    checks = Forward("evidence")
    _pending = Forward("evidence")
    _dry = Forward("evidence")
    _dry_why = Forward("evidence")
    _dry_sites = Forward("evidence")
    _longest_seen = Forward("evidence")
    forecast = Forward("evidence", method=True)
    max_seq_len = Forward("evidence", method=True)
    dry_peak = Forward("evidence", method=True)
    dry_answers = Forward("evidence", method=True)
    dry_run_why = Forward("evidence", method=True)
    dry_peak_site = Forward("evidence", method=True)
    scratch_bytes = Forward("evidence", method=True)
    judge = Forward("evidence", method=True)
    bound_of = Forward("evidence", method=True)
    batch_size_or_last = Forward("evidence", method=True)
    dry_forecast = Forward("evidence", method=True)
    dry_margin = Forward("evidence", method=True)
    kept_forecast = Forward("evidence", method=True)
    any_dry_run_answered = Forward("evidence", method=True)
    _dry_judged = Forward("evidence", method=True)
    _measured_bound = Forward("evidence", method=True)
    # the ladder: rungs on, allowed, not applicable, their events
    applied_mitigations = Forward("ladder", "applied")
    mitigations = Forward("ladder", "allowed")
    mitigation_events = Forward("ladder", "events")
    not_applicable = Forward("ladder")
    # the curriculum's state
    stages = Forward("course")
    stage = Forward("course")
    stage_steps = Forward("course")
    capped_at = Forward("course")
    refit_queue = Forward("course")
    decide_now = Forward("course")
    seq_len = Forward("course")
    batch_at = Forward("course", method=True)
    # the advice given
    warned = Forward("advice")
    advise = Forward("advice", method=True)
    take_advice = Forward("advice", method=True)

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
        dry_run: Optional[DryRun] = None,
        config: Optional[SeqMemConfig] = None,
    ) -> None:
        config = planner_config(
            config, warmup_steps=warmup_steps, tolerance=tolerance, memory_budget=memory_budget_bytes,
            safety_margin=safety_margin, curriculum=curriculum, warmup_steps_after_change=warmup_steps_after_change,
            trace_lengths=trace_lengths, measure_every_n_steps=measure_every_n_steps, mitigations=mitigations)
        self.settings = PlannerSettings(config, RunFacts.of(config, compare_reserved=compare_reserved, block_bytes=block_bytes,
                                                            precision=precision, dry_run=dry_run))
        self.ladder = LadderState(config.mitigations)  # the rungs left to this run
        self.reset()

    def reset(self) -> None:
        """Everything a run accumulates (what :meth:`state_dict` saves), as before the first step: fresh
        parts (the settings and the rungs left to the run stay)."""
        self.advice = AdviceQueue()
        self.ladder = LadderState(self.ladder.allowed)
        self.course = CurriculumState(self.curriculum)
        self.evidence = Evidence(self.settings, self.ladder, self.advice)
        self.schedule = MeasurementSchedule()  # which batches are warm-ups, measured, traced
        self.step = 0
        self._cache: dict[str, Any] = {}  # the budget view (lightning_seqmem.plan.metrics)

    def set_length_limit(self, limit: Optional[int], reason: str = "") -> None:
        """The model's longest sequence (``limit`` tokens, from ``reason``): no length past it is
        dry-run, forecast or proposed; curriculum stages past it are dropped (the last stage becomes
        the limit rounded down to ``multiple_of``), said once.

        Example:
            >>> p = SeqMemPlanner(curriculum=Curriculum(start=64, target=1024, multiple_of=64))
            >>> p.set_length_limit(300, "config.max_position_embeddings=300")
            >>> p.stages, p.within_limit(300), p.within_limit(301), p.take_advice()[0].kind
            ((64, 128, 256), True, False, 'length_limit')
        """
        self.bind_run(length_limit=None if limit is None else int(limit), length_limit_reason=reason)
        if self.length_limit is None:
            return
        dropped = self.course.drop_past(self.length_limit)
        if dropped:
            self.advise(A.length_limit(self.length_limit, reason, dropped, self.stages[-1]))

    # ------------------------------------------------------------------------------------------
    # Decisions (lightning_seqmem.plan.decisions, lightning_seqmem.plan.curriculum_state)
    # ------------------------------------------------------------------------------------------
    def decide(self, shape: tuple[int, int], applicable: Applicability) -> Decision:
        """What to do before a batch whose full shape is ``(batch_size, seq_len)``.

        ``applicable`` maps each rung not on yet to ``(applies, reason)`` for this model and batch
        (under DDP: applies on every rank). Pure: the state changes only in :meth:`commit`.
        """
        batch_size, seq_len = int(shape[0]), int(shape[1])
        self._longest_seen = max(self._longest_seen, seq_len)  # (a cache: a length the data has)
        if self.curriculum is None:
            return decisions.decide_free(self, seq_len, batch_size, applicable)
        return decide_curriculum(self, seq_len, batch_size, applicable)

    def _plan(self, seq_len: int, batch_size: int, applicable: Applicability) -> Any:
        """:func:`lightning_seqmem.plan.decisions.choose_setting` (the fastest setting that fits)."""
        return decisions.choose_setting(self, seq_len, batch_size, applicable)

    def price(self, setting: Optional[Sequence[str]], seq_len: int, batch_size: int) -> pricing.Price:
        """The predicted cost of one step with ``setting`` (default: the one on) at ``(seq_len,
        batch_size)``, from the measured step times (:func:`~lightning_seqmem.plan.pricing.predict_step`)."""
        key = self.applied_mitigations if setting is None else tuple(setting)
        return pricing.predict_step(self.records, key, int(seq_len), int(batch_size), self.device_type)

    def commit(self, decision: Decision) -> None:
        """Take ``decision`` (every rank, the same one). A rung is recorded in :meth:`rung_applied`."""
        self.course.commit(decision)
        for item in decision.advice:
            self.advise(item)

    # ------------------------------------------------------------------------------------------
    # Rungs (lightning_seqmem.plan.ladder_state)
    # ------------------------------------------------------------------------------------------
    def before_rung(self, name: str, seq_len: int, batch_size: int) -> None:
        """Called just before ``name`` is switched on: dry runs of the setting now on that only
        this moment allows (a copy cannot undo a rung), for the check after the attention switch."""
        self.evidence.dry_before_rung(name, seq_len, batch_size)

    def rung_applied(self, name: str, ok: bool, detail: str, seq_len: Optional[int], batch_size: Optional[int] = None) -> None:
        """A rung ``decide`` asked for was switched on (``ok``) on every rank, or on none; ``seq_len``
        and ``batch_size``: where it was decided (the peak before is the measured one there, else
        the dry run's)."""
        if not ok:
            self.ladder.failed(name)
            self.course.replan()
            self.advise(A.mitigation_failed(name, detail))
            return
        before, method = self.evidence.peak_before(seq_len, batch_size)
        self.ladder.switched_on(name, self.step, seq_len, batch_size, detail, before, method)
        self.forecaster  # noqa: B018 - a fresh fit for the new setting

    def rung_removed(self, name: str, why: str, pending: Optional[PendingStep] = None) -> None:
        """A rung that was on is off again (every rank): it is not tried again this run; ``pending``,
        the step that found out, ran without it."""
        if pending is not None:
            pending.mitigations = tuple(m for m in pending.mitigations if m != name)
        self.ladder.removed(name, why)
        self.course.replan()
        self.advise(A.mitigation_failed(name, why))

    def restart(self, allowed: Sequence[str], still_on: Sequence[str] = ()) -> None:
        """A fresh run (:meth:`reset`) that may use the rungs ``allowed``, with ``still_on`` on already
        (found on the module: never reported as off), fitted as a setting of its own."""
        self.reset()
        self.ladder.allow(allowed)
        self.ladder.keep_on(still_on)
        self.forecaster  # noqa: B018 - that setting's own (empty) fit

    def note_not_applicable(self, applicability: Applicability) -> None:
        """The last check of the rungs not on (``rung -> (applies, why)``): why those that do not apply
        here do not (reported, never advised)."""
        self.ladder.note_not_applicable(applicability)

    def drop_mitigations(self, names: Sequence[str], why: str) -> None:
        """Rungs this run cannot take (set-up): off for the run, said once."""
        if names:
            self.ladder.drop(names)
            self.advise(A.mitigations_dropped(names, why))

    # ------------------------------------------------------------------------------------------
    # Measurement (lightning_seqmem.plan.schedule, lightning_seqmem.plan.verification)
    # ------------------------------------------------------------------------------------------
    def begin_step(self, seq_len: int, batch_size: int, optimizer_steps: bool = True, global_step: int = 0,
                   epoch: int = 0) -> PendingStep:
        """The schedule for a batch about to run at ``(seq_len, batch_size)``: warm-up, measured, traced."""
        key = (seq_len, batch_size, self.applied_mitigations)
        warmup, measure, count = self.schedule.next(key, self.step, self.warmup_steps, self.warmup_steps_after_change,
                                                    self.measure_every_n_steps, global_step, self.evidence.covered(*key))
        if count == 0:  # kept to verify against the measurement
            self.evidence.keep_forecast(seq_len, batch_size)
        # only steps ending in an optimizer step are traced: with accumulation the others run another program
        traced = measure and not warmup and optimizer_steps and self.forecaster.wants_trace(seq_len, batch_size, self.trace_lengths)
        events = self.ladder.take_pending_events()
        return PendingStep(self.step, global_step, epoch, seq_len, batch_size, warmup, measure, traced,
                           self.stage if self.stages else None, self.applied_mitigations, events,
                           optimizer_steps=bool(optimizer_steps))

    def end_batch(self, at_stage_length: bool = True) -> None:
        """A batch finished (measured or not). Only a batch that ran at the length it was cut to
        (``at_stage_length``) counts towards the stage's ``steps_per_stage``: where the data is
        shorter than the stage, or the batch could not be cut, the curriculum holds."""
        self.step += 1
        self.stage_steps += 1 if at_stage_length else 0

    def observe(self, pending: PendingStep, memory: StepMemory, seq_len: Optional[int] = None,
                batch_size: Optional[int] = None, trace: Optional[tuple[int, int, StepMemory]] = None,
                rank: Optional[int] = None, step_seconds: Optional[float] = None) -> StepRecord:
        """Record a measured step, fit, verify; returns the record
        (:func:`lightning_seqmem.plan.verification.observe`)."""
        return self.evidence.observe(pending, memory, seq_len, batch_size, trace, rank, step_seconds)

    # ------------------------------------------------------------------------------------------
    # Metrics (lightning_seqmem.plan.metrics) and checkpointing (lightning_seqmem.plan.planner_state)
    # ------------------------------------------------------------------------------------------
    def budget_view(self, batch_size: int) -> dict[str, float]:
        """Forecast for the next stage (or this length), largest length that fits, headroom (cached;
        :func:`lightning_seqmem.plan.metrics.budget_view`)."""
        return plan_metrics.budget_view(self, batch_size)

    def metrics(self, record: StepRecord) -> dict[str, float]:
        """The logged scalars of ``record`` (:func:`lightning_seqmem.plan.metrics.metrics`)."""
        return plan_metrics.metrics(self, record)

    def state_dict(self) -> dict[str, Any]:
        """Flat plain values (:func:`lightning_seqmem.plan.planner_state.planner_state`)."""
        return planner_state(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`, all or nothing (raises on a state this version cannot read)."""
        load_planner_state(self, state)


__all__ = ["Decision", "PendingStep", "SeqMemPlanner", "Verdict", "quadratic_terms"]
