"""At the end of fit, on rank zero: the last advice, the memory breakdown, the figure, the report, the summary.

``SeqMemCallback.on_train_end`` calls :func:`train_end`; :func:`run_breakdown` and
:func:`write_report` are the bodies of the callback's public methods of the same names. Each output
goes through :mod:`~lightning_seqmem.trainer.outputs`, guarded on its own (:func:`.guard.safely`): one that
fails is said in one warning and the others are still written.

Example:
    >>> from types import SimpleNamespace as NS
    >>> train_end(NS(records=[]), NS(is_global_zero=True), None)  # no step measured: nothing to write
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import lightning.pytorch as pl

from lightning_seqmem.core import advice as A
from lightning_seqmem.measure.batch import read_batch_shape
from lightning_seqmem.trainer import outputs
from lightning_seqmem.trainer.guard import safely, warn_advice

if TYPE_CHECKING:
    from lightning_seqmem.trainer.callback import SeqMemCallback


def train_end(cb: "SeqMemCallback", trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """The precision advice, the memory breakdown (``breakdown=True``), the memory figure to
    TensorBoard, the JSON / Markdown report next to the logs and the summary (``summary=True``)."""
    if not trainer.is_global_zero or not cb.records:
        return
    if not cb.edge.failed:
        safely(cb, "the precision advice", lambda: advice_at_end(cb, trainer))
    if cb.config.breakdown and not cb.edge.failed:
        safely(cb, "the memory breakdown", lambda: cb.run_breakdown(trainer, pl_module))
    safely(cb, "the memory figure", lambda: outputs.log_figure(trainer, cb.planner))
    paths: list[Any] = []
    safely(cb, "the report", lambda: paths.extend(cb.write_report(trainer) or ()))
    if cb.config.summary:
        safely(cb, "the summary", lambda: print(outputs.fit_summary(cb.planner, trainer, paths), flush=True))


def advice_at_end(cb: "SeqMemCallback", trainer: pl.Trainer) -> None:
    """Advice from the forecast as it stands now (:mod:`lightning_seqmem.dryrun.advice_now`): bf16 only
    where a dry run says it lowers the peak."""
    from lightning_seqmem.dryrun.advice_now import precision_advice

    item = precision_advice(cb.edge.dry_runner, cb.planner, str(trainer.precision), cb.edge.device)
    if item is not None:
        cb.planner._advice.advise(item)
    warn_advice(cb)


def run_breakdown(cb: "SeqMemCallback", trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """Trace the memory breakdown now (see :func:`lightning_seqmem.trainer.fit_breakdown.run_breakdown`);
    sets the callback's ``breakdowns``, ``breakdown_table``, ``breakdown_report``, warns each
    diagnosis once, logs the tables as TensorBoard text and returns the section."""
    from lightning_seqmem.trainer.fit_breakdown import run_breakdown as trace_breakdown

    section, cb.edge.breakdowns, cb.edge.breakdown_table = trace_breakdown(
        cb.planner, cb.edge.breakdown_batch, lambda batch: read_batch_shape(batch, cb.config.seq_len_fn), cb.edge.device,
        trainer, pl_module)
    cb.edge.breakdown_report = section
    warn_advice(cb)  # one warning per diagnosis
    outputs.log_breakdown(trainer, section)
    return section


def write_report(cb: "SeqMemCallback", trainer: pl.Trainer, directory: Optional[str] = None) -> Any:
    """Write ``seqmem_report.json``, ``seqmem_report.md`` and the figure; return their paths
    (``directory`` defaults to the logger's ``log_dir``, ``default_root_dir`` without a logger)."""
    probe = cb.edge.probe.name if cb.edge.probe is not None else cb.config.probe
    note = A.program_note(cb.edge.compiled_reason, probe)
    probe = f"{probe}: measurements and forecasts {note}" if note else probe
    return outputs.write_report(cb.planner, trainer, directory, device=cb.edge.device, probe=probe,
                                breakdown=cb.edge.breakdown_report)
