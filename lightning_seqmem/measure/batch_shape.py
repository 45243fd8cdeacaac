"""Reading a batch's shape ``(batch_size, seq_len)`` and padding (``attention_mask``) unchanged.
:mod:`lightning_seqmem.measure.batch` re-exports the public names and states the rules.

Example:
    >>> import torch
    >>> read_batch_shape({"input_ids": torch.zeros(2, 8, dtype=torch.long)})
    (2, 8)
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any, Optional

import numpy as np
import torch

from lightning_seqmem.core.config import check_seq_len_fn
from lightning_seqmem.measure.batch_tree import (find_attention_mask, find_reference,
                                                 is_dataclass_instance)

__all__ = ["infer_batch_shape", "mask_stats", "padding_side", "read_batch_shape", "read_mask",
           "shapes_read_by"]

_MAX_DESCRIBED = 20  # leaves listed in the "no token ids found" error, at most
# the user's seq_len_fn while a dry run of their step reads its batches (shapes_read_by)
_SEQ_LEN_FN: ContextVar[Optional[Callable[[Any], Any]]] = ContextVar("seqmem_seq_len_fn",
                                                                     default=None)


@contextlib.contextmanager
def shapes_read_by(seq_len_fn: Optional[Callable[[Any], Any]]) -> Iterator[None]:
    """Meanwhile :func:`infer_batch_shape` reads every batch with ``seq_len_fn`` (checked, as
    :func:`read_batch_shape`), not by its token ids: the dry run of a step whose batch has none
    (float embeddings) reshapes it by the shape the callback reads. ``None`` changes nothing.

    >>> import torch
    >>> embeds = {"x": torch.zeros(2, 8, 4)}
    >>> with shapes_read_by(lambda b: tuple(b["x"].shape[:2])):
    ...     infer_batch_shape(embeds)
    (2, 8)
    >>> tokens = torch.zeros(3, 5, dtype=torch.long)
    >>> with shapes_read_by(infer_batch_shape):  # its own call reads token ids: no recursion
    ...     infer_batch_shape(tokens)
    (3, 5)
    """
    check_seq_len_fn(seq_len_fn)
    token = _SEQ_LEN_FN.set(seq_len_fn)
    try:
        yield
    finally:
        _SEQ_LEN_FN.reset(token)


def infer_batch_shape(batch: Any) -> tuple[int, int]:
    """``(batch_size, seq_len)``: the shape of the batch's reference tensor (2-D integer, see
    :mod:`lightning_seqmem.measure.batch`); ``ValueError`` listing what was found when none.

    >>> import torch
    >>> infer_batch_shape(torch.zeros(2, 5, dtype=torch.long))
    (2, 5)
    >>> batch = {"embeds": torch.zeros(3, 7, 4), "labels": torch.zeros(3, 7, dtype=torch.long)}
    >>> infer_batch_shape(batch)
    (3, 7)
    >>> infer_batch_shape([torch.zeros(3), {"input_ids": torch.zeros(4, 9, dtype=torch.int32)}])
    (4, 9)
    >>> positions, tokens = torch.arange(9).view(1, 9), torch.zeros(4, 9, dtype=torch.long)
    >>> infer_batch_shape([positions, tokens])  # not (1, 9): [1, L] is broadcast over the batch
    (4, 9)

    Inside :func:`shapes_read_by`, its ``seq_len_fn`` reads the shape instead.
    """
    seq_len_fn = _SEQ_LEN_FN.get()
    if seq_len_fn is not None:
        return read_batch_shape(batch, seq_len_fn)
    reference = find_reference(batch)
    if reference is None:
        raise ValueError(
            "Could not infer (batch_size, seq_len) from the batch: expected a 2-D integer tensor of"
            " token ids (`input_ids` in a dict, or the first such tensor), found "
            f"{_describe_batch(batch)}. Pass `seq_len_fn` to the callback to read the shape of"
            " this batch.")
    return int(reference.shape[0]), int(reference.shape[1])


def read_batch_shape(batch: Any,
                     seq_len_fn: Optional[Callable[[Any], Any]] = None) -> tuple[int, int]:
    """``(batch_size, seq_len)``: ``seq_len_fn(batch)`` checked, else :func:`infer_batch_shape`.
    ``seq_len_fn`` must return a pair (tuple, list, ``torch.Size``) of ints >= 1 (Python, NumPy or
    0-d integer tensors), else ``ValueError``; its own errors propagate.

    >>> import numpy as np, torch
    >>> read_batch_shape({"x": torch.zeros(2, 3)}, lambda b: (np.int64(2), torch.tensor(3)))
    (2, 3)
    >>> read_batch_shape({"x": torch.zeros(2, 3)}, lambda b: None)
    ... # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: `seq_len_fn` must return a pair (batch_size, seq_len) of ints >= 1 (Python or
    NumPy ints, or 0-d integer tensors; not bools), got None (did it forget to `return`?)
    """
    if seq_len_fn is None:
        return infer_batch_shape(batch)
    check_seq_len_fn(seq_len_fn)
    token = _SEQ_LEN_FN.set(None)  # a seq_len_fn calling infer_batch_shape reads token ids
    try:
        value = seq_len_fn(batch)
    finally:
        _SEQ_LEN_FN.reset(token)
    accepted = ("`seq_len_fn` must return a pair (batch_size, seq_len) of ints >= 1 (Python or "
                "NumPy ints, or 0-d integer tensors; not bools)")
    if value is None:
        raise ValueError(f"{accepted}, got None (did it forget to `return`?)")
    shape = (tuple(_positive_int(item) for item in value)
             if isinstance(value, (tuple, list)) and len(value) == 2 else None)
    if shape is None or None in shape:
        raise ValueError(f"{accepted}, got {value!r}")
    return shape  # type: ignore[return-value]


def padding_side(batch: Any) -> Optional[str]:
    """``"left"``, ``"right"`` or ``None``: where the padding of a batch is, read from its mask.
    The mask: a 2-D ``attention_mask`` key or field, a container's own first; 0 is padding. Left
    when some row is padded at its start only and none at its end only; right in the mirror case.
    ``None`` otherwise, without such a mask, or if it cannot be read (fake, meta). One device sync.

    >>> import torch
    >>> padding_side({"input_ids": torch.ones(2, 4).long(),
    ...               "attention_mask": torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])})
    'left'
    >>> padding_side({"attention_mask": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])})
    'right'
    >>> padding_side({"attention_mask": torch.ones(2, 4)}) is None
    True
    """
    mask = find_attention_mask(batch)
    if mask is None or mask.shape[1] == 0:
        return None
    flags = read_mask(mask, lambda m: _side_flags(m))
    if flags is None:
        return None
    left, right = flags
    return "left" if left and not right else "right" if right and not left else None


def _side_flags(mask: torch.Tensor) -> torch.Tensor:
    """``[any row padded at its start only, any row padded at its end only]``."""
    first, last = mask[:, 0] != 0, mask[:, -1] != 0
    return torch.stack([(~first & last).any(), (first & ~last).any()])


def mask_stats(mask: torch.Tensor, seq_len: int, truncate: bool) -> torch.Tensor:
    """What ``cut_batch`` reads before a cut: side flags, rows all padding if the first / last
    ``seq_len`` are kept, chunks all padding in chunks of ``seq_len`` (0 when ``truncate``).

    >>> import torch
    >>> mask_stats(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]), 2, truncate=True).tolist()
    [1, 0, 1, 0, 0]
    """
    real = mask != 0
    zero = torch.zeros((), dtype=torch.long, device=mask.device)
    empty_first = (~real[:, :seq_len].any(dim=1)).sum()
    empty_last = (~real[:, -seq_len:].any(dim=1)).sum()
    empty_chunks = zero if truncate else (~real.reshape(-1, seq_len).any(dim=1)).sum()
    return torch.cat([_side_flags(mask).long(),
                      torch.stack([empty_first, empty_last, empty_chunks])])


def read_mask(mask: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> Optional[list]:
    """``fn(mask).tolist()`` (one device sync), or None for a meta or fake mask (a dry run).

    >>> import torch
    >>> ones = torch.ones(2, 4)
    >>> read_mask(ones, lambda m: m.sum(dim=1)), read_mask(ones.to("meta"), len)
    ([4, 4], None)
    """
    if mask.is_meta:
        return None
    try:
        return [int(v) for v in fn(mask).tolist()]
    except (RuntimeError, NotImplementedError):  # fake tensors (dry runs) have no data
        return None


def _positive_int(value: Any) -> Optional[int]:
    """``value`` as an int >= 1 (Python, NumPy, 0-d integer tensor; not bool), else None."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, torch.Tensor):
        if (value.dim() != 0 or value.dtype == torch.bool or value.dtype.is_floating_point
                or value.dtype.is_complex):
            return None
        value = value.item()
    elif isinstance(value, np.ndarray) and value.dtype == np.bool_:
        return None
    try:
        number = operator.index(value)
    except TypeError:
        return None
    return number if number >= 1 else None


def _describe_batch(batch: Any) -> str:
    """A short list of the leaves of a batch with their types and shapes, for error messages."""
    leaves: list[str] = []

    def visit(obj: Any, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            dtype = str(obj.dtype).removeprefix("torch.")
            leaves.append(f"{path}: Tensor({dtype}, {list(obj.shape)})")
        elif isinstance(obj, Mapping) and obj:
            for key, value in obj.items():
                visit(value, f"{path}[{key!r}]")
        elif isinstance(obj, (list, tuple)) and obj:
            for index, value in enumerate(obj):
                visit(value, f"{path}[{index}]")
        elif is_dataclass_instance(obj) and dataclasses.fields(obj):
            for f in dataclasses.fields(obj):
                visit(getattr(obj, f.name), f"{path}.{f.name}")
        else:
            leaves.append(f"{path}: {type(obj).__name__}")

    visit(batch, "batch")
    shown = "; ".join(leaves[:_MAX_DESCRIBED])
    if len(leaves) > _MAX_DESCRIBED:
        shown += f"; ... ({len(leaves) - _MAX_DESCRIBED} more)"
    return shown
