"""Activation offload: what each transformer block saves for backward waits in pinned host memory.

Each repeated block (:func:`.checkpointing.find_repeated_blocks`) runs its forward under the hooks
of ``torch.autograd.graph.save_on_cpu(pin_memory=True)``: each tensor autograd saves there is copied
to the host when saved and back when its backward node runs. The device then holds no block's saved
activations between forward and backward: the peak moves from the forward's end to a backward's
temporaries (huggingface/accelerate#4175: unchanged at short lengths, −25% at 1M tokens).

What goes to the host (:meth:`OffloadedForward.keeps` says what stays):

* each tensor saved inside a block's forward (twice if saved twice), but not the block's parameters,
  buffers (or views of them) and ``nn.Parameter``s (FSDP2's unsharded ones): on the device anyway,
  their host copies would free nothing (``save_on_cpu`` alone makes them too);
* of a checkpointed block, only the checkpoint's inputs (ALST's "checkpoint offload"): the hooks go
  around the checkpoint (its wrapper is the block; Hugging Face checkpoints inside the layer's
  ``forward``, below the hooks). A ``checkpoint_wrapper`` added *after* offload encloses the hooks
  and idles them: list ``"activation_offload"`` after ``"checkpointing"``. Transformers 5's
  ``activation_checkpointing_enable(offload=True)`` is not used: it resets the checkpointed layers.

Switched on between steps: each block gets an instance ``forward`` (:class:`OffloadedForward`).
Cost: the two copies, on the compute stream, and that much pinned host memory.

On fake accelerator tensors (a dry run) ``save_on_cpu`` itself runs, its fake host copies counted by
:mod:`lightning_seqmem.dryrun.host`; on fake CPU tensors the hooks *model* it (keeping the shape;
backward allocates the tensor anew on the device). :attr:`OffloadedForward.host_bytes` counts both.

Example:
    >>> import torch
    >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
    >>> model = GPT(GPTConfig(n_layer=2, d_model=32, n_head=2))
    >>> policy = ActivationOffload()
    >>> policy.apply(model).detail
    'offload the tensors 2 Block blocks save for backward to pinned host memory (save_on_cpu)'
    >>> loss = model(torch.randint(0, 256, (1, 8))).sum()
    >>> offloaded_bytes(model) > 0, is_offloading(model)
    (True, True)
    >>> policy.remove(model).after, is_offloading(model)
    ('off', False)
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks

from lightning_seqmem.measure.tracker import is_fake, tensor_storages
from lightning_seqmem.mitigations.base import (
    CopyPlan,
    MitigationResult,
    Rung,
    RungContext,
    device_type_of,
    wrapping_strategy_refusal,
)
from lightning_seqmem.mitigations.checkpointing.checkpointing import (NO_BLOCKS_FOUND,
                                                                      check_block_class_names,
                                                                      find_repeated_blocks)
from lightning_seqmem.mitigations.checkpointing.checkpointing_levels import wrappers_by_block
from lightning_seqmem.mitigations.activation_offload.activation_offload_spec import SPEC

__all__ = ["ActivationOffload", "ActivationOffloadRung", "OffloadedForward", "is_offloading",
           "offloaded_bytes", "reset_offloaded_bytes"]

CPU_REFUSAL = "CUDA only: on CPU activations already live in host memory"


def _inside_checkpoint() -> bool:
    """Whether the top saved-tensor hooks are a non-reentrant checkpoint's (nothing to offload)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top is not None and getattr(top[0], "__module__", "") == "torch.utils.checkpoint"


class OffloadedForward:
    """A block's ``forward`` under the offload hooks. ``host_bytes``/``host_tensors``: bytes and
    tensors copied to host since the last :func:`reset_offloaded_bytes` (on fake tensors: that would
    be); ``kept_bytes``: bytes of saved parameters and buffers left on the device."""

    def __init__(self, block: nn.Module, pin_memory: bool = True) -> None:
        self.block = block
        self.pin_memory = pin_memory
        self.host_bytes = 0
        self.host_tensors = 0
        self.kept_bytes = 0
        self._own: set[int] = set()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        block = self.block
        if not torch.is_grad_enabled() or _inside_checkpoint():
            return type(block).forward(block, *args, **kwargs)
        self._own = {st._cdata for t in (*block.parameters(), *block.buffers())
                     for st in _storages(t)}
        try:
            with saved_tensors_hooks(self._pack, self._unpack):
                return type(block).forward(block, *args, **kwargs)
        finally:
            self._own = set()

    def keeps(self, tensor: torch.Tensor) -> bool:
        """Whether a tensor saved inside the block stays on the device: a parameter or buffer of the
        block (or a view of one), any ``nn.Parameter``, or a tensor that is not strided."""
        base = tensor._base if tensor._base is not None else tensor
        if (isinstance(tensor, nn.Parameter) or isinstance(base, nn.Parameter)
                or tensor.layout != torch.strided):
            return True
        return any(st._cdata in self._own for st in _storages(tensor))

    def _save_on_cpu(self, device_type: str = "cuda") -> save_on_cpu:
        """``save_on_cpu`` hooks for ``device_type`` tensors (made once per type, not pickled)."""
        hooks = self.__dict__.setdefault("_hooks", {})
        if device_type not in hooks:
            hooks[device_type] = save_on_cpu(pin_memory=self.pin_memory, device_type=device_type)
        return hooks[device_type]

    def _to_host(self, tensor: torch.Tensor) -> Any:
        # the accelerator's device module says whether pinning is possible (save_on_cpu's: CUDA's)
        device_type = "cuda" if tensor.device.type in ("cpu", "meta") else tensor.device.type
        return (device_type, self._save_on_cpu(device_type).pack_hook(tensor))

    def _from_host(self, packed: Any) -> torch.Tensor:
        device_type, what = packed
        return self._save_on_cpu(device_type).unpack_hook(what)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_hooks", None)  # closures: made again on first use
        return state

    def _pack(self, tensor: torch.Tensor) -> Any:
        nbytes = tensor.numel() * tensor.element_size()
        if self.keeps(tensor):
            self.kept_bytes += nbytes
            return ("kept", tensor)
        self.host_bytes += nbytes
        self.host_tensors += 1
        if is_fake(tensor) and tensor.device.type in ("cpu", "meta"):
            # a dry run of the CPU, which has no host apart: the shape alone (the device forgets
            # it), back as a new device tensor; on an accelerator's, save_on_cpu itself runs
            return ("modelled", (tensor.size(), tensor.dtype, tensor.device))
        return ("host", self._to_host(tensor))

    def _unpack(self, packed: Any) -> torch.Tensor:
        how, what = packed
        if how == "kept":
            return what
        if how == "modelled":
            size, dtype, device = what
            return torch.empty(size, dtype=dtype, device=device)
        return self._from_host(what)

    def __repr__(self) -> str:
        return f"OffloadedForward({type(self.block).__name__}, pin_memory={self.pin_memory})"


def _storages(t: torch.Tensor) -> list:
    try:
        return tensor_storages(t)
    except Exception:  # noqa: BLE001 - a tensor subclass without plain storages: not one of ours
        return []


def _wrappers(module: nn.Module) -> list[OffloadedForward]:
    return [m.__dict__["forward"] for m in module.modules()
            if isinstance(m.__dict__.get("forward"), OffloadedForward)]


def is_offloading(module: nn.Module) -> bool:
    """Whether any block of ``module`` offloads its saved activations.

    >>> is_offloading(nn.Linear(2, 2))
    False
    """
    return bool(_wrappers(module))


def offloaded_bytes(module: nn.Module) -> int:
    """``host_bytes`` summed over ``module``'s offloading blocks (each tensor at each save)."""
    return sum(w.host_bytes for w in _wrappers(module))


def reset_offloaded_bytes(module: nn.Module) -> None:
    """Start counting :func:`offloaded_bytes` (and the kept bytes) from zero."""
    for w in _wrappers(module):
        w.host_bytes = w.host_tensors = w.kept_bytes = 0


def _counted(blocks: list[nn.Module]) -> str:
    names = sorted({type(b).__name__ for b in blocks})
    return f"{len(blocks)} {'/'.join(names)} blocks"


class ActivationOffload:
    """Policy: offload the tensors every repeated block saves for backward (in place, idempotent).

    Args:
        block_class_names: the blocks' class names (``None``: :func:`find_repeated_blocks`).
        pin_memory: copy into pinned (page-locked) host memory.

    Example:
        >>> why = ActivationOffload().is_applicable(nn.Linear(2, 2))[1]
        >>> print(why)  # doctest: +NORMALIZE_WHITESPACE
        no repeated blocks found (no Hugging Face model, no nn.ModuleList of one class);
        pass block_class_names
        >>> ActivationOffload(block_class_names=[])
        Traceback (most recent call last):
        ...
        ValueError: `block_class_names` must be None or a non-empty sequence of class names, got [].
    """

    name = "activation_offload"

    def __init__(self, block_class_names: Sequence[str] | None = None,
                 pin_memory: bool = True) -> None:
        self.block_class_names = check_block_class_names(block_class_names)
        if not isinstance(pin_memory, bool):
            raise ValueError(f"`pin_memory` must be True or False, got {pin_memory!r}.")
        self.pin_memory = pin_memory

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The blocks whose forward goes under the hooks (a checkpoint wrapper where one is)."""
        found = {id(b) for b in find_repeated_blocks(model, self.block_class_names)
                 if b is not model}
        # find_repeated_blocks sees through checkpoint wrappers: the wrapper goes under the hooks
        wrappers = wrappers_by_block(model)
        return [wrappers.get(i, b) for b in model.modules() if (i := id(b)) in found]

    def is_applicable(self, model: nn.Module) -> tuple[bool, str]:
        """``(True, what would be offloaded)`` or ``(False, why)``, on any device."""
        if is_offloading(model):
            return False, "saved activations already offloaded"
        blocks = self.blocks(model)
        if not blocks:
            return False, NO_BLOCKS_FOUND
        where = "pinned host memory" if self.pin_memory else "host memory"
        return True, (f"offload the tensors {_counted(blocks)} save for backward to {where} "
                      "(save_on_cpu)")

    def apply(self, model: nn.Module) -> MitigationResult:
        """Put every block's forward under the hooks; a second call changes nothing."""
        applies, reason = self.is_applicable(model)
        if not applies:
            return self.unchanged(model, reason)
        blocks = self.blocks(model)
        for block in blocks:
            if "forward" in block.__dict__:  # someone else's instance forward: do not hide it
                raise ValueError(f"{type(block).__name__} already has an instance attribute "
                                 f"`forward` ({block.__dict__['forward']!r}); activation offload "
                                 "cannot wrap it")
        for block in blocks:
            block.forward = OffloadedForward(block, self.pin_memory)  # type: ignore[method-assign]
        return MitigationResult(self.name, True, reason, "off", "on")

    def unchanged(self, model: nn.Module, reason: str) -> MitigationResult:
        """What ``apply`` returns where it changes nothing, for ``reason``."""
        state = "on" if is_offloading(model) else "off"
        return MitigationResult(self.name, False, reason, state, state)

    def remove(self, model: nn.Module) -> MitigationResult:
        """Give every block its class's forward back."""
        found = [m for m in model.modules()
                 if isinstance(m.__dict__.get("forward"), OffloadedForward)]
        for m in found:
            del m.forward
        detail = (f"{len(found)} blocks save for backward on the device again" if found
                  else "not offloading")
        return MitigationResult(self.name, bool(found), detail, "on" if found else "off", "off")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(block_class_names={self.block_class_names!r}, "
                f"pin_memory={self.pin_memory})")


class ActivationOffloadRung(Rung):
    """The opt-in ``"activation_offload"`` rung: :class:`ActivationOffload` on CUDA, removable;
    refused elsewhere (and by FSDP1 at set-up, not DeepSpeed), yet a dry run models it for ``seqmem
    plan`` (``modelled_where_refused``).

    Example:
        >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
        >>> model = GPT(GPTConfig(n_layer=2, d_model=32, n_head=2))
        >>> ActivationOffloadRung().is_applicable(RungContext(model))
        (False, 'CUDA only: on CPU activations already live in host memory')
    """

    spec = SPEC
    modelled_where_refused = True

    def __init__(self, policy: Optional[ActivationOffload] = None) -> None:
        self.policy = policy or ActivationOffload()

    def is_on(self, module: nn.Module) -> bool:
        return is_offloading(module)

    def is_applicable(self, ctx: RungContext) -> tuple[bool, str]:
        device = device_type_of(ctx.pl_module)
        if device in ("cpu", "meta"):  # meta is planned for the CPU unless a GPU is simulated
            return False, CPU_REFUSAL
        if device != "cuda":
            return False, f"CUDA only: on {device} there is no pinned host memory to copy to"
        return self.policy.is_applicable(ctx.pl_module)

    def apply(self, ctx: RungContext) -> MitigationResult:
        applies, reason = self.is_applicable(ctx)
        if not applies:
            return self.policy.unchanged(ctx.pl_module, reason)
        return self.policy.apply(ctx.pl_module)

    def remove(self, ctx: RungContext) -> Optional[MitigationResult]:
        return self.policy.remove(ctx.pl_module)

    def apply_to_copy(self, copy: Any, plan: CopyPlan) -> None:
        """Model it on the dry run's fake copy on any device (the hooks see fake tensors)."""
        result = self.policy.apply(copy)
        plan.notes.append(f"{self.name}: {result.detail}"
                          + (" (modelled)" if result.applied else ""))

    def strategy_refusal(self, trainer: Any) -> Optional[str]:
        return wrapping_strategy_refusal(trainer)

RUNG = ActivationOffloadRung
"""This folder's rung (what :data:`~lightning_seqmem.core.rungs.RUNG_FOLDERS` names)."""
