"""Run by tests/test_offload_dry_run.py: 2 CPU processes (gloo) train a GPT sharded with FSDP2 and
``CPUOffloadPolicy`` (``ModelParallelStrategy``), measured by SeqMemCallback's live-tensor tracker;
before the fit, rank 0 dry-runs the same setting on ``device="cpu"`` from the unsharded template.
Each rank writes JSON.

    python tests/scripts/offload_run.py OUT_DIR

On the CPU the device and the host are one memory: the tracker counts every storage, offloaded or
not, so the test compares totals (the dry run's ``peak_bytes``, its ``host_peak_bytes`` being 0).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

from fsdp2_cpu import ShardedLitGPT  # noqa: E402
from lightning_seqmem import SeqMemCallback  # noqa: E402
from lightning_seqmem.reference.demo import SyntheticTokenDataModule  # noqa: E402

SEQ_LEN, ROWS, STEPS = 128, 2, 4
MODEL = dict(n_layer=2, d_model=64, n_head=2, vocab_size=512, attention="sdpa")


class OffloadedLitGPT(ShardedLitGPT):
    """``ShardedLitGPT`` whose ``fully_shard`` calls offload to the CPU (pageable: no device to pin
    for)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

        mesh = self.device_mesh
        if mesh is None or isinstance(self.model, FSDPModule):
            return
        dp_mesh = mesh["data_parallel"]
        policy = CPUOffloadPolicy(pin_memory=False)
        for block in self.model.blocks:
            fully_shard(block, mesh=dp_mesh, offload_policy=policy)
        fully_shard(self.model, mesh=dp_mesh, offload_policy=policy)


class DryRuns(pl.Callback):
    """On rank 0 at set-up (before configure_model shards): the dry runs of this setting on the
    CPU."""

    def __init__(self, result: dict) -> None:
        self.result = result

    def setup(self, trainer, pl_module, stage):
        if not trainer.is_global_zero:
            return
        from lightning_seqmem.dryrun.sharded import sharded_dry_run_step, unsharded_template

        template = unsharded_template(pl_module)
        data = SyntheticTokenDataModule(batch_size=ROWS, seq_len=SEQ_LEN, num_samples=2,
                                        vocab_size=MODEL["vocab_size"])
        batch = next(iter(data.train_dataloader()))
        # one block's parameters: the size of FSDP2's flat all-gather output for that block
        self.result["block_bytes"] = sum(p.numel() * p.element_size()
                                         for p in pl_module.model.blocks[0].parameters())
        for name, offload in (("dry_offload", True), ("dry_plain", False)):
            dry = sharded_dry_run_step(template, batch, SEQ_LEN, 2, device="cpu", offload=offload)
            self.result[name] = {"peak": dry.peak_bytes, "phases": dry.phase_peak_bytes,
                                 "host": dry.host_peak_bytes, "detail": dry.detail}


def main() -> None:
    out = sys.argv[1]
    warnings.simplefilter("ignore")
    result: dict = {}
    pl.seed_everything(0, verbose=False)
    cb = SeqMemCallback(warmup_steps=1, probe="tracker", mitigations=(), dry_run=False,
                        summary=False)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS,
        callbacks=[DryRuns(result), cb], use_distributed_sampler=False, default_root_dir=out,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )
    data = SyntheticTokenDataModule(batch_size=ROWS, seq_len=SEQ_LEN, num_samples=STEPS * ROWS,
                                    vocab_size=MODEL["vocab_size"],
                                    seed=1000 * int(os.environ.get("LOCAL_RANK", 0)))
    trainer.fit(OffloadedLitGPT(**MODEL), data)
    result["records"] = [
        {"step": r.step, "seq_len": r.seq_len, "peak": r.peak_bytes, "rank": r.rank,
         "warmup": r.warmup,
         "phases": {"forward": r.forward_peak_bytes, "backward": r.backward_peak_bytes,
                    "optimizer": r.optimizer_peak_bytes}}
        for r in cb.records]
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
