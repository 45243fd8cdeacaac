"""Memory probes: what one training step really used, phase by phase.

A :class:`MemoryProbe`'s ``start_step`` runs at batch start, ``mark_phase`` at each phase boundary
(forward, backward, optimizer), ``end_step`` at batch end, returning a :class:`StepMemory` (bytes).
:class:`CudaAllocatorProbe` reads the CUDA caching allocator (a few microseconds per step);
:class:`TrackerProbe` works on any device: exact live tensor bytes (pre-step ones too) and, with
``record_events=True``, the allocation/free events :mod:`lightning_seqmem.core.timeline` replays."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterable, Optional

import torch

from lightning_seqmem.core.checks import check_choice
from lightning_seqmem.core.config import PROBE_NAMES  # (checked with the other arguments, in core)
from lightning_seqmem.core.records import StepMemory
from lightning_seqmem.measure.tracker import LiveTensorTracker, flat_tensors

__all__ = ["CudaAllocatorProbe", "DeviceAndHostProbe", "MemoryProbe", "optimizer_held_tensors",
           "TrackerProbe", "attribute_tensors", "existing_tensors", "make_probe",
           "round_cuda_block_bytes"]


_CUDA_BLOCK_BYTES = 512  # the CUDA caching allocator rounds every block up to 512 bytes
_NOT_STARTED = "end_step() called without start_step()"


class MemoryProbe:
    """Interface of a per-step memory probe (see the module docstring)."""

    name = "abstract"
    # whether each step counts what earlier steps allocated and left alive (the callback's probe:
    # the steps of one run; an allocator's counters always do, a dry run's steps are of copies)
    carries = False
    left_at_peak_bytes = 0  # of those, alive at the last step's peak (0 where not carried)

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
    """``torch.compiler.set_stance("force_eager")`` while any tracked step holds it: under a
    ``TorchDispatchMode`` dynamo skips the code for good, so one tracked step would leave a compiled
    module eager; with the stance dynamo is not asked. Holders are counted (probes may overlap); the
    earlier stance comes back when the last lets go or an abandoned probe is collected."""

    holders = 0
    saved: Any = None

    @classmethod
    def hold(cls) -> bool:
        if cls.holders == 0:
            try:
                cls.saved = torch.compiler.set_stance("force_eager")
            except Exception:  # noqa: BLE001 - older torch, or in a compiled region: nothing to do
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
            with contextlib.suppress(Exception):  # never raises
                saved.__exit__(None, None, None)


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
        self.scratch: Optional[Callable[[Any, Any, Any], int]] = None  # LiveTensorTracker.scratch
        self.pinned: Optional[Callable[..., bool]] = None  # see LiveTensorTracker.pinned
        self._stance: Any = None
        self._left: list[weakref.ref] = []  # weak references to those storages
        self._first_new = 0  # the tracker's first allocation not among the step's existing

    @property
    def running(self) -> bool:
        return self._tracker is not None

    def left_storages(self) -> list[torch.UntypedStorage]:
        """The storages earlier steps allocated and left alive, which the next step counts where
        they are not among its existing tensors (its gradients and optimizer state may be)."""
        return [st for st in (ref() for ref in self._left) if st is not None]

    def start_step(self, existing: Iterable[torch.Tensor], record_events: bool = False,
                   resident_bytes: int = 0) -> None:
        """Start the step on the ``existing`` tensors plus ``resident_bytes`` held by none."""
        self.abort()
        tracker = LiveTensorTracker(self.device_type, record_events=record_events)
        tracker.scratch, tracker.pinned = self.scratch, self.pinned
        tracker.track_existing(existing)
        self._first_new = tracker.allocations
        if self.carries:
            tracker.track_left(self._left)
        self._left = []
        tracker.track_bytes(resident_bytes)
        self._start_bytes = tracker.live_bytes
        if _EagerStance.hold():  # released once, by end, abort or GC
            self._stance = weakref.finalize(self, _EagerStance.release)
        tracker.__enter__()
        self._tracker = tracker

    def mark_phase(self, phase: str) -> None:
        if self._tracker is not None:
            self._tracker.mark_phase(phase)

    def end_step(self) -> StepMemory:
        tracker = self._tracker
        if tracker is None:
            raise RuntimeError(_NOT_STARTED)
        self._tracker = None
        tracker.__exit__(None, None, None)
        self._keep_left(tracker)
        if tracker.events is not None:
            tracker.events.left_bytes = tracker.peak_left_bytes
        self._release_stance()
        if tracker.error is not None:
            raise RuntimeError("the live-tensor tracker failed during the step: "
                               f"{tracker.error!r}") from tracker.error
        return StepMemory(peak_bytes=tracker.peak_bytes,
                          phase_peak_bytes=dict(tracker.phase_peak_bytes),
                          start_bytes=self._start_bytes, end_bytes=tracker.live_bytes,
                          events=tracker.events)

    def abort(self) -> None:
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            with contextlib.suppress(Exception):  # the mode stack was already unwound by another
                tracker.__exit__(None, None, None)
            self._keep_left(tracker)
        self._release_stance()

    def _keep_left(self, tracker: LiveTensorTracker) -> None:
        """Stop ``tracker``, keeping what its step leaves alive for the next (where it carries)."""
        if self.carries:
            self._left = tracker.left_alive(self._first_new)
            self.left_at_peak_bytes = tracker.peak_left_bytes
        tracker.stop()

    def _release_stance(self) -> None:
        """Let go of the eager stance this step holds, if any (once)."""
        self._stance, stance = None, self._stance
        if stance is not None:
            stance()


class DeviceAndHostProbe(MemoryProbe):
    """Two probes over one step, phases marked together: ``device`` (the device a dry run
    simulates; :meth:`end_step` returns its figure) and ``host`` (its figure: :attr:`host_memory`).

    Example:
        >>> probe = DeviceAndHostProbe(TrackerProbe("seqmem"), TrackerProbe("cpu"))
        >>> w = torch.ones(4)  # 16 bytes, alive before the step
        >>> probe.start_step([w], record_events=True)
        >>> probe.mark_phase("forward")
        >>> x = w.repeat(2)  # 32 bytes more
        >>> probe.end_step().peak_bytes, probe.host_memory.peak_bytes
        (0, 48)
        >>> probe.host_memory.phase_peak_bytes
        {'forward': 48}
    """

    def __init__(self, device: MemoryProbe, host: TrackerProbe) -> None:
        self.device, self.host = device, host
        self.name = device.name
        self.host_memory: Optional[StepMemory] = None

    @property
    def running(self) -> bool:
        return self.device.running

    def start_step(self, existing: Iterable[torch.Tensor], record_events: bool = False) -> None:
        existing = list(existing)
        self.host_memory = None
        self.device.start_step(existing, record_events=record_events)
        self.host.start_step(existing, record_events=record_events)

    def mark_phase(self, phase: str) -> None:
        self.device.mark_phase(phase)
        self.host.mark_phase(phase)

    def end_step(self) -> StepMemory:
        try:
            self.host_memory = self.host.end_step()
        except BaseException:
            self.device.abort()
            raise
        return self.device.end_step()

    def abort(self) -> None:
        self.host.abort()
        self.device.abort()


class CudaAllocatorProbe(MemoryProbe):
    """Per-phase peaks and :class:`.AllocatorCounters` from the CUDA caching allocator (peak
    reserved and allocated may come at different moments); ``record_events=True`` runs a
    :class:`LiveTensorTracker` alongside. Resets the peak counters at each step and phase boundary
    (``torch.cuda.max_memory_allocated()`` elsewhere sees the peak since the last)."""

    name = "cuda"

    def __init__(self, device: torch.device | int | str | None = None) -> None:
        self.device = (torch.device("cuda", torch.cuda.current_device()) if device is None
                       else torch.device(device))
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
            self._max_reserved = max(self._max_reserved,
                                     torch.cuda.max_memory_reserved(self.device))

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
            raise RuntimeError(_NOT_STARTED)
        self._running = False
        self._close_phase()
        events = self._tracker_probe.end_step().events if self._tracker_probe.running else None
        stats = torch.cuda.memory_stats(self.device)
        if not self._phase_peaks:  # no phase was marked: the whole step is one phase
            self._phase_peaks["forward"] = torch.cuda.max_memory_allocated(self.device)
        peak = max(self._phase_peaks.values())
        reserved = max(self._max_reserved, torch.cuda.memory_reserved(self.device))
        fragmentation = max(reserved - peak, 0)
        return StepMemory(peak_bytes=peak, phase_peak_bytes=dict(self._phase_peaks),
                          start_bytes=self._start_bytes,
                          end_bytes=torch.cuda.memory_allocated(self.device),
                          reserved_bytes=reserved, fragmentation_bytes=fragmentation,
                          fragmentation_fraction=fragmentation / reserved if reserved else 0.0,
                          inactive_split_bytes=int(stats.get("inactive_split_bytes.all.current",
                                                             0)),
                          alloc_retries=int(stats.get("num_alloc_retries", 0)),
                          num_ooms=int(stats.get("num_ooms", 0)), events=events)

    def abort(self) -> None:
        self._running = False
        self._tracker_probe.abort()


# walked elsewhere, or not the module's
_NOT_ATTRIBUTES = frozenset({"_parameters", "_buffers", "_modules", "_trainer", "_fabric"})


def attribute_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Tensors held as plain attributes of ``model`` or its submodules (caches such as
    ``PositionalEncoding.pe``), directly or in a list, tuple or dict attribute (one level deep).

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


def existing_tensors(model: torch.nn.Module, optimizers: Iterable[Any],
                     batch: Any) -> list[torch.Tensor]:
    """Tensors alive before a training step, each once: the model's, gradients, optimizers', batch.

    Example:
        >>> lin = torch.nn.Linear(4, 4)
        >>> opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        >>> len(existing_tensors(lin, [opt], {"x": torch.ones(2, 4)}))
        3
    """
    out: list[torch.Tensor] = (list(model.parameters()) + list(model.buffers())
                               + attribute_tensors(model))
    out += [p.grad for p in model.parameters() if p.grad is not None]
    for optimizer in optimizers:
        for state in optimizer.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        out += optimizer_held_tensors(optimizer)
    out += flat_tensors(batch)
    return list({id(t): t for t in out}.values())  # each once (param_groups hold the parameters)


def optimizer_held_tensors(optimizer: Any, depth: int = 4) -> list[torch.Tensor]:
    """Tensors an optimizer holds as attributes, in containers and wrapped optimizers (not modules),
    unseen in ``state``: DeepSpeed ZeRO's flat fp32 partitions and gradient buffers (~4 B/param).

    Example:
        >>> lin = torch.nn.Linear(4, 4)
        >>> opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        >>> opt.flat_buffer = [torch.zeros(8)]
        >>> [tuple(t.shape) for t in optimizer_held_tensors(opt) if t.numel() == 8]
        [(8,)]
    """
    out: list[torch.Tensor] = []
    seen: set[int] = set()

    def visit(value: Any, left: int) -> None:
        if isinstance(value, torch.Tensor):
            out.append(value)
            return
        if (left <= 0 or id(value) in seen
                or isinstance(value, (torch.nn.Module, str, bytes, int, float))):
            return
        seen.add(id(value))
        if isinstance(value, dict):
            for item in list(value.values()):
                visit(item, left - 1)
        elif isinstance(value, (list, tuple, set)):
            for item in list(value):
                visit(item, left - 1)
        elif value is optimizer or hasattr(value, "param_groups"):
            for item in list(vars(value).values()):
                visit(item, left - 1)

    try:
        visit(optimizer, depth)
    except Exception:  # noqa: BLE001 - an optimizer that cannot be walked shows its state only
        return []
    return out


def round_cuda_block_bytes(nbytes: int) -> int:
    """Round a size up to the CUDA caching allocator's 512-byte block (what it counts as allocated).

    Example:
        >>> round_cuda_block_bytes(1), round_cuda_block_bytes(512), round_cuda_block_bytes(513)
        (512, 512, 1024)
    """
    return -(-nbytes // _CUDA_BLOCK_BYTES) * _CUDA_BLOCK_BYTES


def make_probe(name: str, device: torch.device) -> MemoryProbe:
    """The probe for ``SeqMemCallback(probe=name)`` on ``device`` ("auto": allocator on CUDA).

    Example:
        >>> make_probe("auto", torch.device("cpu")).name
        'tracker'
    """
    check_choice("probe", name, PROBE_NAMES)
    if name == "cuda" or (name == "auto" and device.type == "cuda"):
        if device.type != "cuda":
            raise ValueError("`probe='cuda'` needs the model on a CUDA device, but it is on "
                             f"{device}; use probe='tracker' or 'auto'")
        return CudaAllocatorProbe(device)
    return TrackerProbe(device.type)
