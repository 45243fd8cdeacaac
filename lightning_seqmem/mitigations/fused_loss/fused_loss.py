"""The ``"fused_loss"`` rung: a causal LM's loss without its logits ever materialised whole.

A causal LM's loss, ``cross_entropy(hidden @ lm_head.weight.T, labels)``, holds ``[tokens, vocab]``
float32 logits, their log-softmax saved for backward and their gradient, each larger than the rest
of a step once attention is linear (16K tokens x 248K vocabulary: 16 GB per copy). A fused linear
cross-entropy computes the same loss (micro-batching's weighting by label tokens holds) and
gradients a block of tokens at a time, keeping only the ``[tokens, d_model]`` and
``[vocab, d_model]`` gradients. Backends, picked by device at switch-on: ``cce`` (Apple's Cut
Cross-Entropy, the ``fused`` extra) and ``liger`` (Liger-Kernel) on CUDA with triton; ``tiled``
(DeepSpeed's eager ``TiledFusedLogitsLoss``, the ``tiled`` extra) on every device, in token shards
(:func:`tiled_shards`), gradients made in the forward. A dry run runs ``tiled`` (eager: fake tensors
work), on CUDA standing in for ``cce``/``liger`` (triton needs real tensors; their memory is at most
``tiled``'s); on the simulated CUDA device ``"auto"``'s ``cce`` is modelled (:mod:`.kernels_loss`).

Two kinds of model take it, found top-down: Hugging Face ``*ForCausalLM`` models (with a bias-free
``lm_head`` and a base model; those scaling or capping their logits, Gemma, Cohere, Granite,
refused), their instance's ``forward`` patched (:mod:`.fused_loss_hf`); and modules of the
*fused-loss protocol*, as :class:`lightning_seqmem.reference.nn.GPT` (``GPT.loss``)::

      class MyLM(nn.Module):
          fused_loss = None                      # set by the rung; None: the plain loss

          def set_fused_loss(self, fn):
              self.fused_loss = fn

          def loss(self, input_ids, labels):
              hidden = self.body(input_ids)      # [batch, length, d_model]
              if self.fused_loss is not None:    # fn(hidden, weight, labels, ignore_index=-100)
                  return self.fused_loss(hidden, self.lm_head.weight, labels)
              return F.cross_entropy(self.lm_head(hidden).flatten(0, 1), labels.flatten())

Example:
    >>> import torch
    >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
    >>> model = GPT(GPTConfig(vocab_size=512, n_layer=1, d_model=32, n_head=2))
    >>> ids, labels = torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 16))
    >>> plain = model.loss(ids, labels)
    >>> result = FusedLossRung().apply(RungContext(model))
    >>> result.applied, result.after, FusedLossRung().is_on(model)
    (True, 'tiled', True)
    >>> bool(torch.allclose(model.loss(ids, labels), plain, atol=1e-5))
    True
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_seqmem.core.rungs import RungNotApplicable
from lightning_seqmem.mitigations.attention.attention import is_hf_pretrained_model
from lightning_seqmem.mitigations.base import (CopyPlan, MitigationResult, Rung, RungContext,
                                               device_type_of, find_top_down)
from lightning_seqmem.mitigations.fused_loss.fused_loss_hf import (
    hf_refusal, hf_refusals, hf_fused_loss_of, hf_switch_off, hf_switch_on)
from lightning_seqmem.mitigations.microbatch.microbatch_functional import IGNORE_INDEX
from lightning_seqmem.mitigations.fused_loss.fused_loss_spec import SPEC

__all__ = ["FUSED_LOSS_BACKENDS", "FusedLinearCrossEntropy", "FusedLossRung",
           "backend_unavailable_reason", "find_fused_loss_targets", "fused_loss_backend",
           "register_modelled_backends", "resolve_backend", "tiled_shards"]

FUSED_LOSS_BACKENDS = ("auto", "cce", "liger", "tiled")
"""Values of ``FusedLinearCrossEntropy(backend=...)``; ``"auto"``: :func:`resolve_backend`."""

_INSTALL = {"cce": "pip install 'lightning-seqmem[fused]' (cut-cross-entropy)",
            "liger": "pip install liger-kernel",
            "tiled": "pip install 'lightning-seqmem[tiled]' (deepspeed)"}
_MODULE = {"cce": "cut_cross_entropy", "liger": "liger_kernel", "tiled": "deepspeed"}
_MODELLED: dict[str, dict[str, Callable[..., torch.Tensor]]] = {}  # device type -> backend -> model


def register_modelled_backends(device_type: str,
                               backends: dict[str, Callable[..., torch.Tensor]]) -> None:
    """Run ``backends`` modelled on ``device_type`` (the dry run's simulated CUDA), as ``fn(hidden
    [N, d], weight [V, d], labels [N], ignore_index) -> summed loss``; ``"auto"`` picks as on CUDA.

    Example:
        >>> register_modelled_backends("example", {"cce": lambda h, w, y, i: h.sum()})
        >>> backend_unavailable_reason("cce", "example") is None, resolve_backend("example")
        (True, 'cce')
        >>> del _MODELLED["example"]
    """
    _MODELLED[device_type] = dict(backends)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # pragma: no cover - a broken install
        return False


def backend_unavailable_reason(backend: str, device_type: str) -> Optional[str]:
    """Why ``backend`` cannot run on ``device_type`` here (with what to install), or None.

    Example:
        >>> backend_unavailable_reason("cce", "cpu")
        'cce needs CUDA (its kernels are triton), the model is on cpu'
        >>> backend_unavailable_reason("tiled", "cpu") is None  # deepspeed is installed here
        True
    """
    if backend not in FUSED_LOSS_BACKENDS[1:]:
        raise ValueError(f"`backend` must be one of {FUSED_LOSS_BACKENDS[1:]}, got {backend!r}.")
    if backend in _MODELLED.get(device_type, {}):
        return None
    if backend in ("cce", "liger"):
        if device_type != "cuda":
            return f"{backend} needs CUDA (its kernels are triton), the model is on {device_type}"
        if not _installed("triton"):
            return f"{backend} needs triton: pip install triton"
    if not _installed(_MODULE[backend]):
        return f"{backend} is not installed: {_INSTALL[backend]}"
    return None


def resolve_backend(device_type: str) -> Optional[str]:
    """``"auto"``'s pick on ``device_type``: cce, liger on CUDA (or modelled), else tiled; or None.

    Example:
        >>> resolve_backend("cpu")
        'tiled'
    """
    cuda_like = device_type == "cuda" or device_type in _MODELLED
    order = ("cce", "liger", "tiled") if cuda_like else ("tiled",)
    return next((b for b in order if backend_unavailable_reason(b, device_type) is None), None)


def _none_installed_reason(device_type: str) -> str:
    if device_type == "cuda":
        return (f"no fused cross-entropy library is installed: {_INSTALL['cce']}, "
                f"or {_INSTALL['tiled']}")
    return f"no fused cross-entropy library for {device_type} is installed: {_INSTALL['tiled']}"


MIN_SHARD_LOGITS = 1 << 20
"""A ``tiled`` shard's fewest logits (4 MiB float32): fewer loops where hidden states are tiny."""


def tiled_shards(tokens: int, d_model: int, vocab_size: int) -> int:
    """Shards ``tiled`` cuts ``tokens`` into (Liger's rule): ``ceil(vocab / d_model)``, each of a
    power-of-two length, logits about the hidden states' size, at least :data:`MIN_SHARD_LOGITS`.

    Example:
        >>> tiled_shards(16384, 4096, 131072)  # Llama-3-8B at 16K tokens: 32 shards of 512 tokens
        32
        >>> tiled_shards(512, 64, 8192), tiled_shards(100, 64, 8192)
        (4, 1)
    """
    factor = max(1, math.ceil(vocab_size / max(1, d_model)))
    shard_tokens = max(math.ceil(tokens / factor), math.ceil(MIN_SHARD_LOGITS / max(1, vocab_size)))
    shard_tokens = 1 << max(0, math.ceil(math.log2(shard_tokens)))
    return max(1, math.ceil(tokens / shard_tokens))


def _tiled_fused_logits_loss() -> Any:
    """DeepSpeed's ``TiledFusedLogitsLoss``, imported without its accelerator warning on stdout."""
    if "deepspeed" not in sys.modules and "DS_ACCELERATOR" not in os.environ:
        os.environ["DS_ACCELERATOR"] = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            from deepspeed.accelerator import get_accelerator

            get_accelerator()  # cached from now on
        finally:
            del os.environ["DS_ACCELERATOR"]
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    return TiledFusedLogitsLoss


class _SavedTensors:
    """A stand-in for an autograd ``ctx``: DeepSpeed's forward saves its input gradient here."""

    saved: tuple = ()

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved = tensors


class _TiledLinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T`` by DeepSpeed's ``TiledFusedLogitsLoss`` on a
    detached weight: its forward adds the weight's gradient to ``param.grad`` (``zero_grad`` would
    erase it, micro-batch weights not scale it); both gradients are kept for backward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                ignore_index: int, shards: int) -> torch.Tensor:
        TiledFusedLogitsLoss = _tiled_fused_logits_loss()
        x = hidden.detach().requires_grad_(ctx.needs_input_grad[0])
        w = weight.detach().requires_grad_(ctx.needs_input_grad[1])

        def shard_loss(_: Any, x_shard: torch.Tensor, y_shard: torch.Tensor) -> torch.Tensor:
            logits = F.linear(x_shard, w).float()
            return F.cross_entropy(logits, y_shard, ignore_index=ignore_index, reduction="sum")

        saved = _SavedTensors()
        # its forward alone (its backward reads the incoming gradient's value: not on fake tensors)
        loss = TiledFusedLogitsLoss.forward(saved, shard_loss, None, x.unsqueeze(0),
                                            labels.unsqueeze(0), None, shards, [w], "sum")
        x_grad = saved.saved[0].squeeze(0) if saved.saved else None
        ctx.save_for_backward(x_grad, w.grad)
        return loss.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x_grad, w_grad = ctx.saved_tensors
        return (None if x_grad is None else x_grad * grad.to(x_grad.dtype),
                None if w_grad is None else w_grad * grad.to(w_grad.dtype), None, None, None)


class FusedLinearCrossEntropy:
    """``cross_entropy(hidden @ weight.T, labels)`` without the logits, by ``backend`` (``"auto"``:
    :func:`resolve_backend` of the weight's device per call), called as ``fn(hidden [..., d], weight
    [vocab, d], labels [...], ignore_index=-100, reduction="mean", num_items_in_batch=None)``: the
    mean over labels not ``ignore_index``, the sum, or the sum / ``num_items_in_batch`` where given.

    Example:
        >>> import torch
        >>> hidden, weight = torch.randn(2, 8, 16, requires_grad=True), torch.randn(300, 16)
        >>> labels = torch.randint(0, 300, (2, 8)); labels[0, :3] = -100
        >>> fused = FusedLinearCrossEntropy("tiled")(hidden, weight, labels)
        >>> plain = F.cross_entropy((hidden @ weight.T).flatten(0, 1), labels.flatten())
        >>> bool(torch.allclose(fused, plain, atol=1e-5))
        True
        >>> FusedLinearCrossEntropy("xla")
        Traceback (most recent call last):
        ...
        ValueError: `backend` must be one of ('auto', 'cce', 'liger', 'tiled'), got 'xla'.
    """

    def __init__(self, backend: str = "auto") -> None:
        if backend not in FUSED_LOSS_BACKENDS:
            raise ValueError(f"`backend` must be one of {FUSED_LOSS_BACKENDS}, got {backend!r}.")
        self.backend = backend

    def resolve(self, device_type: str) -> str:
        """The backend a call on ``device_type`` runs (raises with what to install if none can)."""
        backend = self.backend if self.backend != "auto" else resolve_backend(device_type)
        if backend is None:
            raise RuntimeError(_none_installed_reason(device_type))
        why = backend_unavailable_reason(backend, device_type)
        if why is not None:
            raise RuntimeError(why)
        return backend

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                 ignore_index: int = IGNORE_INDEX, reduction: str = "mean",
                 num_items_in_batch: Any = None) -> torch.Tensor:
        if reduction not in ("mean", "sum"):
            raise ValueError(f"`reduction` must be 'mean' or 'sum', got {reduction!r}.")
        if hidden.shape[:-1] != labels.shape or hidden.shape[-1] != weight.shape[-1]:
            raise ValueError("`hidden` [..., d] and `labels` [...] must share their leading shape "
                             f"and `weight` be [vocab, d], got hidden {tuple(hidden.shape)}, "
                             f"labels {tuple(labels.shape)}, weight {tuple(weight.shape)}.")
        h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).to(hidden.device)
        backend = self.resolve(weight.device.type)
        # triton kernels take one dtype: cast as F.linear under autocast would
        if backend != "tiled" and torch.is_autocast_enabled(h.device.type):
            dtype = torch.get_autocast_dtype(h.device.type)
            h, weight = h.to(dtype), weight.to(dtype)
        modelled = _MODELLED.get(weight.device.type, {}).get(backend)
        if modelled is not None:
            total = modelled(h, weight, y, ignore_index)
        elif backend == "cce":
            from cut_cross_entropy import linear_cross_entropy

            total = linear_cross_entropy(h, weight, y, ignore_index=ignore_index, reduction="sum",
                                         impl="cce")
        elif backend == "liger":
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

            total = liger_fused_linear_cross_entropy(h, weight, y, ignore_index=ignore_index,
                                                     reduction="sum")
        else:
            total = _TiledLinearCrossEntropy.apply(
                h, weight, y, ignore_index, tiled_shards(h.shape[0], h.shape[1], weight.shape[0]))
        total = total.float()
        if num_items_in_batch is not None:
            return total / (num_items_in_batch.to(total.device)
                            if torch.is_tensor(num_items_in_batch) else num_items_in_batch)
        return total if reduction == "sum" else total / (y != ignore_index).sum()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(backend={self.backend!r})"


def _implements_protocol(module: nn.Module) -> bool:
    return callable(getattr(module, "set_fused_loss", None))


def find_fused_loss_targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of the targets in ``model`` (the module's two kinds), top-down.

    Example:
        >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
        >>> wrapper = nn.ModuleDict({"net": GPT(GPTConfig(n_layer=1, d_model=32, n_head=2))})
        >>> [n for n, _ in find_fused_loss_targets(wrapper)]
        ['net']
    """
    def take(module: nn.Module) -> Optional[bool]:
        if is_hf_pretrained_model(module):
            return hf_refusal(module) is None
        return True if _implements_protocol(module) else None

    return find_top_down(model, take)


def _fn_of(target: nn.Module) -> Any:
    """The fused loss a target runs, or None (the plain loss)."""
    return (hf_fused_loss_of(target) if is_hf_pretrained_model(target)
            else getattr(target, "fused_loss", None))


def fused_loss_backend(model: nn.Module) -> Optional[str]:
    """The backend the fused loss of ``model`` runs (``"tiled"``, ...), ``"mixed"``, or None (off).

    Example:
        >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
        >>> fused_loss_backend(GPT(GPTConfig(n_layer=1, d_model=32, n_head=2))) is None
        True
    """
    found = {getattr(fn, "backend", "custom") for _, t in find_fused_loss_targets(model)
             if (fn := _fn_of(t)) is not None}
    if not found:
        return None
    return found.pop() if len(found) == 1 else "mixed"


def _switch(target: nn.Module, fn: Optional[FusedLinearCrossEntropy]) -> None:
    """Put ``fn`` on ``target`` (None: the plain loss back)."""
    if not is_hf_pretrained_model(target):
        target.set_fused_loss(fn)
    elif fn is None:
        hf_switch_off(target)
    else:
        hf_switch_on(target, fn)


class FusedLossRung(Rung):
    """The ``"fused_loss"`` rung: :class:`FusedLinearCrossEntropy` of ``backend``.

    Example:
        >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
        >>> model = GPT(GPTConfig(vocab_size=512, n_layer=1, d_model=32, n_head=2))
        >>> rung = FusedLossRung()
        >>> rung.is_applicable(RungContext(model))  # doctest: +NORMALIZE_WHITESPACE
        (True, 'plain -> fused linear cross-entropy (tiled, DeepSpeed TiledFusedLogitsLoss)
        on <root>')
        >>> rung.apply(RungContext(model)).detail
        'loss plain -> fused linear cross-entropy (tiled, DeepSpeed TiledFusedLogitsLoss) on <root>'
        >>> rung.remove(RungContext(model)).after, rung.is_on(model)
        ('plain', False)
    """

    spec = SPEC
    _LIBRARY = {"cce": "Apple Cut Cross-Entropy", "liger": "Liger-Kernel",
                "tiled": "DeepSpeed TiledFusedLogitsLoss"}

    def __init__(self, backend: str = "auto") -> None:
        self.backend = FusedLinearCrossEntropy(backend).backend  # raises for an unknown one

    def _backend(self, model: nn.Module) -> tuple[Optional[str], str]:
        device = device_type_of(model)
        if self.backend == "auto":
            chosen = resolve_backend(device)
            return chosen, ("" if chosen else _none_installed_reason(device))
        why = backend_unavailable_reason(self.backend, device)
        return (None, why) if why else (self.backend, "")

    def is_on(self, module: nn.Module) -> bool:
        return fused_loss_backend(module) is not None

    def is_applicable(self, ctx: RungContext) -> tuple[bool, str]:
        model = ctx.pl_module
        targets = find_fused_loss_targets(model)
        if not targets:
            refused = hf_refusals(model)
            return False, (refused[0] if refused else
                           "no causal LM found: neither a Hugging Face *ForCausalLM model nor a "
                           "module with set_fused_loss(fn) (the fused-loss protocol of "
                           "lightning_seqmem.mitigations.fused_loss.fused_loss)")
        if all(_fn_of(t) is not None for _, t in targets):
            return False, f"already on {fused_loss_backend(model)}"
        backend, why = self._backend(model)
        if backend is None:
            return False, why
        names = ", ".join(n or "<root>" for n, _ in targets)
        return True, (f"plain -> fused linear cross-entropy ({backend}, "
                      f"{self._LIBRARY[backend]}) on {names}")

    def apply(self, ctx: RungContext) -> MitigationResult:
        applies, why = self.is_applicable(ctx)
        if not applies:
            state = fused_loss_backend(ctx.pl_module) or "plain"
            return MitigationResult(self.name, False, why, state, state)
        backend, _ = self._backend(ctx.pl_module)
        self._put_on(ctx.pl_module, backend)
        return MitigationResult(self.name, True, f"loss {why}", "plain", backend)

    @staticmethod
    def _put_on(model: nn.Module, backend: str) -> None:
        fn = FusedLinearCrossEntropy(backend)
        for _, target in find_fused_loss_targets(model):
            if _fn_of(target) is None:
                _switch(target, fn)

    def remove(self, ctx: RungContext) -> Optional[MitigationResult]:
        before = fused_loss_backend(ctx.pl_module) or "plain"
        for _, target in find_fused_loss_targets(ctx.pl_module):
            if _fn_of(target) is not None:
                _switch(target, None)
        return MitigationResult(self.name, before != "plain", f"loss {before} -> plain", before,
                                "plain")

    def apply_to_copy(self, copy: Any, plan: CopyPlan) -> None:
        """Put on ``tiled``, or the run's pick where cce/liger run modelled (see the module)."""
        applies, why = self.is_applicable(RungContext(copy))
        if not applies:
            if not self.is_on(copy):  # the step would be the plain loss's: not this setting's
                raise RungNotApplicable(self.name, why)
            plan.notes.append(f"{self.name}: {why}")
            return
        backend, _ = self._backend(copy)
        modelled = _MODELLED.get(device_type_of(copy), {})
        if backend in modelled:
            self._put_on(copy, backend)
            plan.notes.append(f"{self.name}: loss plain -> {backend} ({self._LIBRARY[backend]}, "
                              "modelled: its allocations on the simulated CUDA device)")
            return
        if backend_unavailable_reason("tiled", device_type_of(copy)) is not None:
            raise RungNotApplicable(self.name, f"{backend} on the model; the dry run needs tiled: "
                                               f"{_INSTALL['tiled']}")
        self._put_on(copy, "tiled")
        stand_in = ("" if backend == "tiled"
                    else f" (standing in for {backend}, whose memory is at most tiled's)")
        plan.notes.append(f"{self.name}: loss plain -> tiled{stand_in}")

    __repr__ = FusedLinearCrossEntropy.__repr__

RUNG = FusedLossRung
"""This folder's rung (what :data:`~lightning_seqmem.core.rungs.RUNG_FOLDERS` names)."""
