"""Micro-batching: run each training batch as several smaller ones, accumulating their gradients.

The activations of a step are those of one micro-batch, so the batch-proportional part of the peak
(``B * (a*L + b*L^2)``) drops to ``micro_batch_size / B`` of itself, while the learning dynamics stay
those of the full batch: the same batches in the same order (no sample dropped or repeated), the
same number of optimizer steps, ``global_step`` and LR schedule, and gradients equal to the
full-batch ones up to rounding. It takes effect at the next ``training_step``, mid-epoch included:
neither ``trainer.accumulate_grad_batches`` nor the dataloader is touched (see DESIGN.md for why
changing either mid-epoch is wrong).

Mechanism (automatic optimization; Lightning's ``Closure.closure`` runs ``training_step``, then
``zero_grad`` on the first batch of an accumulation window, then ``backward`` of the returned loss):

1. ``training_step`` of the module *instance* is replaced by a wrapper (the class is untouched;
   :meth:`MicroBatching.remove` restores the original). The wrapper splits the batch with
   :func:`split_batch` into ``k`` micro-batches of ``n_1 .. n_k`` samples (``N`` in all).
2. On the first batch of an accumulation window (``batch_idx % accumulate_grad_batches == 0``,
   Lightning's own test) it zeroes the gradients itself, through the module's
   ``optimizer_zero_grad`` hook, and replaces that hook on the instance with a one-shot no-op, so
   that Lightning's ``zero_grad``, which comes after ``training_step``, does not erase the
   gradients of the first ``k - 1`` micro-batches. The ``on_before_zero_grad`` hooks still run
   at Lightning's usual point.
3. Micro-batches ``1 .. k-1``: the original ``training_step``, its loss scaled by
   ``n_i / N / accumulate_grad_batches`` (Lightning divides the returned loss by
   ``accumulate_grad_batches``; these losses never reach Lightning, so the wrapper divides them
   itself), and ``trainer.strategy.backward(scaled, optimizer)``: the precision plugin scales the
   loss (``GradScaler`` under ``16-mixed``) and the ``on_before_backward``/``on_after_backward``
   hooks run, once per micro-batch as they run once per batch under ``accumulate_grad_batches``.
   Under DDP these backward calls run inside ``DistributedDataParallel.no_sync()``, so gradients
   are all-reduced once per optimizer step. (With torch 2.13 the reducer is armed only in DDP's
   ``_post_forward``, after ``training_step`` returns, so they would not all-reduce anyway;
   ``no_sync`` keeps that true whatever DDP does inside its forward.)
4. The last micro-batch is not backpropagated by the wrapper: its scaled loss is returned, and
   Lightning backpropagates it (with the DDP gradient sync).

What ``training_step`` returns: the last micro-batch's output, its ``"loss"`` replaced by
``scaled_last + sum(scaled_i for i < k).detach()``. Its gradient is that of the last micro-batch
alone (the others are constants, already backpropagated), its value is the sample-weighted mean of
the micro-batch losses, i.e. the full-batch loss: the ``outputs["loss"]`` seen by
``on_train_batch_end`` and the progress bar are what they would be without micro-batching. Other
keys of a dict output come from the last micro-batch.

Caveats:

* The loss returned by ``training_step`` must be a **mean over samples** (as cross entropy with
  ``reduction="mean"`` over equally long samples is). A sum, or a mean over tokens where samples
  have different numbers of valid tokens, is weighted wrongly by ``n_i / N``.
* Batch norm (statistics of a smaller batch) and dropout (a different random stream) break the
  equality with the full-batch run; the memory saving remains.
* ``self.log`` inside ``training_step`` runs once per micro-batch: a value logged ``on_step`` shows
  the last micro-batch's, one logged ``on_epoch`` is averaged over micro-batches weighted by the
  ``batch_size`` passed to ``self.log`` (pass ``batch_size=`` to weight by micro-batch size).
* Only the training step is split; validation and prediction batches are not.
* Under DDP with ``find_unused_parameters=True``, unused parameters are found from the last
  micro-batch's graph: a parameter used by an earlier micro-batch only (data-dependent routing)
  would be treated as unused. Not tested with ``static_graph=True``.
* Supported: automatic optimization on a single device or DDP (``ddp``, ``ddp_spawn``, ...).
  Manual optimization, DeepSpeed (it accumulates itself), FSDP and other model-parallel
  strategies are refused by :meth:`MicroBatching.is_applicable`.

Example:
    >>> import torch
    >>> batch = {"input_ids": torch.zeros(5, 3, dtype=torch.long), "index": torch.arange(5), "tag": "x"}
    >>> parts = split_batch(batch, 2)
    >>> [p["input_ids"].shape[0] for p in parts], [p["index"].tolist() for p in parts], parts[2]["tag"]
    ([2, 2, 1], [[0, 1], [2, 3], [4]], 'x')
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_seqmem.batch import infer_batch_shape
from lightning_seqmem.checks import check_int
from lightning_seqmem.mitigations import MitigationResult

__all__ = ["MicroBatching", "is_micro_batching", "split_batch"]


def _micro_batch_sizes(batch_size: int, micro_batch_size: int) -> list[int]:
    full, rest = divmod(batch_size, micro_batch_size)
    return [micro_batch_size] * full + ([rest] if rest else [])


def _slice(obj: Any, batch_size: int, start: int, length: int) -> Any:
    """``obj`` with every tensor whose dim 0 is ``batch_size`` narrowed to ``[start, start+length)``."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() >= 1 and obj.shape[0] == batch_size:
            return obj.narrow(0, start, length)  # a view: no copy of the batch
        return obj
    if isinstance(obj, Mapping):
        items = {key: _slice(value, batch_size, start, length) for key, value in obj.items()}
        if isinstance(obj, MutableMapping):
            try:
                new = copy.copy(obj)  # keeps the mapping's type (dict, OrderedDict, BatchEncoding, ...)
                for key, value in items.items():
                    new[key] = value
                return new
            except Exception:  # noqa: BLE001 - an exotic mapping: a plain dict still works in training_step
                return items
        try:
            return type(obj)(items)
        except Exception:  # noqa: BLE001
            return items
    if isinstance(obj, (list, tuple)):
        parts = [_slice(value, batch_size, start, length) for value in obj]
        if isinstance(obj, list):
            return parts
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*parts)
        return type(obj)(parts)
    return obj


def split_batch(batch: Any, micro_batch_size: int) -> list[Any]:
    """Split a batch into consecutive micro-batches of at most ``micro_batch_size`` samples.

    The batch size ``N`` is read with :func:`lightning_seqmem.batch.infer_batch_shape` (the first
    dimension of its 2-D integer token tensor). Every tensor whose dim 0 equals ``N`` is cut along
    dim 0 (as views, nothing is copied); other values (scalars, strings, tensors of another first
    dimension) are passed unchanged to every micro-batch. Mappings, lists, tuples and namedtuples
    are rebuilt with their type; the input is never mutated. A list of ``N`` strings is a list, not
    a tensor: it is *not* cut. The last micro-batch is smaller when ``micro_batch_size`` does not
    divide ``N``.

    Raises:
        ValueError: bad ``micro_batch_size``, or no 2-D integer tensor in the batch.

    Example:
        >>> import torch
        >>> ids = torch.arange(8).reshape(4, 2)
        >>> [t.tolist() for t, _ in split_batch((ids, torch.tensor(1.0)), 3)]
        [[[0, 1], [2, 3], [4, 5]], [[6, 7]]]
    """
    micro_batch_size = check_int("micro_batch_size", micro_batch_size, accepted="an int >= 1")
    batch_size, _ = infer_batch_shape(batch)
    parts, start = [], 0
    for length in _micro_batch_sizes(batch_size, micro_batch_size):
        parts.append(_slice(batch, batch_size, start, length))
        start += length
    return parts


def _loss_of(output: Any) -> torch.Tensor | None:
    """The loss in a ``training_step`` output, as Lightning reads it (a tensor, ``output["loss"]``, or None)."""
    if isinstance(output, Mapping):
        loss = output.get("loss")
        if loss is None:
            raise ValueError("In automatic optimization, when `training_step` returns a dict, it needs a 'loss' key.")
        return loss
    if output is None or isinstance(output, torch.Tensor):
        return output
    raise ValueError(
        f"`training_step` must return a Tensor, a dict with a 'loss' key, or None; got {type(output).__name__}."
    )


def _with_loss(output: Any, loss: torch.Tensor) -> Any:
    if isinstance(output, Mapping):
        return {**output, "loss": loss}
    return loss


def _trainer_of(pl_module: Any) -> Any:
    try:
        return pl_module.trainer
    except RuntimeError:  # not attached to a Trainer
        return None


def _positional_capacity(fn: Any) -> int | None:
    """How many positional arguments ``fn`` takes (None: unlimited)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params)


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Leave the precision plugin's autocast (``training_step`` runs inside it) for a backward."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False) if enabled else contextlib.nullcontext()


class _SkipNextZeroGrad:
    """Instance-level ``optimizer_zero_grad`` that skips one call, then puts the original back."""

    def __init__(self, pl_module: Any) -> None:
        self.pl_module = pl_module
        self.previous = pl_module.__dict__.get("optimizer_zero_grad")  # None: the class's method

    def restore(self) -> None:
        if self.pl_module.__dict__.get("optimizer_zero_grad") is self:
            if self.previous is None:
                del self.pl_module.optimizer_zero_grad
            else:
                self.pl_module.optimizer_zero_grad = self.previous

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.restore()  # the gradients were zeroed before the first micro-batch: keep them


class _MicroBatchedTrainingStep:
    """The wrapper put on ``pl_module.training_step`` (a picklable object, for ``ddp_spawn``)."""

    _seqmem_micro_batching = True

    def __init__(self, pl_module: Any, micro_batch_size: int) -> None:
        self.pl_module = pl_module
        # A training_step set on the instance before us, else None: the class's method, looked up at
        # call time (a stored bound method would pickle as getattr(module, "training_step"): us).
        self.previous = pl_module.__dict__.get("training_step")
        self.micro_batch_size = micro_batch_size
        self.num_args = _positional_capacity(self.original)

    @property
    def original(self) -> Any:
        if self.previous is not None:
            return self.previous
        return type(self.pl_module).training_step.__get__(self.pl_module)

    @property
    def __wrapped__(self) -> Any:  # Lightning's is_overridden("training_step", module) follows it
        return self.original

    def __call__(self, batch: Any, *args: Any) -> Any:
        if self.num_args is not None:  # Lightning passes batch_idx only if the signature asks for it
            args = args[: max(self.num_args - 1, 0)]
        trainer = _trainer_of(self.pl_module)
        if trainer is None or not self.pl_module.automatic_optimization:
            return self.original(batch, *args)
        parts = split_batch(batch, self.micro_batch_size)
        if len(parts) == 1:
            return self.original(batch, *args)
        return self._run(trainer, parts, *args)

    def _run(self, trainer: Any, parts: list[Any], *args: Any) -> Any:
        total = sum(infer_batch_shape(part)[0] for part in parts)
        accumulate = trainer.accumulate_grad_batches
        skip_backward = bool(getattr(trainer.fit_loop, "_skip_backward", False))
        optimizer = trainer.optimizers[0]
        if not skip_backward and trainer.fit_loop.epoch_loop.batch_idx % accumulate == 0:
            # Lightning zeroes after training_step (Closure.closure): zero now, and skip its call.
            pending = self.pl_module.__dict__.get("optimizer_zero_grad")
            if isinstance(pending, _SkipNextZeroGrad):  # armed by a step whose zero_grad never came
                pending.restore()
            self.pl_module.optimizer_zero_grad(trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx, optimizer)
            self.pl_module.optimizer_zero_grad = _SkipNextZeroGrad(self.pl_module)
        model = trainer.strategy.model
        no_sync = model.no_sync if isinstance(model, DistributedDataParallel) else contextlib.nullcontext
        done: torch.Tensor | None = None  # sum of the scaled losses already backpropagated, detached
        for part in parts[:-1]:
            output = self.original(part, *args)
            loss = _loss_of(output)
            del output
            if loss is None:  # this micro-batch is skipped, as Lightning skips a batch returning None
                continue
            scaled = loss * (infer_batch_shape(part)[0] / total)
            if not skip_backward:
                with no_sync(), _autocast_off(scaled.device.type):
                    trainer.strategy.backward(scaled / accumulate, optimizer)
            done = scaled.detach() if done is None else done + scaled.detach()
            del loss, scaled
        output = self.original(parts[-1], *args)
        loss = _loss_of(output)
        if loss is None:
            return output
        scaled = loss * (infer_batch_shape(parts[-1])[0] / total)
        return _with_loss(output, scaled if done is None else scaled + done)


def is_micro_batching(pl_module: Any) -> bool:
    """Whether ``pl_module.training_step`` is wrapped by :class:`MicroBatching`.

    Example:
        >>> import torch
        >>> is_micro_batching(torch.nn.Linear(2, 2))
        False
    """
    return isinstance(pl_module.__dict__.get("training_step"), _MicroBatchedTrainingStep)


def _describe(pl_module: Any) -> str:
    wrapper = pl_module.__dict__.get("training_step")
    return f"micro_batch_size={wrapper.micro_batch_size}" if isinstance(wrapper, _MicroBatchedTrainingStep) else "off"


def _dataloader_batch_size(trainer: Any) -> int | None:
    loader = getattr(trainer, "train_dataloader", None)
    size = getattr(loader, "batch_size", None)
    return size if isinstance(size, int) else None


class MicroBatching:
    """Policy: split every training batch into micro-batches of ``micro_batch_size`` samples.

    See the module docstring for the mechanism and its caveats (the loss must be a mean over
    samples; batch norm and dropout break the equality with the full-batch run).

    Args:
        micro_batch_size: samples per micro-batch (the last one of a batch may be smaller).
            ``1`` gives the lowest peak, at the cost of the least parallel work per kernel.

    Example:
        >>> MicroBatching(0)
        Traceback (most recent call last):
        ...
        ValueError: `micro_batch_size` must be an int >= 1, got 0
    """

    name = "micro_batching"

    def __init__(self, micro_batch_size: int = 1) -> None:
        self.micro_batch_size = check_int("micro_batch_size", micro_batch_size, accepted="an int >= 1")

    def is_applicable(self, trainer: Any, pl_module: Any, batch: Any = None) -> tuple[bool, str]:
        """``(True, what would change)`` or ``(False, reason)``.

        Args:
            trainer: the ``Trainer`` (its strategy and dataloader are checked).
            pl_module: the ``LightningModule``.
            batch: a training batch, to read the batch size from; without it the train
                dataloader's ``batch_size`` is used when known.
        """
        if not getattr(pl_module, "automatic_optimization", True):
            return False, "manual optimization (automatic_optimization=False): the module runs its own backward"
        from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

        strategy = trainer.strategy
        if getattr(strategy, "handles_gradient_accumulation", False):
            return False, f"{type(strategy).__name__} accumulates gradients itself"
        if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
            return False, f"strategy {type(strategy).__name__} not supported (single device and DDP are)"
        model = strategy.model
        if model is not None and model is not pl_module and not isinstance(model, DistributedDataParallel):
            return False, f"the strategy wraps the module in {type(model).__name__} (not DistributedDataParallel)"
        wrapper = pl_module.__dict__.get("training_step")
        if isinstance(wrapper, _MicroBatchedTrainingStep) and wrapper.micro_batch_size == self.micro_batch_size:
            return False, f"already micro-batching with micro_batch_size={self.micro_batch_size}"
        if batch is not None:
            try:
                batch_size: int | None = infer_batch_shape(batch)[0]
            except ValueError as err:
                return False, f"cannot split the batch: {err}"
        else:
            batch_size = _dataloader_batch_size(trainer)
        if batch_size is not None and batch_size <= self.micro_batch_size:
            return False, f"batch size {batch_size} is already at most micro_batch_size={self.micro_batch_size}"
        size = "?" if batch_size is None else str(batch_size)
        return True, f"split batches of {size} into micro-batches of {self.micro_batch_size}"

    def apply(self, trainer: Any, pl_module: Any, batch: Any = None) -> MitigationResult:
        """Wrap ``pl_module.training_step``; takes effect at the next training step.

        Call it outside ``training_step`` (e.g. from ``on_train_batch_start`` or before ``fit``).
        A second call with the same size changes nothing; with another size it changes the size.
        """
        before = _describe(pl_module)
        applicable, reason = self.is_applicable(trainer, pl_module, batch)
        if not applicable:
            return MitigationResult(self.name, applied=False, detail=reason, before=before, after=before)
        wrapper = pl_module.__dict__.get("training_step")
        if isinstance(wrapper, _MicroBatchedTrainingStep):
            wrapper.micro_batch_size = self.micro_batch_size
        else:
            pl_module.training_step = _MicroBatchedTrainingStep(pl_module, self.micro_batch_size)
        after = _describe(pl_module)
        detail = f"{reason} ({before} -> {after})"
        return MitigationResult(self.name, applied=True, detail=detail, before=before, after=after)

    def remove(self, pl_module: Any) -> MitigationResult:
        """Restore the original ``training_step`` (call it between training steps)."""
        before = _describe(pl_module)
        wrapper = pl_module.__dict__.get("training_step")
        if not isinstance(wrapper, _MicroBatchedTrainingStep):
            return MitigationResult(self.name, applied=False, detail="not micro-batching", before=before, after=before)
        if wrapper.previous is not None:
            pl_module.training_step = wrapper.previous
        else:
            del pl_module.training_step
        skip = pl_module.__dict__.get("optimizer_zero_grad")
        if isinstance(skip, _SkipNextZeroGrad):
            skip.restore()
        detail = "restored the original training_step"
        return MitigationResult(self.name, applied=True, detail=detail, before=before, after="off")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(micro_batch_size={self.micro_batch_size})"
