"""Walking a training batch as a tree: its containers (mappings, ``BatchEncoding``, lists, tuples,
namedtuples, dataclasses), its token tensors, and :func:`map_tensors`, the package's one walk that
rebuilds containers of the same types. Used by :mod:`lightning_seqmem.measure.batch` (cutting),
micro-batching (splitting) and the dry run (shaping).

Example:
    >>> import torch
    >>> batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "meta": ["a", torch.ones(2)]}
    >>> out = map_tensors(batch, lambda t, key, top: t[:1], in_place=False)
    >>> out["input_ids"].shape, out["meta"][1].shape, batch["input_ids"].shape
    (torch.Size([1, 8]), torch.Size([1]), torch.Size([2, 8]))
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any, Optional

import torch

__all__ = ["can_cut_in_place", "find_attention_mask", "find_reference", "is_dataclass_instance",
           "is_immutable_container", "map_tensors"]


def can_cut_in_place(batch: Any) -> bool:
    """True if ``set_batch_sequence_length`` can cut this batch in place: a mutable mapping, a
    ``list``, a non-frozen dataclass. Only the outermost container matters (immutable ones nested
    in it are rebuilt and put back).

    >>> import torch
    >>> ids = torch.zeros(2, 4, dtype=torch.long)
    >>> can_cut_in_place({"input_ids": ids}), can_cut_in_place([ids]), can_cut_in_place((ids,))
    (True, True, False)
    >>> can_cut_in_place(ids)
    False
    """
    if isinstance(batch, (MutableMapping, list)):
        return True
    if is_dataclass_instance(batch):
        return not type(batch).__dataclass_params__.frozen  # type: ignore[attr-defined]
    return False


def _is_token_tensor(x: Any) -> bool:
    """True for a 2-D integer tensor (not bool, not float, not complex)."""
    return (isinstance(x, torch.Tensor) and x.dim() == 2 and x.dtype != torch.bool
            and not x.dtype.is_floating_point and not x.dtype.is_complex)


def is_dataclass_instance(obj: Any) -> bool:
    """True for an instance of a dataclass (not the class itself): a batch container.

    >>> import dataclasses
    >>> @dataclasses.dataclass
    ... class Batch:
    ...     input_ids: object = None
    >>> is_dataclass_instance(Batch()), is_dataclass_instance(Batch)
    (True, False)
    """
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def is_immutable_container(obj: Any) -> bool:
    """A container whose entries cannot be replaced: tuple, read-only mapping, frozen dataclass.

    >>> import types
    >>> [is_immutable_container(c) for c in ((1,), types.MappingProxyType({}), [])]
    [True, True, False]
    """
    if (isinstance(obj, tuple)
            or (isinstance(obj, Mapping) and not isinstance(obj, MutableMapping))):
        return True
    return is_dataclass_instance(obj) and not isinstance(obj, Mapping) and not can_cut_in_place(obj)


def _children(obj: Any) -> Iterator[tuple[Any, Any]]:
    """``(key, value)`` of a container's entries (key None in a sequence); nothing for a leaf."""
    if isinstance(obj, Mapping):
        yield from obj.items()
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield None, value
    elif is_dataclass_instance(obj):
        for f in dataclasses.fields(obj):
            yield f.name, getattr(obj, f.name)


def _token_tensors(obj: Any) -> Iterator[tuple[torch.Tensor, bool]]:
    """``(tensor, named)``: every 2-D integer tensor depth first, a mapping's input_ids first."""
    if isinstance(obj, torch.Tensor):
        if _is_token_tensor(obj):
            yield obj, False
        return
    named = obj.get("input_ids") if isinstance(obj, Mapping) else None
    if not _is_token_tensor(named):
        named = None
    if named is not None:
        yield named, True
    for _, value in _children(obj):
        if value is not named:
            yield from _token_tensors(value)


def find_reference(obj: Any) -> torch.Tensor | None:
    """The tensor whose shape is the batch shape, or None (rules in the docstring of
    :mod:`lightning_seqmem.measure.batch`).

    >>> import torch
    >>> find_reference({"position_ids": torch.zeros(1, 8, dtype=torch.long),
    ...                 "input_ids": torch.zeros(2, 8, dtype=torch.long)}).shape
    torch.Size([2, 8])
    """
    candidates = _token_tensors(obj)
    first = next(candidates, None)
    if first is None:
        return None
    reference, named = first
    if named or reference.shape[0] != 1:
        return reference
    length = reference.shape[1]
    for tensor, _ in candidates:  # a [1, L] first tensor: broadcast, unless nothing has more rows
        if tensor.shape[1] == length and tensor.shape[0] > reference.shape[0]:
            reference = tensor
    return reference


def find_attention_mask(obj: Any) -> Optional[torch.Tensor]:
    """A 2-D tensor under an ``attention_mask`` key or field, a container's own first; else None.

    >>> import torch
    >>> find_attention_mask({"x": [{"attention_mask": torch.ones(2, 4)}]}).shape
    torch.Size([2, 4])
    """
    for key, value in _children(obj):
        if key == "attention_mask" and isinstance(value, torch.Tensor) and value.dim() == 2:
            return value
    for _, value in _children(obj):
        found = find_attention_mask(value)
        if found is not None:
            return found
    return None


def map_tensors(obj: Any, fn: Callable[[torch.Tensor, Any, Any], torch.Tensor], in_place: bool,
                key: Any = None, top_key: Any = None, depth: int = 0) -> Any:
    """Apply ``fn(tensor, key, top_key)`` to every tensor: the package's one walk of a batch tree.

    With ``in_place`` mutable containers change in place (and are returned) and immutable ones are
    rebuilt; without it every container is rebuilt and ``obj`` is left untouched. ``key`` is the
    tensor's key in its parent mapping or dataclass (None in a sequence), ``top_key`` the key or
    index of the batch's top-level entry that holds it.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj, key, top_key)

    def visit(k: Any, v: Any, index: Any) -> Any:
        return map_tensors(v, fn, in_place, k, index if depth == 0 else top_key, depth + 1)

    if isinstance(obj, Mapping):
        new = {k: visit(k, v, k) for k, v in obj.items()}
        if in_place and isinstance(obj, MutableMapping):
            for k, v in new.items():
                if v is not obj[k]:
                    obj[k] = v
            return obj
        return _rebuild_mapping(obj, new)
    if isinstance(obj, (list, tuple)):
        items = [visit(None, v, i) for i, v in enumerate(obj)]
        if isinstance(obj, list):
            if in_place:
                obj[:] = items
                return obj
            return items if type(obj) is list else _rebuild(obj, items)
        return type(obj)(*items) if hasattr(obj, "_fields") else _rebuild(obj, items)  # namedtuple
    if is_dataclass_instance(obj):
        new = {f.name: visit(f.name, getattr(obj, f.name), f.name) for f in dataclasses.fields(obj)}
        changed = {name: v for name, v in new.items() if v is not getattr(obj, name)}
        if in_place and can_cut_in_place(obj):
            for name, v in changed.items():
                setattr(obj, name, v)
            return obj
        return _rebuild_dataclass(obj, changed)
    return obj


def _rebuild(obj: Any, items: list) -> Any:
    """A new sequence of ``obj``'s type holding ``items`` (a plain list or tuple if it cannot)."""
    try:
        return type(obj)(items)
    except TypeError:
        return list(items) if isinstance(obj, list) else tuple(items)


def _rebuild_mapping(obj: Mapping, new: dict) -> Mapping:
    """A new mapping like ``obj`` (type and attributes, for a ``BatchEncoding``) holding ``new``."""
    if isinstance(obj, MutableMapping):
        try:
            out = copy.copy(obj)  # a BatchEncoding keeps its encodings (full-length offsets)
            for k, v in new.items():
                out[k] = v
            return out
        except (TypeError, AttributeError, copy.Error):
            return dict(new)
    try:
        return type(obj)(new)  # a read-only mapping such as MappingProxyType
    except TypeError:
        return dict(new)


def _rebuild_dataclass(obj: Any, changed: dict) -> Any:
    """A copy of dataclass ``obj`` with ``changed`` fields (frozen ones too)."""
    if not changed:
        return copy.copy(obj)
    init_fields = {f.name for f in dataclasses.fields(obj) if f.init}
    rest = {name: v for name, v in changed.items() if name not in init_fields}
    try:
        out = dataclasses.replace(obj, **{n: v for n, v in changed.items() if n in init_fields})
    except (TypeError, ValueError):
        out, rest = copy.copy(obj), changed
    for name, v in rest.items():
        object.__setattr__(out, name, v)  # a fresh copy: setting a frozen field here is safe
    return out
