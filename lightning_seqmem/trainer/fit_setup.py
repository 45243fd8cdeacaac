"""Before the first step: the checks of the module the callback runs on, and the dry run it judges by.

``SeqMemCallback.on_fit_start`` (after ``configure_model``, where modules are sharded and often
compiled) calls, in this order:

* :func:`check_parameters_fit`: a budget below this rank's parameters and buffers raises
  :class:`~lightning_seqmem.MemoryBudgetError` before any step;
* :func:`check_compiled`: a ``torch.compile``'d module keeps compiling, measured one step in
  :data:`COMPILED_MEASURE_EVERY_N_STEPS` under the tracker, said in one warning;
* :func:`start_dry_run` (rank zero, ``dry_run=True``): the dry run of the training step on a fake
  copy of the module that the planner judges new settings by (on a CPU run its real values kept
  within what the budget leaves, and the callback's own copies in every answer: :mod:`.own_memory`).

Example:
    >>> import torch
    >>> from lightning_seqmem.plan.planner import SeqMemPlanner
    >>> planner = SeqMemPlanner(memory_budget_bytes=10_000, safety_margin=0.1)  # 9,000 bytes usable
    >>> check_parameters_fit(planner, torch.nn.Linear(10, 10), torch.device("cpu"))  # 440 bytes
    >>> check_parameters_fit(planner, torch.nn.Linear(100, 100), torch.device("cpu"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lightning_seqmem.core.records.MemoryBudgetError: seqmem: memory_budget=9.8 KiB cannot be met: the parameters and buffers alone take 39.5 KiB, ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import lightning.pytorch as pl
import torch

from lightning_seqmem.core import advice as A
from lightning_seqmem.core.records import MemoryBudgetError
from lightning_seqmem.trainer.guard import warn_advice

if TYPE_CHECKING:
    from lightning_seqmem.plan.planner import SeqMemPlanner
    from lightning_seqmem.trainer.callback import SeqMemCallback

COMPILED_MEASURE_EVERY_N_STEPS = 10
"""With a ``torch.compile``'d module and the tracker, at most one step in this many (besides warm-ups
and the first steps at a new shape) is measured: a measured step runs eager."""


def check_parameters_fit(planner: "SeqMemPlanner", pl_module: torch.nn.Module, device: Optional[torch.device]) -> None:
    """:class:`MemoryBudgetError` where this rank's parameters and buffers on the training device
    (local shards under FSDP2) alone exceed the usable budget: no step could fit."""
    usable = planner.settings.usable_budget_bytes
    if usable is None or device is None:
        return
    held = 0
    for tensor in (*pl_module.parameters(), *pl_module.buffers()):
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's shard
        if local.device.type == device.type:
            held += local.nbytes
    if held > usable:
        assert planner.settings.budget_bytes is not None
        raise MemoryBudgetError(A.parameters_over_budget(held, usable, planner.settings.budget_bytes,
                                                         planner.settings.safety_margin))


def check_compiled(cb: "SeqMemCallback", pl_module: pl.LightningModule) -> None:
    """A ``torch.compile``'d module: measure without preventing compilation, and say so once
    (see the class docstring). Runs after ``configure_model``, where modules are often compiled."""
    from lightning_seqmem.dryrun.step import compiled_reason

    compiled = cb.edge.compiled_reason = compiled_reason(pl_module)
    probe = cb.edge.probe
    tracked_compiled = compiled is not None and probe is not None and probe.name == "tracker"
    every = max(cb.config.measure_every_n_steps, COMPILED_MEASURE_EVERY_N_STEPS) if tracked_compiled else cb.config.measure_every_n_steps
    cb.planner.bind_run(measure_every_n_steps=every)
    if compiled is None or probe is None:
        return
    cb.planner._advice.advise(A.compiled_module(compiled, probe.name, cb.planner.settings.measure_every_n_steps))
    warn_advice(cb)


def start_dry_run(cb: "SeqMemCallback", trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
    """The dry run of this module's training step (:class:`~lightning_seqmem.dryrun.run.TrainingRunDryRun`,
    on rank zero) that the planner judges each new setting by, with the rungs on now."""
    from lightning_seqmem.diagnostics.peak_trace import trace_peak_site
    from lightning_seqmem.dryrun.run import TrainingRunDryRun
    from lightning_seqmem.trainer.own_memory import resident_bytes, value_room_bytes

    return TrainingRunDryRun(trainer, pl_module, lambda: cb.planner.ladder.applied,
                             lambda why, *shape: cb.planner._advice.advise(A.dry_run_unavailable(why, *shape)),
                             template=cb.edge.sharding_template, site=trace_peak_site,
                             room=lambda: value_room_bytes(cb), resident=lambda: resident_bytes(cb))
