"""``Evidence``: what the planner knows about memory, and how it answers for a shape.

It owns the measured records, one :class:`~lightning_seqmem.core.forecast.MemoryForecaster` per set of
mitigations, the dry-run cache (answers, why one refused, where each peak sits), the forecasts kept
to verify and the trust in each predictor (:class:`~lightning_seqmem.core.trust.PredictorChecks`).
It answers with forecasts (:meth:`Evidence.forecast`, :meth:`Evidence.max_seq_len`, the dry run's
:meth:`Evidence.dry_peak`), judges a shape against the usable budget (:mod:`.judging`) and takes
measured steps in, verifying every forecast (:mod:`.verification`). It reads the rungs on from the
:class:`~lightning_seqmem.plan.ladder_state.LadderState` and the budget, the dry run and the model's
length limit from the :class:`~lightning_seqmem.plan.settings.PlannerSettings`; what it has to say
goes to the :class:`~lightning_seqmem.plan.advice_queue.AdviceQueue`.

Example:
    >>> from lightning_seqmem.plan.advice_queue import AdviceQueue
    >>> from lightning_seqmem.plan.ladder_state import LadderState
    >>> from lightning_seqmem.plan.settings import SETTING_NAMES, PlannerSettings, setting_write_error
    >>> ev = Evidence(PlannerSettings(budget_bytes=10**6, dry_runner=lambda L, B, m: (100 * L * B, {"forward": 100 * L * B})),
    ...               LadderState(()), AdviceQueue())
    >>> ev.dry_peak(256, 4)[0], ev.forecast(256, 4).method, ev.judge(256, 4).kind, ev.judge(4096, 4).kind
    (102400, 'dry_run', 'fits', 'over')
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any, Callable, Mapping, Optional, Sequence

from lightning_seqmem.core.checks import check_int
from lightning_seqmem.core.forecast import Forecast, MemoryForecaster, NotEnoughMeasurements
from lightning_seqmem.core.peak import PeakSite
from lightning_seqmem.core.records import StepMemory, StepRecord
from lightning_seqmem.core.rungs import RungNotApplicable, check_setting
from lightning_seqmem.core.search import bisect_last
from lightning_seqmem.core.trust import PredictorChecks
from lightning_seqmem.plan import dry_evidence, judging, pricing, verification
from lightning_seqmem.plan.checkpoint import compact_records
from lightning_seqmem.plan.advice_queue import AdviceQueue
from lightning_seqmem.plan.ladder_state import LadderState
from lightning_seqmem.plan.schedule import PendingStep
from lightning_seqmem.plan.settings import SETTING_NAMES, PlannerSettings, setting_write_error

__all__ = ["Evidence"]


class Evidence:
    """Records, fits, dry-run answers and the checks of each predictor (see the module doc)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SETTING_NAMES:  # the settings are read through ``settings``, never copied here
            raise setting_write_error("Evidence", name)
        super().__setattr__(name, value)

    def __init__(self, settings: PlannerSettings, ladder: LadderState, advice: AdviceQueue) -> None:
        self.settings, self.ladder, self.advice = settings, ladder, advice
        self.records: list[StepRecord] = []
        self.forecasters: dict[tuple[str, ...], MemoryForecaster] = {(): MemoryForecaster(tolerance=self.settings.tolerance)}
        self.last_batch_size: Optional[int] = None
        self.last_verification_error: Optional[float] = None
        self._pending: dict[tuple, Forecast] = {}  # forecasts kept to verify against the step at that shape
        self._dry: dict[tuple, Optional[tuple[int, dict[str, int]]]] = {}  # dry-run answers (not saved)
        self._dry_why: dict[tuple, str] = {}  # dry-run key -> why it did not answer
        self._dry_sites: dict[tuple, PeakSite] = {}  # dry-run key -> where that step's peak sits, when told
        # dry-run key -> why no figure may stand for it at all: a rung of it does not apply to the
        # model (RungNotApplicable), or the model's own step fails at that shape (fails_at_length)
        self._dry_fatal: dict[tuple, str] = {}
        self._longest_seen = 0  # the longest source length decided on (bounds the dry runs' buckets)
        self.replay_checks: dict[tuple[str, ...], dict[str, Any]] = {}  # replay vs dry run at the target
        self.checks = PredictorChecks(self.settings.tolerance)  # every predictor against the measured steps (not saved)
        self._checked: set[tuple] = set()  # steps whose predictors were checked, with the fits' version
        # (budget, batch size, rungs on, multiple_of, longest) -> the largest length a dry run confirmed to fit
        self._max_seq_len_memo: dict[tuple, int] = {}
        self.view_cache: dict[str, Any] = {}  # the budget view (lightning_seqmem.plan.metrics)

    # judging the budget (lightning_seqmem.plan.judging) and measured steps (.verification)
    def judge(self, seq_len: int, batch_size: int, mitigations: Optional[Sequence[str]] = None) -> judging.Verdict:
        """Whether a batch at ``(seq_len, batch_size)`` with ``mitigations`` (default: those on) fits
        the usable budget (:func:`~lightning_seqmem.plan.judging.judge`)."""
        return judging.judge(self, seq_len, batch_size, mitigations)

    def fit_now(self, batch_size: int) -> int:
        """The largest length the setting on now fits (:func:`~lightning_seqmem.plan.judging.fit_now`)."""
        return judging.fit_now(self, batch_size)

    def covered(self, seq_len: int, batch_size: int, setting: tuple[str, ...]) -> bool:
        """Whether a measured step bounds this shape (:func:`~lightning_seqmem.plan.judging.covered`)."""
        return judging.covered(self, seq_len, batch_size, setting)

    def held_bytes(self) -> int:
        """What every step begins with (:func:`~lightning_seqmem.plan.judging.held_bytes`)."""
        return judging.held_bytes(self)

    def observe(self, pending: PendingStep, memory: StepMemory, seq_len: Optional[int] = None,
                batch_size: Optional[int] = None, trace: Optional[tuple[int, int, StepMemory]] = None,
                rank: Optional[int] = None, step_seconds: Optional[float] = None) -> StepRecord:
        """Record a measured step, fit, verify (:func:`~lightning_seqmem.plan.verification.observe`)."""
        return verification.observe(self, pending, memory, seq_len, batch_size, trace, rank, step_seconds)

    def keep_forecast(self, seq_len: int, batch_size: int) -> None:
        """Keep the forecast at this shape to verify (:func:`~lightning_seqmem.plan.verification.keep_forecast`)."""
        verification.keep_forecast(self, seq_len, batch_size)

    def peak_before(self, seq_len: Optional[int], batch_size: Optional[int]) -> tuple[Optional[int], Optional[str]]:
        """The peak before a rung (:func:`~lightning_seqmem.plan.verification.peak_before`)."""
        return verification.peak_before(self, seq_len, batch_size)

    def dry_before_rung(self, name: str, seq_len: int, batch_size: int) -> None:
        """Dry runs only the moment before a rung allows (:func:`~lightning_seqmem.plan.verification.dry_before_rung`)."""
        verification.dry_before_rung(self, name, seq_len, batch_size)

    def see_length(self, seq_len: int) -> None:
        """A length the data has (bounds the dry runs' buckets)."""
        self._longest_seen = max(self._longest_seen, int(seq_len))

    def price(self, setting: Optional[Sequence[str]], seq_len: int, batch_size: int) -> pricing.Price:
        """The predicted cost of one step with ``setting`` (default: the one on) at ``(seq_len,
        batch_size)``, from the measured step times (:func:`~lightning_seqmem.plan.pricing.predict_step`)."""
        key = self.ladder.applied if setting is None else tuple(setting)
        return pricing.predict_step(self.records, key, int(seq_len), int(batch_size), self.settings.device_type)

    def state_dict(self) -> dict[str, Any]:
        """The records (bounded: :func:`~lightning_seqmem.plan.checkpoint.compact_records`), the fits,
        the forecasts kept to verify, the last batch size and verification error."""
        kept = compact_records(self.records, self.settings.checkpoint_records, self._measured_bound)
        return {
            "records": [r.to_dict() for r in kept],
            "forecasters": {"|".join(k): f.state_dict() for k, f in self.forecasters.items()},
            "last_batch_size": self.last_batch_size,
            "last_verification_error": self.last_verification_error,
            "pending": {"x".join(map(str, k[:2])) + "".join(f"|{m}" for m in k[2]): asdict(v)
                        for k, v in self._pending.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (the ladder's rungs loaded first: the setting on gets its fit)."""
        self.records = [StepRecord.from_dict(r) for r in state.get("records", [])]
        self.forecasters = {}
        for key, value in state.get("forecasters", {"": state.get("forecaster", {})}).items():
            forecaster = MemoryForecaster(tolerance=self.settings.tolerance)
            forecaster.load_state_dict(value)
            self.forecasters[tuple(key.split("|")) if key else ()] = forecaster
        self.forecaster  # noqa: B018
        self.last_batch_size = state.get("last_batch_size")
        self.last_verification_error = state.get("last_verification_error")
        self._pending = {}
        for key, fc in state.get("pending", {}).items():
            shape, *mitigations = key.split("|")
            L, B = (int(x) for x in shape.split("x"))
            self._pending[(L, B, tuple(mitigations))] = Forecast(**fc)

    # forecasts and the dry run
    @property
    def forecaster(self) -> MemoryForecaster:
        """The forecaster of the mitigations on now (each setting has its own fit)."""
        return self.forecasters.setdefault(self.ladder.applied, MemoryForecaster(tolerance=self.settings.tolerance))

    def bound_of(self, fc: Forecast) -> int:
        """What to compare with the budget: the reserved bound on CUDA, the upper bound elsewhere."""
        return fc.reserved_upper_bytes if self.settings.compare_reserved else fc.upper_bytes

    def batch_size_or_last(self, batch_size: Optional[int]) -> int:
        """``batch_size`` checked, or, where None, the last measured one (raises before any)."""
        if batch_size is None:
            if self.last_batch_size is None:
                raise NotEnoughMeasurements("no batch measured yet: pass `batch_size`")
            return self.last_batch_size
        return check_int("batch_size", batch_size)

    def forecast(self, seq_len: int, batch_size: Optional[int] = None, mitigations: Optional[Sequence[str]] = None) -> Forecast:
        """The forecast at ``(seq_len, batch_size)`` with ``mitigations`` (defaults: the last measured
        batch size, the mitigations on now). Raises :class:`NotEnoughMeasurements` before that
        setting has two measured lengths."""
        check_int("seq_len", seq_len)
        if not self.settings.within_limit(seq_len):
            raise ValueError(f"`seq_len`={seq_len} is past this model's limit of {self.settings.length_limit} tokens "
                             f"({self.settings.length_limit_reason}): pass a length up to {self.settings.length_limit}")
        key = self.ladder.applied if mitigations is None else check_setting(mitigations)
        verification.check_dry_once(self, key)
        dry = self.dry_forecast(seq_len, self.batch_size_or_last(batch_size), key)
        if dry is not None:
            return dry
        fatal = self._dry_fatal.get((int(seq_len), self.batch_size_or_last(batch_size), key))
        if fatal is not None:  # no predictor's figure may stand for this setting, or this length
            raise ValueError(f"no forecast at seq_len={seq_len} with mitigations {list(key)}: "
                             f"{fatal}")
        why = self.dry_run_why(seq_len, self.batch_size_or_last(batch_size), key)
        forecaster = self.forecasters.get(key)
        if forecaster is None:
            raise NotEnoughMeasurements(f"nothing measured with mitigations {list(key)}; measured: "
                                        f"{[list(k) for k in self.forecasters]}; {why}")
        fc = forecaster.forecast(seq_len, self.batch_size_or_last(batch_size))
        return replace(fc, detail=f"{fc.detail}; {why}")

    def dry_run_why(self, seq_len: int, batch_size: int, mitigations: Optional[Sequence[str]] = None) -> str:
        """Why the dry run does not answer at ``(seq_len, batch_size)`` (for a forecast's detail)."""
        key = (int(seq_len), int(batch_size), self.ladder.applied if mitigations is None else tuple(mitigations))
        if self.settings.dry_runner is None:
            return "no dry run (dry_run=False, or not rank zero, or before fit)"
        wrong = self.checks.wrong(key[2], "dry_run")
        if wrong is not None:
            return (f"dry run not trusted: it predicted {wrong.relative_error:+.1%} for the step measured at "
                    f"seq_len={wrong.seq_len} (batch {wrong.batch_size})")
        return f"dry run refused: {self._dry_why.get(key, 'no answer')}"

    def max_seq_len(self, budget_bytes: Optional[int] = None, batch_size: Optional[int] = None) -> int:
        """Largest length whose forecast bound fits ``budget_bytes`` (default: the usable budget)
        with the mitigations on now. Before this setting has a fit: by dry run; without one, from
        what is known (the forecast of the setting before the last rung, else the longest length
        measured within the budget; 0 if none): it does not raise after a fit."""
        if budget_bytes is None:
            budget_bytes = self.settings.usable_budget_bytes
            if budget_bytes is None:
                raise ValueError("no memory budget: pass `budget_bytes` or set SeqMemCallback(memory_budget=...)")
        batch_size = self.batch_size_or_last(batch_size)
        limit = (lambda fit: fit) if self.settings.length_limit is None else (lambda fit: min(fit, self.settings.length_limit))
        if self.forecaster.ready:
            return limit(self.forecaster.max_seq_len(budget_bytes, batch_size, reserved=self.settings.compare_reserved))
        if self.dry_answers(batch_size) or self.dry_forecast(1, batch_size) is not None:
            return self._dry_max_seq_len(budget_bytes, batch_size)
        # what is known otherwise (a rung went on at the last steps): the setting before it, whose
        # forecast bounds this one (unless a step showed the rung adds memory here), else the
        # longest length measured within it
        earlier = judging.bounding_setting(self)
        if earlier is not None:
            return limit(self.forecasters[earlier].max_seq_len(budget_bytes, batch_size, reserved=self.settings.compare_reserved))
        return max((r.seq_len for r in self.records if r.mitigations == self.ladder.applied and not r.warmup
                    and r.batch_size >= batch_size and self._measured_bound(r) <= budget_bytes), default=0)

    def _dry_max_seq_len(self, budget_bytes: int, batch_size: int) -> int:
        """A length whose dry-run bound fits, up to 4× the longest length known (with a curriculum, a
        multiple of its ``multiple_of``): the largest the fit through the dry runs cached (and the
        measured steps, where fewer than two lengths were dry-run) guesses to fit, aimed just below
        the budget and confirmed by one dry run at that length
        (:func:`~lightning_seqmem.plan.dry_evidence.confirmed_largest`; a second where the fit redone
        with it says 2% more fits): a lower bound of the largest that a dry run says fits (within
        about 2% of it where the peak is quadratic in the length), where a search to the token took
        four or more. The same answer until a longer length is dry-run and fits."""
        known = [r.seq_len for r in self.records] + ([self.settings.curriculum.target] if self.settings.curriculum else [])
        step = int(self.settings.curriculum.multiple_of) if self.settings.curriculum is not None else 1
        hi = 4 * max(known + [256])
        hi = hi if self.settings.length_limit is None else min(hi, self.settings.length_limit)  # never past the model's positions
        hi -= hi % step

        def fits(L: int) -> bool:
            fc = self.dry_forecast(L, batch_size)
            return fc is not None and self.bound_of(fc) <= budget_bytes

        fitting = [L for L in self.dry_answers(batch_size) if L % step == 0 and L <= hi and fits(L)]  # cached: free
        lo = max(fitting, default=step)
        if not fits(lo):
            return 0 if step == 1 or not fits(1) else bisect_last(fits, 1, lo)
        memo = self._max_seq_len_memo  # the answers confirmed (dry run at each)
        key = (budget_bytes, batch_size, self.ladder.applied, step, hi)
        if memo.get(key) == lo:  # confirmed before, and no longer length dry-run to fit since
            return lo

        def bound(L: int) -> Optional[int]:
            fc = self.dry_forecast(L, batch_size)
            return None if fc is None else self.bound_of(fc)

        dried = {L: bound(L) for L in self.dry_answers(batch_size)}  # cached: free
        known = dict(dried)
        if len(dried) < 2:  # the measured steps too (real peaks, the dry run's margin on them): anchors for the guess
            margin = 1 + self.dry_margin()
            for r in self.records:  # (not the first step: no optimizer state yet)
                if (r.mitigations == self.ladder.applied and r.batch_size == batch_size
                        and r.step >= 1 and r.seq_len not in dried):
                    known[r.seq_len] = max(known.get(r.seq_len, 0), int(self._measured_bound(r) * margin))
            held = self.held_bytes()  # what a step begins with: the peak's floor as the length goes to 0
            if held and int(held * margin) < min((v for v in known.values() if v is not None), default=0):
                known[0] = int(held * margin)  # a third point for the guess (through two, the parabola is p + q·L²: guesses short)
        memo[key] = dry_evidence.confirmed_largest(lo, hi, bound, budget_bytes, known, step)
        return memo[key]

    def _dry_search(self, lo: int, hi: int, unit: int, batch_size: int, setting: tuple[str, ...], budget: int,
                    bound: Optional[Callable[[int], Optional[int]]] = None) -> int:
        """Largest ``x`` in ``[lo, hi]`` whose bound at ``x·unit`` tokens (the dry run's, or ``bound``'s)
        fits ``budget``, given that ``lo`` fits: the dry runs cached narrow it, then guesses from their
        bounds are checked (:func:`~lightning_seqmem.plan.dry_evidence.largest_fitting`)."""
        def dry_bound(x: int) -> Optional[int]:
            fc = self.dry_forecast(x * unit, batch_size, setting)
            return None if fc is None else self.bound_of(fc)

        bound = bound or dry_bound

        known = [L // unit for (L, B, m), v in self._dry.items()
                 if v is not None and B == batch_size and m == setting and L % unit == 0]
        return dry_evidence.largest_fitting(lo, hi, bound, budget, known)

    def _measured_bound(self, r: StepRecord) -> int:
        return r.reserved_bytes if self.settings.compare_reserved and r.reserved_bytes is not None else r.peak_bytes

    def dry_peak(self, seq_len: int, batch_size: int, mitigations: Optional[Sequence[str]] = None
                 ) -> Optional[tuple[int, dict[str, int]]]:
        """The dry run's ``(peak, phase peaks)`` of one step with ``mitigations`` (default: those on
        now), or None where no dry run can answer (cached; a dry run that raises answers None)."""
        key = (int(seq_len), int(batch_size), self.ladder.applied if mitigations is None else tuple(mitigations))
        if self.settings.dry_runner is None or not self.settings.within_limit(seq_len):  # past the model's positions: never asked
            return None
        if key not in self._dry:
            try:
                answer = self.settings.dry_runner(*key)
                peak, phases = answer[0], answer[1]
                self._dry[key] = (int(peak), {k: int(v) for k, v in phases.items()})
                if len(answer) > 2 and isinstance(answer[2], PeakSite):
                    self._dry_sites[key] = answer[2]
            except Exception as exc:  # noqa: BLE001 - the edge says why, once; the other predictors answer
                self._dry[key] = None
                self._dry_why[key] = getattr(exc, "reason", None) or f"{type(exc).__name__}: {exc}"
                fatal = isinstance(exc, RungNotApplicable) or getattr(exc, "fails_at_length", False)
                if fatal is True:
                    self._dry_fatal[key] = self._dry_why[key]
        return self._dry[key]

    def dry_answers(self, batch_size: int, mitigations: Optional[Sequence[str]] = None) -> list[int]:
        """The lengths the dry run answered already at ``batch_size`` with ``mitigations`` (default:
        those on now), sorted: what a report can show without another dry run."""
        key = self.ladder.applied if mitigations is None else tuple(mitigations)
        return sorted(L for (L, B, m), v in self._dry.items() if v is not None and B == int(batch_size) and m == key
                      and self.checks.wrong(key, "dry_run") is None)

    def any_dry_run_answered(self) -> bool:
        """Whether any dry run answered this run (at any shape, with any rungs), trusted or not."""
        return any(answer is not None for answer in self._dry.values())

    def kept_forecast(self, seq_len: int, batch_size: int, mitigations: Sequence[str]) -> Optional[Forecast]:
        """The forecast kept at the first step of ``(seq_len, batch_size, mitigations)`` to verify it
        against its measurement (:func:`~lightning_seqmem.plan.verification.keep_forecast`), while
        that step has not been verified yet; else None.

        Example:
            >>> from lightning_seqmem.plan.planner import SeqMemPlanner
            >>> p = SeqMemPlanner(dry_runner=lambda L, B, m: (100 * L * B, {"forward": 100 * L * B}))
            >>> p.evidence.any_dry_run_answered(), p.evidence.dry_peak(64, 2)[0], p.evidence.any_dry_run_answered()
            (False, 12800, True)
            >>> s = p.begin_step(64, 2)   # the first step at this shape: the dry run's forecast is kept
            >>> p.evidence.kept_forecast(64, 2, ()).method, p.evidence.kept_forecast(128, 2, ())
            ('dry_run', None)
        """
        return self._pending.get((int(seq_len), int(batch_size), tuple(mitigations)))

    def dry_margin(self) -> float:
        """The dry run's margin: 2%, widened by its largest measured under-prediction."""
        misses = [v.measured_bytes / max(v.forecast_bytes, 1) - 1 for f in self.forecasters.values()
                  for v in f.verifications if v.method == "dry_run"]
        return max([0.02] + misses)

    def scratch_bytes(self, seq_len: int, batch_size: int, mitigations: Sequence[str]) -> int:
        """What the allocator counted beyond the dry run, grown to ``(seq_len, batch_size)``.

        Only with allocator counters (``compare_reserved``): a dry run counts tensors, and the
        tracker probe counts the same tensors (0 by construction), but CUDA kernels also take
        scratch buffers of their own (eager attention's backward: one more ``[B, H, L, L]`` block
        on CUDA than on the CPU). From this setting's fitted steps (each shape dry-run once, cached),
        the longest not longer than ``seq_len`` gives ``measured - dry``, scaled by
        ``(L / L0)^2 * max(1, B / B0)`` (at most quadratic in L, linear in B); without one, the
        shortest such step's, unscaled.

        Example:
            >>> from lightning_seqmem.core.records import StepMemory
            >>> from lightning_seqmem.plan.planner import SeqMemPlanner
            >>> p = SeqMemPlanner(warmup_steps=0, warmup_steps_after_change=0, compare_reserved=True,
            ...                   dry_runner=lambda L, B, m: (100 * L * L, {"forward": 100 * L * L}))
            >>> p.evidence.dry_peak(64, 2)[0]
            409600
            >>> s = p.begin_step(64, 2, optimizer_steps=True, global_step=0)
            >>> _ = p.observe(s, StepMemory(409600 + 4096, {"forward": 409600 + 4096}, 0, 409600 + 4096))
            >>> p.course.end_batch()
            >>> p.evidence.records[0].peak_bytes - p.evidence.dry_peak(64, 2)[0]   # what the allocator counted beyond the dry run
            4096
            >>> p.evidence.scratch_bytes(128, 2, ()), p.evidence.scratch_bytes(128, 4, ())   # 4096 B at 64 tokens, batch 2
            (16384, 32768)
        """
        if not self.settings.compare_reserved:
            return 0
        key = tuple(mitigations)
        measured = [r for r in self.records if r.mitigations == key and not r.warmup]
        below = [r for r in measured if r.seq_len <= seq_len]
        if not measured:
            return 0
        grown = bool(below)
        r = max(below, key=lambda r: (r.seq_len, r.peak_bytes)) if below else min(measured, key=lambda r: r.seq_len)
        dry = self.dry_peak(r.seq_len, r.batch_size, key)  # cached, or one dry run of that measured shape
        if dry is None:
            return 0
        residual = max(0, max(q.peak_bytes for q in measured if (q.seq_len, q.batch_size) == (r.seq_len, r.batch_size)) - dry[0])
        if not grown:
            return residual
        return int(residual * (seq_len / r.seq_len) ** 2 * max(1.0, batch_size / r.batch_size))

    def dry_forecast(self, seq_len: int, batch_size: int, mitigations: Optional[Sequence[str]] = None,
                      source: Optional[tuple[int, int]] = None, trusted_only: bool = True) -> Optional[Forecast]:
        """The dry run's forecast at ``(seq_len, batch_size)``; with ``source``, an upper bound from the
        dry run of that larger shape (see :mod:`.dry_evidence`), scratch counted at ``seq_len``. None
        where it cannot answer, or (``trusted_only``) where it missed measured steps of this setting
        beyond the tolerance (:mod:`.trust`)."""
        key = self.ladder.applied if mitigations is None else tuple(mitigations)
        if trusted_only and self.checks.wrong(key, "dry_run") is not None:
            return None
        answer = self.dry_peak(*(source or (seq_len, batch_size)), mitigations)
        if answer is None:
            return None
        peak, phases = answer
        scratch = self.scratch_bytes(seq_len, batch_size, key)
        if scratch:
            peak, phases = peak + scratch, {p: v + scratch for p, v in phases.items()}
        upper = int(peak * (1 + self.dry_margin()))
        ratio = self.forecasters[key].reserved_ratio if key in self.forecasters else self.forecaster.reserved_ratio
        detail = f"dry run of the training step with mitigations {list(key)} on fake tensors"
        if source is not None and tuple(source) != (seq_len, batch_size):
            detail += f", at seq_len={source[0]}, batch_size={source[1]} (a bound: not shorter, not smaller)"
        detail += self._peak_site_note((*(source or (seq_len, batch_size)), key))
        return Forecast(int(seq_len), int(batch_size), peak, upper, int(upper * ratio), "dry_run", phases, detail)


    def dry_peak_site(self, seq_len: int, batch_size: int, mitigations: Optional[Sequence[str]] = None
                      ) -> Optional[PeakSite]:
        """Where the dry-run step's peak sits at ``(seq_len, batch_size, mitigations)`` (phase, kinds of
        tensor), when its dry run ran and said so; None otherwise (never runs one).

        Example:
            >>> from lightning_seqmem.core.peak import PeakSite
            >>> from lightning_seqmem.plan.planner import SeqMemPlanner
            >>> site = PeakSite("backward", (("attention_scores", 90 * 64 * 64), ("parameters", 10 * 64 * 64)))
            >>> p = SeqMemPlanner(dry_runner=lambda L, B, m: (100 * L * L, {"backward": 100 * L * L}, site))
            >>> p.evidence.dry_peak(64, 2, ())[0], p.evidence.dry_peak_site(64, 2, ()).top_kind
            (409600, 'attention_scores')
            >>> p.evidence.forecast(64, 2, ()).detail.endswith("; peak at backward: attention scores 90%, parameters 10%")
            True
        """
        key = (int(seq_len), int(batch_size), self.ladder.applied if mitigations is None else tuple(mitigations))
        return self._dry_sites.get(key)

    def _peak_site_note(self, key: tuple) -> str:
        site = self._dry_sites.get(key)
        return f"; peak at {site.describe()}" if site is not None else ""

    @property
    def _longest_known(self) -> int:
        """The longest length known to be one the model runs: measured, asked about, the target."""
        return max([r.seq_len for r in self.records] + [self._longest_seen] +
                   ([self.settings.curriculum.target] if self.settings.curriculum else []))

