"""Run by tests/test_fsdp2.py: 2 CPU processes (gloo) train ``ShardedLitGPT`` (FSDP2 through
``ModelParallelStrategy``) with SeqMemCallback, several fits in one launch; each rank writes JSON.

    python tests/scripts/fsdp2_run.py OUT_DIR

Fits, in order (same seed, same data):

1. ``reference``: curriculum 64 -> 256 tokens, no rungs, no budget: records on both ranks, the
   measured per-rank peaks, the gradients and parameters of an unmitigated run; before the first
   128-token batch (64 tokens traced so far) rank 0 forecasts 256 tokens at this world size and at 4
   ranks (a fake process group).
2. ``budget``: the same with a budget that 256 tokens exceed without checkpointing and
   micro-batching: both switched on mid-run; after 2 steps a sharded checkpoint is saved.
3. ``resumed``: the budget run resumed from that checkpoint to the end.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

from fsdp2_cpu import ShardedLitGPT  # noqa: E402
from lightning_seqmem import Curriculum, SeqMemCallback  # noqa: E402
from lightning_seqmem.reference.demo import SyntheticTokenDataModule  # noqa: E402

# bytes per rank: 128 tokens fit plain, 256 need checkpointing and micro-batching
BUDGET = 5_000_000
STEPS = 6  # 3 stages x 2 steps; one batch per epoch
STOP = 2  # the checkpoint: as epoch 2 starts, after the first stage, before any rung


class Grads(pl.Callback):
    """Full (gathered) gradients and parameters at every optimizer step; every rank gathers."""

    def __init__(self):
        self.grads, self.params = [], None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.full_tensor().clone() for n, p in pl_module.named_parameters()
                           if p.grad is not None})

    def on_train_end(self, trainer, pl_module):
        self.params = {n: p.detach().full_tensor().clone() for n, p in pl_module.named_parameters()}


class SaveAtStop(pl.Callback):
    """A sharded checkpoint as the epoch after step ``STOP`` starts (each rank writes its own)."""

    def __init__(self, path):
        self.path = path

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.global_step == STOP:
            trainer.save_checkpoint(self.path)


class Forecasts(pl.Callback):
    """On rank 0, before the first 128-token batch (64 tokens traced): forecasts at 256 tokens."""

    def __init__(self, cb, result):
        self.cb, self.result = cb, result

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != 2 or not trainer.is_global_zero:
            return
        self.result["traced_before_forecast"] = sorted({r.seq_len for r in self.cb.records
                                                        if r.traced})
        for name, kwargs in (("here", {}), ("world2", {"world_size": 2}),
                             ("world4", {"world_size": 4})):
            t0 = time.perf_counter()
            fc = self.cb.forecast(256, **kwargs)
            self.result[f"forecast256_{name}"] = {"peak": fc.peak_bytes, "upper": fc.upper_bytes,
                                                  "method": fc.method,
                                                  "seconds": time.perf_counter() - t0,
                                                  "detail": fc.detail}


def fit(out, cb, max_steps, *more, ckpt_path=None, save=None):
    pl.seed_everything(0, verbose=False)
    grads = Grads()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        default_root_dir=out, logger=False, enable_checkpointing=False,
        # the forecasts (``more``) come before the callback: they ask before its probe starts
        max_steps=max_steps, callbacks=[*more, cb, grads], use_distributed_sampler=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    model = ShardedLitGPT(n_layer=2, d_model=64, n_head=2)
    # one fixed batch per rank and epoch (no DistributedSampler): Lightning 2.6 resumes an epoch at
    # the batch index the previous one ended with, so with several batches per epoch the resumed run
    # would see other batches than the uninterrupted one (a Lightning matter, not a memory one)
    data = SyntheticTokenDataModule(batch_size=2, seq_len=256, num_samples=2,
                                    seed=1000 * int(os.environ.get("LOCAL_RANK", 0)))
    start = time.perf_counter()
    trainer.fit(model, data, ckpt_path=ckpt_path)
    seconds = time.perf_counter() - start
    if save is not None:
        trainer.save_checkpoint(save)
    return trainer, grads, seconds


def callback(start, budget=None, mitigations=()):
    return SeqMemCallback(warmup_steps=1, memory_budget=budget, safety_margin=0.0,
                          mitigations=mitigations, curriculum=Curriculum(
                              start=start, target=start * 4, steps_per_stage=2, multiple_of=16))


def checkpoint_keys(path):
    """The model entries of a distributed (sharded) checkpoint directory."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(path).read_metadata().state_dict_metadata
    return sorted(k for k in keys if k.startswith("state_dict."))


def rel_diff(a, b):
    """Largest relative L2 difference over tensors of two name -> tensor dicts."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)) for k in a)


def main() -> None:
    out = sys.argv[1]
    warnings.simplefilter("ignore")
    result = {}
    reference = callback(64)
    forecasts = Forecasts(reference, result)
    trainer, ref_grads, result["reference_seconds"] = fit(out, reference, STEPS, forecasts)
    rank = trainer.global_rank
    result["reference_records"] = [r.to_dict() for r in reference.records]

    budget = callback(64, BUDGET, ("checkpointing", "microbatch"))
    ckpt = os.path.join(out, "sharded.ckpt")
    _, bud_grads, result["budget_seconds"] = fit(out, budget, STEPS, SaveAtStop(ckpt),
                                                 save=os.path.join(out, "end.ckpt"))
    result["budget_records"] = [r.to_dict() for r in budget.records]
    result["budget_applied"] = list(budget.applied_mitigations)
    result["budget_events"] = [str(e) for e in budget.mitigation_events]
    result["usable_budget"] = budget.usable_budget_bytes
    result["grad_rel_diff"] = [rel_diff(b, r) for b, r in zip(bud_grads.grads, ref_grads.grads)]
    result["param_rel_diff"] = rel_diff(bud_grads.params, ref_grads.params)

    result["checkpoint_is_dir"] = os.path.isdir(ckpt)
    resumed = callback(64, BUDGET, ("checkpointing", "microbatch"))
    trainer, res_grads, result["resumed_seconds"] = fit(out, resumed, STEPS, ckpt_path=ckpt)
    result["resumed_records"] = [r.to_dict() for r in resumed.records]
    result["resumed_applied"] = list(resumed.applied_mitigations)
    result["resumed_param_rel_diff"] = rel_diff(res_grads.params, bud_grads.params)
    result["resumed_grad_rel_diff"] = [
        rel_diff(a, b) for a, b in zip(res_grads.grads, bud_grads.grads[-len(res_grads.grads):])]
    result["resumed_param_max_abs_diff"] = max(
        float((res_grads.params[k] - bud_grads.params[k]).abs().max()) for k in res_grads.params)
    result["parameter_names"] = [sorted(g.params) for g in (ref_grads, bud_grads, res_grads)]
    result["checkpoint_keys"] = [checkpoint_keys(os.path.join(out, name))
                                 for name in ("sharded.ckpt", "end.ckpt")]
    result["global_step"] = trainer.global_step
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
