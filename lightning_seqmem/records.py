"""Plain records of what the callback measured and decided, and the warnings it raises."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping, Optional


class PredictedOOMWarning(UserWarning):
    """The forecast says the next stage (or batch) would not fit the memory budget."""


class ForecastMismatchWarning(UserWarning):
    """A forecast missed the measured peak by more than ``tolerance``."""


class SeqMemFailureWarning(UserWarning):
    """The callback hit an internal failure and stopped measuring; training goes on."""


@dataclass
class StepRecord:
    """One measured training batch (bytes; ``None`` where the probe has no such counter).

    ``step`` counts the training batches the callback has seen (from 0), ``global_step`` is the
    trainer's optimizer-step counter at batch start. ``warmup`` steps are recorded but not fitted.
    ``forecast_*`` hold the forecast made for this ``(seq_len, batch_size)`` before it was first
    measured, and ``forecast_error`` = (forecast − measured) / measured, filled on the first
    non-warm-up measurement of a new length.
    """

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
    reserved_bytes: Optional[int] = None
    fragmentation_bytes: Optional[int] = None
    fragmentation_fraction: Optional[float] = None
    inactive_split_bytes: Optional[int] = None
    alloc_retries: Optional[int] = None
    num_ooms: Optional[int] = None
    stage: Optional[int] = None
    mitigations: tuple[str, ...] = ()
    forecast_peak_bytes: Optional[int] = None
    forecast_upper_bytes: Optional[int] = None
    forecast_method: Optional[str] = None
    forecast_error: Optional[float] = None
    events: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["mitigations"] = list(self.mitigations)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StepRecord":
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["mitigations"] = tuple(kwargs.get("mitigations", ()))
        return cls(**kwargs)
