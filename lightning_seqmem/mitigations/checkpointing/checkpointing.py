"""Activation checkpointing of the repeated transformer blocks.

* Hugging Face ``PreTrainedModel``: ``activation_checkpointing_enable`` (older transformers:
  ``gradient_checkpointing_enable``) with ``use_reentrant=False``; it takes effect in ``train()``.
* Anything else: the blocks (:func:`find_repeated_blocks`) are wrapped in place by
  ``apply_activation_checkpointing`` with ``CheckpointImpl.NO_REENTRANT``, around the same
  parameters (an optimizer built before keeps working); ``state_dict`` keys drop the wrappers'
  ``_checkpoint_wrapped_module.`` prefix (checkpoints interchange); ``named_parameters()`` keep it.
* Blocks sharded with FSDP2: ``torch.distributed._composable.checkpoint`` on each block in place
  (no wrapper: names, ``state_dict`` keys and sharded checkpoints unchanged); it composes with
  ``fully_shard`` before or after it (FSDP2's hooks run outside the region), so mid-run too.

Example:
    >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
    >>> model = GPT(GPTConfig(n_layer=2, d_model=32, n_head=2))
    >>> ActivationCheckpointing().apply(model).applied
    True
    >>> is_checkpointed(model), ActivationCheckpointing().is_applicable(model)
    (True, (False, 'already checkpointed'))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    ActivationWrapper,
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

from lightning_seqmem.mitigations.checkpointing.checkpointing_spec import SPEC
from lightning_seqmem.mitigations.attention.attention import is_hf_pretrained_model
from lightning_seqmem.mitigations.base import (MitigationResult, ModulePolicyRung, RungContext,
                                               fsdp2_modules, wrapping_strategy_refusal)
from lightning_seqmem.mitigations.checkpointing.checkpointing_levels import (
    NONE,
    SELECTIVE,
    Slot,
    checkpoint_function,
    composably_checkpointed,
    hf_is_checkpointing,
    is_hf_layer,
    level_words,
    parse_level,
    partial_counts,
    raise_hf_levels,
    selective_checkpoint_context,
    slot_level,
    state_words,
    target_levels,
    wrappers_by_block,
)

__all__ = ["NO_BLOCKS_FOUND", "ActivationCheckpointing", "CheckpointingRung",
           "check_block_class_names", "counted_blocks", "find_repeated_blocks", "is_checkpointed"]

NO_BLOCKS_FOUND = ("no repeated blocks found (no Hugging Face model, no nn.ModuleList of one "
                   "class); pass block_class_names")
"""Why a policy acting on the repeated blocks refuses a model where none is found."""


def _outermost_matching(model: nn.Module, match) -> list[nn.Module]:
    """Modules where ``match(module)`` holds, top-down, not descending into a match; in order."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if match(module):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return found


def _find_hf_models(model: nn.Module) -> list[nn.Module]:
    """Outermost Hugging Face ``PreTrainedModel``s inside ``model`` (``model`` included)."""
    return _outermost_matching(model, is_hf_pretrained_model)


def _outermost(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """Drop blocks nested inside other blocks (wrapping both would recompute twice); keep order."""
    wanted = {id(b) for b in blocks}
    return _outermost_matching(model, lambda module: id(module) in wanted)


def _modules_named(model: nn.Module, class_names: set[str]) -> list[nn.Module]:
    return _outermost(model, [m for m in model.modules() if type(m).__name__ in class_names])


def find_repeated_blocks(model: nn.Module,
                         block_class_names: Sequence[str] | None = None) -> list[nn.Module]:
    """The repeated blocks of ``model``, in order (of nested matches, the outer one): the modules of
    class ``block_class_names`` (else ValueError); else (None) those of Hugging Face models'
    ``_no_split_modules`` classes; else the children of every ``nn.ModuleList`` whose children share
    one class and hold modules, outermost; else the largest such list of single layers; else none.

    Example:
        >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
        >>> model = GPT(GPTConfig(n_layer=3, d_model=32, n_head=2))
        >>> [type(b).__name__ for b in find_repeated_blocks(model)]
        ['Block', 'Block', 'Block']
        >>> seq2seq = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=2,
        ...                          num_decoder_layers=2, dim_feedforward=16)
        >>> names = [type(b).__name__ for b in find_repeated_blocks(seq2seq)]  # both stacks
        >>> print(names)  # doctest: +NORMALIZE_WHITESPACE
        ['TransformerEncoderLayer', 'TransformerEncoderLayer', 'TransformerDecoderLayer',
         'TransformerDecoderLayer']
        >>> find_repeated_blocks(model, ["DecoderLayer"])
        ... # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        ValueError: `block_class_names`=['DecoderLayer'] matches no module of the model;
        ...['Block', ...].
    """
    if block_class_names is not None:
        if isinstance(block_class_names, str):
            block_class_names = [block_class_names]
        blocks = _modules_named(model, set(block_class_names))
        if not blocks:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise ValueError(
                f"`block_class_names`={list(block_class_names)!r} matches no module of the model; "
                f"class names present: {present}.")
        return blocks
    no_split: set[str] = set()
    for hf_model in _find_hf_models(model):
        no_split.update(getattr(hf_model, "_no_split_modules", None) or ())
    if no_split:
        blocks = _modules_named(model, no_split)
        if blocks:
            return blocks
    # a block already wrapped (all, or the first k of a partial level) counts as the block inside
    stacks = [[_unwrapped(c) for c in m] for m in model.modules()
              if isinstance(m, nn.ModuleList) and len(m)
              and len({type(_unwrapped(c)) for c in m}) == 1]
    blocks = [c for children in stacks for c in children if next(c.children(), None) is not None]
    if blocks:  # every stack of composite blocks (an encoder's and a decoder's), outermost
        return _outermost(model, blocks)
    return max(stacks, key=len, default=[])  # stacks of single layers: the largest (first on a tie)


def _unwrapped(module: nn.Module) -> nn.Module:
    """The block inside a ``checkpoint_wrapper`` (the module itself when not wrapped)."""
    return module._checkpoint_wrapped_module if isinstance(module, ActivationWrapper) else module


def counted_blocks(blocks: list[nn.Module]) -> str:
    """``"2 x Block + 1 x Linear"``: the blocks by class, in order."""
    counts: dict[str, int] = {}
    for b in blocks:
        counts[type(b).__name__] = counts.get(type(b).__name__, 0) + 1
    return " + ".join(f"{n} x {name}" for name, n in counts.items())


def is_checkpointed(model: nn.Module) -> bool:
    """Whether any block of ``model`` is activation-checkpointed (by a wrapper or by Hugging Face).

    Example:
        >>> is_checkpointed(nn.Sequential(nn.Linear(2, 2)))
        False
    """
    if any(isinstance(m, ActivationWrapper) or composably_checkpointed(m) for m in model.modules()):
        return True
    return any(hf_is_checkpointing(m) for m in _find_hf_models(model))


def check_block_class_names(block_class_names: Sequence[str] | None) -> list[str] | None:
    """``block_class_names`` (None, a name or non-empty names) as a list or None; or ValueError."""
    if block_class_names is None:
        return None
    names = [block_class_names] if isinstance(block_class_names, str) else list(block_class_names)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError("`block_class_names` must be None or a non-empty sequence of "
                         f"class names, got {block_class_names!r}.")
    return names


class ActivationCheckpointing:
    """Policy: checkpoint a model's repeated blocks (of class ``block_class_names``, then always by
    the wrapper, Hugging Face models too; None: :func:`find_repeated_blocks`) in place at ``level``:
    None (every block, recomputed whole), ``"selective"`` (every block, matmul outputs kept) or
    ``"k/N"`` (the first ``k`` of ``N`` blocks; :mod:`.checkpointing_levels`).

    Example:
        >>> why = ActivationCheckpointing().is_applicable(nn.Linear(2, 2))[1]
        >>> print(why)  # doctest: +NORMALIZE_WHITESPACE
        no repeated blocks found (no Hugging Face model, no nn.ModuleList of one class);
        pass block_class_names
        >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
        >>> model = GPT(GPTConfig(n_layer=4, d_model=32, n_head=2))
        >>> ActivationCheckpointing(level="2/4").apply(model).detail
        'wrapped 2 x Block with checkpoint_wrapper (non-reentrant; 2 of 4 blocks)'
        >>> ActivationCheckpointing(level="1/4").is_applicable(model)
        (False, 'already checkpointed at 1/4 or more')
        >>> ActivationCheckpointing().is_applicable(model)
        (True, 'wrap 2 x Block (all blocks; now 2/4)')
        >>> ActivationCheckpointing(level="3/8").is_applicable(model)[1]
        "level '3/8' is for a model of 8 blocks; this one has 4 (4 x Block): use 'k/4'"
    """

    def __init__(self, block_class_names: Sequence[str] | None = None,
                 level: Optional[str] = None) -> None:
        self.block_class_names = check_block_class_names(block_class_names)
        parse_level(level)  # raises for a bad level
        self.level = level
        self.name = "checkpointing" if level is None else f"checkpointing:{level}"

    def _hf_models(self, model: nn.Module) -> list[nn.Module]:
        if self.block_class_names is not None:
            return []
        return [m for m in _find_hf_models(model)
                if getattr(m, "supports_gradient_checkpointing", False)]

    def _slots(self, model: nn.Module) -> list[Slot]:
        """The checkpointable blocks of ``model``, in order (the order ``"k/N"`` counts in)."""
        hf_models = self._hf_models(model)
        if hf_models:
            slots: list[Slot] = []
            for hf_model in hf_models:
                layers = [m for m in _outermost_matching(hf_model, is_hf_layer)
                          if m is not hf_model]
                slots += ([Slot("hf_layer", layer, hf_model) for layer in layers]
                          or [Slot("hf_model", hf_model, hf_model)])
            return slots
        blocks = [b for b in find_repeated_blocks(model, self.block_class_names) if b is not model]
        kind = "composable" if fsdp2_modules(model) else "wrap"
        return [Slot(kind, b) for b in blocks]

    def block_levels(self, model: nn.Module, slots: Optional[list[Slot]] = None) -> list[int]:
        """The level (``NONE``, ``SELECTIVE``, ``FULL``) of each block of ``slots`` (None: all)."""
        wrappers = wrappers_by_block(model)
        return [slot_level(s, wrappers) for s in (self._slots(model) if slots is None else slots)]

    def levels_available(self, model: nn.Module) -> tuple[int, bool, bool]:
        """``(N, k/N possible, selective possible)`` for ``model``'s N checkpointable blocks: k/N
        not for a Hugging Face model without per-layer flags, selective not under FSDP2."""
        slots = self._slots(model)
        partial_ok = len(slots) > 1 and not any(s.kind == "hf_model" for s in slots)
        return len(slots), partial_ok, bool(slots) and slots[0].kind != "composable"

    def _targets(self, model: nn.Module, slots: list[Slot]) -> tuple[Optional[list[int]], str]:
        """The level each block needs, or ``(None, why this level cannot apply)``."""
        parsed = parse_level(self.level)
        if isinstance(parsed, tuple):
            k, n = parsed
            if any(s.kind == "hf_model" for s in slots):
                names = ", ".join(type(s.block).__name__ for s in slots if s.kind == "hf_model")
                return None, (f"{names} has no per-layer checkpointing flag (no "
                              "GradientCheckpointingLayer): only 'checkpointing' (all layers) or "
                              "'checkpointing:selective' apply")
            if n != len(slots):
                return None, (f"level {self.level!r} is for a model of {n} blocks; this one has "
                              f"{len(slots)} ({counted_blocks([s.block for s in slots])}): "
                              f"use 'k/{len(slots)}'")
        if parsed == "selective" and slots[0].kind == "composable":
            return None, ("selective checkpointing is not offered under FSDP2 (its composable "
                          "checkpoint cannot be raised to full in place): use "
                          "'checkpointing:k/N' or 'checkpointing'")
        return target_levels(self.level, len(slots)), ""

    def is_on(self, model: nn.Module) -> bool:
        """Whether every block is at least at this level. Checkpointing no block shows (the user's
        own wrappers elsewhere) counts as on, at every level: the rung never wraps a model twice."""
        slots = self._slots(model)
        levels = self.block_levels(model, slots)
        if not any(levels):
            return is_checkpointed(model)
        targets, _ = self._targets(model, slots)
        return targets is not None and all(c >= t for c, t in zip(levels, targets))

    def is_applicable(self, model: nn.Module) -> tuple[bool, str]:
        """``(True, what would be done)`` or ``(False, why)``; ValueError where no block matches."""
        slots = self._slots(model)
        levels = self.block_levels(model, slots)
        if not any(levels) and is_checkpointed(model):
            return False, "already checkpointed"
        if not slots:
            return False, NO_BLOCKS_FOUND
        targets, why = self._targets(model, slots)
        if targets is None:
            return False, why
        raised = [s.block for s, c, t in zip(slots, levels, targets) if t > c]
        if not raised:
            return False, ("already checkpointed" if self.level is None
                           else f"already checkpointed at {self.level} or more")
        hf = slots[0].kind.startswith("hf")
        if self.level is None and not any(levels):  # the full rung from nothing: its own words
            if hf:
                return True, "Hugging Face activation checkpointing on " + ", ".join(
                    type(m).__name__ for m in self._hf_models(model))
            return True, f"wrap {counted_blocks(raised)}"
        how = "Hugging Face activation checkpointing of" if hf else "wrap"
        now = f"; now {state_words(levels)}" if any(levels) else ""
        return True, f"{how} {counted_blocks(raised)} ({level_words(self.level)}{now})"

    def apply(self, model: nn.Module) -> MitigationResult:
        """Switch this level on in place (raising lower blocks); a second call changes nothing."""
        applicable, reason = self.is_applicable(model)
        slots = self._slots(model)
        wrappers = wrappers_by_block(model)
        levels = [slot_level(s, wrappers) for s in slots]
        before = state_words(levels) if any(levels) or not is_checkpointed(model) else "on"
        if not applicable:
            return MitigationResult(self.name, applied=False, detail=reason, before=before,
                                    after=before)
        targets, _ = self._targets(model, slots)
        finals = [max(c, t) for c, t in zip(levels, targets)]
        raised = [(s, c, f) for s, c, f in zip(slots, levels, finals) if f > c]
        words = "" if self.level is None else f"; {level_words(self.level)}"
        what = counted_blocks([s.block for s, _, _ in raised])
        kind = slots[0].kind
        if kind.startswith("hf"):
            raise_hf_levels(slots, levels, finals)
            detail = reason + " (takes effect in train mode)"
        elif kind == "composable":  # FSDP2: in place, composable with fully_shard
            from torch.distributed._composable import checkpoint as composable_checkpoint

            for slot, _, _ in raised:
                composable_checkpoint(slot.block)
            detail = f"checkpointed {what} in place (composable, under FSDP2{words})"
        else:
            fresh = {id(s.block): f for s, c, f in raised if c == NONE}
            if fresh:
                apply_activation_checkpointing(
                    model,
                    checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(
                        m, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                        **({"context_fn": selective_checkpoint_context}
                           if fresh[id(m)] == SELECTIVE else {})),
                    check_fn=lambda m: id(m) in fresh,
                )
            for slot, current, final in raised:
                if current != NONE:  # a selective wrapper raised to full: another function
                    wrappers[id(slot.block)].checkpoint_fn = checkpoint_function(final)
            detail = f"wrapped {what} with checkpoint_wrapper (non-reentrant{words})"
            if any(c != NONE for _, c, _ in raised):
                detail = f"raised {what} to {level_words(self.level)} in place"
        after = state_words(self.block_levels(model))
        return MitigationResult(self.name, applied=self.is_on(model), detail=detail, before=before,
                                after=after)

    def __repr__(self) -> str:
        level = "" if self.level is None else f", level={self.level!r}"
        return f"{type(self).__name__}(block_class_names={self.block_class_names!r}{level})"


class CheckpointingRung(ModulePolicyRung):
    """The ``"checkpointing"`` rung (:class:`ActivationCheckpointing`; ``:selective``, ``:k/N`` or
    every block). Under FSDP2 it goes on after ``fully_shard`` (dry runs too), under DeepSpeed on
    the engine's blocks (ZeRO 0-3: updates unchanged, tests/test_deepspeed.py); FSDP1 refuses it.

    Example:
        >>> from lightning_seqmem.mitigations.base import RungContext
        >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
        >>> model = GPT(GPTConfig(n_layer=2, d_model=32, n_head=2))
        >>> CheckpointingRung().variants(RungContext(model))
        ('checkpointing:selective', 'checkpointing:1/2', 'checkpointing')
        >>> half = CheckpointingRung().at("1/2")
        >>> half.name, half.apply(RungContext(model)).applied, half.is_on(model)
        ('checkpointing:1/2', True, True)
        >>> CheckpointingRung().is_on(model)
        False
        >>> CheckpointingRung().apply(RungContext(model)).applied, CheckpointingRung().is_on(model)
        (True, True)
    """

    spec = SPEC
    after_sharding = True

    def __init__(self, policy: ActivationCheckpointing | None = None) -> None:
        self.policy = policy or ActivationCheckpointing()

    def is_on(self, module: nn.Module) -> bool:
        return self.policy.is_on(module)

    def at(self, level: Optional[str]) -> "CheckpointingRung":
        """The rung at ``"selective"``, ``"k/N"`` or None (every block); else ValueError."""
        if level is None:
            return self
        rung = CheckpointingRung(ActivationCheckpointing(self.policy.block_class_names,
                                                         level=level))
        rung.spec = type(self).spec.at(level)
        return rung

    def variants(self, ctx: RungContext) -> tuple[str, ...]:
        """The variants the model can take, cheapest first (``k/N``: :func:`.partial_counts`)."""
        base = type(self).spec.name
        n_blocks, partial_ok, selective_ok = self.policy.levels_available(ctx.pl_module)
        names = [f"{base}:selective"] if selective_ok else []
        names += [f"{base}:{k}/{n_blocks}" for k in partial_counts(n_blocks)] if partial_ok else []
        return (*names, base)

    def strategy_refusal(self, trainer) -> str | None:  # type: ignore[no-untyped-def]
        return wrapping_strategy_refusal(trainer)

RUNG = CheckpointingRung
"""This folder's rung (what :data:`~lightning_seqmem.core.rungs.RUNG_FOLDERS` names)."""
