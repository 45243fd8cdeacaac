"""Run by tests/test_ddp.py: 2 CPU processes (gloo) train with SeqMemCallback; each writes JSON.

    python tests/scripts/ddp_run.py OUT_DIR [NAME] [--fail-rank0-at STEP] [--budget BYTES]
        [--batch-sizes 4,1]
        [--seq-lens 64,128] [--no-curriculum] [--unreadable-rank1-at STEP] [--mitigations a,b]
        [--vocab-size 256] [--curriculum 16,256] [--d-ff N] [++ NAME ARGS ...]

Each fit writes ``OUT_DIR/rank{0,1}.json``, or ``rank{0,1}_NAME.json`` where named; ``++`` starts
another fit in the same launch (the process group made once: a launch costs ~10 s of imports).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch

import lightning.pytorch as pl
from lightning_seqmem import Curriculum, SeqMemCallback
from lightning_seqmem.measure.batch_shape import infer_batch_shape
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.mitigations.tiled_mlp.tiled_mlp import tiled_mlp_tiles


def main() -> None:
    out, fits = sys.argv[1], [[]]
    for arg in sys.argv[2:]:
        if arg == "++":
            fits.append([])
        else:
            fits[-1].append(arg)
    for argv in fits:
        name = argv.pop(0) if argv and not argv[0].startswith("--") else ""
        fit(out, name, argv)


def fit(out: str, name: str, argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank0-at", type=int, default=None)
    parser.add_argument("--budget", type=int, default=None)
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--mitigations", default="", help="comma-separated ladder, default none")
    parser.add_argument("--strategy", default="ddp", help="ddp or fsdp")
    parser.add_argument("--batch-sizes", default="2,2", help="per-rank batch size")
    parser.add_argument("--seq-lens", default="256,256", help="per-rank data length")
    parser.add_argument("--no-curriculum", action="store_true")
    parser.add_argument("--unreadable-rank1-at", type=int, default=None,
                        help="rank 1 cannot read this batch")
    parser.add_argument("--vocab-size", type=int, default=256, help="of the model and the data")
    parser.add_argument("--curriculum", default="16,256", help="start,target of the curriculum")
    parser.add_argument("--d-ff", type=int, default=None,
                        help="the GPT's MLP width (default 4 * d_model)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    calls = {"batch": 0, "fault": 0}

    # runs before SeqMemCallback: the index of the batch about to run
    class BatchIndex(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            calls["batch"] = batch_idx

    def seq_len_fn(batch):
        if (rank == 1 and args.unreadable_rank1_at is not None
                and calls["batch"] >= args.unreadable_rank1_at):
            raise ValueError("injected: rank 1 cannot read this batch")
        return infer_batch_shape(batch)

    cb = SeqMemCallback(
        warmup_steps=1,
        memory_budget=args.budget,
        safety_margin=0.0,
        curriculum=None if args.no_curriculum else Curriculum(
            *map(int, args.curriculum.split(",")), steps_per_stage=2, multiple_of=16),
        mitigations=tuple(args.mitigations.split(",")) if args.mitigations else (),
        seq_len_fn=seq_len_fn,
    )
    decisions: list = []
    commit = cb.planner.commit
    cb.planner.commit = lambda d: (decisions.append([d.action, d.seq_len, d.rung, list(d.stages)]),
                                   commit(d))[1]
    if args.fail_rank0_at is not None and rank == 0:
        original = cb.planner.observe

        def broken(*a, **k):
            calls["fault"] += 1
            if calls["fault"] == args.fail_rank0_at:
                raise RuntimeError("injected rank-0-only fault")
            return original(*a, **k)

        cb.planner.observe = broken
    batch_size = int(args.batch_sizes.split(",")[rank])
    seq_len = int(args.seq_lens.split(",")[rank])
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=args.strategy, max_steps=args.max_steps,
        callbacks=[BatchIndex(), cb], default_root_dir=out, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    start = time.perf_counter()
    module = LitGPT(n_layer=1, d_model=32, n_head=2, vocab_size=args.vocab_size, d_ff=args.d_ff)
    trainer.fit(module, SyntheticTokenDataModule(batch_size=batch_size, seq_len=seq_len,
                                                 num_samples=256, vocab_size=args.vocab_size))
    result = {
        "rank": trainer.global_rank,
        "seconds": time.perf_counter() - start,
        "records": [r.to_dict() for r in cb.records],
        "decisions": decisions,
        "stages": list(cb.planner.course.stages),
        "capped_at": cb.planner.course.capped_at,
        "disabled": cb.edge.failed,
        "global_step": trainer.global_step,
        "mitigations": list(cb.mitigations),
        "applied_mitigations": list(cb.applied_mitigations),
        "mitigation_events": [{k: e[k] for k in ("name", "step", "seq_len")}
                              for e in cb.mitigation_events],
        "parameters_sum": float(sum(p.detach().double().sum() for p in module.parameters())),
        "tiled_mlp_tiles": tiled_mlp_tiles(module),
        # equal on every rank under DDP
        "parameters": [p.detach().double().sum().item() for p in module.parameters()],
    }
    with open(os.path.join(out, f"rank{trainer.global_rank}{name and '_' + name}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
