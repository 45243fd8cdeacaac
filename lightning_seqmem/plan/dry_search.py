"""Fewer dry runs for the same decisions: buckets, bounds from dry runs made, guided searches.

Pure maths on plain values, assuming a step's peak does not fall as the length or batch grows: a
dry run bounds from above every shape no longer and no larger (:func:`dominating`,
:func:`bucket_up`); "over" is never answered from another shape. :func:`largest_fitting` takes two
dry runs where a bisection takes about seven, :func:`confirmed_largest` one (within about 2% of the
largest on a quadratic); :func:`fitted_bytes` interpolates between the lengths dry-run.

Example:
    >>> bucket_up(300), bucket_up(256), bucket_up(1000), bucket_up(12)
    (320, 256, 1024, 12)
    >>> dominating({(512, 4): 9_000, (1024, 4): 30_000, (384, 4): 5_000}, 400, 4)
    (512, 4)
    >>> peak = lambda L: 1_000 + 3 * L * L   # bytes at length L
    >>> calls = []
    >>> def bound(L):
    ...     calls.append(L)
    ...     return peak(L)
    >>> largest_fitting(1, 4096, bound, budget=3_000_000), len(calls)   # a bisection takes 13
    (999, 4)
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Mapping, Optional

from lightning_seqmem.core.search import bisect_last, crossing_of, interpolated_last

__all__ = ["AHEAD_REACH", "CONFIRM_SLACK", "ahead_length", "bucket_up", "confirmed_largest",
           "crossing", "dominating", "fitted_bytes", "fitted_largest", "largest_fitting"]


def bucket_up(seq_len: int, per_octave: int = 8) -> int:
    """``seq_len`` rounded up onto a geometric grid of ``per_octave`` lengths per doubling (at most
    ``1/per_octave`` longer; lengths up to ``2·per_octave`` are their own bucket).

    >>> [bucket_up(L) for L in (16, 17, 33, 100, 129, 4097)]
    [16, 18, 36, 104, 144, 4608]
    """
    if seq_len <= 2 * per_octave:
        return int(seq_len)
    unit = (1 << (int(seq_len).bit_length() - 1)) // per_octave
    return -(-int(seq_len) // unit) * unit


AHEAD_REACH = 2
"""How far past the longest length known a dry run looks ahead without a curriculum (a factor): it
costs about the same at any length and, if it fits, answers for every shorter one."""


def ahead_length(seq_len: int, longest: int, bounds: Mapping[int, int], budget: int,
                 limit: Optional[int] = None, reach: int = AHEAD_REACH) -> int:
    """The length to dry-run to judge ``seq_len``: ``reach`` times the longest known, bucketed,
    while nothing known is over ``budget``; else 95% of where the ``bounds`` (length -> bytes)
    cross it, or ``seq_len``'s own bucket. Within ``[seq_len, limit]``.

    >>> ahead_length(300, 300, {}, 10_000)   # nothing known: twice as far, on the grid
    640
    >>> ahead_length(300, 500, {640: 9_000}, 10_000, limit=800)
    800
    >>> ahead_length(300, 500, {200: 4_000, 1000: 100_000}, 10_000)   # p + q·L² crosses at 316
    320
    >>> ahead_length(300, 500, {1000: 100_000}, 10_000)   # over, no crossing: its own bucket
    320
    """
    seq_len = int(seq_len)
    cross = crossing(bounds, budget)
    if cross is not None:
        target = int(0.95 * cross)
    elif any(v > budget for v in bounds.values()):
        target = seq_len
    else:
        target = bucket_up(reach * max(int(longest), seq_len))
    target = max(target, bucket_up(seq_len))
    if limit is not None:
        target = min(target, int(limit))
    return max(target, seq_len)


def dominating(answers: Mapping[tuple[int, int], int], seq_len: int,
               batch_size: int) -> Optional[tuple[int, int]]:
    """Key of the least-peak answer at least ``seq_len`` long and ``batch_size`` large, or None.

    >>> dominating({(64, 2): 10, (128, 1): 20}, 100, 2) is None
    True
    """
    above = [(peak, key) for key, peak in answers.items()
             if key[0] >= seq_len and key[1] >= batch_size]
    return min(above)[1] if above else None


def crossing(bounds: Mapping[int, int], budget: int) -> Optional[int]:
    """Where ``bounds`` (length -> bound bytes) would reach ``budget``: between the longest length
    that fits and the shortest longer one over (see :func:`largest_fitting`); None without both.

    >>> crossing({100: 10_000, 200: 40_000, 400: 160_000}, 90_000)   # 1·L² bytes: 300 tokens
    300
    >>> crossing({100: 10_000, 200: 40_000}, 90_000) is None   # nothing known over
    True
    """
    fit = [x for x, v in bounds.items() if v <= budget]
    if not fit:
        return None
    lo = max(fit)
    over = [x for x, v in bounds.items() if v > budget and x > lo]
    if not over:
        return None
    hi = min(over)
    middle = [x for x in bounds if x not in (lo, hi)]  # the parabola through lo, hi, the nearest
    near = ([min(middle, key=lambda x: 0 if lo < x < hi else min(abs(x - lo), abs(x - hi)))]
            if middle else [])
    guess = crossing_of(sorted((x, float(bounds[x])) for x in [lo, hi, *near]), budget)
    return int(guess) if guess is not None and lo <= guess <= hi else None


def largest_fitting(lo: int, hi: int, bound: Callable[[int], Optional[int]], budget: int,
                    known: Iterable[int] = ()) -> int:
    """Largest ``x`` in ``[lo, hi]`` with ``bound(x) <= budget`` (``None``: over), given that ``lo``
    fits and the bound grows with ``x``: ``hi`` first, then the free (cached) points ``known``, then
    :func:`~lightning_seqmem.core.search.interpolated_last`.

    >>> largest_fitting(1, 10, lambda x: x, budget=100)   # hi fits: one call
    10
    >>> largest_fitting(1, 64, lambda x: 2 ** x, budget=1000)   # far from quadratic: still exact
    9
    """
    values: dict[int, float] = {}

    def value(x: int) -> float:
        if x not in values:
            answer = bound(x)
            values[x] = math.inf if answer is None else float(answer)
        return values[x]

    if hi <= lo or value(hi) <= budget:
        return max(lo, hi)
    value(lo)  # (the caller's, cached)
    for x in set(known):  # cached points: free
        if lo < x < hi:
            value(x)
    return interpolated_last(value, budget, lo, hi, dict(values))


CONFIRM_SLACK = 0.01
"""How far below the budget :func:`confirmed_largest` aims, so its dry run fits: a fraction of the
bytes' growth from the shortest known length (~half that of the length); refits need twice that."""


def fitted_bytes(points: Mapping[int, int], x: int) -> Optional[float]:
    """Bytes at length ``x`` of the parabola through the 3 ``points`` (length -> bytes) nearest it
    (``p + q·L²`` through 2; None with fewer), clamped between known neighbours: exact at points.

    >>> peak = {L: 1_000 + 3 * L * L for L in (100, 200, 400)}
    >>> fitted_bytes(peak, 300), 1_000 + 3 * 300 * 300   # a quadratic: exact between the points
    (271000.0, 271000)
    >>> fitted_bytes(peak, 800) == 1_000 + 3 * 800 * 800, fitted_bytes({64: 5}, 128) is None
    (True, True)
    """
    known = sorted((int(L), float(v)) for L, v in points.items() if v is not None)
    if len(known) < 2:
        return None
    x = int(x)
    exact = dict(known)
    if x in exact:
        return exact[x]
    near = sorted(sorted(known, key=lambda p: (abs(p[0] - x), p[0]))[:3])
    if len(near) == 3:
        (x0, y0), (x1, y1), (x2, y2) = near
        value = (y0 * (x - x1) * (x - x2) / ((x0 - x1) * (x0 - x2))
                 + y1 * (x - x0) * (x - x2) / ((x1 - x0) * (x1 - x2))
                 + y2 * (x - x0) * (x - x1) / ((x2 - x0) * (x2 - x1)))
    else:
        (x0, y0), (x1, y1) = near
        q = (y1 - y0) / (x1 * x1 - x0 * x0)
        value = y0 + q * (x * x - x0 * x0)
    value = max([value] + [v for L, v in known if L < x])
    return min([value] + [v for L, v in known if L > x])


def fitted_largest(points: Mapping[int, int], budget: int, lo: int, hi: int, step: int = 1) -> int:
    """Largest multiple of ``step`` in ``[lo, hi]`` whose :func:`fitted_bytes` fits, else ``lo``.

    >>> fitted_largest({L: 1_000 + 3 * L * L for L in (256, 512)}, 3_000_000, 512, 4096)   # 999.8
    999
    >>> two = {256: 10, 512: 20}
    >>> fitted_largest(two, 10_000, 512, 4096, step=64), fitted_largest(two, 15, 512, 4096)
    (4096, 512)
    """
    def fits(x: int) -> bool:
        v = fitted_bytes(points, x)
        return v is not None and v <= budget

    lo_k, hi_k = max(1, -(-int(lo) // step)), int(hi) // step
    if hi_k < lo_k:
        return int(lo)
    if fits(hi_k * step):
        return hi_k * step
    if not fits(lo_k * step):
        return int(lo)
    return max(int(lo), bisect_last(lambda k: fits(k * step), lo_k, hi_k) * step)


def confirmed_largest(lo: int, hi: int, bound: Callable[[int], Optional[int]], budget: int,
                      known: Mapping[int, int], step: int = 1, tries: int = 2,
                      slack: float = CONFIRM_SLACK) -> int:
    """A large multiple of ``step`` in ``[lo, hi]`` whose ``bound`` fits ``budget`` (else ``lo``,
    which fits): :func:`fitted_largest` of the cached ``known`` aimed ``slack`` low, checked by one
    ``bound`` call; it guesses again (``tries`` in all) where a refit differs by over ``2·slack``.

    >>> peak = lambda L: 1_000 + 3 * L * L   # the largest to fit 3 MB: 999; aimed 1% below
    >>> calls = []
    >>> def bound(L):
    ...     calls.append(L)
    ...     return peak(L)
    >>> confirmed_largest(512, 4096, bound, 3_000_000, {L: peak(L) for L in (256, 512)}), calls
    (995, [995])
    """
    anchors = {int(L): int(v) for L, v in known.items() if v is not None}  # for the guesses only

    def fits(x: int) -> bool:  # the answer's own bound, always (cached by the caller where it ran)
        v = bound(x)
        if v is not None:
            anchors[x] = int(v)
        return v is not None and v <= budget

    if hi <= lo:
        return max(lo, hi)
    best = lo
    for _ in range(tries):
        floor = min(anchors.values(), default=budget)  # what does not grow with the length, about
        aim = int(budget - slack * max(0, budget - floor))
        guess = fitted_largest(_spread_out(anchors), aim, best, hi, step)
        if guess <= best or (best > lo and guess <= best * (1 + 2 * slack)):  # the refit agrees
            break
        if fits(guess):
            best = guess
        else:
            hi = guess - 1
    return best


def _spread_out(points: Mapping[int, int], ratio: float = 1.25) -> dict[int, int]:
    """``points`` from the longest down, each kept ``ratio`` shorter than the last kept (close
    points make a parabola's extrapolation noisy); the shortest too where no other was kept.

    >>> sorted(_spread_out({100: 1, 110: 2, 200: 3, 240: 4, 250: 5}))
    [110, 200, 250]
    >>> sorted(_spread_out({500: 1, 505: 2, 512: 3}))
    [500, 512]
    """
    kept: dict[int, int] = {}
    for L in sorted(points, reverse=True):
        if not kept or L * ratio <= min(kept):
            kept[L] = points[L]
    if len(kept) < 2 <= len(points):  # all of them close: the widest pair
        kept[min(points)] = points[min(points)]
    return kept
