"""The measured step around the probe: started at the batch start, stopped, gathered and recorded at its end.

At the end of ``on_train_batch_start`` :func:`start_measurement` tells the planner the step begins
(:meth:`~lightning_seqmem.plan.planner.SeqMemPlanner.begin_step`: measured, traced, a warm-up?) and
starts the probe on the tensors alive before the batch (the callback's own copies on the training
device among them: :mod:`.own_memory`); the callback marks the backward and
optimizer phases. At ``on_train_batch_end`` the step is timed (:func:`step_seconds`), the probe
stopped (:func:`stop_probe`), every rank's measurement gathered (:func:`gather`: the row with the
highest peak, whole) and the record kept and logged (:func:`record_step`). The guarded ones
(:func:`~lightning_seqmem.trainer.guard.guarded`) turn an internal failure into one warning.

Example:
    >>> import time, torch
    >>> from types import SimpleNamespace as NS
    >>> started = time.perf_counter()
    >>> isinstance(step_seconds(started, NS(measure=True), torch.nn.Linear(2, 2)), float)  # a measured step
    True
    >>> step_seconds(started, NS(measure=False), torch.nn.Linear(2, 2)) is None  # not measured: not timed
    True
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

import lightning.pytorch as pl
import torch

from lightning_seqmem.core import advice as A
from lightning_seqmem.measure.batch import read_batch_shape
from lightning_seqmem.plan.metrics import metrics as plan_metrics
from lightning_seqmem.measure.probes import existing_tensors
from lightning_seqmem.plan.planner import Decision, PendingStep
from lightning_seqmem.trainer import access as edge
from lightning_seqmem.trainer import outputs
from lightning_seqmem.trainer.own_memory import own_tensors, untracked_bytes
from lightning_seqmem.trainer import ranks as distributed
from lightning_seqmem.trainer.guard import fail, guarded, warn_once

if TYPE_CHECKING:
    from lightning_seqmem.trainer.callback import SeqMemCallback


@guarded
def start_measurement(cb: "SeqMemCallback", trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                      decision: Decision, shape: tuple[int, int], check: bool = False) -> None:
    """Begin the step the planner decided on (``shape``: the one agreed across ranks) and, for a
    measured one, start the probe in its forward phase; ``check``: a rung's one-time check runs in
    this step on some rank (:func:`.batch_decision.check_pending`): a warm-up."""
    cb.edge.shape = tuple(int(x) for x in read_batch_shape(batch, cb.config.seq_len_fn))  # what this rank really runs
    if decision.seq_len is None:
        planned = shape
    else:
        planned = (cb.planner.course.batch_at(shape[0], shape[1], decision.seq_len), decision.seq_len)
    pending = cb.edge.pending = cb.planner.begin_step(planned[1], planned[0], edge.steps_optimizer(trainer),
                                                      trainer.global_step, trainer.current_epoch)
    probe = cb.edge.probe
    if check:
        pending.warmup, pending.traced = True, False  # a rung's one-time check adds to this peak
    if cb.edge.compiled_reason is not None and probe is not None and probe.name == "cuda":
        pending.traced = False  # a traced step runs a dispatch mode, hence eager: keep it compiled
    if pending.measure:
        assert probe is not None, "setup() was not called"
        existing = [*existing_tensors(pl_module, trainer.optimizers, batch), *own_tensors(cb)]
        if probe.name == "tracker":  # (the allocator's counters hold what no tensor shows)
            probe.start_step(existing, record_events=pending.traced,
                             resident_bytes=untracked_bytes(cb, trainer))
        else:
            probe.start_step(existing, record_events=pending.traced)
        probe.mark_phase("forward")


def step_seconds(started: Optional[float], pending: Optional[PendingStep], pl_module: Any) -> Optional[float]:
    """Wall seconds of the measured step that just ran (forward, backward, optimizer: from the
    end of this callback's batch start, ``started``, to its batch end; on CUDA after a
    synchronize), or None."""
    if started is None or pending is None or not pending.measure:
        return None
    try:
        device = getattr(pl_module, "device", None)
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001 - an untimed step is priced by the others
        return None
    return time.perf_counter() - started


@guarded
def stop_probe(cb: "SeqMemCallback", pending: Optional[PendingStep]) -> Any:
    """This rank's measurement of the step that just ran, or None where it was not measured."""
    probe = cb.edge.probe
    if pending is None or not pending.measure or probe is None or not probe.running:
        return None
    return probe.end_step()


def gather(cb: "SeqMemCallback", trainer: pl.Trainer, memory: Any, refused_here: bool) -> Optional[tuple[bool, Any]]:
    """(a rung was refused on some rank, the row kept) from every rank's measurement
    (:func:`~lightning_seqmem.trainer.ranks.gather_measurement`); None where a rank stopped
    measuring, and then every rank stops (no more collectives)."""
    try:
        any_failed, any_refused, row = distributed.gather_measurement(trainer, cb.edge.failed, memory, cb.edge.shape,
                                                                      refused_here)
    except Exception as exc:  # noqa: BLE001
        fail(cb, "the gathering of peaks across ranks", exc)
        cb.edge.stopped = True
        return None
    if any_failed:
        fail(cb, "another rank", RuntimeError("a rank stopped measuring, so every rank does"))
        cb.edge.stopped = True
        return None
    return any_refused, row


@guarded
def record_step(cb: "SeqMemCallback", trainer: pl.Trainer, pending: Optional[PendingStep], row: Any, memory: Any,
           seconds: Optional[float] = None) -> None:
    """End the batch in the planner (a curriculum stage counts it only at the stage's length), keep
    the gathered row as a :class:`~lightning_seqmem.core.records.StepRecord` and log its scalars."""
    shape = cb.edge.shape
    ran = shape[1] if shape else None  # this rank's batch as it ran
    held = cb.config.curriculum is not None and pending is not None and ran is not None and ran != pending.seq_len
    cb.planner.end_batch(at_stage_length=not held)
    if held:
        cb.planner._advice.advise(A.curriculum_not_applied(pending.seq_len, ran))
    if pending is None or row is None:
        return
    rank, reduced, seq_len, batch_size = row
    trace = (shape[1], shape[0], memory) if memory is not None and shape else None
    record = cb.planner.observe(pending, reduced, seq_len, batch_size, trace=trace,
                                rank=rank if trainer.world_size > 1 else None, step_seconds=seconds)
    try:
        metrics = plan_metrics(record, cb.planner.evidence, cb.planner.course)
    except Exception as exc:  # noqa: BLE001 - a forecast failure must not stop the logging
        warn_once(cb, A.output_failed("the forecast for logging", repr(exc)))
        metrics = {}
    outputs.log_metrics(trainer, metrics, step=record.global_step)
