"""Timeline replay: predict a step's peak at any sequence length from a few short traced steps.

A traced step (:class:`~lightning_seqmem.core.records.TrackedEvents`) is the ordered list of every
storage allocation and free. At two or three lengths a transformer step's op sequence is the same;
only the sizes differ, each a polynomial of degree ≤ 2 in L (weights constant, activations linear,
attention scores quadratic). :class:`TimelineModel` fits each allocation's size so, then replays
the alloc/free sequence at the asked length: the running sum's maximum is the peak, including the
peak moving from one op to another as L grows, which a fit of peaks alone cannot see.

When the traces do not share one sequence (a kernel choice that depends on L, ``torch.compile``,
data-dependent control flow), :meth:`TimelineModel.from_traces` refuses with the reason.

Batch size: traces at two batch sizes for one length tell which allocations are proportional to the
batch. Otherwise every L-dependent allocation is assumed to be, the others not; a batch-independent
L-dependent tensor (a causal mask) is then over-counted, which errs on the safe side."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from lightning_seqmem.core.checks import check_int
from lightning_seqmem.core.search import UNBOUNDED_SEQ_LEN, largest_fitting
from lightning_seqmem.core.records import TrackedEvents


@dataclass
class Trace:
    """One traced training step at a known ``(seq_len, batch_size)``; ``block_bytes`` is the
    allocator's rounding (512 on CUDA, 1 on CPU), applied to every predicted allocation so that
    replayed peaks compare with the allocator's counters."""

    seq_len: int
    batch_size: int
    events: TrackedEvents
    block_bytes: int = 1
    measured_peak_bytes: Optional[int] = None

    def signature(self) -> tuple:
        """What must be equal for two traces to be replayed as one program."""
        ev = self.events
        return (tuple(ev.ops), tuple(ev.sequence), tuple(sorted(ev.phase_starts.items())),
                ev.num_existing)


@dataclass(frozen=True)
class TimelineForecast:
    """A replayed prediction: the peak and the peak of each phase, in bytes."""

    seq_len: int
    batch_size: int
    peak_bytes: int
    phase_peak_bytes: dict[str, int]
    peak_op: str
    method: str = "replay"


@dataclass
class TimelineModel:
    """Per-allocation size polynomials plus the shared alloc/free sequence (:meth:`from_traces`).

    Example:
        >>> import torch
        >>> from lightning_seqmem.measure.probes import TrackerProbe
        >>> w = torch.randn(16, 16, requires_grad=True)
        >>> def traced(seq_len):
        ...     probe = TrackerProbe("cpu")
        ...     x = torch.randn(2, seq_len, 16)
        ...     probe.start_step([w, x], record_events=True)
        ...     probe.mark_phase("forward")
        ...     scores = (x @ w) @ x.transpose(1, 2)          # [2, L, L]
        ...     loss = scores.softmax(-1).sum()
        ...     probe.mark_phase("backward")
        ...     loss.backward()
        ...     w.grad = None
        ...     m = probe.end_step()
        ...     return Trace(seq_len, 2, m.events, measured_peak_bytes=m.peak_bytes)
        >>> model, reason = TimelineModel.from_traces([traced(8), traced(16), traced(32)])
        >>> model.predict(128, 2).peak_bytes == traced(128).measured_peak_bytes
        True
    """

    seq_lens: tuple[int, ...]
    batch_size: int
    coefficients: np.ndarray  # [3, num_allocations]: bytes = c0 + c1·L + c2·L²
    batch_scaled: np.ndarray  # [num_allocations] bool: size proportional to the batch size
    sequence: np.ndarray  # int64, as TrackedEvents.sequence
    phase_starts: dict[str, int]
    ops: list[str]
    block_bytes: int = 1
    max_fit_residual_bytes: float = 0.0
    notes: list[str] = field(default_factory=list)
    left_bytes: int = 0  # what earlier steps left alive at the longest trace's peak: added

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_traces(cls, traces: Sequence[Trace]) -> tuple[Optional["TimelineModel"], str]:
        """Fit from traces: ``(model, "")``, or ``(None, reason)`` when replay cannot be used."""
        if not traces:
            return None, "no traced steps yet"
        by_batch: dict[int, dict[int, Trace]] = {}
        for t in traces:
            by_batch.setdefault(t.batch_size, {}).setdefault(t.seq_len, t)
        batch_size = max(by_batch, key=lambda b: (len(by_batch[b]), b))
        group = [by_batch[batch_size][L] for L in sorted(by_batch[batch_size])]
        if len(group) < 2:
            return None, f"replay needs traced steps at 2 or more lengths, have {len(group)}"
        signature = group[0].signature()
        for t in group[1:]:
            if t.signature() != signature:
                return None, (
                    f"the allocation sequence at seq_len={t.seq_len} differs from seq_len="
                    f"{group[0].seq_len} ({_first_difference(group[0], t)}): a kernel choice that "
                    "depends on the length, torch.compile or data-dependent control flow"
                )
        seq_lens = np.array([t.seq_len for t in group], dtype=np.float64)
        sizes = np.array([t.events.sizes for t in group], dtype=np.float64)  # [k, n]
        coefficients, residual = _fit_size_polynomials(seq_lens, sizes)
        longest = seq_lens.max()  # an allocation depends on L if that changes it by ≥ 1 byte
        depends_on_len = (np.abs(coefficients[1]) * longest
                          + np.abs(coefficients[2]) * longest**2 >= 0.5)
        batch_scaled, notes = depends_on_len, []
        other = _batch_companion(by_batch, batch_size, signature)
        if other is not None:
            here, there = by_batch[batch_size][other.seq_len], other
            batch_scaled = np.array(here.events.sizes) != np.array(there.events.sizes)
            notes.append(f"batch scaling measured from batch sizes {batch_size} and "
                         f"{other.batch_size}")
        else:
            notes.append("batch scaling assumed: L-dependent allocations proportional to the batch")
        if residual > 0.5:
            notes.append("allocation sizes are not exactly quadratic in L (residual "
                         f"{residual:.0f} B)")
        first = group[0].events
        return (cls(seq_lens=tuple(int(L) for L in seq_lens), batch_size=batch_size,
                    coefficients=coefficients, batch_scaled=np.asarray(batch_scaled, dtype=bool),
                    sequence=np.asarray(first.sequence, dtype=np.int64),
                    phase_starts=dict(first.phase_starts), ops=list(first.ops),
                    block_bytes=group[0].block_bytes, max_fit_residual_bytes=float(residual),
                    notes=notes, left_bytes=group[-1].events.left_bytes), "")

    # -- prediction ------------------------------------------------------------------------------
    def allocation_bytes(self, seq_len: int, batch_size: Optional[int] = None) -> np.ndarray:
        """Predicted size of every allocation at ``(seq_len, batch_size)``, in bytes."""
        batch_size = self.batch_size if batch_size is None else batch_size
        L = float(seq_len)
        sizes = self.coefficients[0] + self.coefficients[1] * L + self.coefficients[2] * L * L
        sizes = np.where(self.batch_scaled, sizes * (batch_size / self.batch_size), sizes)
        sizes = np.maximum(np.rint(sizes), 0).astype(np.int64)
        if self.block_bytes > 1:
            sizes = -(-sizes // self.block_bytes) * self.block_bytes
        return sizes

    def predict(self, seq_len: int, batch_size: Optional[int] = None) -> TimelineForecast:
        """Replay the step at ``(seq_len, batch_size)`` and return its peaks."""
        check_int("seq_len", seq_len)
        batch_size = self.batch_size if batch_size is None else batch_size
        check_int("batch_size", batch_size)
        sizes = self.allocation_bytes(seq_len, batch_size)
        seq = self.sequence
        deltas = np.where(seq >= 0, sizes[np.where(seq >= 0, seq, 0)],
                          -sizes[np.where(seq < 0, ~seq, 0)])
        live = np.cumsum(deltas) + self.left_bytes
        peak_at = int(np.argmax(live)) if len(live) else 0
        phase_peaks: dict[str, int] = {}
        starts = sorted(self.phase_starts.items(), key=lambda kv: kv[1])
        for i, (phase, start) in enumerate(starts):
            end = starts[i + 1][1] if i + 1 < len(starts) else len(live)
            before = int(live[start - 1]) if start > 0 else self.left_bytes
            segment = live[start:end]
            phase_peaks[phase] = max(before, int(segment.max()) if len(segment) else before)
        peak_index = int(seq[peak_at]) if len(seq) else 0
        return TimelineForecast(seq_len=seq_len, batch_size=batch_size,
                                peak_bytes=int(live.max()) if len(live) else self.left_bytes,
                                phase_peak_bytes=phase_peaks,
                                peak_op=(self.ops[peak_index] if peak_index >= 0 and self.ops
                                         else ""))

    def max_seq_len(self, budget_bytes: int, batch_size: Optional[int] = None) -> int:
        """Largest L whose replayed peak is ≤ ``budget_bytes`` (0: none; or UNBOUNDED_SEQ_LEN)."""
        def fits(L: int) -> bool:
            return self.predict(L, batch_size).peak_bytes <= budget_bytes

        if fits(1) and not np.any(self.coefficients[1:] > 0):
            return UNBOUNDED_SEQ_LEN
        return largest_fitting(fits)


def _fit_size_polynomials(seq_lens: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, float]:
    """Coefficients [3, n] of c0 + c1·L + c2·L² through each column of ``sizes`` [k, n]."""
    k, n = sizes.shape
    coefficients = np.zeros((3, n))
    if k >= 3:
        scale = seq_lens.max()
        x = seq_lens / scale
        vander = np.stack([np.ones_like(x), x, x * x], axis=1)
        sol, *_ = np.linalg.lstsq(vander, sizes, rcond=None)
        coefficients = sol / np.array([[1.0], [scale], [scale * scale]])
        residual = float(np.abs(vander @ sol - sizes).max()) if n else 0.0
        return coefficients, residual
    # Two lengths: find each size's exponent p in {0, 1, 2} (s ∝ L^p), else a straight line.
    (L1, L2), (s1, s2) = seq_lens, sizes
    assigned = np.zeros(n, dtype=bool)
    for p in (0, 1, 2):
        exact = ~assigned & (np.abs(s2 * L1**p - s1 * L2**p) < 0.5)
        coefficients[p, exact] = s1[exact] / L1**p
        assigned |= exact
    slope = (s2 - s1) / (L2 - L1)
    coefficients[0, ~assigned] = s1[~assigned] - slope[~assigned] * L1
    coefficients[1, ~assigned] = slope[~assigned]
    return coefficients, 0.0


def _batch_companion(by_batch: dict[int, dict[int, Trace]], batch_size: int,
                     signature: tuple) -> Optional[Trace]:
    """A trace at another batch size, at a length also traced at ``batch_size``, same program."""
    for other_batch, traces in by_batch.items():
        if other_batch == batch_size:
            continue
        for seq_len, trace in traces.items():
            if seq_len in by_batch[batch_size] and trace.signature() == signature:
                return trace
    return None


def _first_difference(a: Trace, b: Trace) -> str:
    ops_a, ops_b = a.events.ops, b.events.ops
    for i, (x, y) in enumerate(zip(ops_a, ops_b)):
        if x != y:
            return f"allocation {i}: {x} vs {y}"
    if len(ops_a) != len(ops_b):
        return f"{len(ops_a)} vs {len(ops_b)} allocations"
    return "same allocations, different free order or phases"


__all__ = ["Trace", "TimelineForecast", "TimelineModel"]
