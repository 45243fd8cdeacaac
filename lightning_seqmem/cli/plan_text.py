"""``seqmem plan``'s text output: the table of dry runs, the plan of each length, the longest length
each setting fits, where the peak sits and the totals (the JSON document is :mod:`.plan`'s).

Every function here prints what it is given: the dry runs are done (:mod:`.plan`).

Example:
    >>> joined_names(("attention", "checkpointing")), joined_names(())
    ('attention + checkpointing', 'none')
    >>> fits_cell({"fits": False}, 1), fits_cell({"fits": None}, 1), fits_cell({"fits": True}, None)
    (['NO'], ['-'], [])
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

SEARCH_MULTIPLE = 8  # "nothing fits": the largest fitting length is searched among multiples of this


def joined_names(names: Sequence[str]) -> str:
    """A mitigation set in words, ``"a + b"`` (``"none"`` for the empty set): every line of
    ``seqmem plan`` that names a set, :mod:`.plan`'s progress line too (example above)."""
    return " + ".join(names) if names else "none"


def fits_cell(row: dict[str, Any], usable: Optional[int]) -> list[str]:
    """The ``fits`` cell of a table row (none without a budget: the column is not there); the
    ``--world-size`` table of :mod:`.parallel` shares it (example above)."""
    return [] if usable is None else ["-" if row["fits"] is None else ("yes" if row["fits"] else "NO")]


def modelled_line(row: dict[str, Any]) -> str:
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
            f"{format_bytes(without)} with {joined_names(base)} ({change}, {-saved / without:+.0%}), "
            f"{format_bytes(row['host_bytes'])} of saved activations moved to host memory per step")


def print_peak_at(console: Any, results: Sequence[dict[str, Any]]) -> None:
    """One ``peak at`` line per length: the phase and the kinds of tensor holding the peak."""
    for res in results:
        site = res.get("peak_at")
        if site is not None:
            console.print(f"seq_len {res['seq_len']}: peak at {site['describe']} "
                          f"(with {joined_names(site['mitigations'])})", highlight=False)


def print_header(console: Any, run: Any, sequence_parallel: bool) -> None:
    """What is planned (model, precision, device, optimizer, batch), the rungs skipped and, at N ranks,
    how the ranks are modelled (``sequence_parallel``: the sequence split is searched too)."""
    model = run.model
    console.print(f"[bold]seqmem plan[/bold]: {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} "
                  f"parameters), {run.trainer.precision} precision, on {run.device}, optimizer {run.optimizer_name}, "
                  f"batch {run.batch_size}; one fake training step per length and mitigation set (nothing is allocated)")
    from rich.markup import escape

    for name, reason in run.skipped.items():  # (an install hint holds `[tiled]`: not markup)
        console.print(f"rung {name} skipped: {escape(reason)}", highlight=False)
    world = run.world
    if world is None:
        return
    from lightning_seqmem.dryrun.sharded import context_parallel_note

    console.print(f"per rank at world size {world[0]} ({world[1]}: "
                  + ("parameters, gradients and optimizer state sharded with fully_shard on each block and the "
                     "root, or as the model's configure_model() shards them" if world[1] == "fsdp2" else
                     "every rank holds the whole model, plus DDP's gradient buckets")
                  + "), by a dry run in a fake process group; batch is per rank")
    if not sequence_parallel:
        console.print(context_parallel_note(run.device))


def _table_title(run: Any) -> str:
    from lightning_seqmem.core.units import format_bytes

    title = f"seqmem plan: predicted peak of one training step (dry run), batch {run.batch_size}"
    if run.usable is not None:
        title += (f"; fits = peak within the usable budget {format_bytes(run.usable)} ({format_bytes(run.budget)} − "
                  f"{run.margin:.0%} safety margin)")
    if run.world is not None:
        title = title.replace("predicted peak of one training step", f"predicted per-rank peak at {run.world[0]} ranks "
                              f"({run.world[1]})")
    return title


def _table_cells(run: Any, res: dict[str, Any], row: dict[str, Any], errors: dict[str, int]) -> list[str]:
    """One row of the table; a row's error gets its note number in ``errors`` (first seen, first numbered)."""
    from rich.markup import escape

    from lightning_seqmem.core.units import format_bytes

    if row["error"] is None:
        peak = format_bytes(row["peak_bytes"])
    else:
        number = errors.setdefault(row["error"], len(errors) + 1)
        peak = f"{escape(row['error'].split(':')[0])} [{number}]"
    smallest = []
    if run.world is not None and run.usable is not None:
        smallest = ["-" if row["error"] else (str(row["smallest_world_size"]) if row["smallest_world_size"]
                                              else f"> {run.world[0]}")]
    return [str(res["seq_len"]), str(run.batch_size), joined_names(row["mitigations"]), peak,
            *fits_cell(row, run.usable), *smallest, f"{row['seconds']:.1f}s"]


def print_table(console: Any, run: Any, results: Sequence[dict[str, Any]], config: Any) -> None:
    """The table of dry runs (the plan of each length in bold green, a set over the budget in red), then
    one note per distinct reason a dry run did not run."""
    from rich.table import Table

    table = Table(title=_table_title(run), title_justify="left")
    headers = ["seq_len", "batch", "mitigations", "peak", *(["fits"] if run.usable is not None else []),
               *([f"fits from N (≤ {run.world[0]})"] if run.world is not None and run.usable is not None else []),
               "time"]
    for header in headers:
        table.add_column(header, justify="left" if header == "mitigations" else "right")
    errors: dict[str, int] = {}  # each distinct reason a dry run did not run -> its note number, below the table
    for res in results:
        for row in res["rows"]:
            chosen = res["plan"] is not None and row["mitigations"] == res["plan"]
            table.add_row(*_table_cells(run, res, row, errors),
                          style="bold green" if chosen else ("red" if row["fits"] is False else None))
        table.add_section()
    console.print(table)
    from rich.markup import escape

    for error, number in errors.items():
        console.print(f"[yellow][{number}][/yellow] {escape(error)}", highlight=False)
    if errors:
        console.print(f"(`seqmem forecast --config {config} --lengths ...` predicts from short real steps "
                      "where the dry run does not run)")


def _nothing_fits_line(res: dict[str, Any], usable: int, last_set: Sequence[str], largest: Optional[int],
                       searched: bool) -> str:
    """The line of a length nothing fits at: the lowest peak and the largest length the last set fits."""
    from lightning_seqmem.core.units import format_bytes

    lowest = min((r for r in res["rows"] if r["peak_bytes"] is not None), key=lambda r: r["peak_bytes"])
    if largest is not None:
        longest = f"the largest length that fits with {joined_names(last_set)} is [bold]{largest}[/bold] tokens"
    elif searched:
        longest = f"not even {SEARCH_MULTIPLE} tokens fit with {joined_names(last_set)}"
    else:
        longest = "no length that fits was searched for"
    return (f"seq_len {res['seq_len']}: [red]nothing fits[/red]: the lowest peak is "
            f"{format_bytes(lowest['peak_bytes'])} ({joined_names(lowest['mitigations'])}) over "
            f"{format_bytes(usable)} usable; {longest}")


def _print_plan_of(console: Any, res: dict[str, Any], usable: int) -> None:
    """The cheapest plan of one length that has one, and the fastest setting that fits there."""
    from lightning_seqmem.core.units import format_bytes

    peak = next(r["peak_bytes"] for r in res["rows"] if r["mitigations"] == res["plan"])
    what = joined_names(res["plan"]) if res["plan"] else "no mitigation needed"
    console.print(f"seq_len {res['seq_len']}: cheapest plan: [bold]{what}[/bold] "
                  f"({format_bytes(peak)} of {format_bytes(usable)} usable)")
    fast = res["fastest"]
    if fast is not None:
        console.print(f"seq_len {res['seq_len']}: fastest that fits: [bold]{joined_names(fast['mitigations'])}"
                      f"[/bold], peak {format_bytes(fast['peak_bytes'])}, step time "
                      f"{(fast['step_time_factor'] - 1) * 100:+.0f}% by the rungs' priors ({fast['why']})",
                      highlight=False)


def print_plans(console: Any, results: Sequence[dict[str, Any]], usable: Optional[int], last_set: Sequence[str],
                largest: Optional[int], searched: bool) -> None:
    """Per length (with a budget): the cheapest plan and the fastest that fits, or why there is none."""
    if usable is None:
        return
    for res in results:
        if res["plan"] is not None:
            _print_plan_of(console, res, usable)
        elif all(r["peak_bytes"] is None for r in res["rows"]):
            console.print(f"seq_len {res['seq_len']}: no plan: the dry run failed for every set (see the table)")
        else:
            console.print(_nothing_fits_line(res, usable, last_set, largest, searched))


def print_longest(console: Any, longest: Sequence[dict[str, Any]]) -> None:
    """Per setting dry-run: its prior step-time cost and the longest length it fits (searched, with ``--longest``)."""
    for entry in longest:
        console.print(f"{joined_names(entry['mitigations'])} "
                      f"(step time {(entry['step_time_factor'] - 1) * 100:+.0f}% by "
                      f"priors): longest length that fits of those dry-run ({', '.join(map(str, entry['dry_run_lengths']))}): "
                      + (f"{entry['seq_len']}" if entry["seq_len"] else "none")
                      + (f"; longest that fits (searched): {entry['searched_seq_len'] or 'none'}"
                         if "searched_seq_len" in entry else ""), highlight=False)


def print_totals(console: Any, results: Sequence[dict[str, Any]], search_runs: int, search_seconds: float,
                 modelled: Sequence[dict[str, Any]], seconds: float) -> None:
    """The last line: wall time, dry runs and their time, what a peak counts."""
    dry_seconds = sum(r["seconds"] for res in results for r in res["rows"] + res["searched_rows"]) + search_seconds
    runs = sum(len(res["rows"]) + len(res["searched_rows"]) for res in results) + search_runs
    console.print(f"total {seconds:.1f}s: {runs} dry runs in {dry_seconds:.1f}s"
                  + (f" ({search_runs} in the search for the largest length that fits)" if search_runs else "")
                  + (f", and {len(modelled)} modelling refused rungs" if modelled else "")
                  + "; peaks are live tensor bytes (on CUDA allocator blocks, as max_memory_allocated; not "
                  "reserved memory, workspaces or the CUDA context: that is what the safety margin is for)")


__all__ = ["SEARCH_MULTIPLE", "fits_cell", "joined_names", "modelled_line", "print_header", "print_longest",
           "print_peak_at", "print_plans", "print_table", "print_totals"]
