"""The ``seqmem`` command.

* ``seqmem demo``: train the reference GPT on random tokens with a growing sequence length under
  :class:`~lightning_seqmem.SeqMemCallback`, log to TensorBoard, write and print the report.
* ``seqmem report PATH``: print a saved report (``seqmem_report.json`` or its directory).
* ``seqmem forecast --config CONFIG.yaml --lengths 1024 2048 4096``: build the model and data of a
  LightningCLI config, trace a few short training steps on a copy of the model (nothing is
  trained), and print the predicted peak at each length and the largest length that fits; then
  (``--no-breakdown`` to skip) where the memory goes: by kind and by module at the traced
  lengths and extrapolated to the longest asked, the attention share, the crossover length and
  any diagnosis (:mod:`lightning_seqmem.diagnostics.breakdown`).
* ``seqmem plan --config CONFIG.yaml --lengths 4096 16384 65536``: dry-run one training step of the
  config's model per length and mitigation set on fake tensors (:mod:`lightning_seqmem.dryrun.step`;
  nothing is trained or allocated) and print the predicted peaks, which fit the budget, and the
  cheapest set that fits (``--json`` for a JSON document).

Run ``seqmem COMMAND --help`` for the options.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, NoReturn, Optional, Sequence

__all__ = ["main"]

_DEFAULT_MODEL = "lightning_seqmem.reference.demo.LitGPT"
_DEFAULT_DATA = "lightning_seqmem.reference.demo.SyntheticTokenDataModule"


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
    import torch

    if args.accelerator in ("cuda", "gpu") and not torch.cuda.is_available():
        raise _UserError(f"--accelerator {args.accelerator}: this machine has no CUDA device "
                         "(torch.cuda.is_available() is False); use --accelerator cpu")
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger
    from rich.console import Console

    from lightning_seqmem import Curriculum, SeqMemCallback
    from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
    from lightning_seqmem.present.report import load_report, render_console

    _quiet()
    console = Console(width=None if sys.stdout.isatty() else 120)
    pl.seed_everything(args.seed, verbose=False)
    curriculum = Curriculum(start=args.start, target=args.target, steps_per_stage=args.steps_per_stage)
    # the demo prints the whole report below, so not the callback's end-of-fit summary too
    callback = SeqMemCallback(memory_budget=args.budget, curriculum=curriculum, mitigations=tuple(args.mitigations),
                              summary=False)
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
    folder = Path(args.log_dir)
    if not folder.is_dir():
        raise _UserError(f"no such folder: {args.log_dir!r} (a run's log folder holding events.out.tfevents.* files, "
                         "e.g. seqmem_runs/demo/version_0)")
    if not any(folder.glob("events.out.tfevents.*")):
        found = sorted({str(p.parent) for p in folder.rglob("events.out.tfevents.*")})[:3]
        raise _UserError(f"{args.log_dir!r} holds no TensorBoard event files (events.out.tfevents.*)"
                         + (f"; these folders below it do: {', '.join(found)}" if found else ""))
    from lightning_seqmem.present.panels import render_panels

    render_panels(args.log_dir, args.out)
    print(f"panels of {args.log_dir} written to {args.out}")
    return 0


# ----------------------------------------------------------------------------------------------
# seqmem report
# ----------------------------------------------------------------------------------------------
def _report(args: argparse.Namespace) -> int:
    from lightning_seqmem.present.report import JSON_NAME, load_report, render_console, render_markdown

    path = Path(args.path)
    if not path.exists():
        raise _UserError(f"no such file or folder: {args.path!r} (a {JSON_NAME}, or the run folder holding it: "
                         "the logger's version_N/, e.g. seqmem_runs/demo/version_0)")
    if path.is_dir() and not (path / JSON_NAME).is_file():
        found = sorted(str(p.parent) for p in path.rglob(JSON_NAME))[:3]
        raise _UserError(f"{args.path!r} holds no {JSON_NAME} (written at the end of fit to the logger's version_N/)"
                         + (f"; these folders below it do: {', '.join(found)}" if found else ""))

    report = load_report(args.path)
    if args.markdown:
        sys.stdout.write(render_markdown(report))
    else:
        render_console(report)
    return 0


# ----------------------------------------------------------------------------------------------
# seqmem forecast
# ----------------------------------------------------------------------------------------------
def _read_yaml(path: str, command: str = "seqmem forecast") -> dict[str, Any]:
    import yaml

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"{command}: {path} is not a LightningCLI config (a YAML mapping)")
    return data


def build_from_config(config: str, model_class: str = _DEFAULT_MODEL, data_class: str = _DEFAULT_DATA,
                      overrides: Sequence[str] = (), command: str = "seqmem forecast") -> Any:
    """A ``LightningCLI`` (not run) of ``config``: ``.model``, ``.datamodule`` and ``.trainer``.

    The config's ``model``/``data`` sections may name their class (``class_path``); without one
    they configure ``model_class`` / ``data_class``. The trainer is forced to one device without a
    logger (a forecast is per device); a CUDA config is built on the CPU when no GPU is present.
    ``command`` names the command in the messages printed or raised.
    """
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.cli import LightningCLI

    trainer_cfg = _read_yaml(config, command).get("trainer") or {}
    forced = ["--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.devices=1",
              "--trainer.num_nodes=1", "--trainer.strategy=auto"]
    if str(trainer_cfg.get("accelerator", "auto")) in ("cuda", "gpu") and not torch.cuda.is_available():
        print(f"{command}: the config asks for CUDA but none is available: tracing on the CPU "
              "(kernel choice, workspace and fragmentation on a GPU differ)", file=sys.stderr)
        forced.append("--trainer.accelerator=cpu")
    args = ["--model", model_class, "--data", data_class, "--config", config, *forced, *overrides]
    argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when both `args` and sys.argv are given
    try:
        return LightningCLI(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True,
                            subclass_mode_data=True, run=False, args=args, save_config_callback=None)
    finally:
        sys.argv = argv


def _seqmem_callback(trainer: Any) -> Any:
    """The config's :class:`~lightning_seqmem.SeqMemCallback`, or None."""
    from lightning_seqmem import SeqMemCallback

    return next((c for c in trainer.callbacks if isinstance(c, SeqMemCallback)), None)


def _usable_budget(budget: Optional[int], safety_margin: Optional[float], seqmem: Any,
                   device: Any) -> tuple[Optional[int], float, Optional[int]]:
    """``(budget, margin, usable)``: ``budget`` (bytes) if given, else the config's SeqMemCallback
    ``memory_budget``, else the CUDA device's total, else None; ``margin`` likewise (default 0.1);
    ``usable = budget × (1 − margin)``."""
    import torch

    if budget is None and seqmem is not None:
        budget = seqmem.memory_budget_bytes
    if budget is None and device.type == "cuda":
        budget = torch.cuda.get_device_properties(device).total_memory
    margin = safety_margin if safety_margin is not None else (seqmem.safety_margin if seqmem else 0.1)
    return budget, margin, None if budget is None else int(budget * (1 - margin))


def _first_batch(model: Any, datamodule: Any, seq_len: Optional[int] = None) -> Any:
    """The first training batch of the config's data (its datamodule set to ``seq_len`` tokens
    first where it has ``set_seq_len``), else of the model's own ``train_dataloader``."""
    if seq_len is not None and datamodule is not None and callable(getattr(datamodule, "set_seq_len", None)):
        datamodule.set_seq_len(seq_len)
    source = datamodule if datamodule is not None else model
    if datamodule is not None:
        datamodule.prepare_data()
        datamodule.setup("fit")
    return next(iter(source.train_dataloader()))


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
    from lightning_seqmem.measure.steps import loss_of

    try:
        return loss_of(output)
    except TypeError as exc:
        raise SystemExit(f"seqmem forecast: {exc} (manual optimisation is not supported)") from None


def _default_trace_lengths(lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """Three short lengths to trace and one to check: 64/128/256 (+512) below lengths ≥ 512."""
    shortest = min(lengths)
    base = 256 if shortest >= 512 else max(8, shortest // 2 // 8 * 8)
    trace = sorted({max(1, base // 4), max(2, base // 2), base})
    check = [2 * base] if 2 * base <= max(lengths) else []
    return trace, check


def _forecast(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from lightning_seqmem.measure.batch import infer_batch_shape
    from lightning_seqmem.measure.steps import trace_training_steps
    from lightning_seqmem.core.units import format_bytes, parse_bytes

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
        raise SystemExit("seqmem forecast: the model uses manual optimisation; trace it with lightning_seqmem.measure.steps")
    seqmem = _seqmem_callback(trainer)
    device = trainer.strategy.root_device
    budget = parse_bytes(args.budget, "--budget") if args.budget else None
    budget, margin, usable = _usable_budget(budget, args.safety_margin, seqmem, device)

    batch = _first_batch(model, datamodule, max(trace + check))
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
    from lightning_seqmem.measure.batch import infer_batch_shape
    from lightning_seqmem.diagnostics.section import breakdown_section, safe_seq_lens, trace_breakdowns, training_step_loss, width_dims
    from lightning_seqmem.present.report import render_breakdown_console

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
# seqmem plan
# ----------------------------------------------------------------------------------------------
_SEARCH_MULTIPLE = 8  # "nothing fits": the largest fitting length is searched among multiples of this


class _UserError(Exception):
    """A mistake in what the user asked for: :func:`main` prints its message on one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with every usage error on one line (what is wrong and where to read more)."""

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _budget_text(text: str) -> str:
    """``--budget`` of ``seqmem demo``: checked here, handed on as written."""
    _bytes(text)
    return text


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number (≥ 1), got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1) (e.g. 0.1 keeps 10% free), got {text!r}")
    return value


def _bytes(text: str) -> int:
    from lightning_seqmem.core.units import parse_bytes

    try:
        return parse_bytes(text, "--budget")
    except ValueError as err:
        hint = ""
        number, unit = text.strip().rstrip("bB"), text.strip()[-1:].upper()
        if unit in "KMGT" and unit and text.strip()[:-1].replace(".", "", 1).isdigit():
            hint = f" (for {text!r} write {text.strip()[:-1]}{unit}iB, powers of 1024, or {text.strip()[:-1]}{unit}B, powers of 1000)"
        raise argparse.ArgumentTypeError(str(err).replace("`--budget` must", "must", 1) + hint) from None


def _config_file(text: str) -> str:
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text!r} (a LightningCLI YAML config, e.g. configs/cpu_demo.yaml)")
    return text


def _mitigation_sets(seqmem: Any, trainer: Any, model: Any, batch: Any,
                     batch_size: int) -> tuple[list[tuple[str, ...]], dict[str, str]]:
    """The mitigation sets to dry-run, cheapest first, and ``rung -> why skipped``.

    The rungs are those the config's SeqMemCallback may switch on (``mitigations``, in its order),
    or the default ladder without one; a rung that would not change this model (already on SDPA, no
    repeated blocks, batch size 1, ...) is skipped. Each set adds the next rung to the previous one.
    """
    from lightning_seqmem.core.rungs import MITIGATIONS
    from lightning_seqmem.measure.batch import infer_batch_shape
    from lightning_seqmem.mitigations.ladder import applicability

    rungs = MITIGATIONS if seqmem is None else tuple(seqmem.configured_mitigations)  # in its order
    # a rung's check may read the batch size from the batch: give it only a batch that has the rows
    # asked for (else None: it reads the unconnected trainer's loader, unknown); the size asked goes too
    rows = infer_batch_shape(batch)[0]
    checks = applicability(rungs, trainer, model, batch if rows > 1 or batch_size <= 1 else None, batch_size)
    skipped: dict[str, str] = {}
    sets: list[tuple[str, ...]] = [()]
    for name in rungs:
        applies, reason = checks[name]
        if applies:
            sets.append((*sets[-1], name))
        else:
            skipped[name] = reason
    return sets, skipped


def _step_peak(model: Any, optimizer: Any, batch: Any, seq_len: int, batch_size: int, names: tuple[str, ...],
               context: Any, device: Any, world: Optional[tuple[int, str]] = None) -> int:
    """The dry-run peak of one step; with ``world = (N, strategy)`` the per-rank peak at N ranks."""
    if world is None:
        from lightning_seqmem.dryrun.step import dry_run_step

        return dry_run_step(model, optimizer, batch, seq_len, batch_size, names, context, device).peak_bytes
    from lightning_seqmem.dryrun.sharded import sharded_dry_run_step

    return sharded_dry_run_step(model, batch, seq_len, world[0], batch_size, names, world[1], context, device).peak_bytes


def _plan_rows(model: Any, optimizer: Any, batch: Any, seq_len: int, batch_size: int, sets: Sequence[tuple[str, ...]],
               usable: Optional[int], context: Any, device: Any,
               world: Optional[tuple[int, str]] = None) -> list[dict[str, Any]]:
    """One dry run per mitigation set at ``(seq_len, batch_size)``: a JSON row each. With ``world``
    (``(N, strategy)``), the per-rank peak at N ranks and, with a budget, the smallest world size
    up to N at which the set fits (``smallest_world_size``; None where N does not suffice)."""
    from lightning_seqmem.dryrun.step import DryRunUnsupported

    rows = []
    for names in sets:
        peak = error = smallest = None
        peaks: dict[int, int] = {}
        started = time.perf_counter()
        try:
            peak = _step_peak(model, optimizer, batch, seq_len, batch_size, names, context, device, world)
            if world is not None and usable is not None:
                from lightning_seqmem.dryrun.sharded import smallest_fitting_world_size

                smallest, peaks = smallest_fitting_world_size(
                    lambda n: _step_peak(model, optimizer, batch, seq_len, batch_size, names, context, device,
                                         (n, world[1])), usable, world[0], {world[0]: peak})
        except DryRunUnsupported as exc:
            error = f"unsupported: {exc.reason}"
        except Exception as exc:  # noqa: BLE001 - one failed row must not hide the others
            error = f"failed: {type(exc).__name__}: {exc}"
        row = {"mitigations": list(names), "peak_bytes": peak,
               "fits": None if usable is None or peak is None else peak <= usable,
               "seconds": time.perf_counter() - started, "error": error}
        if world is not None:
            row.update(world_size=world[0], smallest_world_size=smallest,
                       peak_bytes_by_world_size={str(n): v for n, v in sorted(peaks.items())})
        rows.append(row)
    return rows


def _largest_fitting(model: Any, optimizer: Any, batch: Any, batch_size: int, names: tuple[str, ...], usable: int,
                     lo: int, hi: int, context: Any, device: Any) -> tuple[Optional[int], int]:
    """``(largest multiple of 8 below hi whose dry-run peak with names fits usable or None, dry runs)``,
    by bisection; ``lo`` is known to fit (0: nothing known)."""
    from lightning_seqmem.dryrun.step import dry_run_step

    from lightning_seqmem.core.search import bisect_last

    runs = 0

    def fits(units: int) -> bool:
        nonlocal runs
        runs += 1
        return dry_run_step(model, optimizer, batch, units * _SEARCH_MULTIPLE, batch_size, names, context,
                            device).peak_bytes <= usable

    # in units of 8 tokens: lo fits (or is 0), hi does not; neither is dry-run again
    lo = bisect_last(fits, lo // _SEARCH_MULTIPLE, -(-hi // _SEARCH_MULTIPLE))
    return (lo * _SEARCH_MULTIPLE or None), runs


def _names(names: Sequence[str]) -> str:
    return " + ".join(names) if names else "none"


def _plan(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from lightning_seqmem.measure.batch import infer_batch_shape
    from lightning_seqmem.core.units import format_bytes

    _quiet()
    started = time.perf_counter()
    console = Console(width=None if sys.stdout.isatty() else 120, quiet=args.json)  # --json: the document alone
    lengths = sorted(set(args.lengths))
    cli = build_from_config(args.config, args.model_class, args.data_class, command="seqmem plan")
    trainer, model, datamodule = cli.trainer, cli.model, cli.datamodule
    seqmem = _seqmem_callback(trainer)
    device = trainer.strategy.root_device
    budget, margin, usable = _usable_budget(args.budget, args.safety_margin, seqmem, device)
    batch = _first_batch(model, datamodule)  # any length: the dry run cuts or tiles it to each length asked
    batch_size = args.batch_size or infer_batch_shape(batch)[0]
    precision = trainer.precision_plugin
    model = precision.convert_module(model)  # as fit does (bf16-true: bf16 weights); the model stays where it is
    optimizer, optimizer_name = _first_optimizer(model)
    sets, skipped = _mitigation_sets(seqmem, trainer, model, batch, batch_size)
    context = precision.train_step_context  # autocast under mixed precision, as in training_step
    console.print(f"[bold]seqmem plan[/bold]: {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} "
                  f"parameters), {trainer.precision} precision, on {device}, optimizer {optimizer_name}, batch "
                  f"{batch_size}; one fake training step per length and mitigation set (nothing is allocated)")
    for name, reason in skipped.items():
        console.print(f"rung {name} skipped: {reason}")

    world = None if args.world_size is None else (args.world_size, args.strategy)
    if world is not None:
        from lightning_seqmem.dryrun.sharded import context_parallel_note

        console.print(f"per rank at world size {world[0]} ({world[1]}: "
                      + ("parameters, gradients and optimizer state sharded with fully_shard on each block and the "
                         "root, or as the model's configure_model() shards them" if world[1] == "fsdp2" else
                         "every rank holds the whole model, plus DDP's gradient buckets")
                      + "), by a dry run in a fake process group; batch is per rank")
        console.print(context_parallel_note(device))
    results = []
    with console.status(f"dry-running {len(sets)} mitigation sets at seq_len {lengths}..."):
        for L in lengths:
            rows = _plan_rows(model, optimizer, batch, L, batch_size, sets, usable, context, device, world)
            plan = next((r["mitigations"] for r in rows if r["fits"]), None)
            results.append({"seq_len": L, "rows": rows, "plan": plan})
    # nothing fits at some length: the largest length the last (lowest) set fits, searched once
    # between the longest asked length it fits and the shortest it does not
    largest, searched, search_runs, search_seconds = None, False, 0, 0.0
    over = [res["seq_len"] for res in results if res["rows"][-1]["fits"] is False]
    if over and world is None:  # at N ranks the table's "fits from N" column answers instead
        hi = min(over)
        lo = max((res["seq_len"] for res in results if res["rows"][-1]["fits"] and res["seq_len"] < hi), default=0)
        t0 = time.perf_counter()
        with console.status(f"searching the largest length that fits with {_names(sets[-1])}..."):
            try:
                largest, search_runs = _largest_fitting(model, optimizer, batch, batch_size, sets[-1], usable,
                                                        lo, hi, context, device)
                searched = True
            except Exception as exc:  # noqa: BLE001 - the table stands without the search
                console.print(f"[yellow]search for the largest length that fits failed:[/yellow] {exc}")
        search_seconds = time.perf_counter() - t0
    seconds = time.perf_counter() - started

    if usable is not None:
        title = (f"seqmem plan: predicted peak of one training step (dry run), batch {batch_size}; fits = peak within "
                 f"the usable budget {format_bytes(usable)} ({format_bytes(budget)} − {margin:.0%} safety margin)")
    else:
        title = f"seqmem plan: predicted peak of one training step (dry run), batch {batch_size}"
    if world is not None:
        title = title.replace("predicted peak of one training step", f"predicted per-rank peak at {world[0]} ranks "
                              f"({world[1]})")
    table = Table(title=title, title_justify="left")
    smallest_column = world is not None and usable is not None
    headers = ["seq_len", "batch", "mitigations", "peak", *(["fits"] if usable is not None else []),
               *([f"fits from N (≤ {world[0]})"] if smallest_column else []), "time"]
    for header in headers:
        table.add_column(header, justify="left" if header == "mitigations" else "right")
    errors: dict[str, int] = {}  # each distinct reason a dry run did not run -> its note number, below the table
    for res in results:
        for row in res["rows"]:
            fits = [] if usable is None else ["-" if row["fits"] is None else ("yes" if row["fits"] else "NO")]
            chosen = res["plan"] is not None and row["mitigations"] == res["plan"]
            if row["error"] is None:
                peak = format_bytes(row["peak_bytes"])
            else:
                number = errors.setdefault(row["error"], len(errors) + 1)
                peak = f"{row['error'].split(':')[0]} [{number}]"
            smallest = []
            if smallest_column:
                smallest = ["-" if row["error"] else (str(row["smallest_world_size"]) if row["smallest_world_size"]
                                                      else f"> {world[0]}")]
            table.add_row(str(res["seq_len"]), str(batch_size), _names(row["mitigations"]), peak, *fits, *smallest,
                          f"{row['seconds']:.1f}s",
                          style="bold green" if chosen else ("red" if row["fits"] is False else None))
        table.add_section()
    console.print(table)
    for error, number in errors.items():
        console.print(f"[yellow][{number}][/yellow] {error}", highlight=False)
    if errors:
        console.print(f"(`seqmem forecast --config {args.config} --lengths ...` predicts from short real steps "
                      "where the dry run does not run)")
    for res in results:
        rows = res["rows"]
        if usable is None:
            continue
        if res["plan"] is not None:
            peak = next(r["peak_bytes"] for r in rows if r["mitigations"] == res["plan"])
            what = _names(res["plan"]) if res["plan"] else "no mitigation needed"
            console.print(f"seq_len {res['seq_len']}: cheapest plan: [bold]{what}[/bold] "
                          f"({format_bytes(peak)} of {format_bytes(usable)} usable)")
        elif all(r["peak_bytes"] is None for r in rows):
            console.print(f"seq_len {res['seq_len']}: no plan: the dry run failed for every set (see the table)")
        else:
            lowest = min((r for r in rows if r["peak_bytes"] is not None), key=lambda r: r["peak_bytes"])
            if largest is not None:
                longest = f"the largest length that fits with {_names(sets[-1])} is [bold]{largest}[/bold] tokens"
            elif searched:
                longest = f"not even {_SEARCH_MULTIPLE} tokens fit with {_names(sets[-1])}"
            else:
                longest = "no length that fits was searched for"
            console.print(f"seq_len {res['seq_len']}: [red]nothing fits[/red]: the lowest peak is "
                          f"{format_bytes(lowest['peak_bytes'])} ({_names(lowest['mitigations'])}) over "
                          f"{format_bytes(usable)} usable; {longest}")
    if usable is None:
        console.print("no budget (pass --budget, or memory_budget in the config's SeqMemCallback; on CUDA the "
                      "device's total): no fits column and no plan")
    dry_seconds = sum(r["seconds"] for res in results for r in res["rows"]) + search_seconds
    console.print(f"total {seconds:.1f}s: {sum(len(res['rows']) for res in results) + search_runs} dry runs in "
                  f"{dry_seconds:.1f}s"
                  + (f" ({search_runs} in the search for the largest length that fits)" if search_runs else "")
                  + "; peaks are live tensor bytes (on CUDA allocator blocks, as max_memory_allocated; not "
                  "reserved memory, workspaces or the CUDA context: that is what the safety margin is for)")
    if args.json:
        sys.stdout.write(json.dumps({
            "config": os.fspath(args.config), "device": str(device), "precision": str(trainer.precision),
            "batch_size": batch_size, "budget_bytes": budget, "safety_margin": margin, "usable_budget_bytes": usable,
            "mitigation_sets": [list(s) for s in sets], "skipped": skipped, "lengths": results,
            "largest_fitting_seq_len": largest, "seconds": seconds, "method": "dry_run",
            "world_size": None if world is None else world[0], "strategy": None if world is None else world[1],
        }, indent=2) + "\n")
    failed = any(r["error"] and not r["error"].startswith("unsupported:") for res in results for r in res["rows"])
    return 1 if failed else 0


# ----------------------------------------------------------------------------------------------
# Parser
# ----------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    from lightning_seqmem.core.rungs import MITIGATIONS

    parser = _Parser(
        prog="seqmem",
        description="Measure, predict and tame the memory of long-sequence transformer training.",
        epilog="seqmem demo: train a small GPT and report its memory; seqmem report PATH: print a saved "
        "report; seqmem forecast --config CONFIG.yaml --lengths ...: predict peaks without training; "
        "seqmem plan --config CONFIG.yaml --lengths ...: the cheapest mitigations that fit, without training.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="train a small GPT with a sequence-length curriculum and report its memory",
                          description="Train the reference GPT on random tokens (CPU by default) with a growing "
                          "sequence length under SeqMemCallback; log to TensorBoard and write the report.")
    demo.add_argument("--max-steps", type=_positive_int, default=None,
                      help="training steps (default: stages × steps-per-stage + 6 per mitigation, 48 with the defaults)")
    demo.add_argument("--out", default="seqmem_runs", help="TensorBoard save_dir; the report goes in the run's log_dir")
    demo.add_argument("--budget", default="200MiB", type=_budget_text,
                      help="memory budget, e.g. 1GiB or 900MB; units B, KB, MB, GB, TB (powers of 1000), KiB, MiB, "
                      "GiB, TiB (powers of 1024) (default 200MiB: eager attention at 1024 tokens "
                      "would not fit, so the callback switches on SDPA before that stage)")
    demo.add_argument("--mitigations", nargs="*", default=list(MITIGATIONS),
                      help="the ladder, in order (none: warn and cap the curriculum instead)")
    demo.add_argument("--attention", choices=("eager", "sdpa"), default="eager",
                      help="eager materialises the L×L scores (quadratic memory); sdpa does not on CPU")
    demo.add_argument("--start", type=_positive_int, default=64, help="first sequence length (tokens)")
    demo.add_argument("--target", type=_positive_int, default=1024, help="last sequence length (tokens)")
    demo.add_argument("--steps-per-stage", type=_positive_int, default=6, help="steps at each length")
    demo.add_argument("--batch-size", type=_positive_int, default=4, help="samples per batch")
    demo.add_argument("--n-layer", type=_positive_int, default=2, help="transformer blocks")
    demo.add_argument("--d-model", type=_positive_int, default=128, help="model width")
    demo.add_argument("--n-head", type=_positive_int, default=4, help="attention heads")
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
    forecast.add_argument("--config", required=True, type=_config_file, help="LightningCLI YAML (model, data, trainer sections)")
    forecast.add_argument("--lengths", type=_positive_int, nargs="+", required=True, help="sequence lengths to forecast (tokens)")
    forecast.add_argument("--budget", default=None, type=_budget_text,
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

    plan = sub.add_parser("plan", help="predict each mitigation set's peak at given lengths from a LightningCLI config "
                          "and pick the cheapest that fits, without training",
                          description="Build the model and data of a LightningCLI config and dry-run one training "
                          "step per length and mitigation set on fake tensors (nothing is trained or allocated): "
                          "print each predicted peak, which fit the usable budget, and the cheapest set that fits. "
                          "The sets, in cost order: none; attention; attention + checkpointing; attention + "
                          "checkpointing + microbatch, restricted to the config's SeqMemCallback mitigations (in "
                          "their order), without the rungs that do not apply to the model.")
    plan.add_argument("--config", required=True, type=_config_file,
                      help="LightningCLI YAML (model, data, trainer sections)")
    plan.add_argument("--lengths", type=_positive_int, nargs="+", required=True,
                      help="sequence lengths to plan for (tokens, ≥ 1)")
    plan.add_argument("--batch-size", type=_positive_int, default=None, help="samples per step (default: the data's)")
    plan.add_argument("--budget", type=_bytes, default=None,
                      help="memory budget, e.g. 80GiB (default: the config's SeqMemCallback memory_budget, else "
                      "the GPU's total memory, else none: no fits column)")
    plan.add_argument("--safety-margin", type=_fraction, default=None,
                      help="fraction of the budget kept free, in [0, 1) (default: the config's SeqMemCallback, else 0.1)")
    plan.add_argument("--model-class", default=_DEFAULT_MODEL, help="model class when the config names none")
    plan.add_argument("--data-class", default=_DEFAULT_DATA, help="datamodule class when the config names none")
    plan.add_argument("--world-size", type=_positive_int, default=None,
                      help="plan the per-rank peak at this many ranks (a dry run in a fake process group on this "
                      "machine), and with a budget the smallest world size (powers of two up to it) at which each "
                      "length fits with each mitigation set")
    plan.add_argument("--strategy", choices=("fsdp2", "ddp"), default="fsdp2",
                      help="with --world-size: fsdp2 (fully_shard: the model's configure_model(), else each repeated "
                      "block and the root) or ddp (replicas); default fsdp2")
    plan.add_argument("--json", action="store_true", help="print a JSON document instead of the table")
    plan.set_defaults(func=_plan)
    return parser


def _check_demo(args: argparse.Namespace) -> None:
    """What argparse cannot see in ``seqmem demo``'s options, before torch is imported."""
    from lightning_seqmem.core.curriculum import Curriculum
    from lightning_seqmem.core.rungs import check_mitigations

    if args.target < args.start:
        raise _UserError(f"--target {args.target} is shorter than --start {args.start}: the curriculum grows from "
                         "--start to --target (tokens), e.g. --start 64 --target 1024")
    try:
        Curriculum(start=args.start, target=args.target, steps_per_stage=args.steps_per_stage)
    except ValueError as err:
        raise _UserError(f"--start {args.start} --target {args.target}: {err}") from None
    try:
        check_mitigations(args.mitigations)
    except ValueError as err:
        raise _UserError(f"--mitigations: {err}") from None
    if args.d_model % args.n_head:
        raise _UserError(f"--d-model {args.d_model} must be a multiple of --n-head {args.n_head}")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[len("seqmem: "):] if text.startswith("seqmem: ") else text


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``seqmem`` console script.

    A mistake in the command line, a missing file, a budget nothing can meet or an accelerator this
    machine lacks ends in one line on stderr and exit status 2 (``SEQMEM_TRACEBACK=1`` shows the
    traceback instead).
    """
    parser = _parser()
    args = parser.parse_args(argv)
    prog = f"seqmem {args.command}"
    try:
        if args.command == "demo":
            _check_demo(args)
        return int(args.func(args) or 0)
    except _UserError as exc:
        sys.stderr.write(f"{prog}: error: {_one_line(exc)}\n")
        return 2
    except Exception as exc:  # bad input found later: a config, a budget, a file, the accelerator
        if os.environ.get("SEQMEM_TRACEBACK") or not _is_users(exc):
            raise
        sys.stderr.write(f"{prog}: error: {_one_line(exc)} (SEQMEM_TRACEBACK=1 for the traceback)\n")
        return 2


def _is_users(exc: BaseException) -> bool:
    """A user's mistake, said in the error's own words: our validation (ValueError, including
    :class:`~lightning_seqmem.MemoryBudgetError`), Lightning's MisconfigurationException (an
    accelerator this machine lacks), a file that is not there."""
    return (isinstance(exc, (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError))
            or type(exc).__name__ == "MisconfigurationException")


if __name__ == "__main__":
    sys.exit(main())
