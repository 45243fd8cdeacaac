"""The run report: what was measured, what both predictors say, what fits, what was done about it.

:func:`build_report` turns a :class:`~lightning_seqmem.planner.SeqMemPlanner` (what the callback
knows) into a plain, JSON-able dict (bytes everywhere); :func:`lightning_seqmem.outputs.write_report`
writes it as ``seqmem_report.json``, a Markdown summary ``seqmem_report.md`` and the figure
``seqmem_memory.png``; :func:`render_console` prints it as ``rich`` tables;
:func:`load_report` reads the JSON back. GiB/MiB appear only in the Markdown and console output.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from .advice import KINDS, nothing_fits
from .forecast import NotEnoughMeasurements
from .records import PHASES
from .units import display_unit, format_bytes

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

    from .planner import SeqMemPlanner

__all__ = [
    "JSON_NAME",
    "MARKDOWN_NAME",
    "PNG_NAME",
    "REPORT_FORMAT",
    "build_report",
    "load_report",
    "render_breakdown_console",
    "render_breakdown_markdown",
    "render_console",
    "render_markdown",
]  # writing the files: lightning_seqmem.outputs.write_report

REPORT_FORMAT = "lightning-seqmem-report/1"
JSON_NAME, MARKDOWN_NAME, PNG_NAME = "seqmem_report.json", "seqmem_report.md", "seqmem_memory.png"



# ----------------------------------------------------------------------------------------------
# Building
# ----------------------------------------------------------------------------------------------
def _run_facts(planner: "SeqMemPlanner", trainer: Optional["pl.Trainer"], device: Any = None,
               probe: Optional[str] = None) -> dict[str, Any]:
    import lightning
    import torch
    from . import __version__

    facts: dict[str, Any] = {
        "device": None if device is None else str(device),
        "device_name": None,
        "probe": probe,
        "budget_bytes": planner.budget_bytes,
        "usable_budget_bytes": planner.usable_budget_bytes,
        "safety_margin": planner.safety_margin,
        "tolerance": planner.tolerance,
        "warmup_steps": planner.warmup_steps,
        "warmup_steps_after_change": planner.warmup_steps_after_change,
        "mitigations_allowed": list(planner.mitigations),
        "model_class": None,
        "num_parameters": None,
        "precision": None,
        "strategy": None,
        "world_size": None,
        "global_step": None,
        "versions": {"lightning_seqmem": __version__, "torch": torch.__version__, "lightning": lightning.__version__},
        "curriculum": None,
    }
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        facts["device_name"] = torch.cuda.get_device_name(device)
    if trainer is not None:
        module = getattr(trainer, "lightning_module", None)
        if module is not None:
            facts["model_class"] = f"{type(module).__module__}.{type(module).__qualname__}"
            facts["num_parameters"] = sum(p.numel() for p in module.parameters())
        facts["precision"] = str(trainer.precision)
        facts["strategy"] = type(trainer.strategy).__name__
        facts["world_size"] = trainer.world_size
        facts["global_step"] = trainer.global_step
    if planner.curriculum is not None:
        facts["curriculum"] = {
            **planner.curriculum.to_dict(),
            "stages": list(planner.curriculum.stages),
            "stages_run": list(planner.stages),
            "capped_at": planner.capped_at,
            "final_stage": planner.stage,
        }
    return facts


def _points(planner: "SeqMemPlanner") -> list[dict[str, Any]]:
    """Per (seq_len, batch_size, mitigations): max over non-warm-up records of each peak."""
    out: dict[tuple, dict[str, Any]] = {}
    for r in planner.records:
        if r.warmup:
            continue
        key = (r.seq_len, r.batch_size, tuple(r.mitigations))
        p = out.setdefault(key, {
            "seq_len": r.seq_len, "batch_size": r.batch_size, "mitigations": list(r.mitigations),
            "num_steps": 0, "peak_bytes": 0, **{f"{ph}_peak_bytes": None for ph in PHASES},
            "reserved_bytes": None, "fragmentation_bytes": None,
        })
        p["num_steps"] += 1
        p["peak_bytes"] = max(p["peak_bytes"], r.peak_bytes)
        for name in [f"{ph}_peak_bytes" for ph in PHASES] + ["reserved_bytes", "fragmentation_bytes"]:
            value = getattr(r, name)
            if value is not None:
                p[name] = value if p[name] is None else max(p[name], value)
    return [out[k] for k in sorted(out, key=lambda k: (k[1] * k[0], k[0], k[2]))]


def _predictors(planner: "SeqMemPlanner") -> dict[str, Any]:
    forecaster = planner.forecaster
    quadratic, timeline = forecaster.quadratic, forecaster.timeline
    q: dict[str, Any] = {"available": quadratic is not None}
    if quadratic is not None:
        state = quadratic.to_dict()
        q["min_relative_uncertainty"] = state["min_relative_uncertainty"]
        q["confidence_z"] = state["confidence_z"]
        q["phases"] = {
            name: {k: v for k, v in c.items() if k != "covariance"} for name, c in state["phases"].items()
        }
    r: dict[str, Any] = {
        "available": timeline is not None,
        "traced": [{"seq_len": t.seq_len, "batch_size": t.batch_size, "measured_peak_bytes": t.measured_peak_bytes}
                   for t in forecaster.traces],
    }
    if timeline is None:
        r["unavailable_reason"] = forecaster.timeline_unavailable_reason
    else:
        r.update(seq_lens=list(timeline.seq_lens), batch_size=timeline.batch_size, notes=list(timeline.notes),
                 num_allocations=int(timeline.coefficients.shape[1]),
                 max_fit_residual_bytes=timeline.max_fit_residual_bytes)
    settings = planner.forecasters
    verifications = [
        {"seq_len": v.seq_len, "batch_size": v.batch_size, "method": v.method, "forecast_bytes": v.forecast_bytes,
         "measured_bytes": v.measured_bytes, "relative_error": v.relative_error,
         "within_tolerance": abs(v.relative_error) <= planner.tolerance, "mitigations": list(key)}
        for key, f in settings.items() for v in f.verifications
    ]
    accuracy = {}
    for method in ("dry_run", "replay", "quadratic"):
        errors = [v["relative_error"] for v in verifications if v["method"] == method]
        if errors:
            accuracy[method] = {"num_verifications": len(errors), "max_abs_error": max(abs(e) for e in errors),
                                "mean_abs_error": sum(abs(e) for e in errors) / len(errors),
                                "worst_under_prediction": min(min(errors), 0.0)}
    return {"mitigations": list(_applied(planner)), "quadratic": q, "replay": r, "verifications": verifications,
            "accuracy": accuracy, "reserved_ratio": forecaster.reserved_ratio,
            "settings": [{"mitigations": list(key), "num_points": len(f.points), "num_traces": len(f.traces),
                          "ready": f.ready} for key, f in settings.items()]}


def _forecast_row(planner: "SeqMemPlanner", seq_len: int, batch_size: int) -> dict[str, Any]:
    # the fit of the setting on now where it has one (checked against the dry run at the target
    # length while training); the dry run where it has not: a report costs no dry run it need not
    fc = planner.forecaster.forecast(seq_len, batch_size) if planner.forecaster.ready else planner.forecast(seq_len, batch_size)
    bound = planner.bound_of(fc)
    row = {"seq_len": seq_len, "batch_size": batch_size, "method": fc.method, "peak_bytes": fc.peak_bytes,
           "upper_bytes": fc.upper_bytes, "reserved_upper_bytes": fc.reserved_upper_bytes,
           "phase_peak_bytes": dict(fc.phase_peak_bytes), "fits": None}
    for method in ("quadratic", "replay"):
        try:
            other = planner.forecaster.forecast(seq_len, batch_size, method=method)
            row[f"{method}_peak_bytes"] = other.peak_bytes if other.method == method else None
        except (NotEnoughMeasurements, ValueError):
            row[f"{method}_peak_bytes"] = None
    if planner.usable_budget_bytes is not None:
        row["fits"] = bound <= planner.usable_budget_bytes
    return row


REPORT_MEASURED_LENGTHS = 8  # measured lengths with a forecast row (dynamic padding: hundreds; one dry run each)


def _spread(lengths: set[int], n: int) -> set[int]:
    """At most ``n`` of ``lengths``, evenly spread, the shortest and the longest kept.

    >>> sorted(_spread(set(range(10, 210)), 5)), _spread({3, 1}, 5) == {1, 3}
    ([10, 60, 110, 159, 209], True)
    """
    ordered = sorted(lengths)
    if len(ordered) <= n:
        return set(ordered)
    return {ordered[round(i * (len(ordered) - 1) / (n - 1))] for i in range(n)}


def _forecasts(planner: "SeqMemPlanner", batch_size: Optional[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"batch_size": batch_size, "at": [], "max_seq_len": None, "error": None}
    if batch_size is None or not (planner.forecaster.ready or planner.dry_peak(1, batch_size) is not None):
        out["error"] = "not enough measurements to forecast (two measured lengths, or a dry run, are needed)"
        return out
    lengths = _spread({r.seq_len for r in planner.records}, REPORT_MEASURED_LENGTHS)
    if planner.curriculum is not None:
        lengths |= set(planner.curriculum.stages)
        target = planner.curriculum.target
        out["target"] = target
        lengths |= {2 * target, 4 * target}
    else:
        longest = max(lengths, default=0)
        lengths |= {2 * longest, 4 * longest} - {0}
    lengths = {L for L in lengths if planner.within_limit(L)}  # none past the model's own positions
    try:
        out["at"] = [_forecast_row(planner, L, batch_size) for L in sorted(lengths)]
        if planner.usable_budget_bytes is not None:
            out["max_seq_len"] = planner.max_seq_len(planner.usable_budget_bytes, batch_size)
    except Exception as exc:  # noqa: BLE001 - a report is written even when a forecast fails
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def _applied(planner: "SeqMemPlanner") -> tuple[str, ...]:
    return tuple(planner.applied_mitigations)


def _mitigations(planner: "SeqMemPlanner") -> dict[str, Any]:
    """Allowed rungs, the ones on now, each switch (from the planner's events) and the record changes."""
    changes, previous = [], ()
    for r in planner.records:
        current = tuple(r.mitigations)
        if current != previous:
            changes.append({"step": r.step, "global_step": r.global_step, "seq_len": r.seq_len,
                            "before": list(previous), "after": list(current)})
        previous = current
    events = [{k: v for k, v in e.items() if k in ("name", "step", "seq_len", "batch_size", "detail", "before_bytes", "before_method", "after_bytes", "removed")}
              for e in planner.mitigation_events]
    return {"allowed": list(planner.mitigations), "active": list(_applied(planner)),
            "not_applicable": dict(getattr(planner, "not_applicable", {})), "events": events, "changes": changes}


def _warnings(planner: "SeqMemPlanner") -> list[dict[str, str]]:
    return [{"key": key, "kind": kind, "meaning": KINDS.get(kind, "other")} for key, kind in sorted(planner.warned.items())]


def _records_summary(planner: "SeqMemPlanner") -> dict[str, Any]:
    records = planner.records
    if not records:
        return {"num_records": 0}
    top = max(records, key=lambda r: r.peak_bytes)
    reserved = [r.reserved_bytes for r in records if r.reserved_bytes is not None]
    fragmentation = [r.fragmentation_bytes for r in records if r.fragmentation_bytes is not None]
    return {
        "num_records": len(records),
        "num_warmup": sum(r.warmup for r in records),
        "num_traced": sum(r.traced for r in records),
        "seq_lens": sorted({r.seq_len for r in records}),
        "batch_sizes": sorted({r.batch_size for r in records}),
        "first_global_step": records[0].global_step,
        "last_global_step": records[-1].global_step,
        "max_peak_bytes": top.peak_bytes,
        "max_peak_seq_len": top.seq_len,
        "max_peak_global_step": top.global_step,
        "max_reserved_bytes": max(reserved) if reserved else None,
        "max_fragmentation_bytes": max(fragmentation) if fragmentation else None,
        "num_ooms": max((r.num_ooms for r in records if r.num_ooms is not None), default=None),
    }


def build_report(planner: "SeqMemPlanner", trainer: Optional["pl.Trainer"] = None, include_records: bool = True,
                 device: Any = None, probe: Optional[str] = None,
                 breakdown: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Everything the planner knows, as plain JSON-able values (bytes, tokens, fractions).

    Keys: ``format``, ``created``, ``run`` (device, probe, budget, safety margin, model class,
    parameter count, precision, curriculum stages planned and run), ``points`` (per measured
    ``(seq_len, batch_size, mitigations)``: the maximum over non-warm-up steps of each peak),
    ``predictors`` (quadratic coefficients per phase, replay lengths and notes, verifications and
    accuracy per method), ``forecasts`` (at every measured and curriculum length, the target × 2 and
    × 4, and the largest length that fits the usable budget), ``mitigations``, ``warnings`` (keys of
    the warnings the planner gave), ``records_summary``, ``breakdown`` (with
    ``SeqMemCallback(breakdown=True)``, after fit: see
    :func:`~lightning_seqmem.breakdown_steps.breakdown_section`) and, with ``include_records``,
    ``records`` (every :class:`~lightning_seqmem.StepRecord` as a dict).
    """
    batch_size = planner.last_batch_size
    if batch_size is None and planner.records:
        batch_size = planner.records[-1].batch_size
    report = {
        "format": REPORT_FORMAT,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "run": _run_facts(planner, trainer, device, probe),
        "points": _points(planner),
        "predictors": _predictors(planner),
        "forecasts": _forecasts(planner, batch_size),
        "mitigations": _mitigations(planner),
        "warnings": _warnings(planner),
        "records_summary": _records_summary(planner),
    }
    if breakdown is not None:
        report["breakdown"] = breakdown
    if include_records:
        report["records"] = [r.to_dict() for r in planner.records]
    return _plain(report)


def _plain(value: Any) -> Any:
    """JSON-safe copy: tuples to lists, numpy scalars to Python, non-finite floats to None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (str, int)):
        return value
    if hasattr(value, "item"):  # numpy / torch scalar
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return value


def load_report(path: str | os.PathLike) -> dict[str, Any]:
    """Read a report written by :func:`write_report` (a ``.json`` file, or the directory holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / JSON_NAME
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    if not isinstance(report, dict) or report.get("format") != REPORT_FORMAT:
        raise ValueError(f"{str(path)!r} is not a lightning-seqmem report (expected format {REPORT_FORMAT!r})")
    return report


# ----------------------------------------------------------------------------------------------
# Display (the only place, with panels.py, where bytes become MiB/GiB)
# ----------------------------------------------------------------------------------------------
def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _fits(x: Optional[bool]) -> str:
    return "-" if x is None else ("yes" if x else "NO")


def _facts_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    run = report["run"]
    rows = [
        ("device", f"{run['device'] or '-'}" + (f" ({run['device_name']})" if run.get("device_name") else "")),
        ("probe", str(run["probe"])),
        ("budget", format_bytes(run["budget_bytes"])),
        ("usable budget", f"{format_bytes(run['usable_budget_bytes'])} (safety margin {run['safety_margin']:.0%})"),
        ("model", f"{run['model_class'] or '-'}"
                  + (f", {run['num_parameters']:,} parameters" if run.get("num_parameters") else "")),
        ("precision", str(run["precision"] or "-")),
    ]
    if run.get("world_size") and run["world_size"] > 1:
        rows.append(("strategy", f"{run['strategy']} × {run['world_size']}"))
    cur = run.get("curriculum")
    if cur:
        planned, ran = cur["stages"], cur["stages_run"]
        text = " → ".join(map(str, ran)) + f" ({cur['steps_per_stage']} steps per stage)"
        if cur.get("capped_at") is not None:
            text += f"; capped at {cur['capped_at']} (planned up to {planned[-1]})"
        rows.append(("curriculum", text))
    fc = report["forecasts"]
    if fc.get("max_seq_len") is not None:
        rows.append(("largest length that fits", f"{fc['max_seq_len']} tokens at batch {fc['batch_size']}"
                     if fc["max_seq_len"] > 0 else nothing_fits(report["mitigations"]["active"], fc["batch_size"],
                                               list(report["mitigations"].get("not_applicable", {})))))
    acc = report["predictors"]["accuracy"]
    for method, a in acc.items():
        rows.append((f"{method} accuracy", f"max |error| {a['max_abs_error']:.1%} over {a['num_verifications']} verification(s)"))
    mit = report["mitigations"]
    rows.append(("mitigations on", ", ".join(mit["active"]) or "none"))
    rows.append(("warnings", ", ".join(w["key"] for w in report["warnings"]) or "none"))
    return rows


def _points_table(report: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    """Unit, headers and rows of the measured points; CUDA-only and mitigation columns only when used."""
    verified = {(v["seq_len"], v["batch_size"], tuple(v.get("mitigations", []))): v
                for v in report["predictors"]["verifications"]}
    points = report["points"]
    unit, scale = display_unit(max(max(p["peak_bytes"], p["reserved_bytes"] or 0) for p in points))
    with_reserved = any(p["reserved_bytes"] is not None for p in points)
    with_mitigations = any(p["mitigations"] for p in points)
    headers = ["seq_len", "batch", "peak", *PHASES, *(["reserved"] if with_reserved else []),
               "error", *(["mitigations"] if with_mitigations else [])]

    def num(nbytes: Optional[int]) -> str:
        return "-" if nbytes is None else f"{nbytes / scale:.1f}"

    rows = []
    for p in points:
        v = verified.get((p["seq_len"], p["batch_size"], tuple(p["mitigations"])))
        row = [str(p["seq_len"]), str(p["batch_size"]), num(p["peak_bytes"]), *(num(p[f"{ph}_peak_bytes"]) for ph in PHASES)]
        if with_reserved:
            row.append(num(p["reserved_bytes"]))
        row.append("-" if v is None else f"{_pct(v['relative_error'])} {v['method']}")
        if with_mitigations:
            row.append("+".join(p["mitigations"]) or "-")
        rows.append(row)
    return unit, headers, rows


_FORECAST_HEADERS = ["seq_len", "batch", "method", "peak", "upper", "quadratic", "replay", "fits"]


def _forecast_rows(report: dict[str, Any]) -> list[list[str]]:
    return [[str(f["seq_len"]), str(f["batch_size"]), f["method"], format_bytes(f["peak_bytes"]),
             format_bytes(f["upper_bytes"]), format_bytes(f.get("quadratic_peak_bytes")),
             format_bytes(f.get("replay_peak_bytes")), _fits(f["fits"])] for f in report["forecasts"]["at"]]


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The memory breakdown (SeqMemCallback(breakdown=True), seqmem forecast --breakdown)
# ----------------------------------------------------------------------------------------------
def _breakdown_tables(section: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows) of the by-kind, by-category and activation tables of a breakdown section."""
    lens, longer = section["seq_lens"], section.get("extrapolated_seq_len")
    headers = [f"L={L}" for L in lens] + ([f"L={longer} (extrapolated)"] if longer else [])

    def cells(row: dict[str, Any]) -> list[str]:
        return [format_bytes(b) for b in row["bytes"]] + ([format_bytes(row["extrapolated_bytes"])] if longer else [])

    kinds = [[r["kind"], *cells(r), r["growth"]] for r in section["by_kind"]]
    kinds.append(["peak (traced, sum of the above)", *(format_bytes(b) for b in section["peak_bytes"]),
                  *([format_bytes(section.get("extrapolated_peak_bytes"))] if longer else []), ""])
    measured = section.get("measured_peak_bytes") or []
    if any(b is not None for b in measured):
        kinds.append(["peak measured in training", *(format_bytes(b) for b in measured), *(["-"] if longer else []), ""])
    if longer and section.get("forecast_peak_bytes") is not None:
        kinds.append(["peak forecast", *("" for _ in lens), format_bytes(section["forecast_peak_bytes"]), ""])
    categories = [[r["category"], *cells(r), r["growth"]] for r in section["by_category"]]
    activations = [[r["category"], *cells(r), r["growth"]] for r in section["activations"]]
    share = section.get("attention_share_extrapolated")
    activations.append(["attention share", *(f"{x:.1%}" for x in section["attention_share"]),
                        *([f"{share:.1%}" if share is not None else "-"] if longer else []), ""])
    batch = section["batch_size"]
    return [
        (f"Peak memory by kind (batch {batch})", ["kind", *headers, "growth"], kinds),
        (f"Peak memory by module (batch {batch})", ["module", *headers, "growth"], categories),
        ("Activations (alive when backward starts) by module", ["module", *headers, "growth"], activations),
    ]


def _crossover_text(section: dict[str, Any]) -> str:
    crossover = section.get("crossover_seq_len")
    backend = section.get("attention_backend") or "this"
    if crossover is None:
        return (f"Attention activations never exceed the rest at any length (no quadratic attention term with "
                f"{backend} attention).")
    if crossover <= 0:
        return "Attention activations exceed the rest at every length."
    return (f"Attention activations exceed the rest beyond L ≈ {math.ceil(crossover)} (crossover length, from the "
            "per-part polynomials).")


def _calibration_text(section: dict[str, Any]) -> Optional[str]:
    c = section.get("calibration")
    if not c:
        return None
    ratio = c.get("ratio")
    return (f"Korthikanti et al. 2022 calibration at L={c['seq_len']}, batch {c['batch_size']}: measured "
            f"{format_bytes(c['measured_bytes'])} of activations per layer (L×L part "
            f"{format_bytes(c['measured_quadratic_bytes'])}) vs theory {format_bytes(c['theory_bytes'])} (L×L part "
            f"{format_bytes(c['theory_quadratic_bytes'])}), {'-' if ratio is None else f'{ratio:.2f}x'}"
            f"{'; full recomputation (checkpointing on)' if c.get('recompute') else ''}.")


def _breakdown_intro(section: dict[str, Any]) -> str:
    parts = [f"One training step traced at seq_len {section['seq_lens']} (batch {section['batch_size']}) on a copy "
             "of the model and optimizer; what is alive at each step's peak, by kind and by module, and how each "
             "part grows with L (constant / linear / quadratic polynomial fits)."]
    if section.get("extrapolated_seq_len"):
        parts.append(f"The L={section['extrapolated_seq_len']} column extrapolates each part with its own polynomial "
                     "(the peak moment can move at longer lengths: the forecast row is the timeline replay's).")
    facts = [f"attention: {section.get('attention_backend') or '-'}"]
    if section.get("autocast_dtype"):
        facts.append(f"autocast {section['autocast_dtype']}")
    if section.get("checkpointed"):
        facts.append("activation checkpointing on")
    return " ".join(parts) + " (" + ", ".join(facts) + ")."


def render_breakdown_markdown(section: dict[str, Any], heading: str = "") -> str:
    """A breakdown section (see :func:`~lightning_seqmem.breakdown_steps.breakdown_section`) as Markdown:
    tables by kind, by module and of activations with the attention share, the crossover length,
    the diagnoses, the Korthikanti calibration and notes. ``heading``: a first line (e.g. ``"## ..."``)."""
    parts = [heading, ""] if heading else []
    parts += [_breakdown_intro(section), ""]
    for title, headers, rows in _breakdown_tables(section):
        parts += [f"**{title}**", "", _md_table(headers, rows), ""]
    parts += [_crossover_text(section), ""]
    if section.get("diagnoses"):
        parts += ["Diagnoses:", ""] + [f"- {d}" for d in section["diagnoses"]] + [""]
    else:
        parts += ["Diagnoses: none (no fp32 scores under autocast, no hand-written L×L matmul, checkpointing effective).", ""]
    calibration = _calibration_text(section)
    if calibration:
        parts += [calibration, ""]
    parts += [f"- {n}" for n in section.get("notes", [])]
    return "\n".join(parts).rstrip() + "\n"


def render_breakdown_console(section: dict[str, Any], console: Any = None) -> None:
    """A breakdown section as ``rich`` tables, then the crossover, diagnoses and calibration lines."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console(width=None if sys.stdout.isatty() else 120)
    console.print(_breakdown_intro(section))
    for title, headers, rows in _breakdown_tables(section):
        table = Table(title=f"seqmem: {title.lower()}", title_justify="left")
        for i, header in enumerate(headers):
            table.add_column(header, justify="left" if i == 0 or header == "growth" else "right")
        for row in rows:
            table.add_row(*row, style="bold" if row[0].startswith("peak") or row[0] == "attention share" else None)
        console.print(table)
    console.print(_crossover_text(section))
    for d in section.get("diagnoses", []):
        console.print(f"[yellow]diagnosis:[/yellow] {d}")
    calibration = _calibration_text(section)
    if calibration:
        console.print(calibration)
    for n in section.get("notes", []):
        console.print(f"note: {n}")


def render_markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: run facts, measured points, forecasts, predictors, mitigations, the
    memory breakdown (when traced) and warnings."""
    parts = ["# lightning-seqmem report", "", f"Created {report['created']}.", "", "## Run", "",
             _md_table(["", ""], [list(r) for r in _facts_rows(report)]), "",
             "## Measured peaks (max over non-warm-up steps)", ""]
    if report["points"]:
        unit, headers, rows = _points_table(report)
        parts += [f"Peaks in {unit}; forecast error = (forecast − measured) / measured at the first measurement of "
                  "the length.", "", _md_table(headers, rows), ""]
    else:
        parts += ["No step was measured.", ""]
    fc = report["forecasts"]
    parts += ["## Forecasts", ""]
    if fc["at"]:
        parts += [f"Batch size {fc['batch_size']}; \"fits\" compares the upper bound with the usable budget.", "",
                  _md_table(_FORECAST_HEADERS, _forecast_rows(report)), ""]
    if fc.get("error"):
        parts += [f"Forecast unavailable: {fc['error']}", ""]
    pred = report["predictors"]
    parts += ["## Predictors", ""]
    q = pred["quadratic"]
    if pred.get("mitigations"):
        parts += [f"Fitted with {', '.join(pred['mitigations'])} on (each setting of mitigations has its own fit).", ""]
    if q["available"]:
        parts += ["Quadratic fit `M(L, B) = C + B·(a·L + b·L²)` per phase:", "",
                  _md_table(["phase", "C", "a (bytes/token)", "b (bytes/token²)", "residual std", "points"],
                            [[name, format_bytes(c["const_bytes"]), f"{c['linear_bytes_per_token']:.1f}",
                              f"{c['quadratic_bytes_per_token2']:.3f}", format_bytes(c["residual_std_bytes"]),
                              str(c["num_points"])] for name, c in q["phases"].items()]), ""]
    r = pred["replay"]
    if r["available"]:
        parts += [f"Timeline replay of steps traced at seq_len {r['seq_lens']} (batch {r['batch_size']}, "
                  f"{r['num_allocations']} allocations); " + "; ".join(r["notes"]) + ".", ""]
    else:
        parts += [f"Timeline replay unavailable: {r.get('unavailable_reason', '-')}.", ""]
    if pred["verifications"]:
        parts += ["Verifications (forecast made before the length was first measured):", "",
                  _md_table(["seq_len", "batch", "mitigations", "method", "forecast", "measured", "error", "within tolerance"],
                            [[str(v["seq_len"]), str(v["batch_size"]), "+".join(v.get("mitigations", [])) or "none",
                              v["method"], format_bytes(v["forecast_bytes"]), format_bytes(v["measured_bytes"]),
                              _pct(v["relative_error"]), "yes" if v["within_tolerance"] else "NO"]
                             for v in pred["verifications"]]), ""]
    mit = report["mitigations"]
    parts += ["## Mitigations", "", f"Allowed, in order: {', '.join(mit.get('allowed', [])) or 'none'}.", ""]
    if mit.get("events"):
        parts += [_md_table(["step", "seq_len", "switched on", "what was done", "peak before", "peak after"],
                            [[str(e["step"]), str(e["seq_len"]), e["name"], str(e["detail"]),
                              format_bytes(e["before_bytes"]), format_bytes(e["after_bytes"])]
                             for e in mit["events"]]), ""]
    elif mit["changes"]:
        parts += [_md_table(["global step", "seq_len", "before", "after"],
                            [[str(c["global_step"]), str(c["seq_len"]), ", ".join(c["before"]) or "none",
                              ", ".join(c["after"]) or "none"] for c in mit["changes"]]), ""]
    else:
        parts += ["None applied.", ""]
    if report.get("breakdown"):
        parts += [render_breakdown_markdown(report["breakdown"], "## Where the memory goes (breakdown)")]
    parts += ["## Warnings", ""]
    parts += [f"- `{w['key']}`: {w['meaning']}" for w in report["warnings"]] or ["None."]
    s = report["records_summary"]
    parts += ["", "## Records", "", f"{s['num_records']} measured steps"
              + (f" ({s['num_warmup']} warm-up, {s['num_traced']} traced), lengths {s['seq_lens']}; highest peak "
                 f"{format_bytes(s['max_peak_bytes'])} at seq_len {s['max_peak_seq_len']} (global step "
                 f"{s['max_peak_global_step']})." if s["num_records"] else ".")]
    if report.get("files", {}).get("figure"):
        parts += ["", f"![memory vs sequence length]({report['files']['figure']})"]
    return "\n".join(parts) + "\n"


def render_console(report: dict[str, Any], console: Any = None) -> None:
    """Print the report as ``rich`` tables (run facts, measured peaks, forecasts) on ``console``."""
    from rich.console import Console
    from rich.table import Table

    if console is None:  # a pipe or a log file gets 120 columns rather than rich's default 80
        console = Console(width=None if sys.stdout.isatty() else 120)
    facts = Table(title="seqmem: run", show_header=False, title_justify="left")
    facts.add_column(style="bold")
    facts.add_column()
    for name, value in _facts_rows(report):
        facts.add_row(name, value)
    console.print(facts)
    if report["points"]:
        unit, headers, rows = _points_table(report)
        points = Table(title=f"seqmem: measured peaks ({unit}, max over non-warm-up steps)", title_justify="left")
        for header in headers:
            points.add_column(header, justify="left" if header in ("error", "mitigations") else "right")
        for row in rows:
            points.add_row(*row)
        console.print(points)
    fc = report["forecasts"]
    if fc["at"]:
        table = Table(title=f"seqmem: forecasts (batch {fc['batch_size']}; fits = upper bound within the usable budget)",
                      title_justify="left")
        for header in _FORECAST_HEADERS:
            table.add_column(header, justify="left" if header == "method" else "right")
        for row in _forecast_rows(report):
            style = "red" if row[-1] == "NO" else None
            table.add_row(*row, style=style)
        console.print(table)
    if fc.get("error"):
        console.print(f"[yellow]forecast unavailable:[/yellow] {fc['error']}")
    if report.get("breakdown"):
        render_breakdown_console(report["breakdown"], console)
