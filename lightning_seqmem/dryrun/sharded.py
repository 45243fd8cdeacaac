"""FSDP2 (``fully_shard``): the per-rank peak at any world size, on one process.

:func:`sharded_dry_run_step` runs the module's own step on fake tensors as rank 0 (the largest
shard) of a fake process group (:func:`fake_world`), the tracker counting storages and resizes (how
FSDP2 frees gathered parameters). Sharding: the module's ``configure_model()`` on a fake
:func:`unsharded_template` copy, else torchtitan's layout (``fully_shard`` on each repeated block,
then the root). ``strategy="ddp"`` adds DDP's gradient buckets (the trainable gradients again) to
the unsharded step. Not counted: communication buffers, fragmentation and workspaces (:mod:`.step`).

>>> from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
>>> template = unsharded_template(LitGPT(n_layer=2, d_model=64, n_head=2))
>>> batch = next(iter(SyntheticTokenDataModule(batch_size=2, seq_len=32).train_dataloader()))
>>> two, eight = (sharded_dry_run_step(template, batch, 64, world_size=n) for n in (2, 8))
>>> two.peak_bytes > eight.peak_bytes  # parameters, gradients and AdamW state in 8 shards
True
>>> for part in two.detail.split("; ")[-2:]:  # doctest: +NORMALIZE_WHITESPACE
...     print(part)
configure_model() shards nothing: fully_shard on 2 blocks and the root (GPT, holding every
parameter) no host memory apart from the cpu simulated (host peak 0)
"""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import torch
from torch import nn

from lightning_seqmem.core.checks import check_int, is_a
from lightning_seqmem.core.search import smallest_fitting
from lightning_seqmem.dryrun.accelerator import contained_unpack_failures
from lightning_seqmem.dryrun.session import fake_batch, fake_session
from lightning_seqmem.dryrun.moe import routing_note
from lightning_seqmem.dryrun.result import DryRunResult, DryRunUnsupported
from lightning_seqmem.dryrun.fake import check_module, configured_optimizer, detached_memo
from lightning_seqmem.dryrun.step import (unsupported_reason, state_as_held, checked_rungs,
                                          host_peaks, replay_peaks, simulated_device_for)
from lightning_seqmem.dryrun.values import transformers_without_fake_detection
from lightning_seqmem.dryrun.cuda import allocator_block_bytes
from lightning_seqmem.dryrun.cpu_offload import (cpu_offload_policy, is_offloaded,
                                                 offloading_every_fully_shard,
                                                 settle_before_the_step)
from lightning_seqmem.dryrun.host import (PinWatch, host_detail, host_events, is_pinned_storage,
                                          mark_pinned, with_host_probe)
from lightning_seqmem.dryrun.step_functions import step_functions
from lightning_seqmem.mitigations import ladder
from lightning_seqmem.mitigations.base import fsdp2_modules
from lightning_seqmem.mitigations.checkpointing.checkpointing import find_repeated_blocks
from lightning_seqmem.measure.batch_shape import shapes_read_by
from lightning_seqmem.measure.steps import training_step_memory, validation_step_memory
from lightning_seqmem.core.records import PHASES
from lightning_seqmem.measure.probes import make_probe

__all__ = ["STRATEGIES", "check_strategy", "data_parallel_size", "dry_run_refusal", "fake_world",
           "is_fsdp2", "sharded_dry_run_step", "sharding_root", "template_for",
           "unsharded_template", "world_forecast"]

STRATEGIES = ("fsdp2", "ddp")
"""Strategies an N-rank plan models: FSDP2 sharding, or DDP replicas."""

MESH_DIM_NAMES = ("data_parallel", "tensor_parallel")  # as ModelParallelStrategy names them
_C10D_MAPS = ("_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config", "_tags_to_pg",
              "_pg_to_tag")


def is_fsdp2(module: Any) -> bool:
    """Whether ``module`` is (or holds) an FSDP2 module.

    >>> is_fsdp2(nn.Linear(2, 2)), is_fsdp2(None)
    (False, False)
    """
    return isinstance(module, nn.Module) and bool(fsdp2_modules(module))


def check_strategy(strategy: Any) -> str:
    """Validate a plan's ``strategy`` argument.

    >>> check_strategy("fsdp2")
    'fsdp2'
    >>> check_strategy("zero3")
    Traceback (most recent call last):
    ...
    ValueError: `strategy` must be one of ('fsdp2', 'ddp'), got 'zero3'
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"`strategy` must be one of {STRATEGIES}, got {strategy!r}")
    return strategy


def unsharded_template(pl_module: nn.Module) -> nn.Module:
    """A ``meta`` copy of ``pl_module`` (no memory, no trainer) taken before ``configure_model()``
    shards it (an FSDP2 module does not copy); raises :class:`DryRunUnsupported` if it cannot."""
    if is_fsdp2(pl_module):
        raise DryRunUnsupported(
            "the module is already sharded with fully_shard (an FSDP2 module cannot be copied); "
            "the template must be taken before configure_model() runs (SeqMemCallback does so in "
            "setup)"
        )
    memo = detached_memo(pl_module, keep_mesh=False)
    try:
        for p in pl_module.parameters():
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"),
                                       requires_grad=p.requires_grad)
        for b in pl_module.buffers():
            memo[id(b)] = torch.empty_like(b, device="meta")
        return copy.deepcopy(pl_module, memo)
    except Exception as exc:  # noqa: BLE001
        raise DryRunUnsupported("copying the module onto the meta device failed: "
                                f"{type(exc).__name__}: {exc}") from exc


@contextlib.contextmanager
def fake_world(world_size: int, device_type: str = "cpu") -> Iterator[Any]:
    """A fake ``world_size``-rank process group (this process: rank 0) yielding its device mesh;
    collectives only allocate outputs. A real group is set aside meanwhile: call none of it inside.

    >>> with fake_world(8) as mesh:
    ...     mesh.shape, mesh.mesh_dim_names
    ((8, 1), ('data_parallel', 'tensor_parallel'))
    >>> import torch.distributed as dist
    >>> dist.is_initialized()
    False
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world_size = check_int("world_size", world_size)
    saved_world, saved_count = c10d._world, c10d._group_count
    saved = {name: dict(getattr(c10d, name)) for name in _C10D_MAPS}
    saved["_tags_to_pg"] = {tag: list(groups) for tag, groups in saved["_tags_to_pg"].items()}
    for name in _C10D_MAPS:
        getattr(c10d, name).clear()
    c10d._world, c10d._group_count = c10d._World(), 0
    c10d._unregister_all_process_groups()
    try:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
        try:
            yield init_device_mesh(device_type, (world_size, 1), mesh_dim_names=MESH_DIM_NAMES)
        finally:
            dist.destroy_process_group()
    finally:
        c10d._world, c10d._group_count = saved_world, saved_count
        for name in _C10D_MAPS:
            getattr(c10d, name).clear()
            getattr(c10d, name).update(saved[name])
        # the C++ registry of group names holds the fake groups ("0", "1", ...): put the real back
        c10d._unregister_all_process_groups()
        for pg, name in saved["_pg_names"].items():
            c10d._register_process_group(name, pg)


def _fake_from_template(template: nn.Module, fake_mode: Any, device: torch.device) -> nn.Module:
    memo: dict[int, Any] = {}
    with fake_mode:
        for p in template.parameters():
            memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                       requires_grad=p.requires_grad)
        for b in template.buffers():
            memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device=device)
    try:
        return copy.deepcopy(template, memo)
    except Exception as exc:  # noqa: BLE001
        raise DryRunUnsupported("copying the template onto fake tensors failed: "
                                f"{type(exc).__name__}: {exc}") from exc


def _shard(model: nn.Module, mesh: Any, notes: list[str], offload_policy: Any = None) -> None:
    """The module's own ``configure_model()`` over ``mesh``, else the default layout; every
    ``fully_shard`` (the module's too) gets ``offload_policy`` (a ``CPUOffloadPolicy``)."""
    from torch.distributed.fsdp import fully_shard

    model.__dict__["_device_mesh"] = mesh
    configure = getattr(model, "configure_model", None)
    if callable(configure):
        offloading = (offloading_every_fully_shard(offload_policy) if offload_policy is not None
                      else contextlib.nullcontext())
        try:
            with offloading:
                configure()
        except DryRunUnsupported:
            raise
        except Exception as exc:  # noqa: BLE001
            raise DryRunUnsupported("configure_model() failed on the fake copy: "
                                    f"{type(exc).__name__}: {exc}") from exc
    if is_fsdp2(model):
        notes.append(f"configure_model() sharded {len(fsdp2_modules(model))} modules")
        return
    blocks = [b for b in find_repeated_blocks(model) if b is not model]
    dp_mesh = mesh[MESH_DIM_NAMES[0]]
    offload = {} if offload_policy is None else {"offload_policy": offload_policy}
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, **offload)
    root = sharding_root(model)
    fully_shard(root, mesh=dp_mesh, **offload)
    notes.append(f"configure_model() shards nothing: fully_shard on {len(blocks)} blocks and the "
                 "root" + ("" if root is model
                           else f" ({_class_name(root)}, holding every parameter)"))


def _class_name(module: nn.Module) -> str:
    """The module's own class name (not FSDP2's ``FSDP<name>`` subclass)."""
    name = type(module).__name__
    return name[4:] if name.startswith("FSDP") and is_fsdp2(module) else name


def sharding_root(model: nn.Module) -> nn.Module:
    """The innermost submodule holding all of ``model``'s parameters (else ``model``): the one
    ``training_step`` calls, so FSDP2's root hooks gather the parameters outside blocks in time.

    >>> outer = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    >>> sharding_root(outer) is outer[0]
    True
    """
    total = sum(1 for _ in model.parameters())
    while not any(True for _ in model.parameters(recurse=False)):
        holders = [c for c in model.children() if sum(1 for _ in c.parameters()) == total]
        if len(holders) != 1:
            break
        model = holders[0]
    return model


def sharded_dry_run_step(
    template: nn.Module, batch: Any, seq_len: int, world_size: int,
    batch_size: Optional[int] = None, mitigations: Sequence[str] = (), strategy: str = "fsdp2",
    autocast: Optional[Callable[[], ContextManager[Any]]] = None,
    device: Optional[torch.device | str] = None, first_split_check: Optional[bool] = None,
    offload: bool = False, held: Optional[tuple[bool, bool]] = None,
) -> DryRunResult:
    """Per-rank peak of one training step at ``world_size`` ranks (rank 0's; bytes).

    Args:
        template: the unsharded module (:func:`unsharded_template`; may be on ``meta``), unmodified.
        batch: one rank's training batch (cut or tiled to ``(batch_size, seq_len)``).
        seq_len, batch_size: the step to simulate (``batch_size`` per rank; default the batch's).
        world_size: ranks sharing the model (the data-parallel degree).
        mitigations: rungs applied to the copy, before or after sharding as the ladder does.
        strategy: ``"fsdp2"`` or ``"ddp"``.
        autocast: a zero-argument factory of the forward's context (the precision plugin's).
        device: default ``cpu``; ``cuda`` without CUDA: simulated, host apart (``host_peak_bytes``).
        first_split_check: include micro-batching's one-time loss check (None: if ``"microbatch"``).
        offload: FSDP2 ``CPUOffloadPolicy`` on every ``fully_shard`` (:mod:`.cpu_offload`); a
            ``configure_model()`` that offloads is planned as it is either way.
        held: the step is ``validation_step`` as a fit's validation loop runs it, beside
            ``(gradients alive, optimizer state made)`` (:func:`.step.held_state`): one phase.

    Raises:
        ValueError: ``offload`` with ``strategy="ddp"``, or not a bool; ``held`` not two bools.
        DryRunUnsupported: the step cannot run on fake tensors, or the module cannot be sharded.
    """
    started = time.perf_counter()
    seq_len = check_int("seq_len", seq_len)
    world_size = check_int("world_size", world_size)
    strategy = check_strategy(strategy)
    names = checked_rungs(mitigations)
    check_module(template)
    if is_fsdp2(template):
        raise DryRunUnsupported("`template` is already sharded; pass an unsharded copy "
                                "(unsharded_template)")
    from lightning_seqmem.measure.batch_shape import infer_batch_shape

    if not isinstance(offload, bool):
        raise ValueError(f"`offload` must be a bool, got {offload!r}")
    if held is not None and not (isinstance(held, tuple) and len(held) == 2
                                 and all(isinstance(x, bool) for x in held)):
        raise ValueError("`held` must be None or (gradients alive, optimizer state made), two "
                         f"bools (dryrun.step.held_state), got {held!r}")
    if offload and strategy != "fsdp2":
        raise ValueError("`offload` (FSDP2 CPUOffloadPolicy) needs strategy='fsdp2', "
                         f"got {strategy!r}")
    batch_size = (infer_batch_shape(batch)[0] if batch_size is None
                  else check_int("batch_size", batch_size))
    device = simulated_device_for(device, torch.device("cpu"))
    policy = cpu_offload_policy(device) if offload else None
    notes: list[str] = []
    with (fake_session(seq_len, device) as (fake_mode, values),
          fake_world(world_size, device.type) as mesh):
        try:
            model = _fake_from_template(template, fake_mode, device)
            with fake_mode:
                plan = ladder.apply_to_copy(names, model, after_sharding=False)
                with PinWatch():  # the shards FSDP2 pins (CPUOffloadPolicy)
                    if strategy == "fsdp2":
                        _shard(model, mesh, plan.notes, policy)
                    offloaded = strategy == "fsdp2" and is_offloaded(model)
                    if offloaded:
                        settle_before_the_step(model)
                        plan.notes.append(_offload_note(device, policy is not None))
                after = ladder.apply_to_copy(names, model, after_sharding=True)
                plan.notes += after.notes
                plan.micro_batch_size = plan.micro_batch_size or after.micro_batch_size
                optimizer = configured_optimizer(model)
                values.let_step_read(optimizer)
            step_batch, source_shape = fake_batch(batch, seq_len, batch_size, device, fake_mode,
                                                  values)
            loss_fn, step_optimizer = step_functions(model, optimizer, plan, batch_size,
                                                     first_split_check)
            notes = plan.notes
            probe = with_host_probe(make_probe("tracker", device), device)
            with fake_mode, values, transformers_without_fake_detection():
                state_as_held(model, optimizer, held)
                if offloaded:
                    _pin_gradients_as_fsdp2_does(model)
                with contained_unpack_failures(device) as failures:
                    memory = (validation_step_memory(model, optimizer, step_batch, probe, autocast)
                              if held else
                              training_step_memory(model, step_optimizer, step_batch, loss_fn,
                                                   probe, record_events=True, context=autocast))
                if failures:
                    raise failures[0]
            host_memory = getattr(probe, "host_memory", None)
            notes += [note for note in [routing_note(values)] if note]  # what an MoE step assumed
        except DryRunUnsupported:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure of the fake run is a reason
            raise DryRunUnsupported(unsupported_reason(exc)) from exc
    assert memory is not None and memory.events is not None
    peak, phase_peaks = replay_peaks(memory.events, allocator_block_bytes(device))
    phase_peaks = {p: phase_peaks[p] for p in PHASES if p in phase_peaks}
    if strategy == "ddp":
        buckets = sum(p.numel() * p.element_size() for p in template.parameters()
                      if p.requires_grad)
        peak, phase_peaks = peak + buckets, {p: v + buckets for p, v in phase_peaks.items()}
        notes.append(f"DDP gradient buckets: {buckets} bytes")
    host_peak, host_phase_peaks = host_peaks(host_memory)
    detail = (
        f"a fake {'validation_step' if held else 'step'} of {type(template).__name__} as rank 0 "
        f"of {world_size} ({strategy}) on "
        f"{device}, batch {source_shape} -> ({batch_size}, {seq_len}) per rank"
        + (f"; {'; '.join(notes)}" if notes else "")
        + f"; {host_detail(device, host_memory, host_peak)}"
    )
    return DryRunResult(seq_len=seq_len, batch_size=batch_size, mitigations=names, peak_bytes=peak,
                        phase_peak_bytes=phase_peaks, seconds=time.perf_counter() - started,
                        detail=detail, host_peak_bytes=host_peak,
                        host_phase_peak_bytes=host_phase_peaks,
                        events=memory.events, host_events=host_events(host_memory))


def _pin_gradients_as_fsdp2_does(model: nn.Module) -> None:
    """The gradients a first step leaves (zeros) pinned where their parameter shard is: FSDP2
    copies each reduce-scattered shard into pinned host memory under ``pin_memory=True``."""
    from lightning_seqmem.measure.tracker import tensor_storages

    for p in model.parameters():
        if p.grad is not None and any(is_pinned_storage(st) for st in tensor_storages(p)):
            mark_pinned(p.grad)


def _offload_note(device: torch.device, asked: bool) -> str:
    how = "offload=True" if asked else "configure_model()"
    if device.type == "cpu":
        return (f"FSDP2 CPUOffloadPolicy ({how}) on the CPU itself: the shards, gradients and "
                "optimizer state stay where they are (one memory)")
    return (f"FSDP2 CPUOffloadPolicy ({how}, pinned): parameter shards, gradients and optimizer "
            "state on the host, the optimizer step there; the device holds the gathered blocks, "
            "activations and FSDP2's copies")


# -- the training run's side (used by SeqMemCallback through TrainingRunDryRun) -------------------
def data_parallel_size(trainer: Any, pl_module: Any) -> int:
    """Ranks sharing the model's data-parallel dimension: the device mesh's ``data_parallel`` size
    under ``ModelParallelStrategy``, else the trainer's world size."""
    mesh = getattr(pl_module, "__dict__", {}).get("_device_mesh")
    if mesh is not None and mesh.mesh_dim_names and MESH_DIM_NAMES[0] in mesh.mesh_dim_names:
        return int(mesh[MESH_DIM_NAMES[0]].size())
    return int(getattr(trainer, "world_size", 1) or 1)


def template_for(trainer: Any, pl_module: nn.Module) -> Optional[nn.Module]:
    """The unsharded template of a run whose strategy shards the module in ``configure_model()``
    (``ModelParallelStrategy``, ``FSDPStrategy``), taken in ``setup`` before it does; else None."""
    if (not is_a(trainer.strategy, "ModelParallelStrategy", "FSDPStrategy") or is_fsdp2(pl_module)):
        return None
    return unsharded_template(pl_module)


def dry_run_refusal(trainer: Any) -> Optional[str]:
    """Why no dry run of the run's own step answers for this strategy (FSDP1, DeepSpeed), or None.

    >>> from types import SimpleNamespace
    >>> dry_run_refusal(SimpleNamespace(strategy=None)) is None
    True
    """
    name = type(getattr(trainer, "strategy", None)).__name__
    if name == "FSDPStrategy":
        return ("FSDPStrategy (FSDP1) flattens and shards the parameters inside "
                "FullyShardedDataParallel, which a fake copy of the module does not reproduce; "
                "forecasts come from measured steps (timeline replay, quadratic fit); "
                "forecast(world_size=N) plans it as FSDP2 from the template taken in setup")
    if "DeepSpeed" in name:
        return (f"{name}: DeepSpeed partitions parameters, gradients and optimizer state inside "
                "its own engine, which a fake copy of the module does not reproduce; forecasts "
                "come from measured steps (timeline replay, quadratic fit)")
    return None


def world_forecast(dry: Any, seq_len: int, batch_size: int, mitigations: Sequence[str],
                   world_size: int, strategy: Optional[str] = None) -> Any:
    """A :class:`~lightning_seqmem.core.forecast.Forecast` of the per-rank peak at ``world_size``
    ranks by :func:`sharded_dry_run_step` on ``dry`` (a :class:`.run.TrainingRunDryRun`, with a kept
    batch); ``strategy``: default ``"fsdp2"`` if sharded, else ``"ddp"``. The bound adds 2%."""
    from lightning_seqmem.core.forecast import Forecast

    if dry is None or dry.batch is None:
        raise ValueError("`world_size` forecasts need the dry run's kept batch: "
                         "SeqMemCallback(dry_run=True), on rank zero, after the first training "
                         "batch")
    template = dry.template if dry.template is not None else dry.pl_module
    strategy = check_strategy(strategy or ("fsdp2" if dry.template is not None else "ddp"))
    if is_fsdp2(template):
        raise DryRunUnsupported("the module is sharded and no unsharded template was taken in "
                                "setup")
    with shapes_read_by(dry.seq_len_fn):
        result = sharded_dry_run_step(template, dry.batch, seq_len, world_size, batch_size,
                                      mitigations, strategy,
                                      autocast=dry.trainer.precision_plugin.train_step_context,
                                      device=dry.trainer.strategy.root_device)
    upper = int(result.peak_bytes * 1.02)
    return Forecast(int(seq_len), int(batch_size), result.peak_bytes, upper, upper, "dry_run",
                    dict(result.phase_peak_bytes),
                    f"per rank at world size {world_size}: {result.detail}")


# -- plans at N ranks (seqmem plan --world-size) --------------------------------------------------
def world_sizes_up_to(world_size: int) -> list[int]:
    """The world sizes a plan tries: powers of two below ``world_size``, then ``world_size``.

    >>> world_sizes_up_to(8), world_sizes_up_to(6), world_sizes_up_to(1)
    ([1, 2, 4, 8], [1, 2, 4, 6], [1])
    """
    world_size = check_int("world_size", world_size)
    sizes = [1 << k for k in range(world_size.bit_length()) if 1 << k < world_size]
    return sizes + [world_size]


def smallest_fitting_world_size(
        peak_at: Callable[[int], int], usable_bytes: int, world_size: int,
        known: Optional[dict[int, int]] = None,
        bound: Callable[[int], int] = int) -> tuple[Optional[int], dict[int, int]]:
    """The smallest of :func:`world_sizes_up_to` whose per-rank peak (by ``bound``) fits
    ``usable_bytes`` (None: none), bisected (peaks do not grow with it), and every peak computed.

    >>> smallest_fitting_world_size(lambda n: 100 + 800 // n, 350, 8)
    (4, {8: 200, 2: 500, 4: 300})
    """
    sizes = world_sizes_up_to(world_size)
    peaks: dict[int, int] = dict(known or {})

    def peak(n: int) -> int:
        if n not in peaks:
            peaks[n] = int(peak_at(n))
        return peaks[n]

    return smallest_fitting(lambda n: bound(peak(n)) <= usable_bytes, sizes), peaks


def context_parallel_note(device: torch.device | str) -> str:
    """What a plan says about context (sequence) parallelism on ``device``.

    >>> context_parallel_note("cpu").startswith("context parallelism: not planned on cpu")
    True
    """
    device = torch.device(device)
    if device.type != "cuda":
        return (f"context parallelism: not planned on {device.type}: PyTorch's context_parallel "
                "(torch.distributed.tensor.experimental) shards the sequence across ranks for CUDA "
                "SDPA kernels (flash, memory-efficient, cuDNN) and cannot run here")
    return ("context parallelism: not planned: context_parallel can run on CUDA, but this version "
            "does not model it (its ring attention buffers are not simulated); each rank holds the "
            "whole sequence here")
