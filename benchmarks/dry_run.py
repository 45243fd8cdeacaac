"""How close is a dry run to a real training step, and what does it cost? (CPU)

Accuracy: for each case (the reference GPT with eager / SDPA attention, activation checkpointing
off / on, fp32 / bf16 autocast; Hugging Face Llama and a Mistral with a sliding window, SDPA),
:func:`~lightning_seqmem.dryrun.step.dry_run_step` forecasts one training step at each length from a
batch of ``L0`` tokens, and a real step is measured at that length on a separate copy of the
module: AdamW, one warm-up step, then the measured step under the CPU
:class:`~lightning_seqmem.measure.probes.TrackerProbe` (exact live tensor bytes; parameters,
gradients, optimizer state and the batch counted). Error is ``(dry - measured) / measured``;
negative is an under-prediction (an OOM risk). Target: within 1% everywhere.

Cost: the dry run alone at 1k, 8k and 32k tokens (real steps there would be too slow, or too big:
eager attention at 32k tokens needs hundreds of GiB). Each row runs in a fresh process after
imports, model construction and one warm-up dry run at 64 tokens: ``peak RSS +MiB`` is the
process's resident high-water mark during the call (``VmHWM`` of ``/proc/self/status``, reset to
the current RSS through ``/proc/self/clear_refs`` just before it) minus its RSS just before it.
(``resource.getrusage().ru_maxrss`` is not used: Linux carries it over ``exec`` from the forking
parent.) ``seconds`` is the measured call's own time.

    python benchmarks/dry_run.py            # L0=32, real steps up to 2048 tokens, 3 cost models
    python benchmarks/dry_run.py --quick    # small models, real steps at 16·L0 = 256 tokens,
                                            # 1 cost model
    python benchmarks/dry_run.py --json     # the figures as one JSON dict instead of tables
    python benchmarks/dry_run.py --device cuda --quick   # on a GPU: the dry run against the CUDA
                                            # allocator's counters (max_memory_allocated per phase)
    python benchmarks/dry_run.py --device cuda --quick --from-cpu   # the same, the dry run made
                                            # from a CPU copy (what seqmem plan does on a laptop)

On CUDA the measured step is read by the CUDA allocator probe (``torch.cuda.max_memory_allocated``
reset at each phase boundary, 512-byte blocks), the dry run simulates ``cuda`` with the same
rounding, and bf16 cases run under ``torch.autocast("cuda", dtype=torch.bfloat16)``. The cost rows
stay on the CPU (a dry run allocates no device memory).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

import lightning.pytorch as pl
from lightning_seqmem.reference.demo import LitGPT
from lightning_seqmem.dryrun.result import DryRunUnsupported
from lightning_seqmem.dryrun.step import dry_run_step
from lightning_seqmem.mitigations.checkpointing.checkpointing import ActivationCheckpointing
from lightning_seqmem.measure.steps import training_step_memory
from lightning_seqmem.measure.probes import make_probe

VOCAB_SIZE = 256  # token ids
TOLERANCE = 0.01  # target |error| of a dry run against the measured step
COST_LENGTHS = (1024, 8192, 32768)  # tokens per sample of the dry-run-only rows
MIB = 2**20
CPU = torch.device("cpu")
DEVICE = CPU  # where the measured steps run (--device)
FROM_CPU = False  # --from-cpu: the dry run gets a CPU module and optimizer, simulating DEVICE


class HFLM(pl.LightningModule):
    """A randomly initialised Hugging Face causal LM (nothing downloaded), next-token cross
    entropy."""

    def __init__(self, model_type: str, attn_implementation: str, **config: Any) -> None:
        super().__init__()
        import transformers

        fields = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      vocab_size=VOCAB_SIZE)
        hf_config = transformers.AutoConfig.for_model(model_type, **{**fields, **config})
        self.model = transformers.AutoModelForCausalLM.from_config(
            hf_config, attn_implementation=attn_implementation)

    def training_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch["input_ids"], use_cache=False,
                            attention_mask=batch.get("attention_mask")).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())


@dataclass(frozen=True)
class Case:
    name: str  # model, e.g. "gpt-2L-d128" or "mistral-sw256"
    attention: str  # "eager" or "sdpa"
    checkpointing: bool
    bf16: bool  # forward under torch.autocast("cpu", dtype=torch.bfloat16)
    build: Callable[[], torch.nn.Module]
    batch_size: int


def _gpt(d_model: int, attention: str) -> Callable[[], torch.nn.Module]:
    return lambda: LitGPT(n_layer=2, d_model=d_model, n_head=4, attention=attention,
                          vocab_size=VOCAB_SIZE)


def _hf(model_type: str, attention: str, hidden: int,
        **config: Any) -> Callable[[], torch.nn.Module]:
    return lambda: HFLM(model_type, attention, hidden_size=hidden, intermediate_size=2 * hidden,
                        **config)


def accuracy_cases(quick: bool) -> tuple[list[Case], tuple[int, ...], tuple[int, ...], int]:
    """(cases, GPT lengths, HF lengths, L0)."""
    d_model, hidden, window = (64, 64, 32) if quick else (128, 128, 256)
    gpt = f"gpt-2L-d{d_model}"
    cases = [
        Case(gpt, attention, ckpt, bf16, _gpt(d_model, attention), 4 if not quick else 2)
        for bf16 in (False, True)
        for attention in ("eager", "sdpa")
        for ckpt in (False, True)
    ]
    cases += [
        Case(f"llama-d{hidden}", "sdpa", False, False, _hf("llama", "sdpa", hidden), 2),
        Case(f"mistral-sw{window}", "sdpa", False, False,
             _hf("mistral", "sdpa", hidden, sliding_window=window), 2),
    ]
    if quick:
        return cases, (256,), (16, 256), 16
    cases += [
        Case(f"mistral-sw{window}", "sdpa", False, True,
             _hf("mistral", "sdpa", hidden, sliding_window=window), 2),
        Case(f"mistral-sw{window}", "eager", False, False,
             _hf("mistral", "eager", hidden, sliding_window=window), 2),
    ]
    return cases, (128, 512, 2048), (128, 512, 2048), 32


def _batch(batch_size: int, seq_len: int, seed: int = 0, device: torch.device = CPU) -> dict:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB_SIZE, (batch_size, seq_len + 1), generator=g)
    return {"input_ids": tokens[:, :-1].clone().to(device),
            "labels": tokens[:, 1:].clone().to(device)}


def _loss(model, batch):
    return model.training_step(batch, 0)


def _autocast(bf16: bool) -> Optional[Callable]:
    return (lambda: torch.autocast(DEVICE.type, dtype=torch.bfloat16)) if bf16 else None


def measure_real(module: torch.nn.Module, case: Case, seq_len: int) -> int:
    """Peak bytes of a real step (warm-up step first) on a copy of ``module`` with the case's
    settings."""
    real = copy.deepcopy(module).to(DEVICE)
    if case.checkpointing:
        ActivationCheckpointing().apply(real)
    optimizer = torch.optim.AdamW(real.parameters(), lr=1e-4)
    batch = _batch(case.batch_size, seq_len, seed=1, device=DEVICE)
    training_step_memory(real, optimizer, batch, _loss, context=_autocast(case.bf16))
    probe = make_probe("cuda" if DEVICE.type == "cuda" else "tracker", DEVICE)
    m = training_step_memory(real, optimizer, batch, _loss, probe, context=_autocast(case.bf16))
    del real, optimizer, batch
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    return m.peak_bytes


def accuracy(quick: bool, show: bool) -> list[dict]:
    cases, gpt_lengths, hf_lengths, l0 = accuracy_cases(quick)
    rows = []
    if show:
        print(f"accuracy: dry run from a batch of L0={l0} tokens vs a real measured step (AdamW, "
              "warm-up step first)")
        probe = ("CUDA allocator counters" if DEVICE.type == "cuda"
                 else "CPU TrackerProbe, exact live bytes")
        print(f"error = (dry - measured) / measured step peak ({probe}, on {DEVICE})")
        header = (f"{'model':<16} {'attention':<9} {'ckpt':<4} {'precision':<9} {'seq_len':>7} "
                  f"{'measured MiB':>12} {'dry MiB':>10} {'error':>8} {'dry s':>6}")
        print(header)
        print("-" * len(header))
    for case in cases:
        torch.manual_seed(0)
        home = CPU if FROM_CPU else DEVICE  # where the dry run's module and optimizer live
        module = case.build().to(home)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        mitigations = ["checkpointing"] if case.checkpointing else []
        for seq_len in gpt_lengths if case.name.startswith("gpt") else hf_lengths:
            try:
                dry = dry_run_step(module, optimizer, _batch(case.batch_size, l0, device=home),
                                   seq_len, mitigations=mitigations,
                                   autocast=_autocast(case.bf16), device=DEVICE)  # fmt: skip
            except DryRunUnsupported as err:
                print(f"  {case.name} {seq_len}: {err}")
                continue
            module.to(CPU)  # only the measured copy on the device: its peak is the step's alone
            measured = measure_real(module, case, seq_len)
            module.to(home)
            error = (dry.peak_bytes - measured) / measured
            row = dict(model=case.name, attention=case.attention, checkpointing=case.checkpointing,
                       precision="bf16" if case.bf16 else "fp32", seq_len=seq_len,
                       batch_size=case.batch_size,
                       measured_bytes=measured, dry_bytes=dry.peak_bytes, relative_error=error,
                       dry_seconds=dry.seconds)  # fmt: skip
            rows.append(row)
            if show:
                print(
                    f"{case.name:<16} {case.attention:<9} "
                    f"{'on' if case.checkpointing else 'off':<4} {row['precision']:<9} "
                    f"{seq_len:>7} {measured / MIB:12.2f} {dry.peak_bytes / MIB:10.2f} "
                    f"{error:+8.2%} {dry.seconds:6.2f}"
                )
    if show:
        print("-" * len(header))
        worst = max(abs(r["relative_error"]) for r in rows)
        verdict = "PASS" if worst <= TOLERANCE else "FAIL"
        print(f"SUMMARY worst |error| = {worst:.2%} over {len(rows)} steps: {verdict} (target <= "
              f"{TOLERANCE:.0%})")
    return rows


# -- cost: one fresh process per row ---------------------------------------------------------------
COST_MODELS = {
    "gpt-2L-d128 eager": lambda: _gpt(128, "eager")(),
    "gpt-2L-d128 sdpa": lambda: _gpt(128, "sdpa")(),
    "mistral-sw256 sdpa": lambda: _hf("mistral", "sdpa", 128, sliding_window=256)(),
}
COST_BATCH_SIZE = 4


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` figure in KiB (``VmRSS``: resident now; ``VmHWM``: its high-water
    mark)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cost_worker(model: str, seq_len: int) -> dict:
    """Run in a fresh process: one warm-up dry run at 64 tokens, then the measured one.

    Peak memory: the rise of the process's resident high-water mark (``VmHWM``, reset to the
    current RSS just before the call) over its RSS just before the call. ``ru_maxrss`` is not used:
    Linux carries it over ``exec`` from the forking parent, whose RSS it would report.
    """
    warnings.filterwarnings("ignore")
    module = COST_MODELS[model]()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    batch = _batch(COST_BATCH_SIZE, 32)
    dry_run_step(module, optimizer, batch, 64)
    rss_before = _status_kib("VmRSS")
    reset = _reset_peak_rss()
    hwm_before = _status_kib("VmHWM")
    result = dry_run_step(module, optimizer, batch, seq_len)
    peak = _status_kib("VmHWM") - (rss_before if reset else hwm_before)
    return dict(model=model, seq_len=seq_len, batch_size=COST_BATCH_SIZE,
                predicted_bytes=result.peak_bytes,
                seconds=result.seconds, peak_rss_increase_bytes=max(peak, 0) * 1024,
                rss_before_bytes=rss_before * 1024, peak_reset=reset)  # fmt: skip


def cost(quick: bool, show: bool) -> list[dict]:
    models = ["gpt-2L-d128 eager"] if quick else list(COST_MODELS)
    rows = []
    if show:
        print()
        print(f"cost of a dry run alone (batch {COST_BATCH_SIZE}; a fresh process per row, after "
              "imports, the model and a")
        print("warm-up dry run at 64 tokens; peak RSS +MiB = the call's resident high-water mark "
              "(VmHWM, reset by")
        print("/proc/self/clear_refs before it) minus the process's RSS just before it, "
              "'process RSS MiB')")
        header = (f"{'model':<20} {'seq_len':>7} {'predicted peak GiB':>18} {'seconds':>8} "
                  f"{'peak RSS +MiB':>13} {'process RSS MiB':>15}")
        print(header)
        print("-" * len(header))
    for model in models:
        for seq_len in COST_LENGTHS:
            proc = subprocess.run(
                [sys.executable, __file__, "--cost-worker", model, str(seq_len)],
                capture_output=True, text=True, check=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )  # fmt: skip
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append(row)
            if show:
                print(
                    f"{model:<20} {seq_len:>7} {row['predicted_bytes'] / 2**30:18.2f} "
                    f"{row['seconds']:8.2f} "
                    f"{row['peak_rss_increase_bytes'] / MIB:13.1f} "
                    f"{row['rss_before_bytes'] / MIB:15.0f}"
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="small models, real steps up to 256 tokens, one cost model")
    parser.add_argument("--json", action="store_true",
                        help="print the figures as one JSON dict instead of tables")
    parser.add_argument("--device", default="cpu",
                        help="where the measured steps run: cpu (default) or cuda")
    parser.add_argument("--from-cpu", action="store_true",
                        help="with --device cuda: dry-run a CPU module and optimizer onto the "
                        "device (as seqmem plan plans a GPU run from a laptop: AdamW's foreach "
                        "step resolved for CUDA, not for the CPU tensors it copies)")
    parser.add_argument("--cost-worker", nargs=2, metavar=("MODEL", "SEQ_LEN"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.cost_worker:
        print(json.dumps(cost_worker(args.cost_worker[0], int(args.cost_worker[1]))))
        return 0
    global DEVICE, FROM_CPU
    DEVICE, FROM_CPU = torch.device(args.device), args.from_cpu
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: dry_run --device cuda skipped")
        return 0
    start = time.perf_counter()
    show = not args.json
    if show:
        where = (torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda"
                 else f"{torch.get_num_threads()} threads")
        print(f"dry_run: torch {torch.__version__}, {where}{' (quick)' if args.quick else ''}")
    figures = {"accuracy": accuracy(args.quick, show)}
    figures["cost"] = cost(args.quick, show) if DEVICE.type == "cpu" else []  # a CPU figure
    figures["worst_relative_error"] = max(abs(r["relative_error"]) for r in figures["accuracy"])
    figures["total_seconds"] = time.perf_counter() - start
    if show:
        print(f"total runtime: {figures['total_seconds']:.1f} s")
    else:
        print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
