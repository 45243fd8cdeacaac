"""The rungs of the mitigation ladder as plain values (no torch): what the torch-free planner knows of
each, and the registry of their names.

A rung is two halves. This module holds its :class:`RungSpec` (name, advice words, step-time prior,
and the few facts the planner acts on); :mod:`lightning_seqmem.mitigations` holds the torch half
that switches it on (the ``Rung`` protocol of :mod:`lightning_seqmem.mitigations.base`), which
registers its spec here through :func:`lightning_seqmem.mitigations.ladder.register`. The planner
never compares a rung's name: it reads the rung's spec.

Example:
    >>> check_mitigations(["attention", "microbatch"])
    ('attention', 'microbatch')
    >>> check_mitigations(["attention", "fp8"])
    Traceback (most recent call last):
    ...
    ValueError: `mitigations` must be a sequence of distinct names from ('attention', 'checkpointing', 'microbatch', 'fused_loss', 'tiled_mlp', 'activation_offload') (an empty one warns only), got ['attention', 'fp8']
    >>> remaining_advice(("attention",))
    'enable activation checkpointing, or train with batch size 1 and gradient accumulation'
    >>> spec("checkpointing").step_time_prior
    0.33

A rung may come in levels (checkpointing k of N blocks, a selective policy): a *variant* is named
``"<rung>:<level>"`` (``"checkpointing:3/8"``); the bare name is the rung's full level. A setting
holds at most one variant of each rung. The user names rungs; the planner chooses their levels.

    >>> base_name("checkpointing:3/8"), level_of("checkpointing:3/8"), level_of("checkpointing")
    ('checkpointing', '3/8', None)
    >>> round(spec("checkpointing:3/8").step_time_prior, 4), spec("checkpointing:3/8").name
    (0.1237, 'checkpointing:3/8')
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence


class RungNotApplicable(ValueError):
    """A setting asked about holds a rung this model cannot take (its own check says why): a dry
    run, and so a forecast, of that setting would be the figure of another one.

    Example:
        >>> err = RungNotApplicable("fused_loss", "no causal LM found")
        >>> err.rung, str(err)
        ('fused_loss', 'fused_loss does not apply to this model: no causal LM found')
    """

    def __init__(self, rung: str, why: str) -> None:
        self.rung, self.why = rung, why
        self.reason = f"{rung} does not apply to this model: {why}"
        super().__init__(self.reason)


@dataclass(frozen=True)
class RungSpec:
    """What the planner knows of one rung (plain values).

    Example:
        >>> RungSpec("fused_loss", advice="use a fused cross-entropy", step_time_prior=0.02).linearises_attention
        False
    """

    name: str  # the rung's name in ``SeqMemCallback(mitigations=[...])``, the policy's ``.name`` too
    advice: str  # what to do, in words, for a warning ("enable activation checkpointing")
    step_time_prior: float = 0.0  # extra step time as a fraction of the plain step, until measured
    linearises_attention: bool = False  # after the switch the L² term should fall: checked, warned if not
    first_step_check: bool = False  # the step that switches it on runs a one-time check (dry-run apart)
    # priors of named levels (``(("selective", 0.08),)``); a level "k/N" scales ``step_time_prior`` by k/N
    level_priors: tuple[tuple[str, float], ...] = ()
    # priors on one device type where it differs (``(("cpu", 0.6),)``: an eager fallback kernel there)
    device_priors: tuple[tuple[str, float], ...] = ()
    # the same mechanism as other training engines' configs switch it (``seqmem plan --emit``):
    # "activation_checkpointing", "gradient_accumulation"; "" for none (see :func:`engine_features`)
    engine_feature: str = ""

    def prior_on(self, device_type: "str | None") -> float:
        """The step-time prior on ``device_type`` (``"cpu"``, ``"cuda"``; None: the general one).

        >>> RungSpec("fused_loss", "x", 0.05, device_priors=(("cpu", 0.6),)).prior_on("cpu")
        0.6
        """
        return dict(self.device_priors).get(device_type, self.step_time_prior) if device_type else self.step_time_prior

    def at(self, level: "str | None") -> "RungSpec":
        """This spec for variant ``level`` (None: the full rung): its name and step-time prior.

        >>> RungSpec("checkpointing", "x", 0.3, level_priors=(("selective", 0.1),)).at("selective").step_time_prior
        0.1
        """
        if level is None:
            return self
        prior = dict(self.level_priors).get(level)
        if prior is None:
            k, _, n = level.partition("/")
            prior = self.step_time_prior * int(k) / int(n) if k.isdigit() and n.isdigit() and int(n) > 0 else self.step_time_prior
        return replace(self, name=f"{self.name}{LEVEL_SEP}{level}", step_time_prior=prior, device_priors=())


_BUILTIN = (
    # eager -> SDPA/flash-attn: no L^2 matrix, no extra compute
    RungSpec("attention", "switch attention to SDPA or flash-attn", 0.0, linearises_attention=True),
    # recompute every block in backward: about one more forward, ~1/3 of a step (Chen et al. 2016)
    # levels: "k/N" blocks cost k/N of it; "selective" recomputes the pointwise ops only (norms, activations,
    # residual adds), not the matmuls nor attention. Measured on CPU by benchmarks/checkpointing_levels.py
    # (reference GPT, 4 layers, d_model 256, L=512, batch 2, AdamW, interleaved steps, a shared machine),
    # step time over plain: selective x1.089 / x1.213, 2/4 x1.128 / x1.259, all blocks x1.271 / x1.373 (two
    # runs): selective's extra time is 0.33-0.57 of full's, so 0.45 x 0.33 ~ 0.15. Its dispatch mode costs
    # per op: on small models it can cost as much as full (x1.42 vs x1.44 at d_model 128, L=256).
    RungSpec("checkpointing", "enable activation checkpointing", 0.33, level_priors=(("selective", 0.15),),
             engine_feature="activation_checkpointing"),
    # micro-batches of one sample: the same FLOPs in smaller kernels; the first split step checks the loss
    RungSpec("microbatch", "train with batch size 1 and gradient accumulation", 0.1, first_step_check=True,
             engine_feature="gradient_accumulation"),
    # the causal-LM loss from hidden states and lm_head.weight in token shards: no [tokens, vocab] logits;
    # the same matmuls (logits once, both gradients in the forward), a Python loop over the shards
    # on CPU it runs DeepSpeed's eager tiled loss: measured by benchmarks/longest_length.py (32K vocabulary,
    # hidden 256, 512 tokens x 2) at 0.515 s against 0.426 s for SDPA + full checkpointing (+33%): ~+60%
    RungSpec("fused_loss", "compute the loss with a fused linear cross-entropy (allow the fused_loss rung)", 0.05,
             device_priors=(("cpu", 0.6),)),
    # DeepSpeed's TiledMLP: the MLPs run again in backward, tile by tile: about one more forward of the
    # MLPs (~2/3 of a block's matmuls) on top of a step of ~3 forwards: ~0.2 (ALST, arXiv 2506.13996)
    RungSpec("tiled_mlp", "tile the MLPs along the sequence (allow \"tiled_mlp\"; the `tiled` extra)", 0.2),
    # saved activations to pinned host memory and back (CUDA only): two copies of them over the host link, on
    # the compute stream; a guess until measured (ALST reports a few % at 650K tokens, more at short lengths)
    RungSpec("activation_offload", "offload saved activations to pinned host memory (CUDA)", 0.15),
)
_SPECS: dict[str, RungSpec] = {s.name: s for s in _BUILTIN}

EXTRA_RUNGS = ("fused_loss", "tiled_mlp", "activation_offload")
"""Built-in rungs a user opts in to (``SeqMemCallback(mitigations=[..., "fused_loss"])``): not in the
default ladder, not advised unless allowed."""

BUILTIN_RUNGS = tuple(s.name for s in _BUILTIN)
"""Every built-in rung (the default ladder and the opt-in ones): never unregistered."""

MITIGATIONS = tuple(s.name for s in _BUILTIN if s.name not in EXTRA_RUNGS)
"""The built-in rungs of the default ladder, cheapest first (the default order)."""

ADVICE = {s.name: s.advice for s in _BUILTIN if s.name in MITIGATIONS}  # kept for 0.1 callers: prefer spec(name).advice


LEVEL_SEP = ":"


def base_name(name: str) -> str:
    """The rung of variant ``name`` (``"checkpointing:3/8"`` -> ``"checkpointing"``)."""
    return name.split(LEVEL_SEP, 1)[0]


def level_of(name: str) -> "str | None":
    """The level of variant ``name`` (``"3/8"``), None for a bare rung name (its full level)."""
    return name.split(LEVEL_SEP, 1)[1] if LEVEL_SEP in name else None


def at_most(a: str, b: str) -> bool:
    """Whether variant ``a`` saves no more memory than ``b`` by construction: the same rung, and ``a``
    equal to ``b``, or ``b`` its full level (the bare name), or both ``k/N`` of the same N with
    ``a``'s k not larger. Other levels are not compared (a selective policy vs k of N blocks).

    >>> at_most("checkpointing:3/8", "checkpointing"), at_most("checkpointing:3/8", "checkpointing:5/8")
    (True, True)
    >>> at_most("checkpointing", "checkpointing:5/8"), at_most("checkpointing:selective", "checkpointing:5/8")
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
    """Make ``rung_spec`` known (a rung registered by :func:`lightning_seqmem.mitigations.ladder.register`)."""
    if not isinstance(rung_spec, RungSpec) or not rung_spec.name or not isinstance(rung_spec.name, str):
        raise ValueError(f"`rung_spec` must be a RungSpec with a non-empty name, got {rung_spec!r}")
    _SPECS[rung_spec.name] = rung_spec


def unregister_spec(name: str) -> None:
    """Forget a registered rung (built-ins stay)."""
    if name not in BUILTIN_RUNGS:
        _SPECS.pop(name, None)


def rung_names() -> tuple[str, ...]:
    """Every known rung: the built-ins in their default order, then the registered ones."""
    return tuple(_SPECS)


def spec(name: str) -> RungSpec:
    """The spec of rung (or variant) ``name``; an unknown name gets a spec with no special facts (never raises)."""
    base = _SPECS.get(base_name(name)) or RungSpec(base_name(name), f"switch {base_name(name)} on")
    return base.at(level_of(name))


def engine_features(setting: Sequence[str]) -> frozenset[str]:
    """What the rungs of ``setting`` are in other training engines' own configs (each rung's
    ``spec(name).engine_feature``): ``"activation_checkpointing"``, ``"gradient_accumulation"``. A rung
    at a lower level (``"checkpointing:3/8"``) stands for none: those switches are all or nothing.

    >>> sorted(engine_features(["attention", "checkpointing", "microbatch"]))
    ['activation_checkpointing', 'gradient_accumulation']
    >>> engine_features(["checkpointing:3/8", "fused_loss"])
    frozenset()
    """
    return frozenset(f for n in setting if level_of(n) is None and (f := spec(n).engine_feature))


def check_mitigations(value: Any, variants: bool = False) -> tuple[str, ...]:
    """Validate ``SeqMemCallback(mitigations=...)``: distinct names of known rungs. ``variants``: a
    setting (a dry run's), where a rung may be named at a level (``"checkpointing:3/8"``), at most
    one variant per rung; whether the rung has that level is the rung's to say (``ladder.rung``).

    >>> check_mitigations(["attention", "checkpointing:3/8"], variants=True)
    ('attention', 'checkpointing:3/8')
    >>> check_mitigations(["checkpointing", "checkpointing:3/8"], variants=True)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: `mitigations` must be a sequence of distinct names from (...), each rung at most once (at one level, e.g. 'checkpointing:3/8'), got ['checkpointing', 'checkpointing:3/8']
    """
    names = tuple(value) if isinstance(value, (list, tuple)) else None
    if variants and names is not None and all(isinstance(n, str) for n in names):
        bases = [base_name(n) for n in names]
        if all(b in _SPECS for b in bases) and len(set(bases)) == len(bases):
            return names
        raise ValueError(
            f"`mitigations` must be a sequence of distinct names from {rung_names()}, each rung at most once "
            f"(at one level, e.g. 'checkpointing:3/8'), got {value!r}"
        )
    if names is None or any(n not in _SPECS for n in names) or len(set(names)) != len(names):
        raise ValueError(
            f"`mitigations` must be a sequence of distinct names from {rung_names()} "
            f"(an empty one warns only), got {value!r}"
        )
    return names


def check_setting(value: Any, name: str = "mitigations") -> tuple[str, ...]:
    """Validate a setting (the rungs on, variants included): distinct known rungs, one entry per rung.

    >>> check_setting(["attention", "checkpointing:3/8"])
    ('attention', 'checkpointing:3/8')
    >>> check_setting(["checkpointing:3/8", "checkpointing"])
    Traceback (most recent call last):
    ...
    ValueError: `mitigations` (a setting) must be a sequence of names of known rungs (variants '<rung>:<level>' allowed), at most one entry per rung, from ('attention', 'checkpointing', 'microbatch', 'fused_loss', 'tiled_mlp', 'activation_offload'), got ['checkpointing:3/8', 'checkpointing']
    """
    names = tuple(value) if isinstance(value, (list, tuple)) else None
    if (names is None or any(not isinstance(n, str) or base_name(n) not in _SPECS for n in names)
            or len({base_name(n) for n in names}) != len(names)):
        raise ValueError(f"`{name}` (a setting) must be a sequence of names of known rungs (variants '<rung>{LEVEL_SEP}<level>' "
                         f"allowed), at most one entry per rung, from {rung_names()}, got {value!r}")
    return names


def remaining_advice(applied: Sequence[str], inapplicable: Sequence[str] = (), device: str = "cuda") -> str:
    """What else would help, in words, for a warning: every rung not on yet that applies to this
    model (not ``inapplicable``: attention already on SDPA is never advised; nor the opt-in
    :data:`EXTRA_RUNGS`), cheapest first; with
    none left, what fits the machine (``device``: the run's device type): sharding across GPUs on
    CUDA, a larger budget or a smaller step elsewhere.

    >>> remaining_advice((), inapplicable=("attention",))
    'enable activation checkpointing, or train with batch size 1 and gradient accumulation'
    >>> remaining_advice(MITIGATIONS, device="cpu")
    'raise `memory_budget`, lower the batch size, or train a smaller model'
    >>> remaining_advice(("attention", "checkpointing:1/4", "microbatch"))  # a rung on at a lower level
    'enable activation checkpointing (on now at level 1/4)'
    """
    levels = {base_name(n): level_of(n) for n in applied}
    rest = [s.advice + (f" (on now at level {levels[n]})" if levels.get(n) else "") for n, s in _SPECS.items()
            if (n not in levels or levels[n] is not None) and n not in inapplicable and n not in EXTRA_RUNGS]
    if rest:
        return ", or ".join(rest)
    if device == "cuda":
        return "use sequence/context parallelism or ZeRO-3/FSDP across GPUs"
    return "raise `memory_budget`, lower the batch size, or train a smaller model"


__all__ = ["ADVICE", "at_most", "BUILTIN_RUNGS", "EXTRA_RUNGS", "LEVEL_SEP", "MITIGATIONS", "RungNotApplicable", "RungSpec", "base_name", "level_of", "check_mitigations", "check_setting", "engine_features", "register_spec", "remaining_advice",
           "rung_names", "spec", "unregister_spec"]
