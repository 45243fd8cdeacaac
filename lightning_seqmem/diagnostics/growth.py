"""How a part of the memory grows with the sequence length L: constant, linear or quadratic.

Pure maths on measured sizes (bytes): :func:`fit_growth` fits ``c0 + c1·L + c2·L²``,
:func:`classify_growth` names the highest-degree term present, :func:`crossover_length` finds the
length beyond which one polynomial outgrows another, and :func:`is_quadratic_shape` tells an L×L
tensor by its shape. No tracing, no model.

Example:
    >>> (classify_growth([64, 128], [3 * 64**2, 3 * 128**2]),
    ...  crossover_length((0, 0, 1), (0, 64, 0)))
    ('quadratic', 64.0)
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

__all__ = ["GROWTHS", "classify_growth", "crossover_length", "fit_growth", "is_quadratic_shape",
           "polynomial_at"]

GROWTHS = ("constant", "linear", "quadratic")
"""Growth classes, by degree."""


def is_quadratic_shape(shape: Sequence[int], seq_len: int) -> bool:
    """Whether a tensor of ``shape`` has two or more dimensions equal to ``seq_len``.

    Example:
        >>> is_quadratic_shape((2, 4, 48, 48), 48), is_quadratic_shape((2, 48, 64), 48)
        (True, False)
    """
    return sum(1 for d in shape if d == seq_len) >= 2


def fit_growth(seq_lens: Sequence[float], sizes: Sequence[float]) -> tuple[float, float, float]:
    """Coefficients ``(c0, c1, c2)`` of ``size ≈ c0 + c1·L + c2·L²`` through measured sizes. Three
    or more lengths: least squares. Two: a single term ``c_p·L^p`` (p = 0, 1 or 2) when it goes
    through both points (within 0.1%), else the two terms that bracket the observed growth exponent
    (constant + linear below 1, linear + quadratic above).

    Example:
        >>> fit_growth([64, 128], [100 * 64**2, 100 * 128**2])
        (0.0, 0.0, 100.0)
        >>> sizes = [7 + 3 * L + 0.5 * L * L for L in (10, 20, 40)]
        >>> [round(c, 6) for c in fit_growth([10, 20, 40], sizes)]
        [7.0, 3.0, 0.5]
    """
    L = np.asarray(seq_lens, dtype=np.float64)
    s = np.asarray(sizes, dtype=np.float64)
    if L.shape != s.shape or L.ndim != 1:
        raise ValueError(
            f"`seq_lens` and `sizes` must be 1-D of one length, got {L.shape} and {s.shape}")
    unique = np.unique(L)
    if len(unique) < 2 or np.any(L <= 0):
        raise ValueError(f"`seq_lens` must hold two or more distinct positive lengths, got "
                         f"{list(seq_lens)}")
    if not np.any(s):
        return (0.0, 0.0, 0.0)
    if len(unique) >= 3:
        scale = L.max()
        x = L / scale
        vander = np.stack([np.ones_like(x), x, x * x], axis=1)
        sol, *_ = np.linalg.lstsq(vander, s, rcond=None)
        return (float(sol[0]), float(sol[1] / scale), float(sol[2] / scale**2))
    s = np.array([s[L == u].mean() for u in unique])
    (L1, L2), (s1, s2) = unique, s
    for p in (0, 1, 2):
        a, b = s1 / L1**p, s2 / L2**p
        if abs(a - b) <= 1e-3 * max(abs(a), abs(b)):
            coeffs = [0.0, 0.0, 0.0]
            coeffs[p] = float((a + b) / 2)
            return tuple(coeffs)  # type: ignore[return-value]
    if s1 > 0 and s2 > 0 and math.log(s2 / s1) / math.log(L2 / L1) > 1:
        # c1·L + c2·L² through both points
        c2 = (s2 / L2 - s1 / L1) / (L2 - L1)
        return (0.0, float(s1 / L1 - c2 * L1), float(c2))
    c1 = (s2 - s1) / (L2 - L1)
    return (float(s1 - c1 * L1), float(c1), 0.0)


def classify_growth(seq_lens: Sequence[float], sizes: Sequence[float],
                    rel_tol: float = 0.02) -> str:
    """``"constant"``, ``"linear"`` or ``"quadratic"``: the highest-degree term present (terms
    assumed non-negative). Two lengths: ``constant`` if the size changes by at most ``rel_tol``,
    ``quadratic`` if it grows faster than L (ratio above ``(L2/L1)·(1 + rel_tol)``), else
    ``linear``. Three or more: the highest-degree term of :func:`fit_growth` contributing at least
    ``rel_tol`` of the largest size at the longest length (the two-length rule on the two longest
    when the fit misses a point by more than 5%).

    Example:
        >>> classify_growth([64, 128], [5, 5]), classify_growth([64, 128], [100 + 64, 100 + 128])
        ('constant', 'linear')
        >>> classify_growth([64, 128, 256], [1000 + L * L for L in (64, 128, 256)])
        'quadratic'
    """
    L = np.asarray(seq_lens, dtype=np.float64)
    s = np.asarray(sizes, dtype=np.float64)
    order = np.argsort(L)
    L, s = L[order], s[order]
    c = fit_growth(L, s)
    if not np.any(s):
        return "constant"
    big = float(np.abs(s).max())
    fitted = c[0] + c[1] * L + c[2] * L * L
    Lmax = L[-1]
    terms = [abs(c[0]), abs(c[1]) * Lmax, abs(c[2]) * Lmax**2]  # each term at the longest length
    if len(np.unique(L)) >= 3 and np.abs(fitted - s).max() <= 0.05 * big:
        for p in (2, 1):
            if terms[p] >= rel_tol * big:
                return GROWTHS[p]
        return "constant"
    (L1, s1), (L2, s2) = (L[-2], s[-2]), (L[-1], s[-1])
    if L1 == L2:
        L1, s1 = L[0], s[0]
    if s1 <= 0 or s2 <= 0:  # appears or vanishes between lengths: judge by the fitted terms
        return GROWTHS[int(np.argmax(terms))]
    ratio = s2 / s1
    if abs(ratio - 1) <= rel_tol:
        return "constant"
    return "quadratic" if ratio > (L2 / L1) * (1 + rel_tol) else "linear"


def polynomial_at(coefficients: Sequence[float], seq_len: float) -> float:
    """``c0 + c1·L + c2·L²`` (``coefficients`` as :func:`fit_growth` gives them) at ``seq_len``."""
    return sum(c * seq_len**p for p, c in enumerate(coefficients))


def crossover_length(attention: Sequence[float], rest: Sequence[float]) -> Optional[float]:
    """The length beyond which ``attention(L) > rest(L)`` for every larger L, both ``(c0, c1, c2)``
    coefficients (bytes = c0 + c1·L + c2·L²): ``0.0`` when attention already dominates at every
    positive length, ``None`` when it never comes to (its leading term is not larger).

    Example:
        >>> crossover_length((0, 10, 1), (0, 100, 0))   # 10L + L² = 100L at L = 90
        90.0
        >>> crossover_length((0, 10, 0), (0, 100, 0)) is None
        True
    """
    a = np.asarray(attention, dtype=np.float64)
    r = np.asarray(rest, dtype=np.float64)
    if a.shape != (3,) or r.shape != (3,):
        raise ValueError(f"coefficients must be (c0, c1, c2), got {tuple(attention)!r} and "
                         f"{tuple(rest)!r}")
    d0, d1, d2 = a - r
    if abs(d2) <= 1e-12 * (abs(a[2]) + abs(r[2])):
        d2 = 0.0
    if abs(d1) <= 1e-12 * (abs(a[1]) + abs(r[1])):
        d1 = 0.0
    if d2 < 0 or (d2 == 0 and d1 < 0) or (d2 == 0 and d1 == 0 and d0 <= 0):
        return None
    if d2 == 0 and d1 == 0:
        return 0.0
    roots = np.roots([d2, d1, d0]) if d2 else np.array([-d0 / d1])
    real = [float(x.real) for x in np.atleast_1d(roots)
            if abs(x.imag) <= 1e-9 * max(1.0, abs(x.real))]
    return max([0.0] + real)
