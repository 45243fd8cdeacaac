"""lightning-seqmem: measure, predict and tame the memory of long-sequence transformer training.

Quick start::

    import lightning.pytorch as pl
    from lightning_seqmem import Curriculum, SeqMemCallback

    cb = SeqMemCallback(memory_budget="12GiB", curriculum=Curriculum(start=512, target=8192))
    pl.Trainer(callbacks=[cb]).fit(model, datamodule)
    print(cb.forecast(16384).upper_bytes, cb.max_seq_len())
"""

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

# Plain values and torch-free maths import eagerly; everything that needs torch or Lightning is
# imported on first use, so ``import lightning_seqmem.plan.planner`` loads neither.
from lightning_seqmem.core.config import SeqMemConfig
from lightning_seqmem.core.curriculum import Curriculum
from lightning_seqmem.core.forecast import Forecast, MemoryForecaster, NotEnoughMeasurements, Verification
from lightning_seqmem.core.quadratic import QuadraticForecast, QuadraticMemoryModel
from lightning_seqmem.core.records import (
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
    "LiveTensorTracker": ".measure.probes",
    "StepMemory": ".measure.probes",
    "TrackerProbe": ".measure.probes",
    "infer_batch_shape": ".measure.batch",
    "set_batch_sequence_length": ".measure.batch",
}

# The flat modules of 0.1 under their old names (configs name ``lightning_seqmem.demo.LitGPT``):
# ``import lightning_seqmem.demo`` gives the very module ``lightning_seqmem.reference.demo``.
_OLD_NAMES = {
    "advice": "core.advice", "advice_now": "dryrun.advice_now", "batch": "measure.batch",
    "breakdown": "diagnostics.breakdown", "breakdown_steps": "diagnostics.section",
    "callback": "trainer.callback", "checks": "core.checks", "curriculum": "core.curriculum",
    "demo": "reference.demo", "distributed": "trainer.ranks", "dryrun": "dryrun.step",
    "edge": "trainer.access", "forecast": "core.forecast", "hf": "reference.hf", "model": "core.quadratic",
    "nn": "reference.nn", "offline": "measure.steps", "oom": "trainer.oom", "outputs": "trainer.outputs",
    "panels": "present.panels", "planner": "plan.planner", "probes": "measure.probes",
    "records": "core.records", "report": "present.report", "rungs": "core.rungs",
    "sharded": "dryrun.sharded", "state": "plan.checkpoint", "timeline": "core.timeline",
    "training_dry_run": "dryrun.run", "units": "core.units",
}


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``lightning_seqmem.<old flat name>`` and answers with the module it moved to."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        prefix, _, old = fullname.partition(".")
        if prefix != __name__ or old not in _OLD_NAMES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        return importlib.import_module(f"{__name__}.{_OLD_NAMES[spec.name.partition('.')[2]]}")

    def exec_module(self, module: Any) -> None:
        pass  # the module it moved to is already executed


if not any(isinstance(f, _OldNames) for f in sys.meta_path):
    sys.meta_path.append(_OldNames())


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
