"""The budget promise on a GPU: a curriculum 16x beyond what fits, the ladder on, every step \
checked.

Without CUDA it prints ``no CUDA device: gpu_budget skipped`` and exits 0. With CUDA:

1. A short unmitigated run (LitGPT d=512, 8 layers, 8 heads, eager attention, batch 4, bf16-mixed)
   at ``--fits`` tokens measures the reserved peak ``R`` with the allocator's own counters.
2. ``memory_budget`` is set so that the usable budget (budget x (1 - safety_margin)) is ``R`` x
   1.05: the eager model fits about ``--fits`` tokens and no more.
3. A curriculum run from 256 tokens to ``--target`` with the whole ladder allowed. An independent
   callback placed before the SeqMemCallback resets ``torch.cuda`` peak counters at batch start
   and reads ``max_memory_allocated`` / ``max_memory_reserved`` at every phase boundary and at
   batch end (the LightningModule's ``on_train_batch_end``, after every callback).

Printed: every step's length, batch size, mitigations, the probe's peak, the independent allocated
and reserved peaks, and whether reserved stayed within the usable budget. ``PASS`` when no step's
independent reserved peak exceeded the usable budget and the curriculum reached the target (or
the callback capped it with a warning).

    python benchmarks/gpu_budget.py
    python benchmarks/gpu_budget.py --fits 512 --target 8192
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_check import (  # noqa: E402
    BATCH_SIZE, D_MODEL, N_HEAD, N_LAYER, VOCAB_SIZE, _cleanup, _mib, build)

warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", category=DeprecationWarning)
SAFETY_MARGIN = 0.1  # the callback's default


def measured_reserved(classes, seq_len: int, precision: str) -> int:
    """Reserved peak (bytes) of the last step of a 3-step unmitigated eager run at ``seq_len``."""
    from gpu_check import train

    _, reader = train(classes, "eager", precision, seq_len, 3)
    return reader.steps[-1]["reserved_peak_bytes"]


def budget_run(classes, budget_bytes: int, target: int, precision: str, max_steps: int):
    import lightning.pytorch as pl  # noqa: F401 - imported by build() too

    from lightning_seqmem import Curriculum, SeqMemCallback
    from lightning_seqmem.reference.demo import SyntheticTokenDataModule

    IndependentPeaks, CheckedLitGPT, make_trainer = classes
    torch.manual_seed(0)
    reader = IndependentPeaks()
    seqmem = SeqMemCallback(
        memory_budget=budget_bytes, safety_margin=SAFETY_MARGIN,
        curriculum=Curriculum(start=256, target=target, steps_per_stage=2, multiple_of=64),
    )  # fmt: skip
    model = CheckedLitGPT(vocab_size=VOCAB_SIZE, n_layer=N_LAYER, n_head=N_HEAD, d_model=D_MODEL,
                          attention="eager")
    model.peak_reader = reader
    data = SyntheticTokenDataModule(
        batch_size=BATCH_SIZE, seq_len=target, num_samples=BATCH_SIZE * max_steps,
        vocab_size=VOCAB_SIZE
    )
    trainer = make_trainer([reader, seqmem], max_steps, precision)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=data)
    said = [f"{w.category.__name__}: {str(w.message).splitlines()[0][:160]}" for w in caught
            if "seqmem" in w.category.__module__ or "SeqMem" in w.category.__name__
            or "OOM" in w.category.__name__]  # fmt: skip
    del trainer, data
    _cleanup()
    return seqmem, reader, model, said


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fits", type=int, default=512,
                        help="tokens the eager model is given room for")
    parser.add_argument("--target", type=int, default=8192, help="curriculum target (tokens)")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--max-steps", type=int, default=30)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: gpu_budget skipped")
        return 0
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    classes = build(args)
    t0 = time.perf_counter()
    fits_reserved = measured_reserved(classes, args.fits, args.precision)
    usable = int(fits_reserved * 1.05)
    budget = int(usable / (1 - SAFETY_MARGIN))
    print(
        f"gpu_budget: {torch.cuda.get_device_name()}, torch {torch.__version__}; LitGPT "
        f"d={D_MODEL} {N_LAYER} layers {N_HEAD} heads eager, batch {BATCH_SIZE}, {args.precision}\n"
        f"eager reserved peak at {args.fits} tokens: {_mib(fits_reserved)} MiB -> memory_budget "
        f"{_mib(budget)} MiB, usable {_mib(usable)} MiB; curriculum 256 -> {args.target}"
    )
    seqmem, reader, model, said = budget_run(classes, budget, args.target, args.precision,
                                             args.max_steps)
    print(f"  {'step':>4} {'L':>5} {'B':>2} {'mitigations':<34} {'probe MiB':>9} {'alloc MiB':>9} "
          f"{'resv MiB':>9} {'ok':>3}")
    over = 0
    for r in seqmem.records:
        ind = reader.steps[r.step] if r.step < len(reader.steps) else {}
        ok = ind.get("reserved_peak_bytes", 0) <= usable
        over += not ok
        print(
            f"  {r.step:>4} {r.seq_len:>5} {r.batch_size:>2} {','.join(r.mitigations) or '-':<34} "
            f"{_mib(r.peak_bytes):>9} "
            f"{_mib(ind.get('peak_bytes')):>9} {_mib(ind.get('reserved_peak_bytes')):>9} "
            f"{'yes' if ok else 'NO':>3}"
        )
    unrecorded = [s for i, s in enumerate(reader.steps)
                  if i not in {r.step for r in seqmem.records}]
    over += sum(s["reserved_peak_bytes"] > usable for s in unrecorded)
    for event in seqmem.mitigation_events:
        print(f"  rung {event['name']} at step {event['step']}: before "
              f"{_mib(event['before_bytes'])} MiB ({event.get('before_method')}), "
              f"after {_mib(event['after_bytes'])} MiB")  # fmt: skip
    for line in said:
        print(f"  warning {line}")
    last = seqmem.records[-1].seq_len if seqmem.records else 0
    capped = seqmem.planner.course.capped_at
    reached = last == args.target or capped is not None
    print(
        f"steps {len(reader.steps)}, over the usable budget {over}; last length {last}, capped at "
        f"{capped}; applied {list(seqmem.applied_mitigations)}; {time.perf_counter() - t0:.1f} s"
    )
    print(f"SUMMARY {'PASS' if over == 0 and reached else 'FAIL'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
