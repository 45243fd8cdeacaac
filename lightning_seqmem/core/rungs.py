"""The rungs of the mitigation ladder as plain values (no torch): their specs and the registry.

A rung is its :class:`RungSpec` here (advice, step-time prior, the facts the planner reads instead
of names) and a torch half in :mod:`lightning_seqmem.mitigations` that switches it on and registers
the spec (``ladder.register``). A *variant* ``"<rung>:<level>"`` (``"checkpointing:3/8"``) is a rung
at a level the planner chose (the bare name: full level), at most one per setting.

Example:
    >>> check_mitigations(["attention", "microbatch"])
    ('attention', 'microbatch')
    >>> check_mitigations(["attention", "fp8"])  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: `mitigations` must be a sequence of distinct names from ('attention',
    'checkpointing', 'microbatch', 'fused_loss', 'tiled_mlp', 'activation_offload') (an empty one
    warns only), got ['attention', 'fp8']
    >>> remaining_advice(("attention",))
    'enable activation checkpointing, or train with batch size 1 and gradient accumulation'
    >>> spec("checkpointing").step_time_prior
    0.33
    >>> base_name("checkpointing:3/8"), level_of("checkpointing:3/8"), level_of("checkpointing")
    ('checkpointing', '3/8', None)
    >>> round(spec("checkpointing:3/8").step_time_prior, 4), spec("checkpointing:3/8").name
    (0.1237, 'checkpointing:3/8')
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping, Optional, Sequence

from lightning_seqmem.core.rung_spec import LEVEL_SEP, RungSpec


class RungNotApplicable(ValueError):
    """The model cannot take a rung (its check says why): a dry run would measure another setting.

    Example:
        >>> err = RungNotApplicable("fused_loss", "no causal LM found")
        >>> err.rung, str(err)
        ('fused_loss', 'fused_loss does not apply to this model: no causal LM found')
    """

    def __init__(self, rung: str, why: str) -> None:
        self.rung, self.why = rung, why
        self.reason = f"{rung} does not apply to this model: {why}"
        super().__init__(self.reason)


RUNG_FOLDERS = ("attention", "checkpointing", "microbatch", "fused_loss", "tiled_mlp",
                "activation_offload")
"""The built-in rungs, one folder each (``mitigations/<rung>/``: rung, spec, method card), default
order then opt-in. A user's rung: its folder and ``ladder.register_folder``."""

_BUILTIN = tuple(  # torch-free data (tests/test_imports.py)
    importlib.import_module(f"lightning_seqmem.mitigations.{folder}.{folder}_spec").SPEC
    for folder in RUNG_FOLDERS)
_SPECS: dict[str, RungSpec] = {s.name: s for s in _BUILTIN}

EXTRA_RUNGS = ("fused_loss", "tiled_mlp", "activation_offload")
"""Built-in rungs a user opts in to: not in the default ladder, not advised unless allowed."""

BUILTIN_RUNGS = tuple(s.name for s in _BUILTIN)
"""Every built-in rung (the default ladder and the opt-in ones): never unregistered."""

MITIGATIONS = tuple(s.name for s in _BUILTIN if s.name not in EXTRA_RUNGS)
"""The built-in rungs of the default ladder, cheapest first (the default order)."""


def base_name(name: str) -> str:
    """The rung of variant ``name`` (``"checkpointing:3/8"`` -> ``"checkpointing"``)."""
    return name.split(LEVEL_SEP, 1)[0]


def level_of(name: str) -> "str | None":
    """The level of variant ``name`` (``"3/8"``), None for a bare rung name (its full level)."""
    return name.split(LEVEL_SEP, 1)[1] if LEVEL_SEP in name else None


def at_most(a: str, b: str) -> bool:
    """Whether variant ``a`` saves no more memory than ``b`` by construction (same rung, no higher
    level: equal, ``b`` bare, or ``k/N`` of one N with ``a``'s k not larger).

    >>> c = "checkpointing"
    >>> at_most(f"{c}:3/8", c), at_most(f"{c}:3/8", f"{c}:5/8")
    (True, True)
    >>> at_most(c, f"{c}:5/8"), at_most(f"{c}:selective", f"{c}:5/8")
    (False, False)
    """
    if base_name(a) != base_name(b):
        return False
    la, lb = level_of(a), level_of(b)
    if la == lb or lb is None:
        return True
    if la is None:
        return False
    ka, _, na = la.partition("/")
    kb, _, nb = lb.partition("/")
    return all(x.isdigit() for x in (ka, na, kb, nb)) and na == nb and int(ka) <= int(kb)


def register_spec(rung_spec: RungSpec) -> None:
    """Make ``rung_spec`` known (a rung registered by ``mitigations.ladder.register``)."""
    if (not isinstance(rung_spec, RungSpec) or not rung_spec.name
            or not isinstance(rung_spec.name, str)):
        raise ValueError(f"`rung_spec` must be a RungSpec with a non-empty name, got {rung_spec!r}")
    _SPECS[rung_spec.name] = rung_spec


def unregister_spec(name: str) -> None:
    """Forget a registered rung (built-ins stay)."""
    if name not in BUILTIN_RUNGS:
        _SPECS.pop(name, None)


def rung_names() -> tuple[str, ...]:
    """Every known rung: the built-ins in their default order, then the registered ones."""
    return tuple(_SPECS)


def rung_specs() -> dict[str, RungSpec]:
    """The specs known now, as a plain dict copy (it pickles; a rung registered later is not in it).

    >>> specs = rung_specs()
    >>> specs["checkpointing"].step_time_prior, "toy" in specs
    (0.33, False)
    """
    return dict(_SPECS)


def spec(name: str, specs: Optional[Mapping[str, RungSpec]] = None) -> RungSpec:
    """The spec of rung or variant ``name`` in ``specs`` (default: registry), plain if unknown."""
    known = _SPECS if specs is None else specs
    base = known.get(base_name(name)) or RungSpec(base_name(name), f"switch {base_name(name)} on")
    return base.at(level_of(name))


def engine_features(setting: Sequence[str]) -> frozenset[str]:
    """The rungs of ``setting`` as other engines' all-or-nothing config switches
    (``spec(n).engine_feature``); a rung at a lower level (``"checkpointing:3/8"``) stands for none.

    >>> sorted(engine_features(["attention", "checkpointing", "microbatch"]))
    ['activation_checkpointing', 'gradient_accumulation', 'sdpa_attention']
    >>> engine_features(["checkpointing:3/8", "fused_loss"])
    frozenset()
    """
    return frozenset(f for n in setting if level_of(n) is None and (f := spec(n).engine_feature))


def is_setting(names: Sequence[Any]) -> bool:
    """Whether ``names`` name known rungs, each at most once (variants ``'<rung>:<level>'`` too)."""
    return (all(isinstance(n, str) and base_name(n) in _SPECS for n in names)
            and len({base_name(n) for n in names}) == len(names))


def check_mitigations(value: Any, variants: bool = False) -> tuple[str, ...]:
    """Validate ``SeqMemCallback(mitigations=...)``: distinct names of known rungs. ``variants``: a
    dry run's setting, a rung at most once, maybe at a level (checked by ``ladder.rung``).

    >>> check_mitigations(["attention", "checkpointing:3/8"], variants=True)
    ('attention', 'checkpointing:3/8')
    >>> check_mitigations(["checkpointing", "checkpointing:3/8"], variants=True)
    ... # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: `mitigations` must be a sequence of distinct names from (...), each rung at most
    once (at one level, e.g. 'checkpointing:3/8'), got ['checkpointing', 'checkpointing:3/8']
    """
    names = tuple(value) if isinstance(value, (list, tuple)) else None
    if variants and names is not None and all(isinstance(n, str) for n in names):
        if is_setting(names):
            return names
        raise ValueError(
            f"`mitigations` must be a sequence of distinct names from {rung_names()}, each rung at "
            f"most once (at one level, e.g. 'checkpointing:3/8'), got {value!r}"
        )
    if names is None or any(n not in _SPECS for n in names) or len(set(names)) != len(names):
        raise ValueError(
            f"`mitigations` must be a sequence of distinct names from {rung_names()} "
            f"(an empty one warns only), got {value!r}"
        )
    return names


def check_setting(value: Any, name: str = "mitigations") -> tuple[str, ...]:
    """Validate a setting (the rungs on, variants included): known rungs, one entry per rung.

    >>> check_setting(["attention", "checkpointing:3/8"])
    ('attention', 'checkpointing:3/8')
    >>> check_setting(["checkpointing:3/8", "checkpointing"])  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: `mitigations` (a setting) must be a sequence of names of known rungs (variants
    '<rung>:<level>' allowed), at most one entry per rung, from ('attention', 'checkpointing',
    'microbatch', 'fused_loss', 'tiled_mlp', 'activation_offload'), got ['checkpointing:3/8',
    'checkpointing']
    """
    names = tuple(value) if isinstance(value, (list, tuple)) else None
    if names is None or not is_setting(names):
        raise ValueError(f"`{name}` (a setting) must be a sequence of names of known rungs "
                         f"(variants '<rung>{LEVEL_SEP}<level>' allowed), at most one entry per "
                         f"rung, from {rung_names()}, got {value!r}")
    return names


def remaining_advice(applied: Sequence[str], inapplicable: Sequence[str] = (),
                     device: str = "cuda") -> str:
    """What else would help, in words: every rung not on yet that applies (not ``inapplicable``,
    not :data:`EXTRA_RUNGS`), cheapest first; with none left, what fits ``device`` (a device type).

    >>> remaining_advice((), inapplicable=("attention",))
    'enable activation checkpointing, or train with batch size 1 and gradient accumulation'
    >>> remaining_advice(MITIGATIONS, device="cpu")
    'raise `memory_budget`, lower the batch size, or train a smaller model'
    >>> remaining_advice(("attention", "checkpointing:1/4", "microbatch"))  # one at a lower level
    'enable activation checkpointing (on now at level 1/4)'
    """
    levels = {base_name(n): level_of(n) for n in applied}
    rest = [s.advice + (f" (on now at level {levels[n]})" if levels.get(n) else "")
            for n, s in _SPECS.items() if (n not in levels or levels[n] is not None)
            and n not in inapplicable and n not in EXTRA_RUNGS]
    if rest:
        return ", or ".join(rest)
    if device == "cuda":
        return "use sequence/context parallelism or ZeRO-3/FSDP across GPUs"
    return "raise `memory_budget`, lower the batch size, or train a smaller model"


__all__ = ["at_most", "BUILTIN_RUNGS", "EXTRA_RUNGS", "MITIGATIONS", "RUNG_FOLDERS",
           "RungNotApplicable", "base_name", "level_of", "check_mitigations", "check_setting",
           "engine_features", "is_setting", "register_spec", "remaining_advice", "rung_names",
           "rung_specs", "spec", "unregister_spec"]
