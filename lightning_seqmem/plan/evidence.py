"""``Evidence``: what the planner knows about memory, and how it answers for a shape.

Three parts, each the one writer of its state: ``measured`` (:mod:`.measured`: records, fits,
trust), ``dry`` (:mod:`.dry_evidence`: the dry-run cache and forecasts) and ``verification``
(:mod:`.verification`: a measured step taken in, every forecast checked). It answers from them: a
verdict (:meth:`judge`), a forecast, the largest length that fits, a setting's price.

Example:
    >>> from lightning_seqmem.plan.advice_queue import AdviceQueue
    >>> from lightning_seqmem.plan.ladder_state import LadderState
    >>> from lightning_seqmem.plan.settings import PlannerSettings
    >>> dry_runner = lambda L, B, m: (100 * L * B, {"forward": 100 * L * B})
    >>> ev = Evidence(PlannerSettings(budget_bytes=10**6, dry_runner=dry_runner),
    ...               LadderState(()), AdviceQueue())
    >>> ev.dry.peak(256, 4)[0], ev.forecast(256, 4).method
    (102400, 'dry_run')
    >>> ev.judge(256, 4).kind, ev.judge(4096, 4).kind
    ('fits', 'over')
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Optional, Sequence

from lightning_seqmem.core.checks import check_int
from lightning_seqmem.core.forecast import Forecast, MemoryForecaster, NotEnoughMeasurements
from lightning_seqmem.core.rungs import check_setting
from lightning_seqmem.core.units import to_gib
from lightning_seqmem.plan import judging, pricing
from lightning_seqmem.plan.advice_queue import AdviceQueue
from lightning_seqmem.plan.dry_evidence import DryEvidence
from lightning_seqmem.plan.ladder_state import LadderState
from lightning_seqmem.plan.measured import MeasuredEvidence
from lightning_seqmem.plan.settings import SETTING_NAMES, PlannerSettings, setting_write_error
from lightning_seqmem.plan.verification import Verification

__all__ = ["Evidence"]


class Evidence:
    """The measured and the dry-run evidence, and the answers drawn from both (see module doc)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SETTING_NAMES:  # the settings are read through ``settings``, never copied here
            raise setting_write_error("Evidence", name)
        super().__setattr__(name, value)

    def __init__(self, settings: PlannerSettings, ladder: LadderState, advice: AdviceQueue) -> None:
        self.settings, self.ladder, self.advice = settings, ladder, advice
        self.measured = MeasuredEvidence(settings, advice)
        self.dry = DryEvidence(settings, ladder, self.measured)
        self.verification = Verification(settings, ladder, advice, self.measured, self.dry)
        self._view: tuple[tuple, dict[str, float]] = ((), {})  # the budget view, by its key

    @property
    def forecaster(self) -> MemoryForecaster:
        """The fit of the mitigations on now (each setting has its own)."""
        return self.measured.forecaster_of(self.ladder.applied)

    def bound_of(self, fc: Forecast) -> int:
        """What to compare with the budget (:meth:`.settings.PlannerSettings.bound_of`)."""
        return self.settings.bound_of(fc)

    def judge(self, seq_len: int, batch_size: int,
              mitigations: Optional[Sequence[str]] = None) -> judging.Verdict:
        """Whether a batch at ``(seq_len, batch_size)`` with ``mitigations`` (default: those on)
        fits the usable budget (:func:`~lightning_seqmem.plan.judging.judge`); a set of rungs
        other than those on is judged by its dry run alone.

        >>> from lightning_seqmem.plan.planner import SeqMemPlanner
        >>> SeqMemPlanner().evidence.judge(4096, 8)   # no budget: everything fits
        Verdict(kind='fits', bound_bytes=None, peak_bytes=None, method='', measured=False)
        """
        budget, on = self.settings.usable_budget_bytes, self.ladder.applied

        def dry(mitigations: Optional[Sequence[str]] = None) -> Optional[tuple[int, int]]:
            fc = self.dry.judged(seq_len, batch_size, mitigations)
            return None if fc is None else (self.bound_of(fc), fc.peak_bytes)

        if mitigations is not None and tuple(mitigations) != on:
            return judging.judge(budget, [], lambda: dry(mitigations), list)
        here = [(self.measured.bound(r), r.peak_bytes, r.warmup) for r in self.measured.records
                if (r.seq_len, r.batch_size, r.mitigations) == (seq_len, batch_size, on)]
        return judging.judge(budget, here, dry, lambda: self._bounds(seq_len, batch_size))

    def _bounds(self, seq_len: int, batch_size: int) -> list[tuple[int, int, str]]:
        """The upper bounds of the setting on without a dry run: its fit, the fit of the setting
        before its last rung (unless a step showed that rung adds memory), the one-point bound."""
        bounds: list[tuple[int, int, str]] = []
        if self.forecaster.ready:
            fc = self.forecaster.forecast(seq_len, batch_size)
            bounds.append((self.bound_of(fc), fc.peak_bytes, fc.method))
        earlier = self.measured.bounding_setting(self.ladder.applied)
        if earlier is not None:
            fc = self.measured.forecasters[earlier].forecast(seq_len, batch_size)
            bounds.append((self.bound_of(fc), fc.peak_bytes, "previous setting"))
        one_point = self.measured.one_point_bound(seq_len, batch_size, self.ladder.applied)
        if one_point is not None:
            bounds.append((*one_point, "one-point bound"))
        return bounds

    def fit_now(self, batch_size: int) -> int:
        """Largest length the setting on fits (:meth:`.measured.MeasuredEvidence.fit_now`)."""
        return self.measured.fit_now(batch_size, self.ladder.applied)

    def price(self, setting: Optional[Sequence[str]], seq_len: int,
              batch_size: int) -> pricing.Price:
        """The predicted cost of one step with ``setting`` (default: the one on) at ``(seq_len,
        batch_size)`` (:func:`~lightning_seqmem.plan.pricing.predict_step`)."""
        key = self.ladder.applied if setting is None else tuple(setting)
        return pricing.predict_step(self.measured.records, key, int(seq_len), int(batch_size),
                                    self.settings.device_type, self.settings.rung_specs)

    def forecast(self, seq_len: int, batch_size: Optional[int] = None,
                 mitigations: Optional[Sequence[str]] = None) -> Forecast:
        """The forecast at ``(seq_len, batch_size)`` with ``mitigations`` (defaults: the last
        measured batch size, the rungs on now): the dry run's where it answers and is trusted, else
        the fit's. Raises :class:`NotEnoughMeasurements` before that setting has two lengths."""
        check_int("seq_len", seq_len)
        limit = self.settings.length_limit
        if not self.settings.within_limit(seq_len):
            raise ValueError(f"`seq_len`={seq_len} is past this model's limit of {limit} tokens "
                             f"({self.settings.length_limit_reason}): pass a length up to {limit}")
        key = self.ladder.applied if mitigations is None else check_setting(mitigations)
        self.verification.check_dry_once(key)
        B = self.measured.batch_size_or_last(batch_size)
        dry = self.dry.forecast(seq_len, B, key)
        if dry is not None:
            return dry
        fatal = self.dry.fatal.get((int(seq_len), B, key))
        if fatal is not None:  # no predictor's figure may stand for this setting, or this length
            raise ValueError(f"no forecast at seq_len={seq_len} with mitigations {list(key)}: "
                             f"{fatal}")
        why = self.dry.why_not(seq_len, B, key)
        forecaster = self.measured.forecasters.get(key)
        if forecaster is None:
            raise NotEnoughMeasurements(f"nothing measured with mitigations {list(key)}; measured: "
                                        f"{[list(k) for k in self.measured.forecasters]}; {why}")
        fc = forecaster.forecast(seq_len, B)
        return replace(fc, detail=f"{fc.detail}; {why}")

    def max_seq_len(self, budget_bytes: Optional[int] = None,
                    batch_size: Optional[int] = None) -> int:
        """Largest length whose forecast bound fits ``budget_bytes`` (default: the usable budget)
        with the rungs on now. Before this setting has a fit: by dry run, else from what is known
        (the setting before the last rung, else the longest length measured within; 0 if none)."""
        if budget_bytes is None:
            budget_bytes = self.settings.usable_budget_bytes
            if budget_bytes is None:
                raise ValueError("no memory budget: pass `budget_bytes` or set "
                                 "SeqMemCallback(memory_budget=...)")
        batch_size = self.measured.batch_size_or_last(batch_size)
        within = self.settings.clip_to_limit  # never past the model's limit
        reserved = self.settings.compare_reserved
        if self.forecaster.ready:
            return within(self.forecaster.max_seq_len(budget_bytes, batch_size, reserved=reserved))
        if self.dry.answered(batch_size) or self.dry.forecast(1, batch_size) is not None:
            return self.dry.max_seq_len(budget_bytes, batch_size)
        # the setting before the last rung bounds this one unless a step showed the rung adds memory
        earlier = self.measured.bounding_setting(self.ladder.applied)
        if earlier is not None:
            return within(self.measured.forecasters[earlier].max_seq_len(budget_bytes, batch_size,
                                                                         reserved=reserved))
        return self.measured.longest_within(budget_bytes, batch_size, self.ladder.applied,
                                            fitted_only=True)

    def budget_view(self, target: Optional[int], batch_size: int) -> dict[str, float]:
        """The logged budget view at ``target`` (the next stage; None: the last length measured), in
        GiB: the forecast bound and, with a budget, the usable budget, the largest length that
        fits and the headroom; empty where nothing forecasts it. Cached until its inputs change."""
        key = (self.ladder.applied, self.forecaster.version, target, batch_size)
        if self._view[0] == key:
            return self._view[1]
        out: dict[str, float] = {}
        records = self.measured.records
        target = target or (records[-1].seq_len if records else None)
        # the fit of the setting on now; before it has two lengths, the dry run (when there is one)
        fc = None if not target else (self.forecaster.forecast(target, batch_size)
                                      if self.forecaster.ready
                                      else self.dry.judged(target, batch_size))
        if fc is not None:
            bound = self.bound_of(fc)
            out["forecast_next_gib"] = to_gib(bound)
            budget = self.settings.usable_budget_bytes
            if budget is not None:
                out["budget_gib"] = to_gib(budget)
                out["max_seq_len"] = float(self.max_seq_len(budget, batch_size))
                out["headroom_gib"] = to_gib(budget - bound)
                out["headroom_fraction"] = (budget - bound) / budget
        self._view = (key, out)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The measured evidence's state (the dry runs are not saved: redone after a resume)."""
        return self.measured.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (the ladder loaded first: the setting on gets its fit)."""
        self.measured.load_state_dict(state)
        self.forecaster  # noqa: B018
