"""``seqmem plan --workers N``: the table's rows dry-run in N processes are the rows one process
dry-runs, and a worker that fails or hangs costs the plan nothing but its wait
(lightning_seqmem.cli.plan_workers)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from pathlib import Path

import pytest

from lightning_seqmem.cli import plan_workers
from lightning_seqmem.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
CPU_DEMO = ROOT / "configs" / "cpu_demo.yaml"
ARGS = ["plan", "--config", str(CPU_DEMO), "--lengths", "1024", "4096", "--budget", "450MiB",
        "--longest", "--json"]


def _plan(capsys, *extra: str) -> dict:
    assert main([*ARGS, *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> dict:
    """The plan of ARGS in this process alone (``--workers 1``), made once for the module."""
    out, cwd = io.StringIO(), os.getcwd()
    os.chdir(tmp_path_factory.mktemp("alone"))
    try:
        with contextlib.redirect_stdout(out):
            assert main([*ARGS, "--workers", "1"]) == 0
    finally:
        os.chdir(cwd)
    return json.loads(out.getvalue())


def _answers(doc: dict) -> tuple:
    """Everything a plan answers, its timings apart."""
    rows = [[(r["mitigations"], r["offload"], r["peak_bytes"], r["host_peak_bytes"], r["fits"],
              r["error"])
             for r in res["rows"] + res["searched_rows"]] for res in doc["lengths"]]
    devices = [{k: v for k, v in d.items() if k != "process"} for d in doc["devices"]]
    return rows, [(res["plan"], res["fastest"])
                  for res in doc["lengths"]], doc["longest_fitting_by_set"], devices


def test_rows_dry_run_in_two_processes_are_the_rows_of_one(alone, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    split = _plan(capsys, "--workers", "2")
    assert (alone["processes"], split["processes"]) == (1, 2)
    assert _answers(split) == _answers(alone) and split["dry_runs"] == alone["dry_runs"]
    assert alone["dry_runs"] >= 8  # 4 sets at 2 lengths at least, each a real fake step


def test_a_second_device_answered_by_a_worker_is_answered_as_here(tmp_path, monkeypatch, capsys):
    """Two devices: the second one's plans and searches run in the worker, from this process's rows;
    every device's answer equals a plan alone's (a length both devices' searches ask may be dry-run
    twice)."""
    monkeypatch.chdir(tmp_path)
    budgets = ["--budget", "450MiB", "600MiB"]
    alone, split = (_plan(capsys, *budgets, "--workers", "1"),
                    _plan(capsys, *budgets, "--workers", "2"))
    assert split["processes"] == 2 and [d["process"] for d in split["devices"]] == [0, 1]
    assert [d["process"] for d in alone["devices"]] == [0, 0]
    assert _answers(split) == _answers(alone) and split["dry_runs"] >= alone["dry_runs"]
    assert any(e["searched_seq_len"] for e in split["devices"][1]["longest_fitting_by_set"]
               if "searched_seq_len" in e)


@pytest.mark.parametrize("command", [["python3", "-c", "import sys; sys.exit(3)"], ["sleep", "60"]],
                         ids=["fails", "hangs"])
def test_a_worker_that_fails_or_hangs_is_ignored(command, alone, tmp_path, monkeypatch, capsys):
    """A worker that exits at once, or never answers (stopped after the wait), leaves its rows to
    this process: the same answers as a plan alone."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(plan_workers, "worker_command", lambda: command)
    monkeypatch.setattr(plan_workers, "WAIT_FLOOR_S", 1.0)
    monkeypatch.setattr(plan_workers, "WAIT_FACTOR", 0.0)
    started = time.perf_counter()
    split = _plan(capsys, "--workers", "2")
    assert split["processes"] == 1 and _answers(split) == _answers(alone)
    assert time.perf_counter() - started < 50  # the hanging worker was not waited for


def test_workers_is_checked_before_any_work(capsys):
    with pytest.raises(SystemExit):
        main([*ARGS, "--workers", "0"])
    assert "--workers" in capsys.readouterr().err


def test_the_default_worker_count_follows_the_environment(monkeypatch):
    monkeypatch.setenv("SEQMEM_PLAN_WORKERS", "3")
    assert plan_workers.default_workers() == 3
    monkeypatch.setenv("SEQMEM_PLAN_WORKERS", "0")
    with pytest.raises(ValueError, match="SEQMEM_PLAN_WORKERS must be a positive integer, got '0'"):
        plan_workers.default_workers()
    monkeypatch.delenv("SEQMEM_PLAN_WORKERS")
    assert 1 <= plan_workers.default_workers() <= 2
