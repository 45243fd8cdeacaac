"""``seqmem plan --world-size N``: sequence/context-parallel degrees and offload beside the rungs.

Per length, layouts (:mod:`lightning_seqmem.plan.parallel`) are dry-run in search order: the
ladder's sets and the fastest fitting one cheapest first, within a set the degree ascending (Ulysses
before ring); the first that fits the usable budget per rank is the plan. Only where nothing fits is
FSDP2 ``CPUOffloadPolicy`` dry-run on the rows run (:mod:`lightning_seqmem.dryrun.cpu_offload`:
device and host peaks, judged by :func:`lightning_seqmem.plan.budgets.fits_budgets`); where that dry
run is refused, :func:`~lightning_seqmem.plan.parallel.offload_model` stands in (``peak_source``
says so). DeepSpeed ZeRO-3 offload is planned by the same rows."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from lightning_seqmem.cli.plan_text import fits_cell, joined_names
from lightning_seqmem.core.units import format_bytes
from lightning_seqmem.plan.judging import dry_run_bound

__all__ = ["optimizer_states_per_parameter", "parallel_plans"]

RING_NOTE = ("ring rows: PyTorch's own ring attention code (context_parallel's "
             "_templated_ring_attention, allgather rotation, float32 merge, and its backward) run "
             "on the CPU flash kernel in the fake process group; a real ring step (forward and "
             "backward) runs only on CUDA, where context_parallel dispatches the "
             "flash/efficient/cuDNN kernels: not measured on CPU (benchmarks/gpu_check.py "
             "--ring on a GPU)")


def optimizer_states_per_parameter(optimizer: Any) -> Optional[int]:
    """How many parameter-sized state tensors ``optimizer``'s class keeps (AdamW: 2), from one real
    step of a copy on a 4-element parameter; None when it cannot be told.

    Example:
        >>> import torch
        >>> optimizer_states_per_parameter(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]))
        2
    """
    import torch

    try:
        p = torch.nn.Parameter(torch.zeros(4))
        import inspect

        accepted = inspect.signature(type(optimizer).__init__).parameters
        copy = type(optimizer)([p], **{k: v for k, v in optimizer.defaults.items()
                                       if k in accepted and k != "params"})
        p.grad = torch.ones(4)
        copy.step()
        return sum(1 for t in copy.state[p].values()
                   if isinstance(t, torch.Tensor) and t.numel() == 4)
    except Exception:  # noqa: BLE001 - an unknown optimizer: the offload model says so
        return None


def _peak_row(rows: Sequence[dict[str, Any]], names: tuple[str, ...]) -> Optional[dict[str, Any]]:
    return next((r for r in rows if tuple(r["mitigations"]) == tuple(names)), None)


@dataclass(frozen=True)
class _Shard:
    """What every sequence-parallel dry run of one ``seqmem plan --world-size N`` shares."""

    model: Any
    batch: Any
    batch_size: int
    context: Any
    device: Any
    world_size: int
    usable: Optional[int]
    state: dict[str, int]  # one rank's parameter/gradient/optimizer-state bytes (the formula's)
    host_budget: Optional[int] = None  # bytes of host memory per rank's process (None: not judged)
    peaks: dict = field(default_factory=dict)  # the dry runs made (by length, rungs and layout)

    def dry(self, L: int, names: Sequence[str], degree: int, kind: str, offload: bool) -> Any:
        """The dry run of one rank's shard, made once (every device's search reads it)."""
        from lightning_seqmem.dryrun.depth import depth_sequence_parallel_dry_run_step

        key = (L, tuple(names), degree, kind, offload)
        if key not in self.peaks:
            self.peaks[key] = depth_sequence_parallel_dry_run_step(
                self.model, self.batch, L, self.world_size, degree, kind, self.batch_size,
                tuple(names), self.context, self.device, offload=offload)
        return self.peaks[key]


def _attention_calls(console: Any, shard: _Shard, names: tuple[str, ...]) -> Any:
    """The model's attention calls, heads and mask with ``names`` on (none if unreadable), kept."""
    from lightning_seqmem.dryrun.sequence_parallel import AttentionCalls, attention_calls

    if ("calls", names) not in shard.peaks:
        try:
            shard.peaks["calls", names] = attention_calls(
                shard.model, shard.batch, 64, shard.batch_size, names, shard.context, shard.device)
        except Exception as exc:  # noqa: BLE001 - the degrees are skipped with the reason
            console.print(f"[yellow]reading the model's attention calls failed[/yellow]: {exc}")
            return AttentionCalls()
    return shard.peaks["calls", names]


def _print_search(console: Any, world_size: int, kinds: tuple[str, ...], engine: Optional[str],
                  calls: Any) -> None:
    console.print(f"sequence parallelism at {world_size} ranks: the group lies within the world "
                  f"(dp_shard x degree = {world_size}; FSDP2 shards the parameters over all "
                  f"{world_size}, as torchtitan's dp_shard_cp mesh and DeepSpeed's ZeRO-3 do); "
                  "search order: the rung sets cheapest first (the ladder's and the fastest that "
                  "fits, by their step-time priors), within each the degree ascending "
                  "(Ulysses before ring), offload last; kinds searched: "
                  f"{', '.join(kinds) or 'none'}" + (f" (what {engine} runs)" if engine else "")
                  + f"; the model's attention: {calls.calls} {calls.attention} calls, "
                  f"{calls.n_heads} heads, "
                  f"{calls.n_kv_heads} KV heads, "
                  f"{'an explicit attn_mask' if calls.masked else 'no explicit mask'}")


def _blank_row(shard: _Shard, L: int, names: tuple[str, ...], layout: Any) -> dict[str, Any]:
    return {**layout.to_json(), "layout": layout.name(), "mitigations": list(names), "seq_len": L,
            "batch_size": shard.batch_size, "tokens_per_rank": layout.local_seq_len(L),
            "peak_source": "dry run", "host_bytes": None, "peak_bytes": None, "error": None,
            "seconds": 0.0}


def _layout_row(shard: _Shard, res: dict[str, Any], names: tuple[str, ...], layout: Any,
                no_sdpa: dict[tuple[str, ...], str]) -> dict[str, Any]:
    """One layout with ``names`` at ``res``'s length: degree 1 is the N-rank table's own row; a set
    whose model makes no SDPA call (``no_sdpa``, filled here) runs no degree above 1."""
    from lightning_seqmem.dryrun.result import DryRunUnsupported

    L = res["seq_len"]
    row = _blank_row(shard, L, names, layout)
    started = time.perf_counter()
    if layout.degree == 1:  # the table's row or the fastest setting's
        own = _peak_row(res["rows"] + res.get("searched_rows", []), names) or {}
        row.update(peak_bytes=own.get("peak_bytes"), error=own.get("error"),
                   seconds=own.get("seconds", 0.0))
    elif names in no_sdpa:
        row["error"] = no_sdpa[names]
    else:
        try:
            row["peak_bytes"] = shard.dry(L, names, layout.degree, layout.kind, False).peak_bytes
        except DryRunUnsupported as exc:
            row["error"] = f"unsupported: {exc.reason}"
            if "no scaled_dot_product_attention call" in exc.reason:
                no_sdpa[names] = row["error"]
        except Exception as exc:  # noqa: BLE001 - one failed row must not hide the others
            row["error"] = f"failed: {type(exc).__name__}: {exc}"
        row["seconds"] = time.perf_counter() - started
    row["bound_bytes"] = None if row["peak_bytes"] is None else dry_run_bound(row["peak_bytes"])
    row["fits"] = (None if shard.usable is None or row["bound_bytes"] is None
                   else row["bound_bytes"] <= shard.usable)
    return row


def _by_cost(res: dict[str, Any], sets: Sequence[tuple[str, ...]],
             device_type: str) -> list[tuple[str, ...]]:
    """``sets`` and the fastest fitting setting if made of their rungs (engines switch rungs whole),
    cheapest first by step-time priors (ladder order on ties): none dearer than the callback's."""
    from lightning_seqmem.plan.pricing import prior_factor

    names = tuple((res.get("fastest") or {}).get("mitigations", ()))
    ours = names and names not in sets and set(names) <= {n for s in sets for n in s}
    return sorted([*sets, *([names] if ours else [])], key=lambda s: prior_factor(s, device_type))


def _first_fit(rows: list[dict[str, Any]], sets: Sequence[tuple[str, ...]], ok: Sequence[Any],
               row_of: Callable[..., Optional[dict[str, Any]]]) -> Optional[dict[str, Any]]:
    """The first row that fits (``row_of(names, layout)``; None: not a candidate), the sets in
    order, within each the layouts ``ok`` by degree; the rows made are appended to ``rows``. Where
    degree 1 does not fit, the largest degree is tried next: where it does not fit either, the
    set's other degrees are not run (a rank's peak falls as its share of the tokens does)."""
    top = [i for i, layout in enumerate(ok) if layout.degree == ok[-1].degree > 1]
    for names in sets:
        made: dict[int, Optional[dict[str, Any]]] = {}

        def row(i: int) -> Optional[dict[str, Any]]:
            if i not in made:
                made[i] = row_of(names, ok[i])  # noqa: B023 - called in this iteration only
            return made[i]

        for i in range(len(ok)):
            if row(i) is not None:
                rows.append(made[i])
                if made[i]["fits"]:
                    return made[i]
            if i == 0 and top and all(row(j) is not None and made[j]["fits"] is False
                                      for j in top):
                rows.extend(made[j] for j in top)
                break
    return None


def _offload_peaks(shard: _Shard, row: dict[str, Any]) -> dict[str, Any]:
    """The device and host peaks of ``row``'s layout and rungs with FSDP2 ``CPUOffloadPolicy``: a
    dry run; where it is refused, the formula on the row's own peak, marked so."""
    from lightning_seqmem.dryrun.result import DryRunUnsupported
    from lightning_seqmem.plan.parallel import offload_model

    degree = max(row["sequence_parallel_degree"], row["context_parallel_degree"])
    try:
        result = shard.dry(row["seq_len"], row["mitigations"], degree, row["sequence_parallel"],
                           True)
        return {"peak_source": "dry run", "peak_bytes": result.peak_bytes,
                "host_bytes": result.host_peak_bytes,
                "host_phase_peak_bytes": result.host_phase_peak_bytes}
    except DryRunUnsupported as exc:
        if row["peak_bytes"] is None:  # a layout not run without offload: no formula either
            return {"error": f"unsupported: {exc.reason}"}
        state = shard.state
        model = offload_model(row["peak_bytes"], state["parameter_shard_bytes"],
                              state["gradient_shard_bytes"], state["optimizer_state_bytes"])
        return {"peak_source": f"formula (the offload dry run was refused: {exc.reason})",
                "peak_bytes": model["device_peak_bytes"], "host_bytes": model["host_bytes"]}


def _offload_row(shard: _Shard, row: dict[str, Any]) -> dict[str, Any]:
    """``row``'s layout and rungs again with FSDP2 CPU offload (:func:`_offload_peaks`), held
    against the device's usable budget and the host budget."""
    from lightning_seqmem.plan.budgets import fits_budgets

    started = time.perf_counter()
    off = {**row, "offload": True, "layout": row["layout"] + " + offload",
           **_offload_peaks(shard, row)}
    if off["peak_bytes"] is None:
        return {**off, "bound_bytes": None, "fits": None, "seconds": time.perf_counter() - started}
    off["bound_bytes"] = dry_run_bound(off["peak_bytes"])
    fit = fits_budgets(off["peak_bytes"], off["host_bytes"] or 0, shard.usable,
                       shard.host_budget, bound_bytes=off["bound_bytes"])
    off.update(fits=fit.fits, fit=fit.reason, seconds=time.perf_counter() - started)
    return off


def _length_plan(shard: _Shard, res: dict[str, Any], sets: Sequence[tuple[str, ...]],
                 kinds: tuple[str, ...], calls: Any, state: dict[str, int],
                 per_parameter: Optional[int]) -> dict[str, Any]:
    """The layouts of one length, searched (offload last, with a budget), as its JSON entry."""
    from lightning_seqmem.dryrun.accelerator import stands_for
    from lightning_seqmem.plan.parallel import layouts

    ok, skipped = layouts(shard.world_size, res["seq_len"], calls.n_heads, calls.n_kv_heads,
                          calls.masked, kinds, calls.attention)
    searched = (_by_cost(res, sets, stands_for(shard.device)) if shard.usable is not None
                else sets[-1:])
    rows: list[dict[str, Any]] = []
    no_sdpa: dict[tuple[str, ...], str] = {}  # sets without an SDPA call: no degree > 1 runs
    # the optimizer step's least peak (state shards: no degree changes them) over the budget
    floor = min((r["optimizer_peak_bytes"] for r in res["rows"]
                 if not r.get("offload") and r.get("optimizer_peak_bytes") is not None),
                default=None)
    state_over = (shard.usable is not None and floor is not None
                  and dry_run_bound(floor) > shard.usable)
    plan = _first_fit(rows, searched, ok[:1] if state_over else ok,
                      lambda names, layout: _layout_row(shard, res, names, layout, no_sdpa))
    if plan is None and shard.usable is not None:  # offload, in the same order
        run = {(tuple(r["mitigations"]), r["layout"]): r for r in rows}

        def offloaded(names: tuple[str, ...], layout: Any) -> Optional[dict[str, Any]]:
            row = run.get((names, layout.name()), _blank_row(shard, res["seq_len"], names, layout))
            return None if row["error"] else _offload_row(shard, row)

        plan = _first_fit(rows, searched, ok, offloaded)
    return {"seq_len": res["seq_len"], "rows": rows, "plan": plan, "state_over_budget": state_over,
            "skipped_degrees": [{"kind": k, "degree": d, "reason": why} for k, d, why in skipped],
            "attention": {"calls": calls.calls, "function": calls.attention,
                          "heads": calls.n_heads, "kv_heads": calls.n_kv_heads,
                          "explicit_mask": calls.masked},
            "state_bytes_per_rank": state, "optimizer_states_per_parameter": per_parameter,
            "host_budget_bytes": shard.host_budget}


def _layout_table(plans: Sequence[dict[str, Any]], world_size: int, usable: Optional[int]) -> Any:
    """The rows of every length's search (the plan in bold green)."""
    from rich.table import Table

    table = Table(title=f"seqmem plan: per-rank peak at {world_size} ranks with the sequence split "
                        "(dry run of one rank's shard: its tokens, the all-to-all or K/V buffers, "
                        "the collectives' outputs; formula: modelled)", title_justify="left")
    for header in ("seq_len", "layout", "mitigations", "tokens/rank", "peak/rank", "figure",
                   "host/rank", *(["fits"] if usable is not None else []), "time"):
        table.add_column(header, justify="left" if header in ("layout", "mitigations", "figure")
                         else "right")
    for entry in plans:
        for row in entry["rows"]:
            peak = (format_bytes(row["peak_bytes"]) if row["peak_bytes"] is not None
                    else (row["error"] or "-")[:60])
            table.add_row(str(row["seq_len"]), row["layout"], joined_names(row["mitigations"]),
                          str(row["tokens_per_rank"]), peak, row["peak_source"],
                          format_bytes(row["host_bytes"]), *fits_cell(row, usable),
                          f"{row['seconds']:.1f}s",
                          style="bold green" if row is entry["plan"] else None)
        table.add_section()
    return table


def _print_layout_plans(console: Any, plans: Sequence[dict[str, Any]], world_size: int,
                        usable: Optional[int], engine: Optional[str], device: Any) -> None:
    """Per length: degrees skipped, the cheapest layout (with ``--emit`` its launch config)."""
    from lightning_seqmem.cli.emit import emit
    from lightning_seqmem.dryrun.accelerator import stands_for

    for entry in plans:
        L = entry["seq_len"]
        for skip in entry["skipped_degrees"]:
            console.print(f"seq_len {L}: {skip['kind']} {skip['degree']} skipped: {skip['reason']}")
        if entry["state_over_budget"]:
            console.print(f"seq_len {L}: the optimizer step's state shards alone are over the "
                          "budget: no degree without offload is dry-run", highlight=False)
        plan = entry["plan"]
        if plan is not None:
            console.print(f"seq_len {L}: cheapest layout at {world_size} ranks: "
                          f"[bold]{plan['layout']}[/bold], rungs "
                          f"{joined_names(plan['mitigations'])} "
                          f"({format_bytes(plan['peak_bytes'])} per rank of {format_bytes(usable)} "
                          f"usable, {plan['peak_source']}"
                          + (f"; host {format_bytes(plan['host_bytes'])} per rank"
                             if plan["host_bytes"] else "") + ")")
            if engine is not None:
                plan["launch_config"] = emit(engine, plan, stands_for(device))
                console.print(f"--emit {engine} (seq_len {L}):", highlight=False)
                console.print(plan["launch_config"], highlight=False, markup=False)
        elif usable is not None:
            console.print(f"seq_len {L}: [red]no layout fits[/red] at {world_size} ranks (with "
                          "offload: device and host peaks dry-run)")


def parallel_plans(console: Any, model: Any, optimizer: Any, batch: Any, batch_size: int,
                   sets: Sequence[tuple[str, ...]], usable: Optional[int], context: Any,
                   device: Any, world_size: int, results: Sequence[dict[str, Any]],
                   kinds: tuple[str, ...], engine: Optional[str],
                   host_budget: Optional[int] = None,
                   peaks: Optional[dict] = None) -> list[dict[str, Any]]:
    """Search, print and return (JSON) the N-rank layouts of every length of ``results`` (the N-rank
    table's rows, reused at degree 1); offload rows are held against ``host_budget`` too (bytes;
    None: only the device's budget); ``peaks`` keeps the dry runs for another device's search."""
    from lightning_seqmem.cli.emit import ENGINE_KINDS, switched_sets
    from lightning_seqmem.dryrun.sequence_parallel import state_bytes

    if engine is not None:
        kinds = tuple(k for k in kinds if k in ENGINE_KINDS[engine])
        sets, left = switched_sets(engine, sets)  # those engine runs (its launch config)
    first = not peaks  # the first device's search: the notes every device's search shares
    if engine is not None and left and first:
        console.print(f"--emit {engine}: sets with {joined_names(left)} not searched ({engine} "
                      "has no switch for them; --emit lightning runs them)", highlight=False)
    per_parameter = optimizer_states_per_parameter(optimizer)
    state = state_bytes(model, world_size, per_parameter)
    shard = _Shard(model, batch, batch_size, context, device, world_size, usable, state,
                   host_budget, {} if peaks is None else peaks)
    calls = _attention_calls(console, shard, sets[-1])
    if first:
        _print_search(console, world_size, kinds, engine, calls)
    plans = [{**_length_plan(shard, res, sets, kinds, calls, state, per_parameter),
              "rungs_left_out": left if engine else []} for res in results]
    console.print(_layout_table(plans, world_size, usable))
    if "ring" in kinds and first:
        console.print(RING_NOTE)
    _print_layout_plans(console, plans, world_size, usable, engine, device)
    return plans
