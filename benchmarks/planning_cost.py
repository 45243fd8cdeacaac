"""What does planning cost? Dry runs, stage decisions and a dynamic-padding run, at 2/8/32 layers \
(CPU)

For Llama-like models (a random Hugging Face ``LlamaConfig``: nothing downloaded; d=256, MLP 512,
4 heads, SDPA attention, AdamW) of 2, 8 and 32 decoder layers:

* ``dry run s``: one :func:`~lightning_seqmem.dryrun.step.dry_run_step` at ``--length`` tokens
  (after one warm-up dry run; the median of ``--repeats``);
* ``decision s`` / ``dry runs``: one cold stage decision of
  :class:`~lightning_seqmem.plan.planner.SeqMemPlanner` (no dry run cached) in the worst case: the
  next stage is over the budget with every rung, so the planner tries each set of rungs and then
  finds the longest length that fits. The budget is the dry run's peak at 5/8 of the way between the
  two stages, with checkpointing and micro-batching; ``cap`` is the length it settles on. Under DDP
  the other ranks wait in a collective for exactly this long (the decision is taken on rank zero
  only);
* ``run s`` / ``base s``: a ``Trainer.fit`` of ``--steps`` steps with dynamic padding (every batch
  has a new length, drawn without repeats from ``--min-length`` to ``--max-length``) with
  ``SeqMemCallback(memory_budget=...)`` (a budget of twice the dry-run peak at the longest length:
  nothing has to be switched on) against the same fit without the callback (wall time of ``fit``;
  interleaved, best of ``--fit-repeats``, after an untimed fit of the same data: the first step at
  a new shape sets its CPU kernels up, 3 to 15 times the later ones' time on 2 layers). Their
  difference is two costs of different kinds, given apart:

  - ``fixed s``: what does not grow with the steps: the dry runs (the decisions' and the
    end-of-fit report's) and the callback's set-up and end-of-fit hooks (``setup``,
    ``on_fit_start``, ``on_train_start``, ``on_train_end``: the report, the figure), timed inside
    the run;
  - ``per step``: the per-step overhead, the median over steps (the first excepted) of one step's
    wall time in the run, less the dry runs made in it, over the same step's (same index, same
    length) in the fit without the callback, less one: the decisions, the probe, the measured
    steps' tracker, the logging. Each step's time is its shortest over the ``--fit-repeats``
    interleaved fits (3 by default, 1 with ``--quick``) and the figure a median of ratios, so that
    a shared machine's load in one fit or the other does not make it; ``fit overhead`` is the whole
    fit's ratio (the shortest fits), the fixed seconds included (what a short run pays: on 16 steps
    it is nearly all fixed cost), and ``per_step_by_difference_fraction`` (JSON) that ratio less
    the fixed seconds, a cross-check of the median;
* ``wait s``: of that run, the seconds rank zero spent in the planner's decisions (what other ranks
  would wait in the collective before each batch), ``dry s`` / ``dry n``: seconds and number of dry
  runs in the run (the end-of-fit report's included), ``meas``: steps the callback measured (the
  others ran below a measured longer step: :mod:`lightning_seqmem.plan.schedule`);
* ``over``: steps over the usable budget by an independent count: every step that ran, against a
  real step measured apart (the live-tensor tracker, after a warm-up step) at the longest length
  that ran, and every measured record against the budget (the larger of the two counts).

    python benchmarks/planning_cost.py --layers 8 --json   # the headline: 200 steps, 64..512
    python benchmarks/planning_cost.py --quick  # 16 steps, short lengths (a few minutes on 2 cores)
    python benchmarks/planning_cost.py --quick --json   # last line: one JSON object

The ``--json`` line has ``overhead_fraction`` (layer count as a string -> the per-step overhead as a
fraction), ``fixed_s`` (-> the fixed seconds), ``fit_overhead_fraction`` (-> the whole fit's) and
the other figures under the same keys.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import statistics
import tempfile
import time
import warnings
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_seqmem import Curriculum, SeqMemCallback
from lightning_seqmem.dryrun.step import dry_run_step
from lightning_seqmem.reference.hf import HFCausalLM
from lightning_seqmem.plan.planner import SeqMemPlanner
from lightning_seqmem.dryrun.run import TrainingRunDryRun

warnings.filterwarnings("ignore")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("lightning.fabric").setLevel(logging.ERROR)

VOCAB_SIZE = 256  # token ids
MIB = 2**20


def llama(layers: int) -> HFCausalLM:
    """A random Llama-like causal LM: d=256, MLP 512, 4 heads, ``layers`` blocks, SDPA."""
    torch.manual_seed(0)
    return HFCausalLM(config={"hidden_size": 256, "intermediate_size": 512,
                              "num_hidden_layers": layers, "num_attention_heads": 4,
                              "num_key_value_heads": 4, "vocab_size": VOCAB_SIZE},
                      attn_implementation="sdpa")


def token_batch(batch_size: int, seq_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB_SIZE, (batch_size, seq_len + 1), generator=g)
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


class DynamicPadding(Dataset):
    """Whole batches, each padded to a new length (no length repeats):
    ``DataLoader(batch_size=None)``."""

    def __init__(self, num_batches: int, batch_size: int, min_length: int, max_length: int,
                 seed: int = 0) -> None:
        lengths = list(range(min_length, max_length + 1))
        random.Random(seed).shuffle(lengths)
        if len(lengths) < num_batches:
            raise ValueError(f"{num_batches} batches need {num_batches} lengths, got "
                             f"{min_length}..{max_length}")
        self.lengths, self.batch_size = lengths[:num_batches], batch_size

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return token_batch(self.batch_size, self.lengths[i], seed=i)


def dry_run_seconds(layers: int, seq_len: int, batch_size: int, repeats: int) -> tuple[float, int]:
    module = llama(layers)
    optimizer = module.configure_optimizers()
    batch = token_batch(batch_size, 64)
    dry_run_step(module, optimizer, batch, 64, batch_size)  # warm-up (imports, caches)
    times, peak = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        peak = dry_run_step(module, optimizer, batch, seq_len, batch_size).peak_bytes
        times.append(time.perf_counter() - t0)
    return statistics.median(times), peak


def stage_decision(layers: int, batch_size: int, stage_len: int, next_len: int) -> dict[str, Any]:
    """One cold worst-case stage decision (see the module doc): seconds, dry runs, the cap."""
    module = llama(layers)
    optimizer = module.configure_optimizers()
    batch = token_batch(batch_size, 64)
    calls: list[tuple[int, int, tuple[str, ...]]] = []

    def dry(seq_len: int, batch_size: int,
            mitigations: tuple[str, ...]) -> tuple[int, dict[str, int]]:
        calls.append((seq_len, batch_size, tuple(mitigations)))
        r = dry_run_step(module, optimizer, batch, seq_len, batch_size, mitigations)
        return r.peak_bytes, r.phase_peak_bytes

    every = ("checkpointing", "microbatch")
    between = stage_len + (next_len - stage_len) * 5 // 8
    budget = dry(between, batch_size, every)[0]
    calls.clear()
    curriculum = Curriculum(start=stage_len, target=next_len, growth=next_len / stage_len,
                            steps_per_stage=1)
    planner = SeqMemPlanner(memory_budget_bytes=budget, safety_margin=0.0, curriculum=curriculum,
                            mitigations=("attention",) + every, dry_runner=dry)
    planner.evidence.measured.last_batch_size, planner.course.stage_steps = batch_size, 1
    applicable = {"attention": (False, "already SDPA"), "checkpointing": (True, ""),
                  "microbatch": (True, "")}
    t0 = time.perf_counter()
    decision = planner.decide((batch_size, next_len), applicable)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "dry_runs": len(calls), "action": decision.action,
            "cap": decision.seq_len, "budget_mib": budget / MIB}


class _Instrument:
    """Times the planner's decisions, the dry runs of a fit (in all, and per batch: ``batch`` is the
    index of the batch running) and the callback's set-up and end-of-fit hooks (patched in,
    restored after)."""

    HOOKS = ("setup", "on_fit_start", "on_train_start", "on_train_end")

    def __init__(self) -> None:
        self.decide_s = 0.0
        self.dry_s = 0.0
        self.dry_n = 0
        self.hooks_s = 0.0
        self.batch = -1
        self.dry_by_batch: dict[int, float] = {}

    def __enter__(self) -> "_Instrument":
        self._decide, self._dry = SeqMemPlanner.decide, TrainingRunDryRun.__call__
        self._hooks = {name: getattr(SeqMemCallback, name) for name in self.HOOKS}
        inst = self

        def decide(planner, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inst._decide(planner, *args, **kwargs)
            finally:
                inst.decide_s += time.perf_counter() - t0

        def dry(runner, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inst._dry(runner, *args, **kwargs)
            finally:
                seconds = time.perf_counter() - t0
                inst.dry_s += seconds
                inst.dry_n += 1
                inst.dry_by_batch[inst.batch] = inst.dry_by_batch.get(inst.batch, 0.0) + seconds

        def timed(hook):
            def run(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return hook(*args, **kwargs)
                finally:
                    inst.hooks_s += time.perf_counter() - t0
            return run

        SeqMemPlanner.decide, TrainingRunDryRun.__call__ = decide, dry
        for name, hook in self._hooks.items():
            setattr(SeqMemCallback, name, timed(hook))
        return self

    def __exit__(self, *exc: Any) -> None:
        SeqMemPlanner.decide, TrainingRunDryRun.__call__ = self._decide, self._dry
        for name, hook in self._hooks.items():
            setattr(SeqMemCallback, name, hook)

    def fixed_s(self) -> float:
        """The seconds that do not grow with the steps: every dry run, and the set-up and end-of-fit
        hooks outside them (a dry run inside a hook is counted once)."""
        inside_hooks = self.dry_by_batch.get(-1, 0.0) + self.dry_by_batch.get(-2, 0.0)
        return self.dry_s + max(0.0, self.hooks_s - inside_hooks)


class _StepClock(pl.Callback):
    """Each batch's wall seconds, from its first ``on_train_batch_start`` (this callback goes first)
    to the next one's (the last: to the end of training); tells ``instrument`` the batch running."""

    def __init__(self, instrument: Optional[_Instrument] = None) -> None:
        self.instrument, self.starts, self.end = instrument, [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())
        if self.instrument is not None:
            self.instrument.batch = len(self.starts) - 1

    def on_train_end(self, trainer, pl_module) -> None:
        self.end = time.perf_counter()
        if self.instrument is not None:
            self.instrument.batch = -2  # the end-of-fit report's dry runs

    def seconds(self) -> list[float]:
        ends = self.starts[1:] + ([self.end] if self.end is not None else [])
        return [b - a for a, b in zip(self.starts, ends)]


def per_step_overhead(run: list[float], base: list[float], dry_by_batch: dict[int, float]) -> float:
    """The median over steps (the first excepted) of ``(run_i - dry_i) / base_i``, less one.

    >>> round(per_step_overhead([3.0, 1.05, 1.2, 1.0], [2.0, 1.0, 1.0, 1.0], {0: 1.0, 2: 0.15}), 6)
    0.05
    """
    ratios = [(r - dry_by_batch.get(i, 0.0)) / b for i, (r, b) in enumerate(zip(run, base))
              if i >= 1 and b > 0]
    return statistics.median(ratios) - 1 if ratios else float("nan")


class _Ran(pl.Callback):
    """Every batch's ``(seq_len, batch_size, rungs on)`` as it runs (after SeqMemCallback's cut)."""

    def __init__(self, cb: SeqMemCallback) -> None:
        self.cb, self.shapes = cb, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        B, L = batch["input_ids"].shape
        self.shapes.append((int(L), int(B), tuple(self.cb.applied_mitigations)))


def independent_peak(layers: int, seq_len: int, batch_size: int) -> int:
    """The live-tensor peak of one real training step at ``(seq_len, batch_size)``, after a warm-up
    step (gradients and optimizer state alive, as in a run), measured apart from the callback."""
    from lightning_seqmem.measure.probes import make_probe
    from lightning_seqmem.measure.steps import training_step_memory

    module = llama(layers)
    optimizer = module.configure_optimizers()
    batch = token_batch(batch_size, seq_len, seed=1)
    loss_fn = lambda m, b: m.training_step(b, 0)  # noqa: E731
    training_step_memory(module, optimizer, batch, loss_fn)
    memory = training_step_memory(module, optimizer, batch, loss_fn,
                                  make_probe("tracker", torch.device("cpu")))
    assert memory is not None
    return memory.peak_bytes


def fit_seconds(layers: int, data: DynamicPadding,
                callbacks: Callable[[], list]) -> tuple[float, list]:
    module = llama(layers)
    cbs = callbacks()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=len(data), max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=cbs,
                         default_root_dir=tempfile.mkdtemp(prefix="seqmem-cost-"))
    loader = DataLoader(data, batch_size=None, shuffle=False)
    gc.collect()
    t0 = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader)
    return time.perf_counter() - t0, cbs


def dynamic_padding_run(layers: int, args: argparse.Namespace) -> dict[str, Any]:
    data = DynamicPadding(args.steps, args.batch_size, args.min_length, args.max_length)
    _, peak = dry_run_seconds(layers, args.max_length, args.batch_size, 1)
    budget = 2 * peak
    base: list[tuple[float, list[float]]] = []
    run: list[tuple[float, list[float], _Instrument]] = []
    records, over = 0, 0
    fit_seconds(layers, data, list)  # untimed: the first fit at each shape sets its CPU kernels up
    for i in range(args.fit_repeats):
        order = ("base", "run") if i % 2 == 0 else ("run", "base")
        for which in order:
            if which == "base":
                clock = _StepClock()
                seconds, _ = fit_seconds(layers, data, lambda: [clock])
                base.append((seconds, clock.seconds()))
                continue
            cb = SeqMemCallback(memory_budget=budget)
            ran = _Ran(cb)
            with _Instrument() as inst:
                clock = _StepClock(inst)
                seconds, _ = fit_seconds(layers, data, lambda: [clock, cb, ran])
            run.append((seconds, clock.seconds(), inst))
            records = len(cb.records)
            usable = cb.planner.settings.usable_budget_bytes
            # the measured steps, by the callback's tracker
            over = sum(r.peak_bytes > usable for r in cb.records)
    # the independent count: every step that ran, against a real step measured apart at the longest
    # shape that ran with the same rungs (a step's peak does not fall as the length grows): the
    # steps the callback left unmeasured are counted too
    longest: dict[tuple, tuple[int, int]] = {}
    for L, B, rungs in ran.shapes:
        longest[rungs] = max(longest.get(rungs, (0, 0)), (L, B))
    independent = {rungs: independent_peak(layers, L, B) for rungs, (L, B) in longest.items()
                   if not rungs}
    # with a rung on: not measured apart, counted as over (none here)
    unchecked = sum(bool(s[2]) for s in ran.shapes)
    over_independent = sum(independent[s[2]] > usable for s in ran.shapes
                           if s[2] in independent) + unchecked
    b_s, r_s = min(s for s, _ in base), min(s for s, _, _ in run)
    b_steps = [min(steps) for steps in zip(*(steps for _, steps in base))]  # each step's shortest
    less_dry = ([t - i.dry_by_batch.get(k, 0.0) for k, t in enumerate(ts)] for _, ts, i in run)
    r_steps = [min(steps) for steps in zip(*less_dry)]
    inst = min(run, key=lambda item: item[0])[2]
    fixed = min(i.fixed_s() for _, _, i in run)
    return {"base_s": b_s, "run_s": r_s, "fit_overhead": r_s / b_s - 1, "fixed_s": fixed,
            "per_step_by_difference": (r_s - fixed) / b_s - 1,
            "overhead": per_step_overhead(r_steps, b_steps, {}),
            "wait_s": inst.decide_s, "dry_s": inst.dry_s, "dry_n": inst.dry_n, "records": records,
            "steps": len(ran.shapes), "over_budget_records": over,
            "over_budget_steps": max(over, over_independent),
            "independent_peak_mib": max(independent.values(), default=0) / MIB,
            "usable_mib": usable / MIB}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 steps, lengths 32..160, 1 repeat")
    parser.add_argument("--json", action="store_true",
                        help="print the figures as one JSON object, last line")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--steps", type=int, default=None,
                        help="steps of the dynamic-padding run (200)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--min-length", type=int, default=None)
    parser.add_argument("--max-length", type=int, default=None)
    parser.add_argument("--length", type=int, default=1024, help="tokens of the timed dry run")
    parser.add_argument("--repeats", type=int, default=None, help="timed dry runs (median)")
    parser.add_argument("--fit-repeats", type=int, default=None,
                        help="interleaved fits with and without the callback (3; --quick: 1)")
    args = parser.parse_args(argv)
    quick = args.quick
    args.steps = args.steps or (16 if quick else 200)
    args.min_length = args.min_length or (32 if quick else 64)
    args.max_length = args.max_length or (160 if quick else 512)
    args.repeats = args.repeats or (1 if quick else 3)
    args.fit_repeats = args.fit_repeats or (1 if quick else 3)
    t_start = time.perf_counter()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows: dict[str, dict[str, Any]] = {}
    for layers in args.layers:
        row: dict[str, Any] = {}
        row["dry_run_s"], _ = dry_run_seconds(layers, args.length, args.batch_size, args.repeats)
        stage, nxt = (64, 128) if quick else (256, 512)
        row["decision"] = stage_decision(layers, args.batch_size, stage, nxt)
        row["run"] = dynamic_padding_run(layers, args)
        rows[str(layers)] = row
        print(f"({layers} layers done after {time.perf_counter() - t_start:.0f} s)", flush=True)
    total = time.perf_counter() - t_start
    out = {
        "overhead_fraction": {k: v["run"]["overhead"] for k, v in rows.items()},
        "fixed_s": {k: v["run"]["fixed_s"] for k, v in rows.items()},
        "fit_overhead_fraction": {k: v["run"]["fit_overhead"] for k, v in rows.items()},
        "per_step_by_difference_fraction": {k: v["run"]["per_step_by_difference"]
                                            for k, v in rows.items()},
        "dry_run_s": {k: v["dry_run_s"] for k, v in rows.items()},
        "decision_s": {k: v["decision"]["seconds"] for k, v in rows.items()},
        "decision_dry_runs": {k: v["decision"]["dry_runs"] for k, v in rows.items()},
        "run_s": {k: v["run"]["run_s"] for k, v in rows.items()},
        "base_s": {k: v["run"]["base_s"] for k, v in rows.items()},
        "wait_s": {k: v["run"]["wait_s"] for k, v in rows.items()},
        "run_dry_runs": {k: v["run"]["dry_n"] for k, v in rows.items()},
        "run_dry_s": {k: v["run"]["dry_s"] for k, v in rows.items()},
        "over_budget_steps": {k: v["run"]["over_budget_steps"] for k, v in rows.items()},
        "measured_steps": {k: v["run"]["records"] for k, v in rows.items()},
        "independent_peak_mib": {k: v["run"]["independent_peak_mib"] for k, v in rows.items()},
        "usable_budget_mib": {k: v["run"]["usable_mib"] for k, v in rows.items()},
        "steps": args.steps, "lengths": [args.min_length, args.max_length],
        "batch_size": args.batch_size, "total_s": total,
    }
    print(f"planning_cost: Llama d=256, batch {args.batch_size}, SDPA, CPU; dry run at "
          f"{args.length} tokens; "
          f"{args.steps}-step dynamic padding {args.min_length}..{args.max_length} tokens")
    print(f"{'layers':>6} {'dry run s':>9} {'decision s':>10} {'dry runs':>8} {'cap':>5} | "
          f"{'run s':>7} {'base s':>7} {'fixed s':>7} {'per step':>8} {'fit ovh':>8} "
          f"{'wait s':>7} {'dry s':>7} {'dry n':>5} {'meas':>4} {'over':>4}")
    for k, v in rows.items():
        d, r = v["decision"], v["run"]
        print(f"{k:>6} {v['dry_run_s']:>9.2f} {d['seconds']:>10.2f} {d['dry_runs']:>8} "
              f"{d['cap'] or 0:>5} | "
              f"{r['run_s']:>7.1f} {r['base_s']:>7.1f} {r['fixed_s']:>7.1f} {r['overhead']:>8.1%} "
              f"{r['fit_overhead']:>8.1%} {r['wait_s']:>7.1f} {r['dry_s']:>7.1f} {r['dry_n']:>5} "
              f"{r['records']:>4} {r['over_budget_steps']:>4}")
    print(f"total runtime: {total:.1f} s")
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
