"""What is wrong in a traced step, and what attention costs: the article's FAQ and an ablation.

:func:`diagnose` turns the quadratic (L×L) tensors of a :class:`~.tracer.Breakdown` into findings
with their fix, each warned once as a :class:`MemoryDiagnosisWarning`. :func:`attention_ablation`
traces a step with every attention module replaced by identity and sets it beside the real step
(:class:`AttentionAblation`).
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from torch import nn

from lightning_seqmem.core.units import format_bytes
from lightning_seqmem.diagnostics.categories import find_attention_modules, module_infos
from lightning_seqmem.diagnostics.tracer import AllocationRecord, Breakdown, trace_breakdown
from lightning_seqmem.mitigations.checkpointing.checkpointing import is_checkpointed

__all__ = ["AttentionAblation", "MemoryDiagnosisWarning", "attention_ablation", "diagnose"]

_MATMUL_OPS = ("aten::bmm", "aten::mm", "aten::matmul", "aten::baddbmm", "aten::addmm",
               "aten::addbmm")


class MemoryDiagnosisWarning(UserWarning):
    """A memory problem found in a traced step, with its fix (see :func:`diagnose`)."""


def _example(records: list[AllocationRecord]) -> str:
    r = max(records, key=lambda x: x.nbytes)
    return f"{r.op} -> {list(r.shape)} {r.dtype} in `{r.module}`"


def diagnose(breakdown: Breakdown, model: nn.Module, autocast: Optional[bool] = None) -> list[str]:
    """The article's FAQ applied to a traced step, each finding returned and warned once
    (:class:`MemoryDiagnosisWarning`): attention scores in fp32 under mixed precision; a
    hand-written ``bmm``/``matmul`` materialising the L×L matrix (where SDPA would not); activation
    checkpointing configured but L×L tensors still saved for backward in the forward.
    ``autocast``: whether the step ran under autocast (``None``: what the trace saw)."""
    autocast = breakdown.autocast if autocast is None else autocast
    quads = [r for r in breakdown.tensors if r.quadratic]
    found: list[str] = []
    fp32 = [r for r in quads if r.dtype == "float32"]
    if autocast and fp32:
        found.append(
            f"Attention scores in float32 under mixed precision: {len(fp32)} L×L float32 tensors "
            f"({format_bytes(sum(r.nbytes for r in fp32))} in total), e.g. {_example(fp32)}. "
            "Memory of the score matrix doubles versus 16-bit. Fix: keep scores in the autocast "
            "dtype (softmax with dtype=float32 returns fp32: cast back at once, or don't upcast), "
            "or better use scaled_dot_product_attention (AttentionSwitch('sdpa')), which never "
            "materialises them."
        )
    mm = [r for r in quads if r.op.split(".")[0] in _MATMUL_OPS]
    if mm:
        found.append(
            f"A hand-written matmul materialises the full L×L score matrix: {len(mm)} tensors from "
            f"{sorted({r.op for r in mm})} ({format_bytes(sum(r.nbytes for r in mm))}), e.g. "
            f"{_example(mm)}. scaled_dot_product_attention (or flash-attn) computes the same "
            "result blockwise without it. Fix: replace `q @ k.transpose(-2, -1)`/softmax/`@ v` "
            "with F.scaled_dot_product_attention (AttentionSwitch('sdpa') for models that "
            "support it)."
        )
    saved = [r for r in quads if r.saved_for_backward and r.phase == "forward"]
    if saved and is_checkpointed(model):
        modules = sorted({r.module for r in saved})
        found.append(
            f"Activation checkpointing is configured but not taking effect: {len(saved)} L×L "
            f"tensors ({format_bytes(sum(r.nbytes for r in saved))}) are still saved for backward "
            f"in the forward, from {len(modules)} module(s) such as {modules[:3]}. Fix: make sure "
            "the blocks that contain attention are the ones wrapped "
            "(ActivationCheckpointing(block_class_names=[...])), that a Hugging Face model is in "
            "train() mode, and that the forward calls the wrapped modules."
        )
    for message in found:
        warnings.warn(message, MemoryDiagnosisWarning, stacklevel=2)
    return found


def _identity_forward(module: nn.Module) -> Callable[..., Any]:
    if type(module).__module__.startswith("transformers"):  # (attn_output, attn_weights)
        return lambda hidden_states, *args, **kwargs: (hidden_states, None)
    return lambda x, *args, **kwargs: x


@dataclass
class AttentionAblation:
    """One step traced with attention, one with every attention module replaced by identity."""

    with_attention: Breakdown
    without_attention: Breakdown
    replaced: list[str]  # module paths

    @property
    def attention_peak_bytes(self) -> int:
        """How much of the peak attention accounts for (peak with minus peak without)."""
        return self.with_attention.peak_bytes - self.without_attention.peak_bytes

    @property
    def attention_peak_share(self) -> float:
        peak = self.with_attention.peak_bytes
        return self.attention_peak_bytes / peak if peak else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq_len": self.with_attention.seq_len,
            "batch_size": self.with_attention.batch_size,
            "peak_bytes_with_attention": self.with_attention.peak_bytes,
            "peak_bytes_without_attention": self.without_attention.peak_bytes,
            "attention_peak_bytes": self.attention_peak_bytes,
            "attention_peak_share": self.attention_peak_share,
            "replaced": list(self.replaced),
        }


def attention_ablation(step_fn: Callable[[], Any], model: nn.Module, *args: Any,
                       attention_modules: Optional[Sequence[nn.Module]] = None,
                       baseline: Optional[Breakdown] = None, **kwargs: Any) -> AttentionAblation:
    """Trace a step with attention (unless ``baseline`` is given), then one with attention as
    identity, both with :func:`~.tracer.trace_breakdown`'s arguments (``existing`` read once, so an
    iterator serves both). Each attention module's ``forward`` is replaced on the instance for that
    one step (Hugging Face attention returns ``(hidden_states, None)``) and restored after. The
    ablated step is a real training step (the attention parameters get no gradient in it): the
    difference in peaks is what attention costs, its gradients and optimizer scratch included."""
    trace = inspect.signature(trace_breakdown).bind(step_fn, model, *args, **kwargs)
    trace.arguments["existing"] = list(trace.arguments.get("existing", ()))
    if attention_modules is None:
        named = find_attention_modules(model)
    else:
        infos = module_infos(model)
        named = [(infos.get(id(m), (type(m).__name__, ()))[0], m) for m in attention_modules]
    if not named:
        raise ValueError("`model` has no attention module to ablate; pass `attention_modules`")
    if baseline is None:
        baseline = trace_breakdown(*trace.args, **trace.kwargs)
    saved: list[tuple[nn.Module, Any]] = []
    try:
        for _, module in named:
            saved.append((module, module.__dict__.get("forward", _MISSING)))
            module.forward = _identity_forward(module)
        ablated = trace_breakdown(*trace.args, **trace.kwargs)
    finally:
        for module, previous in saved:
            if previous is _MISSING:
                del module.forward
            else:
                module.forward = previous
    return AttentionAblation(baseline, ablated, [name for name, _ in named])


_MISSING = object()
