"""Searches for the largest length and the smallest world size that fit: bisection, and guesses
from known points (:func:`interpolated_last`). Predicates are monotone (a peak never falls as L
grows; more ranks never hurt); each asks as few times as a bisection must; callers cache dry runs.

Example:
    >>> largest_fitting(lambda L: 3 * L * L <= 10_000)  # 57² · 3 = 9747, 58² · 3 = 10092
    57
    >>> largest_fitting(lambda L: L <= 1000, step=64, high=4096)
    960
    >>> smallest_fitting(lambda n: 800 // n <= 250, [1, 2, 4, 8])
    4
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

UNBOUNDED_SEQ_LEN = 2**31 - 1
"""Answer of :func:`largest_fitting` (and every ``max_seq_len``) when nothing up to it is over."""


def bisect_last(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """Largest ``x`` in ``[lo, hi)`` with ``fits(x)``, given ``fits(lo)`` and not ``fits(hi)``
    (neither is asked: either may be a sentinel).

    Example:
        >>> bisect_last(lambda x: x * x <= 50, 0, 100)
        7
    """
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def largest_fitting(fits: Callable[[int], bool], *, low: int = 1, high: Optional[int] = None,
                    step: int = 1, hint: Optional[int] = None,
                    limit: int = UNBOUNDED_SEQ_LEN) -> int:
    """Largest multiple of ``step`` in ``[low, high)`` that ``fits``; 0 when ``low`` (rounded up)
    does not. With ``high`` the largest candidate is asked first; without, the search doubles from
    ``hint`` (default ``2·low``) until one does not fit, returning ``limit`` if all up to it fit.

    Example:
        >>> largest_fitting(lambda L: L <= 5, hint=4)
        5
        >>> largest_fitting(lambda L: True, high=100, step=8)
        96
        >>> largest_fitting(lambda L: L < 10, low=16, step=16)
        0
    """
    if step < 1 or low < 1:
        raise ValueError(f"`step` and `low` must be positive, got step={step!r}, low={low!r}")
    u_lo = -(-low // step)
    if not fits(u_lo * step):
        return 0
    if high is not None:
        u_hi = (high - 1) // step  # the largest candidate
        if u_hi <= u_lo:
            return u_lo * step
        if fits(u_hi * step):
            return u_hi * step
        return bisect_last(lambda u: fits(u * step), u_lo, u_hi) * step
    u_limit = limit // step
    u_hi = max(u_lo + 1, -(-hint // step) if hint else 2 * u_lo)
    while u_hi < u_limit and fits(u_hi * step):
        u_lo, u_hi = u_hi, 2 * u_hi
    if u_hi >= u_limit:
        if fits(u_limit * step):
            return limit
        u_hi = u_limit
    return bisect_last(lambda u: fits(u * step), u_lo, u_hi) * step


def crossing_of(points: Sequence[tuple[int, float]], limit: float) -> Optional[float]:
    """Where the curve through ``points`` (2 or 3 ascending ``(x, value)``) reaches ``limit``: the
    root nearest the points of the parabola through three (else of the line through the outer two),
    of ``p + q·x²`` through two (else of their line); None where flat.

    >>> crossing_of([(100, 10_000.0), (200, 40_000.0), (400, 160_000.0)], 90_000)  # 1·L²
    300.0
    >>> crossing_of([(100, 10_000.0), (400, 160_000.0)], 90_000)  # p + q·L² through two
    300.0
    """
    two = len(points) == 2
    if len(points) >= 3:
        (x0, y0), (x1, y1), (x2, y2) = points[:3]
        # Newton's form: y = y0 + d1 (x - x0) + d2 (x - x0)(x - x1)
        d1 = (y1 - y0) / (x1 - x0)
        d2 = ((y2 - y1) / (x2 - x1) - d1) / (x2 - x0)
        a, b, c = d2, d1 - d2 * (x0 + x1), y0 - d1 * x0 + d2 * x0 * x1 - limit
        if abs(a) > 1e-12 * max(1.0, abs(b)):
            disc = b * b - 4 * a * c
            if disc >= 0:
                roots = [(-b + sign * disc ** 0.5) / (2 * a) for sign in (1, -1)]
                centre = sum(x for x, _ in points[:3]) / 3
                return min(roots, key=lambda r: abs(r - centre))
    (x0, y0), (x1, y1) = points[0], points[-1]  # the outer two
    if y1 == y0:
        return None
    if two and min(x0, x1) >= 0 and x0 != x1 and (y1 - y0) * (x1 - x0) > 0:  # p + q·x² through both
        q = (y1 - y0) / (x1 * x1 - x0 * x0)
        square = (limit - (y0 - q * x0 * x0)) / q
        if square >= 0:
            return square ** 0.5
    return x0 + (limit - y0) * (x1 - x0) / (y1 - y0)


def interpolated_last(value: Callable[[int], float], limit: float, lo: int, hi: int,
                      known: Optional[dict[int, float]] = None) -> int:
    """Largest ``x`` in ``[lo, hi)`` with ``value(x) <= limit`` (:func:`bisect_last`'s answer;
    ``value`` never falls as ``x`` grows) in far fewer asks where ``value`` is smooth: each guess
    interpolates the known values (``known``: ``x -> value``, extended by every answer) nearest the
    bracket; one not halving it is followed by its midpoint: at most ~twice a bisection's asks.

    Example:
        >>> asked = []
        >>> def peak(x):
        ...     asked.append(x)
        ...     return 100 + 3 * x + 0.01 * x * x
        >>> known = {x: 100 + 3 * x + 0.01 * x * x for x in (1024, 2048, 4096)}  # all over
        >>> interpolated_last(peak, 10_000, 0, 4096, known), asked  # bisection: 10 questions
        (856, [856, 857])
    """
    known = dict(known or {})

    def ask(x: int) -> float:
        if x not in known:
            known[x] = float(value(x))
        return known[x]

    lo = max([lo] + [x for x, v in known.items() if lo < x < hi and v <= limit])
    hi = min([hi] + [x for x, v in known.items() if lo < x < hi and v > limit])
    while hi - lo > 1:
        near = sorted(known, key=lambda x: (0 if lo <= x <= hi else 1, abs(x - (lo + hi) / 2)))[:3]
        guess = (crossing_of(sorted((x, known[x]) for x in near), limit) if len(near) >= 2
                 else None)
        x = (lo + hi) // 2 if guess is None or not math.isfinite(guess) else int(guess)
        x = min(max(x, lo + 1), hi - 1)
        width = hi - lo
        if ask(x) <= limit:
            lo = x
            if x + 1 < hi and ask(x + 1) > limit:
                hi = x + 1
        else:
            hi = x
            if x - 1 > lo and ask(x - 1) <= limit:
                lo = x - 1
        if hi - lo > 1 and hi - lo > width // 2:  # the guess was poor: halve the bracket once
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ask(mid) <= limit else (lo, mid)
    return lo


def smallest_fitting(fits: Callable[[int], bool], candidates: Sequence[int]) -> Optional[int]:
    """The smallest of ``candidates`` (ascending) that ``fits``, or None; the last is asked first.

    Example:
        >>> asked = []
        >>> smallest_fitting(lambda n: asked.append(n) or n >= 3, [1, 2, 4, 8]), asked
        (4, [8, 2, 4])
    """
    if not candidates or not fits(candidates[-1]):
        return None
    first = bisect_last(lambda i: not fits(candidates[i]), -1, len(candidates) - 1) + 1
    return candidates[first]


__all__ = ["UNBOUNDED_SEQ_LEN", "bisect_last", "crossing_of", "interpolated_last",
           "largest_fitting", "smallest_fitting"]
