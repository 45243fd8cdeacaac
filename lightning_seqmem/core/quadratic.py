"""Quadratic memory model: fit, predict and invert ``M(L, B) = C + B·(a·L + b·L²)`` per phase.

Fitted with ``a, b ≥ 0`` separately for every phase (forward, backward, optimizer step, ...);
the step peak is the maximum over phases. ``C`` is constant memory (weights, grads, optimizer
state), ``a`` activations linear in ``L``, ``b`` the attention scores ``[B, heads, L, L]``. Bytes.

A fit on short lengths can under-predict a long one by 30% (the moment of the peak moves as ``L``
grows, see DESIGN.md), so forecasts carry an upper bound: the larger of ``z`` OLS prediction
standard errors and ``min_relative_uncertainty`` times the dynamic bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

import numpy as np

from lightning_seqmem.core.checks import check_int
from lightning_seqmem.core.search import UNBOUNDED_SEQ_LEN, largest_fitting

DEFAULT_PHASE = "step"
"""Phase name used when points carry a single peak (an int) instead of a phase mapping."""

# Candidate active sets (columns of [1, B·L, B·L²] left free); the others are pinned at 0.
_FULL, _QUADRATIC_ONLY, _LINEAR_ONLY, _CONST_ONLY = (0, 1, 2), (0, 2), (0, 1), (0,)
_ZERO_COV = ((0.0, 0.0, 0.0),) * 3


@dataclass(frozen=True)
class QuadraticCoefficients:
    """Fitted ``M(L, B) = C + B·(a·L + b·L²)`` of one phase, in bytes.

    Example:
        >>> coef = QuadraticCoefficients(1e6, 3e3, 40.0, residual_std_bytes=0.0, num_points=3)
        >>> coef.dynamic_bytes(seq_len=100, batch_size=2)
        1400000.0
        >>> coef.predict_bytes(seq_len=100, batch_size=2)
        2400000.0
    """

    const_bytes: float  # C: memory that does not depend on L or B (weights, grads, optimizer)
    linear_bytes_per_token: float  # a: bytes per token per sample (≥ 0)
    quadratic_bytes_per_token2: float  # b: bytes per token² per sample (≥ 0), attention scores
    residual_std_bytes: float  # sqrt(SSE / (n - p)); 0.0 when there is no degree of freedom
    num_points: int  # measurements used (duplicates included)
    # Covariance of (C, a, b) in bytes² (rows/cols of pinned coefficients are 0), for the OLS
    # standard error of a prediction; all zeros when there is no degree of freedom.
    covariance: tuple[tuple[float, ...], ...] = field(default=_ZERO_COV, repr=False)

    def dynamic_bytes(self, seq_len: float, batch_size: float) -> float:
        """``B·(a·L + b·L²)``: the part of the peak that depends on the input size."""
        a, b = self.linear_bytes_per_token, self.quadratic_bytes_per_token2
        return float(batch_size) * (a * seq_len + b * float(seq_len) ** 2)

    def predict_bytes(self, seq_len: float, batch_size: float) -> float:
        """Point prediction ``C + B·(a·L + b·L²)``."""
        return self.const_bytes + self.dynamic_bytes(seq_len, batch_size)

    def prediction_std_bytes(self, seq_len: float, batch_size: float) -> float:
        """OLS standard error of the prediction, ``sqrt(x0ᵀ·Cov·x0)``, ``x0 = [1, B·L, B·L²]``."""
        x0 = _design_row(seq_len, batch_size)
        return math.sqrt(max(0.0, float(x0 @ np.asarray(self.covariance, dtype=float) @ x0)))


@dataclass(frozen=True)
class QuadraticForecast:
    """Predicted peak at one ``(seq_len, batch_size)``; budget against ``upper_bytes``."""

    seq_len: int
    batch_size: int
    peak_bytes: int  # max over phases of the point prediction, rounded up
    upper_bytes: int  # max over phases of the conservative upper bound (≥ peak_bytes)
    uncertainty_bytes: int  # upper_bytes - peak_bytes
    peak_phase: str  # phase holding peak_bytes
    phase_peak_bytes: dict[str, int]  # point prediction per phase, rounded up
    method: str = "quadratic"


class QuadraticMemoryModel:
    """Per-phase quadratic memory model with non-negative ``a``, ``b`` and conservative bounds.

    Args:
        min_relative_uncertainty: floor of the upper bound, as a fraction of the dynamic bytes
            (the article accepts a prediction within 15%).
        confidence_z: number of OLS prediction standard errors added for the upper bound.

    Example:
        >>> points = [(L, 2, 1_000_000 + 2 * (3_000 * L + 40 * L * L)) for L in (128, 256, 512)]
        >>> model = QuadraticMemoryModel().fit(points)
        >>> round(model.coefficients["step"].quadratic_bytes_per_token2, 6)
        40.0
        >>> forecast = model.predict(2048, batch_size=2)
        >>> forecast.peak_phase, round(forecast.peak_bytes / 2**20, 1)
        ('step', 332.7)
        >>> model.max_seq_len(2**30, batch_size=2, conservative=False)
        3624
    """

    def __init__(self, min_relative_uncertainty: float = 0.15, confidence_z: float = 2.0) -> None:
        self.min_relative_uncertainty = _check_non_negative("min_relative_uncertainty",
                                                            min_relative_uncertainty)
        self.confidence_z = _check_non_negative("confidence_z", confidence_z)
        self._coefficients: dict[str, QuadraticCoefficients] = {}

    @property
    def is_fitted(self) -> bool:
        return bool(self._coefficients)

    def _check_fitted(self) -> None:
        if not self.is_fitted:
            raise RuntimeError("QuadraticMemoryModel is not fitted: call `fit(points)` first")

    @property
    def phases(self) -> tuple[str, ...]:
        return tuple(self._coefficients)

    @property
    def coefficients(self) -> dict[str, QuadraticCoefficients]:
        return dict(self._coefficients)

    def fit(self, points: Iterable[tuple[int, int, Any]]) -> QuadraticMemoryModel:
        """Fit every phase from ``(seq_len, batch_size, peak)`` points; returns ``self``.

        ``peak`` is a byte count (one phase, ``"step"``) or a mapping phase name → bytes, with the
        same keys in every point; a ``None`` value means that phase was not measured there."""
        rows: list[tuple[int, int, Mapping[str, Any]]] = []
        phase_names: Optional[tuple[str, ...]] = None
        for point in points:
            seq_len, batch_size, peak = point
            check_int("seq_len", seq_len)
            check_int("batch_size", batch_size)
            peaks = peak if isinstance(peak, Mapping) else {DEFAULT_PHASE: peak}
            names = tuple(peaks)
            if phase_names is None:
                phase_names = names
            elif set(names) != set(phase_names):
                raise ValueError(f"every point must have the phases {list(phase_names)}, got "
                                 f"{list(names)}")
            for name, value in peaks.items():
                if not isinstance(name, str):
                    raise ValueError(f"phase names must be str, got {name!r}")
                if value is not None:
                    _check_non_negative(f"peak[{name!r}]" if isinstance(peak, Mapping) else "peak",
                                        value)
            rows.append((int(seq_len), int(batch_size), peaks))
        if phase_names is None:
            raise ValueError("need at least 2 distinct (seq_len, batch_size) points, got 0")
        fitted = {}
        for name in phase_names:
            measured = [(s, b, float(p[name])) for s, b, p in rows if p[name] is not None]
            try:
                fitted[name] = _fit_phase(measured)
            except ValueError as err:
                if len(phase_names) == 1:
                    raise
                raise ValueError(f"phase {name!r}: {err}") from None
        self._coefficients = fitted
        return self

    def predict(self, seq_len: int, batch_size: int = 1) -> QuadraticForecast:
        """Point and upper-bound peak at ``(seq_len, batch_size)``, maximised over phases."""
        self._check_fitted()
        check_int("seq_len", seq_len)
        check_int("batch_size", batch_size)
        phase_peak_bytes, peak_phase, peak, upper = {}, "", -math.inf, 0.0
        for name, coef in self._coefficients.items():
            point = max(0.0, coef.predict_bytes(seq_len, batch_size))
            margin = max(
                self.confidence_z * coef.prediction_std_bytes(seq_len, batch_size),
                self.min_relative_uncertainty * coef.dynamic_bytes(seq_len, batch_size),
            )
            phase_peak_bytes[name] = math.ceil(point)
            upper = max(upper, point + margin)
            if point > peak:
                peak_phase, peak = name, point
        peak_bytes, upper_bytes = math.ceil(peak), math.ceil(upper)
        return QuadraticForecast(seq_len=int(seq_len), batch_size=int(batch_size),
                                 peak_bytes=peak_bytes, upper_bytes=upper_bytes,
                                 uncertainty_bytes=upper_bytes - peak_bytes,
                                 peak_phase=peak_phase, phase_peak_bytes=phase_peak_bytes)

    def max_seq_len(self, budget_bytes: int, batch_size: int = 1, conservative: bool = True) -> int:
        """Largest ``L ≥ 1`` whose forecast fits ``budget_bytes``; 0 if ``L = 1`` does not fit.

        Compares ``upper_bytes`` (``conservative=True``) or ``peak_bytes``, as :meth:`predict`
        rounds them. :data:`UNBOUNDED_SEQ_LEN` when no phase depends on ``L``."""
        check_int("budget_bytes", budget_bytes)
        check_int("batch_size", batch_size)
        self._check_fitted()

        def fits(seq_len: int) -> bool:
            forecast = self.predict(seq_len, batch_size)
            return (forecast.upper_bytes if conservative else forecast.peak_bytes) <= budget_bytes

        # the point prediction's closed form (a lower bound of the upper bound) brackets the answer
        estimate = min(_largest_len_below(c, budget_bytes, batch_size)
                       for c in self._coefficients.values())
        return largest_fitting(fits, hint=int(min(estimate + 2.0, UNBOUNDED_SEQ_LEN)))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able state (for checkpoints and reports)."""
        return {
            "min_relative_uncertainty": self.min_relative_uncertainty,
            "confidence_z": self.confidence_z,
            "phases": {name: {"const_bytes": c.const_bytes,
                              "linear_bytes_per_token": c.linear_bytes_per_token,
                              "quadratic_bytes_per_token2": c.quadratic_bytes_per_token2,
                              "residual_std_bytes": c.residual_std_bytes,
                              "num_points": c.num_points,
                              "covariance": [list(row) for row in c.covariance]}
                       for name, c in self._coefficients.items()},
        }

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> QuadraticMemoryModel:
        """Inverse of :meth:`to_dict`; missing keys take their defaults (an unfitted model)."""
        model = cls(state.get("min_relative_uncertainty", 0.15), state.get("confidence_z", 2.0))
        for name, c in (state.get("phases") or {}).items():
            model._coefficients[name] = QuadraticCoefficients(
                const_bytes=float(c["const_bytes"]),
                linear_bytes_per_token=float(c["linear_bytes_per_token"]),
                quadratic_bytes_per_token2=float(c["quadratic_bytes_per_token2"]),
                residual_std_bytes=float(c.get("residual_std_bytes", 0.0)),
                num_points=int(c.get("num_points", 0)),
                covariance=tuple(tuple(float(v) for v in row)
                                 for row in c.get("covariance", _ZERO_COV)),
            )
        return model


def _design_row(seq_len: float, batch_size: float) -> np.ndarray:
    return np.array([1.0, float(batch_size) * seq_len, float(batch_size) * float(seq_len) ** 2])


def _fit_phase(points: list[tuple[int, int, float]]) -> QuadraticCoefficients:
    """Least squares on ``[1, B·L, B·L²]`` with ``a, b ≥ 0`` by enumerating the active sets."""
    num_distinct = len({(s, b) for s, b, _ in points})
    if num_distinct < 2:
        raise ValueError("need at least 2 distinct (seq_len, batch_size) points, got "
                         f"{num_distinct}")
    x = np.array([_design_row(s, b) for s, b, _ in points])
    y = np.array([p for _, _, p in points])
    # Normalise columns and target: bytes reach 1e11 and B·L² reaches 1e10.
    x_scale = np.abs(x).max(axis=0)
    y_scale = float(np.abs(y).max()) or 1.0
    xn, yn = x / x_scale, y / y_scale
    # With 2 distinct points only 2 parameters: the article's C + b·B·L², else C + a·B·L, else C.
    candidates = (_FULL, _QUADRATIC_ONLY, _LINEAR_ONLY, _CONST_ONLY)
    candidates = candidates[1:] if num_distinct == 2 else candidates
    best: Optional[tuple[float, tuple[int, ...], np.ndarray]] = None
    for active in candidates:
        xa = xn[:, active]
        if np.linalg.matrix_rank(xa) < len(active):
            continue
        beta = np.linalg.lstsq(xa, yn, rcond=None)[0]
        if np.any(beta[1:] < 0):
            continue
        sse = float(np.sum((yn - xa @ beta) ** 2))
        if best is None or sse < best[0]:
            best = (sse, active, beta)
            if num_distinct == 2:
                break  # preference order, not least residual: both 2-parameter fits are exact
    assert best is not None, "the constant-only fit is always feasible"
    sse, active, beta = best
    coef = np.zeros(3)
    coef[list(active)] = beta * y_scale / x_scale[list(active)]
    dof = len(points) - len(active)
    residual_std = math.sqrt(sse / dof) * y_scale if dof > 0 else 0.0
    cov = np.zeros((3, 3))
    if dof > 0:
        xa = xn[:, active]
        cov_n = (sse / dof) * np.linalg.inv(xa.T @ xa)
        idx = np.ix_(active, active)
        cov[idx] = cov_n * y_scale**2 / np.outer(x_scale[list(active)], x_scale[list(active)])
    return QuadraticCoefficients(const_bytes=float(coef[0]), linear_bytes_per_token=float(coef[1]),
                                 quadratic_bytes_per_token2=float(coef[2]),
                                 residual_std_bytes=residual_std, num_points=len(points),
                                 covariance=tuple(tuple(float(v) for v in row) for row in cov))


def _largest_len_below(coef: QuadraticCoefficients, budget_bytes: int, batch_size: int) -> float:
    """Real root of ``C + B·(a·L + b·L²) = budget`` (``inf`` if ``a = b = 0``), stable form."""
    room = (budget_bytes - coef.const_bytes) / batch_size
    if room <= 0:
        return 0.0
    a, b = coef.linear_bytes_per_token, coef.quadratic_bytes_per_token2
    denominator = a + math.sqrt(a * a + 4.0 * b * room)
    return 2.0 * room / denominator if denominator > 0 else math.inf


def _check_non_negative(name: str, value: Any) -> float:
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:
        raise ValueError(f"`{name}` must be a non-negative finite number, got {value!r}")
    return float(value)
