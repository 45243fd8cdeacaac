"""The module micro-batching's first-step check runs on: the callback's own copy, not the user's.

The check (:mod:`.microbatch`) calls ``training_step`` three more times without gradient; on the
user's module anything it does besides the loss (a sample counter, a ``torchmetrics`` update)
would happen three more times. So it runs on a copy (:func:`check_copy`): the module deep-copied
with its parameters *shared*, its buffers and attribute tensors copied (a batch norm's statistics,
a metric's states: the check's updates land there) and the Trainer (or Fabric) and device mesh it
is attached to shared. The copy, and what ``training_step`` changed on it, is then dropped. The
copied tensors are the check's memory beside its forwards (the dry run counts them:
:func:`copied_tensors`). A module that refuses a copy makes the wrapper refuse, saying why.

Example:
    >>> import torch
    >>> class Counting(torch.nn.Linear):
    ...     seen = 0
    ...     def training_step(self, batch, batch_idx=0):
    ...         self.seen += len(batch)
    ...         return self(batch).mean()
    >>> model = Counting(2, 1)
    >>> twin, step = check_copy(model)
    >>> x = torch.ones(3, 2)
    >>> twin.weight is model.weight, float(step(x)) == float(model(x).mean())
    (True, True)
    >>> twin.seen, model.seen   # the copy counted, the module did not
    (3, 0)
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch

from lightning_seqmem.measure.probes import attribute_tensors
from lightning_seqmem.mitigations.base import fsdp2_modules

__all__ = ["check_copy", "copied_tensors", "sharded_modules"]


def copied_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """What :func:`check_copy` copies of ``module``'s tensors: its buffers and attribute tensors
    (outside what FSDP2 shards, which is shared).

    >>> lin = torch.nn.BatchNorm1d(4)
    >>> [tuple(t.shape) for t in copied_tensors(lin)]
    [(4,), (4,), ()]
    """
    params = {id(p) for p in module.parameters()}
    shared = sharded_modules(module)
    params |= {id(t) for m in shared for t in [*m.buffers(recurse=False), *attribute_tensors(m)]}
    out, seen = [], set()
    for t in [*module.buffers(), *attribute_tensors(module)]:
        if id(t) not in params and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def sharded_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules under an FSDP2 ``fully_shard`` (each sharded module and all below it): FSDP2
    gathers and frees their parameters by setting them on these objects, so a copy shares them.

    >>> sharded_modules(torch.nn.Linear(2, 2))
    []
    """
    found: dict[int, torch.nn.Module] = {}
    for sub in fsdp2_modules(module):
        found.update({id(m): m for m in sub.modules()})
    return list(found.values())


def check_copy(pl_module: torch.nn.Module, wrapper: Optional[Any] = None,
               ) -> tuple[torch.nn.Module, Callable[..., Any]]:
    """``(copy, its training_step)``: ``pl_module`` deep-copied with its parameters shared and what
    it is attached to (Trainer, Fabric, device mesh) shared, and the submodules FSDP2 shards
    (:func:`sharded_modules`) shared too: what ``training_step`` changes on the module itself and
    its other submodules lands on the copy. ``wrapper`` (the micro-batching wrapper) is left out of
    the copy, whose ``training_step`` is the one the wrapper wraps, bound to the copy.

    Raises:
        ValueError: the module itself is sharded with ``fully_shard``.
        Exception: whatever ``copy.deepcopy`` raises for an attribute that refuses a copy.
    """
    memo: dict[int, Any] = {id(p): p for p in pl_module.parameters()}
    for sub in sharded_modules(pl_module):  # FSDP2 swaps parameters on these very modules: shared
        if sub is pl_module:
            raise ValueError("the module itself is sharded with fully_shard (FSDP2), which gathers "
                             "its parameters onto it alone")
        memo[id(sub)] = sub
    for name in ("_trainer", "_fabric", "_device_mesh"):
        attached = pl_module.__dict__.get(name)
        if attached is not None:
            memo[id(attached)] = attached
    if wrapper is not None:
        memo[id(wrapper)] = None
    twin = copy.deepcopy(pl_module, memo)
    previous = getattr(wrapper, "previous", None)
    twin.__dict__.pop("training_step", None)
    if previous is not None:  # an instance training_step under the wrapper: the copy's own
        twin.__dict__["training_step"] = copy.deepcopy(previous, memo)
    return twin, twin.training_step
