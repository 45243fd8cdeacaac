"""Everything the callback writes: logged scalars, the TensorBoard layout, figure and text, the
report files and the OOM diagnosis. The package's one module touching ``trainer.loggers`` or the
filesystem; what it writes is built elsewhere (:mod:`.planner`, :mod:`.panels`, :mod:`.report`).
Files are written whole or not at all (:func:`atomic_write`), even on a full disk or a crash."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import tempfile
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

from lightning.pytorch.loggers import TensorBoardLogger

from lightning_seqmem.present.panels import (BREAKDOWN_TAG, FIGURE_TAG, custom_scalars_layout,
                                             memory_figure)
from lightning_seqmem.present.report import JSON_NAME, MARKDOWN_NAME, PNG_NAME, build_report
from lightning_seqmem.present.render import render_markdown
from lightning_seqmem.present.summary import run_summary

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl
    from matplotlib.figure import Figure

    from lightning_seqmem.plan.schedule import PendingStep
    from lightning_seqmem.plan.view import PlanView

__all__ = ["OOM_NAME", "atomic_write", "fit_summary", "log_breakdown", "log_figure", "log_metrics",
           "log_text", "report_dir", "report_oom", "save_figure", "write_layout",
           "write_oom_diagnosis", "write_report"]

OOM_NAME = "seqmem_oom_diagnosis.json"

# Loggers whose experiment already holds the layout (a second write would replace it: write once).
_LAYOUT_WRITTEN: "weakref.WeakSet[Any]" = weakref.WeakSet()
# logger -> global steps whose figure was already logged (the callback and a script may both ask).
_FIGURES_LOGGED: "weakref.WeakKeyDictionary[Any, set[int]]" = weakref.WeakKeyDictionary()


# -- Files -------------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w") -> Iterator[Any]:
    """Open a temporary file beside ``path``; on success rename it to ``path``, else remove it.

    Example:
        >>> import tempfile, pathlib
        >>> target = pathlib.Path(tempfile.mkdtemp()) / "a.txt"
        >>> with atomic_write(target) as f:
        ...     _ = f.write("done")
        >>> target.read_text()
        'done'
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def report_dir(trainer: "pl.Trainer") -> str:
    """Where the report goes: the first logger's ``log_dir`` (else its ``save_dir``), else
    ``trainer.default_root_dir``. Unlike ``trainer.log_dir`` it does not broadcast: rank zero may
    call it alone."""
    for logger in trainer.loggers:
        for attribute in ("log_dir", "save_dir"):
            directory = getattr(logger, attribute, None)
            if directory:
                return str(directory)
    return str(trainer.default_root_dir)


def save_figure(view: "PlanView", path: Any, **kwargs: Any) -> "Figure":
    """Draw :func:`~lightning_seqmem.present.panels.memory_figure` (``kwargs`` go to it) and save
    it to ``path`` (PNG, SVG or PDF, by its suffix), whole or not at all (:func:`atomic_write`)."""
    figure = memory_figure(view, **kwargs)
    suffix = Path(path).suffix.lstrip(".") or "png"
    with atomic_write(path, "wb") as f:
        figure.savefig(f, format=suffix)
    return figure


def write_report(view: "PlanView", trainer: Optional["pl.Trainer"] = None,
                 directory: Optional[str | os.PathLike] = None,
                 **facts: Any) -> Optional[tuple[Path, Path, Path]]:
    """Write ``seqmem_report.json``, ``seqmem_report.md`` and ``seqmem_memory.png`` to ``directory``
    (default :func:`report_dir` of ``trainer``); ``facts`` go to
    :func:`~lightning_seqmem.present.report.build_report` (``device``, ``probe``, ``breakdown``).
    Returns the three paths; None, writing nothing, on ranks other than global zero."""
    if trainer is not None and not trainer.is_global_zero:
        return None
    if directory is None:
        if trainer is None:
            raise ValueError("`write_report` needs a `trainer` or a `directory`")
        directory = report_dir(trainer)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    report = build_report(view, trainer, **facts)
    png_path = out / PNG_NAME
    save_figure(view, png_path)
    report["files"] = {"json": JSON_NAME, "markdown": MARKDOWN_NAME, "figure": PNG_NAME}
    json_path, md_path = out / JSON_NAME, out / MARKDOWN_NAME
    with atomic_write(json_path) as f:
        f.write(json.dumps(report, indent=2, allow_nan=False) + "\n")
    with atomic_write(md_path) as f:
        f.write(render_markdown(report))
    return json_path, md_path, png_path


def write_oom_diagnosis(view: "PlanView", trainer: Any, exception: BaseException,
                        pending: Optional["PendingStep"] = None, last_records: int = 10) -> str:
    """Write ``seqmem_oom_diagnosis.json``: the last records, the forecast for the failing batch,
    what the planner would have done next; with ``torch.cuda.memory._record_memory_history()`` on,
    the allocator snapshot beside it as ``seqmem_oom_snapshot.pickle`` (open it at
    https://pytorch.org/memory_viz). Returns the diagnosis's path."""
    import torch

    directory = report_dir(trainer)
    os.makedirs(directory, exist_ok=True)
    seq_len, batch_size = ((pending.seq_len, pending.batch_size) if pending is not None
                           else (None, None))
    forecast: Any = None
    forecast_used = ("none: no forecast existed for this batch (nothing measured at two lengths, "
                     "no dry run)")
    if seq_len and batch_size:
        try:
            fc = _forecast_used(view, seq_len, batch_size, pending)
            if fc is not None:
                forecast = vars(fc)
                forecast_used = FORECAST_NAMES.get(fc.method, fc.method)
        except Exception as exc:  # noqa: BLE001
            forecast = f"forecast failed: {exc!r}"
            forecast_used = f"none: the forecast failed ({exc!r})"
    summary = run_summary(view)
    diagnosis: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "error": f"{type(exception).__name__}: {exception}",
        "step": view.course.step,
        "global_step": getattr(trainer, "global_step", None),
        "failing_batch": {"seq_len": seq_len, "batch_size": batch_size},
        "forecast_for_failing_batch": forecast,
        "forecast_used": forecast_used,
        "usable_budget_bytes": summary.usable_budget_bytes,
        "mitigations_applied": list(summary.rungs_on),
        "mitigations_left": list(summary.rungs_left),
        "summary": summary.to_dict(),  # what ran until the failing batch (present.summary)
        "would_have_done": _would_have_done(view, batch_size),
        "last_records": [r.to_dict() for r in view.evidence.measured.records[-last_records:]],
        "cuda_snapshot": None,
    }
    if torch.cuda.is_available():
        diagnosis["cuda_memory_summary"] = torch.cuda.memory_summary()
        try:
            snapshot = torch.cuda.memory._snapshot()
            if snapshot.get("device_traces") and any(snapshot["device_traces"]):
                snapshot_path = os.path.join(directory, "seqmem_oom_snapshot.pickle")
                with atomic_write(snapshot_path, "wb") as f:
                    pickle.dump(snapshot, f)
                diagnosis["cuda_snapshot"] = snapshot_path
        except Exception:  # noqa: BLE001 - history was off, or the allocator cannot snapshot
            pass
    path = os.path.join(directory, OOM_NAME)
    with atomic_write(path) as f:
        json.dump(diagnosis, f, indent=2, default=str)
    return path


def fit_summary(view: "PlanView", trainer: Optional["pl.Trainer"], paths: Any = ()) -> str:
    """The few lines printed at the end of fit (``SeqMemCallback(summary=True)``): what ran (the
    longest length, the measured peak against the usable budget, the rungs on, how many warnings)
    and where to look (the folder of the report files, the TensorBoard panels).

    Example:
        >>> from lightning_seqmem.plan.planner import SeqMemPlanner
        >>> planner = SeqMemPlanner(memory_budget_bytes=2**20)
        >>> print(fit_summary(planner, None, ("runs/version_0/seqmem_report.json",)))
        ... # doctest: +NORMALIZE_WHITESPACE
        seqmem: no training step was measured; usable budget 921.6 KiB (budget 1.0 MiB); rungs on:
        none; 0 warnings.
        seqmem: report in runs/version_0 (seqmem_report.md, seqmem_report.json, seqmem_memory.png);
        no TensorBoard logger: no panels.
    """
    first = f"seqmem: {run_summary(view).sentence()}{' (above)' if view.advice.warned else ''}."
    paths = [Path(p) for p in paths or ()]
    folder = str(paths[0].parent) if paths else report_dir(trainer) if trainer is not None else None
    where = (f"report in {folder} ({MARKDOWN_NAME}, {JSON_NAME}, {PNG_NAME})" if paths else
             f"no report written (see the warnings){f'; logs in {folder}' if folder else ''}")
    loggers = _tensorboard_loggers(trainer) if trainer is not None else []
    panels = (f"panels: tensorboard --logdir {loggers[0].log_dir} (tabs CUSTOM SCALARS, IMAGES), "
              f"or seqmem panels {loggers[0].log_dir}" if loggers
              else "no TensorBoard logger: no panels")
    return f"{first}\nseqmem: {where}; {panels}."


def report_oom(view: "PlanView", trainer: Any, exception: BaseException,
               pending: Optional["PendingStep"] = None) -> None:
    """Write the OOM diagnosis and say where (one warning); never raises: the real error stands."""
    from lightning.pytorch.utilities import rank_zero_warn

    from lightning_seqmem.core.records import PredictedOOMWarning, SeqMemFailureWarning

    try:
        path = write_oom_diagnosis(view, trainer, exception, pending)
        rank_zero_warn(f"seqmem: out of memory; diagnosis written to {path}",
                       category=PredictedOOMWarning)
    except Exception as exc:  # noqa: BLE001 - never mask the real error
        rank_zero_warn(f"seqmem: could not write the OOM diagnosis ({exc!r})",
                       category=SeqMemFailureWarning)


FORECAST_NAMES = {"dry_run": "dry run", "replay": "timeline replay", "quadratic": "quadratic fit"}
"""The predictor behind a forecast, in words (``Forecast.method`` -> name)."""


def _forecast_used(view: "PlanView", seq_len: int, batch_size: int,
                   pending: Optional["PendingStep"]) -> Any:
    """The forecast the planner had for the failing batch: the one kept to verify it (the dry
    run's, the replay's or the fit's), else the dry run's or the fit's now; None if none exists."""
    kept = (view.evidence.measured.kept_forecast(seq_len, batch_size, pending.mitigations)
            if pending is not None else None)
    if kept is not None:
        return kept
    try:
        return view.evidence.forecast(seq_len, batch_size,
                                      pending.mitigations if pending is not None else None)
    except Exception:  # noqa: BLE001 - NotEnoughMeasurements, a length past the model's limit
        return None


def _would_have_done(view: "PlanView", batch_size: Optional[int]) -> str:
    if view.settings.usable_budget_bytes is None:
        return "nothing: no memory budget was set, so forecasts were informational"
    if not view.evidence.forecaster.ready and not view.evidence.dry.any_answered():
        return ("nothing yet: fewer than two lengths were measured and no dry run answered, so no "
                "forecast existed")
    left = [m for m in view.ladder.allowed if m not in view.ladder.applied]
    if left:
        return f"switch on {left[0]!r} before growing past the largest length that fits"
    batch_size = batch_size or view.evidence.measured.last_batch_size or 1
    fit = view.evidence.max_seq_len(view.settings.usable_budget_bytes, batch_size)
    if fit <= 0:
        from lightning_seqmem.core.advice import nothing_fits

        return f"stop: {nothing_fits(view.ladder.applied, batch_size)}"
    by = ("dry run" if not view.evidence.forecaster.ready else FORECAST_NAMES[
        "replay" if view.evidence.forecaster.timeline is not None else "quadratic"])
    return (f"cap the sequence length at {fit} (the largest forecast to fit the usable budget, by "
            f"the {by})")


# -- Loggers -----------------------------------------------------------------------------------
def log_metrics(trainer: "pl.Trainer", metrics: dict[str, float], step: int,
                prefix: str = "seqmem/") -> None:
    """Log ``metrics`` (tags without ``prefix``) to every logger of ``trainer``."""
    if trainer.loggers:
        tagged = {f"{prefix}{k}": float(v) for k, v in metrics.items()}
        for logger in trainer.loggers:
            logger.log_metrics(tagged, step=step)


def _tensorboard_loggers(trainer: "pl.Trainer") -> list[TensorBoardLogger]:
    return [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]


def _logger_prefix(logger: TensorBoardLogger) -> str:
    """What ``TensorBoardLogger(prefix=...)`` puts before every tag (``"<prefix>-"`` or nothing)."""
    prefix = getattr(logger, "_prefix", "") or ""
    return f"{prefix}{logger.LOGGER_JOIN_CHAR}" if prefix else ""


def write_layout(trainer: "pl.Trainer", prefix: str = "seqmem/") -> int:
    """Write :func:`custom_scalars_layout` to every ``TensorBoardLogger`` of ``trainer``, once each
    (TensorBoard keeps only the last layout), on global rank zero (the other ranks' experiments are
    dummies); a logger made with ``prefix=`` gets its prefixed tags. Returns how many it wrote."""
    if not trainer.is_global_zero:
        return 0
    written = 0
    for logger in _tensorboard_loggers(trainer):
        if logger in _LAYOUT_WRITTEN:
            continue
        logger.experiment.add_custom_scalars(custom_scalars_layout(_logger_prefix(logger) + prefix))
        _LAYOUT_WRITTEN.add(logger)
        written += 1
    return written


def log_figure(trainer: "pl.Trainer", view: "PlanView",
               step: Optional[int] = None) -> Optional["Figure"]:
    """Draw :func:`memory_figure` and log it under :data:`FIGURE_TAG` to every TensorBoard logger
    (at ``step``, default ``trainer.global_step``; once a step per logger). Returns the figure, or
    None off global rank zero or without a TensorBoard logger."""
    loggers = _tensorboard_loggers(trainer)
    if not trainer.is_global_zero or not loggers:
        return None
    step = trainer.global_step if step is None else int(step)
    figure = memory_figure(view)
    for logger in loggers:
        steps = _FIGURES_LOGGED.setdefault(logger, set())
        if step in steps:
            continue
        logger.experiment.add_figure(FIGURE_TAG, figure, global_step=step, close=False)
        logger.experiment.flush()
        steps.add(step)
    return figure


def log_breakdown(trainer: "pl.Trainer", section: dict[str, Any]) -> int:
    """The memory breakdown's tables as TensorBoard text (:data:`.panels.BREAKDOWN_TAG`)."""
    from lightning_seqmem.present.render import render_breakdown_markdown

    return log_text(trainer,
                    render_breakdown_markdown(section, "### seqmem: where the memory goes"))


def log_text(trainer: "pl.Trainer", text: str, step: Optional[int] = None,
             tag: Optional[str] = None) -> int:
    """Log Markdown ``text`` (the *TEXT* tab) under ``tag`` (default :data:`BREAKDOWN_TAG`) to every
    TensorBoard logger at ``step`` (default ``trainer.global_step``), on global rank zero only.
    Returns how many loggers got it."""
    if not trainer.is_global_zero:
        return 0
    step = trainer.global_step if step is None else int(step)
    loggers = _tensorboard_loggers(trainer)
    for logger in loggers:
        logger.experiment.add_text(tag or BREAKDOWN_TAG, text, global_step=step)
        logger.experiment.flush()
    return len(loggers)
