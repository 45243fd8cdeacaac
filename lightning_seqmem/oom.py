"""Turn a real out-of-memory error into a diagnosis written next to the logs.

:func:`is_oom` recognises ``torch.cuda.OutOfMemoryError`` (and the plain ``RuntimeError`` that older
or other backends raise with "out of memory" in the message). :func:`write_oom_diagnosis` writes
``seqmem_oom_diagnosis.json``: the last records, the forecast the callback had for the failing
length, what it would have done next, and — when the user turned on CUDA memory history with
``torch.cuda.memory._record_memory_history()`` — the allocator snapshot beside it as
``seqmem_oom_snapshot.pickle`` (open it at https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import json
import os
import pickle
import time
from typing import Any, Optional

import torch

from .report import report_dir


def is_oom(exception: BaseException) -> bool:
    """True for an out-of-memory error from any device.

    Example:
        >>> is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory")), is_oom(ValueError("x"))
        (True, False)
    """
    if isinstance(exception, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(exception, RuntimeError) and "out of memory" in str(exception).lower()


def write_oom_diagnosis(callback: Any, trainer: Any, exception: BaseException, last_records: int = 10) -> Optional[str]:
    """Write the diagnosis JSON (and the CUDA snapshot if history was on); return its path."""
    directory = report_dir(trainer)
    os.makedirs(directory, exist_ok=True)
    current = callback._current or {}
    seq_len, batch_size = current.get("seq_len"), current.get("batch_size")
    forecast: Any = None
    if seq_len and batch_size and callback.forecaster.ready:
        try:
            forecast = vars(callback.forecaster.forecast(seq_len, batch_size))
        except Exception as exc:  # noqa: BLE001
            forecast = f"forecast failed: {exc!r}"
    diagnosis: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "error": f"{type(exception).__name__}: {exception}",
        "step": callback._step,
        "global_step": getattr(trainer, "global_step", None),
        "failing_batch": {"seq_len": seq_len, "batch_size": batch_size},
        "forecast_for_failing_batch": forecast,
        "usable_budget_bytes": callback.usable_budget_bytes,
        "mitigations_applied": list(callback.applied_mitigations),
        "mitigations_left": [m for m in callback.mitigations if m not in callback.applied_mitigations],
        "would_have_done": _would_have_done(callback, seq_len),
        "last_records": [r.to_dict() for r in callback.records[-last_records:]],
        "cuda_snapshot": None,
    }
    if torch.cuda.is_available():
        diagnosis["cuda_memory_summary"] = torch.cuda.memory_summary()
        try:
            snapshot = torch.cuda.memory._snapshot()
            if snapshot.get("device_traces") and any(snapshot["device_traces"]):
                snapshot_path = os.path.join(directory, "seqmem_oom_snapshot.pickle")
                with open(snapshot_path, "wb") as f:
                    pickle.dump(snapshot, f)
                diagnosis["cuda_snapshot"] = snapshot_path
        except Exception:  # noqa: BLE001 - history was off, or the allocator cannot snapshot
            pass
    path = os.path.join(directory, "seqmem_oom_diagnosis.json")
    with open(path, "w") as f:
        json.dump(diagnosis, f, indent=2, default=str)
    return path


def _would_have_done(callback: Any, seq_len: Optional[int]) -> str:
    if callback.usable_budget_bytes is None:
        return "nothing: no memory budget was set, so forecasts were informational"
    if not callback.forecaster.ready:
        return "nothing yet: fewer than two lengths were measured, so no forecast existed"
    left = [m for m in callback.mitigations if m not in callback.applied_mitigations]
    if left:
        return f"switch on {left[0]!r} before growing past the largest length that fits"
    fit = callback.max_seq_len()
    return f"cap the sequence length at {fit} (the largest forecast to fit the usable budget)"
