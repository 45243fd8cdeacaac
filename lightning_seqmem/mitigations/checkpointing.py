"""Activation checkpointing of the repeated transformer blocks.

Each checkpointed block keeps only its input for backward and recomputes the rest, so activations
grow with the number of blocks times ``L`` instead of with everything each block saves (the
``L x L`` attention weights included). Costs about one extra forward (~25-30% of step time).

* Hugging Face ``PreTrainedModel``: ``activation_checkpointing_enable`` (``gradient_checkpointing_enable``
  on older transformers) with ``use_reentrant=False``; it only takes effect in ``train()`` mode.
* Anything else: the blocks (see :func:`find_repeated_blocks`) are wrapped in place by
  ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.apply_activation_checkpointing``
  with ``CheckpointImpl.NO_REENTRANT``. The wrappers hold the same parameter objects (an optimizer
  built before keeps working, its state untouched) and strip their ``_checkpoint_wrapped_module.``
  prefix from ``state_dict`` keys (and add it back on load), so checkpoints stay interchangeable
  with an unwrapped model. ``named_parameters()`` of the root *does* show the prefix.
* Blocks sharded with FSDP2 (``fully_shard``, e.g. in ``configure_model()``): PyTorch's composable
  ``torch.distributed._composable.checkpoint`` is applied to each block in place instead (no
  wrapper module: parameter names, ``state_dict`` keys and sharded checkpoints are unchanged). It
  composes with ``fully_shard`` applied before or after it (FSDP2's hooks run outside the
  checkpointed region either way), so it can be switched on mid-run.

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
from functools import partial

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    ActivationWrapper,
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

from lightning_seqmem.core.rungs import spec
from lightning_seqmem.mitigations.base import MitigationResult, ModulePolicyRung, wrapping_strategy_refusal
from lightning_seqmem.mitigations.attention import is_hf_pretrained_model

__all__ = ["ActivationCheckpointing", "CheckpointingRung", "find_repeated_blocks", "is_checkpointed"]


def _outermost_matching(model: nn.Module, match) -> list[nn.Module]:
    """Modules for which ``match(module)`` holds, top-down, not descending into a match; in order."""
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


def find_repeated_blocks(model: nn.Module, block_class_names: Sequence[str] | None = None) -> list[nn.Module]:
    """The repeated blocks of ``model`` to checkpoint, outermost first-found order.

    Args:
        model: any module (a ``LightningModule`` is searched like any other).
        block_class_names: class names of the blocks. ``None`` means: the classes in
            ``_no_split_modules`` of a Hugging Face model inside ``model``; failing that, the children
            of every ``nn.ModuleList`` whose children all have one class and hold modules of their
            own (every stack of blocks: an encoder's and a decoder's), outermost; failing that, the
            largest such list of single layers.

    Returns:
        The matching modules; nested matches are dropped in favour of the outer one. Empty when
        ``block_class_names`` is ``None`` and nothing repeated was found.

    Raises:
        ValueError: ``block_class_names`` given but no module has one of these class names.

    Example:
        >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
        >>> model = GPT(GPTConfig(n_layer=3, d_model=32, n_head=2))
        >>> [type(b).__name__ for b in find_repeated_blocks(model)]
        ['Block', 'Block', 'Block']
        >>> from torch import nn
        >>> seq2seq = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=16)
        >>> [type(b).__name__ for b in find_repeated_blocks(seq2seq)]  # both stacks, not the first found
        ['TransformerEncoderLayer', 'TransformerEncoderLayer', 'TransformerDecoderLayer', 'TransformerDecoderLayer']
        >>> find_repeated_blocks(model, ["DecoderLayer"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `block_class_names`=['DecoderLayer'] matches no module of the model; ...['Block', ...].
    """
    if block_class_names is not None:
        if isinstance(block_class_names, str):
            block_class_names = [block_class_names]
        blocks = _modules_named(model, set(block_class_names))
        if not blocks:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise ValueError(
                f"`block_class_names`={list(block_class_names)!r} matches no module of the model; "
                f"class names present: {present}."
            )
        return blocks
    no_split: set[str] = set()
    for hf_model in _find_hf_models(model):
        no_split.update(getattr(hf_model, "_no_split_modules", None) or ())
    if no_split:
        blocks = _modules_named(model, no_split)
        if blocks:
            return blocks
    stacks = [list(m) for m in model.modules()
              if isinstance(m, nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1]
    blocks = [c for children in stacks for c in children if next(c.children(), None) is not None]
    if blocks:  # every stack of composite blocks (an encoder's and a decoder's), outermost
        return _outermost(model, blocks)
    return max(stacks, key=len, default=[])  # only stacks of single layers: the largest (the first on a tie)


def _counted(blocks: list[nn.Module]) -> str:
    """``"2 x TransformerEncoderLayer + 2 x TransformerDecoderLayer"``: the blocks by class, in order."""
    counts: dict[str, int] = {}
    for b in blocks:
        counts[type(b).__name__] = counts.get(type(b).__name__, 0) + 1
    return " + ".join(f"{n} x {name}" for name, n in counts.items())


def _hf_is_checkpointing(hf_model: nn.Module) -> bool:
    # `is_activation_checkpointing` (transformers 5.x) avoids the FutureWarning of the old name.
    name = "is_activation_checkpointing" if hasattr(type(hf_model), "is_activation_checkpointing") else None
    if name is None and hasattr(type(hf_model), "is_gradient_checkpointing"):
        name = "is_gradient_checkpointing"
    return bool(getattr(hf_model, name)) if name is not None else False


def is_checkpointed(model: nn.Module) -> bool:
    """Whether any block of ``model`` is activation-checkpointed (by a wrapper or by Hugging Face).

    Example:
        >>> is_checkpointed(nn.Sequential(nn.Linear(2, 2)))
        False
    """
    if any(isinstance(m, ActivationWrapper) or _composably_checkpointed(m) for m in model.modules()):
        return True
    return any(_hf_is_checkpointing(m) for m in _find_hf_models(model))


def _composably_checkpointed(module: nn.Module) -> bool:
    """Whether ``torch.distributed._composable.checkpoint`` was applied to ``module``."""
    from torch.distributed._composable import _get_registry

    return "checkpoint" in (_get_registry(module) or {})


def _is_fsdp2(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _hf_enable(hf_model: nn.Module) -> None:
    kwargs = {"use_reentrant": False}  # the reentrant variant warns and needs inputs that require grad
    if callable(getattr(hf_model, "activation_checkpointing_enable", None)):  # transformers >= 5.x
        hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class ActivationCheckpointing:
    """Policy: checkpoint every repeated block of a model, in place and idempotently.

    Args:
        block_class_names: class names of the blocks to wrap; ``None`` finds them (see
            :func:`find_repeated_blocks`). Given names always use the wrapper path, also for
            Hugging Face models.

    Example:
        >>> ActivationCheckpointing().is_applicable(nn.Linear(2, 2))[1]
        'no repeated blocks found (no Hugging Face model, no nn.ModuleList of one class); pass block_class_names'
    """

    name = "checkpointing"

    def __init__(self, block_class_names: Sequence[str] | None = None) -> None:
        if block_class_names is not None:
            names = [block_class_names] if isinstance(block_class_names, str) else list(block_class_names)
            if not names or not all(isinstance(n, str) and n for n in names):
                raise ValueError(
                    f"`block_class_names` must be None or a non-empty sequence of class names, "
                    f"got {block_class_names!r}."
                )
            block_class_names = names
        self.block_class_names = block_class_names

    def _hf_models(self, model: nn.Module) -> list[nn.Module]:
        if self.block_class_names is not None:
            return []
        return [m for m in _find_hf_models(model) if getattr(m, "supports_gradient_checkpointing", False)]

    def is_applicable(self, model: nn.Module) -> tuple[bool, str]:
        """``(True, what would be wrapped)`` or ``(False, reason)``.

        Raises:
            ValueError: ``block_class_names`` matches no module of ``model``.
        """
        if is_checkpointed(model):
            return False, "already checkpointed"
        hf_models = self._hf_models(model)
        if hf_models:
            return True, "Hugging Face activation checkpointing on " + ", ".join(type(m).__name__ for m in hf_models)
        blocks = [b for b in find_repeated_blocks(model, self.block_class_names) if b is not model]
        if not blocks:
            return False, (
                "no repeated blocks found (no Hugging Face model, no nn.ModuleList of one class); "
                "pass block_class_names"
            )
        return True, f"wrap {_counted(blocks)}"

    def apply(self, model: nn.Module) -> MitigationResult:
        """Enable checkpointing in place; a second call changes nothing."""
        applicable, reason = self.is_applicable(model)
        if not applicable:
            state = "on" if is_checkpointed(model) else "off"
            return MitigationResult(self.name, applied=False, detail=reason, before=state, after=state)
        hf_models = self._hf_models(model)
        if hf_models:
            for hf_model in hf_models:
                _hf_enable(hf_model)
            detail = reason + " (takes effect in train mode)"
        else:
            blocks = [b for b in find_repeated_blocks(model, self.block_class_names) if b is not model]
            wanted = {id(b) for b in blocks}
            if any(_is_fsdp2(m) for m in model.modules()):  # FSDP2: in place, composable with fully_shard
                from torch.distributed._composable import checkpoint

                for block in blocks:
                    checkpoint(block)
                detail = f"checkpointed {_counted(blocks)} in place (composable, under FSDP2)"
                return MitigationResult(self.name, applied=True, detail=detail, before="off", after="on")
            apply_activation_checkpointing(
                model,
                checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
                check_fn=lambda m: id(m) in wanted,
            )
            detail = f"wrapped {_counted(blocks)} with checkpoint_wrapper (non-reentrant)"
        after = "on" if is_checkpointed(model) else "off"
        return MitigationResult(self.name, applied=after == "on", detail=detail, before="off", after=after)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_class_names={self.block_class_names!r})"


class CheckpointingRung(ModulePolicyRung):
    """The ladder's ``"checkpointing"`` rung: :class:`ActivationCheckpointing` of every repeated block
    behind the :class:`~lightning_seqmem.mitigations.base.Rung` protocol. Under FSDP2 it goes on after
    ``fully_shard`` (composable ``checkpoint``), in a sharded dry run too; FSDP1 and DeepSpeed wrap
    the model themselves and refuse it at set-up.

    Example:
        >>> from lightning_seqmem.mitigations.base import RungContext
        >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
        >>> model = GPT(GPTConfig(n_layer=2, d_model=32, n_head=2))
        >>> CheckpointingRung().apply(RungContext(model)).applied, CheckpointingRung().is_on(model)
        (True, True)
    """

    spec = spec("checkpointing")
    after_sharding = True

    def __init__(self, policy: ActivationCheckpointing | None = None) -> None:
        self.policy = policy or ActivationCheckpointing()

    def is_on(self, module: nn.Module) -> bool:
        return is_checkpointed(module)

    def strategy_refusal(self, trainer) -> str | None:  # type: ignore[no-untyped-def]
        return wrapping_strategy_refusal(trainer)
