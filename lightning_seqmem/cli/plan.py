"""``seqmem plan``: dry-run one training step of a config's model per length and mitigation set, on
fake tensors, and print which fit and the cheapest that does."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from lightning_seqmem.cli.common import (
    build_from_config,
    find_seqmem_callback,
    first_batch,
    first_optimizer,
    quiet_warnings,
    usable_budget,
)
from lightning_seqmem.cli.plan_text import (
    SEARCH_MULTIPLE,
    joined_names,
    modelled_line,
    print_peak_at,
    print_header,
    print_longest,
    print_plans,
    print_table,
    print_totals,
)

__all__ = ["PlanRun", "run_plan"]

_SEARCH_MULTIPLE = SEARCH_MULTIPLE  # "nothing fits": the largest fitting length is searched among multiples of this


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
        from lightning_seqmem.dryrun.depth import depth_dry_run_step as dry_run_step

        return dry_run_step(model, optimizer, batch, seq_len, batch_size, names, context, device).peak_bytes
    from lightning_seqmem.dryrun.depth import depth_sharded_dry_run_step as sharded_dry_run_step

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
    from lightning_seqmem.dryrun.depth import depth_dry_run_step as dry_run_step

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
    from lightning_seqmem.dryrun.depth import depth_dry_run_step as dry_run_step
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
    from lightning_seqmem.dryrun.depth import depth_dry_run_step as dry_run_step

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


@dataclass
class PlanRun:
    """What every dry run of one ``seqmem plan`` shares: the config's model (converted as fit converts
    it), optimizer, first batch, step context and device, the mitigation sets and the budget.
    ``world``: ``(N, strategy)`` with ``--world-size``, else None."""

    trainer: Any
    model: Any
    optimizer: Any
    optimizer_name: str
    batch: Any
    batch_size: int
    context: Any
    device: Any
    sets: list[tuple[str, ...]]
    skipped: dict[str, str]
    checks: dict[str, Any]
    budget: Optional[int]
    margin: float
    usable: Optional[int]
    world: Optional[tuple[int, str]]

    @property
    def ladder_rungs(self) -> list[str]:
        """The rungs this run may take, in its order (their variants apart)."""
        from lightning_seqmem.core.rungs import level_of

        return [n for n in self.checks if level_of(n) is None]

    def rows(self, seq_len: int, sets: Sequence[tuple[str, ...]]) -> list[dict[str, Any]]:
        """:func:`_plan_rows` of ``sets`` at ``seq_len``."""
        return _plan_rows(self.model, self.optimizer, self.batch, seq_len, self.batch_size, sets, self.usable,
                          self.context, self.device, self.world)


@dataclass
class _Search:
    """The searches beyond the asked lengths: the largest length the last set fits (where nothing
    fits somewhere), and their dry runs and seconds (``--longest`` adds its own)."""

    largest: Optional[int] = None
    searched: bool = False
    runs: int = 0
    seconds: float = 0.0


def _check_emit(args: argparse.Namespace) -> None:
    """``--emit`` plans an FSDP2 layout at ``--world-size`` ranks: refused without them."""
    if getattr(args, "emit", None) and args.world_size is None:
        raise SystemExit(f"seqmem plan: --emit {args.emit} needs --world-size N (the ranks the launch config is for)")
    if getattr(args, "emit", None) and args.strategy != "fsdp2":
        raise SystemExit(f"seqmem plan: --emit {args.emit} plans FSDP2 layouts, got --strategy {args.strategy}: "
                         "use --strategy fsdp2")


def _set_up(args: argparse.Namespace) -> PlanRun:
    """Build the config's model, data and optimizer (nothing is trained) and the sets to dry-run."""
    from lightning_seqmem.measure.batch import infer_batch_shape

    cli = build_from_config(args.config, args.model_class, args.data_class, command="seqmem plan")
    trainer, model, datamodule = cli.trainer, cli.model, cli.datamodule
    seqmem = find_seqmem_callback(trainer)
    device = trainer.strategy.root_device
    budget, margin, usable = usable_budget(args.budget, args.safety_margin, seqmem, device)
    batch = first_batch(model, datamodule)  # any length: the dry run cuts or tiles it to each length asked
    batch_size = args.batch_size or infer_batch_shape(batch)[0]
    precision = trainer.precision_plugin
    model = precision.convert_module(model)  # as fit does (bf16-true: bf16 weights); the model stays where it is
    optimizer, optimizer_name = first_optimizer(model)
    checks: dict[str, Any] = {}
    sets, skipped = _mitigation_sets(seqmem, trainer, model, batch, batch_size, checks)
    world = None if args.world_size is None else (args.world_size, args.strategy)
    # autocast under mixed precision, as in training_step
    return PlanRun(trainer, model, optimizer, optimizer_name, batch, batch_size, precision.train_step_context, device,
                   sets, skipped, checks, budget, margin, usable, world)


def _length_result(run: PlanRun, seq_len: int) -> dict[str, Any]:
    """The dry runs of one length: the sets' rows, the cheapest plan, the fastest setting that fits
    (and the rows it ran beyond the sets), where the peak sits."""
    rows = run.rows(seq_len, run.sets)
    plan = next((r["mitigations"] for r in rows if r["fits"]), None)
    fastest, searched_rows = _fastest(rows, run.ladder_rungs, run.checks, run.usable,
                                      lambda names: run.rows(seq_len, [names])[0], run.device.type)
    result = {"seq_len": seq_len, "rows": rows, "plan": plan, "fastest": fastest, "searched_rows": searched_rows}
    result["peak_at"] = (None if run.world is not None else  # the sharded dry run does not say
                         _peak_at(run.model, run.optimizer, run.batch, seq_len, run.batch_size, rows, plan, run.context,
                                  run.device))
    return result


def _search_largest(console: Any, run: PlanRun, results: list[dict[str, Any]]) -> _Search:
    """Nothing fits at some length: the largest length the last (lowest) set fits, searched once
    between the longest asked length it fits and the shortest it does not."""
    search = _Search()
    over = [res["seq_len"] for res in results if res["rows"][-1]["fits"] is False]
    if not over or run.world is not None:  # at N ranks the table's "fits from N" column answers instead
        return search
    hi = min(over)
    lo = max((res["seq_len"] for res in results if res["rows"][-1]["fits"] and res["seq_len"] < hi), default=0)
    t0 = time.perf_counter()
    with console.status(f"searching the largest length that fits with {joined_names(run.sets[-1])}..."):
        try:
            search.largest, search.runs = _largest_fitting(run.model, run.optimizer, run.batch, run.batch_size,
                                                           run.sets[-1], run.usable, lo, hi, run.context, run.device)
            search.searched = True
        except Exception as exc:  # noqa: BLE001 - the table stands without the search
            console.print(f"[yellow]search for the largest length that fits failed:[/yellow] {exc}")
    search.seconds = time.perf_counter() - t0
    return search


def _search_longest_each(console: Any, run: PlanRun, longest: list[dict[str, Any]], results: list[dict[str, Any]],
                         search: _Search) -> None:
    """``--longest``: per setting dry-run, the longest length it fits (``searched_seq_len``)."""
    t0 = time.perf_counter()
    with console.status("searching the longest length each setting fits..."):
        for entry in longest:
            entry["searched_seq_len"], runs = _search_longest(run.model, run.optimizer, run.batch, run.batch_size,
                                                              entry, results, run.usable, run.context, run.device)
            search.runs += runs
    search.seconds += time.perf_counter() - t0


def _json_document(args: argparse.Namespace, run: PlanRun, results: list[dict[str, Any]], search: _Search,
                   modelled: list[dict[str, Any]], seconds: float, longest: list[dict[str, Any]],
                   parallel: Optional[list[dict[str, Any]]]) -> dict[str, Any]:
    """``--json``: the whole plan as one document (README: *Plan before training*)."""
    world = run.world
    return {
        "parallel_plans": parallel,
        "config": os.fspath(args.config), "device": str(run.device), "precision": str(run.trainer.precision),
        "batch_size": run.batch_size, "budget_bytes": run.budget, "safety_margin": run.margin,
        "usable_budget_bytes": run.usable, "mitigation_sets": [list(s) for s in run.sets], "skipped": run.skipped,
        "lengths": results, "largest_fitting_seq_len": search.largest, "modelled": modelled, "seconds": seconds,
        "method": "dry_run", "longest_fitting_by_set": longest,
        "world_size": None if world is None else world[0], "strategy": None if world is None else world[1],
    }


def _parallel(console: Any, run: PlanRun, results: list[dict[str, Any]],
              args: argparse.Namespace) -> Optional[list[dict[str, Any]]]:
    """With ``--world-size`` under fsdp2 (or ``--emit``): the sequence-parallel layouts beside the rungs."""
    kinds = _sequence_parallel_kinds(args, run.world)
    if not kinds and not getattr(args, "emit", None):
        return None
    from lightning_seqmem.cli.parallel import parallel_plans

    return parallel_plans(console, run.model, run.optimizer, run.batch, run.batch_size, run.sets, run.usable,
                          run.context, run.device, run.world[0], results, kinds, getattr(args, "emit", None))


def run_plan(args: argparse.Namespace) -> int:
    """``seqmem plan ARGS``: set up, dry-run every length and mitigation set, print the text output
    (or, with ``--json``, the document alone); the exit status (``seqmem`` is :func:`.main.main`)."""
    from rich.console import Console

    _check_emit(args)
    quiet_warnings()
    started = time.perf_counter()
    console = Console(width=None if sys.stdout.isatty() else 120, quiet=args.json)  # --json: the document alone
    lengths = sorted(set(args.lengths))
    run = _set_up(args)
    print_header(console, run, bool(_sequence_parallel_kinds(args, run.world)))
    with console.status(f"dry-running {len(run.sets)} mitigation sets at seq_len {lengths}..."):
        results = [_length_result(run, L) for L in lengths]
    search = _search_largest(console, run, results)
    modelled = _modelled_rows(run.model, run.optimizer, run.batch, run.batch_size, run.sets[-1], run.skipped, results,
                              run.usable, run.context, run.device) if run.world is None else []
    seconds = time.perf_counter() - started

    print_table(console, run, results, args.config)
    print_plans(console, results, run.usable, run.sets[-1], search.largest, search.searched)
    for row in modelled:
        console.print(modelled_line(row), highlight=False)
    longest = _longest_by_set(results, run.usable, run.device.type)
    if getattr(args, "longest", False) and run.usable is not None and run.world is None:
        _search_longest_each(console, run, longest, results, search)
    print_longest(console, longest)
    print_peak_at(console, results)
    if run.usable is None:
        console.print("no budget (pass --budget, or memory_budget in the config's SeqMemCallback; on CUDA the "
                      "device's total): no fits column and no plan")
    print_totals(console, results, search.runs, search.seconds, modelled, seconds)
    parallel = _parallel(console, run, results, args)
    if args.json:
        sys.stdout.write(json.dumps(_json_document(args, run, results, search, modelled, seconds, longest, parallel),
                                    indent=2) + "\n")
    failed = any(r["error"] and not r["error"].startswith("unsupported:") for res in results for r in res["rows"])
    return 1 if failed else 0
