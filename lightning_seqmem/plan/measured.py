"""``MeasuredEvidence``: the steps that ran, the fits through them and the trust in each predictor.

It owns the records, one :class:`~lightning_seqmem.core.forecast.MemoryForecaster` per setting,
the forecasts kept to verify and the checks of every predictor
(:class:`~lightning_seqmem.core.trust.PredictorChecks`). It never asks the dry run (the dry-run
evidence reads it, not the reverse).

Example:
    >>> from lightning_seqmem.core.records import StepRecord
    >>> from lightning_seqmem.plan.advice_queue import AdviceQueue
    >>> from lightning_seqmem.plan.settings import PlannerSettings
    >>> m = MeasuredEvidence(PlannerSettings(budget_bytes=10**6, safety_margin=0.0), AdviceQueue())
    >>> m.records.append(StepRecord(step=1, global_step=1, epoch=0, seq_len=64, batch_size=2,
    ...                             warmup=False, traced=False, peak_bytes=4000,
    ...                             forward_peak_bytes=4000, backward_peak_bytes=None,
    ...                             optimizer_peak_bytes=None, start_bytes=1000))
    >>> m.held_bytes(), m.covered(32, 2, ()), m.covered(128, 2, ())
    (1000, True, False)
    >>> m.one_point_bound(128, 2, ())   # 1000 held + 3000 grown by (128/64)² = 13000, +2%
    (13260, 13000)
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Iterable, Mapping, Optional

from lightning_seqmem.core.checks import check_int
from lightning_seqmem.core.forecast import Forecast, MemoryForecaster, NotEnoughMeasurements
from lightning_seqmem.core.quadratic import UNBOUNDED_SEQ_LEN
from lightning_seqmem.core.records import StepRecord
from lightning_seqmem.core.trust import PredictorChecks
from lightning_seqmem.plan.advice_queue import AdviceQueue
from lightning_seqmem.plan.checkpoint import compact_records
from lightning_seqmem.plan.judging import DRY_RUN_MARGIN
from lightning_seqmem.plan.settings import PlannerSettings

__all__ = ["MeasuredEvidence", "ONE_POINT_MARGIN"]

Setting = tuple[str, ...]
ONE_POINT_MARGIN = 0.02  # on top of the one-point bound, as the replay's margin


class MeasuredEvidence:
    """Records, fits, kept forecasts and predictor checks (see the module doc)."""

    def __init__(self, settings: PlannerSettings, advice: AdviceQueue) -> None:
        self.settings, self.advice = settings, advice
        self.records: list[StepRecord] = []
        self.forecasters: dict[Setting, MemoryForecaster] = {(): self.new_forecaster()}
        self.last_batch_size: Optional[int] = None
        self.last_verification_error: Optional[float] = None
        self.kept: dict[tuple, Forecast] = {}  # to verify against the step at that shape
        self.checks = PredictorChecks(settings.tolerance)  # each predictor vs steps (not saved)
        self.checked: set[tuple] = set()  # steps whose predictors were checked, with fits' version
        self.replay_checks: dict[Setting, dict[str, Any]] = {}  # replay vs dry run at the target

    def new_forecaster(self) -> MemoryForecaster:
        return MemoryForecaster(tolerance=self.settings.tolerance)

    def forecaster_of(self, setting: Setting) -> MemoryForecaster:
        """The fit of ``setting`` (made empty where it has none yet)."""
        return self.forecasters.setdefault(tuple(setting), self.new_forecaster())

    def bound(self, r: StepRecord) -> int:
        """What a measured step compares with the budget: reserved bytes on CUDA, else the peak."""
        return (r.reserved_bytes if self.settings.compare_reserved and r.reserved_bytes is not None
                else r.peak_bytes)

    def batch_size_or_last(self, batch_size: Optional[int]) -> int:
        """``batch_size`` checked, or, where None, the last measured one (raises before any)."""
        if batch_size is None:
            if self.last_batch_size is None:
                raise NotEnoughMeasurements("no batch measured yet: pass `batch_size`")
            return self.last_batch_size
        return check_int("batch_size", batch_size)

    def kept_forecast(self, seq_len: int, batch_size: int,
                      mitigations: Iterable[str]) -> Optional[Forecast]:
        """The forecast kept at the first step of ``(seq_len, batch_size, mitigations)`` to verify
        it against its measurement, while that step is not verified yet; else None.

        >>> from lightning_seqmem.plan.planner import SeqMemPlanner
        >>> run = lambda L, B, m: (100 * L * B, {"forward": 100 * L * B})
        >>> p = SeqMemPlanner(dry_runner=run)
        >>> dry, m = p.evidence.dry, p.evidence.measured
        >>> dry.any_answered(), dry.peak(64, 2)[0], dry.any_answered()
        (False, 12800, True)
        >>> s = p.begin_step(64, 2)   # the first step at this shape: the dry forecast kept
        >>> m.kept_forecast(64, 2, ()).method, m.kept_forecast(128, 2, ())
        ('dry_run', None)
        """
        return self.kept.get((int(seq_len), int(batch_size), tuple(mitigations)))

    def held_bytes(self) -> int:
        """What the latest measured step after the first began with (parameters, gradients,
        optimizer state, the batch): a floor of every later peak that no rung lowers (0: none)."""
        for r in reversed(self.records):
            if r.step > 0 and r.start_bytes:
                return int(r.start_bytes)
        return 0

    def covered(self, seq_len: int, batch_size: int, setting: Setting) -> bool:
        """Whether a measured step at a shape not shorter and not smaller, with ``setting``, stayed
        within the usable budget, so bounds ``(seq_len, batch_size)`` (see :mod:`.schedule`). Never
        under a curriculum: its shorter lengths (probes, re-measurements) run to be measured."""
        if self.settings.curriculum is not None:
            return False
        usable = self.settings.usable_budget_bytes
        return any(r.seq_len >= seq_len and r.batch_size >= batch_size and r.mitigations == setting
                   and (usable is None or self.bound(r) <= usable) for r in self.records)

    def memory_added(self, before: Setting, after: Setting, at: Optional[tuple[int, int]] = None,
                     records: Optional[Iterable[StepRecord]] = None
                     ) -> Optional[tuple[int, int, int, int]]:
        """Where a fitted step under ``after`` peaked above those of the same shape under ``before``
        (e.g. a fused loss on a small vocabulary), as ``(seq_len, batch_size, before_bytes,
        after_bytes)`` at the largest rise, or None. ``at``: only that shape; ``records``: these."""
        peaks: dict[tuple[int, int, Setting], int] = {}
        for r in self.records if records is None else records:
            if (not r.warmup and r.mitigations in (before, after)
                    and (at is None or (r.seq_len, r.batch_size) == at)):
                key = (r.seq_len, r.batch_size, r.mitigations)
                peaks[key] = max(peaks.get(key, 0), self.bound(r))
        rises = [(peaks[(L, B, after)] / max(peak, 1), (L, B, peak, peaks[(L, B, after)]))
                 for (L, B, m), peak in peaks.items()
                 if m == before and peaks.get((L, B, after), -1) > peak]
        return max(rises)[1] if rises else None

    def bounding_setting(self, on: Setting) -> Optional[Setting]:
        """The setting before the last rung of ``on`` whose forecast bounds ``on`` (its fit is
        ready, and no shape measured under both peaked higher with the rungs since), or None."""
        for n in range(len(on) - 1, -1, -1):
            earlier = self.forecasters.get(on[:n])
            if earlier is not None and earlier.ready:
                return None if self.memory_added(on[:n], on) is not None else on[:n]
        return None

    def one_point_bound(self, seq_len: int, batch_size: int,
                        on: Setting) -> Optional[tuple[int, int]]:
        """(bound, peak) from ``on``'s fitted step nearest below ``seq_len`` (any length if none is
        shorter), assuming activations at most quadratic in L and linear in B."""
        same = [r for r in self.records if not r.warmup and r.mitigations == on]
        if not same:
            return None
        shorter = [r for r in same if r.seq_len <= seq_len] or same
        r = max(shorter, key=lambda r: (r.seq_len, r.peak_bytes))
        dynamic = max(r.peak_bytes - r.start_bytes, 0)
        scale = max(1.0, (seq_len / r.seq_len) ** 2) * max(1.0, batch_size / r.batch_size)
        peak = int(r.start_bytes + dynamic * scale)
        ratio = self.forecaster_of(on).reserved_ratio if self.settings.compare_reserved else 1.0
        return int(peak * (1 + ONE_POINT_MARGIN) * ratio), peak

    def fit_now(self, batch_size: int, on: Setting) -> int:
        """Largest length forecast to fit the usable budget with ``on`` (the fit of ``on``, else of
        the setting before its last rungs); before any fit, :meth:`longest_within`."""
        budget = self.settings.usable_budget_bytes
        if budget is None:
            return UNBOUNDED_SEQ_LEN
        for n in range(len(on), -1, -1):
            forecaster = self.forecasters.get(on[:n])
            if forecaster is not None and forecaster.ready:
                return forecaster.max_seq_len(budget, batch_size,
                                              reserved=self.settings.compare_reserved)
        return self.longest_within(budget, batch_size, on)

    def longest_within(self, budget_bytes: int, batch_size: int, on: Setting,
                       fitted_only: bool = False) -> int:
        """The longest length measured within ``budget_bytes`` with ``on`` at this batch size or
        larger (``fitted_only``: warm-up steps apart), 0 if none."""
        return max((r.seq_len for r in self.records
                    if r.mitigations == on and not (fitted_only and r.warmup)
                    and r.batch_size >= batch_size and self.bound(r) <= budget_bytes), default=0)

    def dry_margin(self) -> float:
        """The dry run's margin: :data:`~lightning_seqmem.plan.judging.DRY_RUN_MARGIN` (2%),
        widened by its largest measured under-prediction."""
        misses = [v.measured_bytes / max(v.forecast_bytes, 1) - 1 for f in self.forecasters.values()
                  for v in f.verifications if v.method == "dry_run"]
        return max([DRY_RUN_MARGIN] + misses)

    def state_dict(self) -> dict[str, Any]:
        """The records (bounded: :func:`~lightning_seqmem.plan.checkpoint.compact_records`), the
        fits, the forecasts kept to verify, the last batch size and verification error."""
        kept = compact_records(self.records, self.settings.checkpoint_records, self.bound)
        return {
            "records": [r.to_dict() for r in kept],
            "forecasters": {"|".join(k): f.state_dict() for k, f in self.forecasters.items()},
            "last_batch_size": self.last_batch_size,
            "last_verification_error": self.last_verification_error,
            "pending": {"x".join(map(str, k[:2])) + "".join(f"|{m}" for m in k[2]): asdict(v)
                        for k, v in self.kept.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.records = [StepRecord.from_dict(r) for r in state.get("records", [])]
        self.forecasters = {}
        for key, value in state.get("forecasters", {"": state.get("forecaster", {})}).items():
            forecaster = self.new_forecaster()
            forecaster.load_state_dict(value)
            self.forecasters[tuple(key.split("|")) if key else ()] = forecaster
        self.last_batch_size = state.get("last_batch_size")
        self.last_verification_error = state.get("last_verification_error")
        self.kept = {}
        for key, fc in state.get("pending", {}).items():
            shape, *mitigations = key.split("|")
            L, B = (int(x) for x in shape.split("x"))
            self.kept[(L, B, tuple(mitigations))] = Forecast(**fc)
