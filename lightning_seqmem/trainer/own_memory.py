"""What the callback itself holds in the training device's memory, so it is counted and judged.

The callback's own tensors (the batch copy its dry run reshapes, the breakdown's longest batch, the
dry run's real value twins, run on the CPU) live in host memory: on a CPU run, the device's. So:

* :func:`own_tensors`: the copies kept across steps; the probe counts them as memory a step begins
  with and every dry-run answer adds their bytes (:func:`resident_bytes`), so records, forecasts and
  the budget agree; likewise DDP's gradient buckets copying the gradients (:func:`untracked_bytes`);
* :func:`value_room_bytes`: inside a step window (batch start to end, where decisions and their dry
  runs run), what the usable budget leaves beside the run's tensors: the most a dry run's real
  values may hold at once (:func:`~lightning_seqmem.dryrun.values.value_room`); a dry run needing
  more refuses, saying so, and the other predictors answer.

Example:
    >>> import torch
    >>> from types import SimpleNamespace as NS
    >>> from lightning_seqmem.trainer.run_state import EdgeState
    >>> kept = {"ids": torch.zeros(2, 8, dtype=torch.long)}
    >>> edge = EdgeState(device=torch.device("cpu"), dry_runner=NS(batch=kept))
    >>> resident_bytes(edge), left_bytes(edge, evaluate=True)  # the batch copy: 2 x 8 int64
    (128, 0)
    >>> edge.device = torch.device("cuda", 0)  # on a GPU the copy is host memory
    >>> resident_bytes(edge)
    0
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch

from lightning_seqmem.dryrun.sharded import is_fsdp2
from lightning_seqmem.measure.probes import existing_tensors
from lightning_seqmem.measure.tracker import flat_tensors, tensor_storages

if TYPE_CHECKING:
    from lightning_seqmem.trainer.run_state import EdgeState

__all__ = ["bucket_bytes", "host_is_device", "left_bytes", "own_tensors", "resident_bytes",
           "start_probe", "storage_bytes", "untracked_bytes", "value_room_bytes"]

HOST_DEVICE_TYPES = ("cpu",)
"""Device types whose memory is the host's: what the callback keeps in host memory counts there."""


def host_is_device(device: Optional[torch.device]) -> bool:
    """Whether ``device``'s memory is the host's (a CPU run).

    >>> [host_is_device(d) for d in (torch.device("cpu"), torch.device("cuda", 0), None)]
    [True, False, False]
    """
    return device is not None and device.type in HOST_DEVICE_TYPES


def own_tensors(state: "EdgeState") -> list[torch.Tensor]:
    """The tensors the callback keeps across steps on the training device (none off a CPU run)."""
    device = state.device
    if not host_is_device(device):
        return []
    runner = state.dry_runner
    kept = flat_tensors(getattr(runner, "batch", None)) if runner is not None else []
    if state.breakdown_batch is not None:
        kept += flat_tensors(state.breakdown_batch[1])
    return [t for t in kept if t.device.type == device.type]


def storage_bytes(tensors: Iterable[Any], device_type: str) -> int:
    """Bytes of the distinct storages of ``tensors`` on ``device_type`` (views counted once).

    >>> x = torch.zeros(4, 4)
    >>> storage_bytes([x, x[:2], torch.ones(2)], "cpu")
    72
    """
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == device_type:
            for st in tensor_storages(t):
                seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def bucket_bytes(trainer: Any) -> int:
    """Bytes of DDP's gradient buckets where they are a second copy of the gradients (Lightning's
    default, ``gradient_as_bucket_view=False``): allocated by the reducer in C++, seen by no probe
    of tensors; 0 elsewhere (no DDP, or buckets that are the gradients themselves).

    >>> from types import SimpleNamespace as NS
    >>> bucket_bytes(NS(strategy=NS(model=torch.nn.Linear(2, 2))))
    0
    """
    from torch.nn.parallel import DistributedDataParallel

    model = getattr(getattr(trainer, "strategy", None), "model", None)
    if not isinstance(model, DistributedDataParallel):
        return 0
    if getattr(model, "gradient_as_bucket_view", False):
        return 0  # the buckets are the gradients, counted as such
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def untracked_bytes(state: "EdgeState", trainer: Any) -> int:
    """What a CPU run's device holds for the strategy outside any tensor the tracker sees (DDP's
    bucket copies, :func:`bucket_bytes`): counted in each measured step and each dry-run answer. On
    a GPU the allocator's counters and the dry run's resident bytes hold them already: 0."""
    return bucket_bytes(trainer) if host_is_device(state.device) else 0


def resident_bytes(state: "EdgeState", evaluate: bool = False) -> int:
    """What every dry-run answer adds on a CPU run: the bytes of :func:`own_tensors` (the callback's
    own copies), :func:`untracked_bytes` (the strategy's) and :func:`left_bytes` (earlier steps',
    ``evaluate``: for a validation batch)."""
    device = state.device
    if not host_is_device(device):
        return 0
    trainer = state.fit_refs[0]() if state.fit_refs is not None else None
    strategy = untracked_bytes(state, trainer) if trainer is not None else 0
    return storage_bytes(own_tensors(state), device.type) + strategy + left_bytes(state, evaluate)


def left_bytes(state: "EdgeState", evaluate: bool = False) -> int:
    """Bytes earlier steps allocated and left alive (another callback's kept outputs, a logged value
    till the next is logged), which the probe counts: for a training step, those alive at the last
    one's peak (a step frees them where the last did); for a validation batch, which frees none,
    all alive now beyond the run's tensors and the callback's own."""
    probe = state.probe
    trainer, pl_module = (r() for r in state.fit_refs or (lambda: None, lambda: None))
    if not evaluate or not hasattr(probe, "left_storages") or None in (trainer, pl_module):
        return int(getattr(probe, "left_at_peak_bytes", 0))
    held = [*existing_tensors(pl_module, trainer.optimizers, ()), *own_tensors(state)]
    seen = {st._cdata for t in held for st in tensor_storages(t)}
    return sum({st._cdata: st.nbytes() for st in probe.left_storages() if st._cdata not in seen
                and st.device.type == state.device.type}.values())


def start_probe(state: "EdgeState", trainer: Any, pl_module: Any, batch: Any,
                record_events: bool = False) -> None:
    """Start ``state.probe`` in the forward phase of a step beside the run's tensors, the callback's
    own (:func:`own_tensors`) and, for the tracker, :func:`untracked_bytes`: as dry runs count."""
    probe = state.probe
    existing = [*existing_tensors(pl_module, trainer.optimizers, batch), *own_tensors(state)]
    # earlier steps' left-overs counted; not under FSDP2 (2 MB its sharded dry run lacks: unknown)
    probe.carries = not is_fsdp2(pl_module)
    if probe.name == "tracker":  # (the allocator's counters hold what no tensor shows)
        untracked = untracked_bytes(state, trainer)
        probe.start_step(existing, record_events=record_events, resident_bytes=untracked)
        if untracked and not getattr(trainer.strategy.model, "_has_rebuilt_buckets", True):
            _release_when_rebuilt(trainer.strategy.model, probe)
    else:
        probe.start_step(existing, record_events=record_events)
    probe.mark_phase("forward")


def _release_when_rebuilt(ddp: Any, probe: Any) -> None:
    """DDP rebuilds its buckets before the forward of its second iteration (third with
    ``static_graph``): the tracker sees the new ones and counted the old ones as resident, freed
    unseen then; a one-shot hook on the wrapped module (after the rebuild) frees them there."""
    tracker = probe._tracker
    first: list[int] = []

    def rebuilding(*_: Any) -> None:
        before.remove()
        first.append(tracker.allocations)

    def rebuilt(*_: Any) -> None:
        handle.remove()
        if ddp._has_rebuilt_buckets and probe._tracker is tracker:
            tracker.release_bytes()
            # the new buckets: counted as resident by the later steps, not left alive by this one
            tracker.not_left.update(range(first[0] if first else 0, tracker.allocations))

    before = ddp.register_forward_pre_hook(rebuilding)
    handle = ddp.module.register_forward_pre_hook(rebuilt)


def value_room_bytes(state: "EdgeState", usable: Optional[int]) -> Optional[int]:
    """The most a dry run's real values may hold now: inside a step window of a CPU run with a
    budget, the usable budget less the run's tensors (the module's, the gradients, the optimizer
    state, the batch, the callback's own copies); None elsewhere (on a GPU they are host memory;
    outside a window no step runs)."""
    device = state.device
    refs = state.fit_refs
    if not host_is_device(device) or usable is None or state.window_batch is None or refs is None:
        return None
    trainer, pl_module = refs[0](), refs[1]()
    if trainer is None or pl_module is None:
        return None
    held = [*existing_tensors(pl_module, trainer.optimizers, state.window_batch),
            *own_tensors(state)]
    return max(0, int(usable) - storage_bytes(held, device.type) - untracked_bytes(state, trainer))
