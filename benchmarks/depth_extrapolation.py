"""A dry run of an 8B model, whole and depth-extrapolated: seconds and bytes side by side (CPU).

Model: a Llama-3.1-8B-shaped config (vocab 128256, hidden 4096, MLP 14336, 32 layers, 32 heads,
8 KV heads, rotary up to 131072 tokens), SDPA attention, built on the meta device in bf16
(``with torch.device("meta"): HFCausalLM(config=..., attn_implementation="sdpa")``, then
``.to(torch.bfloat16)``: nothing allocated), AdamW from its ``configure_optimizers``, batch 1.

For each setting, at ``--length`` tokens on ``--device``:

* ``full s``: :func:`~lightning_seqmem.dryrun.step.dry_run_step` of the whole model (every layer's
  ops through the fake-tensor dispatch);
* ``depth s``: :func:`~lightning_seqmem.dryrun.depth.depth_dry_run_step`, cold (the setting's proof:
  copies of 1-3 blocks, more for ``k/N``) and ``again s`` at another length (``--length`` + 4096:
  one copy's dry run, the proof cached), each against the full dry run at its length;
* the peaks (GiB), and whether every figure (peak, each phase's peak, host bytes) is equal to the
  byte.

``--plan``: also ``seqmem plan --lengths 32768 65536 131072 --longest --budget 80GB --json`` of
this model over the default settings, as a user runs it (a process of its own; a config naming this
script's ``MetaLlama``): wall and CPU seconds, and each setting's longest length that fits. The plan
asks every dry run depth-extrapolated; it runs on one core, so its CPU seconds are its wall time on
an idle machine (on a shared one the wall time is longer).

    python benchmarks/depth_extrapolation.py            # 32 layers, 4 settings (a few minutes)
    python benchmarks/depth_extrapolation.py --plan     # and the plan's time
    python benchmarks/depth_extrapolation.py --quick    # 8 layers, width 256, 2 settings
    python benchmarks/depth_extrapolation.py --json     # last line: the figures as one JSON object
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

from lightning_seqmem.reference.hf import HFCausalLM

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072)
QUICK = dict(LLAMA_8B, vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
             num_attention_heads=4, num_key_value_heads=2)
SETTINGS = [(), ("checkpointing",), ("checkpointing:12/32",), ("checkpointing:selective",)]
PLAN_LENGTHS = (32768, 65536, 131072)
PLAN_CONFIG = """\
trainer: {accelerator: cpu, devices: 1}
model:
  class_path: depth_extrapolation.MetaLlama
  init_args: {num_hidden_layers: %d}
data:
  class_path: lightning_seqmem.reference.demo.SyntheticTokenDataModule
  init_args: {batch_size: 1, seq_len: 16, num_samples: 8, vocab_size: 128256}
"""
GiB = 2**30


class MetaLlama(HFCausalLM):
    """:class:`~lightning_seqmem.reference.hf.HFCausalLM` of the 8B config built on the meta
    device in bf16 (for ``seqmem plan``: a LightningCLI config names it)."""

    def __init__(self, num_hidden_layers: int = 32, attn_implementation: str = "sdpa") -> None:
        with torch.device("meta"):
            super().__init__(config=dict(LLAMA_8B, num_hidden_layers=num_hidden_layers),
                             attn_implementation=attn_implementation)
        self.hparams.update(shift_labels=False, lr=3e-4, weight_decay=0.0)
        self.to(torch.bfloat16)


def meta_model(config: dict) -> HFCausalLM:
    with torch.device("meta"):
        model = HFCausalLM(config=config, attn_implementation="sdpa")
    return model.to(torch.bfloat16)


def _figures(result: Any) -> tuple:
    return result.peak_bytes, result.phase_peak_bytes, result.host_bytes


def compare(model: Any, names: tuple, seq_len: int, device: str) -> dict:
    """Full and depth-extrapolated dry runs of a setting at two lengths (the 2nd: proof cached)."""
    from lightning_seqmem.dryrun.depth import depth_dry_run_step
    from lightning_seqmem.dryrun.step import dry_run_step

    tokens = torch.zeros(1, 16, dtype=torch.long)
    batch = {"input_ids": tokens, "labels": tokens}
    row: dict[str, Any] = {"setting": " + ".join(names) or "none", "seq_len": seq_len}
    for key, L in (("cold", seq_len), ("again", seq_len + 4096)):
        t = time.perf_counter()
        deep = depth_dry_run_step(model, None, batch, L, 1, names, device=device)
        row[f"depth_{key}_s"] = time.perf_counter() - t
        t = time.perf_counter()
        full = dry_run_step(model, None, batch, L, 1, names, device=device)
        row[f"full_{key}_s"] = time.perf_counter() - t
        row[f"equal_{key}"] = _figures(deep) == _figures(full)
        row[f"peak_{key}_bytes"], row[f"full_peak_{key}_bytes"] = deep.peak_bytes, full.peak_bytes
        row[f"detail_{key}"] = deep.detail.split("; the copy of")[0]
    return row


def plan_seconds(layers: int) -> dict:
    """``seqmem plan --longest --json`` of :class:`MetaLlama` in a process of its own, as a user
    runs it: wall and CPU seconds (the child's user + system time), exit status, each setting's
    longest length that fits (searched)."""
    here = os.path.dirname(os.path.abspath(__file__))
    command = [sys.executable, "-m", "lightning_seqmem.cli.main", "plan",
               "--config", "llama_8b.yaml", "--lengths", *map(str, PLAN_LENGTHS), "--longest",
               "--budget", "80GB", "--json"]
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "llama_8b.yaml"), "w", encoding="utf-8") as f:
            f.write(PLAN_CONFIG % layers)
        path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}
        before, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True, cwd=tmp, env=env)
        wall, after = time.perf_counter() - wall, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    out = {"plan_wall_s": wall, "plan_cpu_s": cpu, "plan_exit": proc.returncode,
           "plan_layers": layers}
    if proc.returncode == 0:
        doc = json.loads(proc.stdout)
        out["plan_longest"] = {" + ".join(e["mitigations"]) or "none": e.get("searched_seq_len")
                               for e in doc["longest_fitting_by_set"]}
    else:
        out["plan_error"] = proc.stderr[-2000:]
    return out


def _print_plan(out: dict) -> None:
    lengths = " ".join(map(str, PLAN_LENGTHS))
    print(f"seqmem plan --lengths {lengths} --longest --budget 80GB ({out['plan_layers']} layers, "
          f"default settings): {out['plan_wall_s']:.1f} s wall, {out['plan_cpu_s']:.1f} s CPU, "
          f"exit {out['plan_exit']}")
    for setting, longest in out.get("plan_longest", {}).items():
        print(f"  {setting:26s} longest that fits: {longest} tokens")
    if "plan_error" in out:
        print(out["plan_error"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=32768, help="tokens per sample")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (simulated without a GPU)")
    parser.add_argument("--quick", action="store_true", help="8 layers, width 256, 2 settings")
    parser.add_argument("--plan", action="store_true", help="also time seqmem plan --longest")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    started = time.perf_counter()
    config = QUICK if args.quick else LLAMA_8B
    settings = [(), ("checkpointing:3/8",)] if args.quick else SETTINGS
    model = meta_model(config)
    layers = config["num_hidden_layers"]
    print(f"depth_extrapolation: Llama-shaped, {layers} layers, hidden {config['hidden_size']}, "
          f"vocab {config['vocab_size']}, bf16 on meta, AdamW, batch 1, {args.length} tokens, "
          f"device {args.device}")
    print(f"{'setting':26s} {'full s':>7s} {'depth s':>8s} {'again s':>8s} {'full again s':>12s} "
          f"{'peak GiB':>9s} {'again GiB':>9s}  equal")
    rows = []
    for names in settings:
        row = compare(model, names, args.length, args.device)
        rows.append(row)
        equal = "yes" if row["equal_cold"] and row["equal_again"] else "NO"
        print(f"{row['setting']:26s} {row['full_cold_s']:7.2f} {row['depth_cold_s']:8.2f} "
              f"{row['depth_again_s']:8.2f} {row['full_again_s']:12.2f} "
              f"{row['peak_cold_bytes'] / GiB:9.2f} {row['peak_again_bytes'] / GiB:9.2f}  {equal}",
              flush=True)
    print(f"how: {rows[-1]['detail_again']}")
    equal = all(r["equal_cold"] and r["equal_again"] for r in rows)
    print(f"SUMMARY every figure equal to the full dry run's: {'PASS' if equal else 'FAIL'}")
    out: dict[str, Any] = {"rows": rows, "equal": equal}
    if args.plan:
        out.update(plan_seconds(layers))
        _print_plan(out)
    print(f"total runtime: {time.perf_counter() - started:.1f} s")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
