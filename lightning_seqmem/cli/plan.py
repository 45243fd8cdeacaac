"""``seqmem plan``: dry-run one training step of a config's model per length and mitigation set, on
fake tensors, and print which fit and the cheapest that does."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Optional, Sequence

from lightning_seqmem.cli.common import (
    _first_batch,
    _first_optimizer,
    _quiet,
    _seqmem_callback,
    _usable_budget,
    build_from_config,
)

_SEARCH_MULTIPLE = 8  # "nothing fits": the largest fitting length is searched among multiples of this


def _mitigation_sets(seqmem: Any, trainer: Any, model: Any, batch: Any, batch_size: int,
                     checks_out: Optional[dict] = None) -> tuple[list[tuple[str, ...]], dict[str, str]]:
    """The mitigation sets to dry-run, cheapest first, and ``rung -> why skipped`` (``checks_out``
    receives every rung's and variant's applicability, for the search of the fastest setting).

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
    if checks_out is not None:
        checks_out.update(checks)
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


def _sequence_parallel_kinds(args: argparse.Namespace, world: Optional[tuple[int, str]]) -> tuple[str, ...]:
    """The sequence-parallel kinds searched (``--sequence-parallel``): with ``--world-size`` under fsdp2 only."""
    from lightning_seqmem.plan.parallel import check_kinds

    if world is None or world[1] != "fsdp2" or world[0] < 2:
        return ()
    return check_kinds(getattr(args, "sequence_parallel", "auto"))


def _modelled_rows(model: Any, optimizer: Any, batch: Any, batch_size: int, base: tuple[str, ...],
                   skipped: dict[str, str], results: list[dict[str, Any]], usable: Optional[int], context: Any,
                   device: Any) -> list[dict[str, Any]]:
    """For each rung skipped here that a dry run still models (``Rung.modelled_where_refused``: activation
    offload on CPU), per length: the device peak with the last set and with it added, and the bytes it
    moves to host memory. Modelled, not measured (``"measured": false``); a failure is the row's error."""
    from lightning_seqmem.dryrun.step import dry_run_step
    from lightning_seqmem.mitigations.ladder import rung

    rows = []
    for name, why in skipped.items():
        if not getattr(rung(name), "modelled_where_refused", False):
            continue
        for res in results:
            without = next(r for r in res["rows"] if tuple(r["mitigations"]) == base)
            row = {"rung": name, "refused": why, "seq_len": res["seq_len"], "mitigations": [*base, name],
                   "peak_bytes_without": without["peak_bytes"], "peak_bytes": None, "host_bytes": None,
                   "saved_bytes": None, "fits": None, "measured": False, "error": without["error"]}
            if without["peak_bytes"] is not None:
                try:
                    dry = dry_run_step(model, optimizer, batch, res["seq_len"], batch_size, (*base, name), context,
                                       device)
                    row.update(peak_bytes=dry.peak_bytes, host_bytes=dry.host_bytes,
                               saved_bytes=without["peak_bytes"] - dry.peak_bytes,
                               fits=None if usable is None else dry.peak_bytes <= usable)
                except Exception as exc:  # noqa: BLE001 - a modelled row must not hide the table
                    row["error"] = f"failed: {type(exc).__name__}: {exc}"
            rows.append(row)
    return rows


def _modelled_line(row: dict[str, Any]) -> str:
    """One modelled row in words (``seqmem plan``'s text output)."""
    from lightning_seqmem.core.units import format_bytes

    head = (f"seq_len {row['seq_len']}: {row['rung']} is refused here ({row['refused']}); modelled by a dry run, "
            f"not measured")
    if row["peak_bytes"] is None:
        return f"{head}: {row['error'] or 'no figure'}"
    base = [n for n in row["mitigations"] if n != row["rung"]]
    saved, without = row["saved_bytes"], row["peak_bytes_without"]
    change = f"−{format_bytes(saved)}" if saved >= 0 else f"+{format_bytes(-saved)}"
    return (f"{head}: where it applies the device peak would be {format_bytes(row['peak_bytes'])} instead of "
            f"{format_bytes(without)} with {_names(base)} ({change}, {-saved / without:+.0%}), "
            f"{format_bytes(row['host_bytes'])} of saved activations moved to host memory per step")


def _fastest(rows: list[dict[str, Any]], rungs: Sequence[str], checks: dict, usable: Optional[int],
             dry: Any, device_type: Optional[str] = None) -> tuple[Optional[dict[str, Any]], list[dict[str, Any]]]:
    """The fastest setting that fits at one length (:func:`~lightning_seqmem.plan.choose.choose`,
    priced by the rungs' step-time priors: nothing is timed here), and the rows of the settings it
    dry-ran beyond ``rows`` (the ladder's prefixes, already dry-run). ``dry(names)`` -> a row."""
    from types import SimpleNamespace

    from lightning_seqmem.core.units import format_bytes
    from lightning_seqmem.plan.choose import choose
    from lightning_seqmem.plan.pricing import prior_factor

    if usable is None:
        return None, []
    known = {tuple(r["mitigations"]): r for r in rows}
    extra: list[dict[str, Any]] = []

    def row(names: tuple[str, ...]) -> dict[str, Any]:
        if names not in known:
            known[names] = dry(names)
            extra.append(known[names])
        return known[names]

    def judge(names: tuple[str, ...]) -> Any:
        r = row(names)
        kind = "unknown" if r["peak_bytes"] is None else ("fits" if r["peak_bytes"] <= usable else "over")
        return SimpleNamespace(kind=kind, bound_bytes=r["peak_bytes"])

    plain = known.get(())
    if plain is not None and plain["fits"]:
        choice_setting, why = (), "no mitigation needed"
    else:
        choice = choose((), rungs, checks, judge, lambda s: prior_factor(s, device_type), fmt=format_bytes,
                        usable=usable)
        if choice is None or not choice.fits:
            return None, extra
        choice_setting, why = choice.setting, choice.why
    r = known[choice_setting]
    return {"mitigations": list(choice_setting), "peak_bytes": r["peak_bytes"],
            "step_time_factor": prior_factor(choice_setting, device_type), "why": why}, extra


def _longest_by_set(results: list[dict[str, Any]], usable: Optional[int],
                    device_type: Optional[str] = None) -> list[dict[str, Any]]:
    """Per setting dry-run (the ladder's prefixes and those the search of the fastest setting ran), the
    longest asked length at which it fits, with its prior step-time factor (empty without a budget)."""
    from lightning_seqmem.plan.pricing import prior_factor

    if usable is None:
        return []
    best: dict[tuple[str, ...], Optional[int]] = {}
    ran: dict[tuple[str, ...], list[int]] = {}
    for res in results:
        for row in res["rows"] + res.get("searched_rows", []):
            names = tuple(row["mitigations"])
            fits = row["peak_bytes"] is not None and row["peak_bytes"] <= usable
            best[names] = max(best.get(names) or 0, res["seq_len"] if fits else 0) or None
            ran.setdefault(names, []).append(res["seq_len"])
    return [{"mitigations": list(k), "seq_len": v, "step_time_factor": prior_factor(k, device_type),
             "dry_run_lengths": ran[k]}
            for k, v in best.items()]


def _search_longest(model: Any, optimizer: Any, batch: Any, batch_size: int, entry: dict[str, Any],
                    results: list[dict[str, Any]], usable: int, context: Any, device: Any) -> tuple[Optional[int], int]:
    """(the longest multiple of 8 that ``entry``'s setting fits, dry runs): searched between the longest
    dry-run length it fits and the shortest it does not; without one over, the longest it fits."""
    names = tuple(entry["mitigations"])
    over = [res["seq_len"] for res in results for r in res["rows"] + res["searched_rows"]
            if tuple(r["mitigations"]) == names and r["peak_bytes"] is not None and r["peak_bytes"] > usable]
    if not over:
        return entry["seq_len"], 0
    hi = min(over)
    lo = max((L for L in [entry["seq_len"] or 0] if L < hi), default=0)
    return _largest_fitting(model, optimizer, batch, batch_size, names, usable, lo, hi, context, device)


def _peak_at(model: Any, optimizer: Any, batch: Any, seq_len: int, batch_size: int, rows: Sequence[dict[str, Any]],
             plan: Optional[Sequence[str]], context: Any, device: Any) -> Optional[dict[str, Any]]:
    """Where the peak sits at ``seq_len`` (the ``"peak at"`` field): phase and kinds of tensor of the
    chosen plan's step, or, where none was chosen (nothing fits, or no budget), of the set with the
    lowest peak; one more dry run, its fake step traced by
    :func:`~lightning_seqmem.diagnostics.peak.trace_peak_site`. None where no dry run ran or it could
    not say. ``mitigations`` (the set) then :meth:`~lightning_seqmem.core.peak.PeakSite.to_dict`."""
    from lightning_seqmem.diagnostics.peak import trace_peak_site
    from lightning_seqmem.dryrun.step import dry_run_step

    ran = [r for r in rows if r["peak_bytes"] is not None]
    if not ran:
        return None
    names = tuple(plan) if plan is not None else tuple(min(ran, key=lambda r: r["peak_bytes"])["mitigations"])
    try:
        site = dry_run_step(model, optimizer, batch, seq_len, batch_size, names, context, device,
                            site=trace_peak_site).peak_site
    except Exception:  # noqa: BLE001 - the table stands without it
        return None
    return None if site is None else {"mitigations": list(names), **site.to_dict()}


def _names(names: Sequence[str]) -> str:
    return " + ".join(names) if names else "none"


def _print_peak_at(console: Any, results: Sequence[dict[str, Any]]) -> None:
    """One ``peak at`` line per length: the phase and the kinds of tensor holding the peak."""
    for res in results:
        site = res.get("peak_at")
        if site is not None:
            console.print(f"seq_len {res['seq_len']}: peak at {site['describe']} (with {_names(site['mitigations'])})",
                          highlight=False)


def _plan(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from lightning_seqmem.measure.batch import infer_batch_shape
    from lightning_seqmem.core.units import format_bytes

    if getattr(args, "emit", None) and args.world_size is None:
        raise SystemExit(f"seqmem plan: --emit {args.emit} needs --world-size N (the ranks the launch config is for)")
    if getattr(args, "emit", None) and args.strategy != "fsdp2":
        raise SystemExit(f"seqmem plan: --emit {args.emit} plans FSDP2 layouts, got --strategy {args.strategy}: "
                         "use --strategy fsdp2")
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
    checks: dict[str, Any] = {}
    sets, skipped = _mitigation_sets(seqmem, trainer, model, batch, batch_size, checks)
    ladder_rungs = [n for n in checks if ":" not in n]  # the rungs this run may take, in its order
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
        if not _sequence_parallel_kinds(args, world):
            console.print(context_parallel_note(device))
    results = []
    with console.status(f"dry-running {len(sets)} mitigation sets at seq_len {lengths}..."):
        for L in lengths:
            rows = _plan_rows(model, optimizer, batch, L, batch_size, sets, usable, context, device, world)
            plan = next((r["mitigations"] for r in rows if r["fits"]), None)
            fastest, searched_rows = _fastest(rows, ladder_rungs, checks, usable, lambda names, L=L: _plan_rows(
                model, optimizer, batch, L, batch_size, [names], usable, context, device, world)[0], device.type)
            results.append({"seq_len": L, "rows": rows, "plan": plan, "fastest": fastest,
                            "searched_rows": searched_rows})
            results[-1]["peak_at"] = (None if world is not None else  # the sharded dry run does not say
                                      _peak_at(model, optimizer, batch, L, batch_size, rows, plan, context, device))
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
    modelled = _modelled_rows(model, optimizer, batch, batch_size, sets[-1], skipped, results, usable, context,
                              device) if world is None else []
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
            fast = res["fastest"]
            if fast is not None:
                console.print(f"seq_len {res['seq_len']}: fastest that fits: [bold]{_names(fast['mitigations'])}"
                              f"[/bold], peak {format_bytes(fast['peak_bytes'])}, step time "
                              f"{(fast['step_time_factor'] - 1) * 100:+.0f}% by the rungs' priors ({fast['why']})",
                              highlight=False)
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
    for row in modelled:
        console.print(_modelled_line(row), highlight=False)

    longest = _longest_by_set(results, usable, device.type)
    if getattr(args, "longest", False) and usable is not None and world is None:
        t0 = time.perf_counter()
        with console.status("searching the longest length each setting fits..."):
            for entry in longest:
                entry["searched_seq_len"], runs = _search_longest(model, optimizer, batch, batch_size, entry, results,
                                                                  usable, context, device)
                search_runs += runs
        search_seconds += time.perf_counter() - t0
    for entry in longest:
        console.print(f"{_names(entry['mitigations'])} (step time {(entry['step_time_factor'] - 1) * 100:+.0f}% by "
                      f"priors): longest length that fits of those dry-run ({', '.join(map(str, entry['dry_run_lengths']))}): "
                      + (f"{entry['seq_len']}" if entry["seq_len"] else "none")
                      + (f"; longest that fits (searched): {entry['searched_seq_len'] or 'none'}"
                         if "searched_seq_len" in entry else ""), highlight=False)


    _print_peak_at(console, results)
    if usable is None:
        console.print("no budget (pass --budget, or memory_budget in the config's SeqMemCallback; on CUDA the "
                      "device's total): no fits column and no plan")
    dry_seconds = sum(r["seconds"] for res in results for r in res["rows"] + res["searched_rows"]) + search_seconds
    console.print(f"total {seconds:.1f}s: {sum(len(res['rows']) + len(res['searched_rows']) for res in results) + search_runs} dry runs in "
                  f"{dry_seconds:.1f}s"
                  + (f" ({search_runs} in the search for the largest length that fits)" if search_runs else "")
                  + (f", and {len(modelled)} modelling refused rungs" if modelled else "")
                  + "; peaks are live tensor bytes (on CUDA allocator blocks, as max_memory_allocated; not "
                  "reserved memory, workspaces or the CUDA context: that is what the safety margin is for)")
    parallel = None
    if _sequence_parallel_kinds(args, world) or getattr(args, "emit", None):
        from lightning_seqmem.cli.parallel import parallel_plans

        parallel = parallel_plans(console, model, optimizer, batch, batch_size, sets, usable, context, device, world[0],
                                  results, _sequence_parallel_kinds(args, world), getattr(args, "emit", None))
    if args.json:
        sys.stdout.write(json.dumps({
            "parallel_plans": parallel,
            "config": os.fspath(args.config), "device": str(device), "precision": str(trainer.precision),
            "batch_size": batch_size, "budget_bytes": budget, "safety_margin": margin, "usable_budget_bytes": usable,
            "mitigation_sets": [list(s) for s in sets], "skipped": skipped, "lengths": results,
            "largest_fitting_seq_len": largest, "modelled": modelled, "seconds": seconds, "method": "dry_run",
            "longest_fitting_by_set": longest,
            "world_size": None if world is None else world[0], "strategy": None if world is None else world[1],
        }, indent=2) + "\n")
    failed = any(r["error"] and not r["error"].startswith("unsupported:") for res in results for r in res["rows"])
    return 1 if failed else 0
