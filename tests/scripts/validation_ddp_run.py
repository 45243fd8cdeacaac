"""Run by tests/test_validation_ddp.py: 2 CPU processes (gloo) whose validation batches differ in
length, the callback under a budget that 4 x 1024 tokens meet with SDPA only; each rank measures
its own validation batches (the live-tensor tracker) and writes JSON.

    python tests/scripts/validation_ddp_run.py OUT_DIR MODE[,MODE...]

A fit per ``MODE``, each writing ``OUT_DIR/rank{0,1}_{MODE}.json``: ``together`` (Lightning's
distributed sampler: rank 0 draws a batch of 64 tokens, rank 1 one of 1024), ``fsdp2`` (the same,
the module sharded by FSDP2 under ``ModelParallelStrategy``), ``broken`` (as ``together``, the
callback's measurement of rank 1's validation batches raising) or ``apart``
(``use_distributed_sampler=False``: rank 0's loader a batch of 512 tokens, rank 1's two of 64).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
from fsdp2_cpu import ShardedLitGPT  # noqa: E402

from lightning_seqmem import Curriculum, PredictedOOMWarning, SeqMemCallback
from lightning_seqmem.measure.probes import TrackerProbe, existing_tensors
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.trainer.own_memory import bucket_bytes

BUDGET = 17_000_000  # bytes: 4 x 1024 tokens peak 139 MiB eager, 14 MiB with SDPA


class ValidatedGPT(LitGPT):
    def validation_step(self, batch, batch_idx):
        return self.training_step(batch, batch_idx)


class ShardedValidatedGPT(ShardedLitGPT):
    validation_step = ValidatedGPT.validation_step


class ValidationPeaks(pl.Callback):
    """This rank's measured peak of every validation batch, with the rungs on as it ran."""

    def __init__(self, cb: SeqMemCallback) -> None:
        self.cb, self.runs = cb, []

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.probe = TrackerProbe()
        self.probe.start_step(existing_tensors(pl_module, trainer.optimizers, batch))
        self.probe.mark_phase("forward")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx,
                                dataloader_idx=0):
        self.runs.append([batch["input_ids"].shape[1], self.probe.end_step().peak_bytes,
                          list(self.cb.applied_mitigations)])


class BreakRankOne(pl.Callback):
    """The callback's measurement of rank 1's validation batches raises (placed after it)."""

    def __init__(self, cb: SeqMemCallback) -> None:
        self.cb = cb

    def on_validation_batch_start(self, trainer, *args, **kwargs):
        def broken():
            raise RuntimeError("injected: rank 1's validation measurement")

        if trainer.global_rank == 1:
            self.cb.edge.probe.end_step = broken

    def on_validation_batch_end(self, trainer, *args, **kwargs):
        self.cb.edge.probe.__dict__.pop("end_step", None)


def _batch(seq_len: int) -> dict:
    tokens = torch.randint(0, 64, (4, seq_len + 1), generator=torch.Generator().manual_seed(0))
    return {"input_ids": tokens[:, :-1].clone(), "labels": tokens[:, 1:].clone()}


def main() -> None:
    for mode in sys.argv[2].split(","):  # one launch, a fit per mode
        fit(sys.argv[1], mode, int(os.environ.get("LOCAL_RANK", 0)))


def fit(out: str, mode: str, rank: int) -> None:
    together = mode != "apart"
    batches = [_batch(64), _batch(1024)] if together else ([_batch(512)], [_batch(64)] * 2)[rank]
    cb = SeqMemCallback(memory_budget=BUDGET, safety_margin=0.0, warmup_steps=1,
                        curriculum=Curriculum(start=64, target=1024, steps_per_stage=2,
                                              multiple_of=16))
    peaks = ValidationPeaks(cb)
    data = SyntheticTokenDataModule(batch_size=4, seq_len=1024, num_samples=16, vocab_size=64)
    data.val_dataloader = lambda: torch.utils.data.DataLoader(batches, batch_size=None)
    strategy = (ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
                if mode == "fsdp2" else "ddp")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2,
                         val_check_interval=2, num_sanity_val_steps=1,
                         use_distributed_sampler=together,
                         callbacks=[cb, peaks, *([BreakRankOne(cb)] if mode == "broken" else [])],
                         default_root_dir=out, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = (ShardedValidatedGPT if mode == "fsdp2" else ValidatedGPT)(
            n_layer=4, d_model=64, n_head=4, vocab_size=64, attention="eager")
        trainer.fit(module, data)
    result = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "usable": cb.usable_budget_bytes,
        "runs": peaks.runs,
        "applied_mitigations": list(cb.applied_mitigations),
        "events": [[e["step"], e["name"], e["seq_len"]] for e in cb.mitigation_events],
        "training_peaks": [r.peak_bytes for r in cb.records],
        "validation_rows": cb.edge.validation,
        "judged": [[*key[:2], list(key[2]), list(key[3]), peak]
                   for key, peak in cb._validation.judged.items()],
        "buckets": bucket_bytes(trainer),  # DDP's bucket copies of the gradients: no tensor shows
        "warned": list(cb.planner.advice.warned),
        "said": [str(w.message) for w in caught if issubclass(w.category, PredictedOOMWarning)
                 or "validation" in str(w.message)],
    }
    with open(os.path.join(out, f"rank{trainer.global_rank}_{mode}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
