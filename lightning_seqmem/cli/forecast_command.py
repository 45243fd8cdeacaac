"""``seqmem forecast``: trace a few short training steps of a config's model on a copy, print the
predicted peaks and where the memory goes."""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_seqmem.cli.common import (build_from_config, find_seqmem_callback, first_batch,
                                         first_optimizer, quiet_warnings, usable_budget)
from lightning_seqmem.core.units import format_bytes, parse_bytes
from lightning_seqmem.present.render import stdout_console, yes_no

__all__ = ["run_forecast"]


def _loss_of(output: Any) -> Any:
    """The loss of a ``training_step`` output (:func:`.keep_outputs`); none ends the command."""
    from lightning_seqmem.measure.steps import keep_outputs, loss_of

    keep_outputs(output)
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


def _lengths(args: argparse.Namespace) -> tuple[list[int], list[int], list[int]]:
    """(lengths asked, lengths to trace, those to check at): ``--lengths``, ``--trace-lengths``
    (default :func:`_default_trace_lengths`) and ``--no-check``, checked."""
    lengths = sorted(set(args.lengths))  # each ≥ 1: the parser checks
    trace, check = ((sorted(set(args.trace_lengths)), []) if args.trace_lengths
                    else _default_trace_lengths(lengths))
    if len(trace) < 2:
        raise SystemExit("seqmem forecast: --trace-lengths needs 2 or more distinct lengths, "
                         f"got {args.trace_lengths}")
    if args.no_check:
        check = []
    return lengths, trace, check


def _print_fit(console: Any, forecaster: Any, budget: Optional[int], margin: float,
               usable: Optional[int], batch_size: int, reserved: bool) -> Optional[int]:
    """Print the checks, then the largest length that fits (returned; None without a budget)."""
    for v in forecaster.verifications:
        console.print(f"check at seq_len {v.seq_len}: forecast {format_bytes(v.forecast_bytes)} "
                      f"({v.method}), measured {format_bytes(v.measured_bytes)}, "
                      f"error {v.relative_error:+.1%}")
    if usable is None:
        console.print("no budget (pass --budget, or memory_budget in the config's SeqMemCallback)")
        return None
    max_len = forecaster.max_seq_len(usable, batch_size, reserved=reserved)
    console.print(f"largest length that fits {format_bytes(usable)} (budget {format_bytes(budget)} "
                  f"minus safety margin {margin:.0%}) at batch {batch_size}: "
                  f"[bold]{max_len}[/bold] tokens")
    return max_len


def run_forecast(args: argparse.Namespace) -> int:
    """``seqmem forecast ARGS``: trace the config's model on a copy, print (or ``--json``) the
    forecast and where the memory goes; returns the exit status."""
    from lightning_seqmem.measure.batch_shape import infer_batch_shape
    from lightning_seqmem.measure.steps import trace_training_steps

    quiet_warnings()
    console = stdout_console()
    lengths, trace, check = _lengths(args)
    cli = build_from_config(args.config, args.model_class, args.data_class)
    trainer, model, datamodule = cli.trainer, cli.model, cli.datamodule
    if not model.automatic_optimization:
        raise SystemExit("seqmem forecast: the model uses manual optimisation; trace it with "
                         "lightning_seqmem.measure.steps")
    seqmem = find_seqmem_callback(trainer)
    device = trainer.strategy.root_device
    budget = parse_bytes(args.budget, "--budget") if args.budget else None
    budget, margin, usable = usable_budget(budget, args.safety_margin, seqmem, device)

    batch = first_batch(model, datamodule, max(trace + check))
    traced_batch, source_len = infer_batch_shape(batch)
    batch_size = args.batch_size or traced_batch

    work = copy.deepcopy(model)  # the steps below train the copy; the configured model is untouched
    precision = trainer.precision_plugin
    work = precision.convert_module(work).to(device)
    optimizer, optimizer_name = first_optimizer(work)
    console.print(f"[bold]seqmem forecast[/bold]: {type(model).__name__} "
                  f"({sum(p.numel() for p in model.parameters()):,} parameters), "
                  f"{trainer.precision} precision, on {device}, optimizer {optimizer_name}; "
                  f"tracing {len(trace)} steps at seq_len {trace} (batch {traced_batch})"
                  + (f", checking at {check}" if check else ""))
    with console.status(f"tracing training steps at seq_len {trace}..."):
        forecaster = trace_training_steps(
            work, optimizer, batch, trace, lambda m, b: _loss_of(m.training_step(b, 0)),
            device=device, context=precision.train_step_context,
            check_seq_lens=[L for L in check if L <= source_len])
    del work, optimizer
    reserved = device.type == "cuda"

    rows = _forecast_table(forecaster, lengths, batch_size, usable, reserved, console)
    max_len = _print_fit(console, forecaster, budget, margin, usable, batch_size, reserved)
    section = None
    if args.breakdown:
        section = _forecast_breakdown(model, precision, device, batch, trace, max(lengths),
                                      forecaster, console)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "config": os.fspath(args.config), "device": str(device),
            "precision": str(trainer.precision), "trace_lengths": trace, "budget_bytes": budget,
            "usable_budget_bytes": usable, "forecasts": rows, "max_seq_len": max_len,
            "verifications": [{**vars(v), "relative_error": v.relative_error}
                              for v in forecaster.verifications],
            "breakdown": section,
        }, indent=2) + "\n", encoding="utf-8")
    return 0


def _forecast_table(forecaster: Any, lengths: Sequence[int], batch_size: int,
                    usable: Optional[int], reserved: bool, console: Any) -> list[dict[str, Any]]:
    """Print the forecast per length (peak, upper bound, fits); return the rows for ``--json``."""
    from rich.table import Table

    table = Table(title=f"seqmem forecast (batch {batch_size}); fits = upper bound within the "
                        f"usable budget {format_bytes(usable)}", title_justify="left")
    for header in ("seq_len", "method", "peak", "upper bound", "fits"):
        table.add_column(header, justify="left" if header == "method" else "right")
    rows = []
    for L in lengths:
        fc = forecaster.forecast(L, batch_size)
        bound = fc.reserved_upper_bytes if reserved else fc.upper_bytes
        fits = None if usable is None else bound <= usable
        rows.append({"seq_len": L, "batch_size": batch_size, "method": fc.method,
                     "peak_bytes": fc.peak_bytes, "upper_bytes": bound, "fits": fits})
        table.add_row(str(L), fc.method, format_bytes(fc.peak_bytes), format_bytes(bound),
                      yes_no(fits), style=None if fits is not False else "red")
    console.print(table)
    return rows


def _forecast_breakdown(model: Any, precision: Any, device: Any, batch: Any, trace: Sequence[int],
                        longest: int, forecaster: Any, console: Any) -> dict[str, Any]:
    """Breakdowns at the traced lengths (none equal to a model width) on a fresh copy, printed."""
    from lightning_seqmem.measure.batch_shape import infer_batch_shape
    from lightning_seqmem.diagnostics.section import (breakdown_section, safe_seq_lens,
                                                      trace_breakdowns, width_dims)
    from lightning_seqmem.diagnostics.traced_step import training_step_loss
    from lightning_seqmem.present.render import render_breakdown_console

    work = precision.convert_module(copy.deepcopy(model)).to(device)
    optimizer, _ = first_optimizer(work)
    batch_size, source_len = infer_batch_shape(batch)
    lengths, notes = safe_seq_lens(trace, width_dims(work, batch_size), source_len, num=3)
    if len(lengths) < 2:
        raise SystemExit("seqmem forecast: no two lengths to trace the breakdown at "
                         f"(from {list(trace)})")
    console.print(f"[bold]where the memory goes[/bold]: tracing one step at seq_len {lengths} "
                  f"(batch {batch_size}) on a fresh copy of the model")
    with console.status(f"tracing the breakdown at seq_len {lengths}..."):
        breakdowns = trace_breakdowns(work, optimizer, batch, lengths, training_step_loss,
                                      device=device, context=precision.train_step_context)
    forecast_peak = (forecaster.forecast(longest, batch_size).peak_bytes
                     if longest > lengths[-1] else None)
    section = breakdown_section(breakdowns, work, extrapolate_to=longest,
                                forecast_peak_bytes=forecast_peak, notes=notes)
    del work, optimizer, breakdowns
    render_breakdown_console(section, console)
    return section
