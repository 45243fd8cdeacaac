"""The forecaster: both predictors behind one question, "what will the peak be at (L, B)?".

:class:`MemoryForecaster` collects measured points (for the quadratic model) and traced steps
(for the timeline replay), fits lazily, answers with the best method available, and learns from
every verification: an under-prediction at a newly measured length widens later upper bounds.

Example:
    >>> f = MemoryForecaster()
    >>> for seq_len, peak in [(128, 12_100_000), (256, 28_200_000), (512, 87_200_000)]:
    ...     f.add_measurement(seq_len, 4, {"step": peak})
    >>> fc = f.forecast(1024, 4)
    >>> fc.method, fc.peak_bytes < fc.upper_bytes
    ('quadratic', True)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

from lightning_seqmem.core.quadratic import QuadraticMemoryModel
from lightning_seqmem.core.search import largest_fitting
from lightning_seqmem.core.records import TrackedEvents
from lightning_seqmem.core.timeline import TimelineModel, Trace

METHODS = ("replay", "quadratic")


class NotEnoughMeasurements(RuntimeError):
    """Raised by :meth:`MemoryForecaster.forecast` before two lengths have been measured."""


@dataclass(frozen=True)
class Forecast:
    """A predicted step peak at ``(seq_len, batch_size)``, bytes. ``upper_bytes`` is what to budget
    against (≥ ``peak_bytes``). ``reserved_upper_bytes`` adds the allocator's fragmentation measured
    so far (CUDA; ``upper_bytes`` elsewhere): OOM happens at the reserved level. ``method`` is
    ``"replay"`` or ``"quadratic"``; ``detail`` says why."""

    seq_len: int
    batch_size: int
    peak_bytes: int
    upper_bytes: int
    reserved_upper_bytes: int
    method: str
    phase_peak_bytes: dict[str, int]
    detail: str = ""


@dataclass(frozen=True)
class Verification:
    """A forecast compared with the measurement of the same ``(seq_len, batch_size)``."""

    seq_len: int
    batch_size: int
    method: str
    forecast_bytes: int
    measured_bytes: int

    @property
    def relative_error(self) -> float:
        """(forecast − measured) / measured: negative is an under-prediction."""
        return (self.forecast_bytes - self.measured_bytes) / max(self.measured_bytes, 1)


class MemoryForecaster:
    """Measured points + traces → forecasts, with verification-driven uncertainty.

    Args:
        tolerance: relative error accepted at verification; also the quadratic model's minimum
            relative uncertainty on the dynamic (L-dependent) bytes.
        replay_margin: minimum relative margin added to replayed peaks (the replay is exact on the
            CPU tracker; on CUDA the allocator adds block rounding and workspace).
        max_traces: traced steps kept for the replay (the shortest lengths are kept).
    """

    def __init__(self, tolerance: float = 0.15, replay_margin: float = 0.02,
                 max_traces: int = 8) -> None:
        self.tolerance = tolerance
        self.replay_margin = replay_margin
        self.max_traces = max_traces
        # (seq_len, batch_size) -> phase -> max measured peak; "step" is the whole step
        self.points: dict[tuple[int, int], dict[str, int]] = {}
        self.reserved_ratio = 1.0  # max measured reserved / allocated peak (CUDA)
        self.traces: list[Trace] = []
        self.verifications: list[Verification] = []
        self._quadratic: Optional[QuadraticMemoryModel] = None
        self._timeline: Optional[TimelineModel] = None
        self._timeline_reason = "no traced steps yet"
        self.distrusted: dict[str, str] = {}  # method -> why not trusted (the planner's checks)
        self._dirty = True
        self.version = 0  # bumped by every change of the inputs: a cache key for derived figures

    # -- inputs ----------------------------------------------------------------------------------
    def add_measurement(self, seq_len: int, batch_size: int, phase_peak_bytes: Mapping[str, int],
                        reserved_bytes: Optional[int] = None) -> None:
        """Add a non-warm-up step's peaks (per phase; key ``"step"`` for the whole step)."""
        point = self.points.setdefault((int(seq_len), int(batch_size)), {})
        before = (dict(point), self.reserved_ratio)
        for phase, nbytes in phase_peak_bytes.items():
            if nbytes is not None:
                point[phase] = max(point.get(phase, 0), int(nbytes))
        peak = max(point.values(), default=0)
        point["step"] = max(point.get("step", 0), peak)
        if reserved_bytes is not None and peak > 0:
            self.reserved_ratio = max(self.reserved_ratio, reserved_bytes / peak)
        if (point, self.reserved_ratio) != before:  # a repeated measurement changes no fit
            self._changed()

    def add_trace(self, trace: Trace) -> None:
        """Add a traced step (one per (L, B)); past ``max_traces`` the longest other is dropped."""
        if any((t.seq_len, t.batch_size) == (trace.seq_len, trace.batch_size) for t in self.traces):
            return
        self.traces.append(trace)
        if len(self.traces) > self.max_traces:
            longest = max((t for t in self.traces if t is not trace),
                          key=lambda t: (t.seq_len, t.batch_size))
            self.traces.remove(longest)
        self.traces.sort(key=lambda t: (t.seq_len, t.batch_size))
        self._changed()

    def wants_trace(self, seq_len: int, batch_size: int, num_lengths: int) -> bool:
        """Whether a step at ``(seq_len, batch_size)`` should be traced: yes until ``num_lengths``
        lengths are traced at this batch size, and for a length whose forecast missed by more than
        ``tolerance`` (its program may differ: the trace tells)."""
        if any((t.seq_len, t.batch_size) == (seq_len, batch_size) for t in self.traces):
            return False
        if any((v.seq_len, v.batch_size) == (seq_len, batch_size)
               and abs(v.relative_error) > self.tolerance for v in self.verifications):
            return True
        same_batch = {t.seq_len for t in self.traces if t.batch_size == batch_size}
        return (len(same_batch) < num_lengths
                or len(self.traces) < self.max_traces and not same_batch)

    # -- fitting ---------------------------------------------------------------------------------
    def _changed(self) -> None:
        self._dirty = True
        self.version += 1

    def _refit(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        self._timeline, self._timeline_reason = TimelineModel.from_traces(self.traces)
        distinct = {seq_len * batch for seq_len, batch in self.points}
        self._quadratic = None
        if len(distinct) >= 2:
            model = QuadraticMemoryModel(min_relative_uncertainty=self.tolerance)
            # every phase seen at two or more distinct L·B, and always the whole step: with gradient
            # accumulation the optimizer phase is seen less often, and the step's peak bounds it
            all_phases = sorted({p for point in self.points.values() for p in point})
            phases = [p for p in all_phases
                      if len({L * B for (L, B), point in self.points.items() if p in point}) >= 2]
            data = [(L, B, {p: point.get(p) for p in phases})
                    for (L, B), point in self.points.items()]
            self._quadratic = model.fit(data)

    @property
    def quadratic(self) -> Optional[QuadraticMemoryModel]:
        """The fitted quadratic model, or None before two distinct (L·B) were measured."""
        self._refit()
        return self._quadratic

    @property
    def timeline(self) -> Optional[TimelineModel]:
        """The timeline replay model, or None (see :attr:`timeline_unavailable_reason`)."""
        self._refit()
        return self._timeline

    @property
    def timeline_unavailable_reason(self) -> str:
        self._refit()
        return self._timeline_reason

    @property
    def ready(self) -> bool:
        return self.timeline is not None or self.quadratic is not None

    # -- outputs ---------------------------------------------------------------------------------
    def _miss_ratio(self, method: str) -> float:
        """Largest measured / forecast − 1 over this method's under-predictions (0 if none)."""
        return max([0.0] + [v.measured_bytes / max(v.forecast_bytes, 1) - 1
                            for v in self.verifications if v.method == method])

    def _allocator_residual(self, timeline: TimelineModel, seq_len: int, batch_size: int) -> int:
        """Allocator counters only (traces in 512-byte blocks): the allocator's peak beyond the
        replayed tensors, ``a + c·L²·max(1, B/B0)`` through the shortest trace and the longest up to
        ``seq_len`` (workspaces are the constant, kernel scratch the growing part; one growing
        slower than L² is over-predicted, never under). 0 for the tracker, whose replay is exact."""
        if timeline.block_bytes <= 1:
            return 0
        points = sorted((t.seq_len, t.batch_size,
                         max(0, t.measured_peak_bytes
                             - timeline.predict(t.seq_len, t.batch_size).peak_bytes))
                        for t in self.traces if t.measured_peak_bytes is not None)  # fmt: skip
        if not points:
            return 0
        (l1, _, r1), (l2, b2, r2) = (points[0],
                                     max([p for p in points if p[0] <= seq_len] or points[:1]))
        c = (r2 - r1) / (l2 * l2 - l1 * l1) if l2 > l1 else 0.0
        a = r1 - c * l1 * l1
        if a < 0 or c < 0:  # not of that shape: the larger residual, constant or grown from its L
            a, c = (max(r1, r2), 0.0) if c < 0 else (0.0, r2 / (l2 * l2))
        return int(a + c * seq_len * seq_len * max(1.0, batch_size / b2))

    def forecast(self, seq_len: int, batch_size: int, method: Optional[str] = None) -> Forecast:
        """Predict the step peak; replay when it applies (and is not in :attr:`distrusted` while a
        quadratic fit exists), else the quadratic fit (or ``method``)."""
        if method is not None and method not in METHODS:
            raise ValueError(f"`method` must be one of {METHODS} or None, got {method!r}")
        timeline, quadratic = self.timeline, self.quadratic
        skip_replay = method is None and "replay" in self.distrusted and quadratic is not None
        if timeline is not None and method in (None, "replay") and not skip_replay:
            fc = timeline.predict(seq_len, batch_size)
            extra = self._allocator_residual(timeline, seq_len, batch_size)
            peak, phases = (fc.peak_bytes + extra,
                            {p: v + extra for p, v in fc.phase_peak_bytes.items()})
            upper = int(peak * (1 + max(self.replay_margin, self._miss_ratio("replay"))))
            detail = (f"replay of steps traced at seq_len {list(timeline.seq_lens)}; "
                      + "; ".join(timeline.notes))
            if extra:
                detail += f"; plus {extra} bytes the allocator counted beyond the traced tensors"
            return self._make(seq_len, batch_size, peak, upper, "replay", phases, detail)
        if quadratic is not None and method in (None, "quadratic"):
            fc = quadratic.predict(seq_len, batch_size)
            detail = "quadratic fit of measured peaks"
            if skip_replay:
                detail += f" (replay not trusted: {self.distrusted['replay']})"
            elif method is None:
                detail += f" (replay unavailable: {self._timeline_reason})"
            upper = max(fc.upper_bytes, int(fc.peak_bytes * (1 + self._miss_ratio("quadratic"))))
            return self._make(seq_len, batch_size, fc.peak_bytes, upper, "quadratic",
                              fc.phase_peak_bytes, detail)
        if method == "replay":
            raise NotEnoughMeasurements(f"replay unavailable: {self._timeline_reason}")
        raise NotEnoughMeasurements(
            f"cannot forecast yet: {len(self.points)} (seq_len, batch_size) point(s) measured and "
            f"replay unavailable ({self._timeline_reason}); measure at least two lengths "
            "(a curriculum, dynamic padding, or more warm-up-free steps)"
        )

    def _make(self, seq_len, batch_size, peak, upper, method, phases, detail) -> Forecast:
        return Forecast(seq_len=int(seq_len), batch_size=int(batch_size), peak_bytes=int(peak),
                        upper_bytes=int(upper),
                        reserved_upper_bytes=int(upper * self.reserved_ratio), method=method,
                        phase_peak_bytes={k: int(v) for k, v in phases.items()}, detail=detail)

    def max_seq_len(self, budget_bytes: int, batch_size: int, reserved: bool = False) -> int:
        """Largest L whose forecast upper bound (reserved, if asked) fits ``budget_bytes``, or 0."""
        if budget_bytes <= 0:
            return 0

        def fits(L: int) -> bool:
            fc = self.forecast(L, batch_size)
            return (fc.reserved_upper_bytes if reserved else fc.upper_bytes) <= budget_bytes

        return largest_fitting(fits)

    def verify(self, forecast: Forecast, measured_bytes: int) -> Verification:
        """Record how ``forecast`` compared with the measured peak; later bounds widen on misses."""
        v = Verification(forecast.seq_len, forecast.batch_size, forecast.method,
                         forecast.peak_bytes, int(measured_bytes))
        self.verifications.append(v)
        self._changed()
        return v

    # -- checkpointing ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain values only (lists, dicts, ints), for the callback's checkpoint state."""
        return {
            "points": [[L, B, dict(p)] for (L, B), p in self.points.items()],
            "reserved_ratio": self.reserved_ratio,
            "traces": [{"seq_len": t.seq_len, "batch_size": t.batch_size,
                        "block_bytes": t.block_bytes, "measured_peak_bytes": t.measured_peak_bytes,
                        "events": asdict(t.events)} for t in self.traces],
            "verifications": [asdict(v) for v in self.verifications],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.points = {(int(L), int(B)): dict(p) for L, B, p in state.get("points", [])}
        self.reserved_ratio = float(state.get("reserved_ratio", 1.0))
        self.traces = [Trace(seq_len=t["seq_len"], batch_size=t["batch_size"],
                             events=TrackedEvents(**t["events"]),
                             block_bytes=t.get("block_bytes", 1),
                             measured_peak_bytes=t.get("measured_peak_bytes"))
                       for t in state.get("traces", [])]
        self.verifications = [Verification(**v) for v in state.get("verifications", [])]
        self._changed()
