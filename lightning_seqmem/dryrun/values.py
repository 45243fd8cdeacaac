"""The values a dry run keeps real: tensors computed from the batch alone (masks, positions), up to
a size that grows with the length, and the batch itself shaped to ``(batch_size, seq_len)``."""

from __future__ import annotations

import contextlib
import contextvars
import math
import sys
import weakref
from collections.abc import MutableMapping
from typing import Any, Iterator, Optional

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                           DynamicOutputShapeException, FakeTensor, FakeTensorMode)
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map_only

from lightning_seqmem.measure.batch import cut_batch
from lightning_seqmem.measure.batch_shape import infer_batch_shape
from lightning_seqmem.measure.batch_tree import map_tensors
from lightning_seqmem.measure.batch_tensors import scaled_length
from lightning_seqmem.measure.batch_tensors import is_square
from lightning_seqmem.dryrun.accelerator import to_host_device

__all__ = ["STAND_IN", "BatchValues", "ValueRoom", "batch_to_device", "shape_batch",
           "transformers_without_fake_detection", "value_max_bytes", "value_room"]

_VALUE_MAX_BYTES = 8 * 2**20  # real values kept of tensors computed from the batch alone, each
_VALUE_CEILING_BYTES = 2**28  # ... or up to a fp32 [L, L] mask of the length (8192 tokens), at most

STAND_IN = 1.0  # what an optimizer step reads from a float scalar of unknown value


def value_max_bytes(seq_len: int) -> int:
    """Largest tensor computed from the batch alone whose real value a dry run at ``seq_len`` keeps:
    at least the fp32 ``[L, L]`` causal mask whose values ``nn.TransformerDecoder`` reads, from
    8 MiB up to 256 MiB (8192 tokens). The values are real tensors in host memory (within
    :func:`value_room` where the host is the training device); beyond 8192 tokens such a check
    refuses the dry run, and the fit of measured steps answers.

    Example:
        >>> value_max_bytes(512) == 8 * 2**20, value_max_bytes(8192) == 4 * 8192 * 8192
        (True, True)
        >>> value_max_bytes(65536) == 2**28
        True
    """
    return min(max(_VALUE_MAX_BYTES, 4 * int(seq_len) ** 2), _VALUE_CEILING_BYTES)


class ValueRoom:
    """How many bytes the real twins of one dry run may hold at once (:func:`value_room`): on a CPU
    run, what the usable budget leaves beside the run's tensors, so a dry run inside a step window
    never takes the device past its budget. A twin that does not fit is not kept (a step that reads
    its values refuses the dry run; :attr:`withheld_bytes` is the largest one).

    Example:
        >>> room = ValueRoom(1000)
        >>> room.take(600), room.take(600), room.withheld_bytes, room.held_bytes
        (True, False, 600, 600)
        >>> room.release(600); room.take(900), room.peak_bytes
        (True, 900)
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = max(0, int(limit_bytes))
        self.held_bytes = 0  # what the twins hold now
        self.peak_bytes = 0  # the most they held at once
        self.withheld_bytes = 0  # the largest twin refused for want of room (0: none)

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit (noting the largest that did not)."""
        if self.held_bytes + int(nbytes) <= self.limit_bytes:
            return True
        self.withheld_bytes = max(self.withheld_bytes, int(nbytes))
        return False

    def take(self, nbytes: int) -> bool:
        """Hold ``nbytes`` more where they fit."""
        if not self.fits(nbytes):
            return False
        self.held_bytes += int(nbytes)
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return True

    def release(self, nbytes: int) -> None:
        self.held_bytes = max(0, self.held_bytes - int(nbytes))


_ROOM: contextvars.ContextVar[Optional[ValueRoom]] = contextvars.ContextVar("seqmem_value_room",
                                                                           default=None)


@contextlib.contextmanager
def value_room(limit_bytes: Optional[int]) -> Iterator[Optional[ValueRoom]]:
    """The dry runs inside keep real twins of at most ``limit_bytes`` at once, all together (None:
    only each twin's :func:`value_max_bytes`); yields the :class:`ValueRoom` (None without a limit).

    Example:
        >>> with value_room(4096) as room:
        ...     room.limit_bytes
        4096
    """
    room = None if limit_bytes is None else ValueRoom(limit_bytes)
    token = _ROOM.set(room)
    try:
        yield room
    finally:
        _ROOM.reset(token)


# -- values a step reads from its batch -----------------------------------------------------------
def _tensors_in(*objs: Any) -> list[torch.Tensor]:
    """The tensors among an op's arguments or outputs (aten nests at most one list deep)."""
    out: list[torch.Tensor] = []
    for obj in objs:
        for x in (obj.values() if isinstance(obj, dict)
                  else obj if isinstance(obj, (list, tuple)) else (obj,)):
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif isinstance(x, (list, tuple)):
                out.extend(t for t in x if isinstance(t, torch.Tensor))
    return out


_UNINITIALISED = {torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.empty_like,
                  torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided}
"""Ops whose output holds no values (uninitialised memory): never given a real twin."""

_WRITTEN_ARGS: dict[Any, tuple[tuple[int, str], ...]] = {}  # op -> (position, name) of args written


def _written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments an op writes to (``self`` of an in-place op, ``out=``)."""
    where = _WRITTEN_ARGS.get(func)
    if where is None and getattr(func, "namespace", None) == "c10d":
        # a collective writes its outputs in place, but c10d's schemas carry no alias information:
        # every tensor argument counts as written (a fake process group fills none of them)
        where = tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                      if "Tensor" in str(a.type))
        _WRITTEN_ARGS[func] = where
    if where is None:
        where = tuple(
            (-1 if a.kwarg_only else i, a.name)
            for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        _WRITTEN_ARGS[func] = where
    written: list[torch.Tensor] = []
    for i, name in where:
        written += _tensors_in(args[i] if 0 <= i < len(args) else kwargs.get(name))
    return written


def _small(out: Any, max_bytes: int = _VALUE_MAX_BYTES) -> bool:
    return all(t.numel() * t.element_size() <= max_bytes for t in _tensors_in(out))


def _new_bytes(out: Any, args: tuple, kwargs: dict) -> int:
    """Bytes of the storages among an op's outputs that are not its inputs' (a view or an in-place
    op makes none): what running it again on the twins allocates."""
    inputs = {t.untyped_storage()._cdata for t in _tensors_in(args, kwargs)
              if t.layout == torch.strided}
    new = {}
    for t in _tensors_in(out):
        if t.layout == torch.strided and (storage := t.untyped_storage())._cdata not in inputs:
            new[storage._cdata] = storage.nbytes()
    return sum(new.values())


def _bound_bytes(args: tuple, kwargs: dict) -> int:
    """At most what an op whose output shape depends on values makes from its inputs (``nonzero``:
    one int64 index per element and dimension)."""
    return sum(8 * t.numel() * max(1, t.dim()) for t in _tensors_in(args, kwargs))


class BatchValues(TorchDispatchMode):
    """Real values of the small tensors a step computes from its batch and constants alone: fake
    tensors have none, yet models read some (``mask.all()``, ``position_ids`` diffs,
    ``(labels != -100).sum().item()``). This mode (above the fake mode) keeps their real twins, up
    to ``max_bytes`` (:func:`value_max_bytes`), rerunning each such op on the twins with every mode
    off (uncounted; twins die with their fake tensors). An op reading a tensor without a twin (an
    activation) still fails, except a floating-point scalar read inside an optimizer's step
    (:meth:`let_step_read`). A real tensor held by the module is its own twin, never written to.
    Writing a storage from a tensor without a twin drops the twins of all its views."""

    def __init__(self, fake_mode: FakeTensorMode, max_bytes: int = _VALUE_MAX_BYTES) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.max_bytes = int(max_bytes)  # largest tensor whose real value is kept
        self.room: Optional[ValueRoom] = _ROOM.get()  # what all twins may hold at once (None: any)
        # id(fake) -> (a weak reference to it, its twin, the twin's storage key)
        self._values: dict[int, tuple[weakref.ref, torch.Tensor, int]] = {}
        self._held: dict[int, list[int]] = {}  # a twin storage's key -> [twins on it, its bytes]
        # storages whose values were overwritten unseen
        self._unknown_storages: dict[int, weakref.ref] = {}
        self._in_optimizer_step = False

    def let_step_read(self, optimizer: torch.optim.Optimizer) -> None:
        """In ``optimizer.step()`` a float scalar of unknown value (Adafactor's ``p.norm().item()``)
        reads as :data:`STAND_IN`: it scales the update, not a size. An int or bool still refuses.

        >>> from lightning_seqmem.dryrun.session import fake_session
        >>> with fake_session(8, torch.device("cpu")) as (fake_mode, values), fake_mode, values:
        ...     w = torch.nn.Parameter(torch.empty(4, 4)); w.grad = torch.zeros_like(w)
        ...     values.let_step_read(optimizer := torch.optim.Adafactor([w]))
        ...     optimizer.step()  # reads w.norm().item(), unknown: the stand-in
        >>> sorted(optimizer.state[w])
        ['col_var', 'row_var', 'step']
        """
        optimizer.register_step_pre_hook(lambda *_: setattr(self, "_in_optimizer_step", True))
        optimizer.register_step_post_hook(lambda *_: setattr(self, "_in_optimizer_step", False))

    def can_keep(self, nbytes: int) -> bool:
        """Whether a twin of ``nbytes`` new bytes may be made: within ``max_bytes`` and the room."""
        return nbytes <= self.max_bytes and (self.room is None or self.room.fits(nbytes))

    def give(self, fake: torch.Tensor, value: torch.Tensor) -> None:
        if value.numel() * value.element_size() > self.max_bytes:
            return
        storage = value.untyped_storage()
        key, skey = id(fake), storage._cdata
        self._drop(key)  # its earlier twin (an in-place op gives the same one back)
        if skey not in self._held:
            if self.room is not None and not self.room.take(storage.nbytes()):
                return  # no room for its values: the fake tensor's are unknown
            self._held[skey] = [0, storage.nbytes()]
        self._held[skey][0] += 1
        self._values[key] = (weakref.ref(fake, lambda _, k=key: self._drop(k)), value, skey)

    def _drop(self, key: int) -> None:
        entry = self._values.pop(key, None)
        if entry is None:
            return
        held = self._held.get(entry[2])
        if held is not None:
            held[0] -= 1
            if held[0] <= 0:
                del self._held[entry[2]]
                if self.room is not None:
                    self.room.release(held[1])

    def clear(self) -> None:
        """Drop every twin now (the session ends): their memory is freed at once, not when the
        garbage collector frees the fake tensors' cycles."""
        for key in list(self._values):
            self._drop(key)

    def forget(self, fake: torch.Tensor) -> None:
        """``fake`` was written from unknown values: no view of its storage has known values now."""
        if self._value(fake) is None:
            return  # nothing known there (parameters, gradients, activations): nothing to forget
        self._drop(id(fake))
        storage = fake.untyped_storage()
        key = storage._cdata
        self._unknown_storages[key] = weakref.ref(
            storage, lambda _, k=key: self._unknown_storages.pop(k, None))

    def _value(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        if not isinstance(t, FakeTensor):
            return t
        entry = self._values.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        if self._unknown_storages and t.untyped_storage()._cdata in self._unknown_storages:
            return None
        return entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # an uninitialised tensor (torch.empty: FSDP2's all-gather buffers) has no values: no twin
        # (one of 256 MiB each took address space, untouched, 27 GB of it at 70B)
        known = (getattr(func, "overloadpacket", None) not in _UNINITIALISED
                 and all(self._value(t) is not None for t in _tensors_in(args, kwargs)))
        written = _written_tensors(func, args, kwargs)
        if any(not isinstance(t, FakeTensor) for t in written):
            known = False  # never write to a real tensor
        try:
            out = func(*args, **kwargs)
            computed = True
        except (DataDependentOutputException, DynamicOutputShapeException):
            if (self._in_optimizer_step and func is torch.ops.aten._local_scalar_dense.default
                    and args[0].is_floating_point()):
                return STAND_IN
            if not known or sum(t.numel() * t.element_size()
                                for t in _tensors_in(args, kwargs)) > self.max_bytes:
                raise
            out, computed = None, False
        if known and not self.can_keep(_new_bytes(out, args, kwargs) if computed
                                       else _bound_bytes(args, kwargs)):
            known = False  # no room for its values (on a CPU run the room is the device's)
        if not known or (computed and not _small(out, self.max_bytes)):
            for t in written:
                self.forget(t)  # its values are unknown from now on
            return out
        real_args, real_kwargs = to_host_device(tree_map_only(torch.Tensor, self._value,
                                                              (args, kwargs)))
        if real_kwargs.get("pin_memory"):  # the same values in pageable memory (pinning needs CUDA)
            real_kwargs = {**real_kwargs, "pin_memory": False}
        with _disable_current_modes():
            real = func(*real_args, **real_kwargs)  # in host memory: the device's is the step's
        if not computed:  # the output's shape depends on the values: made on the op's device
            # through the modes below, so that the tracker counts it as the real op's output
            device = next((t.device for t in _tensors_in(args, kwargs)), None)
            out = tree_map_only(torch.Tensor, lambda r: torch.empty_strided(
                r.shape, r.stride(), dtype=r.dtype, device=device or r.device), real)
        for fake, value in zip(tree_flatten(out)[0], tree_flatten(real)[0]):
            if isinstance(fake, FakeTensor) and isinstance(value, torch.Tensor):
                self.give(fake, value)
        return out


@contextlib.contextmanager
def transformers_without_fake_detection() -> Iterator[None]:
    """Let Hugging Face transformers take a real step's shortcuts on fake tensors:
    ``transformers.utils.import_utils.is_tracing`` counts a fake tensor as tracing, skipping the
    shortcuts that read values (SDPA gets an explicit ``[B, 1, L, L]`` causal mask instead of
    ``is_causal=True``: measured +28% on a small Llama at 512 tokens, and a quadratic term a real
    step lacks), so ``is_fake_tensor`` is False meanwhile; :class:`BatchValues` has the values."""
    module = sys.modules.get("transformers.utils.import_utils")
    original = getattr(module, "is_fake_tensor", None)
    if original is None:
        yield
        return
    module.is_fake_tensor = lambda x: False
    try:
        yield
    finally:
        module.is_fake_tensor = original


# -- the batch ------------------------------------------------------------------------------------
def _resize(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` cut, or tiled (repeated whole, then cut), to ``size`` along ``dim``."""
    have = x.shape[dim]
    if have == size:
        return x
    if have > size:
        return x.narrow(dim, 0, size)
    repeats = [1] * x.dim()
    repeats[dim] = math.ceil(size / have)
    return x.repeat(*repeats).narrow(dim, 0, size)


def shape_batch(
    batch: Any, seq_len: int, batch_size: int, fake_mode: FakeTensorMode, values: BatchValues
) -> tuple[Any, tuple[int, int]]:
    """A fake copy of ``batch`` at ``(batch_size, seq_len)``, with the batch's original shape
    ``(B, L)`` (:func:`.batch_shape.infer_batch_shape`). Sequence tensors as in
    :mod:`lightning_seqmem.measure.batch` (``L`` at dim 1 or both last dims). Rows are cut or
    repeated, sequence dims cut or tiled, ``position_ids`` made ``arange(seq_len)``; another length
    (an encoder-decoder's ``labels [B, L/2]``) keeps its ratio to ``L``
    (:func:`.batch_tensors.scaled_length`). Changed tensors are contiguous copies, all values go to
    ``values`` (copied), containers are rebuilt with their type; ``batch`` is untouched. A shorter
    length is cut as the callback cuts (:func:`.batch.cut_batch`: a left-padded batch keeps its
    last tokens, the real ones), so the dry run sees the padding, or none, that the step will."""
    rows, length = source = infer_batch_shape(batch)
    if seq_len < length:
        with contextlib.suppress(TypeError, ValueError):  # else cut below, from the first token
            batch, length = cut_batch(batch, seq_len).batch, seq_len

    def convert(x: torch.Tensor, key: Any) -> torch.Tensor:
        if isinstance(x, FakeTensor):
            fake = x
        else:
            fake = fake_mode.from_tensor(x)
            if values.can_keep(x.numel() * x.element_size()):
                with _disable_current_modes():
                    values.give(fake, x.detach().clone())
        out = fake
        square = is_square(fake, rows, length)
        sequence = (not square and fake.dim() >= 2 and fake.shape[0] in (rows, 1)
                    and fake.shape[1] == length)
        if fake.dim() >= 1 and fake.shape[0] == rows and not (rows == 1 and key == "position_ids"):
            out = _resize(out, 0, batch_size)
        if square:
            out = _resize(_resize(out, -2, seq_len), -1, seq_len)
        elif sequence and key == "position_ids" and not out.dtype.is_floating_point:
            view = [1] * out.dim()
            view[1] = seq_len
            positions = torch.arange(seq_len, dtype=out.dtype, device=out.device).view(view)
            out = positions.expand(out.shape[0], seq_len, *out.shape[2:])
        elif sequence:
            out = _resize(out, 1, seq_len)
        elif not square and (size := scaled_length(fake, rows, length, seq_len)) is not None:
            out = _resize(out, 1, size)  # another length (encoder-decoder labels): its ratio kept
        return out if out is fake else out.clone(memory_format=torch.contiguous_format)

    with fake_mode, values:
        return map_tensors(batch, lambda x, key, _: convert(x, key), False), source


def batch_to_device(obj: Any, device: torch.device) -> Any:
    """``obj``, its tensors on ``device``: mutable containers changed in place, others rebuilt."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, MutableMapping):
        for k in list(obj):
            obj[k] = batch_to_device(obj[k], device)
        return obj
    if isinstance(obj, list):
        return [batch_to_device(v, device) for v in obj]
    if isinstance(obj, tuple):
        parts = [batch_to_device(v, device) for v in obj]
        return type(obj)(*parts) if hasattr(obj, "_fields") else type(obj)(parts)
    return obj
