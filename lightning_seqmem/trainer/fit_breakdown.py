"""The memory breakdown at the end of fit (``SeqMemCallback(breakdown=True)``): the work is
:mod:`lightning_seqmem.diagnostics.section`'s; this module reads what it needs from the trainer and
the view (the first optimizer, the autocast context, the micro-batching on, the free GPU room)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from lightning_seqmem.core.advice import Advice
from lightning_seqmem.diagnostics.compare import compare_breakdowns
from lightning_seqmem.diagnostics.findings import MemoryDiagnosisWarning
from lightning_seqmem.diagnostics.section import end_of_fit_plan, end_of_fit_section, width_dims
from lightning_seqmem.measure.probes import existing_tensors
from lightning_seqmem.mitigations.microbatch.microbatch_step import is_micro_batching

if TYPE_CHECKING:  # pragma: no cover
    from lightning_seqmem.plan.view import PlanView

__all__ = ["run_breakdown"]


def _room_beside(pl_module: Any, optimizer: Any, device: torch.device) -> float:
    """Bytes a copy of the model may take on ``device`` beside the trained one (90% of the free)."""
    state = sum(t.numel() * t.element_size()
                for t in existing_tensors(pl_module, [optimizer], None))
    free = (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
            - torch.cuda.memory_allocated(device))
    return 0.9 * (free - state)


def run_breakdown(view: "PlanView", kept: Optional[tuple[int, Any]],
                  shape_of: Callable[[Any], tuple[int, int]], device: Any, trainer: Any,
                  pl_module: Any) -> tuple[dict[str, Any], list[Any], Any]:
    """The memory breakdown at the end of fit: one warm-up and one traced training step at each of
    up to 3 lengths (the longest measured under the rungs on, none equal to a model width), on a
    copy of ``pl_module`` and the first optimizer, from ``kept`` = ``(seq_len, CPU copy of the
    longest batch)``, with the run's autocast and micro-batching; the RNG state is restored.
    Returns ``(section, breakdowns, table)``: the report's section, a ``Breakdown`` per length and
    their comparison; each diagnosis goes to the view's advice."""
    if kept is None:
        raise RuntimeError("no training batch was kept (SeqMemCallback(breakdown=True) keeps one "
                           "per step)")
    if not trainer.optimizers:
        raise RuntimeError("the trainer has no optimizer to step")
    batch_len, batch = kept
    batch_size = int(shape_of(batch)[0])
    device = device or pl_module.device
    optimizer = trainer.optimizers[0]
    curriculum = view.settings.curriculum
    plan = end_of_fit_plan(
        view.evidence.measured.records, view.ladder.applied, batch_len, batch_size,
        width_dims(pl_module, batch_size),
        multiple_of=curriculum.multiple_of if curriculum is not None else 8,
        target=curriculum.target if curriculum is not None else 0,
        room_bytes=_room_beside(pl_module, optimizer, device) if device.type == "cuda" else None,
    )
    try:
        forecast_peak = view.evidence.forecaster.forecast(plan.extrapolate_to,
                                                          batch_size).peak_bytes
    except Exception:  # noqa: BLE001 - the table stands without it
        forecast_peak = None
    micro: dict[str, Any] = {}
    if is_micro_batching(pl_module):  # the wrapper's settings: the copy's steps split as the run
        wrapper = pl_module.__dict__["training_step"]
        micro = {"micro_batch_size": wrapper.micro_batch_size, "weighting": wrapper.weighting,
                 "ignore_index": wrapper.ignore_index}
    section, breakdowns = end_of_fit_section(
        pl_module, optimizer, batch, plan, device=device,
        context=trainer.precision_plugin.train_step_context, forecast_peak_bytes=forecast_peak,
        **micro)
    for i, finding in enumerate(section["diagnoses"]):
        view.advice.advise(Advice("diagnosis", f"diagnosis-{i}", f"seqmem: {finding}",
                                  MemoryDiagnosisWarning))
    return section, breakdowns, compare_breakdowns(breakdowns)
