"""The stack of repeated blocks of a model, whether its blocks are alike, and shallow copies.

:func:`blocks_differ` says why the blocks of :func:`find_stack`'s ``nn.ModuleList`` (those
:func:`.checkpointing.find_repeated_blocks` finds) are not alike (a parameter shape, a sliding
window on some layers, a per-layer config list); :func:`shallow_copy` is the model with only the
first ``k`` blocks, :func:`shallow_optimizer` the optimizer's view of the copy's parameters.

Example:
    >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
    >>> model = GPT(GPTConfig(n_layer=4, d_model=32, n_head=2))
    >>> stack, why = find_stack(model)
    >>> len(stack), why, blocks_differ(stack)
    (4, '', None)
    >>> short = shallow_copy(model, stack, 2)
    >>> len(short.blocks), len(model.blocks)
    (2, 4)
    >>> short.blocks[0].ln1.weight is model.blocks[0].ln1.weight
    True
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from torch import nn

from lightning_seqmem.dryrun.fake import detached_memo, unwrap_optimizer
from lightning_seqmem.measure.probes import attribute_tensors
from lightning_seqmem.mitigations.checkpointing.checkpointing import find_repeated_blocks

__all__ = ["blocks_differ", "find_stack", "shallow_copy", "shallow_optimizer", "stack_configs",
           "state_key"]

_WRAPPED = "_checkpoint_wrapped_module"  # torch's checkpoint_wrapper holds the block as this
_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _inner(module: nn.Module) -> nn.Module:
    return getattr(module, _WRAPPED, module)


def find_stack(model: nn.Module) -> tuple[Optional[nn.ModuleList], str]:
    """``(the ModuleList holding every repeated block of model, '')``, or ``(None, why not)``.

    Example:
        >>> find_stack(nn.Sequential(nn.Linear(2, 2)))
        (None, 'no repeated blocks found (no Hugging Face model, no nn.ModuleList of one class)')
    """
    blocks = [b for b in find_repeated_blocks(model) if b is not model]
    if not blocks:
        return None, ("no repeated blocks found (no Hugging Face model, no nn.ModuleList of one "
                      "class)")
    wanted = {id(b) for b in blocks}
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)
             and any(id(_inner(c)) in wanted for c in m)]
    if len(lists) != 1:
        return None, (f"the {len(blocks)} repeated blocks sit in {len(lists)} stacks; depth "
                      "extrapolation takes one")
    stack = lists[0]
    if [id(_inner(c)) for c in stack] != [id(b) for b in blocks]:
        return None, "the stack of repeated blocks holds other modules too"
    runs = {c.num_hidden_layers for c in stack_configs(model, stack)} - {len(stack)}
    if runs:
        return None, (f"the config runs {min(runs)} of the stack's {len(stack)} layers "
                      "(num_hidden_layers)")
    return stack, ""


def _plain(value: Any, depth: int = 0) -> Any:
    """A comparable stand-in for an attribute's value: itself where plain, else its kind."""
    if isinstance(value, _PLAIN):
        return value if not isinstance(value, (torch.dtype, torch.device)) else str(value)
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)) and depth < 2 and len(value) <= 64:
        return tuple(_plain(v, depth + 1) for v in value)
    return getattr(value, "__qualname__", type(value).__qualname__)


def _signature(block: nn.Module) -> dict[tuple[str, str], Any]:
    """``(submodule, attribute) -> comparable value`` of everything a block is made of: classes,
    parameter and buffer shapes, dtypes and devices, plain attributes, how many hooks it has."""
    out: dict[tuple[str, str], Any] = {}
    for name, module in block.named_modules():
        out[(name, "<class>")] = type(module).__qualname__
        for key, value in vars(module).items():
            if key in ("_parameters", "_buffers"):
                out.update({(name, f"{key}.{n}"): None if t is None else
                            (tuple(t.shape), str(t.dtype), t.device.type, t.requires_grad)
                            for n, t in value.items()})
            elif key == "_modules":
                out[(name, key)] = tuple(value)
            elif key.endswith("hooks") and hasattr(value, "__len__"):
                out[(name, key)] = len(value)
            else:
                out[(name, key)] = _plain(value)
    return out


def _is_index(name: str, values: list) -> bool:
    """Whether an attribute named ``name`` with these values across the blocks counts them."""
    return (any(word in name.lower() for word in ("idx", "index", "layer", "_id"))
            and all(isinstance(v, int) and not isinstance(v, bool) for v in values)
            and len({v - j for j, v in enumerate(values)}) == 1)


def blocks_differ(stack: nn.ModuleList, model: Optional[nn.Module] = None) -> Optional[str]:
    """Why the blocks of ``stack`` are not alike (the first difference found), or None. Only
    attributes that count the blocks (``layer_idx``: the index plus a constant) may differ, and the
    stack's HF config (:func:`stack_configs`) may hold no per-layer list whose entries differ
    (``layer_types`` of local and global attention).

    Example:
        >>> two = nn.ModuleList([nn.Linear(2, 2, bias=False), nn.Linear(2, 3, bias=False)])
        >>> blocks_differ(two)  # doctest: +NORMALIZE_WHITESPACE
        "block 1 differs from block 0 at _parameters.weight: ((3, 2), 'torch.float32', 'cpu', True)
        vs ((2, 2), 'torch.float32', 'cpu', True)"
    """
    signatures = [_signature(b) for b in stack]
    first = signatures[0]
    for i, other in enumerate(signatures[1:], start=1):
        for key in sorted(set(first) | set(other)):
            a, b = first.get(key, "<absent>"), other.get(key, "<absent>")
            if a == b:
                continue
            counts = [s.get(key) for s in signatures]
            if _is_index(key[1], counts):
                continue  # the block's index: layer_idx
            where = ".".join(p for p in key if p)
            return f"block {i} differs from block 0 at {where}: {b!r} vs {a!r}"
    for config in stack_configs(model, stack) if model is not None else []:
        for key, value in vars(config).items():
            if not isinstance(value, (list, tuple)) or len(value) != len(stack):
                continue
            kinds = sorted({repr(v) for v in value})
            if len(kinds) > 1:
                return (f"the config's per-layer {key} holds {len(kinds)} kinds "
                        f"({', '.join(kinds[:3])})")
    return None


def stack_configs(model: nn.Module, stack: nn.ModuleList) -> list[Any]:
    """The configs that count the layers of ``stack`` (``num_hidden_layers``: Hugging Face's), held
    as ``config`` by the module holding it (a Hugging Face model's own: ``LlamaModel.config``, the
    same object as its causal LM's); another model's config inside ``model`` is not among them."""
    found: dict[int, Any] = {}
    for module in model.modules():
        config = module.__dict__.get("config")
        holds = any(child is stack for child in module._modules.values())
        if holds and isinstance(getattr(config, "num_hidden_layers", None), int):
            found.setdefault(id(config), config)
    return list(found.values())


def state_key(model: nn.Module, stack: nn.ModuleList) -> tuple:
    """The cache key of ``model``'s shallow copies: its modules and parameters (by identity), their
    train/eval modes, a block's signature and the layer configs' values."""
    return (tuple(id(m) for m in model.modules()), tuple(id(p) for p in model.parameters()),
            tuple(m.training for m in model.modules()),
            tuple(sorted(map(repr, _signature(stack[0]).items()))),
            tuple(repr(sorted(vars(c).items(), key=lambda kv: kv[0]))
                  for c in stack_configs(model, stack)))


def shallow_copy(model: nn.Module, stack: nn.ModuleList, depth: int) -> nn.Module:
    """``model`` (unchanged) with only the first ``depth`` blocks of ``stack``: modules copied,
    tensors shared, no trainer, the stack's configs (per-layer lists too) cut to ``depth``."""
    memo = detached_memo(model)
    for t in [*model.parameters(), *model.buffers(), *attribute_tensors(model)]:
        memo[id(t)] = t
    short = copy.copy(stack)  # a new ModuleList object over the same dict of blocks: replaced next
    short.__dict__["_modules"] = dict(list(stack._modules.items())[:depth])
    memo[id(stack)] = copy.deepcopy(short, memo)
    clone = copy.deepcopy(model, memo)
    for config in stack_configs(clone, memo[id(stack)]):
        for key, value in list(vars(config).items()):
            if isinstance(value, (list, tuple)) and len(value) == len(stack):
                setattr(config, key, type(value)(value[:depth]))
        config.num_hidden_layers = depth
    return clone


def shallow_optimizer(optimizer: Any, clone: nn.Module) -> Optional[torch.optim.Optimizer]:
    """A view of ``optimizer`` (unchanged; same class, defaults and param-group hyperparameters)
    over the parameters of ``clone`` alone, for :func:`.fake.rebuild_optimizer`; None for None."""
    if optimizer is None:
        return None
    real = unwrap_optimizer(optimizer)
    kept = {id(p) for p in clone.parameters()}
    view = object.__new__(type(real))
    view.__dict__.update(real.__dict__)
    groups = [{**g, "params": [p for p in g["params"] if id(p) in kept]} for g in real.param_groups]
    view.__dict__["param_groups"] = [g for g in groups if g["params"]]
    return view
