"""Where a step's peak sits, from a traced step: :func:`peak_site` of a :class:`~.tracer.Breakdown`.

:func:`peak_kind` maps the tracer's description of an allocation (category, kind, phase, quadratic
shape, recomputed) onto the :data:`~lightning_seqmem.core.peak.PEAK_KINDS` a user reasons with, and
:func:`peak_site` sums the tensors alive at the peak by it. :func:`trace_peak_site` traces a step
and answers in one go: the dry run (``dry_run_step``'s ``site``) hands it its fake step, the
end-of-fit report a real one.

Example:
    >>> import torch
    >>> lin = torch.nn.Linear(64, 64)
    >>> opt = torch.optim.AdamW(lin.parameters())
    >>> x = torch.ones(2, 64)
    >>> def step():
    ...     opt.zero_grad(); lin(x).square().sum().backward(); opt.step()
    >>> step()  # the optimizer state exists from now on
    >>> site = trace_peak_site(step, lin, opt, [x], seq_len=3, batch_size=2)
    >>> site.phase, site.top_kind  # AdamW's two moments are twice the parameters
    ('optimizer', 'optimizer_state')
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from lightning_seqmem.core.peak import PEAK_KINDS, PEAK_PHASES, PeakSite
from lightning_seqmem.diagnostics.categories import KINDS
from lightning_seqmem.diagnostics.tracer import AllocationRecord, Breakdown, trace_breakdown

__all__ = ["peak_kind", "peak_site", "trace_peak_site"]

_STATE_KINDS = tuple(k for k in KINDS if k in PEAK_KINDS)  # the tracer's kinds kept as they are


def peak_kind(record: AllocationRecord) -> str:
    """The ``PEAK_KINDS`` kind of one traced allocation, the first that holds: the state kinds as
    the tracer found them, ``attention_scores`` (its category), ``logits`` (made by the output layer
    or the loss, or their backward), ``recompute`` (made by a recomputed checkpointed forward),
    ``saved_activations`` (an activation), else ``other`` (batch, activation grads, temporaries).

    Example:
        >>> r = AllocationRecord(0, 64, "aten::bmm", (2, 8, 8), "float32", "blocks.0.attn",
        ...                      "attention_scores", "forward", "activations")
        >>> peak_kind(r)
        'attention_scores'
    """
    if record.kind in _STATE_KINDS:
        return record.kind
    if record.category == "attention_scores":
        return "attention_scores"
    if record.category == "loss_logits":
        return "logits"
    if record.recompute:
        return "recompute"
    if record.kind == "activations":
        return "saved_activations"
    return "other"


def peak_site(breakdown: Breakdown) -> PeakSite:
    """The phase of ``breakdown``'s peak and the kinds alive there
    (:class:`~lightning_seqmem.core.peak.PeakSite`). The phase is the tracer's, made precise: a
    forward peak reached by an allocation of the output layer or the loss is ``loss``; a backward
    peak with recomputed tensors alive is ``recompute``."""
    by_kind: dict[str, int] = {}
    for i in breakdown.alive_at_peak:
        r = breakdown.tensors[i]
        kind = peak_kind(r)
        by_kind[kind] = by_kind.get(kind, 0) + r.nbytes
    phase = breakdown.peak_phase
    top = (breakdown.tensors[breakdown.peak_index]
           if 0 <= breakdown.peak_index < len(breakdown.tensors) else None)
    if phase == "forward" and top is not None and top.category == "loss_logits":
        phase = "loss"
    elif phase == "backward" and by_kind.get("recompute", 0) > 0:
        phase = "recompute"
    return PeakSite.of(phase if phase in PEAK_PHASES else "existing", by_kind, breakdown.peak_op)


def trace_peak_site(step_fn: Callable[[], Any], model: nn.Module, *args: Any,
                    **kwargs: Any) -> PeakSite:
    """Trace one training step (:func:`~.tracer.trace_breakdown`, same arguments) and say where
    its peak sits. The step may run its own probe inside (the dry run's tracker): both see every
    op."""
    return peak_site(trace_breakdown(step_fn, model, *args, **kwargs))
