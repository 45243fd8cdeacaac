"""The one micro-batched training step, run by the wrapper of :class:`.microbatch.MicroBatching`
(in ``training_step``), the dry run (on its fake copy) and the memory breakdown, so forecasts and
breakdowns follow the step's own order of allocations: :func:`run_micro_batches` (the loop; losses
weighted by ``c_i / C``), :func:`check_pair` (the first-step check's sub-batch), and
:func:`micro_batched_loss` with :class:`ZeroGradBeforeFirstMicroBatch` (the step as a ``(loss_fn,
optimizer)`` pair for :func:`~lightning_seqmem.measure.steps.training_step_memory`).

Example:
    >>> import torch
    >>> from lightning_seqmem.measure.steps import training_step_memory
    >>> lin = torch.nn.Linear(2, 1)
    >>> optimizer = torch.optim.SGD(lin.parameters(), lr=0.0)
    >>> batch = {"input_ids": torch.ones(3, 2, dtype=torch.long),
    ...          "x": torch.tensor([[1.0, 0], [0, 1], [1, 1]])}
    >>> loss_fn = lambda model, b: model(b["x"]).mean()
    >>> step_loss = micro_batched_loss(optimizer, 1, loss_fn)  # three micro-batches of one sample
    >>> training_step_memory(lin, ZeroGradBeforeFirstMicroBatch(optimizer), batch, step_loss)
    >>> [round(g, 4) for g in lin.weight.grad.flatten().tolist()]  # the whole batch's mean gradient
    [0.6667, 0.6667]
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from functools import partial
from typing import Any, Callable, NamedTuple, Optional

import torch

from lightning_seqmem.measure.batch_shape import infer_batch_shape
from lightning_seqmem.measure.steps import loss_of
from lightning_seqmem.mitigations.microbatch.microbatch_functional import (
    IGNORE_INDEX, deferred_gradient_reduction, micro_batch_counts, slice_batch, split_batch)

__all__ = ["CheckPair", "ZeroGradBeforeFirstMicroBatch", "check_pair", "micro_batched_loss",
           "run_micro_batches"]


def _with_loss(output: Any, loss: torch.Tensor) -> Any:
    return {**output, "loss": loss} if isinstance(output, Mapping) else loss


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Leave the precision plugin's autocast (``training_step`` runs inside it) for a backward."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False) if enabled else contextlib.nullcontext()


class CheckPair(NamedTuple):
    """The sub-batch the first-step check runs: the first two micro-batches that count something."""

    batch: Any  # samples start .. start + length - 1 of the batch (views)
    used: list[int]  # the indices of the two micro-batches
    start: int  # the pair's first sample in the batch
    length: int  # its samples, from the first micro-batch to the end of the second


def check_pair(batch: Any, parts: list[Any], counts: list[int]) -> Optional[CheckPair]:
    """The first two micro-batches with ``counts[i] > 0``, which the first-step check compares apart
    and together (samples from the first to the second); None where fewer than two count.

    Example:
        >>> import torch
        >>> batch = torch.arange(10).reshape(5, 2)
        >>> found = check_pair(batch, split_batch(batch, 1), [1, 0, 2, 1, 1])
        >>> found.used, found.start, found.length, found.batch.tolist()
        ([0, 2], 0, 3, [[0, 1], [2, 3], [4, 5]])
        >>> check_pair(batch, split_batch(batch, 1), [0, 0, 0, 3, 0]) is None
        True
    """
    used = [i for i, c in enumerate(counts) if c > 0][:2]
    if len(used) < 2:
        return None
    sizes = [infer_batch_shape(part)[0] for part in parts]
    start, length = sum(sizes[: used[0]]), sum(sizes[used[0] : used[1] + 1])
    return CheckPair(slice_batch(batch, sum(sizes), start, length), used, start, length)


def run_micro_batches(parts: list[Any], counts: list[int], forward: Callable[[Any], Any],
                      backward: Optional[Callable[[torch.Tensor], Any]], model: Any,
                      zero_grad: Callable[[], Any],
                      read_loss: Optional[Callable[[Any], Optional[torch.Tensor]]] = None,
                      hold: bool = True) -> Any:
    """One micro-batched ``training_step``, the wrapper's and the dry run's: ``zero_grad()``, then
    for each micro-batch with ``counts[i] > 0`` but the last: ``forward``, its loss (``read_loss``,
    default ``loss_of(..., required=False)``; None: skipped, as Lightning skips such a batch)
    scaled by ``counts[i] / sum(counts)``, and ``backward(scaled)`` with autocast off and
    ``model``'s gradient reduction deferred (``backward`` None: none, as under ``_skip_backward``).
    Returns the last one's output (not backpropagated) with its ``"loss"`` (or itself) replaced by
    its scaled loss plus the others' (detached); as it came if its loss is None. ``hold`` (the
    wrapper's order): outputs and unscaled losses live until their micro-batch is done; False (the
    dry run's): dropped once read or scaled.

    Example:
        >>> import torch
        >>> w = torch.ones(2, requires_grad=True)
        >>> parts = split_batch(torch.tensor([[1, 1], [2, 2], [3, 3]]), 1)
        >>> loss = run_micro_batches(parts, [1, 1, 1], lambda part: (w * part).sum(),
        ...                          lambda s: s.backward(), w, zero_grad=lambda: None)
        >>> round(float(loss.detach()), 4), w.grad.tolist()  # the mean of 2, 4, 6; two backwards
        (4.0, [1.0, 1.0])
    """
    if read_loss is None:
        read_loss = partial(loss_of, required=False)
    total = sum(counts)
    used = [i for i, c in enumerate(counts) if c > 0]  # c_i = 0: no gradient: not run
    zero_grad()
    done: torch.Tensor | None = None  # sum of the scaled losses already backpropagated, detached
    for i in used[:-1]:
        output = forward(parts[i])
        loss = read_loss(output)
        del output
        if loss is None:  # this micro-batch is skipped, as Lightning skips a batch returning None
            continue
        scaled = loss * (counts[i] / total)
        if not hold:
            loss = None
        if backward is not None:
            with deferred_gradient_reduction(model), _autocast_off(scaled.device.type):
                backward(scaled)
        done = scaled.detach() if done is None else done + scaled.detach()
        del loss, scaled
    output = forward(parts[used[-1]])
    loss = read_loss(output)
    if loss is None:
        return output
    if not hold:
        output = None
    scaled = loss * (counts[used[-1]] / total)
    if not hold:
        loss = None
    return _with_loss(output, scaled if done is None else scaled + done)


class ZeroGradBeforeFirstMicroBatch:
    """The optimizer as the micro-batching wrapper drives it: zeroed before the first micro-batch
    (by :func:`micro_batched_loss`), so the ``zero_grad`` after the forward does nothing."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def step(self) -> None:
        self.optimizer.step()


def _no_zero_grad() -> None:
    """A later batch of an accumulation window: its gradients add to the earlier batches'."""


def micro_batched_loss(optimizer: torch.optim.Optimizer, micro_batch_size: int,
                       loss_fn: Callable[[Any, Any], torch.Tensor], weighting: str = "auto",
                       ignore_index: int = IGNORE_INDEX,
                       counts_of: Optional[Callable[[Any, int, str, int], list[int]]] = None,
                       before: Optional[Callable[[Any, Any, list[Any], list[int]], Any]] = None,
                       zero_grad: bool = True) -> Callable[[Any, Any], torch.Tensor]:
    """``(model, batch) -> loss`` for ``training_step_memory`` with
    :class:`ZeroGradBeforeFirstMicroBatch`: counts ``c_i`` by ``counts_of`` (default:
    :func:`micro_batch_counts`), runs ``before(model, batch, parts, counts)`` (the dry run: the
    first-step check's memory), zeroes ``optimizer`` and runs :func:`run_micro_batches`, returning
    the last micro-batch's loss for the caller's backward. A batch of one micro-batch, or nothing
    counted, runs whole, zeroed after its forward as Lightning does; ``zero_grad=False``: never."""

    def step_loss(model: Any, batch: Any) -> torch.Tensor:
        parts = split_batch(batch, micro_batch_size)
        if len(parts) > 1:
            counts = (counts_of(batch, micro_batch_size, weighting, ignore_index)
                      if counts_of is not None
                      else micro_batch_counts(batch, micro_batch_size, weighting, ignore_index)[1])
        else:
            counts = [1]
        if len(parts) == 1 or not any(c > 0 for c in counts):
            loss = loss_fn(model, batch)
            if zero_grad:
                optimizer.zero_grad(set_to_none=True)  # Lightning's zero_grad, after the forward
            return loss
        if before is not None:
            before(model, batch, parts, counts)
        zero = partial(optimizer.zero_grad, set_to_none=True) if zero_grad else _no_zero_grad
        return run_micro_batches(
            parts, counts, lambda part: loss_fn(model, part), lambda scaled: scaled.backward(),
            model, zero_grad=zero, read_loss=lambda loss: loss, hold=False)

    return step_loss
