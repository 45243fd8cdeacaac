"""Run by tests/test_budget_ddp.py: 2 CPU processes (gloo) with batches of 4 and 1 samples, the
ladder ``("microbatch",)`` and a budget only micro-batching meets; each rank counts its step windows
with the profiler (tests/step_window.py) and writes JSON.

    python tests/scripts/budget_ddp_run.py OUT_DIR BUDGET_BYTES [views]

``views``: ``DDPStrategy(gradient_as_bucket_view=True)`` (default: Lightning's, the buckets a copy).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from step_window import StepWindows  # noqa: E402

from lightning_seqmem import Curriculum, SeqMemCallback  # noqa: E402
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule  # noqa: E402

VOCAB = 8192  # a wide output layer: the logits of 4 samples are what micro-batching saves


def main() -> None:
    out, budget = sys.argv[1], int(sys.argv[2])
    VIEWS = len(sys.argv) > 3 and sys.argv[3] == "views"
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    cb = SeqMemCallback(warmup_steps=1, memory_budget=budget, safety_margin=0.0,
                        mitigations=("microbatch",),
                        curriculum=Curriculum(64, 256, steps_per_stage=2, multiple_of=32))
    windows = StepWindows()
    # gradient_as_bucket_view: the gradients are DDP's buckets (else the buckets are a second copy
    # of them, which no probe of tensors sees on a CPU run). init_sync=False: no broadcast of the
    # weights at set-up (both ranks seed them alike), whose flat buffer gloo's worker thread may
    # free, where the profiler records no free: the judge then counted it alive in every window
    # (+2.1 MB, one copy of the parameters, in about one run in four)
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=8,
                         strategy=DDPStrategy(gradient_as_bucket_view=VIEWS, init_sync=False),
                         callbacks=windows.around(cb), default_root_dir=out, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    module = LitGPT(n_layer=1, d_model=32, n_head=2, vocab_size=VOCAB)
    data = SyntheticTokenDataModule(batch_size=(4, 1)[rank], seq_len=256, num_samples=64,
                                    vocab_size=VOCAB)
    trainer.fit(module, data)
    result = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "records": [[r.step, r.seq_len, r.batch_size, r.peak_bytes, list(r.mitigations), r.warmup,
                     r.rank, r.forecast_method, r.forecast_error]
                    for r in cb.records],
        "applied_mitigations": list(cb.applied_mitigations),
        "usable": cb.usable_budget_bytes,
        "window_peaks": windows.peaks(),
        "windows_over": windows.over(cb.usable_budget_bytes),
        "micro_batching": getattr(module.__dict__.get("training_step"), "micro_batch_size", None),
    }
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
