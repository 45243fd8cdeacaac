"""The report of :func:`~lightning_seqmem.present.report.build_report` and the memory breakdown as
``rich`` tables and Markdown (here and in the panels, bytes become MiB/GiB)."""

from __future__ import annotations

import math
import sys
from typing import Any, Optional

from lightning_seqmem.core.advice import nothing_fits
from lightning_seqmem.core.records import PHASES
from lightning_seqmem.core.units import display_unit, format_bytes
from lightning_seqmem.present.summary import RunSummary

__all__ = ["render_breakdown_console", "render_breakdown_markdown", "render_console",
           "render_markdown", "stdout_console", "yes_no"]


# ---- Display (the only place, with panels.py, where bytes become MiB/GiB) ---------------------
def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:+.1%}"


def yes_no(x: Optional[bool]) -> str:
    """A yes/no cell (``fits``, ``within tolerance``): ``"yes"``, ``"NO"``, ``"-"`` if unknown."""
    return "-" if x is None else ("yes" if x else "NO")


def stdout_console(quiet: bool = False) -> Any:
    """The ``rich`` console of a command's output: the terminal's width, or 120 columns on a pipe
    or a log file (rather than rich's default 80)."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 120, quiet=quiet)


def _facts_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    run = report["run"]
    rows = [
        ("device", f"{run['device'] or '-'}"
                   + (f" ({run['device_name']})" if run.get("device_name") else "")),
        ("probe", str(run["probe"])),
        ("budget", format_bytes(run["budget_bytes"])),
        ("usable budget", f"{format_bytes(run['usable_budget_bytes'])} "
                          f"(safety margin {run['safety_margin']:.0%})"),
        ("model", f"{run['model_class'] or '-'}" + (f", {run['num_parameters']:,} parameters"
                                                    if run.get("num_parameters") else "")),
        ("precision", str(run["precision"] or "-")),
    ]
    if report.get("summary"):  # older reports have none
        rows.append(("what ran", RunSummary.from_dict(report["summary"]).sentence()))
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
        rows.append(("largest length that fits", f"{fc['max_seq_len']} tokens at batch "
                     f"{fc['batch_size']}" if fc["max_seq_len"] > 0
                     else nothing_fits(report["mitigations"]["active"], fc["batch_size"],
                                       list(report["mitigations"].get("not_applicable", {})))))
    acc = report["predictors"]["accuracy"]
    for method, a in acc.items():
        rows.append((f"{method} accuracy", f"max |error| {a['max_abs_error']:.1%} over "
                                           f"{a['num_verifications']} verification(s)"))
    mit = report["mitigations"]
    rows.append(("mitigations on", ", ".join(mit["active"]) or "none"))
    rows.append(("warnings", ", ".join(w["key"] for w in report["warnings"]) or "none"))
    if report.get("peak_site"):
        rows.append(("peak at (longest length)", peak_site_text(report["peak_site"])))
    return rows


def peak_site_text(site: dict[str, Any]) -> str:
    """A report's ``peak_site`` in one line: length, phase and kinds, and what said so.

    Example:
        >>> site = {"source": "dry_run", "seq_len": 512, "batch_size": 2, "mitigations": [],
        ...         "describe": "backward: attention scores 82%, saved activations 13%"}
        >>> peak_site_text(site)  # doctest: +NORMALIZE_WHITESPACE
        'seq_len 512, batch 2, no mitigation: backward: attention scores 82%, saved activations 13%
        (dry run of that step)'
    """
    source = {"breakdown": "a traced step at the end of fit",
              "dry_run": "dry run of that step"}.get(site.get("source"), "-")
    mitigations = " + ".join(site.get("mitigations") or []) or "no mitigation"
    return (f"seq_len {site['seq_len']}, batch {site['batch_size']}, {mitigations}: "
            f"{site['describe']} ({source})")


def _points_table(report: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    """Unit, headers and rows of the measured points; CUDA-only and mitigation columns if used."""
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
        row = [str(p["seq_len"]), str(p["batch_size"]), num(p["peak_bytes"]),
               *(num(p[f"{ph}_peak_bytes"]) for ph in PHASES)]
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
             format_bytes(f.get("replay_peak_bytes")), yes_no(f["fits"])]
            for f in report["forecasts"]["at"]]


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# ---- The memory breakdown (SeqMemCallback(breakdown=True), seqmem forecast --breakdown) -------
def _breakdown_tables(section: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows) of a breakdown's by-kind, by-category and activation tables."""
    lens, longer = section["seq_lens"], section.get("extrapolated_seq_len")
    headers = [f"L={L}" for L in lens] + ([f"L={longer} (extrapolated)"] if longer else [])

    def cells(row: dict[str, Any]) -> list[str]:
        return ([format_bytes(b) for b in row["bytes"]]
                + ([format_bytes(row["extrapolated_bytes"])] if longer else []))

    kinds = [[r["kind"], *cells(r), r["growth"]] for r in section["by_kind"]]
    kinds.append(["peak (traced, sum of the above)",
                  *(format_bytes(b) for b in section["peak_bytes"]),
                  *([format_bytes(section.get("extrapolated_peak_bytes"))] if longer else []), ""])
    measured = section.get("measured_peak_bytes") or []
    if any(b is not None for b in measured):
        kinds.append(["peak measured in training", *(format_bytes(b) for b in measured),
                      *(["-"] if longer else []), ""])
    if longer and section.get("forecast_peak_bytes") is not None:
        kinds.append(["peak forecast", *("" for _ in lens),
                      format_bytes(section["forecast_peak_bytes"]), ""])
    categories = [[r["category"], *cells(r), r["growth"]] for r in section["by_category"]]
    activations = [[r["category"], *cells(r), r["growth"]] for r in section["activations"]]
    share = section.get("attention_share_extrapolated")
    activations.append(["attention share", *(f"{x:.1%}" for x in section["attention_share"]),
                        *([f"{share:.1%}" if share is not None else "-"] if longer else []), ""])
    batch = section["batch_size"]
    return [
        (f"Peak memory by kind (batch {batch})", ["kind", *headers, "growth"], kinds),
        (f"Peak memory by module (batch {batch})", ["module", *headers, "growth"], categories),
        ("Activations (alive when backward starts) by module", ["module", *headers, "growth"],
         activations),
    ]


def _crossover_text(section: dict[str, Any]) -> str:
    crossover = section.get("crossover_seq_len")
    backend = section.get("attention_backend") or "this"
    if crossover is None:
        return ("Attention activations never exceed the rest at any length (no quadratic attention "
                f"term with {backend} attention).")
    if crossover <= 0:
        return "Attention activations exceed the rest at every length."
    return (f"Attention activations exceed the rest beyond L ≈ {math.ceil(crossover)} (crossover "
            "length, from the per-part polynomials).")


def _calibration_text(section: dict[str, Any]) -> Optional[str]:
    c = section.get("calibration")
    if not c:
        return None
    ratio = c.get("ratio")
    return (f"Korthikanti et al. 2022 calibration at L={c['seq_len']}, batch {c['batch_size']}: "
            f"measured {format_bytes(c['measured_bytes'])} of activations per layer (L×L part "
            f"{format_bytes(c['measured_quadratic_bytes'])}) vs theory "
            f"{format_bytes(c['theory_bytes'])} (L×L part "
            f"{format_bytes(c['theory_quadratic_bytes'])}), "
            f"{'-' if ratio is None else f'{ratio:.2f}x'}"
            f"{'; full recomputation (checkpointing on)' if c.get('recompute') else ''}.")


def _breakdown_peak_text(section: dict[str, Any]) -> Optional[str]:
    """Where the longest traced step's peak sits (the section's ``peak_site``), in one sentence."""
    site = section.get("peak_site")
    if not site:
        return None
    return (f"Peak at L={section['seq_lens'][-1]}: {site['describe']} "
            "(phase, then the kinds of tensor alive there).")


def _breakdown_intro(section: dict[str, Any]) -> str:
    parts = [f"One training step traced at seq_len {section['seq_lens']} "
             f"(batch {section['batch_size']}) on a copy of the model and optimizer; what is "
             "alive at each step's peak, by kind and by module, and how each part grows with L "
             "(constant / linear / quadratic polynomial fits)."]
    if section.get("extrapolated_seq_len"):
        parts.append(f"The L={section['extrapolated_seq_len']} column extrapolates each part with "
                     "its own polynomial (the peak moment can move at longer lengths: the forecast "
                     "row is the timeline replay's).")
    facts = [f"attention: {section.get('attention_backend') or '-'}"]
    if section.get("autocast_dtype"):
        facts.append(f"autocast {section['autocast_dtype']}")
    if section.get("checkpointed"):
        facts.append("activation checkpointing on")
    return " ".join(parts) + " (" + ", ".join(facts) + ")."


def render_breakdown_markdown(section: dict[str, Any], heading: str = "") -> str:
    """A :func:`~lightning_seqmem.diagnostics.section.breakdown_section` as Markdown: its tables,
    crossover length, diagnoses, calibration and notes, after ``heading`` (e.g. ``"## ..."``)."""
    parts = [heading, ""] if heading else []
    parts += [_breakdown_intro(section), ""]
    for title, headers, rows in _breakdown_tables(section):
        parts += [f"**{title}**", "", _md_table(headers, rows), ""]
    parts += [_crossover_text(section), ""]
    if peak := _breakdown_peak_text(section):
        parts += [peak, ""]
    if section.get("diagnoses"):
        parts += ["Diagnoses:", ""] + [f"- {d}" for d in section["diagnoses"]] + [""]
    else:
        parts += ["Diagnoses: none (no fp32 scores under autocast, no hand-written L×L matmul, "
                  "checkpointing effective).", ""]
    if calibration := _calibration_text(section):
        parts += [calibration, ""]
    parts += [f"- {n}" for n in section.get("notes", [])]
    return "\n".join(parts).rstrip() + "\n"


def render_breakdown_console(section: dict[str, Any], console: Any = None) -> None:
    """A breakdown section as ``rich`` tables, then its crossover, diagnoses and calibration."""
    from rich.markup import escape
    from rich.table import Table

    if console is None:
        console = stdout_console()
    console.print(_breakdown_intro(section))
    for title, headers, rows in _breakdown_tables(section):
        table = Table(title=f"seqmem: {title.lower()}", title_justify="left")
        for i, header in enumerate(headers):
            table.add_column(header, justify="left" if i == 0 or header == "growth" else "right")
        for row in rows:
            table.add_row(*row, style="bold" if row[0].startswith("peak")
                          or row[0] == "attention share" else None)
        console.print(table)
    console.print(_crossover_text(section))
    if peak := _breakdown_peak_text(section):
        console.print(peak, highlight=False)
    for d in section.get("diagnoses", []):
        console.print(f"[yellow]diagnosis:[/yellow] {escape(str(d))}")
    if calibration := _calibration_text(section):
        console.print(calibration)
    for n in section.get("notes", []):
        console.print(f"note: {escape(str(n))}")


def _md_forecasts(fc: dict[str, Any]) -> list[str]:
    """The report's forecasts section (Markdown lines)."""
    parts = ["## Forecasts", ""]
    if fc["at"]:
        parts += [f"Batch size {fc['batch_size']}; \"fits\" compares the upper bound with the "
                  "usable budget.", "",
                  _md_table(_FORECAST_HEADERS, _forecast_rows({"forecasts": fc})), ""]
        fitted = [f["seq_len"] for f in fc["at"] if f["method"] == "dry_run_fit"]
        if fitted:
            parts += [f"At seq_len {fitted}, method `dry_run_fit`: a quadratic through the lengths "
                      "dry-run (no dry run at that length).", ""]
    if fc.get("error"):
        parts += [f"Forecast unavailable: {fc['error']}", ""]
    return parts


def _md_predictors(pred: dict[str, Any]) -> list[str]:
    """The report's predictors section: the quadratic fit, the replay, the verifications."""
    parts = ["## Predictors", ""]
    q = pred["quadratic"]
    if pred.get("mitigations"):
        parts += [f"Fitted with {', '.join(pred['mitigations'])} on (each setting of mitigations "
                  "has its own fit).", ""]
    if q["available"]:
        parts += ["Quadratic fit `M(L, B) = C + B·(a·L + b·L²)` per phase:", "", _md_table(
            ["phase", "C", "a (bytes/token)", "b (bytes/token²)", "residual std", "points"],
            [[name, format_bytes(c["const_bytes"]), f"{c['linear_bytes_per_token']:.1f}",
              f"{c['quadratic_bytes_per_token2']:.3f}", format_bytes(c["residual_std_bytes"]),
              str(c["num_points"])] for name, c in q["phases"].items()]), ""]
    r = pred["replay"]
    if r["available"]:
        parts += [f"Timeline replay of steps traced at seq_len {r['seq_lens']} "
                  f"(batch {r['batch_size']}, {r['num_allocations']} allocations); "
                  + "; ".join(r["notes"]) + ".", ""]
    else:
        parts += [f"Timeline replay unavailable: {r.get('unavailable_reason', '-')}.", ""]
    if pred["verifications"]:
        parts += ["Verifications (forecast made before the length was first measured):", "",
                  _md_table(["seq_len", "batch", "mitigations", "method", "forecast", "measured",
                             "error", "within tolerance"],
                            [[str(v["seq_len"]), str(v["batch_size"]),
                              "+".join(v.get("mitigations", [])) or "none", v["method"],
                              format_bytes(v["forecast_bytes"]), format_bytes(v["measured_bytes"]),
                              _pct(v["relative_error"]), yes_no(v["within_tolerance"])]
                             for v in pred["verifications"]]), ""]
    return parts


def render_markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: run facts, measured points, forecasts, predictors, mitigations, the
    memory breakdown (when traced) and warnings."""
    parts = ["# lightning-seqmem report", "", f"Created {report['created']}.", "", "## Run", "",
             _md_table(["", ""], [list(r) for r in _facts_rows(report)]), "",
             "## Measured peaks (max over non-warm-up steps)", ""]
    if report["points"]:
        unit, headers, rows = _points_table(report)
        parts += [f"Peaks in {unit}; forecast error = (forecast − measured) / measured at the "
                  "first measurement of the length.", "", _md_table(headers, rows), ""]
    else:
        parts += ["No step was measured.", ""]
    parts += _md_forecasts(report["forecasts"]) + _md_predictors(report["predictors"])
    mit = report["mitigations"]
    parts += ["## Mitigations", "",
              f"Allowed, in order: {', '.join(mit.get('allowed', [])) or 'none'}.", ""]
    if mit.get("events"):
        parts += [_md_table(
            ["step", "seq_len", "switched on", "what was done", "peak before", "peak after"],
            [[str(e["step"]), str(e["seq_len"]), e["name"], str(e["detail"]),
              format_bytes(e["before_bytes"]), format_bytes(e["after_bytes"])]
             for e in mit["events"]]), ""]
    elif mit["changes"]:
        parts += [_md_table(["global step", "seq_len", "before", "after"], [
            [str(c["global_step"]), str(c["seq_len"]), ", ".join(c["before"]) or "none",
             ", ".join(c["after"]) or "none"] for c in mit["changes"]]), ""]
    else:
        parts += ["None applied.", ""]
    if report.get("breakdown"):
        parts += [render_breakdown_markdown(report["breakdown"],
                                            "## Where the memory goes (breakdown)")]
    if report.get("validation"):
        parts += ["## Validation batches (each shape's first, its highest rank)", "", _md_table(
            ["global step", "rank", "seq_len", "batch", "rungs on", "dry run", "measured"],
            [[str(v["global_step"]), str(v.get("rank", 0)), str(v["seq_len"]), str(v["batch_size"]),
              ", ".join(v["mitigations"]) or "none", format_bytes(v["dry_run_peak_bytes"]),
              format_bytes(v["peak_bytes"])] for v in report["validation"]]), ""]
    parts += ["## Warnings", ""]
    parts += [f"- `{w['key']}`: {w['meaning']}" for w in report["warnings"]] or ["None."]
    s = report["records_summary"]
    parts += ["", "## Records", "", f"{s['num_records']} measured steps"
              + (f" ({s['num_warmup']} warm-up, {s['num_traced']} traced), lengths "
                 f"{s['seq_lens']}; highest peak {format_bytes(s['max_peak_bytes'])} at seq_len "
                 f"{s['max_peak_seq_len']} (global step {s['max_peak_global_step']})."
                 if s["num_records"] else ".")]
    if report.get("files", {}).get("figure"):
        parts += ["", f"![memory vs sequence length]({report['files']['figure']})"]
    return "\n".join(parts) + "\n"


def render_console(report: dict[str, Any], console: Any = None) -> None:
    """Print the report as ``rich`` tables (run facts, measured peaks, forecasts) on ``console``."""
    from rich.markup import escape
    from rich.table import Table

    if console is None:
        console = stdout_console()
    facts = Table(title="seqmem: run", show_header=False, title_justify="left")
    facts.add_column(style="bold")
    facts.add_column()
    for name, value in _facts_rows(report):
        facts.add_row(name, value)
    console.print(facts)
    if report["points"]:
        unit, headers, rows = _points_table(report)
        points = Table(title=f"seqmem: measured peaks ({unit}, max over non-warm-up steps)",
                       title_justify="left")
        for header in headers:
            points.add_column(header,
                              justify="left" if header in ("error", "mitigations") else "right")
        for row in rows:
            points.add_row(*row)
        console.print(points)
    fc = report["forecasts"]
    if fc["at"]:
        table = Table(title=f"seqmem: forecasts (batch {fc['batch_size']}; fits = upper bound "
                            "within the usable budget)", title_justify="left")
        for header in _FORECAST_HEADERS:
            table.add_column(header, justify="left" if header == "method" else "right")
        for row in _forecast_rows(report):
            table.add_row(*row, style="red" if row[-1] == "NO" else None)
        console.print(table)
    if fc.get("error"):
        console.print(f"[yellow]forecast unavailable:[/yellow] {escape(str(fc['error']))}")
    if report.get("breakdown"):
        render_breakdown_console(report["breakdown"], console)
