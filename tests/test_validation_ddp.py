"""Validation batches under several ranks (2 gloo processes, tests/scripts/validation_ddp_run.py):
ranks that draw through Lightning's distributed sampler agree before each validation batch, under
DDP and FSDP2; ranks that draw otherwise are said once and never hang."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from limits import run, shared_fixture

pytestmark = pytest.mark.ddp
DDP_MODES = ("together", "broken", "apart")  # one launch (the FSDP2 fit has its own)


def _launch(tmp_path: Path, modes: tuple[str, ...]) -> dict[str, list[dict]]:
    script = Path(__file__).parent / "scripts" / "validation_ddp_run.py"
    proc = run([sys.executable, str(script), str(tmp_path), ",".join(modes)], 15 * len(modes))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {mode: [json.loads((tmp_path / f"rank{r}_{mode}.json").read_text()) for r in (0, 1)]
            for mode in modes}


@shared_fixture  # once per module
def ddp_runs(tmp_path_factory) -> dict[str, list[dict]]:
    return _launch(tmp_path_factory.mktemp("validation_ddp"), DDP_MODES)


def _ddp_fit(request: pytest.FixtureRequest, tmp_path: Path, mode: str) -> list[dict]:
    if mode in DDP_MODES:
        return request.getfixturevalue("ddp_runs")[mode]
    return _launch(tmp_path, (mode,))[mode]


@pytest.mark.parametrize("mode", ["together", "fsdp2"])
def test_ddp_ranks_agree_on_the_rungs_for_the_longest_validation_batch_on_any_rank(
        request, tmp_path, mode):
    """Lightning's distributed sampler gives rank 0 a validation batch of 64 tokens and rank 1 one
    of 1024, which eager attention runs at 138 MiB against a 16.2 MiB budget: rank zero judges the
    largest shape on any rank, and attention goes on on both ranks before the sanity check's batch
    runs. Rank 1's measured batch equals rank zero's dry run of it to the byte, under DDP and with
    the module sharded by FSDP2 (the sharded dry run of the unsharded template)."""
    zero, one = _ddp_fit(request, tmp_path, mode)
    usable = zero["usable"]
    for rank in (zero, one):
        assert rank["global_step"] == 2 and rank["applied_mitigations"] == ["attention"]
        assert [e[:2] for e in rank["events"]] == [[0, "attention"]]  # before any step
        assert [run[2] for run in rank["runs"]] == [["attention"]] * 2  # every batch ran with it
        assert max(rank["training_peaks"]) <= usable
        assert all(row["peak_bytes"] <= usable for row in rank["validation_rows"])
    assert [run[0] for run in one["runs"]] == [1024, 1024]
    said = [s for s in zero["said"] if "validation batch" in s]
    assert len(said) == 1 and "seq_len=1024, batch 4" in said[0]
    assert "switched on attention before it runs" in said[0]
    # the sanity check (no gradients, no optimizer state): rank zero's dry run of rank 1's shape
    judged = {(L, B, tuple(on), tuple(held)): peak for L, B, on, held, peak in zero["judged"]}
    assert judged[(1024, 4, (), (False, False))] > 8 * usable  # 144 MB eager
    assert one["validation_rows"][0]["peak_bytes"] == judged[(1024, 4, ("attention",),
                                                              (False, False))]
    # the report's rows (rank zero's) are the highest peak on any rank, with its rank and shape;
    # after a step the dry run holds rank zero's own batch copy too (an upper bound for rank 1)
    rows = zero["validation_rows"]
    assert [(row["rank"], row["seq_len"]) for row in rows] == [(1, 1024), (1, 1024)]
    assert [row["peak_bytes"] for row in rows] == [row["peak_bytes"] for row in one[
        "validation_rows"]]
    assert rows[0]["dry_run_peak_bytes"] == rows[0]["peak_bytes"]
    assert 0 <= rows[1]["dry_run_peak_bytes"] - rows[1]["peak_bytes"] < 0.01 * usable


def test_ddp_ranks_that_count_validation_batches_apart_are_said_and_never_hang(ddp_runs):
    """Without Lightning's distributed sampler (rank 0 one batch, rank 1 two) the ranks cannot
    agree before each batch: it is said once, rank zero's batch over the budget is said, and both
    ranks finish."""
    zero, one = ddp_runs["apart"]
    assert zero["global_step"] == one["global_step"] == 2 and len(one["runs"]) == 3
    said = [s for s in zero["said"] if "validation" in s]
    assert len(said) == 2 and "not drawn by Lightning's distributed sampler" in said[0]
    assert "seq_len=512" in said[1] and "cannot agree on rungs for it" in said[1]
    (row,) = zero["validation_rows"]
    assert row["dry_run_peak_bytes"] == row["peak_bytes"] > zero["usable"]


def test_a_rank_whose_validation_measurement_breaks_still_joins_the_gather(ddp_runs):
    """The callback's measurement of rank 1's validation batches raises: rank 1 says it once and
    still joins the gather, so no rank hangs; both ranks train on, measured, and rank zero's rows
    keep its own measurements (no rank's batch is reported as measured when one failed)."""
    zero, one = ddp_runs["broken"]
    assert zero["global_step"] == one["global_step"] == 2
    assert len(zero["training_peaks"]) == len(one["training_peaks"]) == 2
    assert "failed-the validation batch's measurement" in one["warned"]
    assert [row["peak_bytes"] for row in one["validation_rows"]] == [None, None]
    assert [(row["rank"], row["seq_len"]) for row in zero["validation_rows"]] == [(0, 64)] * 2
    assert all(row["peak_bytes"] > 0 for row in zero["validation_rows"])
