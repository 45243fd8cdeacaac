"""Sequence-tiled feed-forward with recompute: DeepSpeed's ``TiledMLP`` on every block's MLP.

An MLP saves its wide intermediates (``[B, L, intermediate]``: four in a Llama MLP, two in the
reference GPT's) for backward in every block; with SDPA and a fused loss they hold the peak at long
lengths. DeepSpeed's ``TiledMLP`` (ALST, arXiv 2506.13996) runs it on sequence tiles saving only its
input, recomputing tile by tile in backward: no saved intermediates, transient ones ``1/tiles`` as
wide, loss and gradients equal up to float rounding. Tiled: each repeated block's MLP
(:func:`find_mlps`), e.g. ``LlamaMLP`` or the reference GPT's ``nn.Sequential`` (its trailing
``nn.Dropout`` after the tiles). Refused: MoE blocks (an ``experts`` child), an active dropout in
the tiled part (the recompute would draw new masks), FSDP2-sharded blocks (untested), FSDP1 and
DeepSpeed (use DeepSpeed's ``TiledMLP`` there). The instance's ``forward`` is patched (``remove``
deletes it); each tile runs, in the forward's autocast state, on detached aliases of the parameters
(``_reparametrize_module``) whose gradients :class:`_HandGradsToParameters` hands over once.

A call runs :func:`tiles_for_length` tiles: ALST's rule (one tile per 4,096 tokens for Llama-3.1-8B)
keeps a tile's intermediate one size at any length, the floor (:func:`tile_count_rule`, fixed at
switch-on; Llama-3.1-8B: 14336 / 4096 -> 4) no larger than the hidden state at short lengths. Ranks
of uneven lengths may run different counts: harmless on one device or DDP, a deadlock where
parameters are gathered per tile (ZeRO-3, FSDP; ALST all-reduces the maximum).

Example:
    >>> import torch
    >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
    >>> model = GPT(GPTConfig(n_layer=2, d_model=32, n_head=2))
    >>> ids = torch.randint(0, 256, (2, 16))
    >>> plain = model(ids)
    >>> policy = TiledMLP()
    >>> policy.apply(model).detail
    'tiled 2 x Sequential into 4 sequence tiles, one per 32 tokens above 128 (DeepSpeed TiledMLP)'
    >>> tiled_mlp_tiles(model), tiled_mlp_tiles(model, seq_len=4096)
    (4, 128)
    >>> torch.allclose(plain, model(ids), atol=1e-6)
    True
    >>> policy.remove(model).after, tiled_mlp_tiles(model)
    ('off', None)
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from lightning_seqmem.mitigations.base import (MitigationResult, ModulePolicyRung, RungContext,
                                               fsdp2_modules, wrapping_strategy_refusal)
from lightning_seqmem.mitigations.checkpointing.checkpointing import (counted_blocks,
                                                                      find_repeated_blocks)
from lightning_seqmem.mitigations.tiled_mlp.tiled_mlp_spec import SPEC

__all__ = ["MLP_CHILD_NAMES", "TiledMLP", "TiledMLPRung", "find_mlps", "tile_count_rule",
           "tiled_mlp_tiles", "tiled_mlp_unavailable_reason", "tiles_for_length"]

MLP_CHILD_NAMES = ("mlp", "feed_forward", "ffn")
"""Names of a block's feed-forward child, tried in this order."""

_MARK = "_seqmem_tiled_mlp"  # the instance attribute holding a tiled MLP's _TiledState
_INSTALL = ("install the `tiled` extra: pip install 'lightning-seqmem[tiled]' (DeepSpeed >= 0.17; "
            "it runs on CPU too)")


def tiled_mlp_unavailable_reason() -> Optional[str]:
    """Why DeepSpeed's ``TiledMLP`` cannot be used here (with what to install), or None.

    Example:
        >>> reason = tiled_mlp_unavailable_reason()
        >>> reason is None or "lightning-seqmem[tiled]" in reason
        True
    """
    if importlib.util.find_spec("deepspeed") is None:
        return f"DeepSpeed is not installed: {_INSTALL}"
    return None


def _library_tiled_mlp() -> Any:
    """DeepSpeed's ``TiledMLP`` (imported lazily: ~2 s, optional extra). Without CUDA or a user's
    ``DS_ACCELERATOR``, the import is told the CPU (what it would detect after a stdout warning)."""
    told = "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available()
    if told:
        os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP as DeepSpeedTiledMLP
    finally:
        if told:
            os.environ.pop("DS_ACCELERATOR", None)
    return DeepSpeedTiledMLP


def _unwrapped(module: nn.Module) -> nn.Module:
    while isinstance(getattr(module, "_checkpoint_wrapped_module", None), nn.Module):
        module = module._checkpoint_wrapped_module
    return module


def find_mlps(model: nn.Module) -> list[nn.Module]:
    """Each repeated block's first child in :data:`MLP_CHILD_NAMES` (through checkpoint wrappers).

    Example:
        >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
        >>> model = GPT(GPTConfig(n_layer=2, d_model=32, n_head=2))
        >>> [type(m).__name__ for m in find_mlps(model)]
        ['Sequential', 'Sequential']
        >>> find_mlps(nn.Linear(2, 2))
        []
    """
    found: list[nn.Module] = []
    for block in find_repeated_blocks(model):
        block = _unwrapped(block)
        if block is model:
            continue
        for name in MLP_CHILD_NAMES:
            child = getattr(block, name, None)
            if isinstance(child, nn.Module):
                found.append(child)
                break
    return found


def _is_active_dropout(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0


def _split(mlp: nn.Module) -> tuple[int, Optional[str]]:
    """``(layers tiled, why not)``: a ``Sequential``'s layers before trailing dropouts, else 0."""
    if isinstance(getattr(mlp, "experts", None), nn.Module):
        return 0, (f"{type(mlp).__name__} is a mixture of experts (an `experts` child): its "
                   "routing is not tiled")
    tiled: list[nn.Module] = [mlp]
    count = 0
    if isinstance(mlp, nn.Sequential):
        layers = list(mlp)
        count = len(layers)
        while count and isinstance(layers[count - 1], nn.modules.dropout._DropoutNd):
            count -= 1
        if not count:
            return 0, f"{type(mlp).__name__} holds dropouts only: nothing to tile"
        tiled = layers[:count]
    for part in tiled:
        for sub in part.modules():
            if _is_active_dropout(sub):
                return count, (f"{type(mlp).__name__} has an active {type(sub).__name__}"
                               f"(p={sub.p}) inside: the recompute in backward would draw new "
                               "masks (set its p to 0)")
    return count, None


def _hidden(mlps: list[nn.Module]) -> int:
    """The narrowest dimension of the MLPs' 2-D weights (their hidden size), 1 without any."""
    return min((min(p.shape) for m in mlps for p in m.parameters() if p.dim() == 2), default=1)


def tiles_for_length(floor: int, seq_len: int, hidden: int) -> int:
    """The tiles of a call on ``seq_len`` tokens: ``max(floor, ceil(seq_len / hidden))``.

    Example:
        >>> tiles_for_length(4, 8192, 4096), tiles_for_length(4, 131072, 4096)
        (4, 32)
    """
    return max(floor, -(-seq_len // max(hidden, 1)))


def tile_count_rule(mlps: list[nn.Module]) -> int:
    """The tile count's floor, the same on every rank: ``max(2, ceil(intermediate / hidden))`` over
    ``mlps``, read from each MLP's 2-D weights (largest / smallest dimension).

    Example:
        >>> mlp = nn.Sequential(nn.Linear(64, 176), nn.GELU(), nn.Linear(176, 64))
        >>> tile_count_rule([mlp]), tile_count_rule([nn.Sequential(nn.Linear(8, 8))])
        (3, 2)
    """
    tiles = 2
    for mlp in mlps:
        shapes = [p.shape for p in mlp.parameters() if p.dim() == 2]
        if shapes:
            wide, narrow = max(max(s) for s in shapes), min(min(s) for s in shapes)
            tiles = max(tiles, math.ceil(wide / max(narrow, 1)))
    return tiles


@dataclass
class _TiledState:
    tiles: int  # the count, or its floor where the length decides (not fixed)
    fixed: bool  # set by hand (TiledMLP(tiles=n)): the same at every length
    hidden: int  # the MLPs' hidden size, for the length term
    layers: int  # nn.Sequential: layers tiled (the rest run after); other MLPs: 0 (all forward)
    previous_forward: Any  # the instance's own ``forward`` before the patch (None: the class's)


def tiled_mlp_tiles(model: nn.Module, seq_len: Optional[int] = None) -> Optional[int]:
    """The tile count of ``model``'s tiled MLPs (its floor; with ``seq_len``, a call's), or None.

    Example:
        >>> tiled_mlp_tiles(nn.Linear(2, 2)) is None
        True
    """
    for m in model.modules():
        state = m.__dict__.get(_MARK)
        if state is not None:
            if seq_len is None or state.fixed:
                return state.tiles
            return tiles_for_length(state.tiles, seq_len, state.hidden)
    return None


class _HandGradsToParameters(torch.autograd.Function):
    """Identity on ``x``; its backward (after the tiles' recompute) hands the aliases' gradients to
    the parameters once: DDP's reducer sees one gradient per parameter per step."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aliases: list[torch.Tensor],
                *params: torch.Tensor) -> torch.Tensor:
        ctx.aliases = aliases
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        grads = []
        for alias in ctx.aliases:
            grads.append(alias.grad)
            alias.grad = None
        ctx.aliases = None
        return (grad, None, *grads)


def _compute(module: nn.Module, state: _TiledState) -> Callable[[torch.Tensor], torch.Tensor]:
    """The part of ``module``'s forward that is tiled, as a function of its input."""
    if state.layers:
        layers = list(module)[: state.layers]

        def run(x: torch.Tensor) -> torch.Tensor:
            for layer in layers:
                x = layer(x)
            return x

        return run
    return (state.previous_forward if state.previous_forward is not None
            else types.MethodType(type(module).forward, module))


def _tiled_forward(self: nn.Module, x: Any, *args: Any, **kwargs: Any) -> Any:
    """The patched ``forward`` of a tiled MLP (bound to the MLP instance)."""
    state: _TiledState = self.__dict__[_MARK]
    params = dict(self.named_parameters())
    wants_grad = torch.is_grad_enabled() and isinstance(x, torch.Tensor) and (
        x.requires_grad or any(p.requires_grad for p in params.values()))
    if args or kwargs or not wants_grad or x.dim() < 2:  # no graph to save, or an unusual call
        own = state.previous_forward or types.MethodType(type(self).forward, self)
        return own(x, *args, **kwargs)
    compute = _compute(self, state)
    aliases = {n: p.detach().requires_grad_(p.requires_grad) for n, p in params.items()}
    x = _HandGradsToParameters.apply(x, list(aliases.values()), *params.values())
    device_type = x.device.type
    autocast_on = torch.is_autocast_enabled(device_type)
    autocast_dtype = torch.get_autocast_dtype(device_type)

    def tile(module: nn.Module, part: torch.Tensor) -> torch.Tensor:
        autocast = (torch.autocast(device_type, dtype=autocast_dtype) if autocast_on
                    else contextlib.nullcontext())
        with autocast, _reparametrize_module(module, aliases):
            return compute(part)

    tiles = state.tiles if state.fixed else tiles_for_length(state.tiles, x.shape[-2], x.shape[-1])
    out = _library_tiled_mlp().apply(tile, self, x, tiles, [])
    for layer in (list(self)[state.layers:] if state.layers else ()):
        out = layer(out)
    return out


class TiledMLP:
    """Policy: tile every repeated block's MLP into ``tiles`` (None: by :func:`tiles_for_length`).

    Example:
        >>> TiledMLP().is_applicable(nn.Linear(2, 2))
        (False, 'no MLP found: no repeated block has an `mlp`, `feed_forward` or `ffn` child')
        >>> TiledMLP(tiles=0)  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        ValueError: `tiles` must be None (by the length: tiles_for_length) or an integer >= 1,
        got 0
    """

    name = "tiled_mlp"

    def __init__(self, tiles: Optional[int] = None) -> None:
        if tiles is not None and (not isinstance(tiles, int) or isinstance(tiles, bool)
                                  or tiles < 1):
            raise ValueError("`tiles` must be None (by the length: tiles_for_length) or an integer "
                             f">= 1, got {tiles!r}")
        self.tiles = tiles

    def _plan(self, model: nn.Module) -> tuple[list[tuple[nn.Module, int]], Optional[str]]:
        mlps = find_mlps(model)
        if not mlps:
            return [], ("no MLP found: no repeated block has an "
                        f"{', '.join(f'`{n}`' for n in MLP_CHILD_NAMES[:-1])} or "
                        f"`{MLP_CHILD_NAMES[-1]}` child")
        planned = []
        for mlp in mlps:
            layers, why = _split(mlp)
            if why is not None:
                return [], why
            planned.append((mlp, layers))
        return planned, None

    def is_applicable(self, model: nn.Module) -> tuple[bool, str]:
        """``(True, what would be tiled)`` or ``(False, why not, with what to do)``."""
        if tiled_mlp_tiles(model) is not None:
            return False, "already tiled"
        planned, why = self._plan(model)
        if why is not None:
            return False, why
        if fsdp2_modules(model):
            return False, ("the blocks are sharded with FSDP2 (fully_shard): the tiled MLP is not "
                           "tested there")
        reason = tiled_mlp_unavailable_reason()
        if reason is not None:
            return False, reason
        mlps = [m for m, _ in planned]
        return True, f"tile {counted_blocks(mlps)} into {self._tiles_said(mlps)}"

    def _tiles_said(self, mlps: list[nn.Module]) -> str:
        if self.tiles:
            return f"{self.tiles} sequence tiles (DeepSpeed TiledMLP)"
        floor, hidden = tile_count_rule(mlps), _hidden(mlps)
        return (f"{floor} sequence tiles, one per {hidden} tokens above {floor * hidden} "
                "(DeepSpeed TiledMLP)")

    def apply(self, model: nn.Module) -> MitigationResult:
        """Tile the MLPs in place; a second call changes nothing."""
        applicable, reason = self.is_applicable(model)
        if not applicable:
            state = "on" if tiled_mlp_tiles(model) is not None else "off"
            return MitigationResult(self.name, applied=False, detail=reason, before=state,
                                    after=state)
        _library_tiled_mlp()  # import now (between steps), not inside the first tiled forward
        planned, _ = self._plan(model)
        mlps = [m for m, _ in planned]
        tiles, hidden = self.tiles or tile_count_rule(mlps), _hidden(mlps)
        for mlp, layers in planned:
            mlp.__dict__[_MARK] = _TiledState(tiles, self.tiles is not None, hidden, layers,
                                              mlp.__dict__.get("forward"))
            mlp.forward = types.MethodType(_tiled_forward, mlp)
        detail = f"tiled {counted_blocks(mlps)} into {self._tiles_said(mlps)}"
        return MitigationResult(self.name, applied=True, detail=detail, before="off", after="on")

    def remove(self, model: nn.Module) -> MitigationResult:
        """Restore every tiled MLP's own ``forward``."""
        count = 0
        for m in model.modules():
            state = m.__dict__.pop(_MARK, None)
            if state is None:
                continue
            count += 1
            if state.previous_forward is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = state.previous_forward
        return MitigationResult(self.name, applied=count > 0, detail=f"untiled {count} MLPs",
                                before="on" if count else "off", after="off")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tiles={self.tiles!r})"


class TiledMLPRung(ModulePolicyRung):
    """The opt-in ``"tiled_mlp"`` rung: :class:`TiledMLP`, on a dry run's fake copy too.

    Example:
        >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
        >>> model = GPT(GPTConfig(n_layer=2, d_model=32, n_head=2))
        >>> rung = TiledMLPRung()
        >>> rung.apply(RungContext(model)).applied, rung.is_on(model)
        (True, True)
        >>> rung.remove(RungContext(model)).applied, rung.is_on(model)
        (True, False)
    """

    spec = SPEC

    def __init__(self, tiles: Optional[int] = None) -> None:
        self.policy = TiledMLP(tiles)

    def remove(self, ctx: RungContext) -> Optional[MitigationResult]:
        return self.policy.remove(ctx.pl_module)

    def is_on(self, module: nn.Module) -> bool:
        return tiled_mlp_tiles(module) is not None

    def strategy_refusal(self, trainer: Any) -> Optional[str]:
        why = wrapping_strategy_refusal(trainer)
        name = type(getattr(trainer, "strategy", None)).__name__
        if why is not None and "DeepSpeed" in name:
            return (f"{name} partitions the parameters in its engine: patch the MLPs with "
                    "DeepSpeed's own TiledMLP (deepspeed.runtime.sequence_parallel.ulysses_sp, "
                    "with compute_params for ZeRO) instead")
        return why

RUNG = TiledMLPRung
"""This folder's rung (what :data:`~lightning_seqmem.core.rungs.RUNG_FOLDERS` names)."""
