"""What every dry run of one ``seqmem plan`` shares (:class:`PlanRun`), and what it answers: the
rows of one length, the fastest setting that fits, the longest length a setting fits. Each dry run
(:meth:`PlanRun.dry`) is made once per ``(seq_len, mitigations, world, offload)`` for every device,
a stack of identical blocks on shallow copies (:mod:`lightning_seqmem.dryrun.depth`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from lightning_seqmem.cli.plan_devices import DeviceBudget
from lightning_seqmem.cli.plan_text import SEARCH_MULTIPLE
from lightning_seqmem.plan.judging import dry_run_bound

__all__ = ["PlanRun", "fastest", "largest_fitting", "longest_by_set", "mitigation_sets",
           "modelled_rows", "peak_at", "search_longest", "setting_key"]

Setting = tuple[str, ...]


@dataclass
class PlanRun:
    """The config's model (on ``meta``, converted as fit does), optimizer, first batch, step context
    and device, the mitigation sets, the devices answered for (``budgets``, the single-budget
    output's first) and every dry run made. ``world``: ``(N, strategy)`` with ``--world-size``."""

    trainer: Any
    model: Any
    optimizer: Any
    optimizer_name: str
    batch: Any
    batch_size: int
    context: Any
    device: Any
    sets: list[Setting]
    skipped: dict[str, str]
    checks: dict[str, Any]
    budgets: list[DeviceBudget]
    margin: float
    world: Optional[tuple[int, str]]
    host_budget: Optional[int] = None
    cache: dict[tuple[Any, ...], dict[str, Any]] = field(default_factory=dict)
    dry_runs: int = 0  # dry runs made (cache misses), in every process
    dry_seconds: float = 0.0  # their time, summed over the processes that made them
    processes: int = 1  # processes that dry-ran the table's rows (:mod:`.plan_workers`)

    @property
    def budget(self) -> Optional[int]:
        """The first device's budget (bytes), None without one."""
        return self.budgets[0].budget_bytes if self.budgets else None

    @property
    def usable(self) -> Optional[int]:
        """The first device's usable budget (bytes), None without one."""
        return self.budgets[0].usable_bytes if self.budgets else None

    @property
    def ladder_rungs(self) -> list[str]:
        """The rungs this run may take, in its order (their variants apart)."""
        from lightning_seqmem.core.rungs import level_of

        return [n for n in self.checks if level_of(n) is None]

    @property
    def device_type(self) -> str:
        """The device type step-time priors are taken on (``cuda`` for the simulated device)."""
        from lightning_seqmem.dryrun.accelerator import stands_for

        return stands_for(self.device)

    @property
    def offloads(self) -> bool:
        """Whether offload settings are planned: the dry runs keep a host apart (an accelerator, or
        the simulated one) and the ranks shard with FSDP2 (one device is a world of one)."""
        from lightning_seqmem.dryrun.accelerator import host_of

        return host_of(self.device) is not None and (self.world is None or self.world[1] == "fsdp2")

    @property
    def splits_sequence(self) -> bool:
        """Whether sequence-parallel layouts may be planned: N ≥ 2 ranks sharded with FSDP2."""
        return self.world is not None and self.world[1] == "fsdp2" and self.world[0] >= 2

    def dry(self, seq_len: int, names: Setting, world: Optional[tuple[int, str]] = None,
            offload: bool = False) -> dict[str, Any]:
        """The dry run of ``names`` at ``(seq_len, batch_size)`` (``world = (N, strategy)``;
        ``offload``: FSDP2 ``CPUOffloadPolicy``), made once and kept: a row ``{"mitigations",
        "offload", "peak_bytes", "host_peak_bytes", "seconds", "error"}``."""
        key = (int(seq_len), tuple(names), world, bool(offload))
        if key not in self.cache:
            self.cache[key] = self._run(int(seq_len), tuple(names), world, bool(offload))
        return dict(self.cache[key])

    def _run(self, seq_len: int, names: Setting, world: Optional[tuple[int, str]],
             offload: bool) -> dict[str, Any]:
        from lightning_seqmem.dryrun.result import DryRunUnsupported

        started = time.perf_counter()
        result = error = None
        try:
            if offload or world is not None:  # offload: FSDP2, one rank without a world
                from lightning_seqmem.dryrun.depth import depth_sharded_dry_run_step

                result = depth_sharded_dry_run_step(
                    self.model, self.batch, seq_len, 1 if world is None else world[0],
                    self.batch_size, names, "fsdp2" if offload else world[1], self.context,
                    self.device, offload=offload)
            else:
                from lightning_seqmem.dryrun.depth import depth_dry_run_step

                result = depth_dry_run_step(self.model, self.optimizer, self.batch, seq_len,
                                            self.batch_size, names, self.context, self.device)
        except DryRunUnsupported as exc:
            error = f"unsupported: {exc.reason}"
        except Exception as exc:  # noqa: BLE001 - one failed row must not hide the others
            error = f"failed: {type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - started
        self.dry_runs += 1
        self.dry_seconds += seconds
        return {"mitigations": list(names), "offload": offload,
                "peak_bytes": None if result is None else result.peak_bytes,
                "host_peak_bytes": (None if result is None
                                    else getattr(result, "host_peak_bytes", None)),
                "optimizer_peak_bytes": (None if result is None
                                         else result.phase_peak_bytes.get("optimizer")),
                "seconds": seconds, "error": error}

    def table_keys(self, lengths: Sequence[int]) -> list[tuple[Any, ...]]:
        """The cache keys of the table's rows (:meth:`rows`) at ``lengths``: each set at each
        length, with and (:attr:`offloads`) without offload, at the run's world."""
        offloads = (False, True) if self.offloads else (False,)
        return [(int(L), tuple(s), self.world, off) for L in lengths for s in self.sets
                for off in offloads]

    def state_floor(self) -> Optional[int]:
        """The least optimizer-step peak (bytes) of the dry runs without offload so far: no rung
        lowers it: over a device's usable budget no setting without offload fits (not searched)."""
        floors = [row["optimizer_peak_bytes"] for (_, _, _, off), row in self.cache.items()
                  if not off and row.get("optimizer_peak_bytes") is not None]
        return min(floors, default=None)

    def over_at_shorter(self, seq_len: int, names: Setting, usable: int,
                        world: Optional[tuple[int, str]] = None) -> Optional[int]:
        """The bound (:func:`~lightning_seqmem.plan.judging.dry_run_bound`) of ``names`` dry-run
        at a length shorter than ``seq_len`` where it was already over ``usable``, else None: a
        step's peak does not fall as its sequence grows: over at ``seq_len`` too."""
        bounds = [dry_run_bound(row["peak_bytes"]) for (L, n, w, off), row in self.cache.items()
                  if L < seq_len and n == tuple(names) and w == world and not off
                  and row.get("peak_bytes") is not None]
        return max((b for b in bounds if b > usable), default=None)

    def beyond_any_rung(self, usable: Optional[int]) -> bool:
        """Whether the bound of :meth:`state_floor` is over ``usable``: only offload can fit."""
        floor = self.state_floor()
        return usable is not None and floor is not None and dry_run_bound(floor) > usable

    def row(self, seq_len: int, names: Setting, usable: Optional[int],
            world: Optional[tuple[int, str]] = None, offload: bool = False) -> dict[str, Any]:
        """:meth:`dry` with ``bound_bytes`` (the device peak with the dry run's margin) and
        ``fits``: the bound within ``usable`` and the host peak within the host budget
        (:func:`~lightning_seqmem.plan.budgets.fits_budgets`; None without a budget or a figure)."""
        from lightning_seqmem.plan.budgets import fits_budgets

        row = self.dry(seq_len, names, world, offload)
        row["fits"] = None
        row["bound_bytes"] = None if row["peak_bytes"] is None else dry_run_bound(row["peak_bytes"])
        if usable is not None and row["peak_bytes"] is not None:
            fit = fits_budgets(row["peak_bytes"], row["host_peak_bytes"] or 0, usable,
                               self.host_budget, bound_bytes=row["bound_bytes"])
            row["fits"] = fit.fits
            if fit.device_fits and not fit.host_fits:
                row["over_host"] = fit.reason
        return row

    def rows(self, seq_len: int, sets: Sequence[Setting],
             usable: Optional[int]) -> list[dict[str, Any]]:
        """One row per set at ``seq_len``, then (:attr:`offloads`) one per set with FSDP2
        ``CPUOffloadPolicy``; with ``world``, the per-rank peak at N ranks and, with a budget, the
        smallest world size up to N at which the set fits (``smallest_world_size``; no offload)."""
        rows = []
        for names in sets:
            row = self.row(seq_len, names, usable, self.world)
            if self.world is not None:
                smallest, peaks = None, {}
                if usable is not None and row["peak_bytes"] is not None:
                    from lightning_seqmem.dryrun.sharded import smallest_fitting_world_size

                    def peak_at_world(n: int) -> int:
                        peak = self.dry(seq_len, names, (n, self.world[1]))["peak_bytes"]
                        if peak is None:
                            raise RuntimeError(f"the dry run at world size {n} failed")
                        return peak

                    try:
                        smallest, peaks = smallest_fitting_world_size(
                            peak_at_world, usable, self.world[0],
                            {self.world[0]: row["peak_bytes"]}, bound=dry_run_bound)
                    except RuntimeError as exc:
                        row["error"] = f"failed: {exc}"
                row.update(world_size=self.world[0], smallest_world_size=smallest,
                           peak_bytes_by_world_size={str(n): v for n, v in sorted(peaks.items())})
            rows.append(row)
        if self.offloads:
            for names in sets:
                row = self.row(seq_len, names, usable, self.world, offload=True)
                if self.world is not None:
                    row.update(world_size=self.world[0], smallest_world_size=None,
                               peak_bytes_by_world_size={})
                rows.append(row)
        return rows


def mitigation_sets(seqmem: Any, trainer: Any, model: Any, batch: Any, batch_size: int,
                    checks_out: Optional[dict] = None,
                    device: Any = None) -> tuple[list[Setting], dict[str, str]]:
    """The mitigation sets to dry-run, cheapest first (each adds the next rung), and ``rung -> why
    skipped``; ``checks_out`` receives every rung's and variant's applicability. The rungs are the
    config's SeqMemCallback's (in its order), else the default ladder; a rung that would not change
    this model (already on SDPA, batch size 1, ...) is skipped, but on the simulated CUDA device one
    refused only because this machine is not that device (``Rung.modelled_where_refused``) is
    taken: its dry run models it."""
    from lightning_seqmem.dryrun.accelerator import is_simulated
    from lightning_seqmem.core.rungs import MITIGATIONS
    from lightning_seqmem.measure.batch_shape import infer_batch_shape
    from lightning_seqmem.mitigations.ladder import applicability, rung

    rungs = MITIGATIONS if seqmem is None else tuple(seqmem.configured_mitigations)  # in its order
    # a rung's check may read the batch size from the batch: give it only a batch with the rows
    # asked for (else None: it reads the unconnected trainer's loader, unknown); the size asked too
    rows = infer_batch_shape(batch)[0]
    checks = applicability(rungs, trainer, model, batch if rows > 1 or batch_size <= 1 else None,
                           batch_size)
    if is_simulated(device):
        for name in rungs:
            if not checks[name][0] and getattr(rung(name), "modelled_where_refused", False):
                checks[name] = (True, f"modelled for CUDA ({checks[name][1]} here)")
    if checks_out is not None:
        checks_out.update(checks)
    skipped: dict[str, str] = {}
    sets: list[Setting] = [()]
    for name in rungs:
        applies, reason = checks[name]
        if applies:
            sets.append((*sets[-1], name))
        else:
            skipped[name] = reason
    return sets, skipped


def largest_fitting(run: PlanRun, names: Setting, usable: int, lo: int, hi: int,
                    offload: bool = False) -> tuple[Optional[int], int]:
    """``(largest multiple of 8 below hi at which names fits, or None; dry runs made)``, per rank at
    the run's world size; ``lo`` is known to fit (0: nothing known). Searched by interpolation of
    the setting's dry runs (:func:`~lightning_seqmem.core.search.interpolated_last`: a step's peak
    is close to quadratic in the length, so a few dry runs find what a bisection needs a dozen
    for), on the larger of device peak over ``usable`` and host peak over the host budget."""
    from lightning_seqmem.core.search import interpolated_last

    before = run.dry_runs

    def over(units: int) -> float:
        row = run.dry(units * SEARCH_MULTIPLE, names, run.world, offload)
        if row["peak_bytes"] is None:
            return float("inf")
        host = (row["host_peak_bytes"] or 0) / run.host_budget if run.host_budget else 0.0
        return max(dry_run_bound(row["peak_bytes"]) / usable, host)

    known = {L // SEARCH_MULTIPLE: over(L // SEARCH_MULTIPLE)
             for (L, setting, world, off) in list(run.cache)
             if setting == tuple(names) and world == run.world and off == offload
             and L % SEARCH_MULTIPLE == 0}
    # in units of 8 tokens: lo fits (or is 0), hi does not
    lo = interpolated_last(over, 1.0, lo // SEARCH_MULTIPLE, -(-hi // SEARCH_MULTIPLE), known)
    return (lo * SEARCH_MULTIPLE or None), run.dry_runs - before


def fastest(run: PlanRun, seq_len: int, rows: list[dict[str, Any]], usable: Optional[int]
            ) -> tuple[Optional[dict[str, Any]], list[dict[str, Any]]]:
    """The fastest setting that fits at one length (:func:`~lightning_seqmem.plan.choose.choose`,
    priced by the rungs' step-time priors on the device simulated: nothing is timed), and the rows
    of the settings it dry-ran beyond ``rows`` (the ladder's prefixes)."""
    from types import SimpleNamespace

    from lightning_seqmem.core.units import format_bytes
    from lightning_seqmem.plan.choose import choose
    from lightning_seqmem.plan.pricing import prior_factor

    if usable is None or run.beyond_any_rung(usable):
        return None, []
    known = {tuple(r["mitigations"]): r for r in rows if not r.get("offload")}
    extra: list[dict[str, Any]] = []

    def row(names: Setting) -> dict[str, Any]:
        if names not in known:
            known[names] = run.row(seq_len, names, usable, run.world)
            extra.append(known[names])
        return known[names]

    def judge(names: Setting) -> Any:
        shorter = None if names in known else run.over_at_shorter(seq_len, names, usable, run.world)
        if shorter is not None:  # over at a shorter length: over here too
            return SimpleNamespace(kind="over", bound_bytes=shorter)
        r = row(names)
        kind = ("unknown" if r["bound_bytes"] is None
                else ("fits" if r["bound_bytes"] <= usable else "over"))
        return SimpleNamespace(kind=kind, bound_bytes=r["bound_bytes"])

    device_type = run.device_type
    plain = known.get(())
    if plain is not None and plain["fits"]:
        choice_setting, why = (), "no mitigation needed"
    else:
        choice = choose((), run.ladder_rungs, run.checks, judge,
                        lambda s: prior_factor(s, device_type), fmt=format_bytes, usable=usable)
        if choice is None or not choice.fits:
            return None, extra
        choice_setting, why = choice.setting, choice.why
    r = known[choice_setting]
    return {"mitigations": list(choice_setting), "peak_bytes": r["peak_bytes"],
            "bound_bytes": r["bound_bytes"],
            "step_time_factor": prior_factor(choice_setting, device_type), "why": why}, extra


def setting_key(row: dict[str, Any]) -> tuple[Setting, bool]:
    """A row's setting: its rungs and whether it offloads."""
    return tuple(row["mitigations"]), bool(row.get("offload"))


def longest_by_set(results: list[dict[str, Any]], usable: Optional[int],
                   device_type: Optional[str] = None) -> list[dict[str, Any]]:
    """Per setting dry-run (the ladder's prefixes, with and without offload, and those the fastest's
    search ran), the longest asked length it fits (device and host), its prior step-time factor
    (offload's host transfers are not priced) and its host peak there (empty without a budget)."""
    from lightning_seqmem.plan.pricing import prior_factor

    if usable is None:
        return []
    best: dict[tuple[Setting, bool], Optional[int]] = {}
    ran: dict[tuple[Setting, bool], list[int]] = {}
    host: dict[tuple[Setting, bool], tuple[int, int]] = {}
    for res in results:
        for row in res["rows"] + res.get("searched_rows", []):
            key = setting_key(row)
            fits = bool(row["fits"])
            best[key] = max(best.get(key) or 0, res["seq_len"] if fits else 0) or None
            ran.setdefault(key, []).append(res["seq_len"])
            if row.get("host_peak_bytes") is not None and (fits or key not in host):
                host[key] = (res["seq_len"], row["host_peak_bytes"])  # longest fit, else shortest
    # open_ended: it fits the longest length dry-run for it, so the longest it fits is at least that
    return [{"mitigations": list(k[0]), "offload": k[1], "seq_len": v,
             "step_time_factor": prior_factor(k[0], device_type), "dry_run_lengths": ran[k],
             "host_peak_bytes": host[k][1] if k in host else None,
             "host_at_seq_len": host[k][0] if k in host else None,
             "open_ended": v is not None and v == max(ran[k])}
            for k, v in best.items()]


def search_longest(run: PlanRun, entry: dict[str, Any], results: list[dict[str, Any]],
                   usable: int) -> tuple[Optional[int], int]:
    """(the longest multiple of 8 that ``entry``'s setting fits, dry runs): searched between the
    longest dry-run length it fits and the shortest it does not; with none over, the longest fit."""
    key = setting_key(entry)
    over = [res["seq_len"] for res in results for r in res["rows"] + res["searched_rows"]
            if setting_key(r) == key and r["fits"] is False]
    if not over:
        return entry["seq_len"], 0
    if not key[1] and run.beyond_any_rung(usable):
        return None, 0  # the state alone is over: no length fits
    hi = min(over)
    lo = max((L for L in [entry["seq_len"] or 0] if L < hi), default=0)
    return largest_fitting(run, key[0], usable, lo, hi, key[1])


def peak_at(run: PlanRun, seq_len: int, rows: Sequence[dict[str, Any]],
            plan: Optional[Sequence[str]]) -> Optional[dict[str, Any]]:
    """``mitigations`` and :meth:`~lightning_seqmem.core.peak.PeakSite.to_dict` of where the peak
    sits at ``seq_len`` (``"peak at"``: phase and kinds of tensor) in the chosen plan's step, else
    the lowest-peak set's; one more dry run, traced by
    :func:`~lightning_seqmem.diagnostics.peak_trace.trace_peak_site`. None where it cannot say."""
    from lightning_seqmem.diagnostics.peak_trace import trace_peak_site
    from lightning_seqmem.dryrun.depth import depth_dry_run_step as dry_run_step

    ran = [r for r in rows if r["peak_bytes"] is not None and not r.get("offload")]
    if not ran:
        return None
    names = (tuple(plan) if plan is not None
             else tuple(min(ran, key=lambda r: r["peak_bytes"])["mitigations"]))
    try:
        site = dry_run_step(run.model, run.optimizer, run.batch, seq_len, run.batch_size, names,
                            run.context, run.device, site=trace_peak_site).peak_site
    except Exception:  # noqa: BLE001 - the table stands without it
        return None
    return None if site is None else {"mitigations": list(names), **site.to_dict()}


def modelled_rows(run: PlanRun, base: Setting, results: list[dict[str, Any]],
                  usable: Optional[int]) -> list[dict[str, Any]]:
    """For each rung skipped here that a dry run still models (``Rung.modelled_where_refused``:
    activation offload on CPU), per length: the device peak with the last set and with it added,
    and the bytes it moves to host memory. Modelled, not measured (``"measured": false``)."""
    from lightning_seqmem.dryrun.depth import depth_dry_run_step as dry_run_step
    from lightning_seqmem.mitigations.ladder import rung

    rows = []
    for name, why in run.skipped.items():
        if not getattr(rung(name), "modelled_where_refused", False):
            continue
        for res in results:
            without = next(r for r in res["rows"] if setting_key(r) == (base, False))
            row = {"rung": name, "refused": why, "seq_len": res["seq_len"],
                   "mitigations": [*base, name], "peak_bytes_without": without["peak_bytes"],
                   "peak_bytes": None, "host_bytes": None, "saved_bytes": None, "fits": None,
                   "measured": False, "error": without["error"]}
            if without["peak_bytes"] is not None:
                try:
                    dry = dry_run_step(run.model, run.optimizer, run.batch, res["seq_len"],
                                       run.batch_size, (*base, name), run.context, run.device)
                    row.update(peak_bytes=dry.peak_bytes, host_bytes=dry.host_bytes,
                               saved_bytes=without["peak_bytes"] - dry.peak_bytes,
                               fits=None if usable is None
                               else dry_run_bound(dry.peak_bytes) <= usable)
                except Exception as exc:  # noqa: BLE001 - a modelled row must not hide the table
                    row["error"] = f"failed: {type(exc).__name__}: {exc}"
            rows.append(row)
    return rows
