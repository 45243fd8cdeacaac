"""The live-tensor tracker: a ``TorchDispatchMode`` that sees every storage an op creates,
registers a weakref finaliser on it and so knows the live bytes at every moment (exact on any
device); it also sees storage resizes (FSDP2) and, with ``record_events``, keeps the ordered
allocation/free sequence the timeline replays. Wrapped by :mod:`lightning_seqmem.measure.probes`."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, is_fake as torch_is_fake
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from lightning_seqmem.core.records import TrackedEvents
from lightning_seqmem.measure.mode_stack import (enter_below_user_modes, exit_own_mode, modes_below,
                                                 stack)


__all__ = ["PINNED", "LiveTensorTracker", "flat_tensors", "is_fake", "tensor_storages"]

PINNED = " (pinned)"
"""Appended to the op name (``TrackedEvents.ops``) of an allocation the ``pinned`` hook calls
page-locked host memory: the event keeps the tensor's bytes, the reader rounds them as the host
allocator does."""


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def flat_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in an op's output or arguments, or a batch (fast path for the usual shapes).

    >>> [t.shape for t in flat_tensors((torch.zeros(2), None, {"x": torch.ones(3)}))]
    [torch.Size([2]), torch.Size([3])]
    """
    if isinstance(obj, torch.Tensor):
        return [obj]
    if (isinstance(obj, (tuple, list))
            and all(isinstance(x, torch.Tensor) or x is None for x in obj)):
        return [x for x in obj if x is not None]
    return [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]


def tensor_storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages of ``t`` (a wrapper subclass: its inner tensors'; none for meta or sparse)."""
    if type(t) in _PLAIN_TENSORS:
        if t.layout != torch.strided or t.device.type == "meta":
            return []
        return [t.untyped_storage()]
    if is_traceable_wrapper_subclass(t):
        inner_names, _ = t.__tensor_flatten__()
        out: list[torch.UntypedStorage] = []
        for name in inner_names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                out.extend(tensor_storages(inner))
        return out
    if t.is_sparse or t.layout != torch.strided or t.device.type == "meta":
        return []
    return [t.untyped_storage()]


def is_fake(t: torch.Tensor) -> bool:
    """A ``FakeTensor`` (its storage on ``meta``, whatever its device): counted as no bytes.

    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode():
    ...     fake = torch.zeros(2)
    >>> is_fake(fake), is_fake(torch.zeros(2))
    (True, False)
    """
    return torch_is_fake(t)


def _fake_mode_active() -> bool:
    return any(isinstance(m, FakeTensorMode) for m in stack())


class _Transient:
    """A placeholder for a scratch allocation's slot (dead at once: nothing to watch)."""


_RESIZE_WATCHERS: list["LiveTensorTracker"] = []  # trackers entered now, told of every resize
_ORIGINAL_RESIZE = torch.UntypedStorage.resize_


def _resize_and_tell(storage: torch.UntypedStorage, size: int) -> Any:
    out = _ORIGINAL_RESIZE(storage, size)
    for tracker in list(_RESIZE_WATCHERS):
        try:
            tracker._resized(storage, int(storage.nbytes()))
        except Exception as exc:  # noqa: BLE001 - the resize itself must succeed regardless
            tracker.error = exc
    return out


def _watch_resizes(tracker: "LiveTensorTracker", on: bool) -> None:
    """``torch.UntypedStorage.resize_`` is not a tensor op (no dispatch mode sees it): wrapped to
    tell an entered tracker (as ``torch.distributed._tools.MemTracker`` does)."""
    if on:
        _RESIZE_WATCHERS.append(tracker)
        torch.UntypedStorage.resize_ = _resize_and_tell  # type: ignore[method-assign]
    else:
        if tracker in _RESIZE_WATCHERS:
            _RESIZE_WATCHERS.remove(tracker)
        if not _RESIZE_WATCHERS:
            torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE  # type: ignore[method-assign]


class LiveTensorTracker(TorchDispatchMode):
    """Exact live tensor bytes on one device type, by watching every storage an op creates.

    Storages alive before tracking began count only if passed to :meth:`track_existing`; a storage
    shared with an op's input (a view, an in-place op) is not a new allocation.

    Example:
        >>> import torch
        >>> w = torch.randn(64, 64, requires_grad=True)
        >>> tracker = LiveTensorTracker("cpu")
        >>> tracker.track_existing([w])
        >>> with tracker:
        ...     y = (w @ w).relu().sum()
        ...     y.backward()
        >>> tracker.peak_bytes >= 3 * 64 * 64 * 4   # w, w @ w and w.grad at least
        True
    """

    def __init__(self, device_type: str, record_events: bool = False) -> None:
        super().__init__()
        self.device_type = device_type
        self.record_events = record_events
        self.live_bytes = 0
        self.peak_bytes = 0
        self._counts_fakes = True  # set on entering (see __enter__)
        self.phase_peak_bytes: dict[str, int] = {}
        self.phase: Optional[str] = None
        self.events = TrackedEvents() if record_events else None
        self._ids: dict[int, int] = {}  # StorageImpl address -> allocation index, while alive
        self._sizes: dict[int, int] = {}  # StorageImpl address -> bytes counted for it now
        self._resized_to_zero: set[int] = set()  # tracked storages resized to 0 bytes, still alive
        self._finalizers: list[weakref.ref] = []
        self._left: dict[int, tuple[int, weakref.ref]] = {}  # track_left's: address -> bytes, ref
        self.not_left: set[int] = set()  # allocations counted elsewhere once alive (left_alive)
        self.left_bytes = 0  # of track_left's storages, alive now
        self.peak_left_bytes = 0  # of those, alive at the peak
        self._resident: list[tuple[int, int]] = []  # (index, bytes) of track_bytes' counts
        self._active = True
        self.error: Optional[BaseException] = None  # bookkeeping failed: the count is void
        # (op, args, out) -> bytes a kernel takes for itself while it runs (a dry run of CUDA, see
        # dryrun.cuda_kernel_scratch_bytes), counted as allocated and freed right after the output
        self.scratch: Optional[Callable[[Any, Any, Any], int]] = None
        # (storage, op or None, args, kwargs) -> whether a new storage is pinned host memory (op
        # None: alive before tracking); its event's op name then ends with PINNED (dryrun.host)
        self.pinned: Optional[Callable[[torch.UntypedStorage, Any, Any, Any], bool]] = None

    # -- bookkeeping ---------------------------------------------------------------------------
    def _add(self, st: torch.UntypedStorage, op: str, nbytes: Optional[int] = None) -> None:
        nbytes = st.nbytes() if nbytes is None else nbytes
        index = len(self._finalizers)  # the one _count gives it
        key = st._cdata
        self._ids[key] = index
        self._sizes[key] = nbytes
        self._count(nbytes, op, weakref.ref(st, lambda _ref, i=index, k=key: self._free(i, k)))

    def _count(self, nbytes: int, op: str, finalizer: Optional[weakref.ref] = None) -> int:
        """Count a new allocation of ``nbytes`` made by ``op`` (the live bytes, the peaks, the
        event); returns its index. ``finalizer``: its storage's; bytes no storage holds get a
        placeholder (it keeps indices aligned with events)."""
        index = len(self._finalizers)
        self._finalizers.append(finalizer if finalizer is not None else weakref.ref(_Transient()))
        self._live(nbytes)
        if self.events is not None:
            self.events.sizes.append(nbytes)
            self.events.ops.append(op)
            self.events.sequence.append(index)
        return index

    def _live(self, nbytes: int) -> None:
        """``nbytes`` more are alive: the peaks follow."""
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_left_bytes = self.live_bytes, self.left_bytes
        if self.phase is not None and self.live_bytes > self.phase_peak_bytes[self.phase]:
            self.phase_peak_bytes[self.phase] = self.live_bytes

    def _free(self, index: int, key: int) -> None:
        self._resized_to_zero.discard(key)  # the storage died: its address may be reused
        if self._ids.get(key) != index:
            return  # resized since (that entry was already freed) or untracked
        del self._ids[key]  # the address may be reused by a later storage
        nbytes = self._sizes.pop(key)
        if not self._active:
            return
        self.live_bytes -= nbytes
        if self.events is not None:
            self.events.sequence.append(~index)

    def _resized(self, st: torch.UntypedStorage, nbytes: int) -> None:
        """``st.resize_(nbytes)`` ran: free its entry and count it again at its new size (FSDP2
        resizes each block's unsharded parameters to 0 after it ran and back before it runs again;
        a storage grown from 0 is counted from then on, whenever it was created)."""
        if not self._active or self.error is not None:
            return
        key = st._cdata
        index = self._ids.get(key)
        if index is not None:
            if self._sizes[key] == nbytes:
                return
            del self._ids[key]
            self.live_bytes -= self._sizes.pop(key)
            if self.events is not None:
                self.events.sequence.append(~index)
            if nbytes == 0:
                self._resized_to_zero.add(key)
        elif key not in self._resized_to_zero and st.device.type != self.device_type:
            return  # another device's storage (a fake one's is on "meta": known by its key above)
        if nbytes > 0:
            self._resized_to_zero.discard(key)
            self._add(st, "<resize_>", nbytes)

    def track_existing(self, tensors: Iterable[Any], kind: str = "existing") -> None:
        """Count storages that were alive before tracking (each storage once). Fake tensors count
        only where a ``FakeTensorMode`` is active (a dry run): elsewhere they hold no memory."""
        fakes = _fake_mode_active()
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
                continue
            if not fakes and is_fake(t):
                continue
            for st in tensor_storages(t):
                if st._cdata not in self._ids:
                    self._add(st, f"<{kind}>" + (PINNED if self.pinned
                                                 and self.pinned(st, None, (), {}) else ""))
        if self.events is not None:
            self.events.num_existing = len(self.events.sizes)

    def track_left(self, storages: Iterable[weakref.ref]) -> None:
        """Count the storages earlier steps allocated and left alive (:meth:`left_alive`), not
        counted yet (another callback's kept outputs; a GPU's allocator counts them): in the live
        bytes till freed, not in the events (no part of the step's program, which a replay scales).

        >>> kept, tracker = torch.ones(4), LiveTensorTracker("cpu")
        >>> tracker.track_left([weakref.ref(kept.untyped_storage())])
        >>> before = tracker.live_bytes; del kept; before, tracker.live_bytes
        (16, 0)
        """
        for ref in storages:
            st = ref()
            if st is None or st._cdata in self._ids or st._cdata in self._left:
                continue
            key, nbytes = st._cdata, st.nbytes()
            self._left[key] = (nbytes, weakref.ref(st, lambda _ref, k=key: self._free_left(k)))
            self.left_bytes += nbytes
            self._live(nbytes)

    def _free_left(self, key: int) -> None:
        entry = self._left.pop(key, None)
        if entry is not None and self._active:
            self.live_bytes -= entry[0]
            self.left_bytes -= entry[0]

    @property
    def allocations(self) -> int:
        """How many allocations were counted so far (the next one's index)."""
        return len(self._finalizers)

    def left_alive(self, since: int = 0) -> list[weakref.ref]:
        """Weak references to the storages still alive that this step allocated (from allocation
        ``since`` on) or was left (:meth:`track_left`), for the next step's :meth:`track_left`."""
        alive = [ref() for _, ref in self._left.values()]
        alive += [self._finalizers[i]() for i in self._ids.values()
                  if i >= since and i not in self.not_left]
        return [weakref.ref(st) for st in alive if st is not None]

    def track_bytes(self, nbytes: int, kind: str = "resident") -> None:
        """Count ``nbytes`` held for the whole step by no tensor this tracker can see (a distributed
        strategy's gradient buckets, allocated in C++ before the step): alive, never freed.

        >>> tracker = LiveTensorTracker("cpu")
        >>> tracker.track_bytes(4096)
        >>> tracker.live_bytes, tracker.peak_bytes
        (4096, 4096)
        """
        if nbytes <= 0:
            return
        self._resident.append((self._count(int(nbytes), f"<{kind}>"), int(nbytes)))
        if self.events is not None:
            self.events.num_existing = len(self.events.sizes)

    def release_bytes(self) -> None:
        """Free what :meth:`track_bytes` counted first: its holder freed it unseen."""
        if self._resident and self._active:
            index, nbytes = self._resident.pop(0)
            self.live_bytes -= nbytes
            if self.events is not None:
                self.events.sequence.append(~index)

    def mark_phase(self, phase: str) -> None:
        """Start a new phase: its peak starts from the bytes live now."""
        self.phase = phase
        self.phase_peak_bytes[phase] = max(self.phase_peak_bytes.get(phase, 0), self.live_bytes)
        if self.events is not None:
            self.events.phase_starts[phase] = len(self.events.sequence)

    def stop(self) -> None:
        """Ignore frees from now on (storages of this step die later, during the next one). The
        weak references (whose callbacks hold this tracker) are dropped at once: a stopped tracker
        reaches no storage, real or fake, whenever it is collected."""
        self._active = False
        self._finalizers.clear()
        self._left.clear()
        self._ids.clear()
        self._sizes.clear()
        self._resized_to_zero.clear()

    # -- dispatch --------------------------------------------------------------------------------
    def __enter__(self):
        _watch_resizes(self, True)
        self._below = modes_below()
        # a tracker entered under a FakeTensorMode counts fake storages (a dry run's); others not
        self._counts_fakes = any(isinstance(m, FakeTensorMode) for m, _ in self._below)
        # under other tools' modes held now (so that they leave first without popping this one),
        # above another tracker (a second SeqMemCallback's)
        return enter_below_user_modes(self, lambda: super(LiveTensorTracker, self).__enter__(),
                                      stop_at=lambda m: isinstance(m, LiveTensorTracker))

    def __exit__(self, *exc_info):
        """Leave this mode only, wherever it is on the stack: another callback's mode entered after
        it (or before it, and left first) is never popped in its place (:mod:`.mode_stack`)."""
        _watch_resizes(self, False)
        exit_own_mode(self, lambda: super(LiveTensorTracker, self).__exit__(*exc_info),
                      getattr(self, "_below", []))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.error is None:
            try:
                self._track_outputs(func, out, args, kwargs)
                if self.scratch is not None:
                    self._transient(self.scratch(func, args, out), func.name())
            except Exception as exc:  # noqa: BLE001 - the op's result must reach the model
                self.error = exc
        return out

    def _transient(self, nbytes: int, op: str) -> None:
        """An allocation of ``nbytes`` freed at once (a kernel's own scratch, beside its output)."""
        if nbytes <= 0:
            return
        index = self._count(nbytes, f"{op} (scratch)")
        self.live_bytes -= nbytes
        if self.events is not None:
            self.events.sequence.append(~index)

    def _track_outputs(self, func, out, args, kwargs) -> None:
        inputs: Optional[set[int]] = None
        for t in flat_tensors(out):
            if t.device.type != self.device_type:
                continue
            if not self._counts_fakes and isinstance(t, FakeTensor):
                continue  # another callback's dry run inside this step: not this step's memory
            for st in tensor_storages(t):
                key = st._cdata
                if key in self._ids or key in self._left:
                    continue
                if inputs is None:  # only built when an output storage is new to us
                    tensors = flat_tensors(args) + (flat_tensors(kwargs) if kwargs else [])
                    inputs = {s._cdata for x in tensors for s in tensor_storages(x)}
                if key in inputs:  # a view or in-place result of an untracked input
                    continue
                name = func.name() if self.events is not None else ""
                if self.pinned is not None and self.pinned(st, func, args, kwargs or {}):
                    name += PINNED
                self._add(st, name)
