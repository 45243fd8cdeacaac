"""Advice recomputed from the current best forecast when it is shown (end of fit), each item only
where it applies to this model and run.

The bf16 advice asks the dry run (:mod:`.step`) for this step's peak with and without bf16 autocast
at the target length, and is given only if bf16 lowers it (with eager attention it can raise it:
bf16 copies of the weights, fp32 softmax).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from lightning_seqmem.core import advice as A
from lightning_seqmem.measure.batch_shape import shapes_read_by

if TYPE_CHECKING:  # pragma: no cover
    from lightning_seqmem.plan.view import PlanView


def target_length(view: "PlanView") -> Optional[int]:
    """The length advice speaks of: the curriculum's target (within the model's own length limit),
    else the longest length measured."""
    if view.settings.curriculum is not None:
        limit = getattr(view, "length_limit", None)
        return (int(view.settings.curriculum.target) if limit is None
                else min(int(view.settings.curriculum.target), int(limit)))
    return max((r.seq_len for r in view.evidence.measured.records), default=None)


BF16_MIN_GAIN = 0.05  # fraction of the 32-bit peak bf16 must save to be worth a restart


def precision_advice(dry: Any, view: "PlanView", precision: str,
                     device: torch.device) -> Optional[A.Advice]:
    """bf16-mixed advice for a 32-bit run, only where a dry run at the target length with bf16
    autocast peaks at least :data:`BF16_MIN_GAIN` (5%) lower than without; None otherwise, and
    where no dry run can answer. ``dry``: the callback's :class:`.run.TrainingRunDryRun` (or None).
    """
    from lightning_seqmem.dryrun.result import DryRunUnsupported
    from lightning_seqmem.dryrun.step import dry_run_step

    if not str(precision).startswith("32") or dry is None or dry.unsupported or dry.batch is None:
        return None
    seq_len, batch_size = target_length(view), view.evidence.measured.last_batch_size
    if seq_len is None or batch_size is None:
        return None
    fp32 = view.evidence.dry.peak(seq_len, batch_size)
    if fp32 is None:
        return None
    optimizers = getattr(dry.trainer, "optimizers", None) or [None]
    try:
        with shapes_read_by(dry.seq_len_fn):
            bf16 = dry_run_step(dry.pl_module, optimizers[0], dry.batch, seq_len, batch_size,
                                autocast=lambda: torch.autocast(device.type, dtype=torch.bfloat16),
                                device=device)
    except DryRunUnsupported:  # a sharded (FSDP2) module cannot be copied: no advice, no failure
        return None
    if bf16.peak_bytes > fp32[0] * (1 - BF16_MIN_GAIN):
        return None
    return A.precision(seq_len, batch_size, fp32[0], bf16.peak_bytes)


__all__ = ["BF16_MIN_GAIN", "precision_advice", "target_length"]
