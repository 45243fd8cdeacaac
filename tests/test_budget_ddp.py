"""Issue 30 (2): ranks that differ in batch size take a rung that fits on every rank, not a stop.

Two gloo ranks with batches of 4 and 1 samples, the ladder ``("microbatch",)`` and a budget only
micro-batching meets (a wide output layer: 4 samples' logits do not fit, 1's do). Micro-batching
changes nothing on the rank with one sample; before, that rank refused it, so the run stopped with
``MemoryBudgetError`` although it fits on both. Each rank counts its step windows with the profiler
(:mod:`step_window`): none over the usable budget.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from limits import limit_s

SCRIPT = Path(__file__).parent / "scripts" / "budget_ddp_run.py"
pytestmark = pytest.mark.ddp


def test_uneven_ranks_micro_batch_instead_of_stopping(tmp_path):
    budget = 20 * 2**20  # 32 tokens x 4 samples: 20.9 MiB (dry run); micro-batched: 16.4 MiB
    command = [sys.executable, str(SCRIPT), str(tmp_path), str(budget)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=limit_s(60))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["global_step"] == rank1["global_step"] == 8
    assert rank0["applied_mitigations"] == rank1["applied_mitigations"] == ["microbatch"]
    assert rank0["micro_batching"] == rank1["micro_batching"] == 1  # on the rank of one sample too
    # the same decisions, warm-ups and rows on both ranks (the forecasts are rank zero's)
    assert [r[:7] for r in rank0["records"]] == [r[:7] for r in rank1["records"]]
    assert rank0["windows_over"] == rank1["windows_over"] == []
    assert all(r[3] <= budget for r in rank0["records"])
