"""Dry run: the peak memory of one training step at any length, without allocating it.

:func:`dry_run_step` answers "what is the peak memory of one training step of this module at
``(seq_len, batch_size, mitigations)``?" by running the module's own ``training_step``, its
backward and its optimizer step on a *fake* copy of the module and optimizer under
:class:`torch._subclasses.fake_tensor.FakeTensorMode`. Fake tensors carry shapes, dtypes, devices
and storages but no data, so a step at 32k tokens costs about as much as one at 64 (well under a
second on the tiny models of this package), and the program that runs is the real one at that
length: kernels chosen by length, sliding windows, masks built in the model. Nothing is
extrapolated. The storages are counted by the same
:class:`~lightning_seqmem.measure.probes.LiveTensorTracker` that measures real steps, through
:func:`lightning_seqmem.measure.steps.training_step_memory` (Lightning's order: forward, ``zero_grad``,
backward, optimizer step).

What is counted, as in a real Lightning run after the first step:

* one un-measured fake step runs first, so the measured (second) step starts with the optimizer
  state allocated and the previous step's gradients alive during the forward (they are released
  by ``zero_grad(set_to_none=True)``, which Lightning calls after ``training_step``);
* parameters, buffers, gradients, optimizer state and the batch are counted as existing; the peak
  of each phase (``forward``, ``backward``, ``optimizer``) is the live bytes' maximum within it;
* on CUDA every allocation is rounded up to the caching allocator's 512-byte block, as
  ``torch.cuda.max_memory_allocated`` counts it (:func:`allocator_block_bytes`). Not modelled:
  allocator fragmentation / reserved memory, cuBLAS/cuDNN workspaces, CUDA context.

Candidate mitigations (rung names, :func:`lightning_seqmem.mitigations.ladder.rung_names`) are
applied to the copy only, each by its rung's ``apply_to_copy``
(:class:`~lightning_seqmem.mitigations.base.Rung`): the attention switch and activation
checkpointing change the copy; micro-batching changes the step (micro-batches of one sample, each loss weighted by its share of what the loss
averages over and backpropagated on its own, one optimizer step, as
:mod:`lightning_seqmem.mitigations.microbatch` runs it: the gradients are zeroed before the first
micro-batch, every micro-batch but the last is backpropagated inside the ``forward`` phase, the
last one in ``backward``; the wrapper's one-time check of its first split batch is not included).

Fake tensors have no values, but the values a step reads from its batch alone are known: small
tensors computed only from the batch and constants (padding masks, label counts, positions,
``nonzero`` of token ids) carry real twins (:class:`_BatchValues`), so ``.item()`` and
data-dependent shapes on them work. A step that cannot run on fake tensors raises
:class:`DryRunUnsupported` with the reason and the line of user code: an op that reads values of
an activation (``loss.item()``, ``if hidden.abs().max() > 1:``), an output shape that depends on
them (``hidden[hidden > 0]``), an op without a fake kernel, a compiled module, manual
optimization. The real module, its parameters, gradients and optimizer state, and the torch random
number generators are left as they were.

The copy keeps the train/eval mode of every submodule, as Lightning's ``fit`` does. While the
step runs, transformers' fake-tensor check is switched off process-wide (see
:func:`_transformers_without_fake_detection`): do not run a dry run beside another thread that
traces a Hugging Face model.

Example:
    >>> import torch
    >>> import torch.nn.functional as F
    >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
    >>> class LM(torch.nn.Module):  # a LightningModule in practice; training_step is what runs
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.gpt = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, attention="eager"))
    ...     def training_step(self, batch, batch_idx):
    ...         logits = self.gpt(batch["input_ids"])
    ...         return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    >>> model = LM()
    >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    >>> batch = {"input_ids": torch.randint(0, 256, (2, 16)), "labels": torch.randint(0, 256, (2, 16))}
    >>> eager = dry_run_step(model, optimizer, batch, seq_len=4096)  # 16 tokens tiled to 4096
    >>> sdpa = dry_run_step(model, optimizer, batch, seq_len=4096, mitigations=["attention"])
    >>> eager.peak_bytes > 8 * sdpa.peak_bytes  # the 4096 x 4096 attention scores
    True
    >>> [p for p in eager.phase_peak_bytes], eager.peak_bytes == max(eager.phase_peak_bytes.values())
    (['forward', 'backward', 'optimizer'], True)
    >>> model.gpt.attention_backend, all(p.grad is None for p in model.parameters()), len(optimizer.state)
    ('eager', True, 0)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import inspect
import math
import re
import sys
import time
import traceback
import warnings
import weakref
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map_only

from lightning_seqmem.measure.batch import infer_batch_shape, scaled_length
from lightning_seqmem.core.checks import check_int
from lightning_seqmem.mitigations import ladder
from lightning_seqmem.mitigations.base import CopyPlan
from lightning_seqmem.mitigations.ladder import check_mitigations
from lightning_seqmem.mitigations.microbatch import (
    IGNORE_INDEX,
    MicroBatching,
    deferred_gradient_reduction,
    _slice,
    is_micro_batching,
    micro_batch_counts,
    micro_batching_check_pending,
    split_batch,
)
from lightning_seqmem.measure.steps import loss_of, training_step_memory
from lightning_seqmem.measure.probes import (
    PHASES,
    TrackedEvents,
    attribute_tensors,
    existing_tensors,
    make_probe,
    round_cuda_block_bytes,
)

__all__ = ["DryRunResult", "DryRunUnsupported", "allocator_block_bytes", "cuda_kernel_scratch_bytes", "dry_run_step",
           "replay_peaks", "resident_bytes", "warm_cuda_workspaces"]

_VALUE_MAX_BYTES = 8 * 2**20  # real values kept for tensors computed from the batch alone, up to this size each
_VALUE_CEILING_BYTES = 2**28  # ... or up to a fp32 [L, L] mask of the simulated length (8192 tokens), never above


def value_max_bytes(seq_len: int) -> int:
    """Largest tensor computed from the batch alone whose real value a dry run at ``seq_len`` keeps.

    A fp32 ``[L, L]`` causal mask is what every ``nn.Transformer`` builds, and
    ``nn.TransformerDecoder`` reads its values (``bool((mask == causal).all())``), so the limit is
    at least that: from 8 MiB up to 256 MiB (8192 tokens). The values are real tensors on the
    simulated device (a few of that size at once, while the dry run lasts): beyond 8192 tokens such
    a check refuses the dry run, and the fit of measured steps answers.

    Example:
        >>> value_max_bytes(512) == 8 * 2**20, value_max_bytes(8192) == 4 * 8192 * 8192, value_max_bytes(65536) == 2**28
        (True, True, True)
    """
    return min(max(_VALUE_MAX_BYTES, 4 * int(seq_len) ** 2), _VALUE_CEILING_BYTES)
_QUIET = (  # warnings a fake copy without a Trainer raises by design
    "You are trying to `self.log()`",
    "Accessing the data pointer of FakeTensor",
)


@dataclass(frozen=True)
class DryRunResult:
    """The peak of one fake training step (bytes).

    ``phase_peak_bytes`` maps ``forward``, ``backward`` and ``optimizer`` to the peak live bytes
    within each phase (each starts from the bytes live when it begins); ``peak_bytes`` is their
    maximum. ``seconds`` is the wall time of the whole dry run (copy, two fake steps).
    ``detail`` says what ran: model, device, optimizer, batch shape, what each mitigation did.
    """

    seq_len: int  # tokens per sample of the simulated step
    batch_size: int  # samples in the simulated batch
    mitigations: tuple[str, ...]  # mitigations applied to the copy, in the order given
    peak_bytes: int  # peak live tensor bytes of the step (allocator blocks on CUDA)
    phase_peak_bytes: dict[str, int]  # phase -> peak live bytes within it
    seconds: float  # wall time of the dry run
    detail: str  # what ran, for logs and reports
    resident_bytes: int = 0  # device memory held outside the step's tensors, included above (CUDA)


class DryRunUnsupported(RuntimeError):
    """The step cannot run on fake tensors; ``reason`` says why (and where, when known).

    Example:
        >>> err = DryRunUnsupported("the module is compiled")
        >>> err.reason, str(err)
        ('the module is compiled', 'dry run unsupported: the module is compiled')
    """

    def __init__(self, reason: str) -> None:
        super().__init__(f"dry run unsupported: {reason}")
        self.reason = reason


def allocator_block_bytes(device: torch.device | str) -> int:
    """Granularity of what the device's allocator counts: 512 bytes on CUDA, 1 (exact storage bytes) elsewhere.

    Example:
        >>> allocator_block_bytes("cuda:0"), allocator_block_bytes("cpu")
        (512, 1)
    """
    return round_cuda_block_bytes(1) if torch.device(device).type == "cuda" else 1


def cuda_kernel_scratch_bytes(func: Any, args: Any, out: Any) -> int:
    """Bytes a CUDA kernel allocates for itself beside its output, where measured (else 0).

    Fake tensors see outputs only. On an H200 (torch 2.11, ``benchmarks/cuda_peak_anatomy.py``)
    the softmax backward kernel (``structured_softmax_backward_cuda_out``) held one more buffer
    the size of its output while it ran: eager attention's backward peaked one ``[B, H, L, L]``
    block above what the tensors account for (9% at 512 tokens, 18% at 2048 for a 2-layer GPT).
    Other kernels showed no such buffer above the allocator's rounding (SDPA in fp32, Llama and
    Mistral with SDPA: within 0.05%).

    Example:
        >>> out = torch.empty(2, 4, 8, 8)
        >>> cuda_kernel_scratch_bytes(torch.ops.aten._softmax_backward_data.default, (), out)
        2048
        >>> cuda_kernel_scratch_bytes(torch.ops.aten.mm.default, (), out)
        0
    """
    if func is torch.ops.aten._softmax_backward_data.default and isinstance(out, torch.Tensor):
        return round_cuda_block_bytes(out.numel() * out.element_size())
    return 0


def warm_cuda_workspaces(device: torch.device) -> None:
    """Make cuBLAS and cuBLASLt allocate their workspaces on ``device`` now, as a first training step does.

    The workspaces come from PyTorch's caching allocator and stay allocated, so
    ``torch.cuda.max_memory_allocated`` counts them in every step (tens of MiB on recent GPUs);
    a tiny real matrix product with and without a bias (the two libraries), forward and
    backward, in fp32 and bf16, allocates them before :func:`resident_bytes` reads the device.
    """
    dtypes = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_bf16_supported() else [])
    for dtype in dtypes:
        x = torch.ones(8, 8, device=device, dtype=dtype, requires_grad=True)
        w = torch.ones(8, 8, device=device, dtype=dtype, requires_grad=True)
        b = torch.ones(8, device=device, dtype=dtype, requires_grad=True)
        (torch.nn.functional.linear(x, w, b).sum() + (x @ w).sum()).backward()
    torch.cuda.synchronize(device)


def resident_bytes(device: torch.device, tensors: Any) -> int:
    """Bytes the CUDA allocator holds on ``device`` outside ``tensors`` (what a step starts with).

    ``torch.cuda.memory_allocated`` minus the 512-byte blocks of the distinct storages among
    ``tensors`` on that device: cuBLAS/cuBLASLt workspaces, and anything else the process keeps
    there (a second model, an EMA copy). A dry run counts only the step's own tensors; this is
    added to its peak so it compares with what the allocator reports. 0 off CUDA.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    seen: set[int] = set()
    known = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device == device:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                known += round_cuda_block_bytes(storage.nbytes())
    return max(0, torch.cuda.memory_allocated(device) - known)


def replay_peaks(events: TrackedEvents, block_bytes: int = 1) -> tuple[int, dict[str, int]]:
    """``(peak, phase -> peak)`` of a traced step, every allocation rounded up to ``block_bytes``.

    With ``block_bytes=1`` this is what the tracker itself counted; with 512 it is what the CUDA
    caching allocator would report (each block rounded up: 1 byte -> 512, 513 -> 1024).

    Example:
        >>> ev = TrackedEvents(sizes=[1000, 1, 513], sequence=[0, 1, ~1, 2], phase_starts={"forward": 1, "backward": 3})
        >>> replay_peaks(ev)
        (1513, {'forward': 1001, 'backward': 1513})
        >>> replay_peaks(ev, block_bytes=512)
        (2048, {'forward': 1536, 'backward': 2048})
    """
    check_int("block_bytes", block_bytes)
    sizes = [-(-n // block_bytes) * block_bytes for n in events.sizes]
    starts: dict[int, list[str]] = {}
    for name, position in sorted(events.phase_starts.items(), key=lambda kv: kv[1]):
        starts.setdefault(position, []).append(name)  # phases with no event between them share one
    live = peak = 0
    phase: Optional[str] = None
    phase_peaks: dict[str, int] = {}

    def begin(position: int) -> Optional[str]:
        current = phase
        for name in starts.get(position, ()):
            phase_peaks[name] = max(phase_peaks.get(name, 0), live)
            current = name
        return current

    for position, entry in enumerate(events.sequence):
        phase = begin(position)
        live += sizes[entry] if entry >= 0 else -sizes[~entry]
        peak = max(peak, live)
        if phase is not None and live > phase_peaks[phase]:
            phase_peaks[phase] = live
    for position in starts:  # phases that began after the last event
        if position >= len(events.sequence):
            begin(position)
    return peak, phase_peaks


# -- up-front checks ---------------------------------------------------------------------------
def _compiled_reason(module: nn.Module) -> Optional[str]:
    """Why ``module`` counts as compiled (``torch.compile``), or None."""
    for name, sub in module.named_modules():
        where = f"submodule {name!r} ({type(sub).__name__})" if name else f"the module ({type(sub).__name__})"
        if type(sub).__name__ == "OptimizedModule" and type(sub).__module__.startswith("torch._dynamo"):
            return f"{where} is a torch.compile'd module (OptimizedModule)"
        if getattr(sub, "_compiled_call_impl", None) is not None:
            return f"{where} was compiled in place (module.compile())"
        forward = sub.__dict__.get("forward")
        if forward is not None and hasattr(forward, "_torchdynamo_orig_callable"):
            return f"the forward of {where} is a torch.compile'd function"
    return None


def _check_module(pl_module: Any) -> None:
    if not isinstance(pl_module, nn.Module) or not callable(getattr(pl_module, "training_step", None)):
        raise TypeError(
            f"`pl_module` must be an nn.Module with a `training_step(batch, batch_idx)` method (a LightningModule), "
            f"got {type(pl_module).__name__}"
        )
    reason = _compiled_reason(pl_module)
    if reason is not None:
        raise DryRunUnsupported(
            f"{reason}: its memory is that of the kernels torch.compile generates (fused, with their own "
            "buffers), which a fake eager step does not reproduce; forecast from measured steps instead"
        )
    if getattr(pl_module, "automatic_optimization", True) is False:
        raise DryRunUnsupported(
            "manual optimization (automatic_optimization=False): the module runs its own backward and optimizer "
            "steps through the Trainer"
        )


# -- copies --------------------------------------------------------------------------------------
@contextlib.contextmanager
def _preserved_rng() -> Iterator[None]:
    """Restore the CPU and (initialised) CUDA generators afterwards, whatever the step drew."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _fake_copy(pl_module: nn.Module, fake_mode: FakeTensorMode, values: Optional["_BatchValues"] = None) -> nn.Module:
    """``copy.deepcopy`` with fake parameters, buffers and attribute tensors, without the Trainer
    (or Fabric) it is attached to.

    Parameters, buffers and tensors held as plain attributes (:func:`~lightning_seqmem.measure.probes.attribute_tensors`:
    caches such as a positional table or a causal mask, a rotary embedding's ``original_inv_freq``)
    are faked first and put in the copy's memo, so the deep copy takes the fake ones and never
    copies a real one (nor a gradient); the attribute tensors count as existing memory of the step,
    as in a real one. ``values`` gets a copy of each attribute tensor's values (within its limit):
    a step may read them.
    """
    memo: dict[int, Any] = {}
    for name in ("_trainer", "_fabric"):
        attached = pl_module.__dict__.get(name)
        if attached is not None:
            memo[id(attached)] = None  # every reference to it copies as None
    mesh = pl_module.__dict__.get("_device_mesh")
    if mesh is not None:
        memo[id(mesh)] = mesh  # shared, not copied (it holds process groups)
    try:
        for p in pl_module.parameters():
            memo[id(p)] = nn.Parameter(fake_mode.from_tensor(p.detach()), requires_grad=p.requires_grad)
        for b in pl_module.buffers():
            memo[id(b)] = fake_mode.from_tensor(b)
        for t in attribute_tensors(pl_module):
            if id(t) in memo or isinstance(t, FakeTensor) or t.device.type == "meta":
                continue
            memo[id(t)] = fake = fake_mode.from_tensor(t)
            if values is not None and t.numel() * t.element_size() <= values.max_bytes:
                with _disable_current_modes():
                    values.give(fake, t.detach().clone())
        return copy.deepcopy(pl_module, memo)
    except Exception as exc:  # noqa: BLE001 - reported as the reason
        raise DryRunUnsupported(f"copying the module onto fake tensors failed: {type(exc).__name__}: {exc}") from exc


def _unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the real one
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(
            "`optimizer` must be a torch.optim.Optimizer (or Lightning's wrapper of one), "
            f"got {type(optimizer).__name__}"
        )
    return inner


def _default_foreach(params: list[torch.Tensor]) -> Optional[bool]:
    """What ``foreach=None`` resolves to for the *real* parameters (fake ones would always give False)."""
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach

        return bool(_default_to_fused_or_foreach(params, differentiable=False, use_fused=False)[1])
    except Exception:  # noqa: BLE001 - a private helper: keep the optimizer's own default
        return None


def _rebuild_optimizer(optimizer: Any, twins: dict[int, nn.Parameter]) -> torch.optim.Optimizer:
    """A fresh optimizer of the same class and param-group hyperparameters over the fake copy.

    ``twins`` maps ``id`` of each real parameter to its fake twin.
    """
    real = _unwrap_optimizer(optimizer)
    groups = []
    for index, group in enumerate(real.param_groups):
        params = []
        for p in group["params"]:
            fake = twins.get(id(p))
            if fake is None:
                raise DryRunUnsupported(
                    f"param group {index} of the optimizer holds a {tuple(p.shape)} tensor that is not a parameter "
                    "of the module, so the fake copy cannot step it (pass the module's own optimizer)"
                )
            params.append(fake)
        hyper = {k: v for k, v in group.items() if k != "params"}
        if "foreach" in hyper and hyper["foreach"] is None and not hyper.get("fused"):
            foreach = _default_foreach(list(group["params"]))
            if foreach is not None:
                hyper["foreach"] = foreach
        groups.append({**hyper, "params": params})
    accepted = inspect.signature(type(real).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        kwargs = dict(real.defaults)
    else:
        kwargs = {k: v for k, v in real.defaults.items() if k in accepted and k != "params"}
    try:
        return type(real)(groups, **kwargs)
    except Exception as exc:  # noqa: BLE001
        raise DryRunUnsupported(
            f"cannot rebuild {type(real).__name__} over the fake copy from its defaults and param groups: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _configured_optimizer(module: Any) -> torch.optim.Optimizer:
    """The (first) optimizer of ``module.configure_optimizers()``, called on the fake copy."""
    try:
        out = module.configure_optimizers()
    except Exception as exc:  # noqa: BLE001
        raise DryRunUnsupported(f"configure_optimizers() failed on the fake copy: {type(exc).__name__}: {exc}") from exc
    while not isinstance(out, torch.optim.Optimizer):
        if isinstance(out, Mapping) and "optimizer" in out:
            out = out["optimizer"]
        elif isinstance(out, (list, tuple)) and out:
            out = out[0]
        else:
            raise DryRunUnsupported(
                f"configure_optimizers() returned {type(out).__name__}; pass the optimizer to dry_run_step"
            )
    return out


# -- values a step reads from its batch -------------------------------------------------------------
def _tensors_in(*objs: Any) -> list[torch.Tensor]:
    """The tensors among an op's arguments or outputs (aten nests at most one list deep)."""
    out: list[torch.Tensor] = []
    for obj in objs:
        for x in obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else (obj,):
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif isinstance(x, (list, tuple)):
                out.extend(t for t in x if isinstance(t, torch.Tensor))
    return out


_WRITTEN_ARGS: dict[Any, tuple[tuple[int, str], ...]] = {}  # op -> (position, name) of the arguments it writes


def _written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments an op writes to (``self`` of an in-place op, ``out=``)."""
    where = _WRITTEN_ARGS.get(func)
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


class _BatchValues(TorchDispatchMode):
    """Real values of the small tensors a step computes from its batch and constants alone.

    Fake tensors have no values, yet models read some: is the batch padded (``mask.all()``), are
    sequences packed (``position_ids`` diffs), where are the labels (``(labels != -100).sum().item()``).
    Those values come from the batch, not from the parameters, and are cheap to compute for real.
    This mode (above the fake mode) keeps a real twin of every fake tensor that was computed only
    from the batch, from constants or from other such tensors, when no larger than ``max_bytes``
    (:func:`value_max_bytes` of the simulated length: a ``[L, L]`` mask fits), running each such op once more on the twins with every mode off (so
    nothing is counted, and the real tensors die with their fake ones). An op that reads the
    values of a tensor without a twin (an activation, anything computed from parameters) still
    fails, as it must. A real tensor held by the module is its own twin, but never written to. A
    tensor with a twin written from one without (``ids[:, 0] = activation.argmax()``) loses the
    twins of its whole storage (every view of it).
    """

    def __init__(self, fake_mode: FakeTensorMode, max_bytes: int = _VALUE_MAX_BYTES) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.max_bytes = int(max_bytes)  # largest tensor whose real value is kept
        self._values: dict[int, tuple[weakref.ref, torch.Tensor]] = {}  # id(fake) -> (ref to it, its twin)
        self._unknown_storages: dict[int, weakref.ref] = {}  # storages whose values were overwritten unseen

    def give(self, fake: torch.Tensor, value: torch.Tensor) -> None:
        if value.numel() * value.element_size() <= self.max_bytes:
            key = id(fake)
            self._values[key] = (weakref.ref(fake, lambda _, k=key: self._values.pop(k, None)), value)

    def forget(self, fake: torch.Tensor) -> None:
        """``fake`` was written from values we do not know: no view of its storage has known values now."""
        if self._value(fake) is None:
            return  # nothing known there (parameters, gradients, activations): nothing to forget
        self._values.pop(id(fake), None)
        storage = fake.untyped_storage()
        key = storage._cdata
        self._unknown_storages[key] = weakref.ref(storage, lambda _, k=key: self._unknown_storages.pop(k, None))

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
        known = all(self._value(t) is not None for t in _tensors_in(args, kwargs))
        written = _written_tensors(func, args, kwargs)
        if any(not isinstance(t, FakeTensor) for t in written):
            known = False  # never write to a real tensor
        try:
            out = func(*args, **kwargs)
            computed = True
        except (DataDependentOutputException, DynamicOutputShapeException):
            if not known or sum(t.numel() * t.element_size() for t in _tensors_in(args, kwargs)) > self.max_bytes:
                raise
            out, computed = None, False
        if not known or (computed and not _small(out, self.max_bytes)):
            for t in written:
                self.forget(t)  # its values are unknown from now on
            return out
        real_args, real_kwargs = tree_map_only(torch.Tensor, self._value, (args, kwargs))
        with _disable_current_modes():
            real = func(*real_args, **real_kwargs)
        if not computed:  # the output's shape (or the result itself) depends on the values
            out = tree_map_only(torch.Tensor, self.fake_mode.from_tensor, real)
        for fake, value in zip(tree_flatten(out)[0], tree_flatten(real)[0]):
            if isinstance(fake, FakeTensor) and isinstance(value, torch.Tensor):
                self.give(fake, value)
        return out


@contextlib.contextmanager
def _transformers_without_fake_detection() -> Iterator[None]:
    """Let Hugging Face transformers take a real step's shortcuts on fake tensors.

    ``transformers.utils.import_utils.is_tracing`` counts a fake tensor as a graph being traced,
    and then skips the shortcuts that read values: SDPA gets an explicit ``[B, 1, L, L]`` causal
    mask instead of ``is_causal=True`` (measured: +28% on a small Llama at 512 tokens, and a
    quadratic term that a real step does not have). A real step takes them, so during the dry run
    ``is_fake_tensor`` answers False; the values the shortcuts read come from :class:`_BatchValues`.
    """
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


# -- the batch -------------------------------------------------------------------------------------
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


def _is_square(x: torch.Tensor, rows: int, length: int) -> bool:
    """A ``[B or 1, ..., L, L]`` attention mask or bias (4-D or more, or 3-D and not float), as in :mod:`.batch`."""
    if x.dim() < 3 or x.shape[0] not in (rows, 1) or not x.shape[-1] == x.shape[-2] == length:
        return False
    return x.dim() >= 4 or not (x.dtype.is_floating_point or x.dtype.is_complex)


def _shape_batch(
    batch: Any, seq_len: int, batch_size: int, fake_mode: FakeTensorMode, values: _BatchValues
) -> tuple[Any, tuple[int, int]]:
    """A fake copy of ``batch`` at ``(batch_size, seq_len)``, with the batch's original shape.

    The batch shape ``(B, L)`` is read as :func:`~lightning_seqmem.measure.batch.infer_batch_shape` reads
    it, and sequence tensors are those :mod:`lightning_seqmem.measure.batch` cuts: first dimension ``B`` or
    1 (broadcast, e.g. ``position_ids`` of shape ``[1, L]``) and ``L`` at dim 1 (``input_ids``,
    ``labels``, ``attention_mask``, embeddings ``[B, L, D]``), or at both last dims (masks and
    biases ``[B, 1, L, L]``). Rows (dim 0 of every tensor with ``B`` rows) are cut or repeated;
    sequence dims are cut or tiled (the tokens repeated from the start), and ``position_ids`` become
    ``0 .. seq_len - 1``; sequences of another length (an encoder-decoder's ``labels [B, L/2]``)
    keep their ratio to ``L`` (:func:`~lightning_seqmem.measure.batch.scaled_length`). Changed tensors are contiguous copies, so each storage holds exactly its
    elements. Every tensor's values are given to ``values`` (copied: the step may change its batch
    in place). Mappings, lists, tuples, namedtuples and dataclasses are rebuilt with their type;
    the batch itself is left untouched.
    """
    rows, length = infer_batch_shape(batch)

    def convert(x: torch.Tensor, key: Any) -> torch.Tensor:
        if isinstance(x, FakeTensor):
            fake = x
        else:
            fake = fake_mode.from_tensor(x)
            if x.numel() * x.element_size() <= values.max_bytes:
                with _disable_current_modes():
                    values.give(fake, x.detach().clone())
        out = fake
        square = _is_square(fake, rows, length)
        sequence = not square and fake.dim() >= 2 and fake.shape[0] in (rows, 1) and fake.shape[1] == length
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
            out = _resize(out, 1, size)  # another length (an encoder-decoder's labels): its ratio kept
        return out if out is fake else out.clone(memory_format=torch.contiguous_format)

    def visit(obj: Any, key: Any = None) -> Any:
        if isinstance(obj, torch.Tensor):
            return convert(obj, key)
        if isinstance(obj, Mapping):
            items = {k: visit(v, k) for k, v in obj.items()}
            if isinstance(obj, MutableMapping):
                try:
                    new = copy.copy(obj)  # keeps the mapping's type (dict, BatchEncoding, ...)
                    for k, v in items.items():
                        new[k] = v
                    return new
                except Exception:  # noqa: BLE001 - an exotic mapping: a plain dict serves training_step
                    return items
            return items
        if isinstance(obj, (list, tuple)):
            parts = [visit(v) for v in obj]
            if isinstance(obj, list):
                return parts
            return type(obj)(*parts) if hasattr(obj, "_fields") else type(obj)(parts)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            new = copy.copy(obj)
            for f in dataclasses.fields(obj):
                object.__setattr__(new, f.name, visit(getattr(obj, f.name), f.name))  # frozen ones too
            return new
        return obj

    with fake_mode, values:
        return visit(batch), (rows, length)


# -- the step ----------------------------------------------------------------------------------------
def _loss_of(output: Any) -> torch.Tensor:
    """:func:`~lightning_seqmem.measure.steps.loss_of`, its refusal a dry-run reason."""
    try:
        return loss_of(output)
    except TypeError as exc:
        raise DryRunUnsupported(str(exc)) from None


def _autocast_off(device_type: str) -> ContextManager[Any]:
    """Leave the forward's autocast for a micro-batch's backward (as the micro-batching wrapper does)."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except (RuntimeError, TypeError):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False) if enabled else contextlib.nullcontext()


class _ZeroGradBeforeFirstMicroBatch:
    """The optimizer as the micro-batching wrapper drives it: zeroed before the first micro-batch.

    :func:`~lightning_seqmem.measure.steps.training_step_memory` calls ``zero_grad`` after the forward
    (Lightning's place for it); under micro-batching that call is skipped, since the gradients of
    the earlier micro-batches are already accumulated by then.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def step(self) -> None:
        self.optimizer.step()


def _micro_batch_counts(batch: Any, micro_batch_size: int, weighting: str, ignore_index: int) -> list[int]:
    """What each micro-batch's loss weighs (see :func:`~lightning_seqmem.mitigations.microbatch.micro_batch_counts`).

    Label tokens are counted from the batch's values (:class:`_BatchValues`); a batch whose labels
    have none (too large to keep) is weighted by samples: the weights are scalars, the memory is the same.
    """
    try:
        return micro_batch_counts(batch, micro_batch_size, weighting, ignore_index)[1]
    except DataDependentOutputException:
        return [infer_batch_shape(part)[0] for part in split_batch(batch, micro_batch_size)]


def _first_step_check(model: nn.Module, batch: Any, parts: list[Any], counts: list[int]) -> None:
    """The memory of the wrapper's one-time check of its first split batch (see
    :mod:`lightning_seqmem.mitigations.microbatch`): a copy of every buffer, then no-grad forwards
    of the first two counted micro-batches together and apart, while the previous step's gradients
    are still alive. Nothing is kept."""
    used = [i for i, c in enumerate(counts) if c > 0][:2]
    if len(used) < 2:
        return
    sizes = [infer_batch_shape(part)[0] for part in parts]
    pair = _slice(batch, sum(sizes), sum(sizes[: used[0]]), sum(sizes[used[0] : used[1] + 1]))
    copies = [b.detach().clone() for b in model.buffers()]
    with torch.no_grad():
        losses = [_plain_loss(model, part).detach() for part in (pair, *(parts[i] for i in used))]
    del copies, losses


def _micro_batched_loss(
    optimizer: torch.optim.Optimizer, micro_batch_size: int, weighting: str = "auto", ignore_index: int = IGNORE_INDEX,
    check: bool = False,
) -> Callable[[nn.Module, Any], torch.Tensor]:
    """``training_step`` per micro-batch, each loss weighted by its share ``c_i / C`` of what the loss averages over.

    Mirrors the wrapper of :mod:`lightning_seqmem.mitigations.microbatch` (its steady state; not
    with ``check``, also the memory of its one-time check of the first split batch, before any
    gradient is touched): count ``c_i`` (label tokens or samples), zero
    the gradients, backpropagate each micro-batch with ``c_i > 0`` but the last (autocast off),
    and return the last one's weighted loss (plus the others', detached) for the caller's
    backward. A batch with one micro-batch, or nothing counted, runs whole, zeroed after its
    forward as Lightning does.
    """

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        parts = split_batch(batch, micro_batch_size)
        counts = _micro_batch_counts(batch, micro_batch_size, weighting, ignore_index) if len(parts) > 1 else [1]
        used = [i for i, c in enumerate(counts) if c > 0]
        if len(parts) == 1 or not used:
            loss = _plain_loss(model, batch)
            optimizer.zero_grad(set_to_none=True)  # Lightning's zero_grad, after the forward
            return loss
        if check:
            _first_step_check(model, batch, parts, counts)
        total = sum(counts)
        optimizer.zero_grad(set_to_none=True)
        done: Optional[torch.Tensor] = None
        for i in used[:-1]:
            scaled = _plain_loss(model, parts[i]) * (counts[i] / total)
            with _autocast_off(scaled.device.type), deferred_gradient_reduction(model):
                scaled.backward()
            done = scaled.detach() if done is None else done + scaled.detach()
            del scaled
        scaled = _plain_loss(model, parts[used[-1]]) * (counts[used[-1]] / total)
        return scaled if done is None else scaled + done

    return loss_fn


def _plain_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return _loss_of(model.training_step(batch, 0))


def _user_frame(tb: Any) -> str:
    """``file:line in function`` of the innermost frame outside torch and this package, or ''."""
    skip = ("/torch/", "/lightning_seqmem/dryrun/step.py", "/lightning_seqmem/measure/steps.py", "/lightning_seqmem/measure/probes.py")
    frames = [f for f in traceback.extract_tb(tb) if not any(s in f.filename.replace("\\", "/") for s in skip)]
    if not frames:
        return ""
    f = frames[-1]
    return f" (at {f.filename}:{f.lineno} in {f.name}: `{(f.line or '').strip()}`)"


def _reason(exc: BaseException) -> str:
    where = _user_frame(exc.__traceback__)
    if isinstance(exc, DataDependentOutputException):
        return (
            f"an op reads tensor values ({exc.func}; e.g. `.item()`, `.tolist()` or `if tensor:` on a value computed "
            f"in the step), which fake tensors do not have{where}"
        )
    if isinstance(exc, DynamicOutputShapeException):
        return (
            f"an op's output shape depends on tensor values ({exc.func}; e.g. `nonzero`, boolean-mask indexing, "
            f"`unique`), which fake tensors do not have{where}"
        )
    if isinstance(exc, UnsupportedOperatorException):
        return f"op {exc.func} has no fake (meta) kernel{where}"
    return f"the fake step failed: {type(exc).__name__}: {exc}{where}"


def _device_of(module: nn.Module) -> torch.device:
    first = next(iter(module.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def _fake_module_and_optimizer(
    pl_module: nn.Module, optimizer: Any, names: tuple[str, ...], device: torch.device, fake_mode: FakeTensorMode,
    values: Optional["_BatchValues"] = None,
) -> tuple[nn.Module, torch.optim.Optimizer, CopyPlan]:
    """The fake copy on ``device`` with the asked rungs, its optimizer, and what its step becomes."""
    notes: list[str] = []
    model = _fake_copy(pl_module, fake_mode, values)
    with fake_mode:
        if device != _device_of(pl_module):
            notes.append(f"moved {_device_of(pl_module)} -> {device}")
            try:
                model = model.to(device)
            except Exception as exc:  # noqa: BLE001 - e.g. a CPU-only build asked for CUDA
                raise DryRunUnsupported(
                    f"cannot simulate {device} for a module on {_device_of(pl_module)} with this torch build "
                    f"({type(exc).__name__}: {exc}); run the dry run where the module lives"
                ) from exc
        twins = {id(real): fake for real, fake in zip(pl_module.parameters(), model.parameters())}
        fake_optimizer = _configured_optimizer(model) if optimizer is None else _rebuild_optimizer(optimizer, twins)
        plan = ladder.apply_to_copy(names, model)  # after the optimizer: the rungs keep parameter identity
    plan.notes[:0] = notes
    return model, fake_optimizer, plan


def _step_functions(
    pl_module: nn.Module, optimizer: torch.optim.Optimizer, plan: CopyPlan, batch_size: int,
    first_split_check: Optional[bool] = None,
) -> tuple[Callable[[nn.Module, Any], torch.Tensor], Any]:
    """``(loss_fn, optimizer)`` for :func:`~lightning_seqmem.measure.steps.training_step_memory`: plain or micro-batched.

    ``first_split_check``: whether the step includes micro-batching's one-time loss check; None:
    when the rung is switched on by this dry run, or the module's wrapper has not run it yet."""
    notes, micro_batch_size = plan.notes, plan.micro_batch_size
    policy = MicroBatching(micro_batch_size or 1)  # the rung's weighting
    check = micro_batch_size is not None and policy.verify  # switched on now: its first split batch is checked
    if micro_batch_size is None and is_micro_batching(pl_module):
        check = micro_batching_check_pending(pl_module)
        policy = pl_module.__dict__["training_step"]  # the wrapper: its size and weighting
        micro_batch_size = int(policy.micro_batch_size)
    if first_split_check is not None:
        check = first_split_check
        notes.append(f"the module micro-batches ({micro_batch_size} per micro-batch)")
    if micro_batch_size is None:
        return _plain_loss, optimizer
    if batch_size <= micro_batch_size:
        notes.append(f"microbatch: batch size {batch_size} is already at most {micro_batch_size}")
        return _plain_loss, optimizer
    notes.append(f"microbatch: {math.ceil(batch_size / micro_batch_size)} micro-batches of {micro_batch_size}")
    weighting, ignore_index = getattr(policy, "weighting", "auto"), getattr(policy, "ignore_index", IGNORE_INDEX)
    loss_fn = _micro_batched_loss(optimizer, micro_batch_size, weighting, ignore_index, check)
    if check:
        notes.append("microbatch: with the one-time check of the first split batch")
    return loss_fn, _ZeroGradBeforeFirstMicroBatch(optimizer)


def _state_after_a_step(model: nn.Module, optimizer: Any) -> None:
    """Gradients and optimizer state as a first real step leaves them, without running it: a zero
    gradient for every trainable parameter, then one optimizer step (creating its state). Half the
    cost of a warm-up forward and backward, and the same storages alive when the measured step starts."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()


def dry_run_step(
    pl_module: nn.Module,
    optimizer: Optional[Any],
    batch: Any,
    seq_len: int,
    batch_size: Optional[int] = None,
    mitigations: Sequence[str] = (),
    autocast: Optional[Callable[[], ContextManager[Any]]] = None,
    device: Optional[torch.device | str] = None,
) -> DryRunResult:
    """Peak memory of one training step of ``pl_module`` at ``(seq_len, batch_size)``, on fake tensors.

    Args:
        pl_module: a ``LightningModule`` (any ``nn.Module`` with ``training_step(batch, batch_idx)``
            returning a loss tensor or a dict with ``"loss"``). Left untouched, with its optimizer
            and the torch random number generators.
        optimizer: the optimizer training it (a ``torch.optim.Optimizer`` or Lightning's wrapper);
            a fresh one of the same class, defaults and param-group hyperparameters is built over
            the copy. ``None``: the copy's own ``configure_optimizers()`` (its first optimizer).
        batch: a training batch (a tensor of token ids, or a mapping / list / tuple holding one;
            see :func:`~lightning_seqmem.measure.batch.infer_batch_shape`). Its rows are cut or repeated
            to ``batch_size``, its sequence tensors cut or tiled to ``seq_len`` (see
            :func:`_shape_batch`); any length will do, values do not matter.
        seq_len: tokens per sample of the step to simulate.
        batch_size: samples in the step; ``None``: the batch's own.
        mitigations: names from :data:`~lightning_seqmem.mitigations.ladder.MITIGATIONS`, applied
            to the copy: ``"attention"``, ``"checkpointing"``, ``"microbatch"`` (micro-batches of 1).
            A module already micro-batched by :class:`~lightning_seqmem.mitigations.microbatch.MicroBatching`
            is simulated with its micro-batch size.
        autocast: a zero-argument factory of the context the forward runs in (the precision
            plugin's ``forward_context``, e.g. ``lambda: torch.autocast("cpu", dtype=torch.bfloat16)``).
        device: the device to simulate; default that of the module's first parameter. A device
            other than the module's must be one this torch build supports.

    Returns:
        a :class:`DryRunResult` of the second of two fake steps (the first creates gradients
        and optimizer state, as the warm-up steps of a real run do).

    Raises:
        DryRunUnsupported: the module cannot run on fake tensors (the reason names the op and the
            line of user code when known), is compiled, or uses manual optimization.
        ValueError, TypeError: bad arguments.
    """
    started = time.perf_counter()
    seq_len = check_int("seq_len", seq_len)
    names = check_mitigations(list(mitigations))
    _check_module(pl_module)
    source_rows, _ = infer_batch_shape(batch)
    batch_size = source_rows if batch_size is None else check_int("batch_size", batch_size)
    module_device = _device_of(pl_module)
    device = module_device if device is None else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", module_device.index if module_device.type == "cuda" else 0)

    with _preserved_rng(), warnings.catch_warnings():
        for message in _QUIET:
            warnings.filterwarnings("ignore", message=".*" + re.escape(message))
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        values = _BatchValues(fake_mode, value_max_bytes(seq_len))
        try:
            model, fake_optimizer, plan = _fake_module_and_optimizer(pl_module, optimizer, names, device, fake_mode,
                                                                      values)
            notes = plan.notes
            step_batch, source_shape = _shape_batch(batch, seq_len, batch_size, fake_mode, values)
            with fake_mode, values:  # as Lightning moves the batch to the module's device
                step_batch = _to_device(step_batch, device)
            loss_fn, step_optimizer = _step_functions(pl_module, fake_optimizer, plan, batch_size)
            probe = make_probe("tracker", device)
            if device.type == "cuda":
                probe.scratch = cuda_kernel_scratch_bytes
            with fake_mode, values, _transformers_without_fake_detection():
                _state_after_a_step(model, fake_optimizer)
                memory = training_step_memory(
                    model, step_optimizer, step_batch, loss_fn, probe, record_events=True, context=autocast
                )
        except DryRunUnsupported:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure of the fake run is a reason
            failure = _reason(exc)
            traceback.clear_frames(exc.__traceback__)  # the step's frames held the half-built fake world
            del exc
            model = fake_optimizer = step_batch = loss_fn = step_optimizer = probe = values = fake_mode = None
            gc.collect()  # its cycles (fake tensors, their mode, the tracker) freed now, not in a later collection
            raise DryRunUnsupported(failure) from None
    assert memory is not None and memory.events is not None
    block = allocator_block_bytes(device)
    peak, phase_peaks = replay_peaks(memory.events, block)
    resident = 0
    if device.type == "cuda" and module_device == device and torch.cuda.is_available():
        warm_cuda_workspaces(device)
        real_optimizer = None if optimizer is None else _unwrap_optimizer(optimizer)
        resident = resident_bytes(device, existing_tensors(pl_module, [real_optimizer] if real_optimizer else [], batch))
    peak += resident
    phase_peaks = {p: phase_peaks[p] + resident for p in PHASES if p in phase_peaks}
    detail = (
        f"a fake step of {type(pl_module).__name__} on {device} (after a zero-gradient optimizer step) with {type(fake_optimizer).__name__}, "
        f"batch {source_shape} -> ({batch_size}, {seq_len})"
        + (f"; {'; '.join(notes)}" if notes else "")
        + f"; live storages counted by LiveTensorTracker{', 512-byte blocks' if block > 1 else ''}"
        + (f"; plus {resident} bytes the allocator holds outside the step's tensors" if resident else "")
    )
    return DryRunResult(
        seq_len=seq_len,
        batch_size=batch_size,
        mitigations=names,
        peak_bytes=peak,
        phase_peak_bytes=phase_peaks,
        seconds=time.perf_counter() - started,
        detail=detail,
        resident_bytes=resident,
    )


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, MutableMapping):
        for k in list(obj):
            obj[k] = _to_device(obj[k], device)
        return obj
    if isinstance(obj, list):
        return [_to_device(v, device) for v in obj]
    if isinstance(obj, tuple):
        parts = [_to_device(v, device) for v in obj]
        return type(obj)(*parts) if hasattr(obj, "_fields") else type(obj)(parts)
    return obj
