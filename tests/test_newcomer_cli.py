"""A newcomer's mistakes with the ``seqmem`` command and the examples: each ends in one clear line
on stderr and a non-zero exit, fast (most before torch is imported), never in a traceback.

Most run ``seqmem``'s :func:`main` in this process, as the console script calls it; a mistake
found after training started, and the example script's, run in a process of their own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from limits import run

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "cpu_demo.yaml"


def _seqmem(args, cwd, base_s=30):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "COLUMNS": "140"}
    env.pop("SEQMEM_TRACEBACK", None)
    return run([sys.executable, "-m", "lightning_seqmem.cli.main", *args], base_s, cwd=cwd, env=env)


def _seqmem_here(args, cwd, monkeypatch, capsys):
    """``seqmem ARGS`` in ``cwd`` through :func:`main` in this process (the console script runs
    ``sys.exit(main())``): its exit status, stdout and stderr, as :func:`_seqmem` gives a
    process's. An exception escaping ``main`` (a traceback) fails the test."""
    from lightning_seqmem.cli.main import main

    monkeypatch.chdir(cwd)
    monkeypatch.setenv("COLUMNS", "140")
    monkeypatch.delenv("SEQMEM_TRACEBACK", raising=False)
    capsys.readouterr()
    try:
        code = main(args)
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def _one_error_line(proc, command: str) -> str:
    """The error line of a failed run: the last line of stderr, starting with the command's name."""
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    errors = [line for line in lines if ": error: " in line]
    assert errors == [lines[-1]], lines  # one error line, and it is the last
    assert lines[-1].startswith(f"{command}: error: "), lines[-1]
    return lines[-1]


@pytest.mark.parametrize("args, words", [
    (["forecast", "--config", "missing.yaml", "--lengths", "128"],
     ["--config", "no such file: 'missing.yaml'"]),
    (["plan", "--config", "missing.yaml", "--lengths", "128"],
     ["--config", "no such file: 'missing.yaml'"]),
    (["report", "missing.json"], ["no such file or folder: 'missing.json'"]),
    (["demo", "--budget", "12G"], ["--budget", "'12G'", "KiB, MiB, GiB", "12GiB", "12GB"]),
    (["demo", "--start", "2048", "--target", "1024"],
     ["--target 1024 is shorter than --start 2048"]),
    (["demo", "--batch-size", "0"], ["--batch-size", "positive whole number", "'0'"]),
    (["demo", "--mitigations", "fp8"], ["--mitigations", "'fp8'", "attention"]),
    (["panels", "never_existed"], ["no such folder: 'never_existed'"]),
    # forecast checks what plan checks, before any work: a margin of 150% planned nothing
    *[(["forecast", "--config", str(CONFIG), "--lengths", "512", *more], words) for more, words in [
        (["--safety-margin", "1.5"], ["--safety-margin", "[0, 1)", "'1.5'"]),
        (["--batch-size", "0"], ["--batch-size", "positive whole number", "'0'"]),
        (["--trace-lengths", "0", "64"], ["--trace-lengths", "positive whole number", "'0'"])]],
])
def test_a_mistake_ends_in_one_line(tmp_path, args, words, monkeypatch, capsys):
    line = _one_error_line(_seqmem_here(args, tmp_path, monkeypatch, capsys), f"seqmem {args[0]}")
    for word in words:
        assert word in line, line
    assert "permanently deleted" not in line


def test_report_and_panels_on_a_folder_without_them_say_what_is_missing_and_where_it_is(
        tmp_path, monkeypatch, capsys):
    (tmp_path / "runs" / "demo" / "version_0").mkdir(parents=True)
    (tmp_path / "runs" / "demo" / "version_0" / "seqmem_report.json").write_text("{}")
    (tmp_path / "runs" / "demo" / "version_0" / "events.out.tfevents.1.host").write_bytes(b"")
    line = _one_error_line(_seqmem_here(["report", "runs"], tmp_path, monkeypatch, capsys),
                           "seqmem report")
    assert "'runs' holds no seqmem_report.json" in line and str(Path("runs/demo/version_0")) in line
    line = _one_error_line(_seqmem_here(["panels", "runs"], tmp_path, monkeypatch, capsys),
                           "seqmem panels")
    assert ("'runs' holds no TensorBoard event files" in line
            and str(Path("runs/demo/version_0")) in line)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU runs the GPU config")
def test_the_gpu_accelerator_on_a_cpu_machine_is_one_line(tmp_path, monkeypatch, capsys):
    proc = _seqmem_here(["demo", "--accelerator", "cuda"], tmp_path, monkeypatch, capsys)
    line = _one_error_line(proc, "seqmem demo")
    assert "no CUDA device" in line and "--accelerator cpu" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU runs the GPU config")
def test_the_gpu_config_on_a_cpu_machine_is_one_line(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = run([sys.executable, str(ROOT / "examples" / "train_gpt_cli.py"), "fit", "--config",
                str(ROOT / "configs" / "gpt2_small_8k_80gb.yaml")], 60, cwd=tmp_path, env=env)
    line = _one_error_line(proc, str(ROOT / "examples" / "train_gpt_cli.py"))
    assert "CUDAAccelerator" in line and "configs/cpu_demo.yaml" in line


def test_a_budget_below_the_parameters_is_one_line_before_any_step(tmp_path):
    proc = _seqmem(["demo", "--budget", "1MiB", "--out", "runs"], tmp_path, base_s=60)
    line = _one_error_line(proc, "seqmem demo")
    assert "memory_budget=1.0 MiB cannot be met: the parameters and buffers alone take" in line
    assert "ZeRO" not in line and "across GPUs" not in line
    assert not list(tmp_path.rglob("seqmem_report.json"))  # nothing trained, nothing reported
