"""Judging a batch against the usable budget: :func:`judge` and the bounds behind it, as functions of
the :class:`~lightning_seqmem.plan.evidence.Evidence` (the public ones are its methods).

Before a batch runs at ``(L, B)`` under the mitigations now on, :func:`judge` says whether it fits:

1. measured already at ``(L, B)`` with these mitigations: over if any step (warm-up included)
   went over, fits if a fitted step did not;
2. else the dry run (:func:`dry_judged`: this shape's, or a bound from a larger shape's);
3. otherwise the smallest of the upper bounds available: this setting's forecast, the forecast of
   the setting before the last rung (a mitigation adds no memory, unless a shape measured under
   both settings peaked higher with it: :func:`adds_memory`), and a one-point bound from
   this setting's nearest shorter measurement (``static + dynamic·(L/L₀)²·B/B₀``: activations grow
   at most quadratically in the length and linearly in the batch: :func:`one_point_bound`);
4. nothing measured yet: unknown (the first steps), and the batch runs.

Example (no budget: everything fits):
    >>> from lightning_seqmem.plan.planner import SeqMemPlanner
    >>> SeqMemPlanner().evidence.judge(4096, 8)
    Verdict(kind='fits', bound_bytes=None, peak_bytes=None, method='', measured=False)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

from lightning_seqmem.core.forecast import Forecast
from lightning_seqmem.core.quadratic import UNBOUNDED_SEQ_LEN
from lightning_seqmem.plan import dry_evidence

if TYPE_CHECKING:  # pragma: no cover
    from lightning_seqmem.plan.evidence import Evidence

__all__ = ["Verdict", "bucket", "covered", "dry_judged", "fit_now", "held_bytes", "judge", "one_point_bound", "over"]

_ONE_POINT_MARGIN = 0.02  # on top of the one-point bound, as the replay's margin


@dataclass(frozen=True)
class Verdict:
    """Whether ``(seq_len, batch_size)`` fits the usable budget under the mitigations now on."""

    kind: str  # "fits", "over" or "unknown"
    bound_bytes: Optional[int] = None  # what was compared with the budget
    peak_bytes: Optional[int] = None  # the measured or forecast peak behind it
    method: str = ""  # "measured", "dry_run", "replay", "quadratic", "one-point bound", "previous setting"
    measured: bool = False


def judge(ev: "Evidence", seq_len: int, batch_size: int, mitigations: Optional[Sequence[str]] = None) -> Verdict:
    """Whether a batch at ``(seq_len, batch_size)`` fits the usable budget now (see the module doc);
    ``mitigations`` asks the dry run about another set of rungs."""
    budget = ev.settings.usable_budget_bytes
    if budget is None:
        return Verdict("fits")
    if mitigations is not None and tuple(mitigations) != ev.ladder.applied:
        fc = dry_judged(ev, seq_len, batch_size, mitigations)
        if fc is None:
            return Verdict("unknown")
        return Verdict("fits" if ev.bound_of(fc) <= budget else "over", ev.bound_of(fc), fc.peak_bytes, "dry_run")
    here = [r for r in ev.records if (r.seq_len, r.batch_size, r.mitigations) ==
            (seq_len, batch_size, ev.ladder.applied)]
    if here:
        worst = max(here, key=ev._measured_bound)
        if ev._measured_bound(worst) > budget:
            return Verdict("over", ev._measured_bound(worst), worst.peak_bytes, "measured", measured=True)
        if any(not r.warmup for r in here):
            return Verdict("fits", ev._measured_bound(worst), worst.peak_bytes, "measured", measured=True)
    dry = dry_judged(ev, seq_len, batch_size)
    if dry is not None:  # the exact program at this length (or a bound from a larger one): before any extrapolation
        return Verdict("fits" if ev.bound_of(dry) <= budget else "over", ev.bound_of(dry), dry.peak_bytes, "dry_run")
    bounds: list[tuple[int, int, str]] = []
    if ev.forecaster.ready:
        fc = ev.forecaster.forecast(seq_len, batch_size)
        bounds.append((ev.bound_of(fc), fc.peak_bytes, fc.method))
    earlier = bounding_setting(ev)  # a mitigation adds no memory, unless a step here showed it did
    if earlier is not None:
        fc = ev.forecasters[earlier].forecast(seq_len, batch_size)
        bounds.append((ev.bound_of(fc), fc.peak_bytes, "previous setting"))
    one_point = one_point_bound(ev, seq_len, batch_size)
    if one_point is not None:
        bounds.append((*one_point, "one-point bound"))
    if not bounds:
        return Verdict("unknown")
    bound, peak, method = min(bounds)
    return Verdict("fits" if bound <= budget else "over", bound, peak, method)


def memory_added(ev: "Evidence", before: tuple[str, ...], after: tuple[str, ...],
                 at: Optional[tuple[int, int]] = None, records: Optional[Iterable[Any]] = None,
                 ) -> Optional[tuple[int, int, int, int]]:
    """Where a fitted step measured under ``after`` peaked above fitted steps of the same shape under
    ``before`` (the rungs between them add memory there: a fused loss on a small vocabulary, a tiled
    MLP at short lengths), as ``(seq_len, batch_size, before_bytes, after_bytes)`` at the largest
    such rise; None where no shape measured under both shows one. ``at``: only that ``(seq_len,
    batch_size)``; ``records``: these (default: the evidence's).

    Example:
        >>> from types import SimpleNamespace as S
        >>> r = lambda m, peak: S(seq_len=64, batch_size=2, mitigations=m, warmup=False, peak_bytes=peak)
        >>> ev = S(records=[r((), 100), r(("fused_loss",), 107)], _measured_bound=lambda rec: rec.peak_bytes)
        >>> memory_added(ev, (), ("fused_loss",)), memory_added(ev, ("fused_loss",), ())
        ((64, 2, 100, 107), None)
    """
    peaks: dict[tuple[int, int, tuple[str, ...]], int] = {}
    for r in ev.records if records is None else records:
        if not r.warmup and r.mitigations in (before, after) and (at is None or (r.seq_len, r.batch_size) == at):
            key = (r.seq_len, r.batch_size, r.mitigations)
            peaks[key] = max(peaks.get(key, 0), ev._measured_bound(r))
    rises = [(peaks[(L, B, after)] / max(peak, 1), (L, B, peak, peaks[(L, B, after)]))
             for (L, B, m), peak in peaks.items() if m == before and peaks.get((L, B, after), -1) > peak]
    return max(rises)[1] if rises else None


def adds_memory(ev: "Evidence", before: tuple[str, ...], after: tuple[str, ...]) -> bool:
    """Whether :func:`memory_added` found a shape where ``after`` peaks above ``before``: then
    ``before``'s forecast is no bound for ``after``."""
    return memory_added(ev, before, after) is not None


def bounding_setting(ev: "Evidence") -> Optional[tuple[str, ...]]:
    """The setting before the last rung whose forecast bounds the setting on now (its fit is ready,
    and no shape measured under both peaked higher with the rungs since), or None."""
    on = ev.ladder.applied
    for n in range(len(on) - 1, -1, -1):
        earlier = ev.forecasters.get(on[:n])
        if earlier is not None and earlier.ready:
            return None if adds_memory(ev, on[:n], on) else on[:n]
    return None


def dry_judged(ev: "Evidence", seq_len: int, batch_size: int, mitigations: Optional[Sequence[str]] = None) -> Optional[Forecast]:
    """The dry-run forecast to judge ``(seq_len, batch_size)`` by, with as few dry runs as possible
    (:mod:`.dry_evidence`: a step's peak does not fall as the length or the batch grows):

    1. this shape's own dry run, when it ran already, without a budget to judge against, or with
       a curriculum (a few lengths, each dry-run and verified when it runs); without one (the
       data sets the length: dynamic padding, a new length every batch):
    2. a cached dry run of a shape not shorter and not smaller whose bound fits: it fits too;
    3. one dry run ahead, at a longer length (:func:`bucket`: twice the longest length known,
       or short of where the cached dry runs cross the budget), when its bound fits: it then
       answers for every length below it;
    4. else this shape's own dry run: "over" is only ever said from the exact shape.
    """
    key = ev.ladder.applied if mitigations is None else tuple(mitigations)
    budget = ev.settings.usable_budget_bytes
    L, B = int(seq_len), int(batch_size)
    if (L, B, key) in ev._dry or budget is None or ev.settings.dry_runner is None or ev.settings.curriculum is not None:
        return ev.dry_forecast(L, B, key)  # a curriculum's few lengths: each its own dry run, verified
    answers = {(k[0], k[1]): v[0] for k, v in ev._dry.items() if v is not None and k[2] == key}
    source = dry_evidence.dominating(answers, L, B)
    if source is not None:
        fc = ev.dry_forecast(L, B, key, source=source)
        if fc is not None and ev.bound_of(fc) <= budget:
            return fc
    top = bucket(ev, L, B, key, budget)
    known_over = any(L <= k[0] <= top and k[1] == B and over(ev, k[0], B, key, budget) for k in answers)
    if top > L and not known_over:
        fc = ev.dry_forecast(L, B, key, source=(top, B))
        if fc is not None and ev.bound_of(fc) <= budget:
            return fc
    return ev.dry_forecast(L, B, key)


def bucket(ev: "Evidence", seq_len: int, batch_size: int, key: tuple[str, ...], budget: int) -> int:
    """The length to dry-run for ``seq_len`` (not shorter; a dry run there that fits answers for
    every shorter one): :func:`~lightning_seqmem.plan.dry_evidence.ahead_length` of the longest
    length known and the bounds of the dry runs cached (twice the longest while none is over;
    short of where they cross the budget once one is), never past the model's positions."""
    longest = max(ev._longest_known, seq_len)
    bounds = {}
    for (L, B, m), answer in ev._dry.items():
        if answer is not None and B == batch_size and m == key:
            fc = ev.dry_forecast(L, B, key)
            if fc is not None:
                bounds[L] = ev.bound_of(fc)
    return dry_evidence.ahead_length(seq_len, longest, bounds, budget, ev.settings.length_limit)


def over(ev: "Evidence", seq_len: int, batch_size: int, key: tuple[str, ...], budget: int) -> bool:
    fc = ev.dry_forecast(seq_len, batch_size, key)
    return fc is not None and ev.bound_of(fc) > budget


def one_point_bound(ev: "Evidence", seq_len: int, batch_size: int) -> Optional[tuple[int, int]]:
    """(bound, peak) from this setting's fitted step nearest below ``seq_len`` (any length
    if none is shorter), assuming activations at most quadratic in L and linear in B."""
    same = [r for r in ev.records if not r.warmup and r.mitigations == ev.ladder.applied]
    if not same:
        return None
    shorter = [r for r in same if r.seq_len <= seq_len] or same
    r = max(shorter, key=lambda r: (r.seq_len, r.peak_bytes))
    dynamic = max(r.peak_bytes - r.start_bytes, 0)
    scale = max(1.0, (seq_len / r.seq_len) ** 2) * max(1.0, batch_size / r.batch_size)
    peak = int(r.start_bytes + dynamic * scale)
    ratio = ev.forecaster.reserved_ratio if ev.settings.compare_reserved else 1.0
    return int(peak * (1 + _ONE_POINT_MARGIN) * ratio), peak


def fit_now(ev: "Evidence", batch_size: int) -> int:
    """Largest length forecast to fit the usable budget; before any fit, the longest one measured
    within it with these mitigations at this batch size or larger (0 if none)."""
    budget = ev.settings.usable_budget_bytes
    if budget is None:
        return UNBOUNDED_SEQ_LEN
    for n in range(len(ev.ladder.applied), -1, -1):
        forecaster = ev.forecasters.get(ev.ladder.applied[:n])
        if forecaster is not None and forecaster.ready:
            return forecaster.max_seq_len(budget, batch_size, reserved=ev.settings.compare_reserved)
    return max((r.seq_len for r in ev.records if r.mitigations == ev.ladder.applied
                and r.batch_size >= batch_size and ev._measured_bound(r) <= budget), default=0)


def covered(ev: "Evidence", seq_len: int, batch_size: int, setting: tuple[str, ...]) -> bool:
    """Whether a measured step at a shape not shorter and not smaller, with ``setting``, stayed
    within the usable budget: it bounds a step at ``(seq_len, batch_size)`` (see
    :mod:`lightning_seqmem.plan.schedule`). Only without a curriculum: a curriculum's shorter
    lengths (probes, re-measurements) are run to be measured."""
    if ev.settings.curriculum is not None:
        return False
    usable = ev.settings.usable_budget_bytes
    return any(r.seq_len >= seq_len and r.batch_size >= batch_size and r.mitigations == setting
               and (usable is None or ev._measured_bound(r) <= usable) for r in ev.records)


def held_bytes(ev: "Evidence") -> int:
    """What the latest measured step after the first began with (parameters, gradients, optimizer
    state, the batch): a floor of every later step's peak that no rung lowers (0 if unknown)."""
    for r in reversed(ev.records):
        if r.step > 0 and r.start_bytes:
            return int(r.start_bytes)
    return 0
