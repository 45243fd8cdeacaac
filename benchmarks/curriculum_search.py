"""How fast, and how safely, is the largest sequence length that fits a budget found?

Three searches on the same model and budget (CPU; an "OOM" is a step whose measured peak exceeds
the budget, which on a GPU would have crashed the run):

* ``truth``: bisection over multiples of ``multiple_of``, measuring a real training step at each
  probe (a fresh Lightning run per probe: 2 warm-up steps + 1 measured). The reference answer.
* ``doubling``: the batch-size-finder way (``power`` mode) — double the length until a step OOMs;
  the answer is the last length that did not. ``doubling+bisect`` then bisects between the last
  success and the first failure (``binsearch`` mode), paying an OOM for every failed probe.
* ``seqmem``: ``SeqMemCallback`` with a ``Curriculum`` and the budget: it forecasts every stage
  before entering it and caps the curriculum at the largest length predicted to fit.

Prints, for each: training steps spent, OOMs, the length found, and its distance from the truth in
units of ``multiple_of``. Goal for seqmem: zero OOMs, within one ``multiple_of`` of the truth.

    python benchmarks/curriculum_search.py [--attention eager] [--budget 60MiB] [--quick]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
import warnings

import torch

import lightning.pytorch as pl
from lightning_seqmem import Curriculum, SeqMemCallback, parse_bytes
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.core.units import format_bytes

STEPS_PER_PROBE = 3  # 2 warm-up steps + 1 measured step


def _trainer(callbacks, max_steps):
    return pl.Trainer(
        # the callback's report goes there
        default_root_dir=tempfile.mkdtemp(prefix="seqmem-bench-"),
        max_steps=max_steps, accelerator="cpu", callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )


def measure_peak(model_kwargs: dict, seq_len: int, batch_size: int) -> int:
    """Peak bytes of one training step at ``seq_len`` (after warm-up), from a fresh run."""
    torch.manual_seed(0)
    cb = SeqMemCallback(warmup_steps=2)
    _trainer([cb], STEPS_PER_PROBE).fit(
        LitGPT(**model_kwargs),
        SyntheticTokenDataModule(batch_size=batch_size, seq_len=seq_len, num_samples=4 * batch_size)
    )
    return cb.records[-1].peak_bytes


class _Counter:
    def __init__(self, model_kwargs, batch_size, budget):
        self.model_kwargs, self.batch_size, self.budget = model_kwargs, batch_size, budget
        self.steps = self.ooms = 0
        self.cache: dict[int, int] = {}

    def fits(self, seq_len: int) -> bool:
        if seq_len not in self.cache:
            self.cache[seq_len] = measure_peak(self.model_kwargs, seq_len, self.batch_size)
        self.steps += STEPS_PER_PROBE
        ok = self.cache[seq_len] <= self.budget
        self.ooms += 0 if ok else 1
        return ok


def truth(counter: _Counter, multiple_of: int, hi: int) -> int:
    lo = 0  # in units of multiple_of: lo fits (0 = nothing), hi does not
    hi_units = hi // multiple_of
    while counter.fits(hi_units * multiple_of):
        hi_units *= 2
    while hi_units - lo > 1:
        mid = (lo + hi_units) // 2
        lo, hi_units = (mid, hi_units) if counter.fits(mid * multiple_of) else (lo, mid)
    return lo * multiple_of


def doubling(counter: _Counter, start: int, multiple_of: int, bisect: bool) -> int:
    last_ok, L = 0, start
    while counter.fits(L):
        last_ok, L = L, 2 * L
    if not bisect:
        return last_ok
    lo, hi = last_ok // multiple_of, L // multiple_of
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if counter.fits(mid * multiple_of) else (lo, mid)
    return lo * multiple_of


def seqmem(model_kwargs, batch_size, budget, start, target, multiple_of, steps_per_stage):
    torch.manual_seed(0)
    curriculum = Curriculum(start=start, target=target, steps_per_stage=steps_per_stage,
                            multiple_of=multiple_of)
    cb = SeqMemCallback(warmup_steps=1, memory_budget=budget, safety_margin=0.0,
                        curriculum=curriculum, mitigations=())

    class StopWhenSettled(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if cb.planner.course.capped_at is not None or cb.seq_len == curriculum.stages[-1]:
                trainer.should_stop = True

    max_steps = steps_per_stage * (curriculum.num_stages + 1)
    _trainer([cb, StopWhenSettled()], max_steps).fit(
        LitGPT(**model_kwargs),
        SyntheticTokenDataModule(batch_size=batch_size, seq_len=target,
                                 num_samples=4 * max_steps * batch_size)
    )
    ooms = sum(r.peak_bytes > budget for r in cb.records)
    return len(cb.records), ooms, cb.seq_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", default="eager", choices=["eager", "sdpa"])
    parser.add_argument("--budget", default=None, help="bytes or e.g. '60MiB'; default: midway "
                                                       "between the peaks at 1/2 and 1x target")
    parser.add_argument("--quick", action="store_true", help="smaller model and lengths (< 1 min)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    model_kwargs = dict(n_layer=2, d_model=64, n_head=4, attention=args.attention)
    start, target, multiple_of, batch_size = (32, 512, 16, 2) if args.quick else (64, 2048, 64, 2)
    if args.quick:
        model_kwargs.update(n_layer=1, d_model=32, n_head=2)
    t0 = time.perf_counter()
    if args.budget is None:
        budget = int(0.5 * (measure_peak(model_kwargs, target // 2, batch_size)
                            + measure_peak(model_kwargs, target, batch_size)))
    else:
        budget = parse_bytes(args.budget, "--budget")
    print(f"model {model_kwargs}, batch {batch_size}, budget {format_bytes(budget)}, lengths "
          f"{start}..{target}, multiple_of {multiple_of}")

    shared_cache: dict[int, int] = {}
    rows = []
    for name, run in [
        ("truth (bisection)", lambda c: truth(c, multiple_of, start)),
        ("doubling until OOM", lambda c: doubling(c, start, multiple_of, bisect=False)),
        ("doubling + bisect", lambda c: doubling(c, start, multiple_of, bisect=True)),
    ]:
        counter = _Counter(model_kwargs, batch_size, budget)
        # measurements are shared; steps and OOMs are counted per search
        counter.cache = shared_cache
        rows.append((name, run(counter), counter.steps, counter.ooms))
    true_len = rows[0][1]
    steps, ooms, found = seqmem(model_kwargs, batch_size, budget, start, target, multiple_of,
                                steps_per_stage=3)
    rows.append(("seqmem curriculum", found, steps, ooms))

    print(f"\n{'search':<22}{'found':>8}{'steps':>8}{'OOMs':>6}{'below truth (multiple_of)':>28}")
    for name, length, nsteps, nooms in rows:
        print(f"{name:<22}{length:>8}{nsteps:>8}{nooms:>6}"
              f"{(true_len - length) / multiple_of:>28.2f}")
    ok = ooms == 0 and 0 <= true_len - found <= multiple_of
    print(f"\nseqmem: {ooms} OOMs, {(true_len - found) // multiple_of} multiple_of below the truth "
          f"-> {'PASS' if ok else 'FAIL'} "
          f"(goal: zero OOMs, within one multiple_of); total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
