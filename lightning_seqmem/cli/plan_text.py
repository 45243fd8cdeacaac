"""``seqmem plan``'s text output: the table of dry runs, the plan of each length, the longest
length each setting fits, where the peak sits and the totals (the JSON document is :mod:`.plan`'s).

Example:
    >>> joined_names(("attention", "checkpointing")), joined_names(())
    ('attention + checkpointing', 'none')
    >>> fits_cell({"fits": False}, 1), fits_cell({"fits": None}, 1), fits_cell({"fits": True}, None)
    (['NO'], ['-'], [])
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from lightning_seqmem.core.units import format_bytes
from lightning_seqmem.plan.judging import DRY_RUN_MARGIN, dry_run_bound
from lightning_seqmem.present.render import yes_no

SEARCH_MULTIPLE = 8  # the largest fitting length is searched among multiples of this


def joined_names(names: Sequence[str]) -> str:
    """A mitigation set in words, ``"a + b"`` (``"none"`` for the empty set); example above."""
    return " + ".join(names) if names else "none"


def setting_name(row: dict[str, Any]) -> str:
    """A row's setting in words: its rungs, and ``+ offload`` where parameters, gradients and
    optimizer state live on the host (FSDP2 ``CPUOffloadPolicy``).

    >>> setting_name({"mitigations": ["checkpointing"], "offload": True})
    'checkpointing + offload'
    """
    names = list(row["mitigations"])
    return joined_names(names) if not row.get("offload") else " + ".join([*names, "offload"])


def fits_cell(row: dict[str, Any], usable: Optional[int]) -> list[str]:
    """The ``fits`` cell of a table row (none without a budget: no such column); example above."""
    return [] if usable is None else [yes_no(row["fits"])]


def modelled_line(row: dict[str, Any]) -> str:
    """One modelled row in words (``seqmem plan``'s text output)."""
    head = (f"seq_len {row['seq_len']}: {row['rung']} is refused here ({row['refused']}); "
            "modelled by a dry run, not measured")
    if row["peak_bytes"] is None:
        return f"{head}: {row['error'] or 'no figure'}"
    base = [n for n in row["mitigations"] if n != row["rung"]]
    saved, without = row["saved_bytes"], row["peak_bytes_without"]
    change = f"−{format_bytes(saved)}" if saved >= 0 else f"+{format_bytes(-saved)}"
    return (f"{head}: where it applies the device peak would be {format_bytes(row['peak_bytes'])} "
            f"instead of {format_bytes(without)} with {joined_names(base)} ({change}, "
            f"{-saved / without:+.0%}), {format_bytes(row['host_bytes'])} of saved activations "
            "moved to host memory per step")


def print_peak_at(console: Any, results: Sequence[dict[str, Any]]) -> None:
    """One ``peak at`` line per length: the phase and the kinds of tensor holding the peak."""
    for res in results:
        site = res.get("peak_at")
        if site is not None:
            console.print(f"seq_len {res['seq_len']}: peak at {site['describe']} "
                          f"(with {joined_names(site['mitigations'])})", highlight=False)


def print_header(console: Any, run: Any, sequence_parallel: bool) -> None:
    """What is planned (model, precision, device, optimizer, batch), the rungs skipped and, at N
    ranks, how the ranks are modelled (``sequence_parallel``: the sequence split searched too)."""
    model = run.model
    console.print(f"[bold]seqmem plan[/bold]: {type(model).__name__} "
                  f"({sum(p.numel() for p in model.parameters()):,} parameters), "
                  f"{run.trainer.precision} precision, on {run.device}, optimizer "
                  f"{run.optimizer_name}, batch {run.batch_size}; one fake training step per "
                  "length and mitigation set (nothing is allocated)")
    from rich.markup import escape

    for name, reason in run.skipped.items():  # (an install hint holds `[tiled]`: not markup)
        console.print(f"rung {name} skipped: {escape(reason)}", highlight=False)
    world = run.world
    if world is None:
        return
    from lightning_seqmem.dryrun.sharded import context_parallel_note

    console.print(f"per rank at world size {world[0]} ({world[1]}: "
                  + ("parameters, gradients and optimizer state sharded with fully_shard on each "
                     "block and the root, or as the model's configure_model() shards them"
                     if world[1] == "fsdp2" else
                     "every rank holds the whole model, plus DDP's gradient buckets")
                  + "), by a dry run in a fake process group; batch is per rank")
    if not sequence_parallel:
        console.print(context_parallel_note(run.device))


def _table_title(run: Any) -> str:
    title = f"seqmem plan: predicted peak of one training step (dry run), batch {run.batch_size}"
    if len(run.budgets) > 1:
        title += (f"; fits on each device = peak + {DRY_RUN_MARGIN:.0%} (the dry run's margin, as "
                  "the callback judges it) within its usable budget (device memory − "
                  f"{run.margin:.0%} safety margin: "
                  + ", ".join(f"{b.name}: {format_bytes(b.usable_bytes)}" for b in run.budgets)
                  + ")")
    elif run.usable is not None:
        title += (f"; fits = peak + {DRY_RUN_MARGIN:.0%} (the dry run's margin, as the callback "
                  f"judges it) within the usable budget {format_bytes(run.usable)} "
                  f"({format_bytes(run.budget)} − {run.margin:.0%} safety margin)")
    if run.world is not None:
        title = title.replace("predicted peak of one training step",
                              f"predicted per-rank peak at {run.world[0]} ranks ({run.world[1]})")
    return title


def _table_cells(run: Any, res: dict[str, Any], row: dict[str, Any],
                 errors: dict[str, int]) -> list[str]:
    """One row of the table; a row's error gets its note number in ``errors`` (first seen first)."""
    from rich.markup import escape

    if row["error"] is None:
        peak = format_bytes(row["peak_bytes"])
    else:
        number = errors.setdefault(row["error"], len(errors) + 1)
        peak = f"{escape(row['error'].split(':')[0])} [{number}]"
    smallest = []
    if run.world is not None and run.usable is not None:
        smallest = ["-" if row["error"]
                    else (str(row["smallest_world_size"]) if row["smallest_world_size"]
                          else f"> {run.world[0]}")]
    bound = row["bound_bytes"]
    fits = fits_cell(row, run.usable)
    fits += [yes_no(None if bound is None else bound <= b.usable_bytes) for b in run.budgets[1:]]
    host = [format_bytes(row.get("host_peak_bytes"))] if _shows_host(run) else []
    return [str(res["seq_len"]), str(run.batch_size), setting_name(row), peak, *host,
            *fits, *smallest, f"{row['seconds']:.1f}s"]


def _shows_host(run: Any) -> bool:
    """Whether the dry runs keep host memory apart (an accelerator, or the simulated one)."""
    from lightning_seqmem.dryrun.accelerator import host_of

    return host_of(run.device) is not None


def print_table(console: Any, run: Any, results: Sequence[dict[str, Any]], config: Any) -> None:
    """The table of dry runs (each length's plan in bold green, a set over the budget in red), then
    one note per distinct reason a dry run did not run."""
    from rich.table import Table

    table = Table(title=_table_title(run), title_justify="left")
    fits = ([f"fits {b.name.split(' ')[0]}" for b in run.budgets] if len(run.budgets) > 1 else
            ["fits"] if run.usable is not None else [])
    headers = ["seq_len", "batch", "mitigations", "peak", *(["host"] if _shows_host(run) else []),
               *fits, *([f"fits from N (≤ {run.world[0]})"]
                        if run.world is not None and run.usable is not None else []),
               "time"]
    for header in headers:
        table.add_column(header, justify="left" if header == "mitigations" else "right")
    errors: dict[str, int] = {}  # distinct reason a dry run did not run -> its note number
    for res in results:
        for row in res["rows"]:
            chosen = (res["plan"] is not None and row["mitigations"] == res["plan"]
                      and bool(row.get("offload")) == res.get("plan_offload", False))
            table.add_row(*_table_cells(run, res, row, errors), style="bold green" if chosen
                          else ("red" if row["fits"] is False else None))
        table.add_section()
    console.print(table)
    from rich.markup import escape

    for error, number in errors.items():
        console.print(f"[yellow][{number}][/yellow] {escape(error)}", highlight=False)
    if errors:
        console.print(f"(`seqmem forecast --config {config} --lengths ...` predicts from short "
                      "real steps where the dry run does not run)")


def _nothing_fits_line(res: dict[str, Any], usable: int, last_set: Sequence[str],
                       largest: Optional[int], searched: bool) -> str:
    """The line of a length nothing fits: the lowest peak, the largest length the last set fits."""
    lowest = min((r for r in res["rows"] if r["peak_bytes"] is not None and not r.get("offload")),
                 key=lambda r: r["peak_bytes"])
    if largest is not None:
        longest = (f"the largest length that fits with {joined_names(last_set)} is "
                   f"[bold]{largest}[/bold] tokens")
    elif searched:
        longest = f"not even {SEARCH_MULTIPLE} tokens fit with {joined_names(last_set)}"
    else:
        longest = "no length that fits was searched for"
    return (f"seq_len {res['seq_len']}: [red]nothing fits[/red]: the lowest peak is "
            f"{format_bytes(lowest['peak_bytes'])} ({setting_name(lowest)}) over "
            f"{format_bytes(usable)} usable; {longest}")


def _print_plan_of(console: Any, res: dict[str, Any], usable: int) -> None:
    """The cheapest plan of one length that has one, and the fastest setting that fits there."""
    offload = res.get("plan_offload", False)
    row = next(r for r in res["rows"]
               if r["mitigations"] == res["plan"] and bool(r.get("offload")) == offload)
    what = setting_name(row) if res["plan"] or offload else "no mitigation needed"
    host = (f", {format_bytes(row['host_peak_bytes'] or 0)} on the host: FSDP2 CPUOffloadPolicy"
            if offload else "")
    console.print(f"seq_len {res['seq_len']}: cheapest plan: [bold]{what}[/bold] "
                  f"({format_bytes(row['peak_bytes'])} of {format_bytes(usable)} usable{host})")
    fast = res["fastest"]
    if fast is not None:
        console.print(f"seq_len {res['seq_len']}: fastest that fits: "
                      f"[bold]{joined_names(fast['mitigations'])}[/bold], peak "
                      f"{format_bytes(fast['peak_bytes'])}, step time "
                      f"{(fast['step_time_factor'] - 1) * 100:+.0f}% by the rungs' priors "
                      f"({fast['why']})", highlight=False)


def print_plans(console: Any, results: Sequence[dict[str, Any]], usable: Optional[int],
                last_set: Sequence[str], largest: Optional[int], searched: bool,
                foreach: bool = False) -> None:
    """Per length (with a budget): the cheapest plan and the fastest that fits, or why none
    (``foreach``: the optimizer steps foreach, and ``foreach=False`` would lower the floor)."""
    if usable is None:
        return
    floor = min((r["optimizer_peak_bytes"] for res in results for r in res["rows"]
                 if not r.get("offload") and r.get("optimizer_peak_bytes")), default=None)
    if floor is not None and dry_run_bound(floor) > usable:  # no rung lowers it
        console.print(f"the optimizer step alone peaks at {format_bytes(floor)} (parameters, "
                      "gradients, optimizer state and the step's temporaries), over "
                      f"{format_bytes(usable)} usable: no setting without offload fits at any "
                      "length" + ("; the optimizer's foreach=False steps one tensor at a time, "
                                  "with fewer temporaries: plan it too" if foreach else ""),
                      highlight=False)
    for res in results:
        if res["plan"] is not None:
            _print_plan_of(console, res, usable)
        elif all(r["peak_bytes"] is None for r in res["rows"]):
            console.print(f"seq_len {res['seq_len']}: no plan: the dry run failed for every set "
                          "(see the table)")
        else:
            console.print(_nothing_fits_line(res, usable, last_set, largest, searched))


def print_longest(console: Any, longest: Sequence[dict[str, Any]]) -> None:
    """Per setting dry-run: its prior step-time cost and the longest length it fits."""
    for entry in longest:
        host = entry.get("host_peak_bytes")
        console.print(f"{setting_name(entry)} (step time {_step_time(entry)}): longest length that "
                      f"fits of those dry-run ({', '.join(map(str, entry['dry_run_lengths']))}): "
                      + (f"{entry['seq_len']}" if entry["seq_len"] else "none")
                      + (f"; longest that fits (searched): {entry['searched_seq_len'] or 'none'}"
                         if "searched_seq_len" in entry else "")
                      + (f"; host memory {format_bytes(host)}" if host is not None else ""),
                      highlight=False)


def _step_time(entry: dict[str, Any]) -> str:
    """A setting's step-time cost by the rungs' priors; offload's host transfers and host optimizer
    step are not priced (they depend on the host link and CPU: time a step)."""
    cost = f"{(entry['step_time_factor'] - 1) * 100:+.0f}% by priors"
    return cost + " + host transfers" if entry.get("offload") else cost


def _longest_cell(entry: Optional[dict[str, Any]]) -> str:
    if entry is None:
        return "-"
    length = entry.get("searched_seq_len", entry["seq_len"])
    if not length:
        return "none"
    return (("≥ " if entry.get("open_ended") else "") + str(length)
            + ("" if "searched_seq_len" in entry else "*"))


def print_devices_longest(console: Any, run: Any, devices: Sequence[dict[str, Any]]) -> None:
    """Several devices: one table, a row per setting dry-run: its prior step-time cost, the longest
    length it fits on each device (searched with ``--longest``, else of the lengths dry-run) and
    the host memory it holds at the longest length it fits (its dry run's host peak)."""
    from rich.table import Table

    by_device = [{(tuple(e["mitigations"]), bool(e.get("offload"))): e for e in d["longest"]}
                 for d in devices]
    settings = list(dict.fromkeys(k for d in by_device for k in d))
    table = Table(title="longest length each setting fits, per device (tokens)",
                  title_justify="left")
    for header in ["setting", "step time", *(b.name for b in run.budgets), "host memory"]:
        table.add_column(header, justify="left" if header == "setting" else "right")
    for names in settings:
        entries = [d.get(names) for d in by_device]
        first = next(e for e in entries if e is not None)
        hosts = [(e["host_peak_bytes"], e.get("host_at_seq_len")) for e in entries
                 if e is not None and e.get("host_peak_bytes") is not None]
        host = max(hosts, key=lambda h: h[0]) if hosts else None
        table.add_row(setting_name(first), _step_time(first), *(_longest_cell(e) for e in entries),
                      "-" if host is None else f"{format_bytes(host[0])} at {host[1]}")
    console.print(table)
    console.print("(≥ N: fits the longest length asked; N*: the longest of the lengths dry-run, "
                  "not searched (--longest searches); -: not dry-run on that device; host memory: "
                  "the setting's host peak at the longest length it fits, else the shortest "
                  "dry-run)")
    if run.host_budget is None and any(e.get("offload") for d in devices for e in d["longest"]):
        console.print("host memory not judged: pass --host-budget (the training machine's RAM) to "
                      "hold offload settings to it", highlight=False)


def print_totals(console: Any, run: Any, modelled: Sequence[dict[str, Any]],
                 seconds: float) -> None:
    """The last line: wall time, dry runs and their time, what a peak counts."""
    from lightning_seqmem.dryrun.accelerator import is_simulated

    where = ("the simulated CUDA device: allocator blocks as max_memory_allocated, CUDA's "
             "autocast, modelled kernels" if is_simulated(run.device)
             else "on CUDA allocator blocks, as max_memory_allocated")
    processes = getattr(run, "processes", 1)
    console.print(f"total {seconds:.1f}s: {run.dry_runs} dry runs in {run.dry_seconds:.1f}s"
                  + (f" (summed over {processes} processes)" if processes > 1 else "")
                  + (f", and {len(modelled)} modelling refused rungs" if modelled else "")
                  + f"; peaks are live tensor bytes ({where}; not reserved memory, workspaces or "
                  "the CUDA context: that is what the safety margin is for)")
    if getattr(run, "offloads", False):
        console.print(OFFLOAD_ASSUMED, highlight=False)


OFFLOAD_ASSUMED = (
    "offload settings: parameters, gradients and optimizer state on the host as FSDP2 "
    "fully_shard(..., offload_policy=CPUOffloadPolicy()) runs them (ModelParallelStrategy), "
    "dry-run on device and host; DeepSpeed's equivalent: Trainer(strategy=DeepSpeedStrategy("
    "stage=3, offload_optimizer=True, offload_parameters=True)) (its fp32 master copy on the host "
    "is 4 bytes per parameter more there; see --emit deepspeed)")
"""What a plan with offload settings assumed (printed last; ``offload_assumed`` in ``--json``)."""


__all__ = ["OFFLOAD_ASSUMED", "SEARCH_MULTIPLE", "fits_cell", "setting_name", "joined_names",
           "modelled_line", "print_devices_longest", "print_header", "print_longest",
           "print_peak_at", "print_plans", "print_table", "print_totals"]
