"""``SeqMemPlanner``: every decision of the callback, on plain values (no torch, no Lightning).

The callback measures, applies and agrees across ranks; the planner decides. It owns

* the measurement schedule (:meth:`begin_step`): warm-up steps, warm-up after a change of shape or
  mitigations, ``measure_every_n_steps``, which steps are traced for the replay;
* one :class:`~lightning_seqmem.core.forecast.MemoryForecaster` per set of mitigations, fed by
  :meth:`observe`, and the verification of every forecast when its length runs;
* the curriculum's state (stage, cap, the queue of shorter lengths measured before growing);
* the budget decision before every batch (:meth:`decide` → :class:`Decision`, applied on every
  rank with :meth:`commit`), the advice it gives (:class:`~lightning_seqmem.core.advice.Advice`), the
  logged metrics and the checkpoint state.

The budget holds at every step, on every path. Before a batch runs at ``(L, B)`` under the
mitigations now on, :meth:`judge` says whether it fits the usable budget:

1. measured already at ``(L, B)`` with these mitigations: over if any step (warm-up included)
   went over, fits if a fitted step did not;
2. otherwise the smallest of the upper bounds available: this setting's forecast, the forecast of
   the setting before the last rung (a mitigation never adds memory), and a one-point bound from
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

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Sequence

from lightning_seqmem.core import advice as A
from lightning_seqmem.core.checks import check_int
from lightning_seqmem.core.curriculum import Curriculum
from lightning_seqmem.core.forecast import Forecast, MemoryForecaster, NotEnoughMeasurements
from lightning_seqmem.core.quadratic import UNBOUNDED_SEQ_LEN
from lightning_seqmem.core.records import PHASES, StepMemory, StepRecord
from lightning_seqmem.core.rungs import MITIGATIONS, base_name, check_mitigations, check_setting, spec
from lightning_seqmem.core.search import bisect_last
from lightning_seqmem.core.timeline import Trace
from lightning_seqmem.core.peak import PeakSite
from lightning_seqmem.core.trust import Check, PredictorChecks
from lightning_seqmem.core.units import format_bytes
from lightning_seqmem.plan import choose, dry_evidence, pricing
from lightning_seqmem.plan import metrics as plan_metrics
from lightning_seqmem.plan.checkpoint import CHECKPOINT_LAST_RECORDS, MEMORY_RECORDS, compact_records
from lightning_seqmem.plan.planner_state import load_planner_state, planner_state
from lightning_seqmem.plan.quadratic_check import quadratic_terms
from lightning_seqmem.plan.schedule import MeasurementSchedule

Applicability = Mapping[str, "tuple[bool, str]"]
DryRun = Callable[[int, int, "tuple[str, ...]"], "tuple[int, dict[str, int]]"]
"""``(seq_len, batch_size, mitigations) -> (peak_bytes, phase_peak_bytes)``, or with a third value, the
:class:`~lightning_seqmem.core.peak.PeakSite` of that step (None: not known): said in the forecast's detail."""
_ONE_POINT_MARGIN = 0.02  # on top of the one-point bound, as the replay's margin


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


@dataclass(frozen=True)
class Verdict:
    """Whether ``(seq_len, batch_size)`` fits the usable budget under the mitigations now on."""

    kind: str  # "fits", "over" or "unknown"
    bound_bytes: Optional[int] = None  # what was compared with the budget
    peak_bytes: Optional[int] = None  # the measured or forecast peak behind it
    method: str = ""  # "measured", "replay", "quadratic", "one-point bound", "previous setting"
    measured: bool = False


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


class SeqMemPlanner:
    """The callback's decisions on plain values. Arguments as :class:`~lightning_seqmem.SeqMemCallback`'s.

    Args:
        memory_budget_bytes: the budget in bytes, or None (forecasts are then informational).
        compare_reserved: judge against reserved memory (the CUDA caching allocator: an OOM happens
            at the reserved level); the tracker has no reserved memory.
        block_bytes: allocation granularity of traced steps (512 for CUDA, 1 for the tracker).
    """

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
    ) -> None:
        self.warmup_steps = warmup_steps
        self.tolerance = float(tolerance)
        self.budget_bytes = memory_budget_bytes
        self.safety_margin = float(safety_margin)
        self.curriculum = curriculum
        self.warmup_steps_after_change = warmup_steps_after_change
        self.trace_lengths = trace_lengths
        self.measure_every_n_steps = measure_every_n_steps
        self.mitigations = check_mitigations(mitigations)  # the rungs left to this run
        self.compare_reserved = compare_reserved
        self.block_bytes = block_bytes
        self.device_type = "cpu"  # the run's device type, for advice that fits the machine (set by the callback)
        self.precision = precision
        self.dry_run = dry_run  # (seq_len, batch_size, mitigations) -> (peak, phase peaks), or raises
        self.checkpoint_records = CHECKPOINT_LAST_RECORDS  # last records a checkpoint keeps (see state.compact_records)
        self.memory_records = MEMORY_RECORDS  # past this many, `records` is compacted to its summary and last half
        self.length_limit: Optional[int] = None  # the model's longest sequence (positions), tokens; None: no limit
        self.length_limit_reason = ""  # where it comes from, e.g. "config.max_position_embeddings=2048"
        self.reset()

    def reset(self) -> None:
        """Everything a run accumulates (what :meth:`state_dict` saves), as before the first step."""
        self.records: list[StepRecord] = []
        self.applied_mitigations: tuple[str, ...] = ()
        self.mitigation_events: list[dict[str, Any]] = []
        self.forecasters: dict[tuple[str, ...], MemoryForecaster] = {(): MemoryForecaster(tolerance=self.tolerance)}
        self.warned: dict[str, str] = {}  # advice key -> kind
        self.step = 0
        self.last_batch_size: Optional[int] = None
        self.last_verification_error: Optional[float] = None
        self.stages: tuple[int, ...] = self.curriculum.stages if self.curriculum else ()
        self.stage = 0
        self.stage_steps = 0
        self.capped_at: Optional[int] = None
        self.refit_queue: list[int] = []
        self.decide_now = False
        self.schedule = MeasurementSchedule()  # which batches are warm-ups, measured, traced
        self._pending: dict[tuple, Forecast] = {}
        self._pending_events: list[str] = []
        self._advice: list[A.Advice] = []
        self._cache: dict[str, Any] = {}
        self._dry: dict[tuple, Optional[tuple[int, dict[str, int]]]] = {}  # dry-run answers (not saved)
        self._longest_seen = 0  # the longest source length decided on (bounds the dry runs' buckets)
        self.replay_checks: dict[tuple[str, ...], dict[str, Any]] = {}  # replay vs dry run at the target
        self.checks = PredictorChecks(self.tolerance)  # every predictor against the measured steps (not saved)
        self._dry_why: dict[tuple, str] = {}  # dry-run key -> why it did not answer
        self._dry_sites: dict[tuple, PeakSite] = {}  # dry-run key -> where that step's peak sits, when told
        self._checked: set[tuple] = set()  # steps whose predictors were checked, with the fits' version
        self.not_applicable: dict[str, str] = {}  # rung -> why it does not apply here (last checked; never advised)

    # ------------------------------------------------------------------------------------------
    # Budget and forecasts
    # ------------------------------------------------------------------------------------------
    @property
    def _key_counts(self) -> dict[tuple, int]:  # the schedule's occurrences per shape (checkpointed)
        return self.schedule.counts

    @_key_counts.setter
    def _key_counts(self, counts: dict[tuple, int]) -> None:
        self.schedule.counts = counts

    @property
    def resume_warmup(self) -> int:
        return self.schedule.resume_warmup

    @resume_warmup.setter
    def resume_warmup(self, steps: int) -> None:
        self.schedule.resume_warmup = steps

    @property
    def usable_budget_bytes(self) -> Optional[int]:
        """``budget × (1 − safety_margin)``, or None without a budget."""
        return None if self.budget_bytes is None else int(self.budget_bytes * (1 - self.safety_margin))

    @property
    def forecaster(self) -> MemoryForecaster:
        """The forecaster of the mitigations on now (each setting has its own fit)."""
        return self.forecasters.setdefault(self.applied_mitigations, MemoryForecaster(tolerance=self.tolerance))

    @property
    def seq_len(self) -> Optional[int]:
        """The curriculum's current stage length (None without a curriculum)."""
        return self.stages[self.stage] if self.stages else None

    def bound_of(self, fc: Forecast) -> int:
        """What to compare with the budget: the reserved bound on CUDA, the upper bound elsewhere."""
        return fc.reserved_upper_bytes if self.compare_reserved else fc.upper_bytes

    def _batch_size(self, batch_size: Optional[int]) -> int:
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
        if not self.within_limit(seq_len):
            raise ValueError(f"`seq_len`={seq_len} is past this model's limit of {self.length_limit} tokens "
                             f"({self.length_limit_reason}): pass a length up to {self.length_limit}")
        key = self.applied_mitigations if mitigations is None else check_setting(mitigations)
        self._check_dry_once(key)
        dry = self._dry_forecast(seq_len, self._batch_size(batch_size), key)
        if dry is not None:
            return dry
        why = self.dry_run_why(seq_len, self._batch_size(batch_size), key)
        forecaster = self.forecasters.get(key)
        if forecaster is None:
            raise NotEnoughMeasurements(f"nothing measured with mitigations {list(key)}; measured: "
                                        f"{[list(k) for k in self.forecasters]}; {why}")
        fc = forecaster.forecast(seq_len, self._batch_size(batch_size))
        return replace(fc, detail=f"{fc.detail}; {why}")

    def _check_dry_once(self, setting: tuple[str, ...]) -> None:
        """Before a dry run answers a query with ``setting`` where it never met a measured step (a run
        without a budget asks it nothing), check it once at the latest measured shape."""
        if self.dry_run is None or self.checks.count(setting, "dry_run"):
            return
        measured = [r for r in self.records if r.mitigations == setting and not r.warmup]
        if len(measured) < (2 if self.compare_reserved else 1):
            return
        r = measured[-1]
        dry = self._dry_forecast(r.seq_len, r.batch_size, setting, trusted_only=False)
        if dry is not None and self.checks.add(setting, Check("dry_run", r.seq_len, r.batch_size, dry.peak_bytes, r.peak_bytes)):
            c = self.checks.latest[(setting, "dry_run", r.seq_len, r.batch_size)]
            self.advise(A.predictor_wrong(r.seq_len, r.batch_size, r.peak_bytes, [("dry_run", dry.peak_bytes, c.relative_error)],
                                          self.tolerance, self.checks.right(setting)))

    def dry_run_why(self, seq_len: int, batch_size: int, mitigations: Optional[Sequence[str]] = None) -> str:
        """Why the dry run does not answer at ``(seq_len, batch_size)`` (for a forecast's detail)."""
        key = (int(seq_len), int(batch_size), self.applied_mitigations if mitigations is None else tuple(mitigations))
        if self.dry_run is None:
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
            budget_bytes = self.usable_budget_bytes
            if budget_bytes is None:
                raise ValueError("no memory budget: pass `budget_bytes` or set SeqMemCallback(memory_budget=...)")
        batch_size = self._batch_size(batch_size)
        limit = (lambda fit: fit) if self.length_limit is None else (lambda fit: min(fit, self.length_limit))
        if self.forecaster.ready:
            return limit(self.forecaster.max_seq_len(budget_bytes, batch_size, reserved=self.compare_reserved))
        if self.dry_answers(batch_size) or self._dry_forecast(1, batch_size) is not None:
            return self._dry_max_seq_len(budget_bytes, batch_size)
        # what is known otherwise (a rung went on at the last steps): the setting before it, whose
        # forecast bounds this one (a mitigation never adds memory), else the longest length measured within it
        for n in range(len(self.applied_mitigations) - 1, -1, -1):
            earlier = self.forecasters.get(self.applied_mitigations[:n])
            if earlier is not None and earlier.ready:
                return limit(earlier.max_seq_len(budget_bytes, batch_size, reserved=self.compare_reserved))
        return max((r.seq_len for r in self.records if r.mitigations == self.applied_mitigations and not r.warmup
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
        known = [r.seq_len for r in self.records] + ([self.curriculum.target] if self.curriculum else [])
        step = int(self.curriculum.multiple_of) if self.curriculum is not None else 1
        hi = 4 * max(known + [256])
        hi = hi if self.length_limit is None else min(hi, self.length_limit)  # never past the model's positions
        hi -= hi % step

        def fits(L: int) -> bool:
            fc = self._dry_forecast(L, batch_size)
            return fc is not None and self.bound_of(fc) <= budget_bytes

        fitting = [L for L in self.dry_answers(batch_size) if L % step == 0 and L <= hi and fits(L)]  # cached: free
        lo = max(fitting, default=step)
        if not fits(lo):
            return 0 if step == 1 or not fits(1) else bisect_last(fits, 1, lo)
        memo = self.__dict__.setdefault("_max_seq_len_memo", {})  # the answers confirmed (dry run at each)
        key = (budget_bytes, batch_size, self.applied_mitigations, step, hi)
        if memo.get(key) == lo:  # confirmed before, and no longer length dry-run to fit since
            return lo

        def bound(L: int) -> Optional[int]:
            fc = self._dry_forecast(L, batch_size)
            return None if fc is None else self.bound_of(fc)

        dried = {L: bound(L) for L in self.dry_answers(batch_size)}  # cached: free
        known = dict(dried)
        if len(dried) < 2:  # the measured steps too (real peaks, the dry run's margin on them): anchors for the guess
            margin = 1 + self._dry_margin()
            for r in self.records:  # (not the first step: no optimizer state yet)
                if (r.mitigations == self.applied_mitigations and r.batch_size == batch_size
                        and r.step >= 1 and r.seq_len not in dried):
                    known[r.seq_len] = max(known.get(r.seq_len, 0), int(self._measured_bound(r) * margin))
        memo[key] = dry_evidence.confirmed_largest(lo, hi, bound, budget_bytes, known, step)
        return memo[key]

    def _dry_search(self, lo: int, hi: int, unit: int, batch_size: int, setting: tuple[str, ...], budget: int,
                    bound: Optional[Callable[[int], Optional[int]]] = None) -> int:
        """Largest ``x`` in ``[lo, hi]`` whose bound at ``x·unit`` tokens (the dry run's, or ``bound``'s)
        fits ``budget``, given that ``lo`` fits: the dry runs cached narrow it, then guesses from their
        bounds are checked (:func:`~lightning_seqmem.plan.dry_evidence.largest_fitting`)."""
        def dry_bound(x: int) -> Optional[int]:
            fc = self._dry_forecast(x * unit, batch_size, setting)
            return None if fc is None else self.bound_of(fc)

        bound = bound or dry_bound

        known = [L // unit for (L, B, m), v in self._dry.items()
                 if v is not None and B == batch_size and m == setting and L % unit == 0]
        return dry_evidence.largest_fitting(lo, hi, bound, budget, known)

    def _measured_bound(self, r: StepRecord) -> int:
        return r.reserved_bytes if self.compare_reserved and r.reserved_bytes is not None else r.peak_bytes

    def _one_point_bound(self, seq_len: int, batch_size: int) -> Optional[tuple[int, int]]:
        """(bound, peak) from this setting's fitted step nearest below ``seq_len`` (any length
        if none is shorter), assuming activations at most quadratic in L and linear in B."""
        same = [r for r in self.records if not r.warmup and r.mitigations == self.applied_mitigations]
        if not same:
            return None
        shorter = [r for r in same if r.seq_len <= seq_len] or same
        r = max(shorter, key=lambda r: (r.seq_len, r.peak_bytes))
        dynamic = max(r.peak_bytes - r.start_bytes, 0)
        scale = max(1.0, (seq_len / r.seq_len) ** 2) * max(1.0, batch_size / r.batch_size)
        peak = int(r.start_bytes + dynamic * scale)
        ratio = self.forecaster.reserved_ratio if self.compare_reserved else 1.0
        return int(peak * (1 + _ONE_POINT_MARGIN) * ratio), peak

    def dry_peak(self, seq_len: int, batch_size: int, mitigations: Optional[Sequence[str]] = None
                 ) -> Optional[tuple[int, dict[str, int]]]:
        """The dry run's ``(peak, phase peaks)`` of one step with ``mitigations`` (default: those on
        now), or None where no dry run can answer (cached; a dry run that raises answers None)."""
        key = (int(seq_len), int(batch_size), self.applied_mitigations if mitigations is None else tuple(mitigations))
        if self.dry_run is None or not self.within_limit(seq_len):  # past the model's positions: never asked
            return None
        if key not in self._dry:
            try:
                answer = self.dry_run(*key)
                peak, phases = answer[0], answer[1]
                self._dry[key] = (int(peak), {k: int(v) for k, v in phases.items()})
                if len(answer) > 2 and isinstance(answer[2], PeakSite):
                    self._dry_sites[key] = answer[2]
            except Exception as exc:  # noqa: BLE001 - the edge says why, once; the other predictors answer
                self._dry[key] = None
                self._dry_why[key] = getattr(exc, "reason", None) or f"{type(exc).__name__}: {exc}"
        return self._dry[key]

    def dry_answers(self, batch_size: int, mitigations: Optional[Sequence[str]] = None) -> list[int]:
        """The lengths the dry run answered already at ``batch_size`` with ``mitigations`` (default:
        those on now), sorted: what a report can show without another dry run."""
        key = self.applied_mitigations if mitigations is None else tuple(mitigations)
        return sorted(L for (L, B, m), v in self._dry.items() if v is not None and B == int(batch_size) and m == key
                      and self.checks.wrong(key, "dry_run") is None)

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
        self.length_limit = None if limit is None else int(limit)
        self.length_limit_reason = reason
        if self.length_limit is None or not self.stages or self.stages[-1] <= self.length_limit:
            return
        assert self.curriculum is not None
        stop = max(self.curriculum.round_down(self.length_limit), self.curriculum.multiple_of)
        dropped = [s for s in self.stages if s > self.length_limit]
        kept = tuple(s for s in self.stages if s <= stop)
        self.stages = kept + ((stop,) if not kept or kept[-1] < stop else ())
        self.stage = min(self.stage, len(self.stages) - 1)
        self.refit_queue = [L for L in self.refit_queue if L <= self.length_limit]
        self.advise(A.length_limit(self.length_limit, reason, dropped, self.stages[-1]))

    def within_limit(self, seq_len: int) -> bool:
        """Whether the model can take ``seq_len`` tokens at all (``length_limit``: its positions)."""
        return self.length_limit is None or int(seq_len) <= self.length_limit

    def _dry_margin(self) -> float:
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
            >>> p = SeqMemPlanner(warmup_steps=0, warmup_steps_after_change=0, compare_reserved=True,
            ...                   dry_run=lambda L, B, m: (100 * L * L, {"forward": 100 * L * L}))
            >>> p.dry_peak(64, 2)[0]
            409600
            >>> s = p.begin_step(64, 2, optimizer_steps=True, global_step=0)
            >>> _ = p.observe(s, StepMemory(409600 + 4096, {"forward": 409600 + 4096}, 0, 409600 + 4096))
            >>> p.end_batch()
            >>> p.records[0].peak_bytes - p.dry_peak(64, 2)[0]   # what the allocator counted beyond the dry run
            4096
            >>> p.scratch_bytes(128, 2, ()), p.scratch_bytes(128, 4, ())   # 4096 B at 64 tokens, batch 2
            (16384, 32768)
        """
        if not self.compare_reserved:
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

    def _dry_forecast(self, seq_len: int, batch_size: int, mitigations: Optional[Sequence[str]] = None,
                      source: Optional[tuple[int, int]] = None, trusted_only: bool = True) -> Optional[Forecast]:
        """The dry run's forecast at ``(seq_len, batch_size)``; with ``source``, an upper bound from the
        dry run of that larger shape (see :mod:`.dry_evidence`), scratch counted at ``seq_len``. None
        where it cannot answer, or (``trusted_only``) where it missed measured steps of this setting
        beyond the tolerance (:mod:`.trust`)."""
        key = self.applied_mitigations if mitigations is None else tuple(mitigations)
        if trusted_only and self.checks.wrong(key, "dry_run") is not None:
            return None
        answer = self.dry_peak(*(source or (seq_len, batch_size)), mitigations)
        if answer is None:
            return None
        peak, phases = answer
        scratch = self.scratch_bytes(seq_len, batch_size, key)
        if scratch:
            peak, phases = peak + scratch, {p: v + scratch for p, v in phases.items()}
        upper = int(peak * (1 + self._dry_margin()))
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
            >>> site = PeakSite("backward", (("attention_scores", 90 * 64 * 64), ("parameters", 10 * 64 * 64)))
            >>> p = SeqMemPlanner(dry_run=lambda L, B, m: (100 * L * L, {"backward": 100 * L * L}, site))
            >>> p.dry_peak(64, 2, ())[0], p.dry_peak_site(64, 2, ()).top_kind
            (409600, 'attention_scores')
            >>> p.forecast(64, 2, ()).detail.endswith("; peak at backward: attention scores 90%, parameters 10%")
            True
        """
        key = (int(seq_len), int(batch_size), self.applied_mitigations if mitigations is None else tuple(mitigations))
        return self._dry_sites.get(key)

    def _peak_site_note(self, key: tuple) -> str:
        site = self._dry_sites.get(key)
        return f"; peak at {site.describe()}" if site is not None else ""

    def _dry_judged(self, seq_len: int, batch_size: int, mitigations: Optional[Sequence[str]] = None) -> Optional[Forecast]:
        """The dry-run forecast to judge ``(seq_len, batch_size)`` by, with as few dry runs as possible
        (:mod:`.dry_evidence`: a step's peak does not fall as the length or the batch grows):

        1. this shape's own dry run, when it ran already, without a budget to judge against, or with
           a curriculum (a few lengths, each dry-run and verified when it runs); without one (the
           data sets the length: dynamic padding, a new length every batch):
        2. a cached dry run of a shape not shorter and not smaller whose bound fits: it fits too;
        3. one dry run ahead, at a longer length (:meth:`_bucket`: twice the longest length known,
           or short of where the cached dry runs cross the budget), when its bound fits: it then
           answers for every length below it;
        4. else this shape's own dry run: "over" is only ever said from the exact shape.
        """
        key = self.applied_mitigations if mitigations is None else tuple(mitigations)
        budget = self.usable_budget_bytes
        L, B = int(seq_len), int(batch_size)
        if (L, B, key) in self._dry or budget is None or self.dry_run is None or self.curriculum is not None:
            return self._dry_forecast(L, B, key)  # a curriculum's few lengths: each its own dry run, verified
        answers = {(k[0], k[1]): v[0] for k, v in self._dry.items() if v is not None and k[2] == key}
        source = dry_evidence.dominating(answers, L, B)
        if source is not None:
            fc = self._dry_forecast(L, B, key, source=source)
            if fc is not None and self.bound_of(fc) <= budget:
                return fc
        bucket = self._bucket(L, B, key, budget)
        known_over = any(L <= k[0] <= bucket and k[1] == B and self._over(k[0], B, key, budget) for k in answers)
        if bucket > L and not known_over:
            fc = self._dry_forecast(L, B, key, source=(bucket, B))
            if fc is not None and self.bound_of(fc) <= budget:
                return fc
        return self._dry_forecast(L, B, key)

    def _bucket(self, seq_len: int, batch_size: int, key: tuple[str, ...], budget: int) -> int:
        """The length to dry-run for ``seq_len`` (not shorter; a dry run there that fits answers for
        every shorter one): :func:`~lightning_seqmem.plan.dry_evidence.ahead_length` of the longest
        length known and the bounds of the dry runs cached (twice the longest while none is over;
        short of where they cross the budget once one is), never past the model's positions."""
        longest = max(self._longest_known, seq_len)
        bounds = {}
        for (L, B, m), answer in self._dry.items():
            if answer is not None and B == batch_size and m == key:
                fc = self._dry_forecast(L, B, key)
                if fc is not None:
                    bounds[L] = self.bound_of(fc)
        return dry_evidence.ahead_length(seq_len, longest, bounds, budget, self.length_limit)

    def _over(self, seq_len: int, batch_size: int, key: tuple[str, ...], budget: int) -> bool:
        fc = self._dry_forecast(seq_len, batch_size, key)
        return fc is not None and self.bound_of(fc) > budget

    @property
    def _longest_known(self) -> int:
        """The longest length known to be one the model runs: measured, asked about, the target."""
        return max([r.seq_len for r in self.records] + [self._longest_seen] +
                   ([self.curriculum.target] if self.curriculum else []))

    def judge(self, seq_len: int, batch_size: int, mitigations: Optional[Sequence[str]] = None) -> Verdict:
        """Whether a batch at ``(seq_len, batch_size)`` fits the usable budget now (see the module doc);
        ``mitigations`` asks the dry run about another set of rungs."""
        budget = self.usable_budget_bytes
        if budget is None:
            return Verdict("fits")
        if mitigations is not None and tuple(mitigations) != self.applied_mitigations:
            fc = self._dry_judged(seq_len, batch_size, mitigations)
            if fc is None:
                return Verdict("unknown")
            return Verdict("fits" if self.bound_of(fc) <= budget else "over", self.bound_of(fc), fc.peak_bytes, "dry_run")
        here = [r for r in self.records if (r.seq_len, r.batch_size, r.mitigations) ==
                (seq_len, batch_size, self.applied_mitigations)]
        if here:
            worst = max(here, key=self._measured_bound)
            if self._measured_bound(worst) > budget:
                return Verdict("over", self._measured_bound(worst), worst.peak_bytes, "measured", measured=True)
            if any(not r.warmup for r in here):
                return Verdict("fits", self._measured_bound(worst), worst.peak_bytes, "measured", measured=True)
        dry = self._dry_judged(seq_len, batch_size)
        if dry is not None:  # the exact program at this length (or a bound from a larger one): before any extrapolation
            return Verdict("fits" if self.bound_of(dry) <= budget else "over", self.bound_of(dry), dry.peak_bytes, "dry_run")
        bounds: list[tuple[int, int, str]] = []
        if self.forecaster.ready:
            fc = self.forecaster.forecast(seq_len, batch_size)
            bounds.append((self.bound_of(fc), fc.peak_bytes, fc.method))
        for n in range(len(self.applied_mitigations) - 1, -1, -1):  # a mitigation never adds memory
            earlier = self.forecasters.get(self.applied_mitigations[:n])
            if earlier is not None and earlier.ready:
                fc = earlier.forecast(seq_len, batch_size)
                bounds.append((self.bound_of(fc), fc.peak_bytes, "previous setting"))
                break
        one_point = self._one_point_bound(seq_len, batch_size)
        if one_point is not None:
            bounds.append((*one_point, "one-point bound"))
        if not bounds:
            return Verdict("unknown")
        bound, peak, method = min(bounds)
        return Verdict("fits" if bound <= budget else "over", bound, peak, method)

    def _fit_now(self, batch_size: int) -> int:
        """Largest length forecast to fit the usable budget; before any fit, the longest one measured
        within it with these mitigations at this batch size or larger (0 if none)."""
        budget = self.usable_budget_bytes
        if budget is None:
            return UNBOUNDED_SEQ_LEN
        for n in range(len(self.applied_mitigations), -1, -1):
            forecaster = self.forecasters.get(self.applied_mitigations[:n])
            if forecaster is not None and forecaster.ready:
                return forecaster.max_seq_len(budget, batch_size, reserved=self.compare_reserved)
        return max((r.seq_len for r in self.records if r.mitigations == self.applied_mitigations
                    and r.batch_size >= batch_size and self._measured_bound(r) <= budget), default=0)

    # ------------------------------------------------------------------------------------------
    # Decisions
    # ------------------------------------------------------------------------------------------
    def decide(self, shape: tuple[int, int], applicable: Applicability) -> Decision:
        """What to do before a batch whose full shape is ``(batch_size, seq_len)``.

        ``applicable`` maps each rung not on yet to ``(applies, reason)`` for this model and batch
        (under DDP: applies on every rank). Pure: the state changes only in :meth:`commit`.
        """
        batch_size, seq_len = int(shape[0]), int(shape[1])
        self._longest_seen = max(self._longest_seen, seq_len)  # (a cache: a length the data has)
        if self.curriculum is None:
            return self._decide_free(seq_len, batch_size, applicable)
        return self._decide_curriculum(seq_len, batch_size, applicable)

    def _state(self, **changes: Any) -> Decision:
        base = Decision("run", None, stages=self.stages, stage=self.stage, refit_queue=tuple(self.refit_queue),
                        decide_now=self.decide_now)
        return replace(base, **changes)

    def _next_rung(self, applicable: Applicability) -> tuple[Optional[str], list[str]]:
        skipped = []
        on = {base_name(n) for n in self.applied_mitigations}
        for name in self.mitigations:
            if name in on:
                continue
            ok, reason = applicable.get(name, (False, "its applicability was not checked"))
            if ok:
                return name, skipped
            skipped.append(f"{name}: {reason}")
        return None, skipped

    def _plan(self, seq_len: int, batch_size: int, applicable: Applicability) -> Optional[choose.Choice]:
        """The setting that fits at ``(seq_len, batch_size)`` with the least predicted step time
        (:func:`~lightning_seqmem.plan.choose.choose`: what is on plus at most one applicable variant
        per rung left or an upgrade, judged by dry run, priced by :meth:`price`); every rung on and
        ``fits=False`` when none fits; None where the dry run cannot answer."""
        if self.dry_peak(seq_len, batch_size) is None:
            return None
        timed = pricing.timed_records(self.records)  # filtered once: every candidate is priced
        return choose.choose(self.applied_mitigations, self.mitigations, applicable,
                             lambda s: self.judge(seq_len, batch_size, s),
                             lambda s: pricing.predict_step(timed, s, seq_len, batch_size, self.device_type).key,
                             fmt=format_bytes, usable=self.usable_budget_bytes)

    def price(self, setting: Optional[Sequence[str]], seq_len: int, batch_size: int) -> pricing.Price:
        """The predicted cost of one step with ``setting`` (default: the one on) at ``(seq_len,
        batch_size)``, from the measured step times (:func:`~lightning_seqmem.plan.pricing.predict_step`)."""
        key = self.applied_mitigations if setting is None else tuple(setting)
        return pricing.predict_step(self.records, key, int(seq_len), int(batch_size), self.device_type)

    def _dry_fit(self, low: int, high: int, batch_size: int, setting: tuple[str, ...],
                 batch_of: Optional[Callable[[int], int]] = None) -> Optional[int]:
        """Largest multiple of the curriculum's ``multiple_of`` in ``[low, high)`` (and within the
        model's ``length_limit``) that :meth:`judge` says fits with ``setting``, or None (bisection: a
        handful of judgements, each the dry run where it answers, cached). ``batch_of(L)``: the batch
        size at ``L`` (``truncate=False`` reshapes rows), else ``batch_size`` at every length."""
        assert self.curriculum is not None
        m = self.curriculum.multiple_of
        if self.length_limit is not None:
            high = min(high, self.length_limit + 1)
        lo, hi = max(-(-low // m), 1), (high - 1) // m  # in units of m: multiples in [low, high)

        def fits(k: int) -> bool:
            L = k * m
            return self.judge(L, batch_of(L) if batch_of else batch_size, setting).kind == "fits"

        if hi < lo or not fits(lo):
            return None
        budget = self.usable_budget_bytes
        assert budget is not None

        def judged_bound(k: int) -> Optional[int]:  # the judgement's bound, so the search agrees with fits()
            L = k * m
            verdict = self.judge(L, batch_of(L) if batch_of else batch_size, setting)
            if verdict.kind == "unknown":
                return None
            return verdict.bound_bytes if verdict.bound_bytes is not None else (0 if verdict.kind == "fits" else budget + 1)

        return m * self._dry_search(lo, hi, m, batch_size, tuple(setting), budget, judged_bound)

    def _checked_fit(self, high: int, batch_size: int) -> int:
        """Largest length below ``high`` that :meth:`judge` says fits with the rungs on now (what a
        warning names as "the largest length forecast to fit"): a multiple of the curriculum's
        ``multiple_of``; without one, the forecast's largest length, checked by the same judgement
        (bisected below it when that is over); 0 if none."""
        if self.curriculum is not None:
            return self._dry_fit(1, high, batch_size, self.applied_mitigations) or 0
        high = high if self.length_limit is None else min(high, self.length_limit + 1)
        guess = min(self._safe_fit(batch_size), high - 1)
        fits = lambda L: self.judge(L, batch_size).kind == "fits"  # noqa: E731
        if guess < 1 or fits(guess):
            return max(guess, 0)
        return 0 if not fits(1) else bisect_last(fits, 1, guess)

    def _decide_free(self, seq_len: int, batch_size: int, applicable: Applicability) -> Decision:
        verdict = self.judge(seq_len, batch_size)
        if verdict.kind != "over":
            return self._state()
        budget, usable = self.budget_bytes, self.usable_budget_bytes
        assert budget is not None and usable is not None
        plan = self._plan(seq_len, batch_size, applicable)
        if plan is not None:
            rungs, fits = plan.rungs, plan.fits
        else:
            rung, _ = self._next_rung(applicable)
            rungs, fits = ((rung,) if rung else ()), True
        words = A.over_budget_batch(seq_len, batch_size, verdict.peak_bytes or 0, verdict.bound_bytes or 0,
                                    verdict.method, usable, budget, self.safety_margin, self._checked_fit(seq_len, batch_size),
                                    self.applied_mitigations, rungs, verdict.measured, still_over=not fits,
                                    inapplicable=_inapplicable(applicable), device=self.device_type)
        return self._state(action="mitigate" if rungs else "over", rungs=rungs, advice=(choose.with_why(words, plan),))

    def batch_at(self, batch_size: int, source_len: int, seq_len: int) -> int:
        """Samples per batch at ``seq_len``: ``truncate=False`` reshapes rows, keeping the tokens."""
        assert self.curriculum is not None
        if not self.curriculum.truncate and source_len > 0:
            return max(1, batch_size * source_len // seq_len)
        return batch_size

    def _decide_curriculum(self, source_len: int, source_batch: int, applicable: Applicability) -> Decision:
        assert self.curriculum is not None
        queue, advance = list(self.refit_queue), False
        if queue:
            seq_len = queue.pop(0)
        elif (self.decide_now or self.stage_steps >= self.curriculum.steps_per_stage) and self.stage + 1 < len(self.stages):
            seq_len, advance = self.stages[self.stage + 1], True
        else:
            seq_len = self.stages[self.stage]
        after_queue = bool(self.refit_queue) and not queue  # the last re-measurement: decide right after
        batch_size = self.batch_at(source_batch, source_len, seq_len)
        verdict = self.judge(seq_len, batch_size)
        go = self._state(action="advance" if advance else "run", seq_len=seq_len, refit_queue=tuple(queue),
                         stage=self.stage + advance, decide_now=after_queue, reset_stage_steps=advance)
        if verdict.kind == "fits":
            return go
        if verdict.kind == "unknown":  # nothing fitted yet with these mitigations: hold the stage
            return go if not advance else self._state(seq_len=self.stages[self.stage], decide_now=True)
        if advance and verdict.method in ("one-point bound", "previous setting") and not self.forecaster.ready:
            probe = self._probe_length(batch_size)
            if probe is not None:  # a real fit of this setting before judging the stage over
                steps = [probe] * (max(1, self.warmup_steps_after_change) + 1)
                return self._state(action="probe", seq_len=probe, refit_queue=tuple(steps[1:]), decide_now=False)
        return self._over_in_curriculum(seq_len, batch_size, verdict, applicable,
                                        lambda L: self.batch_at(source_batch, source_len, L))

    def _probe_length(self, batch_size: int) -> Optional[int]:
        """A length shorter than the current stage not yet fitted with these mitigations, or None."""
        assert self.curriculum is not None
        m = self.curriculum.multiple_of
        fitted = {r.seq_len for r in self.records if not r.warmup and r.mitigations == self.applied_mitigations
                  and r.batch_size == batch_size}
        length = self.stages[self.stage] // 2
        while length >= m:
            candidate = self.curriculum.round_down(length)
            if candidate not in fitted and candidate < self.stages[self.stage]:
                return candidate
            length //= 2
        return None

    def _safe_fit(self, batch_size: int) -> int:
        try:
            return self._fit_now(batch_size)
        except Exception:  # noqa: BLE001 - only words depend on it
            return 0

    def _over_in_curriculum(self, seq_len: int, batch_size: int, verdict: Verdict, applicable: Applicability,
                            batch_of: Optional[Callable[[int], int]] = None) -> Decision:
        """Over the budget at ``seq_len`` (the next stage, or the one running): rungs, or a cap. Every
        cap is the largest multiple of ``multiple_of`` that :meth:`judge` (the dry run where it
        answers: the predictor that judged the stage) says fits, and the words name that length."""
        assert self.curriculum is not None and self.budget_bytes is not None and self.usable_budget_bytes is not None
        m, current = self.curriculum.multiple_of, self.stages[self.stage]
        rung, skipped = self._next_rung(applicable)
        plan = self._plan(seq_len, batch_size, applicable)
        words = dict(seq_len=seq_len, peak=verdict.peak_bytes or 0, bound=verdict.bound_bytes or 0,
                     method=verdict.method, usable=self.usable_budget_bytes, budget=self.budget_bytes,
                     margin=self.safety_margin, fit=0, skipped=skipped, measured=verdict.measured,
                     applied=self.applied_mitigations)
        advance = seq_len > current and seq_len in self.stages
        held = self._held_bytes()
        if held > self.usable_budget_bytes:  # no rung lowers what a step begins with: stop rather than run over
            return self._state(action="stop", seq_len=None, advice=(A.held_over_budget(
                held, self.usable_budget_bytes, self.budget_bytes, self.safety_margin, self.device_type),))
        low = current if seq_len > current else 1  # the next stage over: stay between the two

        def capped(cap: Optional[int]) -> int:
            words["fit"] = cap or 0  # the length that was checked; 0: "no length is forecast to fit"
            return cap if cap is not None else (current if seq_len > current else m)

        if plan is not None and plan.fits:  # the dry run says which rungs make it fit: on before the stage
            words["fit"] = self._dry_fit(1, seq_len, batch_size, self.applied_mitigations, batch_of) or 0
            action = (f"Switching on {', '.join(map(repr, plan.rungs))} before it runs (dry run: it then fits; "
                      f"chosen as the fastest setting that fits: {plan.why})")
            return self._state(action="mitigate", rungs=plan.rungs, seq_len=seq_len, refit_queue=(), decide_now=False,
                               stage=self.stages.index(seq_len) if advance else self.stage, reset_stage_steps=advance,
                               advice=(A.over_budget_stage(action=action, **words),))
        if plan is not None:  # nothing fits at this length even with every rung: all on, and the longest that fits
            setting = plan.setting
            cap = self._dry_fit(low, seq_len, batch_size, setting, batch_of)
            if cap is None and seq_len <= current:  # not even the shortest length fits with every rung
                every = self.judge(seq_len, batch_size, setting)
                return self._stop(seq_len, batch_size, every if every.bound_bytes else verdict, setting)
            cap = capped(cap)
            stages = tuple(s for s in self.stages[: self.stage + 1] if s < cap) + (cap,)
            action = (f"Switching on {', '.join(map(repr, plan.rungs))}; the curriculum stays at seq_len={cap}. "
                      f"To go further: {A.remaining_advice(setting, _inapplicable(applicable), self.device_type)}")
            return self._state(action="cap", rungs=plan.rungs, seq_len=cap, stages=stages, stage=len(stages) - 1,
                               refit_queue=(), decide_now=False, reset_stage_steps=cap != current,
                               advice=(A.over_budget_stage(action=action, **words),))
        if rung is not None:
            words["fit"] = self._dry_fit(1, seq_len, batch_size, self.applied_mitigations, batch_of) or 0
            base = min(current, seq_len)
            lengths = sorted({self.curriculum.round_down(max(base // d, m)) for d in (4, 2, 1)})
            steps = max(1, self.warmup_steps_after_change) + 1  # warm-up, then one fitted step per length
            queue = [L for L in lengths for _ in range(steps)]
            action = (f"Switching on the next mitigation, {rung!r}, then re-measuring at seq_len {lengths} "
                      "before growing")
            return self._state(action="mitigate", rungs=(rung,), seq_len=queue[0], refit_queue=tuple(queue[1:]),
                               decide_now=False, advice=(A.over_budget_stage(action=action, **words),))
        # no rung left: the longest length judged to fit (the next stage over: between the two; the
        # stage running now over: below it)
        found = self._dry_fit(low, seq_len, batch_size, self.applied_mitigations, batch_of)
        if found is None and seq_len <= current and (self.forecaster.ready or seq_len <= m):
            return self._stop(seq_len, batch_size, verdict, self.applied_mitigations)  # nothing fits: a fit says so,
        cap = capped(found)  # or the shortest ran over; else the shortest is measured first
        stages = tuple(s for s in self.stages[: self.stage + 1] if s < cap) + (cap,)
        action = (f"The curriculum stays at seq_len={cap}. To go further: "
                  f"{A.remaining_advice(self.applied_mitigations, _inapplicable(applicable), self.device_type)}")
        return self._state(action="cap", seq_len=cap, stages=stages, stage=len(stages) - 1, refit_queue=(),
                           decide_now=False, reset_stage_steps=cap != current,
                           advice=(A.over_budget_stage(action=action, **words),))

    def _held_bytes(self) -> int:
        """What the latest measured step after the first began with (parameters, gradients, optimizer
        state, the batch): a floor of every later step's peak that no rung lowers (0 if unknown)."""
        for r in reversed(self.records):
            if r.step > 0 and r.start_bytes:
                return int(r.start_bytes)
        return 0

    def _stop(self, seq_len: int, batch_size: int, verdict: Verdict, setting: tuple[str, ...]) -> Decision:
        """Nothing can meet the budget at ``seq_len`` with ``setting`` (every rung this run can take)."""
        assert self.curriculum is not None and self.budget_bytes is not None and self.usable_budget_bytes is not None
        words = A.budget_unreachable(seq_len, batch_size, verdict.bound_bytes or 0, verdict.method,
                                     self.usable_budget_bytes, self.budget_bytes, self.safety_margin, setting,
                                     self.curriculum.multiple_of, self.device_type)
        return self._state(action="stop", seq_len=None, advice=(words,))

    def commit(self, decision: Decision) -> None:
        """Take ``decision`` (every rank, the same one). A rung is recorded in :meth:`rung_applied`."""
        self.stages, self.stage = tuple(decision.stages), decision.stage
        self.refit_queue, self.decide_now = list(decision.refit_queue), decision.decide_now
        if decision.reset_stage_steps:
            self.stage_steps = 0
        if decision.action == "cap":
            self.capped_at = self.stages[-1]
        for item in decision.advice:
            self.advise(item)

    def before_rung(self, name: str, seq_len: int, batch_size: int) -> None:
        """Called just before ``name`` is switched on: dry runs of the setting now on that only
        this moment allows (a copy cannot undo a rung), for the check after the attention switch."""
        if spec(name).linearises_attention and self.dry_run is not None:
            x = max(int(seq_len), 16)
            for k in (1, 2, 3):
                self.dry_peak(k * x, batch_size)

    def rung_applied(self, name: str, ok: bool, detail: str, seq_len: Optional[int], batch_size: Optional[int] = None) -> None:
        """A rung ``decide`` asked for was switched on (``ok``) on every rank, or on none; ``seq_len``
        and ``batch_size``: where it was decided (the peak before is the measured one there, else
        the dry run's)."""
        if not ok:
            self.mitigations = tuple(m for m in self.mitigations if m != base_name(name))
            self.refit_queue, self.decide_now = [], True
            self.advise(A.mitigation_failed(name, detail))
            return
        before = max((r.peak_bytes for r in self.records if r.seq_len == seq_len and r.mitigations == self.applied_mitigations
                      and (batch_size is None or r.batch_size == batch_size)), default=None)
        method = "measured" if before is not None else None
        if before is None and seq_len and batch_size and self._dry.get((seq_len, batch_size, self.applied_mitigations)):
            before, method = self._dry[(seq_len, batch_size, self.applied_mitigations)][0], "dry_run"  # type: ignore[index]
        setting_before = self.applied_mitigations
        self.applied_mitigations = choose.combine(self.applied_mitigations, (name,))  # an upgrade replaces its entry
        self.forecaster  # noqa: B018 - a fresh fit for the new setting
        self.mitigation_events.append({"name": name, "step": self.step, "seq_len": seq_len, "batch_size": batch_size,
                                       "detail": detail, "before_bytes": before, "before_method": method,
                                       "after_bytes": None, "mitigations_before": list(setting_before)})
        self._pending_events.append(f"mitigation:{name}")

    def rung_removed(self, name: str, why: str, pending: Optional[PendingStep] = None) -> None:
        """A rung that was on is off again (every rank): it is not tried again this run; ``pending``,
        the step that found out, ran without it."""
        if pending is not None:
            pending.mitigations = tuple(m for m in pending.mitigations if m != name)
        self.applied_mitigations = tuple(m for m in self.applied_mitigations if m != name)
        self.mitigations = tuple(m for m in self.mitigations if m != name)
        self.refit_queue, self.decide_now = [], True
        for event in self.mitigation_events:
            if event["name"] == name and "removed" not in event:
                event["removed"] = why
        self.advise(A.mitigation_failed(name, why))

    def drop_mitigations(self, names: Sequence[str], why: str) -> None:
        """Rungs this run cannot take (set-up): off for the run, said once."""
        if names:
            self.mitigations = tuple(m for m in self.mitigations if m not in names)
            self.advise(A.mitigations_dropped(names, why))

    # ------------------------------------------------------------------------------------------
    # Measurement
    # ------------------------------------------------------------------------------------------
    def begin_step(self, seq_len: int, batch_size: int, optimizer_steps: bool = True, global_step: int = 0,
                   epoch: int = 0) -> PendingStep:
        """The schedule for a batch about to run at ``(seq_len, batch_size)``: warm-up, measured, traced."""
        key = (seq_len, batch_size, self.applied_mitigations)
        warmup, measure, count = self.schedule.next(key, self.step, self.warmup_steps, self.warmup_steps_after_change,
                                                    self.measure_every_n_steps, global_step, self._covered(*key))
        if count == 0:  # kept to verify against the measurement
            fc = self._dry_forecast(seq_len, batch_size) if (seq_len, batch_size, key[2]) in self._dry else None
            if fc is None and self.forecaster.ready:
                fc = self.forecaster.forecast(seq_len, batch_size)
            if fc is not None:
                self._pending[key] = fc
        # only steps ending in an optimizer step are traced: with accumulation the others run another program
        traced = measure and not warmup and optimizer_steps and self.forecaster.wants_trace(seq_len, batch_size, self.trace_lengths)
        events, self._pending_events = self._pending_events, []
        return PendingStep(self.step, global_step, epoch, seq_len, batch_size, warmup, measure, traced,
                           self.stage if self.stages else None, self.applied_mitigations, events)

    def _covered(self, seq_len: int, batch_size: int, setting: tuple[str, ...]) -> bool:
        """Whether a measured step at a shape not shorter and not smaller, with ``setting``, stayed
        within the usable budget: it bounds a step at ``(seq_len, batch_size)`` (see
        :mod:`lightning_seqmem.plan.schedule`). Only without a curriculum: a curriculum's shorter
        lengths (probes, re-measurements) are run to be measured."""
        if self.curriculum is not None:
            return False
        usable = self.usable_budget_bytes
        return any(r.seq_len >= seq_len and r.batch_size >= batch_size and r.mitigations == setting
                   and (usable is None or self._measured_bound(r) <= usable) for r in self.records)

    def end_batch(self, at_stage_length: bool = True) -> None:
        """A batch finished (measured or not). Only a batch that ran at the length it was cut to
        (``at_stage_length``) counts towards the stage's ``steps_per_stage``: where the data is
        shorter than the stage, or the batch could not be cut, the curriculum holds."""
        self.step += 1
        self.stage_steps += 1 if at_stage_length else 0

    def observe(self, pending: PendingStep, memory: StepMemory, seq_len: Optional[int] = None,
                batch_size: Optional[int] = None, trace: Optional[tuple[int, int, StepMemory]] = None,
                rank: Optional[int] = None, step_seconds: Optional[float] = None) -> StepRecord:
        """Record a measured step, fit, verify; returns the record.

        ``memory`` is the step's measurement; under DDP, that of the rank with the highest peak,
        whose own ``(seq_len, batch_size)`` are given. ``trace`` is the ``(seq_len, batch_size,
        memory)`` whose events are traced (default: the same); ``step_seconds``: the step's own wall
        time (what :meth:`price` predicts from).
        """
        L = pending.seq_len if seq_len is None else int(seq_len)
        B = pending.batch_size if batch_size is None else int(batch_size)
        phases = {p: memory.phase_peak_bytes.get(p) for p in PHASES}
        record = StepRecord(
            step=pending.step, global_step=pending.global_step, epoch=pending.epoch, seq_len=L, batch_size=B,
            warmup=pending.warmup, traced=pending.traced, peak_bytes=memory.peak_bytes,
            forward_peak_bytes=phases["forward"], backward_peak_bytes=phases["backward"],
            optimizer_peak_bytes=phases["optimizer"], start_bytes=memory.start_bytes,
            reserved_bytes=memory.reserved_bytes, fragmentation_bytes=memory.fragmentation_bytes,
            fragmentation_fraction=memory.fragmentation_fraction, inactive_split_bytes=memory.inactive_split_bytes,
            alloc_retries=memory.alloc_retries, num_ooms=memory.num_ooms, stage=pending.stage,
            mitigations=pending.mitigations, events=list(pending.events), rank=rank,
            step_seconds=None if step_seconds is None else float(step_seconds),
        )
        usable = self.usable_budget_bytes
        if record.step == 0 and usable is not None and self._measured_bound(record) > usable:
            assert self.budget_bytes is not None
            self.advise(A.first_step_over_budget(record.start_bytes, record.peak_bytes, usable, self.budget_bytes,
                                                 self.safety_margin))
        forecaster = self.forecasters.setdefault(record.mitigations, MemoryForecaster(tolerance=self.tolerance))
        if not record.warmup:
            self.last_batch_size = B
            wrong_now = self._check_predictors(record, forecaster)
            forecaster.add_measurement(L, B, {p: v for p, v in phases.items() if v is not None}, memory.reserved_bytes)
            tL, tB, tm = trace if trace is not None else (L, B, memory)
            if pending.traced and tm.events is not None:
                forecaster.add_trace(Trace(tL, tB, tm.events, block_bytes=self.block_bytes,
                                           measured_peak_bytes=tm.peak_bytes))
                self._compare_replay(forecaster, record.mitigations, B)
            fc = self._pending.pop((pending.seq_len, pending.batch_size, pending.mitigations), None)
            if fc is not None and (fc.seq_len, fc.batch_size) == (L, B):  # the forecast for the shape that ran
                self._verify(record, fc, forecaster, quiet=fc.method in wrong_now)
            self._after_mitigation(record)
        if any(spec(m).first_step_check for m in record.mitigations) and not any(
                r.mitigations == record.mitigations for r in self.records):
            # the step that switched such a rung on (micro-batching) ran its one-time check, which the dry
            # runs of this setting so far counted: later steps are dry-run afresh, without it
            self._dry = {k: v for k, v in self._dry.items() if k[2] != record.mitigations}
            self._dry_sites = {k: v for k, v in self._dry_sites.items() if k[2] != record.mitigations}
            key = (record.seq_len, record.batch_size, record.mitigations)
            if key in self._pending:  # verified against the next (steady) step: forecast it as such
                fresh = self._dry_forecast(*key)
                if fresh is not None:
                    self._pending[key] = fresh
        self.records.append(record)
        if len(self.records) > self.memory_records:  # a very long run: bounded in memory too
            self.records = compact_records(self.records, self.memory_records // 2, self._measured_bound)
        return record

    def _compare_replay(self, forecaster: MemoryForecaster, setting: tuple[str, ...], batch_size: int) -> None:
        """The replay against the dry run at the target length (the curriculum's, else 4× the longest
        traced): a replay off by more than the tolerance is not trusted, and that is said once."""
        if forecaster.timeline is None or self.dry_run is None or self.checks.wrong(setting, "dry_run") is not None:
            return  # (a dry run that missed measured steps is not the judge of the replay)
        target = self.curriculum.target if self.curriculum else 4 * max(t.seq_len for t in forecaster.traces)
        target = target if self.length_limit is None else min(target, self.length_limit)
        dry = self.dry_peak(target, batch_size, setting)
        if dry is None:
            return
        replay = forecaster.forecast(target, batch_size, method="replay").peak_bytes
        error = (replay - dry[0]) / max(dry[0], 1)
        self.replay_checks[setting] = {"seq_len": target, "batch_size": batch_size, "replay_bytes": replay,
                                       "dry_run_bytes": dry[0], "relative_error": error}
        if abs(error) > self.tolerance:
            self.advise(A.replay_disagrees(target, batch_size, replay, dry[0], error, forecaster.timeline.seq_lens))

    def _check_predictors(self, record: StepRecord, forecaster: MemoryForecaster) -> set[str]:
        """Check each predictor that can answer for the shape that ran against its measured peak,
        before this step is added to any fit; one that misses beyond the tolerance is not trusted
        until it is right again, said once per predictor and setting (:mod:`.trust`). Returns the
        predictors this step found wrong where they were right before."""
        L, B, setting = record.seq_len, record.batch_size, record.mitigations
        seen = (L, B, setting, forecaster.version, (L, B, setting) in self._dry, record.peak_bytes)
        if seen in self._checked:  # the same step again, the same fits: the same checks
            return set()
        self._checked.add(seen)
        predictions: dict[str, int] = {}
        dry_key = (L, B, setting)
        # asked already (no dry run only to check it); with allocator counters, once this setting has a
        # measured step for the kernel scratch beyond the dry run's tensors (scratch_bytes)
        residual_known = not self.compare_reserved or any(r.mitigations == setting and not r.warmup for r in self.records)
        if self.dry_run is not None and dry_key in self._dry and residual_known:
            dry = self._dry_forecast(L, B, setting, trusted_only=False)
            if dry is not None:
                predictions["dry_run"] = dry.peak_bytes
        for method in ("replay", "quadratic"):
            try:
                predictions[method] = forecaster.forecast(L, B, method=method).peak_bytes
            except NotEnoughMeasurements:
                pass
        newly: set[str] = set()
        for method, predicted in predictions.items():
            if self.checks.add(setting, Check(method, L, B, predicted, record.peak_bytes)):
                newly.add(method)
        forecaster.distrusted = {}
        for method in ("replay", "quadratic"):
            wrong = self.checks.wrong(setting, method)
            if wrong is not None:
                forecaster.distrusted[method] = (f"it predicted {wrong.relative_error:+.1%} for the step measured at "
                                                 f"seq_len={wrong.seq_len} (batch {wrong.batch_size})")
        # a predictor ranked after one that decides and is right steps aside silently (see Forecast.detail)
        said = [m for m in ("dry_run", "replay", "quadratic") if m in newly and not self._deciding_before(m, setting, forecaster)]
        if said:
            misses = [(m, predictions[m], self.checks.latest[(setting, m, L, B)].relative_error) for m in said]
            self.advise(A.predictor_wrong(L, B, record.peak_bytes, misses, self.tolerance, self.checks.right(setting)))
        return newly

    def _deciding_before(self, method: str, setting: tuple[str, ...], forecaster: MemoryForecaster) -> bool:
        """Whether a predictor ranked before ``method`` (dry run, replay, quadratic fit) answers and
        is trusted with ``setting``: then ``method`` was not what decisions used."""
        order = ("dry_run", "replay", "quadratic")
        answers = {"dry_run": self.dry_run is not None and any(k[2] == setting and v is not None for k, v in self._dry.items()),
                   "replay": forecaster.timeline is not None, "quadratic": forecaster.quadratic is not None}
        return any(answers[m] and self.checks.wrong(setting, m) is None for m in order[:order.index(method)])

    def _verify(self, record: StepRecord, fc: Forecast, forecaster: MemoryForecaster, quiet: bool = False) -> None:
        v = forecaster.verify(fc, record.peak_bytes)
        record.forecast_peak_bytes, record.forecast_upper_bytes = fc.peak_bytes, fc.upper_bytes
        record.forecast_method, record.forecast_error = fc.method, v.relative_error
        self.last_verification_error = v.relative_error
        if abs(v.relative_error) > self.tolerance and not quiet:  # quiet: said by the predictor check
            self.advise(A.forecast_mismatch(record.seq_len, record.batch_size, fc.method, fc.peak_bytes,
                                            record.peak_bytes, v.relative_error, self.tolerance))

    def _after_mitigation(self, record: StepRecord) -> None:
        """Fill the measured effect of the last mitigation; warn if attention stayed quadratic."""
        if not self.mitigation_events:
            return
        event = self.mitigation_events[-1]
        if event["after_bytes"] is None and record.seq_len == event["seq_len"] and record.mitigations == self.applied_mitigations:
            event["after_bytes"] = record.peak_bytes
        if not spec(event["name"]).linearises_attention or event.get("checked"):
            return
        terms = self._dry_quadratic_terms(event, record.batch_size)
        if terms is None and self.forecaster.ready:
            terms = quadratic_terms(self.forecasters.get(self.applied_mitigations[:-1]), self.forecaster)
        if terms is None:
            return
        old_b, new_b = terms
        event["checked"] = True
        if new_b > 0.5 * old_b:
            self.advise(A.attention_still_quadratic(event["detail"], new_b, old_b))

    def _dry_quadratic_terms(self, event: Mapping[str, Any], batch_size: int) -> Optional[tuple[float, float]]:
        """Bytes per token² per sample before and after the rung of ``event``, from dry runs at
        L, 2L, 3L (``p(3L) − 2p(2L) + p(L) = 2bL²`` for ``p = c + aL + bL²``), or None."""
        before = tuple(event.get("mitigations_before", ()))
        after = choose.combine(before, (event["name"],))
        if after != self.applied_mitigations[: len(after)]:
            return None
        x = max(int(event.get("seq_len") or 0), 16)
        out = []
        for setting in (before, after):
            peaks = [self.dry_peak(k * x, batch_size, setting) for k in (1, 2, 3)]
            if any(p is None for p in peaks):
                return None
            p1, p2, p3 = (p[0] for p in peaks)  # type: ignore[index]
            out.append(max(p3 - 2 * p2 + p1, 0) / (2 * x * x * batch_size))
        return out[0], out[1]

    # ------------------------------------------------------------------------------------------
    # Advice and metrics
    # ------------------------------------------------------------------------------------------
    def advise(self, item: A.Advice) -> None:
        """Queue ``item`` unless its key was given already."""
        if item.key not in self.warned:
            self.warned[item.key] = item.kind
            self._advice.append(item)

    def take_advice(self) -> list[A.Advice]:
        """The advice given since the last call (the callback warns each once)."""
        out, self._advice = self._advice, []
        return out

    def budget_view(self, batch_size: int) -> dict[str, float]:
        """Forecast for the next stage (or this length), largest length that fits, headroom (cached;
        :func:`lightning_seqmem.plan.metrics.budget_view`)."""
        return plan_metrics.budget_view(self, batch_size)

    def metrics(self, record: StepRecord) -> dict[str, float]:
        """The logged scalars of ``record`` (:func:`lightning_seqmem.plan.metrics.metrics`)."""
        return plan_metrics.metrics(self, record)

    # ------------------------------------------------------------------------------------------
    # Checkpointing (lightning_seqmem.plan.planner_state)
    # ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Flat plain values (:func:`lightning_seqmem.plan.planner_state.planner_state`)."""
        return planner_state(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`, all or nothing (raises on a state this version cannot read)."""
        load_planner_state(self, state)


def _inapplicable(applicable: Applicability) -> tuple[str, ...]:
    """The rungs checked and found not to apply (never advised: attention already on SDPA)."""
    return tuple(name for name, (ok, _) in applicable.items() if not ok)


__all__ = ["Decision", "PendingStep", "SeqMemPlanner", "Verdict", "quadratic_terms"]
