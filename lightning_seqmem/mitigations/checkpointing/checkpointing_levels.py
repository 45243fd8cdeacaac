"""The levels of the ``"checkpointing"`` rung: selective, ``k`` of ``N`` blocks, all of them.

Each checkpointable block is at one of three levels, ``NONE < SELECTIVE < FULL``:

* ``SELECTIVE``: the block runs under ``torch.utils.checkpoint`` with a selective policy
  (:func:`save_matmuls_policy`) that keeps the outputs of the matmuls and the attention kernel and
  recomputes the pointwise ops (norms, activations, dropout, residual adds, an eager softmax).
* ``FULL``: the block keeps only its input and recomputes everything (about one more forward).

A variant asks for a level per block (:func:`target_levels`): ``"selective"`` every block at
``SELECTIVE``, ``"k/N"`` the *first* ``k`` blocks at ``FULL`` (the rest as they are), the bare rung
every block at ``FULL``. Switching one on raises each block to at least that (never lowers one),
so a later variant is an upgrade in place; it is on when every block is at least at its level.
The first ``k`` rather than the last: backward reaches them last, when the activations of the
blocks kept whole are freed, so their recompute adds to a smaller live set.

Example:
    >>> parse_level("3/8"), parse_level("selective"), parse_level(None)
    ((3, 8), 'selective', None)
    >>> target_levels("2/4", 4), target_levels("selective", 4), target_levels(None, 2)
    ([2, 2, 0, 0], [1, 1, 1, 1], [2, 2])
    >>> partial_counts(8), partial_counts(4), partial_counts(1)
    ((1, 2, 3, 4, 5, 6, 7), (1, 2, 3), ())
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

NONE, SELECTIVE, FULL = 0, 1, 2
LEVEL_NAMES = {NONE: "none", SELECTIVE: "selective", FULL: "full"}

_SAVED_OP_NAMES = (
    "mm", "addmm", "bmm", "baddbmm", "linear", "matmul",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward",
)
SAVED_OPS = frozenset(op for op in (getattr(torch.ops.aten, n, None) for n in _SAVED_OP_NAMES)
                      if op is not None)
"""The aten ops whose outputs the selective policy keeps (their overload packets)."""


def save_matmuls_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective policy: keep matmul and attention-kernel outputs, recompute everything else.

    >>> aten = torch.ops.aten
    >>> save_matmuls_policy(None, aten.mm.default), save_matmuls_policy(None, aten.gelu.default)
    (<CheckpointPolicy.MUST_SAVE: 0>, <CheckpointPolicy.PREFER_RECOMPUTE: 3>)
    """
    packet = getattr(op, "overloadpacket", op)
    return CheckpointPolicy.MUST_SAVE if packet in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint_context() -> tuple[Any, Any]:
    """The ``context_fn`` of ``checkpoint`` for the selective level (fresh per call)."""
    return create_selective_checkpoint_contexts(save_matmuls_policy)


def checkpoint_kwargs(level: int) -> dict[str, Any]:
    """Keyword arguments of ``checkpoint`` for a block at ``level`` (SELECTIVE or FULL)."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if level == SELECTIVE:
        kwargs["context_fn"] = selective_checkpoint_context
    return kwargs


def checkpoint_function(level: int) -> Callable[..., Any]:
    """``checkpoint`` bound to the keyword arguments of ``level``, for a Hugging Face layer."""
    return functools.partial(checkpoint, **checkpoint_kwargs(level))


def level_of_function(fn: Any) -> int:
    """The level a bound checkpoint function (``functools.partial``) runs a block at: SELECTIVE
    with a ``context_fn`` (ours or the user's own), else FULL."""
    keywords = getattr(fn, "keywords", None) or {}
    return SELECTIVE if keywords.get("context_fn") is not None else FULL


def parse_level(level: Optional[str]) -> Union[None, str, tuple[int, int]]:
    """``None`` (every block), ``"selective"``, or ``(k, n)`` for ``"k/N"``.

    Raises:
        ValueError: anything else (names the value and what is accepted).

    >>> parse_level("0/4")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: checkpointing level must be 'selective' or 'k/N' with 1 <= k <= N (e.g. '3/8'),
    got '0/4'
    """
    if level is None or level == "selective":
        return level
    k, sep, n = level.partition("/") if isinstance(level, str) else ("", "", "")
    if sep and k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n):
        return int(k), int(n)
    raise ValueError("checkpointing level must be 'selective' or 'k/N' with 1 <= k <= N "
                     f"(e.g. '3/8'), got {level!r}")


def target_levels(level: Optional[str], n_blocks: int) -> list[int]:
    """The level each of ``n_blocks`` blocks needs for variant ``level`` (see the module)."""
    parsed = parse_level(level)
    if parsed is None:
        return [FULL] * n_blocks
    if parsed == "selective":
        return [SELECTIVE] * n_blocks
    k, _ = parsed
    return [FULL] * min(k, n_blocks) + [NONE] * max(n_blocks - k, 0)


def partial_counts(n_blocks: int) -> tuple[int, ...]:
    """The block counts ``k`` of the ``"k/N"`` variants offered for ``n_blocks``: ``ceil(N*j/8)``
    for ``j = 1..7``, distinct, below ``N`` (at most seven dry runs for the planner)."""
    return tuple(sorted({math.ceil(n_blocks * j / 8) for j in range(1, 8)} - {0, n_blocks}))


def level_words(level: Optional[str]) -> str:
    """A level in words: ``"all blocks"``, ``"3 of 8 blocks"``, ``"selective (matmul ...)"``."""
    parsed = parse_level(level)
    if parsed is None:
        return "all blocks"
    if parsed == "selective":
        return "selective (matmul outputs kept, pointwise ops recomputed)"
    return f"{parsed[0]} of {parsed[1]} blocks"


# --- each block's level, read and set (the policy in checkpointing.py walks the blocks) ---


def hf_is_checkpointing(hf_model: nn.Module) -> bool:
    # `is_activation_checkpointing` (transformers 5.x) avoids the FutureWarning of the old name.
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(hf_model), name):
            return bool(getattr(hf_model, name))
    return False


def composably_checkpointed(module: nn.Module) -> bool:
    """Whether ``torch.distributed._composable.checkpoint`` was applied to ``module``."""
    from torch.distributed._composable import _get_registry

    return "checkpoint" in (_get_registry(module) or {})


def _hf_enable(hf_model: nn.Module, kwargs: dict | None = None) -> None:
    """Hugging Face's own switch, with ``kwargs`` for ``torch.utils.checkpoint.checkpoint``."""
    # non-reentrant: the reentrant one warns and needs inputs with grad
    kwargs = dict(kwargs or checkpoint_kwargs(FULL))
    if callable(getattr(hf_model, "activation_checkpointing_enable", None)):  # transformers >= 5.x
        hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def is_hf_layer(module: nn.Module) -> bool:
    """A transformers (>= 4.52) ``GradientCheckpointingLayer``, with its own checkpointing flag."""
    return any(c.__name__ == "GradientCheckpointingLayer" for c in type(module).__mro__)


@dataclass(frozen=True)
class Slot:
    """One checkpointable block and how its level is read and set: ``"hf_layer"`` (a Hugging Face
    layer's flag and function), ``"hf_model"`` (a Hugging Face model without per-layer flags, all
    at once), ``"wrap"`` (``checkpoint_wrapper``), ``"composable"`` (under FSDP2)."""

    kind: str
    block: nn.Module
    owner: Optional[nn.Module] = None  # the Hugging Face model of a layer


def wrappers_by_block(model: nn.Module) -> dict[int, ActivationWrapper]:
    return {id(m._checkpoint_wrapped_module): m for m in model.modules()
            if isinstance(m, ActivationWrapper)}


def slot_level(slot: Slot, wrappers: dict[int, ActivationWrapper]) -> int:
    block = slot.block
    if slot.kind == "hf_layer":
        on = getattr(block, "gradient_checkpointing", False)
        return (level_of_function(getattr(block, "_gradient_checkpointing_func", None)) if on
                else NONE)
    if slot.kind == "hf_model":
        if not hf_is_checkpointing(block):
            return NONE
        fns = [m._gradient_checkpointing_func for m in block.modules()
               if getattr(m, "gradient_checkpointing", False)
               and hasattr(m, "_gradient_checkpointing_func")]
        return min((level_of_function(fn) for fn in fns), default=FULL)
    if slot.kind == "composable":
        return FULL if composably_checkpointed(block) else NONE
    wrapper = wrappers.get(id(block))
    return NONE if wrapper is None else level_of_function(getattr(wrapper, "checkpoint_fn", None))


def state_words(levels: list[int]) -> str:
    """``"off"``, ``"on"`` (every block full), ``"selective"``, ``"2/4"``, ``"2/4+selective"``."""
    n, full, selective = len(levels), levels.count(FULL), levels.count(SELECTIVE)
    if full == n and n:
        return "on"
    if not full and not selective:
        return "off"
    if selective == n:
        return "selective"
    return f"{full}/{n}" + ("+selective" if selective else "")


def raise_hf_levels(slots: list[Slot], levels: list[int], finals: list[int]) -> None:
    """Hugging Face's own switch, then each layer's flag and function set to its final level."""
    owners = list({id(s.owner): s.owner for s in slots}.values())
    for owner in owners:
        mine = [(s, c, f) for s, c, f in zip(slots, levels, finals) if s.owner is owner]
        if not any(f > c for _, c, f in mine):
            continue
        if mine[0][0].kind == "hf_model":  # all at once: HF's switch again with the new function
            _hf_enable(owner, checkpoint_kwargs(mine[0][2]))
            continue
        if not hf_is_checkpointing(owner):  # its input-grad hook and every layer's function
            _hf_enable(owner, checkpoint_kwargs(max(f for _, _, f in mine)))
        for slot, _, final in mine:
            layer = slot.block
            layer.gradient_checkpointing = final > NONE
            function = getattr(layer, "_gradient_checkpointing_func", None)
            if final > NONE and (function is None or level_of_function(function) != final):
                layer._gradient_checkpointing_func = checkpoint_function(final)


__all__ = ["FULL", "LEVEL_NAMES", "NONE", "SAVED_OPS", "SELECTIVE", "Slot", "checkpoint_function",
           "checkpoint_kwargs", "composably_checkpointed", "hf_is_checkpointing", "is_hf_layer",
           "raise_hf_levels", "slot_level", "state_words", "wrappers_by_block",
           "level_of_function", "level_words", "parse_level", "partial_counts",
           "save_matmuls_policy", "selective_checkpoint_context", "target_levels"]
