"""lightning-seqmem: measure, predict and tame the memory of long-sequence transformer training.

Quick start::

    import lightning.pytorch as pl
    from lightning_seqmem import Curriculum, SeqMemCallback

    cb = SeqMemCallback(memory_budget="12GiB", curriculum=Curriculum(start=512, target=8192))
    pl.Trainer(callbacks=[cb]).fit(model, datamodule)
    print(cb.forecast(16384).upper_bytes, cb.max_seq_len())
"""

from .batch import infer_batch_shape, set_batch_sequence_length
from .callback import SeqMemCallback
from .curriculum import Curriculum
from .forecast import Forecast, MemoryForecaster, NotEnoughMeasurements, Verification
from .model import QuadraticForecast, QuadraticMemoryModel
from .probes import CudaAllocatorProbe, LiveTensorTracker, StepMemory, TrackerProbe
from .records import ForecastMismatchWarning, PredictedOOMWarning, SeqMemFailureWarning, StepRecord
from .timeline import TimelineModel, Trace
from .units import parse_bytes

__version__ = "0.1.0"

__all__ = [
    "CudaAllocatorProbe",
    "Curriculum",
    "Forecast",
    "ForecastMismatchWarning",
    "LiveTensorTracker",
    "MemoryForecaster",
    "NotEnoughMeasurements",
    "PredictedOOMWarning",
    "QuadraticForecast",
    "QuadraticMemoryModel",
    "SeqMemCallback",
    "SeqMemFailureWarning",
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
