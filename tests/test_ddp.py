"""DDP with 2 CPU processes (gloo): every rank measures the same maxima and takes the same decisions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "ddp_run.py"
pytestmark = pytest.mark.ddp


def _run(tmp_path, *args, timeout=240):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), *args], capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def _decisions(rank):
    return [(r["step"], r["seq_len"], r["stage"], r["peak_bytes"], r["warmup"]) for r in rank["records"]]


def test_ranks_agree_on_peaks_lengths_and_the_cap(tmp_path):
    # a budget that forces a cap between 64 and 256 tokens for this tiny model
    rank0, rank1 = _run(tmp_path, "--budget", str(1_300_000), "--max-steps", "12")
    assert _decisions(rank0) == _decisions(rank1) and len(rank0["records"]) == 12
    assert rank0["stages"] == rank1["stages"] and rank0["capped_at"] == rank1["capped_at"]
    assert rank0["capped_at"] is not None
    assert max(r["peak_bytes"] for r in rank0["records"]) <= 1_300_000


def test_a_rank0_only_fault_does_not_deadlock_and_all_ranks_stop_together(tmp_path):
    rank0, rank1 = _run(tmp_path, "--fail-rank0-at", "3", "--max-steps", "8", timeout=180)
    assert rank0["disabled"] and rank1["disabled"]
    assert rank0["global_step"] == rank1["global_step"] == 8
    # rank 0 failed while recording a step, after that step's collective: rank 1 hears of it at the
    # next batch end, so it stops at most one batch later; what both recorded is identical
    n0, n1 = len(rank0["records"]), len(rank1["records"])
    assert 0 < n0 < 8 and n1 in (n0, n0 + 1)
    assert _decisions(rank0) == _decisions(rank1)[:n0]
