"""``Verification``: a measured step taken in, and every forecast checked against it.

:meth:`Verification.observe` records a measured step, checks each predictor against it before
the step joins any fit (:mod:`lightning_seqmem.core.trust`), fits, checks the replay against the
dry run, verifies the forecast kept for that shape and fills the measured effect of the last rung.

Example:
    >>> from lightning_seqmem.core.records import StepMemory
    >>> from lightning_seqmem.plan.planner import SeqMemPlanner
    >>> p = SeqMemPlanner(warmup_steps=0, warmup_steps_after_change=0,
    ...                   dry_runner=lambda L, B, m: (1000 * L, {"forward": 1000 * L}))
    >>> p.evidence.dry.peak(64, 2)[0]
    64000
    >>> s = p.begin_step(64, 2, global_step=0)
    >>> r = p.observe(s, StepMemory(2000 * 64, {"forward": 2000 * 64}, 0, 2000 * 64))
    >>> p.advice.take_advice()[-1].kind, r.forecast_method, r.forecast_error   # dry run said half
    ('predictor_wrong', 'dry_run', -0.5)
"""

from __future__ import annotations

import itertools
from typing import Optional

from lightning_seqmem.core import advice as A
from lightning_seqmem.core.events import MitigationEvent
from lightning_seqmem.core.forecast import Forecast, MemoryForecaster, NotEnoughMeasurements
from lightning_seqmem.core.records import PHASES, StepMemory, StepRecord
from lightning_seqmem.core.rungs import base_name
from lightning_seqmem.core.timeline import Trace
from lightning_seqmem.core.trust import Check
from lightning_seqmem.plan import choose
from lightning_seqmem.plan.advice_queue import AdviceQueue
from lightning_seqmem.plan.checkpoint import compact_records
from lightning_seqmem.plan.dry_evidence import DryEvidence
from lightning_seqmem.plan.ladder_state import LadderState
from lightning_seqmem.plan.measured import MeasuredEvidence
from lightning_seqmem.plan.quadratic_check import quadratic_terms
from lightning_seqmem.plan.schedule import PendingStep
from lightning_seqmem.plan.settings import PlannerSettings

ADDED_MEMORY_FRACTION = 0.005
"""A rung is said to add memory (``rung_added_memory``) past this rise of the peak at one shape: the
reserved memory of CUDA steps of one shape differs by a block or two. The judge stops taking the
setting before it as a bound at any rise (:meth:`.measured.MeasuredEvidence.bounding_setting`)."""

__all__ = ["ADDED_MEMORY_FRACTION", "Verification"]


class Verification:
    """Measured steps in, every forecast verified (see the module doc)."""

    def __init__(self, settings: PlannerSettings, ladder: LadderState, advice: AdviceQueue,
                 measured: MeasuredEvidence, dry: DryEvidence) -> None:
        (self.settings, self.ladder, self.advice,
         self.measured, self.dry) = settings, ladder, advice, measured, dry

    @property
    def fit_on(self) -> MemoryForecaster:
        """The fit of the rungs on now."""
        return self.measured.forecaster_of(self.ladder.applied)

    def keep_forecast(self, seq_len: int, batch_size: int) -> None:
        """Keep the forecast at ``(seq_len, batch_size)`` with the rungs on now (the dry run's where
        it answered, else the fit's) to verify against the step that runs there."""
        key = (seq_len, batch_size, self.ladder.applied)
        fc = (self.dry.forecast(seq_len, batch_size)
              if self.dry.asked(seq_len, batch_size, key[2]) else None)
        if fc is None and self.fit_on.ready:
            fc = self.fit_on.forecast(seq_len, batch_size)
        if fc is not None:
            self.measured.kept[key] = fc

    def peak_before(self, seq_len: Optional[int],
                    batch_size: Optional[int]) -> tuple[Optional[int], Optional[str]]:
        """``(peak, how)`` with the rungs on now at ``(seq_len, batch_size)``, before a rung goes
        on: the measured peak (``"measured"``), else the dry run's (``"dry_run"``), else Nones."""
        before = max((r.peak_bytes for r in self.measured.records
                      if r.seq_len == seq_len and r.mitigations == self.ladder.applied
                      and (batch_size is None or r.batch_size == batch_size)), default=None)
        method = "measured" if before is not None else None
        answer = (self.dry.answers.get((seq_len, batch_size, self.ladder.applied))
                  if seq_len and batch_size else None)
        if before is None and answer:
            before, method = answer[0], "dry_run"
        return before, method

    def dry_before_rung(self, name: str, seq_len: int, batch_size: int) -> None:
        """Before ``name`` goes on: dry runs of the setting on that only this moment allows (a copy
        cannot undo a rung), for the attention-switch check (:meth:`dry_quadratic_terms`)."""
        if self.settings.spec(name).linearises_attention and self.settings.dry_runner is not None:
            x = max(int(seq_len), 16)
            for k in (1, 2, 3):
                self.dry.peak(k * x, batch_size)

    def observe(self, pending: PendingStep, memory: StepMemory, seq_len: Optional[int] = None,
                batch_size: Optional[int] = None,
                trace: Optional[tuple[int, int, StepMemory]] = None, rank: Optional[int] = None,
                step_seconds: Optional[float] = None, trained: bool = True) -> StepRecord:
        """Record a measured step, fit, verify; returns the record.

        Only a batch that ends an accumulation window (``pending.optimizer_steps``) and was
        ``trained`` (no ``training_step`` that returned None) is fitted and verified. ``memory``:
        under DDP, the rank with the highest peak, whose own ``(seq_len, batch_size)`` are given;
        ``trace``: the ``(seq_len, batch_size, memory)`` whose events are traced (default: the
        same); ``step_seconds``: the step's wall time."""
        L = pending.seq_len if seq_len is None else int(seq_len)
        B = pending.batch_size if batch_size is None else int(batch_size)
        phases = {p: memory.phase_peak_bytes.get(p) for p in PHASES}
        record = StepRecord(
            step=pending.step, global_step=pending.global_step, epoch=pending.epoch, seq_len=L,
            batch_size=B, warmup=pending.warmup, traced=pending.traced,
            peak_bytes=memory.peak_bytes, forward_peak_bytes=phases["forward"],
            backward_peak_bytes=phases["backward"], optimizer_peak_bytes=phases["optimizer"],
            start_bytes=memory.start_bytes, reserved_bytes=memory.reserved_bytes,
            fragmentation_bytes=memory.fragmentation_bytes,
            fragmentation_fraction=memory.fragmentation_fraction,
            inactive_split_bytes=memory.inactive_split_bytes, alloc_retries=memory.alloc_retries,
            num_ooms=memory.num_ooms, stage=pending.stage,
            mitigations=pending.mitigations, events=list(pending.events), rank=rank,
            step_seconds=None if step_seconds is None else float(step_seconds),
        )
        usable = self.settings.usable_budget_bytes
        if record.step == 0 and usable is not None and self.measured.bound(record) > usable:
            assert self.settings.budget_bytes is not None
            self.advice.advise(A.first_step_over_budget(record.start_bytes, record.peak_bytes,
                                                        usable, self.settings.budget_bytes,
                                                        self.settings.safety_margin))
        forecaster = self.measured.forecaster_of(record.mitigations)
        if not record.warmup and pending.optimizer_steps and trained:
            self.measured.last_batch_size = B
            wrong_now = self.check_predictors(record, forecaster)
            forecaster.add_measurement(L, B, {p: v for p, v in phases.items() if v is not None},
                                       memory.reserved_bytes)
            tL, tB, tm = trace if trace is not None else (L, B, memory)
            if pending.traced and tm.events is not None:
                forecaster.add_trace(Trace(tL, tB, tm.events, block_bytes=self.settings.block_bytes,
                                           measured_peak_bytes=tm.peak_bytes))
                self.compare_replay(forecaster, record.mitigations, B)
            fc = self.measured.kept.pop((pending.seq_len, pending.batch_size, pending.mitigations),
                                        None)
            if fc is not None and (fc.seq_len, fc.batch_size) == (L, B):  # for the shape that ran
                self.verify(record, fc, forecaster, quiet=fc.method in wrong_now)
            self.after_mitigation(record)
        once = {base_name(m) for m in record.mitigations if self.settings.spec(m).first_step_check}
        if once and not once & {base_name(m) for r in self.measured.records for m in r.mitigations}:
            # the first step with such a rung (micro-batching) ran its one-time check, which every
            # dry run with the rung so far counted and none after it will: those are dropped, once
            self.dry.forget(once)
            key = (record.seq_len, record.batch_size, record.mitigations)
            if key in self.measured.kept:  # verified against the next (steady) step: forecast so
                fresh = self.dry.forecast(*key)
                if fresh is not None:
                    self.measured.kept[key] = fresh
        self.measured.records.append(record)
        if len(self.measured.records) > self.settings.memory_records:  # bounded in memory too
            self.measured.records = compact_records(
                self.measured.records, self.settings.memory_records // 2, self.measured.bound)
        return record

    def check_dry_once(self, setting: tuple[str, ...]) -> None:
        """Before a dry run answers a query with ``setting`` where it never met a measured step (a
        run without a budget asks it nothing), check it once at the latest measured shape."""
        if self.settings.dry_runner is None or self.measured.checks.count(setting, "dry_run"):
            return
        measured = [r for r in self.measured.records if r.mitigations == setting and not r.warmup]
        if len(measured) < (2 if self.settings.compare_reserved else 1):
            return
        r = measured[-1]
        dry = self.dry.forecast(r.seq_len, r.batch_size, setting, trusted_only=False)
        if dry is not None and self.measured.checks.add(setting, Check(
                "dry_run", r.seq_len, r.batch_size, dry.peak_bytes, r.peak_bytes)):
            c = self.measured.checks.latest[(setting, "dry_run", r.seq_len, r.batch_size)]
            self.advice.advise(A.predictor_wrong(
                r.seq_len, r.batch_size, r.peak_bytes,
                [("dry_run", dry.peak_bytes, c.relative_error)], self.settings.tolerance,
                self.measured.checks.right(setting)))

    def compare_replay(self, forecaster: MemoryForecaster, setting: tuple[str, ...],
                       batch_size: int) -> None:
        """The replay against the dry run at the target length (the curriculum's, else 4× the
        longest traced): a replay off by more than the tolerance is not trusted, said once."""
        if (forecaster.timeline is None or self.settings.dry_runner is None
                or self.measured.checks.wrong(setting, "dry_run") is not None):
            return  # (a dry run that missed measured steps is not the judge of the replay)
        target = (self.settings.curriculum.target if self.settings.curriculum
                  else 4 * max(t.seq_len for t in forecaster.traces))
        target = self.settings.clip_to_limit(target)
        dry = self.dry.peak(target, batch_size, setting)
        if dry is None:
            return
        replay = forecaster.forecast(target, batch_size, method="replay").peak_bytes
        error = (replay - dry[0]) / max(dry[0], 1)
        self.measured.replay_checks[setting] = {"seq_len": target, "batch_size": batch_size,
                                                "replay_bytes": replay, "dry_run_bytes": dry[0],
                                                "relative_error": error}
        if abs(error) > self.settings.tolerance:
            self.advice.advise(A.replay_disagrees(target, batch_size, replay, dry[0], error,
                                                  forecaster.timeline.seq_lens))

    def check_predictors(self, record: StepRecord, forecaster: MemoryForecaster) -> set[str]:
        """Check each predictor that can answer for the shape that ran against its measured peak,
        before this step joins any fit (a miss is said once per predictor and setting). Returns the
        predictors this step found wrong where they were right before."""
        L, B, setting = record.seq_len, record.batch_size, record.mitigations
        seen = (L, B, setting, forecaster.version, self.dry.asked(L, B, setting), record.peak_bytes)
        if seen in self.measured.checked:  # the same step again, the same fits: the same checks
            return set()
        self.measured.checked.add(seen)
        predictions: dict[str, int] = {}
        dry_key = (L, B, setting)
        # asked already (no dry run only to check it); with allocator counters, once this setting
        # has a measured step for the kernel scratch beyond the dry run's tensors (scratch_bytes)
        residual_known = not self.settings.compare_reserved or any(
            r.mitigations == setting and not r.warmup for r in self.measured.records)
        if self.settings.dry_runner is not None and self.dry.asked(*dry_key) and residual_known:
            dry = self.dry.forecast(L, B, setting, trusted_only=False)
            if dry is not None:
                predictions["dry_run"] = dry.peak_bytes
        for method in ("replay", "quadratic"):
            try:
                predictions[method] = forecaster.forecast(L, B, method=method).peak_bytes
            except NotEnoughMeasurements:
                pass
        newly: set[str] = set()
        for method, predicted in predictions.items():
            if self.measured.checks.add(setting, Check(method, L, B, predicted, record.peak_bytes)):
                newly.add(method)
        forecaster.distrusted = {}
        for method in ("replay", "quadratic"):
            wrong = self.measured.checks.wrong(setting, method)
            if wrong is not None:
                forecaster.distrusted[method] = wrong.miss
        # a predictor ranked after one that decides and is right steps aside silently
        said = [m for m in ("dry_run", "replay", "quadratic")
                if m in newly and not self.deciding_before(m, setting, forecaster)]
        if said:
            misses = [(m, predictions[m], self.measured.checks.latest[(setting, m, L, B)]
                       .relative_error) for m in said]
            self.advice.advise(A.predictor_wrong(L, B, record.peak_bytes, misses,
                                                 self.settings.tolerance,
                                                 self.measured.checks.right(setting)))
        return newly

    def deciding_before(self, method: str, setting: tuple[str, ...],
                        forecaster: MemoryForecaster) -> bool:
        """Whether a predictor ranked before ``method`` (dry run, replay, quadratic fit) answers
        and is trusted with ``setting``: then ``method`` was not what decisions used."""
        order = ("dry_run", "replay", "quadratic")
        answers = {"dry_run": (self.settings.dry_runner is not None
                               and self.dry.any_answered(setting)),
                   "replay": forecaster.timeline is not None,
                   "quadratic": forecaster.quadratic is not None}
        return any(answers[m] and self.measured.checks.wrong(setting, m) is None
                   for m in order[:order.index(method)])

    def verify(self, record: StepRecord, fc: Forecast, forecaster: MemoryForecaster,
               quiet: bool = False) -> None:
        v = forecaster.verify(fc, record.peak_bytes)
        record.forecast_peak_bytes, record.forecast_upper_bytes = fc.peak_bytes, fc.upper_bytes
        record.forecast_method, record.forecast_error = fc.method, v.relative_error
        self.measured.last_verification_error = v.relative_error
        if abs(v.relative_error) > self.settings.tolerance and not quiet:  # said by the check
            self.advice.advise(A.forecast_mismatch(record.seq_len, record.batch_size, fc.method,
                                                   fc.peak_bytes, record.peak_bytes,
                                                   v.relative_error, self.settings.tolerance))

    def after_mitigation(self, record: StepRecord) -> None:
        """Fill the measured effect of the last mitigation; warn if attention stayed quadratic."""
        if not self.ladder.events:
            return
        event = self.ladder.events[-1]
        if (event.after_bytes is None and record.seq_len == event.seq_len
                and record.mitigations == self.ladder.applied):
            self.ladder.measured_after(-1, record.peak_bytes)
        if not record.warmup and record.mitigations == self.ladder.applied:
            before = (tuple(event.mitigations_before) if "mitigations_before" in event
                      else self.ladder.applied[:-1])
            rise = self.measured.memory_added(  # (the record is not recorded yet)
                before, self.ladder.applied, at=(record.seq_len, record.batch_size),
                records=itertools.chain(self.measured.records, (record,)))
            # (the bound goes at any rise; said once per rung: the advice's key)
            if rise is not None and rise[3] > rise[2] * (1 + ADDED_MEMORY_FRACTION):
                self.advice.advise(A.rung_added_memory(event.name, *rise))
        if not self.settings.spec(event.name).linearises_attention or event.checked:
            return
        terms = self.dry_quadratic_terms(event, record.batch_size)
        if terms is None and self.fit_on.ready:
            terms = quadratic_terms(self.measured.forecasters.get(self.ladder.applied[:-1]),
                                    self.fit_on)
        if terms is None:
            return
        old_b, new_b = terms
        self.ladder.mark_checked(-1)
        if new_b > 0.5 * old_b:
            self.advice.advise(A.attention_still_quadratic(event.detail, new_b, old_b))

    def dry_quadratic_terms(self, event: MitigationEvent,
                            batch_size: int) -> Optional[tuple[float, float]]:
        """Bytes per token² per sample before and after the rung of ``event``, from dry runs at
        L, 2L, 3L (``p(3L) − 2p(2L) + p(L) = 2bL²`` for ``p = c + aL + bL²``), or None."""
        before = event.mitigations_before
        after = choose.combine(before, (event.name,))
        if after != self.ladder.applied[: len(after)]:
            return None
        x = max(int(event.seq_len or 0), 16)
        out = []
        for setting in (before, after):
            peaks = [self.dry.peak(k * x, batch_size, setting) for k in (1, 2, 3)]
            if any(p is None for p in peaks):
                return None
            p1, p2, p3 = (p[0] for p in peaks)  # type: ignore[index]
            out.append(max(p3 - 2 * p2 + p1, 0) / (2 * x * x * batch_size))
        return out[0], out[1]
