"""FSDP2 (``fully_shard``) through Lightning's ``ModelParallelStrategy`` with 2 CPU processes
(gloo): per-rank records, forecasts per rank and at other world sizes, rungs switched on mid-run
under a budget with unchanged gradients, and resumption from a sharded checkpoint.

One 2-process launch (tests/scripts/fsdp2_run.py) runs every fit; the tests read its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from limits import limit_s, shared_fixture

SCRIPT = Path(__file__).parent / "scripts" / "fsdp2_run.py"
pytestmark = [pytest.mark.ddp, pytest.mark.slow]


@shared_fixture  # once per module; a failure fails one test, the others skip
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2")
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out)], capture_output=True, text=True,
                          timeout=limit_s(480))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def _rows(records, skip_peaks_of=()):
    return [(r["step"], r["seq_len"], r["batch_size"], r["stage"], tuple(r["mitigations"]),
             r["warmup"])
            + (() if r["step"] in skip_peaks_of else (r["peak_bytes"],)) for r in records]


def test_every_rank_records_every_step_and_the_ranks_agree(ranks):
    rank0, rank1 = ranks
    for fit in ("reference", "budget", "resumed"):
        assert len(rank0[f"{fit}_records"]) == 6
        assert _rows(rank0[f"{fit}_records"]) == _rows(rank1[f"{fit}_records"])
    assert [r["seq_len"] for r in rank0["reference_records"]] == [64, 64, 128, 128, 256, 256]


def test_forecast_at_four_times_the_longest_traced_length_is_within_3_percent_per_rank(ranks):
    rank0 = ranks[0]
    assert rank0["traced_before_forecast"] == [64]
    measured = max(r["peak_bytes"] for r in rank0["reference_records"]
                   if r["seq_len"] == 256 and not r["warmup"])
    for name in ("here", "world2"):  # the planner's forecast, and the explicit 2-rank plan
        fc = rank0[f"forecast256_{name}"]
        assert fc["method"] == "dry_run"
        assert abs(fc["peak"] - measured) / measured < 0.03, (name, fc["peak"], measured)
        assert fc["upper"] >= measured
    # 4 ranks hold a quarter of the parameters, gradients and optimizer state instead of a half
    assert rank0["forecast256_world4"]["peak"] < rank0["forecast256_world2"]["peak"]
    assert "rank 0 of 4 (fsdp2)" in rank0["forecast256_world4"]["detail"]


def test_rungs_switched_on_mid_run_under_fsdp2_keep_the_gradients_and_the_budget(ranks):
    rank0, rank1 = ranks
    assert rank0["budget_applied"] == rank1["budget_applied"] == ["checkpointing", "microbatch"]
    first_on = min(r["step"] for r in rank0["budget_records"] if r["mitigations"])
    assert first_on > 0  # mid-run, not before the first step
    assert max(r["peak_bytes"] for r in rank0["budget_records"]) <= rank0["usable_budget"]
    # the same steps as the reference run (same lengths), so without rungs step 4 would be over
    assert max(r["peak_bytes"] for r in rank0["reference_records"]) > rank0["usable_budget"]
    # decided by the dry run of the sharded step, which then matched the measured steady step
    assert all("'before_method': 'dry_run'" in e for e in rank0["budget_events"])
    last = rank0["budget_records"][-1]
    assert last["forecast_method"] == "dry_run" and not last["warmup"]
    assert abs(last["forecast_peak_bytes"] - last["peak_bytes"]) / last["peak_bytes"] < 0.01
    assert len(rank0["grad_rel_diff"]) == 6
    assert max(rank0["grad_rel_diff"]) < 1e-5  # float summation order only
    assert rank0["param_rel_diff"] < 1e-5


def test_resume_from_a_sharded_checkpoint_equals_the_uninterrupted_run(ranks):
    rank0, rank1 = ranks
    assert rank0["checkpoint_is_dir"]  # a distributed checkpoint: one shard file per rank
    # the first resumed step (step 2) has no gradients from a step before it: its peak differs
    assert _rows(rank0["resumed_records"], (2,)) == _rows(rank0["budget_records"], (2,))
    assert rank0["resumed_applied"] == rank0["budget_applied"]
    assert rank0["resumed_param_rel_diff"] == 0.0 and max(rank0["resumed_grad_rel_diff"]) == 0.0
    assert rank1["resumed_param_rel_diff"] == 0.0
    # checkpointing composed with fully_shard leaves parameter names and checkpoint keys unchanged
    before_rungs, after_rungs = rank0["checkpoint_keys"]
    assert before_rungs == after_rungs and len(before_rungs) == 28
    names = rank0["parameter_names"]
    assert names[0] == names[1] == names[2]
    assert sorted("state_dict." + n for n in names[0]) == before_rungs
