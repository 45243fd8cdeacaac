"""What a fake step runs: the user's own ``training_step`` whole, or micro-batched as the rung runs.

:func:`step_functions` turns a dry run's :class:`~lightning_seqmem.mitigations.base.CopyPlan` into
the ``(loss_fn, optimizer)`` pair for :func:`.steps.training_step_memory`: :func:`plain_loss` and
the optimizer, or the micro-batched loss of :mod:`.microbatch.microbatch_twin` (each micro-batch's
loss weighted by its share) and an optimizer zeroed before the first micro-batch.

Example:
    >>> import torch
    >>> from lightning_seqmem.mitigations.base import CopyPlan
    >>> class Toy(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.embed = torch.nn.Embedding(10, 2)
    ...     def training_step(self, batch, batch_idx):
    ...         return self.embed(batch).pow(2).mean()
    >>> model, batch = Toy(), torch.randint(0, 10, (4, 5))  # 4 samples of 5 token ids
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> plan = CopyPlan(micro_batch_size=1)
    >>> loss_fn, step_optimizer = step_functions(model, optimizer, plan, batch_size=4)
    >>> plan.notes[-1]
    'microbatch: with the one-time check of the first split batch'
    >>> loss = loss_fn(model, batch)  # three micro-batches backpropagated, the last one's loss left
    >>> bool(torch.allclose(loss, plain_loss(model, batch)))  # weighted sum: the whole batch's mean
    True
    >>> loss_fn is plain_loss, step_functions(model, optimizer, CopyPlan(), 4)[0] is plain_loss
    (False, True)
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException

from lightning_seqmem.dryrun.result import DryRunUnsupported
from lightning_seqmem.measure.batch_shape import infer_batch_shape
from lightning_seqmem.measure.steps import keep_outputs, loss_of
from lightning_seqmem.mitigations.base import CopyPlan
from lightning_seqmem.mitigations.microbatch.microbatch_functional import (
    IGNORE_INDEX, micro_batch_counts, split_batch)
from lightning_seqmem.mitigations.microbatch.microbatch import MicroBatching
from lightning_seqmem.mitigations.microbatch.microbatch_step import (
    is_micro_batching, micro_batching_check_pending)
from lightning_seqmem.mitigations.microbatch.microbatch_check import copied_tensors
from lightning_seqmem.mitigations.microbatch.microbatch_twin import (
    ZeroGradBeforeFirstMicroBatch, check_pair, micro_batched_loss)

__all__ = ["TrainerLoop", "loop_of", "plain_loss", "step_functions", "trainer_loop"]


@dataclass(frozen=True)
class TrainerLoop:
    """The Trainer's loop settings a step's memory depends on (:func:`loop_of` reads them).

    With ``accumulate_grad_batches > 1`` the modelled step is a window's last batch, the highest:
    earlier gradients alive throughout, the loss divided by the window. ``gradient_clip_val``:
    clipped before the optimizer step. ``buckets_hold_gradients`` (DDP's
    ``gradient_as_bucket_view=True``): ``zero_grad`` frees no gradient memory, as in accumulation.

    Example:
        >>> TrainerLoop().keeps_gradients, TrainerLoop(accumulate_grad_batches=4).accumulating
        (False, True)
    """

    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = None
    gradient_clip_algorithm: str = "norm"  # or "value"
    buckets_hold_gradients: bool = False

    @property
    def accumulating(self) -> bool:
        return self.accumulate_grad_batches > 1

    @property
    def keeps_gradients(self) -> bool:
        """Whether the gradients' memory stays alive from one step into the next one's backward."""
        return self.accumulating or self.buckets_hold_gradients

    def notes(self) -> list[str]:
        """What the modelled step is, for a dry run's detail."""
        out = []
        if self.accumulating:
            out.append(f"the last batch of {self.accumulate_grad_batches} accumulated (the earlier "
                       "batches' gradients alive through its backward)")
        if self.gradient_clip_val:
            out.append(f"gradients clipped by {self.gradient_clip_algorithm} before the optimizer "
                       "step")
        if self.buckets_hold_gradients and not self.accumulating:
            out.append("DDP's gradient buckets (the gradients as views) alive through the backward")
        return out


_LOOP: contextvars.ContextVar[TrainerLoop] = contextvars.ContextVar("seqmem_trainer_loop",
                                                                   default=TrainerLoop())


def loop_of(trainer: Any) -> TrainerLoop:
    """The loop settings of a Lightning ``trainer`` (defaults for anything it does not have).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> loop = loop_of(NS(accumulate_grad_batches=2, gradient_clip_val=1.0,
        ...                   gradient_clip_algorithm="value"))
        >>> loop.accumulating, loop.gradient_clip_val, loop.gradient_clip_algorithm
        (True, 1.0, 'value')
        >>> loop_of(None) == TrainerLoop()
        True
    """
    from torch.nn.parallel import DistributedDataParallel

    clip = getattr(trainer, "gradient_clip_val", None)
    algorithm = getattr(trainer, "gradient_clip_algorithm", None)
    model = getattr(getattr(trainer, "strategy", None), "model", None)
    views = isinstance(model, DistributedDataParallel) and bool(model.gradient_as_bucket_view)
    algorithm = str(getattr(algorithm, "value", algorithm) or "norm")  # (an enum in Lightning)
    return TrainerLoop(int(getattr(trainer, "accumulate_grad_batches", 1) or 1),
                       float(clip) if clip else None, algorithm, views)


@contextlib.contextmanager
def trainer_loop(loop: TrainerLoop) -> Iterator[None]:
    """The dry runs made inside model a step of ``loop`` (see :class:`TrainerLoop`)."""
    token = _LOOP.set(loop)
    try:
        yield
    finally:
        _LOOP.reset(token)


class _LoopOptimizer:
    """The optimizer as the Trainer's loop drives it: ``zero_grad`` a no-op where the gradients'
    memory is kept, gradients clipped before ``step`` where the Trainer clips them."""

    def __init__(self, optimizer: Any, loop: TrainerLoop, keep_gradients: bool) -> None:
        self.optimizer, self.loop, self.keep_gradients = optimizer, loop, keep_gradients

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self.keep_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        if self.loop.gradient_clip_val:
            inner = getattr(self.optimizer, "optimizer", self.optimizer)  # (a micro-batched step's)
            params = [p for group in inner.param_groups for p in group["params"]]
            if self.loop.gradient_clip_algorithm == "value":
                torch.nn.utils.clip_grad_value_(params, clip_value=self.loop.gradient_clip_val)
            else:
                torch.nn.utils.clip_grad_norm_(params, self.loop.gradient_clip_val)
        self.optimizer.step()


def _loss_of(output: Any) -> torch.Tensor:
    """:func:`~lightning_seqmem.measure.steps.loss_of`, its refusal a dry-run reason."""
    try:
        return loss_of(output)
    except TypeError as exc:
        raise DryRunUnsupported(str(exc)) from None


def _micro_batch_counts(batch: Any, micro_batch_size: int, weighting: str,
                        ignore_index: int) -> list[int]:
    """What each micro-batch's loss weighs (:func:`.microbatch_functional.micro_batch_counts`);
    by samples where labels have no values (the weights are scalars: the memory is the same)."""
    try:
        return micro_batch_counts(batch, micro_batch_size, weighting, ignore_index)[1]
    except DataDependentOutputException:
        return [infer_batch_shape(part)[0] for part in split_batch(batch, micro_batch_size)]


def _first_step_check(model: nn.Module, batch: Any, parts: list[Any], counts: list[int]) -> None:
    """The memory of the wrapper's one-time check of its first split batch: its copy of the
    module's tensors, no-grad forwards of the first two counted micro-batches together and apart."""
    found = check_pair(batch, parts, counts)
    if found is None:
        return
    copies = [t.detach().clone() for t in copied_tensors(model)]
    with torch.no_grad():
        losses = [plain_loss(model, part).detach()
                  for part in (found.batch, *(parts[i] for i in found.used))]
    del copies, losses


def plain_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    output = model.training_step(batch, 0)
    keep_outputs(output)  # a dict's other tensors live to the end of the step, as in Lightning
    return _loss_of(output)


LossFn = Callable[[nn.Module, Any], torch.Tensor]


def _divided(loss_fn: LossFn, by: int) -> LossFn:
    """``loss_fn``'s loss divided by ``by``, as Lightning divides a window's (a scalar more)."""
    def divided(model: nn.Module, batch: Any) -> torch.Tensor:
        return loss_fn(model, batch) / by

    return divided


def step_functions(
    pl_module: nn.Module, optimizer: torch.optim.Optimizer, plan: CopyPlan, batch_size: int,
    first_split_check: Optional[bool] = None,
) -> tuple[Callable[[nn.Module, Any], torch.Tensor], Any]:
    """``(loss_fn, optimizer)`` for :func:`.steps.training_step_memory`: plain or micro-batched,
    in the loop of :func:`trainer_loop` (default: one batch per step). ``first_split_check``:
    whether the step includes micro-batching's one-time loss check; None: when this dry run
    switches the rung on, or the module's wrapper has not run it yet."""
    loop = _LOOP.get()
    plan.notes.extend(loop.notes())
    loss_fn, step_optimizer = _step_functions(pl_module, optimizer, plan, batch_size,
                                              first_split_check, loop.keeps_gradients)
    if loop.accumulating:
        loss_fn = _divided(loss_fn, loop.accumulate_grad_batches)
    if loop.keeps_gradients or loop.gradient_clip_val:
        step_optimizer = _LoopOptimizer(step_optimizer, loop, keep_gradients=loop.keeps_gradients)
    return loss_fn, step_optimizer


def _step_functions(pl_module: nn.Module, optimizer: torch.optim.Optimizer, plan: CopyPlan,
                    batch_size: int, first_split_check: Optional[bool],
                    keep_gradients: bool) -> tuple[LossFn, Any]:
    notes, micro_batch_size = plan.notes, plan.micro_batch_size
    policy = MicroBatching(micro_batch_size or 1)  # the rung's weighting
    check = micro_batch_size is not None and policy.verify  # switched on now: checked
    if micro_batch_size is None and is_micro_batching(pl_module):
        check = micro_batching_check_pending(pl_module)
        policy = pl_module.__dict__["training_step"]  # the wrapper: its size and weighting
        micro_batch_size = int(policy.micro_batch_size)
    if first_split_check is not None:
        check = first_split_check
    if micro_batch_size is None:
        return plain_loss, optimizer
    if batch_size <= micro_batch_size:
        notes.append(f"{MicroBatching.name}: batch size {batch_size} is already at most "
                     f"{micro_batch_size}")
        return plain_loss, optimizer
    notes.append(f"{MicroBatching.name}: {math.ceil(batch_size / micro_batch_size)} micro-batches "
                 f"of {micro_batch_size}")
    weighting, ignore_index = (getattr(policy, "weighting", "auto"),
                               getattr(policy, "ignore_index", IGNORE_INDEX))
    loss_fn = micro_batched_loss(optimizer, micro_batch_size, plain_loss, weighting, ignore_index,
                                 counts_of=_micro_batch_counts,
                                 before=_first_step_check if check else None,
                                 zero_grad=not keep_gradients)
    if check:
        notes.append(f"{MicroBatching.name}: with the one-time check of the first split batch")
    return loss_fn, ZeroGradBeforeFirstMicroBatch(optimizer)
