"""Run by tests/test_fsdp2.py: 2 CPU processes (gloo) train ``ShardedLitGPT`` (FSDP2 through
``ModelParallelStrategy``) with SeqMemCallback, several fits in one launch; each rank writes JSON.

    python tests/scripts/fsdp2_run.py OUT_DIR

Fits, in order (same seed, same data):

1. ``short``: curriculum 16 -> 64 tokens, no budget: records on both ranks; forecasts at 256 tokens
   (this world size, and 4 ranks by a fake process group).
2. ``reference``: curriculum 64 -> 256, no rungs, no budget: the measured per-rank peaks and the
   gradients and parameters of an unmitigated run.
3. ``budget``: the same with a budget that 128 tokens exceed without checkpointing and 256 without
   micro-batching too: both are switched on mid-run.
4. ``first`` + ``resumed``: the budget run stopped after 4 steps (an epoch), saved as a sharded
   (distributed) checkpoint, and resumed to the end.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

from fsdp2_cpu import ShardedLitGPT  # noqa: E402
from lightning_seqmem import Curriculum, SeqMemCallback  # noqa: E402
from lightning_seqmem.demo import SyntheticTokenDataModule  # noqa: E402

BUDGET = 5_000_000  # bytes per rank: 64 tokens fit plain, 128 need checkpointing, 256 micro-batching too
STEPS = 6  # 3 stages x 2 steps; 32 samples / (2 ranks x 4) = 4 steps per epoch


class Grads(pl.Callback):
    """Full (gathered) gradients and parameters at every optimizer step; every rank calls the collectives."""

    def __init__(self):
        self.grads, self.params = [], None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.full_tensor().clone() for n, p in pl_module.named_parameters() if p.grad is not None})

    def on_train_end(self, trainer, pl_module):
        self.params = {n: p.detach().full_tensor().clone() for n, p in pl_module.named_parameters()}


def fit(out, cb, max_steps, curriculum_start, ckpt_path=None, save=None):
    pl.seed_everything(0, verbose=False)
    grads = Grads()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=max_steps, callbacks=[cb, grads], default_root_dir=out, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    model = ShardedLitGPT(n_layer=2, d_model=64, n_head=2)
    data = SyntheticTokenDataModule(batch_size=4, seq_len=256, num_samples=32)
    start = time.perf_counter()
    trainer.fit(model, data, ckpt_path=ckpt_path)
    seconds = time.perf_counter() - start
    if save is not None:
        trainer.save_checkpoint(save)
    return trainer, grads, seconds


def callback(start, budget=None, mitigations=()):
    return SeqMemCallback(warmup_steps=1, memory_budget=budget, safety_margin=0.0, mitigations=mitigations,
                          curriculum=Curriculum(start=start, target=start * 4, steps_per_stage=2, multiple_of=16))


def rel_diff(a, b):
    """Largest relative L2 difference over tensors of two name -> tensor dicts."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)) for k in a)


def main() -> None:
    out = sys.argv[1]
    warnings.simplefilter("ignore")
    result = {}
    short = callback(16)
    trainer, _, result["short_seconds"] = fit(out, short, STEPS, 16)
    rank = trainer.global_rank
    result["short_records"] = [r.to_dict() for r in short.records]
    result["short_traced"] = sorted({r.seq_len for r in short.records if r.traced})
    if rank == 0:
        for name, kwargs in (("here", {}), ("world2", {"world_size": 2}), ("world4", {"world_size": 4})):
            t0 = time.perf_counter()
            fc = short.forecast(256, **kwargs)
            result[f"forecast256_{name}"] = {"peak": fc.peak_bytes, "upper": fc.upper_bytes, "method": fc.method,
                                            "seconds": time.perf_counter() - t0, "detail": fc.detail}

    reference = callback(64)
    _, ref_grads, _ = fit(out, reference, STEPS, 64)
    result["reference_records"] = [r.to_dict() for r in reference.records]

    budget = callback(64, BUDGET, ("checkpointing", "microbatch"))
    _, bud_grads, _ = fit(out, budget, STEPS, 64)
    result["budget_records"] = [r.to_dict() for r in budget.records]
    result["budget_applied"] = list(budget.applied_mitigations)
    result["budget_events"] = [str(e) for e in budget.mitigation_events]
    result["usable_budget"] = budget.usable_budget_bytes
    result["grad_rel_diff"] = [rel_diff(b, r) for b, r in zip(bud_grads.grads, ref_grads.grads)]
    result["param_rel_diff"] = rel_diff(bud_grads.params, ref_grads.params)

    ckpt = os.path.join(out, "sharded.ckpt")
    first = callback(64, BUDGET, ("checkpointing", "microbatch"))
    trainer, _, _ = fit(out, first, 4, 64, save=ckpt)
    result["checkpoint_is_dir"] = os.path.isdir(ckpt)
    resumed = callback(64, BUDGET, ("checkpointing", "microbatch"))
    trainer, res_grads, _ = fit(out, resumed, STEPS, 64, ckpt_path=ckpt)
    result["resumed_records"] = [r.to_dict() for r in resumed.records]
    result["resumed_applied"] = list(resumed.applied_mitigations)
    result["resumed_param_rel_diff"] = rel_diff(res_grads.params, bud_grads.params)
    result["resumed_grad_rel_diff"] = [rel_diff(a, b) for a, b in zip(res_grads.grads, bud_grads.grads[-len(res_grads.grads):])]
    result["resumed_keys"] = sorted(res_grads.params)
    result["reference_keys"] = sorted(ref_grads.params)
    result["global_step"] = trainer.global_step
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
