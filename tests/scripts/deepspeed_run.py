"""Run by tests/test_deepspeed.py: Lightning's ``DeepSpeedStrategy`` on the CPU
(tests/deepspeed_cpu.py, gloo, one process), writing JSON: ``{MODE: its result}``.

    python tests/scripts/deepspeed_run.py OUT.json [callback STAGE BUDGET_BYTES] \
        [equality STAGE [STAGE ...]]

Both modes run in one process (torch, Lightning and DeepSpeed start once), ``callback`` first: its
measurements see no earlier fit's tensors.

``equality``: per ZeRO stage, two steps of a small GPT on batches of 4, whole and micro-batched
(2 + 2, switched on before the first step) from the same initial weights, and the relative L2 norm
of the difference of their parameter updates; ``MicroBatching.is_applicable`` at each stage, and the
same with activation checkpointing switched on (its updates against the plain run's); where
micro-batching is refused, the split step run all the same (``forced_micro_relative``, in place of
``micro_relative``).
``callback``: ``SeqMemCallback`` (a curriculum 64 -> 256 tokens, the ladder
checkpointing -> microbatch) under the strategy; each step window's peak counted by the profiler
(tests/step_window.py).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch

import lightning.pytorch as pl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from deepspeed_cpu import cpu_deepspeed_strategy  # noqa: E402
from step_window import StepWindows  # noqa: E402

from lightning_seqmem import Curriculum, SeqMemCallback  # noqa: E402
from lightning_seqmem.mitigations.checkpointing.checkpointing import CheckpointingRung  # noqa: E402
from lightning_seqmem.mitigations.base import RungContext  # noqa: E402
from lightning_seqmem.mitigations.microbatch.microbatch import MicroBatching  # noqa: E402
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule  # noqa: E402

# else 2e8 elements each
SMALL_BUCKETS = {"reduce_bucket_size": 2**16, "allgather_bucket_size": 2**16}


class _Switch(pl.Callback):
    """Micro-batching or checkpointing on before the first step (``on_train_start``)."""

    def __init__(self, what: str) -> None:
        self.what, self.applicable = what, None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.what == "micro":
            self.applicable = MicroBatching(micro_batch_size=2).is_applicable(trainer, pl_module)
            if self.applicable[0]:
                MicroBatching(micro_batch_size=2).apply(trainer, pl_module)
            else:  # refused: run it all the same, as the rung would run with its check left out
                import lightning_seqmem.mitigations.microbatch.microbatch as microbatch

                stage_of, microbatch._deepspeed_stage = (microbatch._deepspeed_stage,
                                                         lambda strategy: None)
                try:  # the stage unknown: nothing refuses it
                    assert MicroBatching(micro_batch_size=2).is_applicable(trainer, pl_module)[0]
                    MicroBatching(micro_batch_size=2).apply(trainer, pl_module)
                finally:
                    microbatch._deepspeed_stage = stage_of
        elif self.what == "checkpointing":
            result = CheckpointingRung().apply(RungContext(pl_module, trainer))
            self.applicable = (result.applied, result.detail)


def _update(stage: int, what: str) -> tuple[dict[str, torch.Tensor], object]:
    pl.seed_everything(0)
    module = LitGPT(n_layer=2, d_model=32, n_head=2)
    start = {k: v.detach().float().clone() for k, v in module.state_dict().items()}
    switch = _Switch(what)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[switch],
                         strategy=cpu_deepspeed_strategy(stage=stage, **SMALL_BUCKETS))
    trainer.fit(module, SyntheticTokenDataModule(seq_len=32, batch_size=4, num_samples=16))
    return {k: v.detach().float() - start[k]
            for k, v in module.state_dict().items()}, switch.applicable


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float(((a[k] - b[k]) ** 2).sum()) for k in a) ** 0.5
    return num / sum(float((a[k] ** 2).sum()) for k in a) ** 0.5


def equality(stages: list[int]) -> dict[str, object]:
    out: dict[str, object] = {}
    for stage in stages:
        plain, _ = _update(stage, "none")
        micro, applicable = _update(stage, "micro")  # refused: the split step run all the same
        ckpt, applied = _update(stage, "checkpointing")
        out[str(stage)] = {"micro_applicable": applicable,
                           ("micro_relative" if applicable[0] else "forced_micro_relative"):
                           _relative(plain, micro),
                           "checkpointing_applied": applied,
                           "checkpointing_relative": _relative(plain, ckpt),
                           "update_norm": sum(float((v ** 2).sum()) for v in plain.values()) ** 0.5}
    return out


def callback(stage: int, budget: int) -> dict[str, object]:
    torch.manual_seed(0)
    cb = SeqMemCallback(warmup_steps=1, memory_budget=budget, safety_margin=0.0,
                        mitigations=("checkpointing", "microbatch"),
                        curriculum=Curriculum(64, 256, steps_per_stage=2, multiple_of=32))
    windows = StepWindows()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=10, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=windows.around(cb),
                         strategy=cpu_deepspeed_strategy(stage=stage, **SMALL_BUCKETS))
    module = LitGPT(n_layer=2, d_model=64, n_head=2, vocab_size=4096)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, SyntheticTokenDataModule(batch_size=4, seq_len=256, num_samples=64,
                                                     vocab_size=4096))
    return {"global_step": trainer.global_step, "applied_mitigations": list(cb.applied_mitigations),
            "records": [[r.step, r.seq_len, r.batch_size, r.peak_bytes] for r in cb.records],
            "max_seq_len": cb.max_seq_len(), "engine": type(trainer.strategy.model).__name__,
            "windows_over": windows.over(budget), "window_peaks": windows.peaks(),
            "warnings": sorted({str(w.message)[:300] for w in caught
                                if "seqmem" in str(w.message)})}


def main() -> None:
    out, args = sys.argv[1], sys.argv[2:]
    warnings.simplefilter("ignore")
    result: dict[str, object] = {}
    if args[:1] == ["callback"]:
        result["callback"], args = callback(int(args[1]), int(args[2])), args[3:]
    if args[:1] == ["equality"]:
        result["equality"], args = equality([int(s) for s in args[1:]]), []
    if args or not result:
        raise SystemExit(f"unknown arguments {args}: see this script's docstring")
    with open(out, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
