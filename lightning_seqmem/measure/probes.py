"""Memory probes: what one training step really used, phase by phase.

Two probes share one interface (:class:`MemoryProbe`): ``start_step`` at batch start,
``mark_phase`` when the step moves from forward to backward to the optimizer step, ``end_step``
at batch end, which returns a :class:`StepMemory`.

* :class:`CudaAllocatorProbe` reads the CUDA caching allocator's counters. The peak is reset at
  every phase boundary, so each phase gets its own peak; reserved memory, fragmentation, inactive
  split blocks, allocator retries and OOMs come from ``torch.cuda.memory_stats``. It costs a few
  microseconds per step.
* :class:`TrackerProbe` works on any device (and is the only choice on CPU, whose memory cannot be
  read from an allocator): a :class:`LiveTensorTracker` — a ``TorchDispatchMode`` that sees every
  storage an op creates and registers a weakref finaliser on it — gives exact live tensor bytes,
  counting the parameters, buffers, gradients, optimizer state and batch tensors that existed
  before the step. With ``record_events=True`` it also keeps the ordered allocation/free sequence
  that :mod:`lightning_seqmem.core.timeline` replays at other lengths.

Bytes everywhere; conversion to GiB happens only where numbers are shown.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from lightning_seqmem.core.records import PHASES, StepMemory, TrackedEvents
from lightning_seqmem.measure.mode_stack import enter_below_user_modes, exit_own_mode, modes_below

"""Phases of a training step, in order: batch start → before backward → before optimizer step → batch end."""

PROBE_NAMES = ("auto", "cuda", "tracker")
"""Accepted values of ``SeqMemCallback(probe=...)``."""

_CUDA_BLOCK_BYTES = 512  # the CUDA caching allocator rounds every block up to 512 bytes




_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _flat_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in an op's output or arguments (fast path for the usual shapes)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)) and all(isinstance(x, torch.Tensor) or x is None for x in obj):
        return [x for x in obj if x is not None]
    return [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]


def tensor_storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding ``t``'s data (a wrapper subclass's inner tensors' too; none for meta or sparse)."""
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


def _is_fake(t: torch.Tensor) -> bool:
    """A ``FakeTensor`` (its storage is on ``meta`` whatever device it reports)."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def _fake_mode_active() -> bool:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())


class _Transient:
    """A placeholder for a scratch allocation's slot (dead at once: nothing to watch)."""


_RESIZE_WATCHERS: list["LiveTensorTracker"] = []  # trackers entered now, told of every storage resize
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
    """``torch.UntypedStorage.resize_`` is not a tensor op (no dispatch mode sees it), so while a
    tracker is entered it is wrapped to tell the tracker (as ``torch.distributed._tools.MemTracker``
    does); the original comes back when the last tracker leaves."""
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

    Storages that existed before tracking began are counted only if passed to
    :meth:`track_existing` (parameters, gradients, optimizer state, the batch). A storage shared
    with an op's input (a view, an in-place op) is not a new allocation.

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
        self._active = True
        self.error: Optional[BaseException] = None  # a bookkeeping failure: the step ran, the count is void
        # (op, args, out) -> bytes a kernel takes for itself while it runs (a dry run of CUDA, see
        # dryrun.cuda_kernel_scratch_bytes); counted as allocated and freed right after the output
        self.scratch: Optional[Callable[[Any, Any, Any], int]] = None

    # -- bookkeeping ---------------------------------------------------------------------------
    def _add(self, st: torch.UntypedStorage, op: str, nbytes: Optional[int] = None) -> None:
        nbytes = st.nbytes() if nbytes is None else nbytes
        index = len(self._finalizers)
        key = st._cdata
        self._ids[key] = index
        self._sizes[key] = nbytes
        self._finalizers.append(weakref.ref(st, lambda _ref, i=index, k=key: self._free(i, k)))
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        if self.phase is not None and self.live_bytes > self.phase_peak_bytes[self.phase]:
            self.phase_peak_bytes[self.phase] = self.live_bytes
        if self.events is not None:
            self.events.sizes.append(nbytes)
            self.events.ops.append(op)
            self.events.sequence.append(index)

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
        """``st.resize_(nbytes)`` ran: free its entry and count it again at its new size.

        FSDP2 keeps each block's unsharded parameters in storages it resizes to 0 after the block
        ran and back before it runs again (``free_storage`` / ``alloc_storage``), which no dispatch
        mode sees; storages it grows from 0 are counted from then on, whenever they were created.
        """
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
            return  # another device's storage (a fake tensor's storage is on "meta": known by its key above)
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
            if not fakes and _is_fake(t):
                continue
            for st in tensor_storages(t):
                if st._cdata not in self._ids:
                    self._add(st, f"<{kind}>")
        if self.events is not None:
            self.events.num_existing = len(self.events.sizes)

    def mark_phase(self, phase: str) -> None:
        """Start a new phase: its peak starts from the bytes live now."""
        self.phase = phase
        self.phase_peak_bytes[phase] = max(self.phase_peak_bytes.get(phase, 0), self.live_bytes)
        if self.events is not None:
            self.events.phase_starts[phase] = len(self.events.sequence)

    def stop(self) -> None:
        """Ignore frees from now on (storages of this step die later, during the next one).

        The weak references (and their callbacks, which hold this tracker) are dropped at once,
        not left to the garbage collector: a stopped tracker reaches no storage, neither the
        training's real ones nor a dry run's fake (meta) ones, whenever it is collected.
        """
        self._active = False
        self._finalizers.clear()
        self._ids.clear()
        self._sizes.clear()
        self._resized_to_zero.clear()

    # -- dispatch --------------------------------------------------------------------------------
    def __enter__(self):
        _watch_resizes(self, True)
        self._below = modes_below()
        # a tracker entered under a FakeTensorMode counts fake storages (a dry run's); others skip them
        self._counts_fakes = any(isinstance(m, FakeTensorMode) for m, _ in self._below)
        # under other tools' modes held now (so that they leave first without popping this one),
        # above another tracker (a second SeqMemCallback's)
        return enter_below_user_modes(self, lambda: super(LiveTensorTracker, self).__enter__(),
                                      stop_at=lambda m: isinstance(m, LiveTensorTracker))

    def __exit__(self, *exc_info):
        """Leave this mode only, wherever it is on the stack: another callback's mode entered after
        it (or before it, and left first) is never popped in its place (:mod:`.mode_stack`)."""
        _watch_resizes(self, False)
        exit_own_mode(self, lambda: super(LiveTensorTracker, self).__exit__(*exc_info), getattr(self, "_below", []))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.error is None:
            try:
                self._track_outputs(func, out, args, kwargs)
                if self.scratch is not None:
                    self._transient(self.scratch(func, args, out), func.name())
            except Exception as exc:  # noqa: BLE001 - the op's result must reach the model regardless
                self.error = exc
        return out

    def _transient(self, nbytes: int, op: str) -> None:
        """An allocation of ``nbytes`` freed at once (a kernel's own scratch, beside its output)."""
        if nbytes <= 0:
            return
        index = len(self._finalizers)
        self._finalizers.append(weakref.ref(_Transient()))  # keeps indices aligned with events
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if self.phase is not None:
            self.phase_peak_bytes[self.phase] = max(self.phase_peak_bytes[self.phase], self.live_bytes)
        self.live_bytes -= nbytes
        if self.events is not None:
            self.events.sizes.append(nbytes)
            self.events.ops.append(f"{op} (scratch)")
            self.events.sequence.extend((index, ~index))

    def _track_outputs(self, func, out, args, kwargs) -> None:
        inputs: Optional[set[int]] = None
        for t in _flat_tensors(out):
            if t.device.type != self.device_type:
                continue
            if not self._counts_fakes and isinstance(t, FakeTensor):
                continue  # another callback's dry run inside this step's window: not this step's memory
            for st in tensor_storages(t):
                key = st._cdata
                if key in self._ids:
                    continue
                if inputs is None:  # only built when an output storage is new to us
                    tensors = _flat_tensors(args) + (_flat_tensors(kwargs) if kwargs else [])
                    inputs = {s._cdata for x in tensors for s in tensor_storages(x)}
                if key in inputs:  # a view or in-place result of an untracked input
                    continue
                self._add(st, func.name() if self.events is not None else "")


class MemoryProbe:
    """Interface of a per-step memory probe (see the module docstring)."""

    name = "abstract"

    def start_step(self, existing: Iterable[torch.Tensor], record_events: bool = False) -> None:
        raise NotImplementedError

    def mark_phase(self, phase: str) -> None:
        raise NotImplementedError

    def end_step(self) -> StepMemory:
        raise NotImplementedError

    def abort(self) -> None:
        """Leave any global state (dispatch modes) after an exception; never raises."""

    @property
    def running(self) -> bool:
        return False


class _EagerStance:
    """``torch.compiler.set_stance("force_eager")`` while any tracked step holds it.

    Under a ``TorchDispatchMode`` dynamo does not compile, and marks the code it was asked to
    compile to be skipped from then on: one tracked step would leave a compiled module eager for the
    rest of the run. With the ``"force_eager"`` stance dynamo is not asked, so the steps the tracker
    does not watch run compiled. Holders are counted (probes may overlap and end in any order: a
    dry run's fake step, the CUDA probe's tracer); the stance before the first holder comes back
    when the last one lets go, or when an abandoned probe is collected.
    """

    holders = 0
    saved: Any = None

    @classmethod
    def hold(cls) -> bool:
        if cls.holders == 0:
            try:
                cls.saved = torch.compiler.set_stance("force_eager")
            except Exception:  # noqa: BLE001 - an older torch, or inside a compiled region: nothing to protect
                return False
        cls.holders += 1
        return True

    @classmethod
    def release(cls) -> None:
        if cls.holders <= 0:
            return
        cls.holders -= 1
        if cls.holders == 0:
            saved, cls.saved = cls.saved, None
            try:
                saved.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - never raises
                pass


class TrackerProbe(MemoryProbe):
    """Per-step peaks from a :class:`LiveTensorTracker`; works on any device.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(32, 32)
        >>> probe = TrackerProbe("cpu")
        >>> probe.start_step(list(model.parameters()))
        >>> probe.mark_phase("forward")
        >>> loss = model(torch.randn(8, 32)).square().mean()
        >>> probe.mark_phase("backward")
        >>> loss.backward()
        >>> m = probe.end_step()
        >>> m.phase_peak_bytes["backward"] >= m.phase_peak_bytes["forward"] > m.start_bytes > 0
        True
    """

    name = "tracker"

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = device_type
        self._tracker: Optional[LiveTensorTracker] = None
        self.scratch: Optional[Callable[[Any, Any, Any], int]] = None  # see LiveTensorTracker.scratch
        self._stance: Any = None

    @property
    def running(self) -> bool:
        return self._tracker is not None

    def start_step(self, existing: Iterable[torch.Tensor], record_events: bool = False) -> None:
        self.abort()
        tracker = LiveTensorTracker(self.device_type, record_events=record_events)
        tracker.scratch = self.scratch
        tracker.track_existing(existing)
        self._start_bytes = tracker.live_bytes
        if _EagerStance.hold():  # a tracked step runs eager; the others stay compiled
            self._stance = weakref.finalize(self, _EagerStance.release)  # released once, by end, abort or GC
        tracker.__enter__()
        self._tracker = tracker

    def mark_phase(self, phase: str) -> None:
        if self._tracker is not None:
            self._tracker.mark_phase(phase)

    def end_step(self) -> StepMemory:
        tracker = self._tracker
        if tracker is None:
            raise RuntimeError("end_step() called without start_step()")
        self._tracker = None
        tracker.__exit__(None, None, None)
        tracker.stop()
        self._stance, stance = None, self._stance
        if stance is not None:
            stance()
        if tracker.error is not None:
            raise RuntimeError(f"the live-tensor tracker failed during the step: {tracker.error!r}") from tracker.error
        return StepMemory(
            peak_bytes=tracker.peak_bytes,
            phase_peak_bytes=dict(tracker.phase_peak_bytes),
            start_bytes=self._start_bytes,
            end_bytes=tracker.live_bytes,
            events=tracker.events,
        )

    def abort(self) -> None:
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            try:
                tracker.__exit__(None, None, None)
            except Exception:  # the mode stack was already unwound by someone else
                pass
            tracker.stop()
        self._stance, stance = None, self._stance
        if stance is not None:
            stance()


class CudaAllocatorProbe(MemoryProbe):
    """Per-phase peaks from the CUDA caching allocator's counters.

    ``reserved_bytes`` is the step's peak reserved memory; ``fragmentation_bytes`` is that minus the
    step's peak allocated (memory the allocator holds that no tensor used even at the peak; the two
    peaks may come from different moments), and ``fragmentation_fraction`` that over reserved.
    With ``record_events=True`` a :class:`LiveTensorTracker` runs alongside, for the timeline replay.

    Note: the probe resets the device's peak counters (``torch.cuda.reset_peak_memory_stats``) at
    every step and phase boundary, so other code reading ``torch.cuda.max_memory_allocated()``
    sees the peak since the last boundary only.
    """

    name = "cuda"

    def __init__(self, device: torch.device | int | str | None = None) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        self._tracker_probe = TrackerProbe("cuda")
        self._phase: Optional[str] = None
        self._phase_peaks: dict[str, int] = {}
        self._max_reserved = 0
        self._running = False

    @property
    def running(self) -> bool:
        return self._running

    def _close_phase(self) -> None:
        if self._phase is not None:
            peak = torch.cuda.max_memory_allocated(self.device)
            self._phase_peaks[self._phase] = max(self._phase_peaks.get(self._phase, 0), peak)
            self._max_reserved = max(self._max_reserved, torch.cuda.max_memory_reserved(self.device))

    def start_step(self, existing: Iterable[torch.Tensor], record_events: bool = False) -> None:
        self.abort()
        self._phase, self._phase_peaks, self._max_reserved = None, {}, 0
        self._start_bytes = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        if record_events:
            self._tracker_probe.start_step(existing, record_events=True)
        self._running = True

    def mark_phase(self, phase: str) -> None:
        self._close_phase()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._phase = phase
        self._tracker_probe.mark_phase(phase)

    def end_step(self) -> StepMemory:
        if not self._running:
            raise RuntimeError("end_step() called without start_step()")
        self._running = False
        self._close_phase()
        events = self._tracker_probe.end_step().events if self._tracker_probe.running else None
        stats = torch.cuda.memory_stats(self.device)
        if not self._phase_peaks:  # no phase was marked: the whole step is one phase
            self._phase_peaks["forward"] = torch.cuda.max_memory_allocated(self.device)
        peak = max(self._phase_peaks.values())
        reserved = max(self._max_reserved, torch.cuda.memory_reserved(self.device))
        fragmentation = max(reserved - peak, 0)
        return StepMemory(
            peak_bytes=peak,
            phase_peak_bytes=dict(self._phase_peaks),
            start_bytes=self._start_bytes,
            end_bytes=torch.cuda.memory_allocated(self.device),
            reserved_bytes=reserved,
            fragmentation_bytes=fragmentation,
            fragmentation_fraction=fragmentation / reserved if reserved else 0.0,
            inactive_split_bytes=int(stats.get("inactive_split_bytes.all.current", 0)),
            alloc_retries=int(stats.get("num_alloc_retries", 0)),
            num_ooms=int(stats.get("num_ooms", 0)),
            events=events,
        )

    def abort(self) -> None:
        self._running = False
        self._tracker_probe.abort()


_NOT_ATTRIBUTES = frozenset({"_parameters", "_buffers", "_modules", "_trainer", "_fabric"})  # walked elsewhere, or not the module's


def attribute_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Tensors held as plain attributes of ``model`` or of its submodules (neither parameters nor
    buffers): caches such as Lightning's demo ``PositionalEncoding.pe`` or ``Transformer.src_mask``,
    directly or in a list, tuple or dict attribute (one level deep). Device memory all the same.

    Example:
        >>> lin = torch.nn.Linear(4, 4)
        >>> lin.cache, lin.pair = torch.ones(3), (torch.zeros(2), None)
        >>> [tuple(t.shape) for t in attribute_tensors(torch.nn.Sequential(lin))]
        [(3,), (2,)]
    """
    out: list[torch.Tensor] = []
    for module in model.modules():
        for name, value in vars(module).items():
            if name in _NOT_ATTRIBUTES:
                continue
            if isinstance(value, torch.Tensor):
                out.append(value)
            elif isinstance(value, (list, tuple)):
                out += [v for v in value if isinstance(v, torch.Tensor)]
            elif isinstance(value, dict) and not name.endswith("hooks"):
                out += [v for v in value.values() if isinstance(v, torch.Tensor)]
    return out


def existing_tensors(model: torch.nn.Module, optimizers: Iterable[Any], batch: Any) -> list[torch.Tensor]:
    """Tensors alive before a training step: parameters, buffers, tensors held as module attributes
    (:func:`attribute_tensors`), gradients, optimizer state, batch.

    Example:
        >>> lin = torch.nn.Linear(4, 4)
        >>> len(existing_tensors(lin, [torch.optim.SGD(lin.parameters(), lr=0.1)], {"x": torch.ones(2, 4)}))
        3
    """
    out: list[torch.Tensor] = list(model.parameters()) + list(model.buffers()) + attribute_tensors(model)
    out += [p.grad for p in model.parameters() if p.grad is not None]
    for optimizer in optimizers:
        for state in optimizer.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    out += _flat_tensors(batch)
    return out


def round_cuda_block_bytes(nbytes: int) -> int:
    """Round a size up to the CUDA caching allocator's 512-byte block (what it counts as allocated).

    Example:
        >>> round_cuda_block_bytes(1), round_cuda_block_bytes(512), round_cuda_block_bytes(513)
        (512, 512, 1024)
    """
    return -(-nbytes // _CUDA_BLOCK_BYTES) * _CUDA_BLOCK_BYTES


def make_probe(name: str, device: torch.device) -> MemoryProbe:
    """The probe for ``SeqMemCallback(probe=name)`` on ``device``.

    ``"auto"`` is the allocator probe on CUDA and the tracker elsewhere.

    Example:
        >>> make_probe("auto", torch.device("cpu")).name
        'tracker'
    """
    if name not in PROBE_NAMES:
        raise ValueError(f"`probe` must be one of {PROBE_NAMES}, got {name!r}")
    if name == "cuda" or (name == "auto" and device.type == "cuda"):
        if device.type != "cuda":
            raise ValueError(
                f"`probe='cuda'` needs the model on a CUDA device, but it is on {device}; "
                "use probe='tracker' or 'auto'"
            )
        return CudaAllocatorProbe(device)
    return TrackerProbe(device.type)
