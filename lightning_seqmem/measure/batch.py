"""Read and set the sequence length of a training batch.

Pure functions, no Lightning (after Composer's ``set_batch_sequence_length``):

- :func:`infer_batch_shape` finds ``(batch_size, seq_len)`` in a batch; :func:`read_batch_shape`
  does the same through a user's ``seq_len_fn`` when one is given, and checks what it returns;
- :func:`cut_batch` returns a batch shortened to a new length, with what the cut really did
  (:class:`BatchCut`), leaving its argument untouched unless asked to cut in place;
  :func:`set_batch_sequence_length` is its in-place form, for Lightning's ``on_train_batch_start``;
- :func:`can_cut_in_place` says whether a batch can be cut in place at all;
- :func:`padding_side` tells a left-padded batch from a right-padded one.

**Batch formats.** A batch is a tensor, or a mapping (``dict``, Hugging Face ``BatchEncoding`` or
another ``Mapping``), list, tuple (``namedtuple`` too) or dataclass instance of tensors and other
values, nested to any depth.

**Cutting in place.** In Lightning's ``on_train_batch_start`` only a change made *inside* the batch
object reaches ``training_step``. A ``dict``, a ``BatchEncoding`` (any ``MutableMapping``), a
``list`` and a non-frozen dataclass can be cut in place: their entries are replaced, nested
immutable containers rebuilt inside them. A tuple, a ``namedtuple``, a read-only mapping, a frozen
dataclass and a bare tensor cannot: :func:`cut_batch` returns a new one, which only helps where the
caller can hand it on (a ``collate_fn``, ``on_after_batch_transfer``, a training loop).

**The reference tensor**, whose shape is the batch shape, is a 2-D integer (not bool, not float)
tensor of token ids, chosen in this order:

1. in a mapping, ``input_ids`` when it is one (whatever its shape, even ``[1, L]``);
2. otherwise the first such tensor met depth first (mapping values in insertion order, list and
   tuple items in order, dataclass fields in declaration order);
3. except that when this first tensor has one row, as a ``[1, L]`` ``position_ids`` broadcast over
   the batch does, the tensor with the most rows among those of the same length ``L`` is taken
   instead (the first of equals).

**Sequence tensors**, cut with the tokens, are those (other than in ``keys`` mode) whose first
dimension is the batch size ``B`` or 1 (broadcast) and that have the reference length ``L``
either at ``seq_dim`` (``input_ids``, ``labels``, ``attention_mask``, ``position_ids`` ``[1, L]``,
embeddings ``[B, L, D]``) or at both of their last two dimensions (attention masks and biases ``[B, 1, L, L]``, and
``[B, L, L]`` when not float: a float ``[B, L, D]`` with ``D == L`` is taken for embeddings),
which are cut on both. **Sequences of another length** (2-D integer or bool tensors with ``B``
rows, or 1, whose length is not ``L``: the decoder ``labels [B, L/2]`` of an encoder-decoder) keep
their ratio to ``L`` when truncated (see :func:`scaled_length`); ``truncate=False`` leaves them.

**Padding.** With ``truncate=True`` the kept positions are the first ``seq_len`` of every row,
except for a left-padded batch, where they are the last ``seq_len`` (the real tokens, ending where
the row's real tokens end); see :func:`padding_side` for how padding is read from ``attention_mask``.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Mapping
from typing import Any, Optional, TypeVar

import numpy as np
import torch

from lightning_seqmem.measure.batch_tensors import (  # scaled_length re-exported
    broadcast_rows,
    diagonal_blocks,
    is_sequence,
    is_square,
    split_positions,
    split_rows,
    scaled_length,
)
from lightning_seqmem.measure.batch_shape import (  # reading a batch; its public names re-exported
    mask_stats,
    read_mask,
    infer_batch_shape,
)
from lightning_seqmem.measure.batch_tree import (  # the tree walk; map_tensors re-exported
    find_attention_mask,
    is_immutable_container,
    map_tensors,
)

__all__ = ["BatchCut", "cut_batch", "set_batch_sequence_length"]


BatchT = TypeVar("BatchT")

_KEEP = ("auto", "first", "last")


@dataclasses.dataclass(frozen=True)
class BatchCut:
    """What :func:`cut_batch` did: the batch it returns and the shape the batch really has.

    ``seq_len`` is the length after the cut, read from the data: when the data are shorter than
    asked (``source_seq_len <= asked_seq_len``) nothing is cut and ``seq_len`` is the data's length,
    not the one asked for.
    """

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
        raise ValueError(
            f"`seq_dim` must be an int >= 1 (dim 0 is the batch dimension), got {seq_dim!r}."
        )
    if keep not in _KEEP:
        raise ValueError(f"`keep` must be one of {list(_KEEP)}, got {keep!r}.")
    for name, flag in (("truncate", truncate), ("in_place", in_place)):
        if not isinstance(flag, (bool, np.bool_)):
            raise ValueError(f"`{name}` must be True or False, got {flag!r}.")
    if in_place and not isinstance(batch, torch.Tensor) and is_immutable_container(batch):
        raise TypeError(
            f"Cannot set the sequence length of a {type(batch).__name__} batch in place: it cannot"
            " be changed in place, and in Lightning's `on_train_batch_start` only an in-place change"
            " reaches `training_step`. Return a dict or a list from the dataloader (or its"
            " `collate_fn`), or let the datamodule set the length (`set_seq_len`); `cut_batch`"
            " returns a cut copy where the caller can hand it on."
        )
    return int(seq_len), bool(truncate), bool(in_place)


def _cut_extent(batch: Any, keys: Optional[Iterable[str]], seq_dim: int) -> tuple[Optional[frozenset[str]], int, int]:
    """``(the named sequence keys or None, batch size, length)`` of a batch :func:`cut_batch` cuts."""
    if keys is not None:
        return _keyed_shape(batch, keys, seq_dim)
    if isinstance(batch, torch.Tensor):
        if batch.dim() <= seq_dim:
            raise ValueError(
                f"A tensor batch needs a dimension `seq_dim`={seq_dim},"
                f" got shape {list(batch.shape)}."
            )
        return None, int(batch.shape[0]), int(batch.shape[seq_dim])
    try:
        batch_size, length = infer_batch_shape(batch)
    except ValueError as err:
        raise ValueError(f"{err} Or pass `keys` to name the sequence tensors.") from None
    return None, batch_size, length


def _mask_plan(batch: Any, batch_size: int, length: int, seq_len: int, truncate: bool,
               keep: str) -> tuple[Optional[str], Optional[str], Optional[int]]:
    """``(kept, padding side, empty rows)`` of a cut, read from the batch's ``attention_mask``
    (``kept``: which positions ``truncate=True`` keeps; None without truncation)."""
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


def cut_batch(
    batch: Any,
    seq_len: int,
    *,
    truncate: bool = True,
    keep: str = "auto",
    seq_dim: int = 1,
    keys: Optional[Iterable[str]] = None,
    in_place: bool = False,
) -> BatchCut:
    """Shorten a batch to ``seq_len`` tokens per row; return the result and its real shape.

    Sequence tensors (see the module docstring; with ``keys``, exactly ``batch[key]`` for each key)
    are cut; other values (a per-sample ``index``, 1-D tensors, strings) are left alone, except as
    below for ``truncate=False``. If ``seq_len`` is not below the current length nothing is cut
    (a batch is never padded), the batch itself is returned and ``BatchCut.seq_len`` is the
    data's own length.

    Args:
        batch: any batch format of the module docstring.
        seq_len: the new length, an int >= 1.
        truncate: ``True`` keeps ``seq_len`` positions of every row (copied, so the full-length
            storage is freed and memory is measured at the new length); a tensor with the length
            at both of its last two dims keeps the same block ``[kept, kept]``. ``False`` keeps
            every token: rows ``[B, L]`` become ``[B * L // seq_len, seq_len]`` (trailing dims
            kept, chunk ``j`` of sample ``b`` is row ``b * L // seq_len + j``), so ``seq_len`` must
            divide ``L``; per-sample tensors with dim 0 equal to ``B`` (such as ``index``) are
            repeated ``L // seq_len`` times along dim 0 to stay aligned, broadcast ``[1, L]``
            tensors are split and tiled to every sample (a ``position_ids`` key is instead
            recomputed as ``arange(seq_len)``, ``[1, seq_len]`` if it was broadcast), and
            ``[..., L, L]`` masks keep their diagonal blocks (a chunk attends within itself). A
            chunk may then hold only padding (counted in ``empty_rows``).
        keep: which positions ``truncate=True`` keeps: ``"first"``, ``"last"``, or ``"auto"``:
            the last for a left-padded batch (:func:`padding_side`), else the first.
        seq_dim: the dimension of the sequence in sequence tensors (>= 1; dim 0 is the batch).
        keys: names of the sequence tensors in a mapping batch, instead of detecting them (then
            they may be float tensors such as ``inputs_embeds``; they are cut at ``seq_dim`` only).
        in_place: change the batch's own containers (see :func:`can_cut_in_place`) rather than
            return new ones. Without it the argument is left untouched (new containers, new cut
            tensors, other values shared).

    Returns:
        A :class:`BatchCut`: the batch, ``batch_size`` and ``seq_len`` after the cut, and
        ``kept``, ``padding_side`` and ``empty_rows`` read from ``attention_mask`` (reading it
        synchronises with its device once per cut).

    Raises:
        ValueError: bad ``seq_len``/``truncate``/``keep``/``seq_dim``/``keys``/``in_place``, no
            sequence tensor found, or
            (with ``truncate=False``) ``seq_len`` does not divide the current length.
        TypeError: ``in_place=True`` for a container that cannot change in place.

    >>> import torch
    >>> batch = (torch.tensor([[0, 5, 6, 7], [1, 2, 3, 4]]), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
    >>> out = cut_batch(batch, 2)  # a tuple: a new tuple comes back
    >>> out.batch[0].tolist(), out.batch_size, out.seq_len, out.in_place, batch[0].shape[1]
    ([[0, 5], [1, 2]], 2, 2, False, 4)
    >>> batch = {"input_ids": torch.tensor([[0, 5, 6, 7], [1, 2, 3, 4]]), "attention_mask": batch[1]}
    >>> out = cut_batch(batch, 2)  # left padding: the last tokens are kept
    >>> out.batch["input_ids"].tolist(), out.kept, out.padding_side
    ([[6, 7], [3, 4]], 'last', 'left')
    >>> out = cut_batch(batch, 16)  # the data are shorter than asked: nothing is cut
    >>> out.seq_len, out.cut, out.shorter_than_asked, out.batch is batch
    (4, False, True, True)
    """
    seq_len, truncate, in_place = _checked_cut_args(batch, seq_len, truncate, keep, seq_dim, in_place)
    key_set, batch_size, length = _cut_extent(batch, keys, seq_dim)
    if seq_len >= length:
        return BatchCut(batch, batch_size, length, length, seq_len, False, None, None, None)
    if not truncate and length % seq_len:
        divisors = [d for d in range(1, length) if length % d == 0]
        raise ValueError(
            f"`truncate=False` keeps every token by splitting rows of length {length} into rows of"
            f" `seq_len`, which must divide {length}; got seq_len={seq_len}. Lengths that divide"
            f" {length}: {divisors}."
        )
    chunks = length // seq_len
    kept, side, empty_rows = _mask_plan(batch, batch_size, length, seq_len, truncate, keep)
    start = length - seq_len if kept == "last" else 0

    def convert(x: torch.Tensor, key: Any, top_key: Any) -> torch.Tensor:
        if key_set is None and not isinstance(batch, torch.Tensor) and is_square(x, batch_size, length):
            if truncate:
                return x.narrow(-1, start, seq_len).narrow(-2, start, seq_len).clone(
                    memory_format=torch.contiguous_format
                )
            return broadcast_rows(diagonal_blocks(x, seq_len), x, batch_size, chunks)
        if is_sequence(x, key_set, top_key, batch, batch_size, length, seq_dim):
            if truncate:  # a copy, not a view: a view would keep the full-length storage alive
                return x.narrow(seq_dim, start, seq_len).clone(memory_format=torch.contiguous_format)
            if key == "position_ids":
                return split_positions(x, seq_len, seq_dim, batch_size, chunks)
            return broadcast_rows(split_rows(x, seq_len, seq_dim), x, batch_size, chunks)
        if truncate and key_set is None and not isinstance(batch, torch.Tensor):
            size = scaled_length(x, batch_size, length, seq_len, seq_dim)
            if size is not None and size < x.shape[seq_dim]:  # labels of an encoder-decoder, [B, r·L]
                begin = x.shape[seq_dim] - size if kept == "last" else 0
                return x.narrow(seq_dim, begin, size).clone(memory_format=torch.contiguous_format)
        if not truncate and x.dim() >= 1 and x.shape[0] == batch_size:
            return x.repeat_interleave(chunks, dim=0)
        return x

    new_batch = map_tensors(batch, convert, in_place)
    return BatchCut(
        batch=new_batch,
        batch_size=batch_size if truncate else batch_size * chunks,
        seq_len=seq_len,
        source_seq_len=length,
        asked_seq_len=seq_len,
        in_place=in_place and new_batch is batch and not isinstance(batch, torch.Tensor),
        kept=kept,
        padding_side=side,
        empty_rows=empty_rows,
    )


def set_batch_sequence_length(
    batch: BatchT,
    seq_len: int,
    *,
    truncate: bool = True,
    seq_dim: int = 1,
    keys: Iterable[str] | None = None,
    keep: str = "auto",
) -> BatchT:
    """Set the sequence length of a batch to ``seq_len`` in place; return the batch.

    :func:`cut_batch` with ``in_place=True``, returning only the batch: a mutable mapping, a list
    or a non-frozen dataclass is changed in place and returned (so that a batch changed in
    Lightning's ``on_train_batch_start`` is what ``training_step`` sees); a tensor comes back as a
    new tensor; a tuple, ``namedtuple``, read-only mapping or frozen dataclass raises
    ``TypeError`` (:func:`can_cut_in_place` tells in advance; :func:`cut_batch` returns a cut copy).
    See :func:`cut_batch` for ``truncate``, ``keep`` (left-padded batches keep their last tokens),
    ``seq_dim`` and ``keys``. If ``seq_len`` is not below the current length the batch is
    returned unchanged: it is never padded.

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
    return cut_batch(
        batch, seq_len, truncate=truncate, keep=keep, seq_dim=seq_dim, keys=keys, in_place=True
    ).batch


def _keyed_shape(batch: Any, keys: Iterable[str], seq_dim: int) -> tuple[frozenset[str], int, int]:
    """Check ``keys`` against a mapping batch; return them with (batch_size, seq_len).

    The named tensors must agree on the length at ``seq_dim`` and on the batch size, except that
    a tensor with one row is broadcast (the batch size is then the largest).
    """
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
            raise ValueError(
                f"`keys` must name tensors with a dimension `seq_dim`={seq_dim};"
                f" batch[{key!r}] is {found}."
            )
        shapes[key] = (int(value.shape[0]), int(value.shape[seq_dim]))
    lengths = {length for _, length in shapes.values()}
    sizes = {size for size, _ in shapes.values() if size != 1}
    if len(lengths) > 1 or len(sizes) > 1:
        raise ValueError(
            "The tensors named in `keys` disagree on (batch_size, length at `seq_dim`): "
            f"{shapes} (a batch size of 1 is broadcast)."
        )
    return frozenset(key_list), max(sizes, default=1), lengths.pop()
