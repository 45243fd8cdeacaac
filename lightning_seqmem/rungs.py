"""The names of the mitigation ladder's rungs and what each costs, as plain values (no torch).

The policies that switch a rung on live in :mod:`lightning_seqmem.mitigations`; this module is what
the torch-free planner needs to talk about them.

Example:
    >>> check_mitigations(["attention", "microbatch"])
    ('attention', 'microbatch')
    >>> check_mitigations(["attention", "fp8"])
    Traceback (most recent call last):
    ...
    ValueError: `mitigations` must be a sequence of distinct names from ('attention', 'checkpointing', 'microbatch') (an empty one warns only), got ['attention', 'fp8']
    >>> remaining_advice(("attention",))
    'enable activation checkpointing, or train with batch size 1 and gradient accumulation'
"""

from __future__ import annotations

from typing import Any, Sequence

MITIGATIONS = ("attention", "checkpointing", "microbatch")
"""Every rung of the ladder, cheapest first (the default order)."""

ADVICE = {
    "attention": "switch attention to SDPA or flash-attn",
    "checkpointing": "enable activation checkpointing",
    "microbatch": "train with batch size 1 and gradient accumulation",
}


def check_mitigations(value: Any) -> tuple[str, ...]:
    """Validate ``SeqMemCallback(mitigations=...)``: distinct names from :data:`MITIGATIONS`."""
    names = tuple(value) if isinstance(value, (list, tuple)) else None
    if names is None or any(n not in MITIGATIONS for n in names) or len(set(names)) != len(names):
        raise ValueError(
            f"`mitigations` must be a sequence of distinct names from {MITIGATIONS} "
            f"(an empty one warns only), got {value!r}"
        )
    return names


def remaining_advice(applied: Sequence[str], inapplicable: Sequence[str] = (), device: str = "cuda") -> str:
    """What else would help, in words, for a warning: every rung not on yet that applies to this
    model (not ``inapplicable``: attention already on SDPA is never advised), cheapest first; with
    none left, what fits the machine (``device``: the run's device type): sharding across GPUs on
    CUDA, a larger budget or a smaller step elsewhere.

    >>> remaining_advice((), inapplicable=("attention",))
    'enable activation checkpointing, or train with batch size 1 and gradient accumulation'
    >>> remaining_advice(MITIGATIONS, device="cpu")
    'raise `memory_budget`, lower the batch size, or train a smaller model'
    """
    rest = [ADVICE[n] for n in MITIGATIONS if n not in applied and n not in inapplicable]
    if rest:
        return ", or ".join(rest)
    if device == "cuda":
        return "use sequence/context parallelism or ZeRO-3/FSDP across GPUs"
    return "raise `memory_budget`, lower the batch size, or train a smaller model"


__all__ = ["ADVICE", "MITIGATIONS", "check_mitigations", "remaining_advice"]
