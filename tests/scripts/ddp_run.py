"""Run by tests/test_ddp.py: 2 CPU processes (gloo) train with SeqMemCallback; each rank writes JSON.

    python tests/scripts/ddp_run.py OUT_DIR [--fail-rank0-at STEP] [--budget BYTES]
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import torch

import lightning.pytorch as pl
from lightning_seqmem import Curriculum, SeqMemCallback
from lightning_seqmem.demo import LitGPT, SyntheticTokenDataModule


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--fail-rank0-at", type=int, default=None)
    parser.add_argument("--budget", type=int, default=None)
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--mitigations", default="", help="comma-separated ladder, default none")
    parser.add_argument("--strategy", default="ddp", help="ddp or fsdp")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    cb = SeqMemCallback(
        warmup_steps=1,
        memory_budget=args.budget,
        safety_margin=0.0,
        curriculum=Curriculum(start=16, target=256, steps_per_stage=2, multiple_of=16),
        mitigations=tuple(args.mitigations.split(",")) if args.mitigations else (),
    )
    rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.fail_rank0_at is not None and rank == 0:
        original = cb.forecaster.add_measurement
        calls = {"n": 0}

        def broken(*a, **k):
            calls["n"] += 1
            if calls["n"] == args.fail_rank0_at:
                raise RuntimeError("injected rank-0-only fault")
            return original(*a, **k)

        cb.forecaster.add_measurement = broken
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=args.strategy, max_steps=args.max_steps, callbacks=[cb], default_root_dir=args.out,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(LitGPT(n_layer=1, d_model=32, n_head=2), SyntheticTokenDataModule(batch_size=2, seq_len=256, num_samples=128))
    out = {
        "rank": trainer.global_rank,
        "records": [r.to_dict() for r in cb.records],
        "stages": list(cb._stages),
        "capped_at": cb._capped_at,
        "disabled": cb._disabled,
        "global_step": trainer.global_step,
        "mitigations": list(cb.mitigations),
        "applied_mitigations": list(cb.applied_mitigations),
    }
    with open(os.path.join(args.out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
