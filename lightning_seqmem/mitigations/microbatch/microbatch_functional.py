"""The functional twin of micro-batching: split a batch, weigh each micro-batch by what the loss
averages over. Plain functions used alike by the training-step wrapper (:mod:`.microbatch_step`),
the dry run and the memory breakdown, so all three split and weigh the same way; the step they all
run is :mod:`.microbatch_twin` (the method card: :mod:`.microbatch`).

Example:
    >>> import torch
    >>> parts = split_batch({"input_ids": torch.zeros(3, 4, dtype=torch.long)}, 2)
    >>> [p["input_ids"].shape[0] for p in parts]
    [2, 1]
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_seqmem.core.checks import check_int
from lightning_seqmem.measure.batch_shape import infer_batch_shape
from lightning_seqmem.measure.batch_tree import map_tensors
from lightning_seqmem.mitigations.base import fsdp2_modules

__all__ = ["IGNORE_INDEX", "RULE_TEXT", "WEIGHTINGS", "check_weighting",
           "deferred_gradient_reduction", "is_deepspeed_engine", "micro_batch_counts",
           "slice_batch", "split_batch"]

IGNORE_INDEX = -100  # label value a loss skips (torch's cross_entropy and Hugging Face's default)
WEIGHTINGS = ("auto", "samples", "label_tokens", "shifted_label_tokens")
RULE_TEXT = {  # what each weighting rule counts, in words
    "samples": "samples",
    "label_tokens": "label tokens (labels != ignore_index)",
    "shifted_label_tokens": "label tokens after the causal shift (labels[..., 1:] != ignore_index)",
}


def check_weighting(weighting: str) -> str:
    """``weighting`` where it is one of :data:`WEIGHTINGS`, else ValueError."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"`weighting` must be one of {WEIGHTINGS}, got {weighting!r}")
    return weighting


def _micro_batch_sizes(batch_size: int, micro_batch_size: int) -> list[int]:
    full, rest = divmod(batch_size, micro_batch_size)
    return [micro_batch_size] * full + ([rest] if rest else [])


def slice_batch(obj: Any, batch_size: int, start: int, length: int) -> Any:
    """``obj`` with every tensor whose dim 0 is ``batch_size`` narrowed to ``[start, start+length)``
    (views: no copy of the batch), in new containers of the same types (dataclasses included)."""
    def narrow(tensor: torch.Tensor, key: Any, top_key: Any) -> torch.Tensor:
        return (tensor.narrow(0, start, length)
                if tensor.dim() >= 1 and tensor.shape[0] == batch_size else tensor)

    return map_tensors(obj, narrow, in_place=False)


def split_batch(batch: Any, micro_batch_size: int) -> list[Any]:
    """Split a batch into consecutive micro-batches of at most ``micro_batch_size`` samples.

    The batch size ``N`` is read with :func:`.infer_batch_shape` (dim 0 of its 2-D integer token
    tensor). Every tensor whose dim 0 is ``N`` is cut along it (as views); other values (scalars,
    strings, a list of ``N`` strings, tensors of another first dimension) go unchanged to every
    micro-batch. Containers are rebuilt with their type; the input is never mutated.

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
    return [slice_batch(batch, batch_size, start, min(micro_batch_size, batch_size - start))
            for start in range(0, batch_size, micro_batch_size)]


def _is_label_tensor(labels: Any, batch_size: int) -> bool:
    return (
        isinstance(labels, torch.Tensor)
        and labels.dim() >= 1
        and labels.shape[0] == batch_size
        and not labels.is_floating_point()
        and not labels.is_complex()
        and labels.dtype != torch.bool
    )


def _labels_are_inputs(batch: Mapping, labels: torch.Tensor, ignore_index: int) -> bool:
    """Whether ``labels`` are ``input_ids`` (ignored positions aside): then the loss shifts them."""
    input_ids = batch.get("input_ids")
    if not isinstance(input_ids, torch.Tensor):
        return input_ids is None  # inputs_embeds: Hugging Face's convention, the loss shifts
    if input_ids.shape != labels.shape:
        return False  # seq2seq targets: not shifted
    return bool(((labels == input_ids) | (labels == ignore_index)).all())


def micro_batch_counts(batch: Any, micro_batch_size: int, weighting: str = "auto",
                       ignore_index: int = IGNORE_INDEX) -> tuple[str, list[int]]:
    """What the loss of ``batch`` averages over, counted in each micro-batch of :func:`split_batch`.

    Returns ``(rule, counts)``: ``rule`` is ``"samples"``, ``"label_tokens"`` or
    ``"shifted_label_tokens"`` (how ``"auto"`` picks it: :mod:`.microbatch`), ``counts[i]`` the
    samples or label tokens of micro-batch ``i``, whose loss weighs ``counts[i] / sum(counts)``.

    Raises:
        ValueError: bad ``micro_batch_size`` or ``weighting``, a batch :func:`split_batch` cannot
            cut, or a token ``weighting`` asked for a batch without an integer ``"labels"`` tensor.

    Example:
        >>> import torch
        >>> ids = torch.arange(1, 9).reshape(4, 2)
        >>> next_tokens = torch.tensor([[2, 3], [4, -100], [-100, -100], [8, 9]])  # not shifted
        >>> micro_batch_counts({"input_ids": ids, "labels": next_tokens}, 2)
        ('label_tokens', [3, 2])
        >>> micro_batch_counts({"input_ids": ids, "labels": ids.masked_fill(ids == 4, -100)}, 2)
        ('shifted_label_tokens', [1, 2])
        >>> micro_batch_counts((ids, ids), 3)
        ('samples', [3, 1])
    """
    micro_batch_size = check_int("micro_batch_size", micro_batch_size, accepted="an int >= 1")
    check_weighting(weighting)
    batch_size, _ = infer_batch_shape(batch)
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if weighting == "samples" or (weighting == "auto" and not _is_label_tensor(labels, batch_size)):
        return "samples", _micro_batch_sizes(batch_size, micro_batch_size)
    if not _is_label_tensor(labels, batch_size):
        raise ValueError(
            f"`weighting={weighting!r}` needs a mapping batch with an integer 'labels' tensor of "
            f"{batch_size} rows; this batch has none (use 'auto' or 'samples')")
    if labels.dim() == 1:  # one label per sample: never shifted
        rule, valid = "label_tokens", labels != ignore_index
    else:
        shifted = (_labels_are_inputs(batch, labels, ignore_index) if weighting == "auto"
                   else weighting == "shifted_label_tokens")
        rule = "shifted_label_tokens" if shifted else "label_tokens"
        valid = (labels[..., 1:] if shifted else labels) != ignore_index
    per_sample = valid.reshape(batch_size, -1).sum(dim=1).tolist()
    return rule, [int(sum(per_sample[start : start + micro_batch_size]))
                  for start in range(0, batch_size, micro_batch_size)]


def is_deepspeed_engine(model: Any) -> bool:
    """Whether ``model`` is DeepSpeed's ``DeepSpeedEngine`` (what Lightning's ``DeepSpeedStrategy``
    wraps the module in), told without importing DeepSpeed.

    Example:
        >>> is_deepspeed_engine(torch.nn.Linear(2, 2))
        False
    """
    return any(cls.__name__ == "DeepSpeedEngine" for cls in type(model).__mro__) and hasattr(
        model, "set_gradient_accumulation_boundary")


@contextlib.contextmanager
def deferred_gradient_reduction(model: Any) -> Any:
    """Backward passes inside accumulate gradients locally, without reducing them across ranks:
    ``DistributedDataParallel.no_sync()``, ``set_requires_gradient_sync(False)`` on every FSDP2
    module of ``model``, or DeepSpeed's ``set_gradient_accumulation_boundary(False)`` (ZeRO stages
    0-3 keep each backward's gradients, partitioned, until the boundary's backward reduces them),
    switched back afterwards; nothing for anything else.

    Example:
        >>> with deferred_gradient_reduction(torch.nn.Linear(2, 2)):
        ...     pass
    """
    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
        return
    if is_deepspeed_engine(model):  # the engine's documented way to run several backwards per step
        before = model._is_gradient_accumulation_boundary  # None: its micro-step count decides
        model.set_gradient_accumulation_boundary(False)
        try:
            yield
        finally:
            model._is_gradient_accumulation_boundary = before
            if hasattr(model.optimizer, "set_gradient_accumulation_boundary"):
                model.optimizer.set_gradient_accumulation_boundary(
                    model.is_gradient_accumulation_boundary())
        return
    sharded = fsdp2_modules(model)
    for m in sharded:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for m in sharded:
            m.set_requires_gradient_sync(True, recurse=False)
