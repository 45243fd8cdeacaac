"""The one protocol every rung of the ladder follows, and the values it passes.

A rung is a small class answering the callback, the dry run and ``seqmem plan``, one method each:

========================================  ==========================================================
``is_applicable(ctx) -> (bool, reason)``  the planner's applicability table, ``seqmem plan``
``apply(ctx) -> MitigationResult``        the callback, between steps (in place, see below)
``remove(ctx) -> MitigationResult|None``  the callback, when the rung's own check refuses it
``is_on(module) -> bool``                 resume, a second fit, the report
``apply_to_copy(copy, plan)``             the dry run: the rung on a fake copy, or ``plan``'s step
``setup_refusal(trainer, module)``        set-up: a strategy (or module) this rung cannot work under
``check_pending(module)``, ``refusal``    the callback: a one-time check after the switch
========================================  ==========================================================

``apply`` leaves parameters, optimizer state and ``state_dict`` keys unchanged. The planner reads
the torch-free :class:`.RungSpec` (``spec``). :func:`.ladder.register` adds a new rung.

Example:
    >>> from torch import nn
    >>> from lightning_seqmem.core.rung_spec import RungSpec
    >>> from lightning_seqmem.core.rungs import RungNotApplicable
    >>> class NoDropout(Rung):
    ...     spec = RungSpec("no_dropout", advice="drop dropout")
    ...     def is_on(self, module):
    ...         return all(m.p == 0 for m in module.modules() if isinstance(m, nn.Dropout))
    ...     def is_applicable(self, ctx):
    ...         on = self.is_on(ctx.pl_module)
    ...         return (False, "no dropout") if on else (True, "dropout p -> 0")
    ...     def apply(self, ctx):
    ...         for m in ctx.pl_module.modules():
    ...             if isinstance(m, nn.Dropout):
    ...                 m.p = 0.0
    ...         return MitigationResult(self.name, True, "dropout p -> 0", "on", "off")
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))
    >>> NoDropout().apply(RungContext(model)).applied, NoDropout().is_on(model)
    (True, True)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from lightning_seqmem.core.checks import is_a
from lightning_seqmem.core.rung_spec import RungSpec
from lightning_seqmem.core.rungs import RungNotApplicable


@dataclass(frozen=True)
class MitigationResult:
    """What one ``apply`` did.

    Example:
        >>> MitigationResult("attention", True, "eager -> sdpa",
        ...                  "eager", "sdpa")  # doctest: +NORMALIZE_WHITESPACE
        MitigationResult(name='attention', applied=True, detail='eager -> sdpa', before='eager',
                         after='sdpa')
    """

    name: str  # the rung, e.g. "attention", "checkpointing"
    applied: bool  # whether the model was changed
    detail: str  # what was done, or why nothing was
    before: str  # the policy's state before, e.g. "eager" or "off"
    after: str  # the policy's state after, e.g. "sdpa" or "on"


@dataclass(frozen=True)
class RungContext:
    """What a rung may look at: the module, the trainer (None for a dry run or ``seqmem plan``), a
    batch and the batch size asked for (None: the batch's own); ``noop_ok``: switch it on even where
    it changes nothing on this rank's batch (:meth:`Rung.noop`), as the other ranks take it."""

    pl_module: Any
    trainer: Any = None
    batch: Any = None
    batch_size: Optional[int] = None
    noop_ok: bool = False


@dataclass
class CopyPlan:
    """The dry run's step with rungs on its copy: ``micro_batch_size`` (None: the whole batch)."""

    micro_batch_size: Optional[int] = None
    notes: list[str] = field(default_factory=list)  # for the dry run's detail line


class Rung:
    """Base of every rung: override ``spec``, ``is_applicable``, ``apply`` and ``is_on``. Defaults:
    not removable, on a copy as on the module, no one-time check, works under every strategy."""

    spec: RungSpec
    after_sharding = False  # the sharded dry run puts it on its copy after fully_shard, else before
    modelled_where_refused = False  # a dry run models it where refused (activation offload on CPU)

    @property
    def name(self) -> str:
        return self.spec.name

    def is_applicable(self, ctx: RungContext) -> tuple[bool, str]:
        raise NotImplementedError

    def apply(self, ctx: RungContext) -> MitigationResult:
        raise NotImplementedError

    def is_on(self, module: Any) -> bool:
        raise NotImplementedError

    def at(self, level: Optional[str]) -> "Rung":
        """This rung at variant ``level`` (``"3/8"``; None: its full level): a configured instance
        whose ``spec`` is ``self.spec.at(level)``; a rung without levels raises ValueError."""
        if level is None:
            return self
        raise ValueError(f"rung {self.name!r} has no levels, got level {level!r}")

    def variants(self, ctx: RungContext) -> tuple[str, ...]:
        """This rung's variants applying to ``ctx``'s model, cheapest first, the full rung last
        (default: the rung alone). A later variant may replace an earlier one on (an upgrade)."""
        return (self.name,)

    def remove(self, ctx: RungContext) -> Optional[MitigationResult]:
        """Switch it off again; None where it cannot (numerics change by float rounding only)."""
        return None

    def apply_to_copy(self, copy: Any, plan: CopyPlan) -> None:
        """Put the rung on a dry run's fake copy (no trainer); raises :class:`.RungNotApplicable`
        where it cannot go on and is not on already (the step would be another setting's)."""
        result = self.apply(RungContext(copy))
        if not result.applied and not self.is_on(copy):
            raise RungNotApplicable(self.name, result.detail)
        plan.notes.append(f"{self.name}: {result.detail}")

    def noop(self, ctx: RungContext) -> Optional[str]:
        """Why the rung changes nothing on this rank's batch (micro-batching 1 sample), or None."""
        return None

    def copy_refusal(self, ctx: RungContext) -> Optional[str]:
        """Why a dry run with the rung would not be a step with it (it cannot go on and is not on),
        decided on the real module before a dry run of a setting holding it; or None."""
        if self.modelled_where_refused:
            return None  # modelled on any device: its apply_to_copy says what it does
        applies, why = self.is_applicable(ctx)
        return None if applies or self.is_on(ctx.pl_module) else why

    def strategy_refusal(self, trainer: Any) -> Optional[str]:
        """Why this rung cannot work under ``trainer``'s strategy (said at set-up), or None."""
        return None

    def setup_refusal(self, trainer: Any, pl_module: Any) -> Optional[str]:
        """Why this rung cannot work in this run at all (strategy, manual optimization), or None."""
        return self.strategy_refusal(trainer)

    def check_pending(self, module: Any, batch: Any = None) -> bool:
        """Whether the next step (on ``batch``) runs the rung's one-time check (and its memory)."""
        return False

    def refusal(self, module: Any) -> Optional[str]:
        """Why the rung's own check refused it after it was switched on, or None."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ModulePolicyRung(Rung):
    """A rung whose ``policy`` acts on the module alone: the attention switch, checkpointing."""

    policy: Any

    def is_applicable(self, ctx: RungContext) -> tuple[bool, str]:
        return self.policy.is_applicable(ctx.pl_module)

    def apply(self, ctx: RungContext) -> MitigationResult:
        return self.policy.apply(ctx.pl_module)


def wrapping_strategy_refusal(trainer: Any) -> Optional[str]:
    """Why a rung rewriting the module cannot work under ``trainer``'s strategy, or None (FSDP1
    wraps the model itself; single device, DDP, FSDP2 and DeepSpeed, a ``DDPStrategy``, take it).

    Example:
        >>> from types import SimpleNamespace
        >>> class FSDPStrategy: ...
        >>> wrapping_strategy_refusal(SimpleNamespace(strategy=FSDPStrategy()))[:45]
        'FSDPStrategy shards or wraps the model itself'
    """
    strategy = getattr(trainer, "strategy", None)
    if strategy is None or is_a(strategy, "ModelParallelStrategy", "SingleDeviceStrategy",
                                "DDPStrategy"):
        return None
    name = type(strategy).__name__
    how = ("for DeepSpeed use its config (activation checkpointing, gradient accumulation); "
           "measurement and forecasts from measured steps still work, the dry run does not"
           if "DeepSpeed" in name else
           "FSDPStrategy (FSDP1) wraps the model in FullyShardedDataParallel: use its "
           "activation_checkpointing_policy, or ModelParallelStrategy with fully_shard (FSDP2) in "
           "configure_model(), where every rung works; measurement and forecasts still work")
    return f"{name} shards or wraps the model itself: {how}"


def find_top_down(model: Any, take: Callable[[Any], Optional[bool]]) -> list[tuple[str, Any]]:
    """The modules of ``model`` a rung acts on, as ``(qualified name, module)`` (the root: ``""``),
    searched top-down: ``take(module)`` True takes it, False stops there (a model the rung refuses),
    None searches its children. A shared submodule is visited once, as in ``named_modules()``.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Linear(2, 2)))
        >>> linear = lambda m: True if isinstance(m, nn.Linear) else None
        >>> [name for name, _ in find_top_down(model, linear)]
        ['0', '1.1']
        >>> find_top_down(model, lambda m: False if isinstance(m, nn.Sequential) else None)
        []
    """
    targets: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def visit(module: Any, name: str) -> None:
        if id(module) in seen:  # shared submodules are visited once, as in named_modules()
            return
        seen.add(id(module))
        taken = take(module)
        if taken is not None:
            if taken:
                targets.append((name, module))
            return
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)

    visit(model, "")
    return targets


def fsdp2_modules(module: Any) -> list[Any]:
    """``module``'s modules (itself included) under FSDP2's ``fully_shard``; none for a non-module.

    Example:
        >>> from torch import nn
        >>> fsdp2_modules(nn.Linear(2, 2)), fsdp2_modules(None)
        ([], [])
    """
    from torch import nn
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, nn.Module):
        return []
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def device_type_of(module: Any) -> str:
    """The device type of ``module``'s first parameter (``"cpu"`` where it has none)."""
    first = next(iter(module.parameters()), None)
    return first.device.type if first is not None else "cpu"


__all__ = ["CopyPlan", "MitigationResult", "ModulePolicyRung", "Rung", "RungContext",
           "device_type_of", "find_top_down", "fsdp2_modules", "wrapping_strategy_refusal"]
