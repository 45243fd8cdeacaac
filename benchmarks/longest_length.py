"""The longest sequence that fits one budget, and what each way of getting there costs per token.

A Hugging Face Llama-like model with a large vocabulary (random config, nothing downloaded: 32K
vocabulary, hidden 256, 4 layers, eager attention to start with, batch 2), on CPU with the
live-tensor tracker. For one fixed budget (by default the measured peak of the plain model at
``--base-len`` tokens), the longest length and the step time per token of:

* (a) ``none``: the model as it is;
* (b) ``old_rungs``: the three rungs of 0.1 by hand (SDPA + full checkpointing + batch 1);
* (c) ``auto``: ``SeqMemCallback`` with every rung allowed, a curriculum from ``--base-len`` up to
  ``--max-len`` under the budget: the longest stage (or cap) it ran, with the setting it chose;
* (d) ``all_by_hand``: everything on by hand (SDPA + full checkpointing + fused loss + tiled MLP +
  batch 1).

Each longest length is searched with dry runs (bisection on ``--multiple-of``), then checked by a
real training step at that length, measured (tracker), which must be within the budget. Step
times are medians of real steps without the callback; the second part's are timed round-robin over
all its settings, ``--rounds`` passes, the best pass of each (this machine is shared and noisy:
compare ratios within one run).

Second part, ``--second-len``: a budget where full checkpointing is not needed (half-way between
the plain peak and the full-checkpointing peak at that length). Every setting that the dry run says
fits is timed (exhaustive search, measured step times, same run); the callback's own choice at that
length is compared with the fastest of them and with SDPA + full checkpointing.

    python benchmarks/longest_length.py [--quick] [--json] [--budget 600MiB]

``--json`` prints, as its last line, one JSON object: ``longest_length`` (``none``, ``old_rungs``,
``auto``, ``all_by_hand`` -> tokens), ``headline_auto_vs_none`` ((c)/(a) in length),
``step_time_ratio_auto_vs_fastest`` and ``step_time_ratio_auto_vs_full_checkpointing`` (second
part).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import tempfile
import time
import warnings
from typing import Any, Optional, Sequence

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_seqmem import Curriculum, SeqMemCallback, parse_bytes
from lightning_seqmem.core.search import largest_fitting
from lightning_seqmem.core.units import format_bytes
from lightning_seqmem.dryrun.step import dry_run_step
from lightning_seqmem.reference.hf import HFCausalLM
from lightning_seqmem.mitigations import ladder
from lightning_seqmem.mitigations.base import RungContext
from lightning_seqmem.core.rungs import rung_names

warnings.filterwarnings("ignore")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("lightning.fabric").setLevel(logging.ERROR)

VOCAB_SIZE = 32768
BATCH_SIZE = 2
OLD_RUNGS = ("attention", "checkpointing", "microbatch")
ALL_BY_HAND = ("attention", "checkpointing", "fused_loss", "tiled_mlp", "microbatch")
FULL_CHECKPOINTING = ("attention", "checkpointing")


def config(layers: int) -> dict[str, Any]:
    return {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 4, "vocab_size": VOCAB_SIZE, "max_position_embeddings": 1 << 17}


def model(layers: int) -> HFCausalLM:
    torch.manual_seed(0)
    return HFCausalLM(config=config(layers), attn_implementation="eager")


def known(setting: Sequence[str]) -> tuple[str, ...]:
    """The rungs of ``setting`` this installation has (a missing one is said once in the output)."""
    names = set(rung_names())
    return tuple(n for n in setting if n.split(":")[0] in names)


class Tokens(Dataset):
    def __init__(self, seq_len: int, num_samples: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB_SIZE, (num_samples, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


class _SwitchOn(pl.Callback):
    def __init__(self, names: Sequence[str]) -> None:
        self.names = names

    def on_train_batch_start(self, trainer, pl_module, batch,
                             batch_idx) -> None:  # type: ignore[no-untyped-def]
        if batch_idx == 0:
            for name in self.names:
                result = ladder.apply(name, trainer, pl_module, batch)
                assert result.applied or ladder.is_on(name, pl_module), (name, result.detail)


class _StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.seconds.append(time.perf_counter() - self._t0)


def _fit(layers: int, seq_len: int, steps: int, callbacks: list) -> None:
    trainer = pl.Trainer(default_root_dir=tempfile.mkdtemp(prefix="seqmem-longest-"),
                         max_steps=steps, accelerator="cpu", callbacks=callbacks, logger=False,
                         enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    data = DataLoader(Tokens(seq_len, BATCH_SIZE * steps), batch_size=BATCH_SIZE)
    trainer.fit(model(layers), data)


def measured_peak(layers: int, setting: Sequence[str], seq_len: int) -> int:
    """Peak of a real training step at ``seq_len`` with ``setting`` on (tracker), after one warm-up
    step."""
    cb = SeqMemCallback(warmup_steps=1, mitigations=(), dry_run=False)
    _fit(layers, seq_len, 2, [_SwitchOn(setting), cb])
    return cb.records[-1].peak_bytes


def step_seconds(layers: int, setting: Sequence[str], seq_len: int, steps: int = 3) -> float:
    """Median seconds of a real step (no callback measuring), the first step left out."""
    timer = _StepTimer()
    _fit(layers, seq_len, steps + 1, [_SwitchOn(setting), timer])
    return statistics.median(timer.seconds[1:])


def interleaved_seconds(layers: int, settings: Sequence[Sequence[str]], seq_len: int,
                        rounds: int) -> dict:
    """Each setting's step seconds, timed in ``rounds`` round-robin passes over all of them (so a
    change of the machine's load falls on every setting alike), the best pass of each: ``{setting:
    seconds}``."""
    seen: dict[tuple[str, ...], list[float]] = {tuple(s): [] for s in settings}
    for _ in range(max(1, rounds)):
        for s in seen:
            seen[s].append(step_seconds(layers, s, seq_len))
    return {s: min(v) for s, v in seen.items()}


class DryPeaks:
    """Dry-run peaks of one model, cached by (length, setting)."""

    def __init__(self, layers: int) -> None:
        self.module = model(layers)
        self.optimizer = self.module.configure_optimizers()
        self.batch = {"input_ids": torch.zeros(BATCH_SIZE, 64, dtype=torch.long),
                      "labels": torch.zeros(BATCH_SIZE, 64, dtype=torch.long)}
        self.cache: dict[tuple[int, tuple[str, ...]], int] = {}

    def peak(self, seq_len: int, setting: Sequence[str]) -> int:
        key = (seq_len, tuple(setting))
        if key not in self.cache:
            self.cache[key] = dry_run_step(self.module, self.optimizer, self.batch, seq_len,
                                           BATCH_SIZE, tuple(setting)).peak_bytes
        return self.cache[key]

    def longest(self, setting: Sequence[str], budget: int, multiple_of: int, max_len: int) -> int:
        fits = lambda L: self.peak(L, setting) <= budget  # noqa: E731
        return largest_fitting(fits, low=multiple_of, high=max_len, step=multiple_of)


def auto_run(layers: int, budget: int, start: int, target: int, multiple_of: int,
             names: Sequence[str], curriculum: bool = True) -> SeqMemCallback:
    """A real fit with the callback choosing under ``budget``: a curriculum ``start -> target``, or
    (``curriculum=False``) every batch at ``target``."""
    cb = SeqMemCallback(memory_budget=budget, safety_margin=0.0, warmup_steps=1,
                        mitigations=tuple(names), curriculum=Curriculum(
                            start=start, target=target, growth=2.0, steps_per_stage=2,
                                              multiple_of=multiple_of) if curriculum else None)
    stages = 2 * (1 + max(0, (target // max(start, 1)).bit_length())) + 2 if curriculum else 3
    _fit(layers, target, stages, [cb])
    return cb


def settings_over(names: Sequence[str], layers: int) -> list[tuple[str, ...]]:
    """Every setting of ``names`` (checkpointing at each level), the empty one first."""
    levels: list[list[Optional[str]]] = []
    for name in names:
        if name == "checkpointing":
            levels.append([None,
                           *ladder.rung("checkpointing").variants(RungContext(model(layers)))])
        else:
            levels.append([None, name])
    return [tuple(n for n in combo if n) for combo in itertools.product(*levels)]


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="shorter lengths, fewer settings timed (a few minutes)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object as the last line")
    parser.add_argument("--budget", default=None,
                        help="bytes or e.g. '600MiB' (default: the plain peak at --base-len)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--base-len", type=int, default=None,
                        help="tokens (default 512; --quick 256)")
    parser.add_argument("--max-len", type=int, default=None,
                        help="longest length searched (default 32768; --quick 8192)")
    parser.add_argument("--second-len", type=int, default=None,
                        help="length of the second part (default: 2 x base)")
    parser.add_argument("--second-only", action="store_true", help="run the second part only")
    parser.add_argument("--rounds", type=int, default=3,
                        help="round-robin timing passes of the second part (best of)")
    args = parser.parse_args(argv)
    base = args.base_len or (256 if args.quick else 512)
    max_len = args.max_len or (8192 if args.quick else 32768)
    multiple_of = 64 if args.quick else 128
    second = args.second_len or 2 * base
    t0 = time.perf_counter()
    dry = DryPeaks(args.layers)
    budget = (parse_bytes(args.budget, "--budget") if args.budget
              else measured_peak(args.layers, (), base))
    every = known(("attention", "checkpointing", "microbatch", "fused_loss", "tiled_mlp"))
    missing = sorted(set(ALL_BY_HAND) - set(known(ALL_BY_HAND)))
    print(f"Llama-like: {args.layers} layers, hidden 256, vocabulary {VOCAB_SIZE}, batch "
          f"{BATCH_SIZE}; "
          f"budget {format_bytes(budget)}"
          + (f"; rungs not installed: {missing}" if missing else ""))

    summary: dict[str, Any] = {}
    if not args.second_only:
        summary = first_part(args, dry, budget, base, max_len, multiple_of, every)
    summary.update(second_part(args, dry, second, multiple_of, every))
    summary["total_s"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(summary))
    return summary


def first_part(args: argparse.Namespace, dry: "DryPeaks", budget: int, base: int, max_len: int,
               multiple_of: int, every: tuple) -> dict[str, Any]:
    """(a)-(d): the longest length of each way under ``budget``, each checked by a measured step."""
    rows: dict[str, dict[str, Any]] = {}
    for label, setting in (("none", ()), ("old_rungs", known(OLD_RUNGS)),
                           ("all_by_hand", known(ALL_BY_HAND))):
        L = dry.longest(setting, budget, multiple_of, max_len)
        rows[label] = {"setting": setting, "longest": L}
    cb = auto_run(args.layers, budget, max(multiple_of, base // 2), rows["all_by_hand"]["longest"],
                  multiple_of, every)
    ran = [r for r in cb.records if r.peak_bytes <= budget]
    longest_auto = max((r.seq_len for r in ran), default=0)
    over = sum(r.peak_bytes > budget for r in cb.records)
    auto_setting = next((r.mitigations for r in cb.records if r.seq_len == longest_auto), ())
    rows["auto"] = {"setting": tuple(auto_setting), "longest": longest_auto,
                    "steps_over_budget": over}

    print(f"\n{'setting':<12}{'longest L':>10}{'measured @L':>13}{'check':>7}{'s/Ktok':>9}  rungs")
    for label in ("none", "old_rungs", "auto", "all_by_hand"):
        row = rows[label]
        L, setting = row["longest"], row["setting"]
        row["measured_bytes"] = measured_peak(args.layers, setting, L) if L else 0
        row["seconds_per_ktoken"] = step_seconds(args.layers, setting,
                                                 L) / (BATCH_SIZE * L) * 1000 if L else float("nan")
        print(f"{label:<12}{L:>10}{format_bytes(row['measured_bytes']):>13}"
              f"{'ok' if row['measured_bytes'] <= budget else 'OVER':>7}"
              f"{row['seconds_per_ktoken']:>9.3f}  "
              f"{' + '.join(setting) or '-'}")
    headline = rows["auto"]["longest"] / max(rows["none"]["longest"], 1)
    reach = rows["auto"]["longest"] / max(rows["all_by_hand"]["longest"], 1)
    print(f"\nheadline: auto reaches {headline:.1f}x the plain model's length, {100 * reach:.0f}% "
          "of everything by hand"
          f"; steps over the budget in the auto run: {over}")

    return {"longest_length": {k: rows[k]["longest"]
                               for k in ("none", "old_rungs", "auto", "all_by_hand")},
            "headline_auto_vs_none": headline, "auto_reach_of_all_by_hand": reach,
            "steps_over_budget": over, "budget_bytes": budget,
            "auto_setting": list(rows["auto"]["setting"])}


def second_part(args: argparse.Namespace, dry: "DryPeaks", second: int, multiple_of: int,
                every: tuple) -> dict[str, Any]:
    """A budget where full checkpointing is not needed: the callback's choice against every fitting
    setting timed (exhaustive search) and against SDPA + full checkpointing."""
    t0 = time.perf_counter()
    plain, full = dry.peak(second, ()), dry.peak(second, known(FULL_CHECKPOINTING))
    budget2 = (plain + full) // 2
    fitting = [s for s in settings_over(every, args.layers) if dry.peak(second, s) <= budget2]
    if args.quick:
        # the lightest-touch ones
        fitting = sorted(fitting, key=lambda s: dry.peak(second, s), reverse=True)[:8]
    cb2 = auto_run(args.layers, budget2, second, second, multiple_of, every, curriculum=False)
    chosen = tuple(cb2.records[-1].mitigations) if cb2.records else ()
    full_setting = known(FULL_CHECKPOINTING)
    times = interleaved_seconds(args.layers, list(dict.fromkeys(fitting + [chosen, full_setting])),
                                second, args.rounds)
    # every setting timed fits: the search's, the choice, full checkpointing
    fastest = min(times, key=times.__getitem__)
    vs_fastest = times[chosen] / times[fastest]
    vs_full = times[chosen] / times[full_setting]
    print(f"\nsecond part: {second} tokens, budget {format_bytes(budget2)} (plain "
          f"{format_bytes(plain)}, "
          f"SDPA + full checkpointing {format_bytes(full)}); "
          f"{len(fitting)} fitting settings timed, "
          f"best of {args.rounds} round-robin passes")
    for s in sorted(times, key=times.__getitem__):
        mark = " <- auto" if s == chosen else (" <- fastest" if s == fastest else "")
        print(f"  {times[s]:8.3f} s  {format_bytes(dry.peak(second, s)):>10}  "
              f"{' + '.join(s) or 'none'}{mark}")
    print(f"auto / fastest {vs_fastest:.3f}, auto / full checkpointing {vs_full:.3f}; "
          f"{time.perf_counter() - t0:.0f} s")
    return {"step_time_ratio_auto_vs_fastest": vs_fastest,
            "step_time_ratio_auto_vs_full_checkpointing": vs_full,
            "second_part_auto_setting": list(chosen), "second_part_budget_bytes": budget2,
            "second_part_seconds": {" + ".join(s) or "none": t for s, t in times.items()}}


if __name__ == "__main__":
    main()
