"""Planning the runs people train, on this machine: Llama-3.1-8B at 32K-128K tokens on one GPU, \
70B on 8.

Runs ``seqmem plan --json`` as a user would, in a subprocess whose address space is capped
(``ulimit -v``, default 8,000,000 KiB: what a laptop may spare), on the repository's configs:

* ``configs/llama3_8b_long.yaml`` (8.0 B parameters, bf16-mixed, flash-attention 2 named, batch 1):
  ``--lengths 32768 65536 131072 --longest``, answered for an 80 GB H100 and a 141 GB H200;
* ``configs/llama3_70b_node.yaml`` (70.6 B, 80 layers, hidden 8192): the same at ``--world-size 8``
  (``--lengths 16384 32768 65536``).

It prints, per config, the wall time and the peak resident memory of the planning: of its largest
process (``getrusage(RUSAGE_CHILDREN)``) and of all its processes together (the plan and its
``--workers``, sampled from ``/proc`` every 0.2 s), the goal (≤ 120 s and ≤ 180 s), and per setting
the longest length that fits on each device with the host memory it holds there (offload settings
hold parameters, gradients and optimizer state on the host); at ``--world-size 8`` also each
device's layout plan per length (sequence parallelism, offload). ``--json``: the last line is one
JSON object with all of it.

    python benchmarks/real_scale.py               # both configs
    python benchmarks/real_scale.py --only 8b --json
"""

from __future__ import annotations

import argparse
import json
import resource
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CASES = {
    "8b": {"config": "configs/llama3_8b_long.yaml",
           "args": ["--lengths", "32768", "65536", "131072", "--longest"], "goal_s": 120.0},
    "70b": {"config": "configs/llama3_70b_node.yaml",
            "args": ["--lengths", "16384", "32768", "65536", "--world-size", "8", "--longest"],
            "goal_s": 180.0},
}


def _tree_rss_bytes(pid: int) -> int:
    """The resident memory of process ``pid`` and all its descendants now (Linux ``/proc``), 0 once
    gone."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) * 1024 for line in f
                               if line.startswith("VmRSS:")), 0)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return total


def _plan(case: dict[str, Any], limit_kib: int) -> dict[str, Any]:
    """One ``seqmem plan --json`` under ``ulimit -v limit_kib``: its document, wall seconds, peak
    RSS of its largest process (``getrusage``) and of all its processes together (sampled every 0.2
    s: the plan's workers)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    command = [sys.executable, "-m", "lightning_seqmem.cli.main", "plan", "--config",
               case["config"], *case["args"], "--json"]
    cap = f"ulimit -v {int(limit_kib)} && exec " + " ".join(command)
    started = time.perf_counter()
    proc = subprocess.Popen(["bash", "-c", cap], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    chunks: dict[str, list[str]] = {"out": [], "err": []}
    readers = [threading.Thread(target=lambda s=s, k=k: chunks[k].append(s.read()), daemon=True)
               for k, s in (("out", proc.stdout), ("err", proc.stderr))]
    for reader in readers:
        reader.start()
    tree_peak = 0
    while proc.poll() is None:
        tree_peak = max(tree_peak, _tree_rss_bytes(proc.pid))
        time.sleep(0.2)
    for reader in readers:
        reader.join()
    seconds = time.perf_counter() - started
    stdout, stderr = "".join(chunks["out"]), "".join(chunks["err"])
    rss_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    out: dict[str, Any] = {"config": case["config"],
                           "command": "seqmem plan --config " + case["config"] + " "
                           + " ".join(case["args"]), "exit_status": proc.returncode,
                           "wall_seconds": seconds, "goal_seconds": case["goal_s"],
                           "peak_rss_bytes": max(rss_kib, before) * 1024,
                           "peak_rss_all_processes_bytes": tree_peak,
                           "address_space_limit_bytes": int(limit_kib) * 1024}
    try:
        out["plan"] = json.loads(stdout)
        out["processes"] = out["plan"].get("processes", 1)
    except json.JSONDecodeError:
        out["plan"] = None
        out["stderr"] = stderr[-4000:]
    return out


def _rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per setting: the longest length on each device and the host memory there."""
    settings: dict[str, dict[str, Any]] = {}
    for device in doc["devices"]:
        for entry in device["longest_fitting_by_set"]:
            name = " + ".join(entry["mitigations"]
                              + (["offload"] if entry.get("offload") else [])) or "none"
            row = settings.setdefault(name, {"setting": name,
                                             "step_time_factor": entry["step_time_factor"],
                                             "longest": {}, "host_peak_bytes": None})
            longest = entry.get("searched_seq_len", entry["seq_len"])
            row["longest"][device["name"]] = {"seq_len": longest,
                                              "at_least": bool(entry.get("open_ended")),
                                              "searched": "searched_seq_len" in entry}
            if entry.get("host_peak_bytes") is not None:
                row["host_peak_bytes"] = max(row["host_peak_bytes"] or 0, entry["host_peak_bytes"])
    return list(settings.values())


def _print(name: str, result: dict[str, Any]) -> None:
    gib = 2**30
    print(f"\n{name}: {result['command']}")
    ok = result["wall_seconds"] <= result["goal_seconds"] and result["exit_status"] == 0
    print(f"  exit {result['exit_status']}, {result['wall_seconds']:.1f} s wall (goal ≤ "
          f"{result['goal_seconds']:.0f} s: {'PASS' if ok else 'FAIL'}), "
          f"peak RSS {result['peak_rss_bytes'] / gib:.2f} GiB per process under a "
          f"{result['address_space_limit_bytes'] / gib:.1f} GiB address-space limit, "
          f"{result['peak_rss_all_processes_bytes'] / gib:.2f} GiB in all "
          f"{result.get('processes', 1)} processes")
    doc = result["plan"]
    if doc is None:
        print("  no plan:", result.get("stderr", "")[-800:])
        return
    print(f"  {doc['dry_runs']} dry runs in {doc['dry_run_seconds']:.1f} s on "
          f"{doc['device']} (simulating "
          f"{doc['simulates']}), {doc['precision']}, batch {doc['batch_size']}")
    devices = [d["name"] for d in doc["devices"]]
    print("  " + f"{'setting':58s}" + "".join(f"{d:>20s}" for d in devices) + f"{'host GiB':>10s}")
    for row in _rows(doc):
        cells = []
        for d in devices:
            cell = row["longest"].get(d)
            cells.append("-" if cell is None else ("none" if not cell["seq_len"] else
                                                   ("≥" if cell["at_least"] else "")
                                                   + str(cell["seq_len"])
                                                   + ("" if cell["searched"] else "*")))
        host = "-" if row["host_peak_bytes"] is None else f"{row['host_peak_bytes'] / gib:.1f}"
        print("  " + f"{row['setting'][:58]:58s}" + "".join(f"{c:>20s}" for c in cells)
              + f"{host:>10s}")
    print("  (≥N: fits the longest length asked; N*: "
          "the longest of the lengths dry-run, not searched)")
    for device in doc["devices"]:  # --world-size N: each device's layout plan per length
        for entry in device.get("parallel_plans") or []:
            plan = entry["plan"]
            print(f"  layout on {device['name']} at {entry['seq_len']}: " + (
                "none fits" if plan is None else
                f"{plan['layout']}, rungs {' + '.join(plan['mitigations']) or 'none'}, "
                f"{plan['peak_bytes'] / gib:.1f} GiB per rank"
                + (f", host {plan['host_bytes'] / gib:.1f} GiB" if plan["host_bytes"] else "")))


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(CASES), action="append",
                        help="run only this config (repeatable)")
    parser.add_argument("--address-space-kib", type=int, default=8_000_000,
                        help="ulimit -v of the planning process")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args(argv)
    results = {}
    for name in args.only or sorted(CASES):
        results[name] = _plan(CASES[name], args.address_space_kib)
        _print(name, results[name])
        if results[name]["plan"] is not None:
            results[name]["settings"] = _rows(results[name]["plan"])
            # the per-length rows: in `seqmem plan --json` itself
            del results[name]["plan"]["lengths"]
    if args.json:
        print(json.dumps(results))
    return 0 if all(r["exit_status"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
