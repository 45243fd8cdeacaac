"""The benchmark scripts run end to end (as subprocesses) and print what they promise."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from limits import limit_s

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(script: str, *args: str, timeout: float = 300) -> str:
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        timeout=limit_s(timeout),
        cwd=BENCHMARKS.parent,
    )
    assert proc.returncode == 0, (f"{script} exited {proc.returncode}\nstdout:\n{proc.stdout}"
                                  f"\nstderr:\n{proc.stderr}")
    return proc.stdout


def test_prediction_accuracy_quick_replay_is_within_one_percent():
    out = _run("prediction_accuracy.py", "--quick")
    assert "prediction_accuracy: batch 4, vocab 256, L0=16" in out
    assert re.search(
        r"^shape\s+attention\s+ckpt\s+target\s+measured MiB\s+replay\s+quad\s+quad>=T/4", out, re.M)
    for attention in ("eager", "sdpa"):
        for ckpt in ("off", "on"):
            assert re.search(rf"^\S+\s+{attention}\s+{ckpt}\s+16·L0=256\s", out,
                             re.M), (attention, ckpt, out)
    replay = re.search(r"^SUMMARY replay\s+worst \|error\|: @8L0=([\d.]+)% @16L0=([\d.]+)%.*: "
                       r"(PASS|FAIL)$", out, re.M)
    assert replay, out
    assert float(replay.group(1)) <= 1.0 and float(replay.group(2)) <= 1.0, replay.group(0)
    assert replay.group(3) == "PASS"
    quadratic = re.search(r"^SUMMARY quad>=T/4\s+worst \|error\|: @8L0=([\d.]+)%.*target <= 15% at "
                          r"8·L0: (PASS|FAIL)$", out, re.M)
    assert quadratic, out
    assert re.search(r"^total runtime: [\d.]+ s$", out, re.M)


@pytest.mark.slow  # about 15 s on the shared 2-core machine (4 short Trainer runs + imports)
def test_overhead_quick_prints_ratios():
    # one interleaved repeat: each configuration's row and ratio are there after one run of each
    out = _run("overhead.py", "--quick", "--repeats", "1")
    assert "overhead: SeqMemCallback step-time ratio vs no callback" in out
    assert re.search(r"^\s+config\s+steps\s+mean ms\s+median ms\s+ratio mean\s+ratio median$", out,
                     re.M)
    rows = {}
    for name in ("baseline", "seqmem", "seqmem/10"):
        match = re.search(
            rf"^\s+{re.escape(name)}\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out,
            re.M)
        assert match, (name, out)
        rows[name] = match
    assert float(rows["baseline"].group(4)) == 1.0
    assert all(int(m.group(1)) > 0 and float(m.group(2)) > 0 for m in rows.values())
    assert "the <= 1.01 target applies to the CUDA allocator counters" in out or "[cuda]" in out
    assert re.search(r"^total runtime: [\d.]+ s$", out, re.M)


def test_gpu_check_runs_or_skips():
    import torch

    out = _run("gpu_check.py", timeout=600)
    if torch.cuda.is_available():
        assert "SUMMARY forecast error" in out
        assert re.search(r"^total runtime: [\d.]+ s$", out, re.M)
    else:
        assert out.strip() == "no CUDA device: gpu_check skipped"


def test_mitigation_gain_quick_every_forecast_length_fits_and_the_ladder_gains_most():
    out = _run("mitigation_gain.py", "--quick")
    rows = {}
    for line in out.splitlines():
        match = re.match(r"^(none|attention|checkpointing|microbatch|attention \+ checkpointing \+ "
                         r"microbatch)\s+(\d+)\s.*?\s(ok|OVER)\s+([\d.]+)x\s+([\d.]+)x$", line)
        if match:
            rows[match.group(1)] = (int(match.group(2)), match.group(3), float(match.group(4)))
    assert len(rows) == 5, out
    assert all(check == "ok" for _, check, _ in rows.values()), out
    ladder_len = rows["attention + checkpointing + microbatch"][0]
    assert all(ladder_len > length for name, (length, _, _) in rows.items() if "+" not in name)
    assert all(gain > 1 for name, (_, _, gain) in rows.items() if name != "none")


def test_curriculum_search_quick_zero_ooms():
    out = _run("curriculum_search.py", "--quick")
    assert "seqmem: 0 OOMs" in out and "PASS" in out, out


def test_kernels_check_prints_the_simulated_dry_runs_and_their_kernels():
    """benchmarks/kernels_check.py: the modelled CUDA kernels' dry runs beside a measured GPU step
    (without CUDA: the simulated column alone), each row naming the kernel modelled."""
    out = _run("kernels_check.py", "--lengths", "1024", timeout=300)
    assert re.search(r"^variant\s+seq_len\s+simulated MiB\s+measured MiB\s+error\s+kernels$", out,
                     re.M)
    for variant, kernel in (("sdpa-bf16", "SDPA flash"), ("sdpa-fp32", "SDPA math"),
                            ("sdpa-bf16-padded", "SDPA efficient")):
        assert re.search(rf"^{re.escape(variant)}\s+1024\s+[\d.]+\s+\S+\s+\S+\s+{kernel}", out,
                         re.M), out
    assert re.search(r"^total runtime: [\d.]+ s$", out, re.M)
