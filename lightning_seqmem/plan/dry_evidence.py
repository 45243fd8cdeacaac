"""``DryEvidence``: what the dry run said, and the dry-run forecasts made from it.

A dry-run forecast is the cached answer calibrated by the measured steps (read only): the kernel
scratch counted beyond it (:meth:`DryEvidence.scratch_bytes`), the margin widened by its own
misses, and no figure once it missed measured steps beyond the tolerance.

Example:
    >>> from lightning_seqmem.plan.advice_queue import AdviceQueue
    >>> from lightning_seqmem.plan.ladder_state import LadderState
    >>> from lightning_seqmem.plan.measured import MeasuredEvidence
    >>> from lightning_seqmem.plan.settings import PlannerSettings
    >>> run = lambda L, B, m: (100 * L * B, {"forward": 100 * L * B})
    >>> settings = PlannerSettings(budget_bytes=10**6, dry_runner=run)
    >>> dry = DryEvidence(settings, LadderState(()), MeasuredEvidence(settings, AdviceQueue()))
    >>> dry.peak(256, 4)[0], dry.forecast(256, 4).upper_bytes, dry.answered(4)
    (102400, 104448, [256])
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from lightning_seqmem.core.forecast import Forecast
from lightning_seqmem.core.peak import PeakSite
from lightning_seqmem.core.rungs import RungNotApplicable, base_name
from lightning_seqmem.core.search import bisect_last
from lightning_seqmem.plan import dry_search
from lightning_seqmem.plan.judging import dry_run_bound
from lightning_seqmem.plan.ladder_state import LadderState
from lightning_seqmem.plan.measured import MeasuredEvidence
from lightning_seqmem.plan.settings import PlannerSettings

__all__ = ["DryEvidence"]

Setting = tuple[str, ...]
Answer = tuple[int, dict[str, int]]


class DryEvidence:
    """The dry-run cache and its forecasts (see the module doc)."""

    def __init__(self, settings: PlannerSettings, ladder: LadderState,
                 measured: MeasuredEvidence) -> None:
        self.settings, self.ladder, self.measured = settings, ladder, measured
        self.answers: dict[tuple, Optional[Answer]] = {}  # (L, B, setting) -> (peak, phase peaks)
        self.why: dict[tuple, str] = {}  # key -> why it did not answer
        self.sites: dict[tuple, PeakSite] = {}  # key -> where that step's peak sits, when told
        # key -> why no figure may stand for it at all: a rung of it does not apply to the model
        # (RungNotApplicable), or the model's own step fails at that shape (fails_at_length)
        self.fatal: dict[tuple, str] = {}
        self.longest_seen = 0  # the longest source length decided on (bounds the buckets)
        # (budget, batch size, rungs on, multiple_of, longest) -> largest length confirmed to fit
        self.confirmed: dict[tuple, int] = {}

    def _key(self, seq_len: int, batch_size: int, mitigations: Optional[Sequence[str]]) -> tuple:
        return (int(seq_len), int(batch_size),
                self.ladder.applied if mitigations is None else tuple(mitigations))

    def peak(self, seq_len: int, batch_size: int,
             mitigations: Optional[Sequence[str]] = None) -> Optional[Answer]:
        """The dry run's ``(peak, phase peaks)`` of one step with ``mitigations`` (default: those
        on now), or None where no dry run can answer (cached; one that raises answers None)."""
        key = self._key(seq_len, batch_size, mitigations)
        # past the model's positions: never asked
        if self.settings.dry_runner is None or not self.settings.within_limit(seq_len):
            return None
        if key not in self.answers:
            try:
                answer = self.settings.dry_runner(*key)
                peak, phases = answer[0], answer[1]
                self.answers[key] = (int(peak), {k: int(v) for k, v in phases.items()})
                if len(answer) > 2 and isinstance(answer[2], PeakSite):
                    self.sites[key] = answer[2]
            except Exception as exc:  # noqa: BLE001 - the edge says why; other predictors answer
                self.answers[key] = None
                self.why[key] = getattr(exc, "reason", None) or f"{type(exc).__name__}: {exc}"
                if (isinstance(exc, RungNotApplicable)
                        or getattr(exc, "fails_at_length", False) is True):
                    self.fatal[key] = self.why[key]
        return self.answers[key]

    def asked(self, seq_len: int, batch_size: int,
              mitigations: Optional[Sequence[str]] = None) -> bool:
        """Whether the dry run was asked about this shape already (answered or not)."""
        return self._key(seq_len, batch_size, mitigations) in self.answers

    def answered(self, batch_size: int, mitigations: Optional[Sequence[str]] = None) -> list[int]:
        """The lengths the dry run answered at ``batch_size`` with ``mitigations`` (default: those
        on now) while it is trusted with them, sorted: what a report can show without another."""
        key = self._key(0, batch_size, mitigations)[2]
        return sorted(L for (L, B, m), v in self.answers.items()
                      if v is not None and B == int(batch_size) and m == key
                      and self.measured.checks.wrong(key, "dry_run") is None)

    def any_answered(self, setting: Optional[Setting] = None) -> bool:
        """Whether any dry run answered (with ``setting``; default: any rungs), trusted or not."""
        return any(v is not None and (setting is None or k[2] == setting)
                   for k, v in self.answers.items())

    def forget(self, rungs: set[str]) -> None:
        """Drop the answers of settings with any of ``rungs`` (they counted a one-time check)."""
        for table in (self.answers, self.sites):
            for key in [k for k in table if rungs & {base_name(m) for m in k[2]}]:
                del table[key]

    def see_length(self, seq_len: int) -> None:
        """A length the data has (bounds the dry runs' buckets)."""
        self.longest_seen = max(self.longest_seen, int(seq_len))

    def longest_known(self) -> int:
        """The longest length known to be one the model runs: measured, asked about, the target."""
        return max([r.seq_len for r in self.measured.records] + [self.longest_seen] +
                   ([self.settings.curriculum.target] if self.settings.curriculum else []))

    def site(self, seq_len: int, batch_size: int,
             mitigations: Optional[Sequence[str]] = None) -> Optional[PeakSite]:
        """Where the dry-run step's peak sits at ``(seq_len, batch_size, mitigations)`` (phase,
        kinds of tensor), when its dry run ran and said so; None otherwise (never runs one).

        >>> from lightning_seqmem.core.peak import PeakSite
        >>> from lightning_seqmem.plan.planner import SeqMemPlanner
        >>> site = PeakSite("backward", (("attention_scores", 90 * 64 * 64),
        ...                              ("parameters", 10 * 64 * 64)))
        >>> run = lambda L, B, m: (100 * L * L, {"backward": 100 * L * L}, site)
        >>> p = SeqMemPlanner(dry_runner=run)
        >>> p.evidence.dry.peak(64, 2, ())[0], p.evidence.dry.site(64, 2, ()).top_kind
        (409600, 'attention_scores')
        >>> p.evidence.forecast(64, 2, ()).detail.endswith(
        ...     "; peak at backward: attention scores 90%, parameters 10%")
        True
        """
        return self.sites.get(self._key(seq_len, batch_size, mitigations))

    def why_not(self, seq_len: int, batch_size: int,
                mitigations: Optional[Sequence[str]] = None) -> str:
        """Why the dry run does not answer at ``(seq_len, batch_size)`` (a forecast's detail)."""
        key = self._key(seq_len, batch_size, mitigations)
        if self.settings.dry_runner is None:
            return "no dry run (dry_run=False, or not rank zero, or before fit)"
        wrong = self.measured.checks.wrong(key[2], "dry_run")
        if wrong is not None:
            return f"dry run not trusted: {wrong.miss}"
        return f"dry run refused: {self.why.get(key, 'no answer')}"

    def scratch_bytes(self, seq_len: int, batch_size: int, mitigations: Sequence[str]) -> int:
        """What the allocator counted beyond the dry run (only with ``compare_reserved``: CUDA
        kernels' scratch buffers, e.g. eager attention's backward: one more ``[B, H, L, L]`` block),
        grown to ``(seq_len, batch_size)``: the longest fitted step not longer than ``seq_len``
        gives ``measured - dry``, scaled by ``(L / L0)^2 * max(1, B / B0)``.

        >>> from lightning_seqmem.core.records import StepMemory
        >>> from lightning_seqmem.plan.planner import SeqMemPlanner
        >>> run = lambda L, B, m: (100 * L * L, {"forward": 100 * L * L})
        >>> p = SeqMemPlanner(warmup_steps=0, warmup_steps_after_change=0,
        ...                   compare_reserved=True, dry_runner=run)
        >>> dry = p.evidence.dry
        >>> dry.peak(64, 2)[0]
        409600
        >>> s = p.begin_step(64, 2, optimizer_steps=True, global_step=0)
        >>> _ = p.observe(s, StepMemory(409600 + 4096, {"forward": 409600 + 4096}, 0,
        ...                             409600 + 4096))
        >>> p.course.end_batch()
        >>> p.evidence.measured.records[0].peak_bytes - dry.peak(64, 2)[0]   # beyond dry run
        4096
        >>> dry.scratch_bytes(128, 2, ()), dry.scratch_bytes(128, 4, ())   # 4096 B at (64, 2)
        (16384, 32768)
        """
        if not self.settings.compare_reserved:
            return 0
        key = tuple(mitigations)
        measured = [r for r in self.measured.records if r.mitigations == key and not r.warmup]
        below = [r for r in measured if r.seq_len <= seq_len]
        if not measured:
            return 0
        r = (max(below, key=lambda r: (r.seq_len, r.peak_bytes)) if below
             else min(measured, key=lambda r: r.seq_len))
        dry = self.peak(r.seq_len, r.batch_size, key)  # cached, or one dry run of that shape
        if dry is None:
            return 0
        same = max(q.peak_bytes for q in measured
                   if (q.seq_len, q.batch_size) == (r.seq_len, r.batch_size))
        residual = max(0, same - dry[0])
        if not below:
            return residual
        return int(residual * (seq_len / r.seq_len) ** 2 * max(1.0, batch_size / r.batch_size))

    def forecast(self, seq_len: int, batch_size: int, mitigations: Optional[Sequence[str]] = None,
                 source: Optional[tuple[int, int]] = None,
                 trusted_only: bool = True) -> Optional[Forecast]:
        """The dry run's forecast at ``(seq_len, batch_size)``; with ``source``, an upper bound from
        the dry run of that larger shape, scratch counted at ``seq_len``. None where it cannot
        answer or (``trusted_only``) is not trusted (:mod:`lightning_seqmem.core.trust`)."""
        key = self._key(seq_len, batch_size, mitigations)[2]
        if trusted_only and self.measured.checks.wrong(key, "dry_run") is not None:
            return None
        shape = source or (seq_len, batch_size)
        answer = self.peak(*shape, key)
        if answer is None:
            return None
        peak, phases = answer
        scratch = self.scratch_bytes(seq_len, batch_size, key)
        if scratch:
            peak, phases = peak + scratch, {p: v + scratch for p, v in phases.items()}
        upper = dry_run_bound(peak, self.measured.dry_margin())
        forecasters = self.measured.forecasters
        fit = (forecasters[key] if key in forecasters
               else self.measured.forecaster_of(self.ladder.applied))
        ratio = fit.reserved_ratio  # (the fit of this setting, else of the one on)
        detail = f"dry run of the training step with mitigations {list(key)} on fake tensors"
        if source is not None and tuple(source) != (seq_len, batch_size):
            detail += (f", at seq_len={source[0]}, batch_size={source[1]} "
                       "(a bound: not shorter, not smaller)")
        site = self.sites.get((*shape, key))
        detail += f"; peak at {site.describe()}" if site is not None else ""
        return Forecast(int(seq_len), int(batch_size), peak, upper, int(upper * ratio), "dry_run",
                        phases, detail)

    def bound(self, fc: Optional[Forecast]) -> Optional[int]:
        """What a forecast compares with the budget (None without one)."""
        return None if fc is None else self.settings.bound_of(fc)

    def judged(self, seq_len: int, batch_size: int,
               mitigations: Optional[Sequence[str]] = None) -> Optional[Forecast]:
        """The dry-run forecast to judge ``(seq_len, batch_size)`` by, with as few dry runs as
        possible: this shape's own where it ran already, without a budget or under a curriculum;
        else a cached dry run of a shape not shorter, not smaller, whose bound fits; else one at
        :meth:`bucket` whose bound fits; else this shape's own ("over" only from its own)."""
        L, B, key = self._key(seq_len, batch_size, mitigations)
        budget = self.settings.usable_budget_bytes
        if (L, B, key) in self.answers or budget is None or self.settings.dry_runner is None \
                or self.settings.curriculum is not None:
            return self.forecast(L, B, key)  # a curriculum's few lengths: each its own dry run
        answers = {(k[0], k[1]): v[0] for k, v in self.answers.items()
                   if v is not None and k[2] == key}
        source = dry_search.dominating(answers, L, B)
        if source is not None:
            fc = self.forecast(L, B, key, source=source)
            if fc is not None and self.bound(fc) <= budget:
                return fc
        top = self.bucket(L, B, key, budget)
        known_over = any(L <= k[0] <= top and k[1] == B
                         and (self.bound(self.forecast(k[0], B, key)) or 0) > budget
                         for k in answers)
        if top > L and not known_over:
            fc = self.forecast(L, B, key, source=(top, B))
            if fc is not None and self.bound(fc) <= budget:
                return fc
        return self.forecast(L, B, key)

    def bucket(self, seq_len: int, batch_size: int, key: Setting, budget: int) -> int:
        """The length to dry-run for ``seq_len``, :func:`.dry_search.ahead_length` of the longest
        known length and cached bounds: a fitting dry run there answers every shorter length."""
        longest = max(self.longest_known(), seq_len)
        bounds = {}
        for (L, B, m), answer in self.answers.items():
            if answer is not None and B == batch_size and m == key:
                fc = self.forecast(L, B, key)
                if fc is not None:
                    bounds[L] = self.bound(fc)
        return dry_search.ahead_length(seq_len, longest, bounds, budget, self.settings.length_limit)

    def max_seq_len(self, budget_bytes: int, batch_size: int) -> int:
        """A length whose dry-run bound fits, up to 4× the longest known (curriculum: a multiple of
        ``multiple_of``), confirmed by one dry run (:func:`.dry_search.confirmed_largest`): within
        about 2% of the largest where a search to the token took four dry runs or more."""
        records = self.measured.records
        curriculum = self.settings.curriculum
        known = [r.seq_len for r in records] + ([curriculum.target] if curriculum else [])
        step = int(curriculum.multiple_of) if curriculum is not None else 1
        hi = self.settings.clip_to_limit(4 * max(known + [256]))  # never past the positions
        hi -= hi % step

        def bound(L: int) -> Optional[int]:
            return self.bound(self.forecast(L, batch_size))

        def fits(L: int) -> bool:
            b = bound(L)
            return b is not None and b <= budget_bytes

        fitting = [L for L in self.answered(batch_size)  # cached: free
                   if L % step == 0 and L <= hi and fits(L)]
        lo = max(fitting, default=step)
        if not fits(lo):
            return 0 if step == 1 or not fits(1) else bisect_last(fits, 1, lo)
        key = (budget_bytes, batch_size, self.ladder.applied, step, hi)
        if self.confirmed.get(key) == lo:  # confirmed, and no longer length dry-run to fit since
            return lo
        dried = {L: bound(L) for L in self.answered(batch_size)}  # cached: free
        points = dict(dried)
        if len(dried) < 2:  # the measured steps too (with the dry run's margin): anchors to guess
            margin = 1 + self.measured.dry_margin()
            for r in records:  # (not the first step: no optimizer state yet)
                if (r.mitigations == self.ladder.applied and r.batch_size == batch_size
                        and r.step >= 1 and r.seq_len not in dried):
                    points[r.seq_len] = max(points.get(r.seq_len, 0),
                                            int(self.measured.bound(r) * margin))
            held = self.measured.held_bytes()  # the peak's floor as the length goes to 0
            if held and int(held * margin) < min((v for v in points.values() if v is not None),
                                                 default=0):
                points[0] = int(held * margin)  # a third point (p + q·L² through two guesses short)
        self.confirmed[key] = dry_search.confirmed_largest(lo, hi, bound, budget_bytes, points,
                                                           step)
        return self.confirmed[key]

    def search(self, lo: int, hi: int, unit: int, batch_size: int, setting: Setting, budget: int,
               bound: Optional[Callable[[int], Optional[int]]] = None) -> int:
        """Largest ``x`` in ``[lo, hi]`` whose bound at ``x·unit`` tokens (the dry run's, or
        ``bound``'s) fits ``budget``, given that ``lo`` fits
        (:func:`~lightning_seqmem.plan.dry_search.largest_fitting` over the dry runs cached)."""
        def dry_bound(x: int) -> Optional[int]:
            return self.bound(self.forecast(x * unit, batch_size, setting))

        known = [L // unit for (L, B, m), v in self.answers.items()
                 if v is not None and B == batch_size and m == setting and L % unit == 0]
        return dry_search.largest_fitting(lo, hi, bound or dry_bound, budget, known)
