"""FSDP2 ``CPUOffloadPolicy`` in a sharded dry run: parameters, gradients, optimizer state on host.

``sharded_dry_run_step(..., offload=True)`` (:mod:`.sharded`) shards the fake copy with
``CPUOffloadPolicy`` and steps as FSDP2 does (on the CPU itself nothing moves): parameter shards in
host memory (pinned off the CPU) copied to the device before each all-gather, gradient shards copied
back, the optimizer stepping on the host. Trackers count both sides in the same fake step
(:mod:`.host`): the device peak holds the gathered blocks, activations and FSDP2's device copies;
the host peak the shards, gradients and optimizer state. A sharding ``configure_model()`` gets the
policy through :func:`offloading_every_fully_shard`. DeepSpeed ZeRO-3 with CPU offload is planned by
the same dry run (:data:`lightning_seqmem.plan.parallel.ZERO3_OFFLOAD_NOTE`).

Example:
    >>> [cpu_offload_policy(torch.device(d)).pin_memory for d in ("cpu", "cuda")]
    [False, True]
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
from torch import nn

from lightning_seqmem.dryrun.accelerator import host_of
from lightning_seqmem.dryrun.host import register_fake_pin_memory
from lightning_seqmem.dryrun.result import DryRunUnsupported

__all__ = ["cpu_offload_policy", "is_offloaded", "offloading_every_fully_shard",
           "settle_before_the_step"]

def cpu_offload_policy(device: torch.device) -> Any:
    """FSDP2's ``CPUOffloadPolicy`` for a dry run on ``device``: pinned host memory where the host
    is apart from ``device`` (FSDP2's default), pageable on the CPU itself (nothing to pin for)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    pinned = host_of(device) is not None
    if pinned:
        register_fake_pin_memory()  # FSDP2 pins each shard as fully_shard runs
    return CPUOffloadPolicy(pin_memory=pinned)


def is_offloaded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` (or a submodule) with ``CPUOffloadPolicy``.

    >>> is_offloaded(nn.Linear(2, 2))
    False
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            groups = state._fsdp_param_groups
            if any(isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups):
                return True
    return False


@contextlib.contextmanager
def offloading_every_fully_shard(policy: Any) -> Iterator[None]:
    """Every ``fully_shard`` call inside gets ``policy`` as its ``offload_policy`` (unless it gives
    a ``CPUOffloadPolicy`` itself), however the caller imported ``fully_shard``: PyTorch's internal
    ``_init_param_group``, which receives the policy, is wrapped for the duration.

    Raises:
        DryRunUnsupported: this torch's ``fully_shard`` has no such function to wrap.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy

    try:
        from torch.distributed.fsdp._fully_shard import _fully_shard as home
        original = home._init_param_group
    except (ImportError, AttributeError):
        raise DryRunUnsupported(
            "this torch's fully_shard cannot be given CPUOffloadPolicy from outside "
            "configure_model(); pass offload_policy=CPUOffloadPolicy() in configure_model() to "
            "plan offload") from None

    @functools.wraps(original)
    def with_policy(*args: Any, **kwargs: Any) -> Any:
        names = list(_parameter_names(original))
        bound = dict(zip(names, args), **kwargs)
        if not isinstance(bound.get("offload_policy"), CPUOffloadPolicy):
            bound["offload_policy"] = policy
        return original(**bound)

    home._init_param_group = with_policy
    try:
        yield
    finally:
        home._init_param_group = original


def _parameter_names(fn: Any) -> Iterator[str]:
    import inspect

    return iter(inspect.signature(fn).parameters)


def settle_before_the_step(model: nn.Module) -> None:
    """Let FSDP2 set up each sharded module's parameter shards before the measured step, as a
    run's first step does: its lazy init re-pins a shard ``is_pinned()`` calls unpinned (always,
    on a fake tensor), so the measured forward would briefly hold two copies of each shard. Each
    parameter group's idempotent ``lazy_init()`` runs now; nothing is gathered. Without such
    groups in this torch, nothing is done (the figure is then the higher one)."""
    from torch.distributed.fsdp import FSDPModule

    for module in (m for m in model.modules() if isinstance(m, FSDPModule)):
        groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", ())
        for group in groups:
            lazy_init = getattr(group, "lazy_init", None)
            if callable(lazy_init):
                lazy_init()
