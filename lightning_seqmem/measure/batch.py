"""Read and set the sequence length of a training batch.

Pure functions, no Lightning (after Composer's ``set_batch_sequence_length``):
:func:`infer_batch_shape` finds ``(batch_size, seq_len)``; :func:`cut_batch` shortens a batch and
says what the cut did (:class:`BatchCut`); :func:`set_batch_sequence_length` is its in-place form.
A batch is a tensor, or a mapping (``dict``, ``BatchEncoding``, any ``Mapping``), list, tuple
(``namedtuple`` too) or dataclass of tensors and other values, nested to any depth.

**In place.** In Lightning's ``on_train_batch_start`` only a change *inside* the batch reaches
``training_step``: a ``MutableMapping``, ``list`` or non-frozen dataclass is cut in place (nested
immutable containers rebuilt); a tuple, read-only mapping, frozen dataclass or tensor comes back
new, of use only where the caller hands it on (``collate_fn``, ``on_after_batch_transfer``).

**The reference tensor** (its shape: the batch's), 2-D integer token ids: a mapping's ``input_ids``
if it is one; else the first met depth first, but if that has one row (a broadcast ``[1, L]``
``position_ids``), the first with most rows of length ``L``. **Sequence tensors**, cut with the
tokens (unless ``keys`` names them), have first dimension ``B`` or 1 and length ``L`` at ``seq_dim``
(ids, labels, masks, embeddings ``[B, L, D]``) or at the last two (``[B, 1, L, L]``, non-float
``[B, L, L]``), cut on both. **Other-length sequences** (2-D integer or bool, ``B`` or 1 rows:
seq2seq ``labels [B, L/2]``) keep their ratio to ``L`` if truncated (:func:`scaled_length`)."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Mapping
from typing import Any, Optional, TypeVar

import numpy as np
import torch

from lightning_seqmem.measure.batch_tensors import (  # scaled_length re-exported
    broadcast_rows, diagonal_blocks, is_sequence, is_square, split_positions, split_rows,
    scaled_length)
from lightning_seqmem.measure.batch_shape import (  # reading a batch; public names re-exported
    mask_stats, read_mask, infer_batch_shape)
from lightning_seqmem.measure.batch_tree import (  # the tree walk; map_tensors re-exported
    find_attention_mask, is_immutable_container, map_tensors)

__all__ = ["BatchCut", "cut_batch", "set_batch_sequence_length"]


BatchT = TypeVar("BatchT")

_KEEP = ("auto", "first", "last")


@dataclasses.dataclass(frozen=True)
class BatchCut:
    """What :func:`cut_batch` did: the batch it returns and its real shape (read from the data)."""

    batch: Any  # the cut batch: the argument itself when cut in place or when nothing was cut
    batch_size: int  # rows after the cut: B, or B * L // seq_len with truncate=False
    seq_len: int  # length after the cut (tokens per row)
    source_seq_len: int  # length before the cut
    asked_seq_len: int  # the length asked for
    in_place: bool  # True when the argument's own containers were changed
    kept: Optional[str]  # "first" or "last" positions kept (truncate=True); None if not truncated
    padding_side: Optional[str]  # "left", "right" or None, from `attention_mask` (see padding_side)
    empty_rows: Optional[int]  # rows holding only padding after the cut; None without a mask

    @property
    def cut(self) -> bool:
        """True when the batch was shortened (or split into shorter rows)."""
        return self.asked_seq_len < self.source_seq_len

    @property
    def shorter_than_asked(self) -> bool:
        """True when the data were shorter than the asked length (then nothing is cut)."""
        return self.source_seq_len < self.asked_seq_len


def _checked_cut_args(batch: Any, seq_len: Any, truncate: Any, keep: Any, seq_dim: Any,
                      in_place: Any) -> tuple[int, bool, bool]:
    """:func:`cut_batch`'s arguments checked: ``(seq_len, truncate, in_place)`` as plain values."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral) or seq_len < 1:
        raise ValueError(f"`seq_len` must be an int >= 1, got {seq_len!r}.")
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or seq_dim < 1:
        raise ValueError("`seq_dim` must be an int >= 1 (dim 0 is the batch dimension), got "
                         f"{seq_dim!r}.")
    if keep not in _KEEP:
        raise ValueError(f"`keep` must be one of {list(_KEEP)}, got {keep!r}.")
    for name, flag in (("truncate", truncate), ("in_place", in_place)):
        if not isinstance(flag, (bool, np.bool_)):
            raise ValueError(f"`{name}` must be True or False, got {flag!r}.")
    if in_place and not isinstance(batch, torch.Tensor) and is_immutable_container(batch):
        raise TypeError(
            f"Cannot set the sequence length of a {type(batch).__name__} batch in place: it cannot"
            " be changed in place, and in Lightning's `on_train_batch_start` only an in-place "
            "change reaches `training_step`. Return a dict or a list from the dataloader (or its"
            " `collate_fn`), or let the datamodule set the length (`set_seq_len`); `cut_batch`"
            " returns a cut copy where the caller can hand it on.")
    return int(seq_len), bool(truncate), bool(in_place)


def _cut_extent(batch: Any, keys: Optional[Iterable[str]],
                seq_dim: int) -> tuple[Optional[frozenset[str]], int, int]:
    """``(the named sequence keys or None, batch size, length)`` of a batch to cut."""
    if keys is not None:
        return _keyed_shape(batch, keys, seq_dim)
    if isinstance(batch, torch.Tensor):
        if batch.dim() <= seq_dim:
            raise ValueError(f"A tensor batch needs a dimension `seq_dim`={seq_dim},"
                             f" got shape {list(batch.shape)}.")
        return None, int(batch.shape[0]), int(batch.shape[seq_dim])
    try:
        batch_size, length = infer_batch_shape(batch)
    except ValueError as err:
        raise ValueError(f"{err} Or pass `keys` to name the sequence tensors.") from None
    return None, batch_size, length


def _mask_plan(batch: Any, batch_size: int, length: int, seq_len: int, truncate: bool,
               keep: str) -> tuple[Optional[str], Optional[str], Optional[int]]:
    """``(kept, padding side, empty rows)`` of a cut, as in :class:`BatchCut`, from the mask."""
    mask = find_attention_mask(batch)
    if mask is not None and tuple(mask.shape) != (batch_size, length):
        mask = None  # a mask of another shape says nothing about these rows
    stats = None if mask is None else read_mask(mask, lambda m: mask_stats(m, seq_len, truncate))
    side: Optional[str] = None
    empty_rows: Optional[int] = None
    if stats is not None:
        left, right, empty_first, empty_last, empty_chunks = stats
        side = "left" if left and not right else "right" if right and not left else None
    kept: Optional[str] = None
    if truncate:
        kept = keep if keep != "auto" else ("last" if side == "left" else "first")
        if stats is not None:
            empty_rows = empty_last if kept == "last" else empty_first
    elif stats is not None:
        empty_rows = empty_chunks
    return kept, side, empty_rows


def cut_batch(batch: Any, seq_len: int, *, truncate: bool = True, keep: str = "auto",
              seq_dim: int = 1, keys: Optional[Iterable[str]] = None,
              in_place: bool = False) -> BatchCut:
    """Cut a batch to ``seq_len`` tokens per row, never padding: sequence tensors (module docstring,
    or ``keys``) are cut, others (a per-sample ``index``, strings) kept but for ``truncate=False``.

    Args:
        truncate: ``True`` keeps ``seq_len`` positions of every row, copied (freeing the full
            storage); ``[.., L, L]`` tensors keep ``[kept, kept]``. ``False`` keeps every token:
            ``[B, L]`` becomes ``[B * L // seq_len, seq_len]`` (``seq_len`` must divide ``L``;
            chunk ``j`` of sample ``b`` is row ``b * L // seq_len + j``), per-sample tensors
            repeated, broadcast ``[1, L]`` ones tiled (``position_ids`` as ``arange(seq_len)``),
            ``[..., L, L]`` masks keep diagonal blocks; a chunk may be all padding (``empty_rows``).
        keep: ``"first"``, ``"last"``, or ``"auto"``: the last for a left-padded batch.
        seq_dim: the sequence dimension (>= 1; dim 0 is the batch).
        keys: names of the sequence tensors in a mapping batch, instead of detecting them (then
            they may be float, such as ``inputs_embeds``; cut at ``seq_dim`` only).
        in_place: change the batch's own containers (else new ones; other values are shared).

    Returns:
        A :class:`BatchCut`, its mask facts read from ``attention_mask`` (one device sync).

    Raises:
        ValueError: a bad argument, no sequence tensor, or (``truncate=False``) ``L % seq_len``.
        TypeError: ``in_place=True`` for a container that cannot change in place.

    >>> import torch
    >>> batch = (torch.tensor([[0, 5, 6, 7], [1, 2, 3, 4]]),
    ...          torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
    >>> out = cut_batch(batch, 2)  # a tuple: a new tuple comes back
    >>> out.batch[0].tolist(), out.batch_size, out.seq_len, out.in_place, batch[0].shape[1]
    ([[0, 5], [1, 2]], 2, 2, False, 4)
    >>> batch = {"input_ids": torch.tensor([[0, 5, 6, 7], [1, 2, 3, 4]]),
    ...          "attention_mask": batch[1]}
    >>> out = cut_batch(batch, 2)  # left padding: the last tokens are kept
    >>> out.batch["input_ids"].tolist(), out.kept, out.padding_side
    ([[6, 7], [3, 4]], 'last', 'left')
    >>> out = cut_batch(batch, 16)  # the data are shorter than asked: nothing is cut
    >>> out.seq_len, out.cut, out.shorter_than_asked, out.batch is batch
    (4, False, True, True)
    """
    seq_len, truncate, in_place = _checked_cut_args(batch, seq_len, truncate, keep, seq_dim,
                                                    in_place)
    key_set, batch_size, length = _cut_extent(batch, keys, seq_dim)
    if seq_len >= length:
        return BatchCut(batch, batch_size, length, length, seq_len, False, None, None, None)
    if not truncate and length % seq_len:
        divisors = [d for d in range(1, length) if length % d == 0]
        raise ValueError(
            f"`truncate=False` keeps every token by splitting rows of length {length} into rows of"
            f" `seq_len`, which must divide {length}; got seq_len={seq_len}. Lengths that divide"
            f" {length}: {divisors}.")
    chunks = length // seq_len
    kept, side, empty_rows = _mask_plan(batch, batch_size, length, seq_len, truncate, keep)
    start = length - seq_len if kept == "last" else 0

    def convert(x: torch.Tensor, key: Any, top_key: Any) -> torch.Tensor:
        if (key_set is None and not isinstance(batch, torch.Tensor)
                and is_square(x, batch_size, length)):
            if truncate:
                return x.narrow(-1, start, seq_len).narrow(-2, start, seq_len).clone(
                    memory_format=torch.contiguous_format)
            return broadcast_rows(diagonal_blocks(x, seq_len), x, batch_size, chunks)
        if is_sequence(x, key_set, top_key, batch, batch_size, length, seq_dim):
            if truncate:  # a copy, not a view: a view would keep the full-length storage alive
                return x.narrow(seq_dim, start, seq_len).clone(
                    memory_format=torch.contiguous_format)
            if key == "position_ids":
                return split_positions(x, seq_len, seq_dim, batch_size, chunks)
            return broadcast_rows(split_rows(x, seq_len, seq_dim), x, batch_size, chunks)
        if truncate and key_set is None and not isinstance(batch, torch.Tensor):
            size = scaled_length(x, batch_size, length, seq_len, seq_dim)
            if size is not None and size < x.shape[seq_dim]:  # encoder-decoder labels, [B, r·L]
                begin = x.shape[seq_dim] - size if kept == "last" else 0
                return x.narrow(seq_dim, begin, size).clone(memory_format=torch.contiguous_format)
        if not truncate and x.dim() >= 1 and x.shape[0] == batch_size:
            return x.repeat_interleave(chunks, dim=0)
        return x

    new_batch = map_tensors(batch, convert, in_place)
    return BatchCut(batch=new_batch, batch_size=batch_size if truncate else batch_size * chunks,
                    seq_len=seq_len, source_seq_len=length, asked_seq_len=seq_len,
                    in_place=(in_place and new_batch is batch
                              and not isinstance(batch, torch.Tensor)),
                    kept=kept, padding_side=side, empty_rows=empty_rows)


def set_batch_sequence_length(batch: BatchT, seq_len: int, *, truncate: bool = True,
                              seq_dim: int = 1, keys: Iterable[str] | None = None,
                              keep: str = "auto") -> BatchT:
    """Set a batch's sequence length in place, returning it (:func:`cut_batch`, ``in_place=True``):
    a tensor comes back new; an immutable container raises ``TypeError`` (:func:`can_cut_in_place`).

    >>> import torch
    >>> batch = {"input_ids": torch.arange(8).reshape(2, 4), "index": torch.tensor([0, 1])}
    >>> out = set_batch_sequence_length(batch, 2)
    >>> out is batch, out["input_ids"].tolist(), out["index"].tolist()
    (True, [[0, 1], [4, 5]], [0, 1])
    >>> batch = {"input_ids": torch.arange(8).reshape(2, 4), "index": torch.tensor([0, 1])}
    >>> out = set_batch_sequence_length(batch, 2, truncate=False)
    >>> out["input_ids"].tolist(), out["index"].tolist()
    ([[0, 1], [2, 3], [4, 5], [6, 7]], [0, 0, 1, 1])
    """
    return cut_batch(batch, seq_len, truncate=truncate, keep=keep, seq_dim=seq_dim, keys=keys,
                     in_place=True).batch


def _keyed_shape(batch: Any, keys: Iterable[str], seq_dim: int) -> tuple[frozenset[str], int, int]:
    """Check ``keys`` (tensors of one length and batch size, 1 broadcast); return (keys, B, L)."""
    if isinstance(keys, str):
        keys = [keys]
    key_list = list(keys)
    if not isinstance(batch, Mapping):
        raise ValueError(f"`keys` needs a mapping batch, got a {type(batch).__name__}.")
    if not key_list:
        raise ValueError("`keys` must name at least one sequence tensor, got none.")
    missing = [key for key in key_list if key not in batch]
    if missing:
        raise ValueError(f"`keys` {missing} not in the batch; its keys are {list(batch)}.")
    shapes = {}
    for key in key_list:
        value = batch[key]
        if not isinstance(value, torch.Tensor) or value.dim() <= seq_dim:
            found = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"`keys` must name tensors with a dimension `seq_dim`={seq_dim};"
                             f" batch[{key!r}] is {found}.")
        shapes[key] = (int(value.shape[0]), int(value.shape[seq_dim]))
    lengths = {length for _, length in shapes.values()}
    sizes = {size for size, _ in shapes.values() if size != 1}
    if len(lengths) > 1 or len(sizes) > 1:
        raise ValueError("The tensors named in `keys` disagree on (batch_size, length at "
                         f"`seq_dim`): {shapes} (a batch size of 1 is broadcast).")
    return frozenset(key_list), max(sizes, default=1), lengths.pop()
