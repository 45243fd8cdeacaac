"""``seqmem plan``: dry-run one training step of a config's model per length and mitigation set, on
fake tensors, and print which fit each device answered for and the cheapest that does.

The model is built on ``meta`` (any size costs nothing); a CUDA config planned without CUDA runs on
the simulated CUDA device (:mod:`lightning_seqmem.dryrun.accelerator`: CUDA's allocator blocks,
autocast, modelled kernels). The dry runs are :class:`.plan_run.PlanRun`'s, each made once whatever
the number of devices (``--budget 80GB h200``, :mod:`.plan_devices`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

from lightning_seqmem.cli.common import (asks_for_cuda, build_from_config, config_margin,
                                         find_seqmem_callback, first_batch, host_budget,
                                         first_optimizer, quiet_warnings)
from lightning_seqmem.cli.plan_devices import DeviceBudget, device_budgets
from lightning_seqmem.cli.plan_workers import (collect_rows, default_workers, device_plans, serve,
                                               start_workers)
from lightning_seqmem.cli.plan_run import (PlanRun, fastest, largest_fitting, longest_by_set,
                                           mitigation_sets, modelled_rows, peak_at, search_longest,
                                           setting_key)
from lightning_seqmem.cli.plan_text import (OFFLOAD_ASSUMED, joined_names, modelled_line,
                                            print_devices_longest, print_header, print_longest,
                                            print_peak_at, print_plans, print_table, print_totals)
from lightning_seqmem.dryrun.accelerator import step_context
from lightning_seqmem.present.render import stdout_console

__all__ = ["run_plan", "serve_worker"]


@dataclass
class _Search:
    """The searches beyond the asked lengths on one device: the largest length the last set fits
    (where nothing fits somewhere), their dry runs and seconds (``--longest`` adds its own)."""

    largest: Optional[int] = None
    searched: bool = False
    runs: int = 0
    seconds: float = 0.0


def _check_emit(args: argparse.Namespace) -> None:
    """``--emit`` plans an FSDP2 layout at ``--world-size`` ranks: refused without them."""
    if getattr(args, "emit", None) and args.world_size is None:
        raise SystemExit(f"seqmem plan: --emit {args.emit} needs --world-size N (the ranks the "
                         "launch config is for)")
    if getattr(args, "emit", None) and args.strategy != "fsdp2":
        raise SystemExit(f"seqmem plan: --emit {args.emit} plans FSDP2 layouts, got --strategy "
                         f"{args.strategy}: use --strategy fsdp2")


def _plan_device(args: argparse.Namespace, trainer: Any) -> Any:
    """The device the dry runs simulate: the trainer's, or the simulated CUDA device where the
    config asks for CUDA and this machine has none."""
    import torch

    from lightning_seqmem.dryrun.step import simulated_device_for

    if asks_for_cuda(args.config) and not torch.cuda.is_available():
        return simulated_device_for("cuda", torch.device("meta"))
    return trainer.strategy.root_device


def _steps_foreach(run: PlanRun) -> bool:
    """Whether the optimizer takes the foreach step on the planned device (``foreach=None`` as
    :func:`.fake.foreach_default` resolves it: on CUDA, the simulated device too)."""
    from lightning_seqmem.dryrun.fake import foreach_default

    default = foreach_default(run.device, run.model.parameters())
    return any(g.get("foreach") or (default and "foreach" in g and g["foreach"] is None
                                    and not g.get("fused")) for g in run.optimizer.param_groups)


def _plan_host_budget(args: argparse.Namespace, seqmem: Any, device: Any) -> Optional[int]:
    """The host memory offload settings are judged against: ``--host-budget``, else the config's
    SeqMemCallback ``host_memory_budget``, else this machine's RAM; None for a simulated device
    (this machine is not the one that trains: host peaks are shown, not judged)."""
    from lightning_seqmem.dryrun.accelerator import is_simulated

    return host_budget(getattr(args, "host_budget", None), seqmem, machine=not is_simulated(device))


def _set_up(args: argparse.Namespace) -> PlanRun:
    """Build the config's model (on ``meta``), data and optimizer (nothing is trained), the sets to
    dry-run and the devices to answer for."""
    from lightning_seqmem.measure.batch_shape import infer_batch_shape

    cli = build_from_config(args.config, args.model_class, args.data_class, command="seqmem plan",
                            meta=True)
    trainer, model, datamodule = cli.trainer, cli.model, cli.datamodule
    seqmem = find_seqmem_callback(trainer)
    device = _plan_device(args, trainer)
    margin = config_margin(args.safety_margin, seqmem)
    budgets = device_budgets(args.budget, margin, seqmem, device)  # None, or a list
    batch = first_batch(model, datamodule)  # any length: each dry run cuts or tiles it
    batch_size = args.batch_size or infer_batch_shape(batch)[0]
    precision = trainer.precision_plugin
    model = precision.convert_module(model)  # as fit does (bf16-true: bf16 weights); on meta, free
    optimizer, optimizer_name = first_optimizer(model)
    checks: dict[str, Any] = {}
    sets, skipped = mitigation_sets(seqmem, trainer, model, batch, batch_size, checks, device)
    world = None if args.world_size is None else (args.world_size, args.strategy)
    host = _plan_host_budget(args, seqmem, device)
    # autocast under mixed precision, as in training_step (CUDA's autocast on the simulated device)
    return PlanRun(trainer, model, optimizer, optimizer_name, batch, batch_size,
                   step_context(precision, device), device, sets, skipped, checks, budgets, margin,
                   world, host_budget=host)


def _length_result(run: PlanRun, seq_len: int, usable: Optional[int],
                   with_site: bool) -> dict[str, Any]:
    """The dry runs of one length judged against ``usable``: the sets' rows, the cheapest plan, the
    fastest setting that fits (and the rows it ran beyond the sets), where the peak sits."""
    rows = run.rows(seq_len, run.sets, usable)
    chosen = next((r for r in rows if r["fits"]), None)  # cheapest first, offload after every one
    plan = None if chosen is None else chosen["mitigations"]
    fast, searched_rows = fastest(run, seq_len, rows, usable)
    result = {"seq_len": seq_len, "rows": rows, "plan": plan,
              "plan_offload": bool(chosen and chosen["offload"]), "fastest": fast,
              "searched_rows": searched_rows}
    if with_site:
        result["peak_at"] = None if run.world is not None else peak_at(run, seq_len, rows, plan)
    return result


def _search_largest(console: Any, run: PlanRun, results: list[dict[str, Any]],
                    usable: Optional[int]) -> _Search:
    """Nothing fits at some length: the largest length the last (lowest) set fits, searched once
    between the longest asked length it fits and the shortest it does not."""
    search = _Search()
    over = [res["seq_len"] for res in results if res["rows"][-1]["fits"] is False]
    if not over or run.world is not None or usable is None:  # N ranks: "fits from N" answers
        return search
    if run.beyond_any_rung(usable):  # the state alone is over: no length fits with any rung
        search.searched = True
        return search
    hi = min(over)
    lo = max((res["seq_len"] for res in results if res["rows"][-1]["fits"] and res["seq_len"] < hi),
             default=0)
    t0 = time.perf_counter()
    with console.status("searching the largest length that fits with "
                        f"{joined_names(run.sets[-1])}..."):
        try:
            search.largest, search.runs = largest_fitting(run, run.sets[-1], usable, lo, hi)
            search.searched = True
        except Exception as exc:  # noqa: BLE001 - the table stands without the search
            console.print(f"[yellow]search for the largest length that fits failed:[/yellow] {exc}")
    search.seconds = time.perf_counter() - t0
    return search


def _search_longest_each(console: Any, run: PlanRun, longest: list[dict[str, Any]],
                         results: list[dict[str, Any]], search: _Search, usable: int) -> None:
    """``--longest``: the longest length each setting fits (``searched_seq_len``), for the ladder's
    sets (with and without offload) and each length's fastest; the other settings the fastest's
    search dry-ran keep the longest of their dry-run lengths."""
    wanted = {(tuple(s), off) for s in run.sets for off in (False, True)}
    wanted |= {(tuple(r["fastest"]["mitigations"]), False) for r in results
               if r["fastest"] is not None}
    t0 = time.perf_counter()
    with console.status("searching the longest length each setting fits..."):
        for entry in longest:
            if setting_key(entry) not in wanted:
                continue
            entry["searched_seq_len"], runs = search_longest(run, entry, results, usable)
            search.runs += runs
            if entry["searched_seq_len"]:
                entry["host_at_seq_len"] = entry["searched_seq_len"]
                entry["host_peak_bytes"] = run.dry(entry["searched_seq_len"],
                                                   tuple(entry["mitigations"]), run.world,
                                                   entry["offload"])["host_peak_bytes"]
    search.seconds += time.perf_counter() - t0


def _device_plan(console: Any, run: PlanRun, lengths: list[int], budget: Optional[DeviceBudget],
                 first: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One device's answer: per length the rows judged against its usable budget, the plans and
    searches; ``first``: the device whose rows the table shows (its results carry ``peak_at``)."""
    usable = None if budget is None else budget.usable_bytes
    results = [_length_result(run, L, usable, first) for L in lengths]
    search = _search_largest(console, run, results, usable)
    longest = longest_by_set(results, usable, run.device_type)
    if getattr(args, "longest", False) and usable is not None:
        _search_longest_each(console, run, longest, results, search, usable)
    out = {"results": results, "search": search, "longest": longest}
    if budget is not None:
        out.update(budget.to_dict())
    return out


def _json_document(args: argparse.Namespace, run: PlanRun, devices: list[dict[str, Any]],
                   modelled: list[dict[str, Any]], seconds: float,
                   parallel: Optional[list[dict[str, Any]]]) -> dict[str, Any]:
    """``--json``: the whole plan as one document (README: *Plan before training*); the top-level
    answer is the first device's, ``devices`` holds every device's."""
    world, first = run.world, devices[0]
    return {
        "parallel_plans": parallel,
        "config": os.fspath(args.config), "device": str(run.device), "simulates": run.device_type,
        "precision": str(run.trainer.precision), "batch_size": run.batch_size,
        "budget_bytes": run.budget, "safety_margin": run.margin, "usable_budget_bytes": run.usable,
        "host_budget_bytes": run.host_budget, "mitigation_sets": [list(s) for s in run.sets],
        "skipped": run.skipped, "lengths": first["results"],
        "largest_fitting_seq_len": first["search"].largest, "modelled": modelled,
        "seconds": seconds, "method": "dry_run", "longest_fitting_by_set": first["longest"],
        "devices": [{k: v for k, v in d.items()
                     if k in ("name", "budget_bytes", "usable_budget_bytes")}
                    | {"process": d.get("process", 0),
                       "plans": [{"seq_len": r["seq_len"], "plan": r["plan"],
                                  "plan_offload": r["plan_offload"], "fastest": r["fastest"]}
                                 for r in d["results"]],
                       "largest_fitting_seq_len": d["search"].largest,
                       "longest_fitting_by_set": d["longest"],
                       "parallel_plans": d.get("parallel_plans")}
                    for d in devices if "name" in d],
        "dry_runs": run.dry_runs, "dry_run_seconds": run.dry_seconds, "processes": run.processes,
        "offload_assumed": OFFLOAD_ASSUMED if run.offloads else None,
        "world_size": None if world is None else world[0],
        "strategy": None if world is None else world[1],
    }


def _parallel(console: Any, run: PlanRun, devices: list[dict[str, Any]],
              args: argparse.Namespace) -> Optional[list[dict[str, Any]]]:
    """With ``--world-size`` under fsdp2, or ``--emit``: sequence-parallel layouts beside rungs,
    searched for each device (its ``parallel_plans``); the first device's returned."""
    from lightning_seqmem.plan.parallel import check_kinds

    kinds = check_kinds(getattr(args, "sequence_parallel", "auto")) if run.splits_sequence else ()
    if not kinds and not getattr(args, "emit", None):
        return None
    from lightning_seqmem.cli.plan_parallel import parallel_plans

    peaks: dict[tuple, Any] = {}  # a layout's dry run, made once for every device
    for device, budget in zip(devices, run.budgets or [None]):
        if len(devices) > 1:
            console.print(f"[bold]layouts on {budget.name}[/bold]:", highlight=False)
        device["parallel_plans"] = parallel_plans(
            console, run.model, run.optimizer, run.batch, run.batch_size, run.sets,
            device.get("usable_budget_bytes"), run.context, run.device, run.world[0],
            device["results"], kinds, getattr(args, "emit", None), run.host_budget, peaks)
    return devices[0]["parallel_plans"]


def serve_worker() -> None:
    """A ``seqmem plan --workers`` worker (:func:`~lightning_seqmem.cli.plan_workers.serve`): sets
    the plan up and answers a device as :func:`run_plan` does."""
    from rich.console import Console

    def set_up(args: argparse.Namespace) -> PlanRun:
        quiet_warnings()
        return _set_up(args)

    def device_plan(run: PlanRun, lengths: list[int], budget: DeviceBudget,
                    args: argparse.Namespace) -> dict:
        return _device_plan(Console(quiet=True), run, lengths, budget, False, args)

    serve(set_up, device_plan)


def run_plan(args: argparse.Namespace) -> int:
    """``seqmem plan ARGS``: set up, dry-run every length and mitigation set, print the text output
    (or, with ``--json``, the document alone); returns the exit status."""
    _check_emit(args)
    quiet_warnings()
    started = time.perf_counter()
    console = stdout_console(quiet=args.json)
    lengths = sorted(set(args.lengths))
    # the workers set the plan up while this process does (cli.plan_workers)
    workers = start_workers(args, getattr(args, "workers", None) or default_workers())
    try:
        run = _set_up(args)
        print_header(console, run, run.splits_sequence
                     and getattr(args, "sequence_parallel", "auto") != "none")
        with console.status(f"dry-running {len(run.sets)} mitigation sets at seq_len {lengths}..."):
            run.processes = collect_rows(run, lengths, workers)
            devices = (device_plans(run, workers, run.budgets, lengths,
                                    lambda b, i: _device_plan(console, run, lengths, b, i == 0,
                                                              args))
                       if run.budgets else [_device_plan(console, run, lengths, None, True, args)])
    finally:
        workers.stop()  # a failed set-up: all of them
    first = devices[0]
    modelled = (modelled_rows(run, run.sets[-1], first["results"], run.usable)
                if run.world is None else [])
    seconds = time.perf_counter() - started

    print_table(console, run, first["results"], args.config)
    for device, budget in zip(devices, run.budgets or [None]):
        if len(run.budgets) > 1:
            console.print(f"[bold]on {budget.name}[/bold]:", highlight=False)
        print_plans(console, device["results"], device.get("usable_budget_bytes"), run.sets[-1],
                    device["search"].largest, device["search"].searched, _steps_foreach(run))
    for row in modelled:
        console.print(modelled_line(row), highlight=False)
    if len(run.budgets) > 1:
        print_devices_longest(console, run, devices)
    else:
        print_longest(console, first["longest"])
    print_peak_at(console, first["results"])
    if run.usable is None:
        console.print("no budget (pass --budget, or memory_budget in the config's SeqMemCallback; "
                      "on CUDA the device's total): no fits column and no plan")
    print_totals(console, run, modelled, seconds)
    parallel = _parallel(console, run, devices, args)
    if args.json:
        sys.stdout.write(json.dumps(_json_document(args, run, devices, modelled, seconds, parallel),
                                    indent=2) + "\n")
    failed = any(r["error"] and not r["error"].startswith("unsupported:")
                 for res in first["results"] for r in res["rows"])
    return 1 if failed else 0
