"""The ``seqmem`` command.

* ``seqmem demo``: train the reference GPT on random tokens with a growing sequence length under
  :class:`~lightning_seqmem.SeqMemCallback`, log to TensorBoard, write and print the report.
* ``seqmem report PATH``: print a saved report (``seqmem_report.json`` or its directory).
* ``seqmem forecast --config CONFIG.yaml --lengths 1024 2048 4096``: build the model and data of a
  LightningCLI config, trace a few short training steps on a copy of the model (nothing is
  trained), and print the predicted peak at each length and the largest length that fits; then
  (``--no-breakdown`` to skip) where the memory goes: by kind and by module at the traced
  lengths and extrapolated to the longest asked, the attention share, the crossover length and
  any diagnosis (:mod:`lightning_seqmem.breakdown`).

Run ``seqmem COMMAND --help`` for the options.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["main"]

_DEFAULT_MODEL = "lightning_seqmem.demo.LitGPT"
_DEFAULT_DATA = "lightning_seqmem.demo.SyntheticTokenDataModule"


def _quiet() -> None:
    """Silence warnings that say nothing to a user of the command (they stay visible elsewhere)."""
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*`self.log\\(\\)` but the `self.trainer` reference.*")
    warnings.filterwarnings("ignore", category=DeprecationWarning)


# ----------------------------------------------------------------------------------------------
# seqmem demo
# ----------------------------------------------------------------------------------------------
def _demo(args: argparse.Namespace) -> int:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger
    from rich.console import Console

    from . import Curriculum, SeqMemCallback
    from .demo import LitGPT, SyntheticTokenDataModule
    from .report import load_report, render_console

    _quiet()
    console = Console(width=None if sys.stdout.isatty() else 120)
    pl.seed_everything(args.seed, verbose=False)
    curriculum = Curriculum(start=args.start, target=args.target, steps_per_stage=args.steps_per_stage)
    callback = SeqMemCallback(memory_budget=args.budget, curriculum=curriculum, mitigations=tuple(args.mitigations))
    # every stage, plus room for each mitigation's re-measurement (3 lengths x 2 steps)
    max_steps = args.max_steps or curriculum.num_stages * curriculum.steps_per_stage + 6 * len(args.mitigations)
    logger = TensorBoardLogger(save_dir=args.out, name="demo")
    model = LitGPT(n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head, attention=args.attention)
    datamodule = SyntheticTokenDataModule(
        batch_size=args.batch_size, seq_len=curriculum.stages[-1], num_samples=max_steps * args.batch_size
    )
    trainer = pl.Trainer(
        max_steps=max_steps,
        accelerator=args.accelerator,
        devices=1,
        logger=logger,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    console.print(
        f"[bold]seqmem demo[/bold]: {args.n_layer}-layer GPT (d={args.d_model}, {args.attention} attention), "
        f"batch {args.batch_size}, curriculum {' → '.join(map(str, curriculum.stages))} "
        f"({curriculum.steps_per_stage} steps each), {max_steps} steps, budget {args.budget or 'none'}"
    )
    trainer.fit(model, datamodule=datamodule)  # the callback writes the panels, figure and report
    paths = callback.write_report(trainer)  # again, to get the paths (same content)
    assert paths is not None  # a single process is rank zero
    render_console(load_report(paths[0]), console)
    console.print(f"TensorBoard logs: {logger.log_dir}   (view: [bold]tensorboard --logdir {args.out}[/bold], "
                  "tabs SCALARS, CUSTOM SCALARS and IMAGES)")
    console.print(f"Report: {paths[0]}\n        {paths[1]}\n        {paths[2]}")
    return 0


def _panels(args: argparse.Namespace) -> int:
    from .panels import render_panels

    render_panels(args.log_dir, args.out)
    print(f"panels of {args.log_dir} written to {args.out}")
    return 0


# ----------------------------------------------------------------------------------------------
# seqmem report
# ----------------------------------------------------------------------------------------------
def _report(args: argparse.Namespace) -> int:
    from .report import load_report, render_console, render_markdown

    report = load_report(args.path)
    if args.markdown:
        sys.stdout.write(render_markdown(report))
    else:
        render_console(report)
    return 0


# ----------------------------------------------------------------------------------------------
# seqmem forecast
# ----------------------------------------------------------------------------------------------
def _read_yaml(path: str) -> dict[str, Any]:
    import yaml

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"seqmem forecast: {path} is not a LightningCLI config (a YAML mapping)")
    return data


def build_from_config(config: str, model_class: str = _DEFAULT_MODEL, data_class: str = _DEFAULT_DATA,
                      overrides: Sequence[str] = ()) -> Any:
    """A ``LightningCLI`` (not run) of ``config``: ``.model``, ``.datamodule`` and ``.trainer``.

    The config's ``model``/``data`` sections may name their class (``class_path``); without one
    they configure ``model_class`` / ``data_class``. The trainer is forced to one device without a
    logger (a forecast is per device); a CUDA config is built on the CPU when no GPU is present.
    """
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.cli import LightningCLI

    trainer_cfg = _read_yaml(config).get("trainer") or {}
    forced = ["--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.devices=1",
              "--trainer.num_nodes=1", "--trainer.strategy=auto"]
    if str(trainer_cfg.get("accelerator", "auto")) in ("cuda", "gpu") and not torch.cuda.is_available():
        print("seqmem forecast: the config asks for CUDA but none is available: tracing on the CPU "
              "(kernel choice, workspace and fragmentation on a GPU differ)", file=sys.stderr)
        forced.append("--trainer.accelerator=cpu")
    args = ["--model", model_class, "--data", data_class, "--config", config, *forced, *overrides]
    argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when both `args` and sys.argv are given
    try:
        return LightningCLI(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True,
                            subclass_mode_data=True, run=False, args=args, save_config_callback=None)
    finally:
        sys.argv = argv


def _first_optimizer(module: Any) -> tuple[Any, str]:
    import torch

    try:
        conf = module.configure_optimizers()
    except Exception as exc:  # noqa: BLE001 - e.g. a schedule that reads self.trainer
        return torch.optim.AdamW(module.parameters()), f"configure_optimizers() failed ({exc!r}); traced with AdamW"
    while isinstance(conf, (list, tuple)) and conf:
        conf = conf[0]
    if isinstance(conf, dict):
        conf = conf.get("optimizer")
    if isinstance(conf, torch.optim.Optimizer):
        return conf, type(conf).__name__
    return torch.optim.AdamW(module.parameters()), "configure_optimizers() returned no optimizer; traced with AdamW"


def _loss_of(output: Any) -> Any:
    if isinstance(output, dict):
        output = output.get("loss")
    if output is None:
        raise SystemExit("seqmem forecast: training_step returned no loss (manual optimisation is not supported)")
    return output


def _default_trace_lengths(lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """Three short lengths to trace and one to check: 64/128/256 (+512) below lengths ≥ 512."""
    shortest = min(lengths)
    base = 256 if shortest >= 512 else max(8, shortest // 2 // 8 * 8)
    trace = sorted({max(1, base // 4), max(2, base // 2), base})
    check = [2 * base] if 2 * base <= max(lengths) else []
    return trace, check


def _forecast(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from . import SeqMemCallback
    from .batch import infer_batch_shape
    from .offline import trace_training_steps
    from .units import format_bytes, parse_bytes

    _quiet()
    console = Console(width=None if sys.stdout.isatty() else 120)
    lengths = sorted(set(args.lengths))
    if min(lengths) < 1:
        raise SystemExit(f"seqmem forecast: --lengths must be positive, got {args.lengths}")
    trace, check = (sorted(set(args.trace_lengths)), []) if args.trace_lengths else _default_trace_lengths(lengths)
    if len(trace) < 2:
        raise SystemExit(f"seqmem forecast: --trace-lengths needs 2 or more distinct lengths, got {args.trace_lengths}")
    if args.no_check:
        check = []

    cli = build_from_config(args.config, args.model_class, args.data_class)
    trainer, model, datamodule = cli.trainer, cli.model, cli.datamodule
    if not model.automatic_optimization:
        raise SystemExit("seqmem forecast: the model uses manual optimisation; trace it with lightning_seqmem.offline")
    seqmem = next((c for c in trainer.callbacks if isinstance(c, SeqMemCallback)), None)
    device = trainer.strategy.root_device
    budget = parse_bytes(args.budget, "--budget") if args.budget else None
    if budget is None and seqmem is not None:
        budget = seqmem.memory_budget_bytes
    if budget is None and device.type == "cuda":
        budget = torch.cuda.get_device_properties(device).total_memory
    margin = args.safety_margin if args.safety_margin is not None else (seqmem.safety_margin if seqmem else 0.1)
    usable = None if budget is None else int(budget * (1 - margin))

    needed = max(trace + check)
    if datamodule is not None and callable(getattr(datamodule, "set_seq_len", None)):
        datamodule.set_seq_len(needed)
    source = datamodule if datamodule is not None else model
    if datamodule is not None:
        datamodule.prepare_data()
        datamodule.setup("fit")
    batch = next(iter(source.train_dataloader()))
    traced_batch, source_len = infer_batch_shape(batch)
    batch_size = args.batch_size or traced_batch

    work = copy.deepcopy(model)  # the steps below train the copy; the configured model is untouched
    precision = trainer.precision_plugin
    work = precision.convert_module(work).to(device)
    optimizer, optimizer_name = _first_optimizer(work)
    console.print(f"[bold]seqmem forecast[/bold]: {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} "
                  f"parameters), {trainer.precision} precision, on {device}, optimizer {optimizer_name}; tracing "
                  f"{len(trace)} steps at seq_len {trace} (batch {traced_batch})"
                  + (f", checking at {check}" if check else ""))
    with console.status(f"tracing training steps at seq_len {trace}..."):
        forecaster = trace_training_steps(
            work, optimizer, batch, trace, lambda m, b: _loss_of(m.training_step(b, 0)), device=device,
            context=precision.train_step_context, check_seq_lens=[L for L in check if L <= source_len],
        )
    del work, optimizer
    reserved = device.type == "cuda"

    table = Table(title=f"seqmem forecast (batch {batch_size}); fits = upper bound within the usable budget "
                        f"{format_bytes(usable)}", title_justify="left")
    for header in ("seq_len", "method", "peak", "upper bound", "fits"):
        table.add_column(header, justify="left" if header == "method" else "right")
    rows = []
    for L in lengths:
        fc = forecaster.forecast(L, batch_size)
        bound = fc.reserved_upper_bytes if reserved else fc.upper_bytes
        fits = None if usable is None else bound <= usable
        rows.append({"seq_len": L, "batch_size": batch_size, "method": fc.method, "peak_bytes": fc.peak_bytes,
                     "upper_bytes": bound, "fits": fits})
        table.add_row(str(L), fc.method, format_bytes(fc.peak_bytes), format_bytes(bound),
                      "-" if fits is None else ("yes" if fits else "NO"), style=None if fits is not False else "red")
    console.print(table)
    for v in forecaster.verifications:
        console.print(f"check at seq_len {v.seq_len}: forecast {format_bytes(v.forecast_bytes)} ({v.method}), "
                      f"measured {format_bytes(v.measured_bytes)}, error {v.relative_error:+.1%}")
    max_len = None
    if usable is not None:
        max_len = forecaster.max_seq_len(usable, batch_size, reserved=reserved)
        console.print(f"largest length that fits {format_bytes(usable)} (budget {format_bytes(budget)} minus "
                      f"safety margin {margin:.0%}) at batch {batch_size}: [bold]{max_len}[/bold] tokens")
    else:
        console.print("no budget (pass --budget, or memory_budget in the config's SeqMemCallback)")
    section = None
    if args.breakdown:
        section = _forecast_breakdown(model, precision, device, batch, trace, max(lengths), forecaster, console)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "config": os.fspath(args.config), "device": str(device), "precision": str(trainer.precision),
            "trace_lengths": trace, "budget_bytes": budget, "usable_budget_bytes": usable,
            "forecasts": rows, "max_seq_len": max_len,
            "verifications": [{**vars(v), "relative_error": v.relative_error} for v in forecaster.verifications],
            "breakdown": section,
        }, indent=2) + "\n", encoding="utf-8")
    return 0


def _forecast_breakdown(model: Any, precision: Any, device: Any, batch: Any, trace: Sequence[int], longest: int,
                        forecaster: Any, console: Any) -> dict[str, Any]:
    """Breakdowns at the traced lengths (made safe: none equal to a model width) on a fresh copy, printed."""
    from .batch import infer_batch_shape
    from .breakdown_steps import breakdown_section, safe_seq_lens, trace_breakdowns, training_step_loss, width_dims
    from .report import render_breakdown_console

    work = precision.convert_module(copy.deepcopy(model)).to(device)
    optimizer, _ = _first_optimizer(work)
    batch_size, source_len = infer_batch_shape(batch)
    lengths, notes = safe_seq_lens(trace, width_dims(work, batch_size), source_len, num=3)
    if len(lengths) < 2:
        raise SystemExit(f"seqmem forecast: no two lengths to trace the breakdown at (from {list(trace)})")
    console.print(f"[bold]where the memory goes[/bold]: tracing one step at seq_len {lengths} (batch {batch_size}) "
                  "on a fresh copy of the model")
    with console.status(f"tracing the breakdown at seq_len {lengths}..."):
        breakdowns = trace_breakdowns(work, optimizer, batch, lengths, training_step_loss, device=device,
                                      context=precision.train_step_context)
    forecast_peak = forecaster.forecast(longest, batch_size).peak_bytes if longest > lengths[-1] else None
    section = breakdown_section(breakdowns, work, extrapolate_to=longest, forecast_peak_bytes=forecast_peak, notes=notes)
    del work, optimizer, breakdowns
    render_breakdown_console(section, console)
    return section


# ----------------------------------------------------------------------------------------------
# Parser
# ----------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="seqmem",
        description="Measure, predict and tame the memory of long-sequence transformer training.",
        epilog="seqmem demo: train a small GPT and report its memory; seqmem report PATH: print a saved "
        "report; seqmem forecast --config CONFIG.yaml --lengths ...: predict peaks without training.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="train a small GPT with a sequence-length curriculum and report its memory",
                          description="Train the reference GPT on random tokens (CPU by default) with a growing "
                          "sequence length under SeqMemCallback; log to TensorBoard and write the report.")
    demo.add_argument("--max-steps", type=int, default=None,
                      help="training steps (default: stages × steps-per-stage + 6 per mitigation, 48 with the defaults)")
    demo.add_argument("--out", default="seqmem_runs", help="TensorBoard save_dir; the report goes in the run's log_dir")
    demo.add_argument("--budget", default="200MiB",
                      help="memory budget, e.g. 1GiB or 900MB (default 200MiB: eager attention at 1024 tokens "
                      "would not fit, so the callback switches on SDPA before that stage)")
    demo.add_argument("--mitigations", nargs="*", default=["attention", "checkpointing", "microbatch"],
                      help="the ladder, in order (none: warn and cap the curriculum instead)")
    demo.add_argument("--attention", choices=("eager", "sdpa"), default="eager",
                      help="eager materialises the L×L scores (quadratic memory); sdpa does not on CPU")
    demo.add_argument("--start", type=int, default=64, help="first sequence length (tokens)")
    demo.add_argument("--target", type=int, default=1024, help="last sequence length (tokens)")
    demo.add_argument("--steps-per-stage", type=int, default=6, help="steps at each length")
    demo.add_argument("--batch-size", type=int, default=4, help="samples per batch")
    demo.add_argument("--n-layer", type=int, default=2, help="transformer blocks")
    demo.add_argument("--d-model", type=int, default=128, help="model width")
    demo.add_argument("--n-head", type=int, default=4, help="attention heads")
    demo.add_argument("--accelerator", default="cpu", help="Lightning accelerator (cpu, cuda, auto)")
    demo.add_argument("--seed", type=int, default=0, help="random seed")
    demo.set_defaults(func=_demo)

    panels = sub.add_parser("panels", help="draw a run's TensorBoard panels to a PNG",
                            description="Read a run's event files and draw the seqmem custom-scalars panels to a PNG.")
    panels.add_argument("log_dir", help="the run's log directory (holding events.out.tfevents.*)")
    panels.add_argument("--out", default="seqmem_panels.png", help="PNG to write")
    panels.set_defaults(func=_panels)

    report = sub.add_parser("report", help="print a saved report", description="Print a saved seqmem report.")
    report.add_argument("path", help="seqmem_report.json, or the directory holding it")
    report.add_argument("--markdown", action="store_true", help="print the Markdown summary instead of tables")
    report.set_defaults(func=_report)

    forecast = sub.add_parser("forecast", help="predict peak memory at given lengths from a LightningCLI config, without training",
                              description="Build the model and data of a LightningCLI config, trace a few short "
                              "training steps on a copy of the model (nothing is trained), and print the forecast "
                              "peak at each length, the largest length that fits the budget, and where the memory "
                              "goes (by kind and module, attention share, crossover length, diagnoses).")
    forecast.add_argument("--config", required=True, help="LightningCLI YAML (model, data, trainer sections)")
    forecast.add_argument("--lengths", type=int, nargs="+", required=True, help="sequence lengths to forecast (tokens)")
    forecast.add_argument("--budget", default=None,
                          help="memory budget, e.g. 12GiB (default: the config's SeqMemCallback memory_budget, "
                          "else the GPU's total memory)")
    forecast.add_argument("--safety-margin", type=float, default=None,
                          help="fraction of the budget kept free (default: the config's SeqMemCallback, else 0.1)")
    forecast.add_argument("--batch-size", type=int, default=None, help="batch size to forecast at (default: the data's)")
    forecast.add_argument("--trace-lengths", type=int, nargs="+", default=None,
                          help="short lengths to trace (default 64 128 256, then a check at 512)")
    forecast.add_argument("--no-check", action="store_true", help="skip the check step at a longer length")
    forecast.add_argument("--model-class", default=_DEFAULT_MODEL, help="model class when the config names none")
    forecast.add_argument("--data-class", default=_DEFAULT_DATA, help="datamodule class when the config names none")
    forecast.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=True,
                          help="after the forecast, trace one step per traced length on a fresh copy and show where "
                          "the memory goes: by kind and module, extrapolated to the longest length asked, the "
                          "attention share, the crossover length and diagnoses (default on; --no-breakdown skips it)")
    forecast.add_argument("--json", default=None, help="also write the forecasts (and the breakdown) to this JSON file")
    forecast.set_defaults(func=_forecast)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``seqmem`` console script."""
    args = _parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
