"""Host memory beside a dry run's device: what one step keeps in host (CPU) memory.

On an accelerator (CUDA, or the simulated one of :mod:`.accelerator`) a second tracker counts the
``"cpu"`` tensors of the same fake step and phases (:class:`DeviceAndHostProbe`): ``save_on_cpu``'s
activations, FSDP2 ``CPUOffloadPolicy``'s shards, gradients and optimizer state, AdamW's ``step``
scalars (unless fused or capturable); those alive before the step count as existing. On the CPU
itself host peaks are 0. Pinned memory (``pin_memory()``, ``pin_memory=True``, non-blocking
device-to-host copies such as FSDP2's offloaded gradients) counts in blocks rounded up to a power of
two, as PyTorch's caching host allocator holds it (``CachingHostAllocator.h``: ``PowerOf2Ceil``).
Fake tensors have no pinned state nor a fake ``aten._pin_memory``: :func:`register_fake_pin_memory`
adds one; :class:`PinWatch` and the host tracker remember pinned storages. Not modelled: the cache
of freed pinned blocks, pageable allocator overheads, host memory outside the step's tensors.

Example:
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> register_fake_pin_memory()
    >>> with FakeTensorMode(), PinWatch():
    ...     shard = torch.empty(1000, dtype=torch.bfloat16).pin_memory()  # 2000 bytes, pinned
    >>> is_pinned_storage(shard.untyped_storage()), power_of_two_bytes(2000)
    (True, 2048)
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_seqmem.core.records import StepMemory, TrackedEvents
from lightning_seqmem.dryrun.accelerator import host_of
from lightning_seqmem.measure.probes import DeviceAndHostProbe, MemoryProbe, TrackerProbe
from lightning_seqmem.measure.tracker import PINNED

__all__ = ["HOST", "PinWatch", "host_detail", "host_events", "is_pinned_storage", "mark_pinned",
           "pinned_storage", "power_of_two_bytes", "register_fake_pin_memory", "with_host_probe"]

HOST = "cpu"
"""The device type of host memory."""

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"library": None}
_PINNED: dict[int, weakref.ref] = {}  # StorageImpl address -> weakref to the pinned host storage


def power_of_two_bytes(nbytes: int) -> int:
    """``nbytes`` rounded up to a power of two, as PyTorch's caching host allocator pins memory.

    >>> [power_of_two_bytes(n) for n in (0, 1, 4096, 4097)]
    [0, 1, 4096, 8192]
    """
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


def _remember(storage: torch.UntypedStorage) -> None:
    key = storage._cdata

    def forget(ref: weakref.ref, key: int = key) -> None:
        if _PINNED.get(key) is ref:  # the address may belong to a newer storage by now
            del _PINNED[key]

    _PINNED[key] = weakref.ref(storage, forget)


def is_pinned_storage(storage: torch.UntypedStorage) -> bool:
    """Whether ``storage`` is a fake host storage this module knows as pinned."""
    ref = _PINNED.get(storage._cdata)
    return ref is not None and ref() is not None


def mark_pinned(tensor: torch.Tensor) -> None:
    """Count fake host ``tensor``'s storages as pinned, as a real step would (FSDP2's gradients)."""
    from lightning_seqmem.measure.tracker import tensor_storages

    for storage in tensor_storages(tensor):
        _remember(storage)


def _fake_pin_memory(tensor: torch.Tensor, device: Any = None) -> torch.Tensor:
    """``aten._pin_memory`` on a fake tensor: a new host storage, same strides (:class:`PinWatch` or
    the host tracker marks it pinned: the fake mode's cache answers repeat calls without this)."""
    return torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype,
                               device=tensor.device)


class PinWatch(TorchDispatchMode):
    """Remembers as pinned the host storages ops allocate in pinned memory while entered (above a
    ``FakeTensorMode``): what FSDP2 pins in ``fully_shard`` and its set-up run, before any step.

    Example:
        >>> from torch._subclasses.fake_tensor import FakeTensorMode
        >>> register_fake_pin_memory()
        >>> with FakeTensorMode(), PinWatch():
        ...     a, b = torch.empty(8).pin_memory(), torch.empty(8).pin_memory()
        ...     c = torch.empty(8)
        >>> [is_pinned_storage(t.untyped_storage()) for t in (a, b, c)]
        [True, True, False]
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _pins(func, args, kwargs):
            mark_pinned(out)
        return out


def register_fake_pin_memory() -> None:
    """Give ``aten._pin_memory`` a fake kernel (once per process) so fake tensors can be pinned."""
    with _LOCK:
        if _STATE["library"] is None:
            library = torch.library.Library("aten", "FRAGMENT")
            torch.library.register_fake("aten::_pin_memory", _fake_pin_memory, lib=library)
            _STATE["library"] = library


def _pins(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether op ``func`` allocates its output in pinned host memory (on a CUDA build)."""
    if func is torch.ops.aten._pin_memory.default or kwargs.get("pin_memory") is True:
        return True
    if func is torch.ops.aten._to_copy.default and kwargs.get("non_blocking"):
        source = args[0] if args else None
        target = kwargs.get("device")
        return (isinstance(source, torch.Tensor) and source.device.type not in (HOST, "meta")
                and target is not None and torch.device(target).type == HOST)
    return False


def pinned_storage(storage: torch.UntypedStorage, func: Any, args: Any,
                   kwargs: dict[str, Any]) -> bool:
    """The host tracker's ``pinned`` hook: whether a host storage new to it (``func`` made it;
    None: it existed before the step) is pinned; one ``func`` pins is remembered as such."""
    if func is not None and _pins(func, args, kwargs):
        _remember(storage)
        return True
    return is_pinned_storage(storage)


def with_host_probe(probe: MemoryProbe, device: torch.device) -> MemoryProbe:
    """``probe``, with a host tracker beside it (:class:`DeviceAndHostProbe`) off the CPU."""
    if host_of(device) is None:
        return probe
    register_fake_pin_memory()
    host = TrackerProbe(HOST)
    host.pinned = pinned_storage
    return DeviceAndHostProbe(probe, host)


def host_events(memory: Optional[StepMemory],
                pinned_blocks: bool = True) -> Optional[TrackedEvents]:
    """The host side's allocation/free sequence of a step for :func:`.step.replay_peaks` (None
    without one), pinned allocations rounded up to a power of two (``pinned_blocks=False``: not).

    Example:
        >>> ev = TrackedEvents(sizes=[100, 3000], ops=["<existing>", "empty" + PINNED],
        ...                    sequence=[0, 1, ~1])
        >>> memory = StepMemory(peak_bytes=3100, phase_peak_bytes={}, start_bytes=100,
        ...                     end_bytes=100, events=ev)
        >>> host_events(memory).sizes, host_events(memory, pinned_blocks=False).sizes
        ([100, 4096], [100, 3000])
    """
    if memory is None or memory.events is None:
        return None
    events = memory.events
    if not pinned_blocks:
        return events
    sizes = [power_of_two_bytes(n) if op.endswith(PINNED) else n
             for n, op in zip(events.sizes, events.ops)]
    return TrackedEvents(sizes=sizes, ops=list(events.ops), sequence=list(events.sequence),
                         phase_starts=dict(events.phase_starts), num_existing=events.num_existing)


def host_detail(device: torch.device, memory: Optional[StepMemory], peak_bytes: int = 0) -> str:
    """What the detail of a dry run says of host memory (``peak_bytes``: the host peak found).

    >>> host_detail(torch.device("cpu"), None)
    'no host memory apart from the cpu simulated (host peak 0)'
    """
    from lightning_seqmem.core.units import format_bytes

    if host_of(device) is None:
        return f"no host memory apart from the {device.type} simulated (host peak 0)"
    ops = [] if memory is None or memory.events is None else memory.events.ops
    pinned = sum(op.endswith(PINNED) for op in ops)
    blocks = (f" ({pinned} pinned blocks, each rounded up to a power of two as PyTorch's caching "
              "host allocator does)") if pinned else ""
    return (f"host memory ({HOST}) peak {format_bytes(peak_bytes)}, counted by a second "
            f"LiveTensorTracker in the same step{blocks}")
