"""One training step of a copy, as training runs it: what the breakdown traces.

* :func:`copy_for_tracing`: a deep copy of a model and its optimizer, so that the traced steps
  train nothing the user holds;
* :func:`training_step_loss`: ``training_step``'s loss, as Lightning reads it;
* :func:`run_training_step`: one step in Lightning's order
  (:func:`~lightning_seqmem.measure.steps.training_step_memory`: forward, ``zero_grad``, backward,
  optimizer step), micro-batched as the ``microbatch`` mitigation runs it when asked
  (:mod:`lightning_seqmem.mitigations.microbatch.microbatch_twin`).

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
from lightning_seqmem.mitigations.microbatch.microbatch_twin import (
    ZeroGradBeforeFirstMicroBatch, micro_batched_loss)

__all__ = ["LossFn", "copy_for_tracing", "run_training_step", "training_step_loss"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def training_step_loss(module: nn.Module, batch: Any) -> torch.Tensor:
    """``module.training_step(batch, 0)``'s loss as Lightning reads it (tensor or ``["loss"]``)."""
    return loss_of(module.training_step(batch, 0))  # type: ignore[operator,return-value]


def copy_for_tracing(model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                     ) -> tuple[nn.Module, Optional[torch.optim.Optimizer]]:
    """A deep copy of ``model`` and an optimizer of the same class over the copy's parameters, with
    the original's ``param_groups`` (a scheduler's learning rate included) and a deep copy of its
    state, so a step of the copy allocates what the original's would and changes nothing of it. An
    optimizer whose constructor does not take its ``defaults`` back is deep-copied instead, its
    parameters mapped to the copy's. A ``LightningModule`` copy is detached from its trainer.

    Example:
        >>> lin = nn.Linear(4, 4)
        >>> opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
        >>> lin(torch.ones(2, 4)).sum().backward(); opt.step()
        >>> lin2, opt2 = copy_for_tracing(lin, opt)
        >>> (type(opt2).__name__, opt2.param_groups[0]["lr"],
        ...  opt2.state[lin2.weight]["step"].item())
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
        raise ValueError(f"the optimizer holds {len(missing)} parameter(s) that are not the "
                         "model's; cannot copy it")
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [memo[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    try:
        optimizer_copy = type(optimizer)(groups, **optimizer.defaults)
        # deep: load_state_dict keeps tensors
        optimizer_copy.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    except Exception:  # noqa: BLE001 - an optimizer with its own constructor: copy, params mapped
        optimizer_copy = copy.deepcopy(optimizer, {**memo})
    return model_copy, optimizer_copy


def run_training_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any,
                      loss_fn: LossFn, context: Optional[Callable[[], ContextManager]] = None,
                      micro_batch_size: Optional[int] = None, weighting: str = "auto",
                      ignore_index: int = IGNORE_INDEX) -> None:
    """One training step in Lightning's order. With ``micro_batch_size``, the ``microbatch``
    wrapper's own step (:func:`~.microbatch_twin.micro_batched_loss`, under ``context``): gradients
    zeroed once, each micro-batch's loss weighted by its share of the counted tokens or samples
    (``weighting``, ``ignore_index`` as the policy's) and backpropagated, the last one in the step's
    backward; a micro-batch that counts nothing is not run, and a batch that is one micro-batch or
    counts nothing runs whole, as under the policy."""
    if not micro_batch_size:
        training_step_memory(model, optimizer, batch, loss_fn, context=context)
        return
    step_loss = micro_batched_loss(optimizer, micro_batch_size, loss_fn, weighting, ignore_index)
    training_step_memory(model, ZeroGradBeforeFirstMicroBatch(optimizer), batch, step_loss,
                         context=context)
