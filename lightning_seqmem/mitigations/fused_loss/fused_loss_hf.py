"""The ``"fused_loss"`` rung on a Hugging Face causal LM: its instance's ``forward`` patched.

A ``*ForCausalLM`` model (or GPT-2's ``*LMHeadModel``, same loss) with a bias-free ``lm_head``
and a base model takes the fused loss by a patched ``forward`` (:func:`hf_switch_on`): a call with
``labels`` runs the base model, then the fused loss on ``lm_head.weight`` with Hugging Face's
semantics (labels shifted, or ``shift_labels`` as given; ``ignore_index`` -100; the mean over
counted tokens, or the sum over ``num_items_in_batch`` where given); ``.logits`` is None. A call
without labels runs the class's forward. The class and ``state_dict`` keys are untouched. Models
that scale or cap their logits are refused (:func:`hf_refusal`). The rung is in :mod:`.fused_loss`.

Example:
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
    ...                                      num_hidden_layers=1, num_attention_heads=2,
    ...                                      num_key_value_heads=1))
    >>> ids = torch.randint(0, 64, (1, 8))
    >>> plain = model(input_ids=ids, labels=ids).loss
    >>> fused = lambda hidden, weight, labels, ignore_index, num_items_in_batch: F.cross_entropy(
    ...     (hidden @ weight.T).flatten(0, 1), labels.flatten(), ignore_index=ignore_index)
    >>> hf_refusal(model) is None
    True
    >>> hf_switch_on(model, fused)
    >>> out = model(input_ids=ids, labels=ids)
    >>> close = bool(torch.allclose(out.loss, plain, atol=1e-6))
    >>> out.logits is None, close, hf_fused_loss_of(model) is fused
    (True, True, True)
    >>> hf_switch_off(model); hf_fused_loss_of(model) is None, "forward" in model.__dict__
    (True, False)
"""

from __future__ import annotations

import inspect
import types
from typing import Any, Callable, Optional

import torch.nn.functional as F
from torch import nn

from lightning_seqmem.mitigations.attention.attention import is_hf_pretrained_model
from lightning_seqmem.mitigations.microbatch.microbatch_functional import IGNORE_INDEX

__all__ = ["hf_fused_loss_of", "hf_refusal", "hf_refusals", "hf_switch_off", "hf_switch_on"]

_PATCH_MARK = "_seqmem_fused_loss"  # a patched model's instance attribute: the fused loss
# config fields of Hugging Face models whose logits are not plain ``hidden @ weight.T``
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling",
                     "output_multiplier_scale")


def hf_refusal(module: nn.Module) -> Optional[str]:
    """Why a Hugging Face model cannot take the patched forward, or None."""
    name = type(module).__name__
    if not (name.endswith("ForCausalLM") or name.endswith("LMHeadModel") and _causal_loss(module)):
        return f"{name} is not a *ForCausalLM model (nor an *LMHeadModel with its loss, as GPT-2)"
    head = getattr(module, "lm_head", None)
    if not isinstance(head, nn.Linear):
        return f"{name} has no nn.Linear lm_head"
    if head.bias is not None:
        return f"{name}'s lm_head has a bias, which the fused loss does not take"
    base = getattr(module, getattr(module, "base_model_prefix", "") or "", None)
    if not isinstance(base, nn.Module) or base is module:
        return f"{name} has no base model (its `base_model_prefix` attribute)"
    for field in _LOGIT_TRANSFORMS:
        value = getattr(module.config, field, None)
        if value not in (None, 1, 1.0):
            return (f"{name} transforms its logits ({field}={value}): the fused loss would change "
                    "the loss")
    return None


def _causal_loss(module: nn.Module) -> bool:
    """Whether ``module.loss_function`` is Hugging Face's ``ForCausalLMLoss`` (GPT-2's is)."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING

        return module.loss_function is LOSS_MAPPING["ForCausalLM"]
    except Exception:  # noqa: BLE001 - an older transformers: only *ForCausalLM models
        return False


def hf_refusals(model: nn.Module) -> list[str]:
    """:func:`hf_refusal` of every Hugging Face model in ``model`` that refuses."""
    return [why for m in model.modules()
            if is_hf_pretrained_model(m) and (why := hf_refusal(m)) is not None]


def _hf_fused_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The patched ``forward`` of a Hugging Face causal LM (see the module)."""
    cls_forward = type(self).forward
    arguments = dict(inspect.signature(cls_forward).bind(self, *args, **kwargs).arguments)
    arguments.pop("self", None)
    for name, p in inspect.signature(cls_forward).parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(name, {}))
    labels = arguments.pop("labels", None)
    shift_labels = arguments.pop("shift_labels", None)
    if labels is None and shift_labels is None:
        return cls_forward(self, *args, **kwargs)
    num_items = arguments.pop("num_items_in_batch", None)
    ignore_index = arguments.pop("ignore_index", IGNORE_INDEX)
    arguments.pop("logits_to_keep", None)  # every position's loss is needed
    return_dict = arguments.pop("return_dict", None)
    outputs = getattr(self, self.base_model_prefix)(**arguments)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    if shift_labels is None:  # as Hugging Face's ForCausalLMLoss: tokens < n predict n
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = self.__dict__[_PATCH_MARK](hidden, self.lm_head.weight, shift_labels,
                                      ignore_index=ignore_index, num_items_in_batch=num_items)
    from transformers.modeling_outputs import CausalLMOutputWithPast  # installed: an HF model

    fields = set(CausalLMOutputWithPast.__dataclass_fields__)
    rest = {k: v for k, v in outputs.items() if k in fields and k not in ("loss", "logits")}
    out = CausalLMOutputWithPast(loss=loss, logits=None, **rest)
    return out.to_tuple() if return_dict is False else out


def hf_fused_loss_of(model: nn.Module) -> Optional[Callable[..., Any]]:
    """The fused loss a patched Hugging Face model runs, or None (its class's forward)."""
    return model.__dict__.get(_PATCH_MARK)


def hf_switch_on(model: nn.Module, fn: Callable[..., Any]) -> None:
    """Patch ``model``'s forward to compute its loss by ``fn``."""
    model.__dict__[_PATCH_MARK] = fn
    model.forward = types.MethodType(_hf_fused_forward, model)  # the instance's, not the class's


def hf_switch_off(model: nn.Module) -> None:
    """Give ``model`` its class's forward back."""
    model.__dict__.pop(_PATCH_MARK, None)
    if getattr(model.__dict__.get("forward"), "__func__", None) is _hf_fused_forward:
        del model.forward
