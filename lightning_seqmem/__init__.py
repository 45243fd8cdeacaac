"""lightning-seqmem: measure, predict and tame the memory of long-sequence transformer training.

Quick start::

    import lightning.pytorch as pl
    from lightning_seqmem import Curriculum, SeqMemCallback

    cb = SeqMemCallback(memory_budget="12GiB", curriculum=Curriculum(start=512, target=8192))
    pl.Trainer(callbacks=[cb]).fit(model, datamodule)
    print(cb.forecast(16384).upper_bytes, cb.max_seq_len())
"""

import importlib
from typing import Any

# Plain values and torch-free maths import eagerly; everything that needs torch or Lightning is
# imported on first use, so ``import lightning_seqmem.plan.planner`` loads neither.
from lightning_seqmem.core.config import SeqMemConfig
from lightning_seqmem.core.curriculum import Curriculum
from lightning_seqmem.core.forecast import (Forecast, MemoryForecaster, NotEnoughMeasurements,
                                            Verification)
from lightning_seqmem.core.quadratic import QuadraticForecast, QuadraticMemoryModel
from lightning_seqmem.core.records import (
    StepMemory,
    ForecastMismatchWarning,
    MemoryBudgetError,
    PredictedOOMWarning,
    SeqMemFailureWarning,
    StepRecord,
)
from lightning_seqmem.core.timeline import TimelineModel, Trace
from lightning_seqmem.core.units import parse_bytes

_LAZY = {
    "SeqMemCallback": ".trainer.callback",
    "SeqMemPlanner": ".plan.planner",
    "CudaAllocatorProbe": ".measure.probes",
    "LiveTensorTracker": ".measure.tracker",
    "TrackerProbe": ".measure.probes",
    "infer_batch_shape": ".measure.batch_shape",
    "set_batch_sequence_length": ".measure.batch",
}

def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "CudaAllocatorProbe",
    "Curriculum",
    "Forecast",
    "ForecastMismatchWarning",
    "LiveTensorTracker",
    "MemoryBudgetError",
    "MemoryForecaster",
    "NotEnoughMeasurements",
    "PredictedOOMWarning",
    "QuadraticForecast",
    "QuadraticMemoryModel",
    "SeqMemCallback",
    "SeqMemConfig",
    "SeqMemFailureWarning",
    "SeqMemPlanner",
    "StepMemory",
    "StepRecord",
    "TimelineModel",
    "Trace",
    "TrackerProbe",
    "Verification",
    "infer_batch_shape",
    "parse_bytes",
    "set_batch_sequence_length",
]
