"""Read and set the sequence length of a training batch.

Two pure functions, no Lightning: :func:`infer_batch_shape` finds ``(batch_size, seq_len)`` in a
batch, and :func:`set_batch_sequence_length` shortens a batch to a new length, the functional twin
of the curriculum (after Composer's ``set_batch_sequence_length``).

A batch is a tensor, or a mapping / list / tuple of tensors and other values, nested to any depth.
The *reference* tensor, the one whose shape is the batch shape, is a 2-D integer tensor of token
ids: ``input_ids`` in a mapping when it is one, otherwise the first 2-D integer tensor met in
order (float and bool tensors are never the reference).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any, TypeVar

import torch

__all__ = ["infer_batch_shape", "set_batch_sequence_length"]

BatchT = TypeVar("BatchT")

_MAX_DESCRIBED = 20  # leaves listed in the "no token ids found" error, at most


def infer_batch_shape(batch: Any) -> tuple[int, int]:
    """Return ``(batch_size, seq_len)`` of a batch of token ids.

    The shape is that of the reference tensor, a 2-D integer (not bool, not float) tensor:

    - a bare tensor: the tensor itself;
    - a mapping: ``input_ids`` if present and a 2-D integer tensor, else the first one found in
      insertion order (searching nested values depth first);
    - a list or tuple: the first one found, depth first through nested mappings and sequences.

    Raises:
        ValueError: no 2-D integer tensor in the batch. The message lists what was found; pass
            ``seq_len_fn`` to the callback to read the shape of such batches.

    >>> import torch
    >>> infer_batch_shape(torch.zeros(2, 5, dtype=torch.long))
    (2, 5)
    >>> batch = {"embeds": torch.zeros(3, 7, 4), "labels": torch.zeros(3, 7, dtype=torch.long)}
    >>> infer_batch_shape(batch)
    (3, 7)
    >>> infer_batch_shape([torch.zeros(3), {"input_ids": torch.zeros(4, 9, dtype=torch.int32)}])
    (4, 9)
    """
    reference = _find_reference(batch)
    if reference is None:
        raise ValueError(
            "Could not infer (batch_size, seq_len) from the batch: expected a 2-D integer tensor of"
            " token ids (`input_ids` in a dict, or the first such tensor), found "
            f"{_describe_batch(batch)}. Pass `seq_len_fn` to the callback to read the shape of"
            " this batch."
        )
    return int(reference.shape[0]), int(reference.shape[1])


def set_batch_sequence_length(
    batch: BatchT,
    seq_len: int,
    *,
    truncate: bool = True,
    seq_dim: int = 1,
    keys: Iterable[str] | None = None,
) -> BatchT:
    """Set the sequence length of a batch to ``seq_len``; return the batch.

    Sequence tensors are, by default, every tensor with a dimension ``seq_dim`` whose size there
    equals the reference length (see :func:`infer_batch_shape`) and whose size at dim 0 equals the
    batch size: ``input_ids``, ``labels``, ``attention_mask``, ``position_ids``, loss masks. With
    ``keys`` (mapping batches only) they are exactly ``batch[key]`` for each key, which may then be
    float tensors such as ``inputs_embeds``; the reference length is read from them. Only
    ``seq_dim`` is cut, so a ``[B, 1, L, L]`` mask is left alone: build such masks in the model.
    Other values (a per-sample ``index``, 1-D tensors, strings) are left alone, except as
    below for ``truncate=False``.

    Args:
        batch: a mutable mapping or a list (changed in place and returned, so that a batch changed
            in Lightning's ``on_train_batch_start`` is what ``training_step`` sees), or a tensor (a
            new tensor is returned). Nested tuples are rebuilt; a top-level tuple is refused.
        seq_len: the new length, an int >= 1.
        truncate: ``True`` keeps the first ``seq_len`` positions of every row (copied, so the
            full-length storage is freed and memory is measured at the new length). ``False`` keeps every token: rows ``[B, L]`` become
            ``[B * L // seq_len, seq_len]`` (trailing dims kept, chunk ``j`` of sample ``b`` is row
            ``b * L // seq_len + j``), so ``seq_len`` must divide ``L``; per-sample tensors with
            dim 0 equal to ``B`` (such as ``index``) are repeated ``L // seq_len`` times along dim 0
            to stay aligned, and a ``position_ids`` key is recomputed as ``arange(seq_len)`` in
            every row. A chunk may then hold only padding.
        seq_dim: the dimension of the sequence in sequence tensors (>= 1; dim 0 is the batch).
        keys: names of the sequence tensors in a mapping batch, instead of detecting them.

    If ``seq_len`` is not below the current length the batch is returned unchanged: it is never
    padded.

    Raises:
        ValueError: bad ``seq_len``/``seq_dim``/``keys``, no sequence tensor found, or (with
            ``truncate=False``) ``seq_len`` does not divide the current length.
        TypeError: the batch is a tuple (or another immutable container).

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
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"`seq_len` must be an int >= 1, got {seq_len!r}.")
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or seq_dim < 1:
        raise ValueError(
            f"`seq_dim` must be an int >= 1 (dim 0 is the batch dimension), got {seq_dim!r}."
        )
    if isinstance(batch, tuple) or (
        isinstance(batch, Mapping) and not isinstance(batch, MutableMapping)
    ):
        raise TypeError(
            f"Cannot set the sequence length of a {type(batch).__name__} batch: it cannot be"
            " changed in place, and in Lightning's `on_train_batch_start` only an in-place change"
            " reaches `training_step`. Return a dict or a list from the dataloader (or its"
            " `collate_fn`), or let the datamodule set the length (`set_seq_len`)."
        )

    key_set: frozenset[str] | None = None
    if keys is not None:
        key_set, batch_size, length = _keyed_shape(batch, keys, seq_dim)
    elif isinstance(batch, torch.Tensor):
        if batch.dim() <= seq_dim:
            raise ValueError(
                f"A tensor batch needs a dimension `seq_dim`={seq_dim},"
                f" got shape {list(batch.shape)}."
            )
        batch_size, length = int(batch.shape[0]), int(batch.shape[seq_dim])
    else:
        try:
            batch_size, length = infer_batch_shape(batch)
        except ValueError as err:
            raise ValueError(f"{err} Or pass `keys` to name the sequence tensors.") from None

    if seq_len >= length:
        return batch
    if not truncate and length % seq_len:
        divisors = [d for d in range(1, length) if length % d == 0]
        raise ValueError(
            f"`truncate=False` keeps every token by splitting rows of length {length} into rows of"
            f" `seq_len`, which must divide {length}; got seq_len={seq_len}. Lengths that divide"
            f" {length}: {divisors}."
        )
    rows_per_sample = length // seq_len

    def is_sequence(x: torch.Tensor, top_key: Any) -> bool:
        if key_set is not None:
            return top_key in key_set  # keyed values are tensors, so this is batch[top_key]
        if isinstance(batch, torch.Tensor):
            return True
        return x.dim() > seq_dim and x.shape[0] == batch_size and x.shape[seq_dim] == length

    def convert(x: torch.Tensor, key: Any, top_key: Any) -> torch.Tensor:
        if is_sequence(x, top_key):
            if truncate:  # a copy, not a view: a view would keep the full-length storage alive
                return x.narrow(seq_dim, 0, seq_len).contiguous()
            rows = _split_rows(x, seq_len, seq_dim)
            if key == "position_ids":
                shape = [1] * rows.dim()
                shape[seq_dim] = seq_len
                positions = torch.arange(seq_len, dtype=rows.dtype, device=rows.device)
                rows = positions.view(shape).expand(rows.shape).contiguous()
            return rows
        if not truncate and x.dim() >= 1 and x.shape[0] == batch_size:
            return x.repeat_interleave(rows_per_sample, dim=0)
        return x

    return _map_tensors(batch, convert)


def _is_token_tensor(x: Any) -> bool:
    """True for a 2-D integer tensor (not bool, not float, not complex)."""
    return (
        isinstance(x, torch.Tensor)
        and x.dim() == 2
        and x.dtype != torch.bool
        and not x.dtype.is_floating_point
        and not x.dtype.is_complex
    )


def _find_reference(obj: Any) -> torch.Tensor | None:
    """The tensor whose shape is the batch shape, or None (rules in :func:`infer_batch_shape`)."""
    if isinstance(obj, torch.Tensor):
        return obj if _is_token_tensor(obj) else None
    if isinstance(obj, Mapping):
        if _is_token_tensor(obj.get("input_ids")):
            return obj["input_ids"]
        children: Iterable[Any] = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    else:
        return None
    for child in children:
        found = _find_reference(child)
        if found is not None:
            return found
    return None


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
        else:
            leaves.append(f"{path}: {type(obj).__name__}")

    visit(batch, "batch")
    shown = "; ".join(leaves[:_MAX_DESCRIBED])
    if len(leaves) > _MAX_DESCRIBED:
        shown += f"; ... ({len(leaves) - _MAX_DESCRIBED} more)"
    return shown


def _keyed_shape(batch: Any, keys: Iterable[str], seq_dim: int) -> tuple[frozenset[str], int, int]:
    """Check ``keys`` against a mapping batch; return them with (batch_size, seq_len)."""
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
    if len(set(shapes.values())) > 1:
        raise ValueError(
            "The tensors named in `keys` disagree on (batch_size, length at `seq_dim`): "
            f"{shapes}."
        )
    batch_size, length = next(iter(shapes.values()))
    return frozenset(key_list), batch_size, length


def _split_rows(x: torch.Tensor, seq_len: int, seq_dim: int) -> torch.Tensor:
    """Split dim ``seq_dim`` of ``x`` into chunks of ``seq_len`` and move the chunks into dim 0."""
    shape = list(x.shape)
    chunks = shape[seq_dim] // seq_len
    x = x.reshape(*shape[:seq_dim], chunks, seq_len, *shape[seq_dim + 1 :])
    x = x.movedim(seq_dim, 1)
    return x.reshape(shape[0] * chunks, *shape[1:seq_dim], seq_len, *shape[seq_dim + 1 :])


def _map_tensors(
    obj: Any,
    fn: Callable[[torch.Tensor, Any, Any], torch.Tensor],
    key: Any = None,
    top_key: Any = None,
    depth: int = 0,
) -> Any:
    """Apply ``fn(tensor, key, top_key)`` to every tensor; mutable containers change in place.

    ``key`` is the tensor's key in its parent mapping (None in a sequence), ``top_key`` the key or
    index of the batch's top-level entry that holds it.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj, key, top_key)
    if isinstance(obj, Mapping):
        new = {
            k: _map_tensors(v, fn, k, k if depth == 0 else top_key, depth + 1)
            for k, v in obj.items()
        }
        if isinstance(obj, MutableMapping):
            for k, v in new.items():
                if v is not obj[k]:
                    obj[k] = v
            return obj
        return new
    if isinstance(obj, (list, tuple)):
        new_items = [
            _map_tensors(v, fn, None, i if depth == 0 else top_key, depth + 1)
            for i, v in enumerate(obj)
        ]
        if isinstance(obj, list):
            obj[:] = new_items
            return obj
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*new_items)
        return type(obj)(new_items)
    return obj
