"""What fits on N ranks with FSDP2, planned on one process; and how close the plan is to a real \
run. (CPU)

Plan figures: :func:`~lightning_seqmem.dryrun.sharded.sharded_dry_run_step` gives the per-rank peak
of one training step of a GPT sharded with ``fully_shard`` (each block, then the root) at N ranks,
by a dry run in a fake process group of N ranks (this process plays rank 0); printed against N at
one length, and against the length at one N, with the seconds each plan took. DDP (replicas) for
comparison: the world size changes nothing per rank.

Accuracy: a real 4-process gloo run (Lightning's ``ModelParallelStrategy(data_parallel_size=4)``,
``examples/fsdp2_cpu.py``'s ``ShardedLitGPT``) measured by SeqMemCallback (the live-tensor tracker
on every rank; the record keeps the highest rank's peak) against the 4-rank plan of the same module
and batch. 4 processes on 2 cores are slow (about a minute) but work.

    python benchmarks/fsdp_plan.py              # plan figures, then the 4-process measurement
    python benchmarks/fsdp_plan.py --quick      # a smaller model and fewer points; still measures
    python benchmarks/fsdp_plan.py --no-measure # plan figures only
    python benchmarks/fsdp_plan.py --json       # the figures as one JSON dict
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

# the 4-process check
MEASURE = dict(n_layer=2, d_model=64, n_head=2, seq_len=256, batch_size=2, world_size=4)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def plan_figures(quick: bool, show: bool) -> dict:
    from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
    from lightning_seqmem.dryrun.sharded import sharded_dry_run_step, unsharded_template

    shape = dict(vocab_size=8192, n_layer=2, d_model=128, n_head=4) if quick else \
        dict(vocab_size=32768, n_layer=4, d_model=256, n_head=4)
    template = unsharded_template(LitGPT(attention="sdpa", **shape))
    params = sum(p.numel() for p in template.parameters())
    batch = next(iter(SyntheticTokenDataModule(batch_size=1, seq_len=64, num_samples=2,
                                                vocab_size=shape["vocab_size"]).train_dataloader()))
    length = 1024 if quick else 4096
    sizes = (1, 2, 8, 64) if quick else (1, 2, 4, 8, 16, 64)
    lengths = (512, 2048) if quick else (1024, 4096, 16384)
    by_n, by_length = [], []
    for n in sizes:
        row = {"world_size": n, "seq_len": length}
        for strategy, names in (("fsdp2", ()), ("fsdp2", ("checkpointing",)), ("ddp", ())):
            r = sharded_dry_run_step(template, batch, length, n, 1, names, strategy)
            key = strategy + ("+ckpt" if names else "")
            row[key], row[key + "_seconds"] = r.peak_bytes, r.seconds
        by_n.append(row)
    n = 8
    for L in lengths:
        row = {"world_size": n, "seq_len": L}
        for names in ((), ("checkpointing",)):
            r = sharded_dry_run_step(template, batch, L, n, 1, names, "fsdp2")
            key = "fsdp2" + ("+ckpt" if names else "")
            row[key], row[key + "_seconds"] = r.peak_bytes, r.seconds
        by_length.append(row)
    if show:
        print(f"fsdp_plan: LitGPT {shape}, SDPA, AdamW, {params:,} parameters, batch 1 per rank; "
              "per-rank peak (MiB)")
        print(f"\nvs world size N at {length} tokens")
        print(f"{'N':>4} {'fsdp2':>9} {'fsdp2+ckpt':>11} {'ddp':>9} {'plan s':>7}")
        for row in by_n:
            print(f"{row['world_size']:>4} {_mib(row['fsdp2']):>9} {_mib(row['fsdp2+ckpt']):>11} "
                  f"{_mib(row['ddp']):>9} "
                  f"{row['fsdp2_seconds']:>7.2f}")
        print(f"\nvs length at N={n}")
        print(f"{'seq_len':>7} {'fsdp2':>9} {'fsdp2+ckpt':>11} {'plan s':>7}")
        for row in by_length:
            print(f"{row['seq_len']:>7} {_mib(row['fsdp2']):>9} {_mib(row['fsdp2+ckpt']):>11} "
                  f"{row['fsdp2_seconds']:>7.2f}")
    return {"model": shape, "parameters": params, "by_world_size": by_n, "by_length": by_length}


def measure_worker(out: str) -> None:
    """Run by the 4-process launch: train 3 steps, rank 0 writes the records."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    from fsdp2_cpu import ShardedLitGPT
    from lightning_seqmem import SeqMemCallback
    from lightning_seqmem.reference.demo import SyntheticTokenDataModule

    warnings.simplefilter("ignore")
    pl.seed_everything(0, verbose=False)
    m = MEASURE
    cb = SeqMemCallback(warmup_steps=1, mitigations=(), dry_run=False)
    trainer = pl.Trainer(accelerator="cpu", devices=m["world_size"], max_steps=3, callbacks=[cb],
                         strategy=ModelParallelStrategy(
                             data_parallel_size=m["world_size"], tensor_parallel_size=1),
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=out)
    started = time.perf_counter()
    trainer.fit(ShardedLitGPT(n_layer=m["n_layer"], d_model=m["d_model"], n_head=m["n_head"]),
                SyntheticTokenDataModule(batch_size=m["batch_size"], seq_len=m["seq_len"],
                                         num_samples=64))
    if trainer.is_global_zero:
        with open(os.path.join(out, "measured.json"), "w") as f:
            json.dump({"records": [r.to_dict() for r in cb.records],
                       "seconds": time.perf_counter() - started}, f)


def accuracy(show: bool) -> dict:
    from fsdp2_cpu import ShardedLitGPT
    from lightning_seqmem.reference.demo import SyntheticTokenDataModule
    from lightning_seqmem.dryrun.sharded import sharded_dry_run_step, unsharded_template

    m = MEASURE
    with tempfile.TemporaryDirectory(prefix="seqmem-fsdp-") as out:
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--measure-worker", out],
                              capture_output=True, text=True, timeout=900, cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(f"the 4-process run failed:\n{proc.stderr[-3000:]}")
        measured = json.loads(Path(out, "measured.json").read_text())
        wall = time.perf_counter() - started
    steady = [r for r in measured["records"] if not r["warmup"]]
    peak = max(r["peak_bytes"] for r in steady)
    template = unsharded_template(ShardedLitGPT(n_layer=m["n_layer"], d_model=m["d_model"],
                                                n_head=m["n_head"]))
    batch = next(iter(SyntheticTokenDataModule(batch_size=m["batch_size"],
                                               seq_len=m["seq_len"]).train_dataloader()))
    plan = sharded_dry_run_step(template, batch, m["seq_len"], m["world_size"])
    error = (plan.peak_bytes - peak) / peak
    result = {**m, "measured_bytes": peak, "measured_rank": steady[-1]["rank"],
              "plan_bytes": plan.peak_bytes,
              "error": error, "plan_seconds": plan.seconds, "run_seconds": wall}
    if show:
        print(f"\naccuracy: {m['world_size']}-process gloo FSDP2 run (ShardedLitGPT "
              f"n_layer={m['n_layer']}, "
              f"d_model={m['d_model']}), {m['seq_len']} tokens, batch {m['batch_size']} per rank")
        print(f"measured per-rank peak {_mib(peak)} MiB "
              f"(rank {result['measured_rank']}, the highest), "
              f"plan at N={m['world_size']} {_mib(plan.peak_bytes)} MiB: error {error:+.2%}; "
              f"plan {plan.seconds:.2f}s, run {wall:.0f}s")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer points")
    parser.add_argument("--no-measure", action="store_true", help="skip the 4-process measurement")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON dict")
    parser.add_argument("--measure-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_worker:
        measure_worker(args.measure_worker)
        return 0
    warnings.simplefilter("ignore")
    out = {"plan": plan_figures(args.quick, not args.json)}
    if not args.no_measure:
        out["accuracy"] = accuracy(not args.json)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
