"""Switch the attention kernel of a model to one without the ``L x L`` score matrix.

Two kinds of model can be switched (see the folder's card for why), found top-down:

* Hugging Face ``PreTrainedModel`` (duck-typed: a ``set_attn_implementation`` method and a
  ``config``), through ``set_attn_implementation("sdpa" | "flash_attention_2" | "eager")``;
* any module with a callable ``set_attention_backend(backend, sdpa_backends=None)``, such as
  :class:`lightning_seqmem.reference.nn.GPT`; its backend is read from ``attention_backend``.

Example:
    >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
    >>> model = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2))
    >>> AttentionSwitch("sdpa").apply(model).after
    'sdpa'
    >>> AttentionSwitch("sdpa").is_applicable(model)
    (False, 'already on sdpa')
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_seqmem.mitigations.base import MitigationResult, ModulePolicyRung, find_top_down
from lightning_seqmem.mitigations.attention.attention_spec import SPEC

__all__ = ["ATTENTION_SWITCH_BACKENDS", "AttentionRung", "AttentionSwitch",
           "current_attention_backend", "find_attention_targets", "flash_unavailable_reason",
           "is_hf_pretrained_model", "register_modelled_flash", "sdpa_kernel_context"]

ATTENTION_SWITCH_BACKENDS = ("auto", "eager", "sdpa", "flash")
"""Values of ``AttentionSwitch(backend=...)``; ``"auto"``: flash if it can run, else sdpa."""

_HF_IMPLEMENTATION = {"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2"}
_HALF_DTYPES = (torch.float16, torch.bfloat16)
_NO_TARGET_REASON = ("no attention module implements set_attention_backend and the model is not a "
                     "Hugging Face PreTrainedModel")
_MODELLED_FLASH: dict[str, Callable[[], str]] = {}  # device type -> HF name of its modelled flash


def register_modelled_flash(device_type: str, implementation: Callable[[], str]) -> None:
    """On ``device_type`` (the dry run's simulated CUDA, :mod:`lightning_seqmem.dryrun.kernels`) the
    ``"flash"`` switch gives Hugging Face models ``implementation()``, a modelled flash-attn.

    Example:
        >>> register_modelled_flash("example", lambda: "flash_attention_2_modelled")
        >>> _MODELLED_FLASH.pop("example")()
        'flash_attention_2_modelled'
    """
    _MODELLED_FLASH[device_type] = implementation


def is_hf_pretrained_model(module: nn.Module) -> bool:
    """Whether ``module`` looks like a Hugging Face ``PreTrainedModel`` (no transformers import):
    its class has ``set_attn_implementation``. A wrapper that forwards unknown attributes to the
    model it wraps (PEFT's ``PeftModel``, ``LoraModel``) is not one: the rungs look inside it.

    Example:
        >>> is_hf_pretrained_model(nn.Linear(2, 2))
        False
    """
    switch = getattr(type(module), "set_attn_implementation", None)  # the class's, not forwarded
    return callable(switch) and hasattr(module, "config")


def _implements_protocol(module: nn.Module) -> bool:
    return callable(getattr(module, "set_attention_backend", None))


def find_attention_targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of each module whose attention kernel can be switched, found
    top-down (:func:`.find_top_down`): a protocol ``GPT``, not its attention layers.

    Example:
        >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
        >>> wrapper = nn.ModuleDict({"net": GPT(GPTConfig(n_layer=2, d_model=32, n_head=2))})
        >>> [name for name, _ in find_attention_targets(wrapper)]
        ['net']
    """
    return find_top_down(
        model, lambda m: True if is_hf_pretrained_model(m) or _implements_protocol(m) else None)


def _backend_of(target: nn.Module) -> str | None:
    if is_hf_pretrained_model(target):
        implementation = getattr(target.config, "_attn_implementation", None)
        if implementation is None:
            return None
        implementation = str(implementation)
        return "flash" if implementation.startswith("flash_attention") else implementation
    backend = getattr(target, "attention_backend", None)
    return backend if isinstance(backend, str) else None


def current_attention_backend(model: nn.Module) -> str | None:
    """The attention backend of ``model``'s switchable modules (Hugging Face
    ``"flash_attention_*"``: ``"flash"``); None if none or unreadable, ``"mixed"`` if they disagree.

    Example:
        >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
        >>> current_attention_backend(GPT(GPTConfig(n_layer=1, d_model=32, n_head=2)))
        'eager'
        >>> current_attention_backend(nn.Linear(2, 2)) is None
        True
    """
    backends = {_backend_of(target) for _, target in find_attention_targets(model)}
    if not backends or None in backends:
        return None
    return backends.pop() if len(backends) == 1 else "mixed"


def _first_parameter(model: nn.Module) -> torch.Tensor | None:
    return next(iter(model.parameters()), None)


def flash_unavailable_reason(model: nn.Module, check_dtype: bool = True) -> str | None:
    """Why flash-attn cannot run for ``model`` here, or ``None`` if it can.

    Args:
        model: its first parameter gives the device (and the dtype when ``check_dtype``).
        check_dtype: also require fp16/bf16 parameters. Off for an explicit request: fp32
            parameters under bf16 autocast (``"bf16-mixed"``) feed flash-attn half tensors.
    """
    param = _first_parameter(model)
    if param is not None and param.device.type in _MODELLED_FLASH:
        targets = find_attention_targets(model)
        others = [name or "<root>" for name, t in targets if not is_hf_pretrained_model(t)]
        if others:
            return (f"flash-attn is modelled on {param.device.type} for Hugging Face models only, "
                    f"not {', '.join(others)}")
        refusing = [type(t).__name__ for _, t in targets
                    if not getattr(t, "_supports_flash_attn", True)]
        if refusing:
            return f"{', '.join(refusing)} does not support flash attention"
    elif importlib.util.find_spec("flash_attn") is None:
        return "flash-attn not installed"
    elif not torch.cuda.is_available():
        return "CUDA not available"
    elif param is not None and param.device.type != "cuda":
        return f"model parameters are on {param.device.type}, flash-attn needs CUDA"
    if check_dtype and param is not None and param.dtype not in _HALF_DTYPES:
        return f"model parameters are {param.dtype}, flash-attn needs float16 or bfloat16"
    return None


def _hf_implementation(backend: str, target: nn.Module) -> str:
    """The Hugging Face attention implementation of ``backend`` for ``target`` (flash: the modelled
    one where its device has it)."""
    param = _first_parameter(target)
    if backend == "flash" and param is not None and param.device.type in _MODELLED_FLASH:
        return _MODELLED_FLASH[param.device.type]()
    return _HF_IMPLEMENTATION[backend]


def _check_sdpa_backends(
        sdpa_backends: Sequence[SDPBackend] | SDPBackend | None) -> list[SDPBackend] | None:
    if sdpa_backends is None:
        return None
    if isinstance(sdpa_backends, SDPBackend):
        sdpa_backends = [sdpa_backends]
    backends = list(sdpa_backends) if isinstance(sdpa_backends, Sequence) else None
    if not backends or not all(isinstance(b, SDPBackend) for b in backends):
        raise ValueError(
            "`sdpa_backends` must be None or a non-empty sequence of torch.nn.attention.SDPBackend "
            "(e.g. [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]), "
            f"got {sdpa_backends!r}.")
    return backends


@contextlib.contextmanager
def sdpa_kernel_context(backends: Sequence[SDPBackend] | SDPBackend | None) -> Iterator[None]:
    """Restrict ``scaled_dot_product_attention`` to ``backends`` (None: no-op) inside the block,
    e.g. the training step; the previous global flags are restored on exit, also on an error.

    Example:
        >>> with sdpa_kernel_context([SDPBackend.MATH]):
        ...     torch.backends.cuda.flash_sdp_enabled()
        False
        >>> torch.backends.cuda.flash_sdp_enabled()
        True
    """
    checked = _check_sdpa_backends(backends)
    if checked is None:
        yield
        return
    with sdpa_kernel(checked):  # restores the previous flags in its own ``finally``
        yield


def _describe(backend: str | None) -> str:
    return "unknown" if backend is None else backend


class AttentionSwitch:
    """Policy: switch every attention target of a model to a memory-efficient kernel.

    Args:
        backend: one of :data:`ATTENTION_SWITCH_BACKENDS`; ``"auto"``: ``"flash"`` where flash-attn
            is installed and the model's parameters are fp16/bf16 on CUDA, else ``"sdpa"``.
        sdpa_backends: ``SDPBackend`` values the ``"sdpa"`` kernel is restricted to, passed to
            ``set_attention_backend``; Hugging Face models: wrap the step in :meth:`kernel_context`.

    Example:
        >>> AttentionSwitch("xformers")
        Traceback (most recent call last):
        ...
        ValueError: `backend` must be one of ('auto', 'eager', 'sdpa', 'flash'), got 'xformers'.
    """

    name = "attention"

    def __init__(self, backend: str = "auto",
                 sdpa_backends: Sequence[SDPBackend] | None = None) -> None:
        if backend not in ATTENTION_SWITCH_BACKENDS:
            raise ValueError(
                f"`backend` must be one of {ATTENTION_SWITCH_BACKENDS}, got {backend!r}.")
        self.sdpa_backends = _check_sdpa_backends(sdpa_backends)
        if self.sdpa_backends is not None and backend in ("eager", "flash"):
            raise ValueError(
                "`sdpa_backends` applies only to backend 'sdpa' or 'auto', "
                f"got backend={backend!r} with sdpa_backends={self.sdpa_backends!r}.")
        self.backend = backend

    def resolve_backend(self, model: nn.Module) -> str:
        """The concrete backend ``apply`` would switch ``model`` to."""
        if self.backend != "auto":
            return self.backend
        return "flash" if flash_unavailable_reason(model, check_dtype=True) is None else "sdpa"

    def kernel_context(self) -> contextlib.AbstractContextManager[None]:
        """:func:`sdpa_kernel_context` with this policy's ``sdpa_backends`` (None: a no-op)."""
        return sdpa_kernel_context(self.sdpa_backends)

    def is_applicable(self, model: nn.Module) -> tuple[bool, str]:
        """``(True, "eager -> sdpa")`` if ``apply`` changes something, else ``(False, why)``."""
        if not find_attention_targets(model):
            return False, _NO_TARGET_REASON
        backend = self.resolve_backend(model)
        before = current_attention_backend(model)
        if before == "flash" and self.backend == "auto":
            return False, "already on flash"  # auto never trades flash for sdpa (even unchecked)
        if backend == "flash":
            reason = flash_unavailable_reason(model, check_dtype=False)
            if reason is not None:
                return False, reason
        if before == backend:
            return False, f"already on {backend}"
        return True, f"{before} -> {backend}"

    def apply(self, model: nn.Module) -> MitigationResult:
        """Switch in place; parameters, buffers and ``state_dict`` keys are untouched."""
        before = _describe(current_attention_backend(model))
        applicable, reason = self.is_applicable(model)
        if not applicable:
            return MitigationResult(self.name, applied=False, detail=reason, before=before,
                                    after=before)
        backend = self.resolve_backend(model)
        targets = find_attention_targets(model)
        try:
            for _, target in targets:
                if is_hf_pretrained_model(target):
                    target.set_attn_implementation(_hf_implementation(backend, target))
                elif backend == "sdpa" and self.sdpa_backends is not None:
                    target.set_attention_backend(backend, sdpa_backends=self.sdpa_backends)
                else:
                    target.set_attention_backend(backend)
        except (ValueError, RuntimeError, ImportError) as err:
            after = _describe(current_attention_backend(model))
            detail = f"switching to {backend} failed: {type(err).__name__}: {err}"
            return MitigationResult(self.name, applied=False, detail=detail, before=before,
                                    after=after)
        after = _describe(current_attention_backend(model))
        names = ", ".join(name or "<root>" for name, _ in targets)
        if after != backend:  # e.g. a Hugging Face model that cannot switch only logs a warning
            detail = f"asked for {backend} on {names} but the model reports {after}"
            return MitigationResult(self.name, applied=False, detail=detail, before=before,
                                    after=after)
        detail = f"attention {before} -> {after} on {names}"
        return MitigationResult(self.name, applied=True, detail=detail, before=before, after=after)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(backend={self.backend!r}, "
                f"sdpa_backends={self.sdpa_backends!r})")


class AttentionRung(ModulePolicyRung):
    """The ``"attention"`` rung: :class:`AttentionSwitch` (``"auto"``) as a :class:`.base.Rung`.

    Example:
        >>> from lightning_seqmem.mitigations.base import RungContext
        >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
        >>> model = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2))
        >>> rung = AttentionRung()
        >>> rung.apply(RungContext(model)).detail, rung.is_on(model)
        ('attention eager -> sdpa on <root>', True)
    """

    spec = SPEC

    def __init__(self, policy: AttentionSwitch | None = None) -> None:
        self.policy = policy or AttentionSwitch()

    def is_on(self, module: nn.Module) -> bool:
        return current_attention_backend(module) not in (None, "eager")

RUNG = AttentionRung
"""This folder's rung (what :data:`~lightning_seqmem.core.rungs.RUNG_FOLDERS` names)."""
