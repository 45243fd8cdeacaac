"""One training step of a copy, as training runs it: what the breakdown traces.

* :func:`copy_for_tracing`: a deep copy of a model and its optimizer (a new optimizer of the same
  class over the copy's parameters, loaded with a deep copy of the original's state), so that the
  traced steps train nothing the user holds;
* :func:`training_step_loss`: ``training_step``'s loss, as Lightning reads it;
* :func:`run_training_step`: one step in Lightning's order
  (:func:`~lightning_seqmem.measure.steps.training_step_memory`: forward, ``zero_grad``, backward,
  optimizer step), micro-batched as the ``microbatch`` mitigation runs it when asked
  (:mod:`lightning_seqmem.mitigations.microbatch.microbatch_twin`): the batch is cut by the policy's own
  :func:`~lightning_seqmem.mitigations.microbatch.microbatch.split_batch` and each micro-batch's loss weighted
  by :func:`~lightning_seqmem.mitigations.microbatch.microbatch.micro_batch_counts` (label tokens for a batch
  with integer ``labels``, else samples).

Example:
    >>> import torch
    >>> from torch import nn
    >>> lin = nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(lin.parameters(), lr=0.0)
    >>> batch = {"input_ids": torch.ones(4, 3, dtype=torch.long), "x": torch.ones(4, 4)}
    >>> loss_fn = lambda model, b: model(b["x"]).mean()
    >>> run_training_step(lin, opt, batch, loss_fn, micro_batch_size=3)
    >>> round(float(lin.bias.grad), 6)  # the full batch's gradient: (3/4)·1 + (1/4)·1
    1.0
"""

from __future__ import annotations

import copy
from typing import Any, Callable, ContextManager, Optional

import torch
from torch import nn

from lightning_seqmem.measure.steps import loss_of, training_step_memory
from lightning_seqmem.mitigations.microbatch.microbatch_functional import IGNORE_INDEX
from lightning_seqmem.mitigations.microbatch.microbatch_twin import ZeroGradBeforeFirstMicroBatch, micro_batched_loss

__all__ = ["LossFn", "copy_for_tracing", "run_training_step", "training_step_loss"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def training_step_loss(module: nn.Module, batch: Any) -> torch.Tensor:
    """``module.training_step(batch, 0)``'s loss, read as Lightning reads it (a tensor or ``["loss"]``)."""
    return loss_of(module.training_step(batch, 0))  # type: ignore[operator,return-value]


def copy_for_tracing(
    model: nn.Module, optimizer: Optional[torch.optim.Optimizer]
) -> tuple[nn.Module, Optional[torch.optim.Optimizer]]:
    """A deep copy of ``model`` and an optimizer of the same class over the copy's parameters.

    The new optimizer gets the original's hyper-parameters (``param_groups``, the learning rate a
    scheduler set included) and a deep copy of its state (step counts, moments), so a step of the
    copy allocates what a step of the original would, and changes nothing of the original. An
    optimizer whose constructor does not take its ``defaults`` back is deep-copied instead, its
    parameters mapped to the copy's. A ``LightningModule`` copy is detached from its trainer.

    Example:
        >>> lin = nn.Linear(4, 4)
        >>> opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
        >>> lin(torch.ones(2, 4)).sum().backward(); opt.step()
        >>> lin2, opt2 = copy_for_tracing(lin, opt)
        >>> type(opt2).__name__, opt2.param_groups[0]["lr"], opt2.state[lin2.weight]["step"].item()
        ('AdamW', 0.1, 1.0)
        >>> opt2.state[lin2.weight]["exp_avg"] is opt.state[lin.weight]["exp_avg"]
        False
    """
    memo: dict[int, Any] = {}
    model_copy = copy.deepcopy(model, memo)
    if optimizer is None:
        return model_copy, None
    params = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [i for i, p in enumerate(params) if id(p) not in memo]
    if missing:
        raise ValueError(f"the optimizer holds {len(missing)} parameter(s) that are not the model's; cannot copy it")
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [memo[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    try:
        optimizer_copy = type(optimizer)(groups, **optimizer.defaults)
        optimizer_copy.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # deep: load_state_dict keeps tensors
    except Exception:  # noqa: BLE001 - an optimizer with its own constructor: copy it, parameters mapped
        optimizer_copy = copy.deepcopy(optimizer, {**memo})
    return model_copy, optimizer_copy


def run_training_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    loss_fn: LossFn,
    context: Optional[Callable[[], ContextManager]] = None,
    micro_batch_size: Optional[int] = None,
    weighting: str = "auto",
    ignore_index: int = IGNORE_INDEX,
) -> None:
    """One training step in Lightning's order, micro-batched like :class:`~lightning_seqmem.mitigations.MicroBatching`.

    With ``micro_batch_size``, the wrapper's own step
    (:func:`~lightning_seqmem.mitigations.microbatch.microbatch_twin.micro_batched_loss`, under ``context``):
    gradients zeroed once, each micro-batch of :func:`~lightning_seqmem.mitigations.microbatch.microbatch.split_batch`
    but the last backpropagated with its loss weighted by its share ``c_i / C`` of
    :func:`~lightning_seqmem.mitigations.microbatch.microbatch.micro_batch_counts` (``weighting``,
    ``ignore_index`` as the policy's), the last one's in the step's backward; a micro-batch that
    counts nothing is not run, and a batch that is one micro-batch or counts nothing at all runs
    whole, as under the policy.
    """
    if not micro_batch_size:
        training_step_memory(model, optimizer, batch, loss_fn, context=context)
        return
    step_loss = micro_batched_loss(optimizer, micro_batch_size, loss_fn, weighting, ignore_index)
    training_step_memory(model, ZeroGradBeforeFirstMicroBatch(optimizer), batch, step_loss, context=context)
