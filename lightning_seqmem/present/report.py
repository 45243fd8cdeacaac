"""The run report: what was measured, what both predictors say, what fits, what was done about it.

:func:`build_report` turns a :class:`~lightning_seqmem.plan.view.PlanView` into a JSON-able dict
(bytes everywhere); :func:`lightning_seqmem.trainer.outputs.write_report` writes it (JSON, Markdown,
figure), :mod:`~lightning_seqmem.present.render` renders it, :func:`load_report` reads it back."""

from __future__ import annotations

import datetime as _dt
import json
import math
import importlib.metadata
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from lightning_seqmem.core.advice import KINDS
from lightning_seqmem.core.forecast import NotEnoughMeasurements
from lightning_seqmem.core.records import PHASES
from lightning_seqmem.present.dry_fit import DRY_RUN_FIT, dry_fit_anchors, dry_fit_forecast
from lightning_seqmem.present.summary import rung_changes, run_summary

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

    from lightning_seqmem.plan.view import PlanView

__all__ = ["JSON_NAME", "MARKDOWN_NAME", "PNG_NAME", "REPORT_FORMAT", "build_report", "load_report"]

REPORT_FORMAT = "lightning-seqmem-report/1"
JSON_NAME, MARKDOWN_NAME, PNG_NAME = "seqmem_report.json", "seqmem_report.md", "seqmem_memory.png"


# ---- Building --------------------------------------------------------------------------------
def _run_facts(view: "PlanView", trainer: Optional["pl.Trainer"], device: Any = None,
               probe: Optional[str] = None) -> dict[str, Any]:
    from lightning_seqmem import __version__

    torch = sys.modules.get("torch")  # loaded by whoever measured; presentation never imports it

    facts: dict[str, Any] = {
        "device": None if device is None else str(device),
        "device_name": None,
        "probe": probe,
        "budget_bytes": view.settings.budget_bytes,
        "usable_budget_bytes": view.settings.usable_budget_bytes,
        "safety_margin": view.settings.safety_margin,
        "tolerance": view.settings.tolerance,
        "warmup_steps": view.settings.warmup_steps,
        "warmup_steps_after_change": view.settings.warmup_steps_after_change,
        "mitigations_allowed": list(view.ladder.allowed),
        "model_class": None,
        "num_parameters": None,
        "precision": None,
        "strategy": None,
        "world_size": None,
        "global_step": None,
        "versions": {"lightning_seqmem": __version__, "torch": _version("torch"),
                     "lightning": _version("lightning")},
        "curriculum": None,
    }
    if (device is not None and device.type == "cuda" and torch is not None
            and torch.cuda.is_available()):
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
    if view.settings.curriculum is not None:
        facts["curriculum"] = {
            **view.settings.curriculum.to_dict(),
            "stages": list(view.settings.curriculum.stages),
            "stages_run": list(view.course.stages),
            "capped_at": view.course.capped_at,
            "final_stage": view.course.stage,
        }
    return facts


def _version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _points(view: "PlanView") -> list[dict[str, Any]]:
    """Per (seq_len, batch_size, mitigations): max over non-warm-up records of each peak."""
    out: dict[tuple, dict[str, Any]] = {}
    for r in view.evidence.measured.records:
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
        for name in ([f"{ph}_peak_bytes" for ph in PHASES]
                     + ["reserved_bytes", "fragmentation_bytes"]):
            value = getattr(r, name)
            if value is not None:
                p[name] = value if p[name] is None else max(p[name], value)
    return [out[k] for k in sorted(out, key=lambda k: (k[1] * k[0], k[0], k[2]))]


def _predictors(view: "PlanView") -> dict[str, Any]:
    forecaster = view.evidence.forecaster
    quadratic, timeline = forecaster.quadratic, forecaster.timeline
    q: dict[str, Any] = {"available": quadratic is not None}
    if quadratic is not None:
        state = quadratic.to_dict()
        q["min_relative_uncertainty"] = state["min_relative_uncertainty"]
        q["confidence_z"] = state["confidence_z"]
        q["phases"] = {name: {k: v for k, v in c.items() if k != "covariance"}
                       for name, c in state["phases"].items()}
    r: dict[str, Any] = {
        "available": timeline is not None,
        "traced": [{"seq_len": t.seq_len, "batch_size": t.batch_size,
                    "measured_peak_bytes": t.measured_peak_bytes} for t in forecaster.traces],
    }
    if timeline is None:
        r["unavailable_reason"] = forecaster.timeline_unavailable_reason
    else:
        r.update(seq_lens=list(timeline.seq_lens), batch_size=timeline.batch_size,
                 notes=list(timeline.notes), num_allocations=int(timeline.coefficients.shape[1]),
                 max_fit_residual_bytes=timeline.max_fit_residual_bytes)
    settings = view.evidence.measured.forecasters
    verifications = [
        {"seq_len": v.seq_len, "batch_size": v.batch_size, "method": v.method,
         "forecast_bytes": v.forecast_bytes, "measured_bytes": v.measured_bytes,
         "relative_error": v.relative_error,
         "within_tolerance": abs(v.relative_error) <= view.settings.tolerance,
         "mitigations": list(key)}
        for key, f in settings.items() for v in f.verifications
    ]
    accuracy = {}
    for method in ("dry_run", "replay", "quadratic"):
        errors = [v["relative_error"] for v in verifications if v["method"] == method]
        if errors:
            accuracy[method] = {"num_verifications": len(errors),
                                "max_abs_error": max(abs(e) for e in errors),
                                "mean_abs_error": sum(abs(e) for e in errors) / len(errors),
                                "worst_under_prediction": min(min(errors), 0.0)}
    return {"mitigations": list(view.ladder.applied), "quadratic": q, "replay": r,
            "verifications": verifications,
            "accuracy": accuracy, "reserved_ratio": forecaster.reserved_ratio, "settings": [
                {"mitigations": list(key), "num_points": len(f.points), "num_traces": len(f.traces),
                 "ready": f.ready} for key, f in settings.items()]}


def _forecast_row(view: "PlanView", seq_len: int, batch_size: int,
                  anchors: Optional[dict[int, Any]] = None) -> dict[str, Any]:
    # the fit of the setting on now, else the dry run cached at that length, else the fit through
    # the dry runs cached (:mod:`.dry_fit`), else a dry run: a report runs no dry run it need not
    fc = (view.evidence.forecaster.forecast(seq_len, batch_size)
          if view.evidence.forecaster.ready else None)
    if fc is None and anchors is not None:
        fc = dry_fit_forecast(view, seq_len, batch_size, anchors)
    fc = fc or view.evidence.forecast(seq_len, batch_size)
    bound = view.evidence.bound_of(fc)
    row = {"seq_len": seq_len, "batch_size": batch_size, "method": fc.method,
           "peak_bytes": fc.peak_bytes, "upper_bytes": fc.upper_bytes,
           "reserved_upper_bytes": fc.reserved_upper_bytes,
           "phase_peak_bytes": dict(fc.phase_peak_bytes), "fits": None}
    if fc.method == DRY_RUN_FIT:
        row["detail"] = fc.detail
    for method in ("quadratic", "replay"):
        try:
            other = view.evidence.forecaster.forecast(seq_len, batch_size, method=method)
            row[f"{method}_peak_bytes"] = other.peak_bytes if other.method == method else None
        except (NotEnoughMeasurements, ValueError):
            row[f"{method}_peak_bytes"] = None
    if view.settings.usable_budget_bytes is not None:
        row["fits"] = bound <= view.settings.usable_budget_bytes
    return row


REPORT_MEASURED_LENGTHS = 8  # measured lengths given a forecast row (dynamic padding: hundreds)


def _spread(lengths: set[int], n: int) -> set[int]:
    """At most ``n`` of ``lengths``, evenly spread, the shortest and the longest kept.

    >>> sorted(_spread(set(range(10, 210)), 5)), _spread({3, 1}, 5) == {1, 3}
    ([10, 60, 110, 159, 209], True)
    """
    ordered = sorted(lengths)
    if len(ordered) <= n:
        return set(ordered)
    return {ordered[round(i * (len(ordered) - 1) / (n - 1))] for i in range(n)}


def _forecasts(view: "PlanView", batch_size: Optional[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"batch_size": batch_size, "at": [], "max_seq_len": None, "error": None}
    if batch_size is None or not (view.evidence.forecaster.ready
                                  or view.evidence.dry.answered(batch_size)):
        out["error"] = ("not enough measurements to forecast (two measured lengths, or a dry run, "
                        "are needed)")
        return out
    measured = {r.seq_len for r in view.evidence.measured.records}
    if view.evidence.forecaster.ready:  # the fit answers: any length, for free
        lengths = _spread(measured, REPORT_MEASURED_LENGTHS)
    else:  # the dry run answers (one each): the lengths it ran already, and the longest measured
        lengths = (_spread(set(view.evidence.dry.answered(batch_size)), REPORT_MEASURED_LENGTHS)
                   | {max(measured, default=0)} - {0})
    if view.settings.curriculum is not None:
        lengths |= set(view.settings.curriculum.stages)
        target = out["target"] = view.settings.curriculum.target
        lengths |= {2 * target, 4 * target}
    else:
        longest = max(measured, default=0)
        lengths |= {2 * longest, 4 * longest} - {0}
    lengths = {L for L in lengths if view.settings.within_limit(L)}  # within the model's positions
    try:
        if view.settings.usable_budget_bytes is not None:  # first: its dry run anchors the rows
            out["max_seq_len"] = view.evidence.max_seq_len(view.settings.usable_budget_bytes,
                                                           batch_size)
    except Exception as exc:  # noqa: BLE001 - a report is written even when a forecast fails
        out["error"] = f"{type(exc).__name__}: {exc}"
    try:
        anchors = None if view.evidence.forecaster.ready else dry_fit_anchors(view, batch_size)
        out["at"] = [_forecast_row(view, L, batch_size, anchors) for L in sorted(lengths)]
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def _mitigations(view: "PlanView") -> dict[str, Any]:
    """Allowed rungs, those on now, each switch (the planner's events) and the record changes."""
    changes = [{"step": r.step, "global_step": r.global_step, "seq_len": r.seq_len,
                "before": list(before), "after": list(after)}
               for r, before, after in rung_changes(view.evidence.measured.records)]
    events = [{k: v for k, v in e.items()
               if k in ("name", "step", "seq_len", "batch_size", "detail", "before_bytes",
                        "before_method", "after_bytes", "removed")}
              for e in view.ladder.events]
    return {"allowed": list(view.ladder.allowed), "active": list(view.ladder.applied),
            "not_applicable": dict(view.ladder.not_applicable), "events": events,
            "changes": changes}


def _warnings(view: "PlanView") -> list[dict[str, str]]:
    return [{"key": key, "kind": kind, "meaning": KINDS.get(kind, "other")}
            for key, kind in sorted(view.advice.warned.items())]


def _records_summary(view: "PlanView") -> dict[str, Any]:
    records = view.evidence.measured.records
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


def _peak_site(view: "PlanView", breakdown: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Where the peak sits at the longest length measured: the end-of-fit breakdown's (``source``
    ``"breakdown"``) when it traced that length or longer, else the dry run of that step
    (``"dry_run"``; cached, or one fake step now); None when neither answers. ``seq_len``,
    ``batch_size``, ``mitigations``, then :meth:`~lightning_seqmem.core.peak.PeakSite.to_dict`."""
    measured = [r for r in view.evidence.measured.records if not r.warmup]
    longest = max(measured, key=lambda r: (r.seq_len, r.batch_size, r.peak_bytes), default=None)
    site = (breakdown or {}).get("peak_site")
    if site is not None and (longest is None or breakdown["seq_lens"][-1] >= longest.seq_len):
        return {"source": "breakdown", "seq_len": breakdown["seq_lens"][-1],
                "batch_size": breakdown["batch_size"],
                "mitigations": list(view.ladder.applied), **site}  # traced with the final rungs on
    if longest is None:
        return None
    key = (longest.seq_len, longest.batch_size, tuple(longest.mitigations))
    found = view.evidence.dry.site(*key) if view.evidence.dry.peak(*key) is not None else None
    if found is None:
        return None
    return {"source": "dry_run", "seq_len": key[0], "batch_size": key[1],
            "mitigations": list(key[2]), **found.to_dict()}


def build_report(view: "PlanView", trainer: Optional["pl.Trainer"] = None,
                 include_records: bool = True, device: Any = None, probe: Optional[str] = None,
                 breakdown: Optional[dict[str, Any]] = None,
                 validation: Optional[list[dict[str, Any]]] = None) -> dict[str, Any]:
    """Everything the planner knows, as plain JSON-able values (bytes, tokens, fractions).

    Keys: ``format``, ``created``, ``run`` (device, budget, model, precision, curriculum),
    ``points`` (per ``(seq_len, batch_size, mitigations)``: the max over non-warm-up steps of each
    peak), ``predictors`` (fits, replay, verifications, accuracy), ``forecasts`` (at the measured
    and curriculum lengths, the target × 2 and × 4; the largest length that fits), ``mitigations``,
    ``warnings``, ``records_summary``, ``summary`` (a :class:`~.summary.RunSummary`), ``breakdown``
    (with ``SeqMemCallback(breakdown=True)``), ``validation`` (the validation batches measured:
    shape, rungs, dry-run and measured peaks), ``peak_site`` (:func:`_peak_site`) and, with
    ``include_records``, ``records`` (every :class:`~lightning_seqmem.StepRecord` as a dict)."""
    batch_size = view.evidence.measured.last_batch_size
    if batch_size is None and view.evidence.measured.records:
        batch_size = view.evidence.measured.records[-1].batch_size
    report = {
        "format": REPORT_FORMAT,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "run": _run_facts(view, trainer, device, probe),
        "points": _points(view),
        "predictors": _predictors(view),
        "forecasts": _forecasts(view, batch_size),
        "mitigations": _mitigations(view),
        "warnings": _warnings(view),
        "records_summary": _records_summary(view),
        "summary": run_summary(view).to_dict(),
    }
    if breakdown is not None:
        report["breakdown"] = breakdown
    report["validation"] = list(validation or [])
    report["peak_site"] = _peak_site(view, breakdown)
    if include_records:
        report["records"] = [r.to_dict() for r in view.evidence.measured.records]
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
    """Read a report written by ``write_report`` (a ``.json`` file, or the directory holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / JSON_NAME
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    if not isinstance(report, dict) or report.get("format") != REPORT_FORMAT:
        raise ValueError(f"{str(path)!r} is not a lightning-seqmem report "
                         f"(expected format {REPORT_FORMAT!r})")
    return report
