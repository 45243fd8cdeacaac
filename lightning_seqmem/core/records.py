"""Plain records of what the callback measured and decided, and the warnings it raises."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping, Optional

PHASES = ("forward", "backward", "optimizer")
"""The phases of a training step, in order (the callback marks each boundary)."""


class PredictedOOMWarning(UserWarning):
    """The forecast says the next stage (or batch) would not fit the memory budget."""


class ForecastMismatchWarning(UserWarning):
    """A forecast missed the measured peak by more than ``tolerance``."""


class SeqMemFailureWarning(UserWarning):
    """The callback hit an internal failure and stopped measuring; training goes on."""


class MemoryBudgetError(ValueError):
    """No setting can meet ``memory_budget``: raised before the first step, or before a batch
    (every rank), rather than training over the budget. The message says what would fit."""


@dataclass
class AllocatorCounters:
    """What a caching allocator counts over a step, for :class:`StepMemory` (which measures them)
    and :class:`StepRecord` (which keeps them): bytes, ``None`` without an allocator (the tracker).

    ``fragmentation_bytes`` is the peak reserved minus the peak allocated,
    ``fragmentation_fraction`` that over the peak reserved; ``alloc_retries``, ``num_ooms``: the
    allocator's retries and out-of-memory errors. A record lists them after its own fields (a base
    listed first comes later in ``fields()``), keeping its field order and positions.

    >>> memory = StepMemory(100, {"forward": 100}, 10, 10, 128)
    >>> memory.reserved_bytes, memory.fragmentation_bytes, [f.name for f in fields(memory)][3:5]
    (128, None, ['end_bytes', 'reserved_bytes'])
    """

    reserved_bytes: Optional[int] = None
    fragmentation_bytes: Optional[int] = None
    fragmentation_fraction: Optional[float] = None
    inactive_split_bytes: Optional[int] = None
    alloc_retries: Optional[int] = None
    num_ooms: Optional[int] = None


@dataclass
class _StepRecordHead:
    """:class:`StepRecord`'s fields before the allocator counters."""

    step: int
    global_step: int
    epoch: int
    seq_len: int
    batch_size: int
    warmup: bool
    traced: bool
    peak_bytes: int
    forward_peak_bytes: Optional[int]
    backward_peak_bytes: Optional[int]
    optimizer_peak_bytes: Optional[int]
    start_bytes: int


@dataclass
class StepRecord(AllocatorCounters, _StepRecordHead):
    """One measured training batch (bytes; ``None`` where the probe has no such counter).

    ``step`` counts the training batches the callback has seen (from 0), ``global_step`` is the
    trainer's optimizer-step counter at batch start. ``warmup`` steps are recorded, not fitted.
    ``forecast_*`` hold the forecast made for this ``(seq_len, batch_size)`` before it was first
    measured; ``forecast_error`` = (forecast − measured) / measured, on the first non-warm-up
    measurement of a new length."""

    stage: Optional[int] = None
    mitigations: tuple[str, ...] = ()
    forecast_peak_bytes: Optional[int] = None
    forecast_upper_bytes: Optional[int] = None
    forecast_method: Optional[str] = None
    forecast_error: Optional[float] = None
    events: list[str] = field(default_factory=list)
    rank: Optional[int] = None  # under DDP: the rank whose peak (the highest) this is, its shape
    # wall seconds of the step itself (forward, backward, optimizer; not the callback's own dry runs
    # or decisions), what :mod:`lightning_seqmem.plan.pricing` prices from; None: not timed
    step_seconds: Optional[float] = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["mitigations"] = list(self.mitigations)
        if out["step_seconds"] is None:  # not timed (a record saved without it): absent
            del out["step_seconds"]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StepRecord":
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["mitigations"] = tuple(kwargs.get("mitigations", ()))
        return cls(**kwargs)


@dataclass
class TrackedEvents:
    """The ordered allocation/free sequence of one traced step.

    ``sizes[i]`` and ``ops[i]`` describe allocation ``i`` (the first ``num_existing`` are the
    storages alive before the step: parameters, gradients, optimizer state, batch). ``sequence``
    holds ``i`` for "allocation i happened" and ``~i`` (negative) for "allocation i was freed", in
    order. ``phase_starts`` maps a phase to the position in ``sequence`` where it began.
    ``left_bytes``: what earlier steps allocated and left alive, at the step's peak (no part of the
    sequence: not the step's own program)."""

    sizes: list[int] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    sequence: list[int] = field(default_factory=list)
    phase_starts: dict[str, int] = field(default_factory=dict)
    num_existing: int = 0
    left_bytes: int = 0


@dataclass
class _StepMemoryHead:
    """:class:`StepMemory`'s fields before the allocator counters."""

    peak_bytes: int
    phase_peak_bytes: dict[str, int]
    start_bytes: int
    end_bytes: int


@dataclass
class StepMemory(AllocatorCounters, _StepMemoryHead):
    """What a probe measured over one training step (bytes). ``phase_peak_bytes`` maps each phase in
    :data:`PHASES` the step went through to its peak; one it skipped (no optimizer step while
    accumulating gradients) is absent."""

    events: Optional[TrackedEvents] = None
