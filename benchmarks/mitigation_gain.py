"""What each mitigation buys: the largest length that fits one budget, and what it costs in step \
time.

For the same model, batch and budget (CPU, live-tensor tracker), with no mitigation, each one
alone, and the whole ladder:

* the largest sequence length that fits, forecast by ``SeqMemCallback`` from three short traced
  lengths (timeline replay) and then checked by a real training step at that length (and one
  ``multiple_of`` longer, which must not fit);
* the mean step time at a fixed length, as a ratio to no mitigation (interleaved repeats, medians;
  this machine is shared and noisy, compare ratios within one run).

    python benchmarks/mitigation_gain.py [--budget 64MiB] [--quick]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import warnings

import torch

import lightning.pytorch as pl
from lightning_seqmem import Curriculum, SeqMemCallback, parse_bytes
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.mitigations import ladder
from lightning_seqmem.core.units import format_bytes

SETTINGS = [(), ("attention",), ("checkpointing",), ("microbatch",),
            ("attention", "checkpointing", "microbatch")]


class _SwitchOn(pl.Callback):
    def __init__(self, names):
        self.names = names

    def on_fit_start(self, trainer, pl_module):
        for name in self.names:
            assert ladder.apply(name, trainer, pl_module).applied, name


class _StepTimer(pl.Callback):
    def __init__(self, skip):
        self.skip, self.times, self._t0 = skip, [], 0.0

    def on_train_batch_start(self, *args):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step > self.skip:
            self.times.append(time.perf_counter() - self._t0)


def _fit(model_kwargs, names, seq_len, batch_size, callbacks, max_steps):
    torch.manual_seed(0)
    trainer = pl.Trainer(
        # the callback's report goes there
        default_root_dir=tempfile.mkdtemp(prefix="seqmem-bench-"),
        max_steps=max_steps, accelerator="cpu", callbacks=[_SwitchOn(names), *callbacks],
        logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    data = SyntheticTokenDataModule(batch_size=batch_size, seq_len=seq_len, num_samples=batch_size
                                    * (max_steps + 1), vocab_size=model_kwargs["vocab_size"])
    trainer.fit(LitGPT(**model_kwargs), data)


def measured_peak(model_kwargs, names, seq_len, batch_size) -> int:
    cb = SeqMemCallback(warmup_steps=2, mitigations=(), dry_run=False)  # measured, not planned
    _fit(model_kwargs, names, seq_len, batch_size, [cb], 3)
    return cb.records[-1].peak_bytes


def largest_that_fits(model_kwargs, names, budget, batch_size, start, multiple_of) -> int:
    cb = SeqMemCallback(warmup_steps=1, mitigations=(), dry_run=False,  # measured, not planned
                        curriculum=Curriculum(start=start, target=4 * start, steps_per_stage=3,
                                              multiple_of=multiple_of))
    _fit(model_kwargs, names, 4 * start, batch_size, [cb], 9)
    return cb.config.curriculum.round_down(cb.max_seq_len(budget, batch_size))


def step_time(model_kwargs, names, seq_len, batch_size, steps) -> float:
    timer = _StepTimer(skip=2)
    _fit(model_kwargs, names, seq_len, batch_size, [timer], steps + 2)
    return statistics.median(timer.times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default=None,
                        help="bytes or e.g. '64MiB' (default: what eager needs at 256 tokens)")
    parser.add_argument("--quick", action="store_true",
                        help="smaller model, fewer timing repeats (< 1 min)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)  # steadier timings on a shared machine

    model_kwargs = dict(vocab_size=256, n_layer=4, n_head=4, d_model=128, attention="eager")
    batch_size, start, multiple_of, time_len, repeats, steps = 4, 64, 16, 256, 3, 6
    if args.quick:
        model_kwargs.update(n_layer=2, d_model=64)
        start, time_len, repeats, steps = 32, 128, 1, 4
    t0 = time.perf_counter()
    budget = (parse_bytes(args.budget, "--budget") if args.budget
              else measured_peak(model_kwargs, (), 4 * start, batch_size))
    print(f"model {model_kwargs}, batch {batch_size}, budget {format_bytes(budget)}, "
          f"multiple_of {multiple_of}")

    times: dict[tuple, list[float]] = {names: [] for names in SETTINGS}
    for _ in range(repeats):  # interleaved, so load changes hit every setting alike
        for names in SETTINGS:
            times[names].append(step_time(model_kwargs, names, time_len, batch_size, steps))
    base_time = statistics.median(times[()])

    print(f"\n{'mitigations':<38}{'largest L':>10}{'peak @L':>12}{'peak @L+m':>12}{'check':>7}"
          f"{'gain':>7}{'step time':>11}")
    base_len = None
    for names in SETTINGS:
        fit = largest_that_fits(model_kwargs, names, budget, batch_size, start, multiple_of)
        at, above = measured_peak(model_kwargs, names, fit, batch_size), measured_peak(
            model_kwargs, names, fit + multiple_of, batch_size)
        base_len = base_len or fit
        label = " + ".join(names) or "none"
        print(f"{label:<38}{fit:>10}{format_bytes(at):>12}{format_bytes(above):>12}"
              f"{'ok' if at <= budget else 'OVER':>7}"
              f"{fit / base_len:>6.1f}x{statistics.median(times[names]) / base_time:>10.2f}x")
    print("\ncheck: the measured peak at the forecast length is within the budget "
          "(the forecast's upper "
          "bound keeps a 2% margin, so L + multiple_of may still fit); gain: "
          "largest L over no mitigation; "
          f"step time: median at seq_len={time_len}, relative to no mitigation; total "
          f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
