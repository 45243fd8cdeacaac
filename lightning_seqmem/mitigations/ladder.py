"""The mitigation ladder: the rungs' policies behind one name each, cheapest first.

Rungs, in the default order (``SeqMemCallback(mitigations=...)`` may reorder or drop them):

========================  =====================================================  =====================
name                      what it does                                           cost
========================  =====================================================  =====================
``"attention"``           eager → SDPA (→ flash-attn where installed, on CUDA,   none: no L² matrix,
                          fp16/bf16): :class:`AttentionSwitch`                    no extra compute
``"checkpointing"``       recompute each transformer block in backward:          ~25-30% more compute
                          :class:`ActivationCheckpointing`
``"microbatch"``          split each batch into micro-batches of one sample      throughput (smaller
                          inside the step: :class:`MicroBatching`                kernels)
========================  =====================================================  =====================

The names and :func:`check_mitigations` live in :mod:`lightning_seqmem.core.rungs` (plain values, for the
torch-free planner); this module applies them.

Example:
    >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
    >>> applicability(["attention", "checkpointing"], None, GPT(GPTConfig(n_layer=2, d_model=32, n_head=2)))["checkpointing"][0]
    True
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from lightning_seqmem.mitigations import MitigationResult
from lightning_seqmem.mitigations.attention import AttentionSwitch
from lightning_seqmem.mitigations.checkpointing import ActivationCheckpointing
from lightning_seqmem.mitigations.microbatch import MicroBatching
from lightning_seqmem.core.rungs import ADVICE, MITIGATIONS, check_mitigations, remaining_advice

def _policy(name: str) -> Any:
    return {"attention": AttentionSwitch, "checkpointing": ActivationCheckpointing, "microbatch": MicroBatching}[name]()


def is_applicable(name: str, trainer: Any, pl_module: Any, batch: Any = None) -> tuple[bool, str]:
    """Whether rung ``name`` would change this model and run, with the reason."""
    policy = _policy(name)
    if name == "microbatch":
        return policy.is_applicable(trainer, pl_module, batch)
    return policy.is_applicable(pl_module)


def apply(name: str, trainer: Any, pl_module: Any, batch: Any = None) -> MitigationResult:
    """Switch rung ``name`` on (in place, between training steps)."""
    policy = _policy(name)
    if name == "microbatch":
        return policy.apply(trainer, pl_module, batch)
    return policy.apply(pl_module)


def remove(name: str, trainer: Any, pl_module: Any) -> Optional[MitigationResult]:
    """Switch rung ``name`` off again where its policy can (micro-batching); None where it cannot
    (attention and checkpointing change numerics by float rounding only, so they may stay)."""
    policy = _policy(name)
    return policy.remove(pl_module) if callable(getattr(policy, "remove", None)) else None


def is_on(name: str, pl_module: Any) -> bool:
    """Whether rung ``name`` is on in ``pl_module`` now (attention: any backend but eager)."""
    from lightning_seqmem.mitigations import current_attention_backend, is_checkpointed, is_micro_batching

    if name == "attention":
        return current_attention_backend(pl_module) not in (None, "eager")
    return is_checkpointed(pl_module) if name == "checkpointing" else is_micro_batching(pl_module)


def applicability(names: Sequence[str], trainer: Any, pl_module: Any, batch: Any = None) -> dict[str, tuple[bool, str]]:
    """``name -> (applies, reason)`` for each rung in ``names``; a check that raises says so (never raises)."""
    out = {}
    for name in names:
        try:
            out[name] = is_applicable(name, trainer, pl_module, batch)
        except Exception as exc:  # noqa: BLE001 - an unusual model must not end the run here
            out[name] = (False, f"its check failed ({type(exc).__name__}: {exc})")
    return out


def try_apply(name: str, trainer: Any, pl_module: Any, batch: Any = None) -> tuple[bool, str]:
    """Switch rung ``name`` on: ``(applied, what was done or why not)``; a failure is returned, never raised."""
    try:
        result = apply(name, trainer, pl_module, batch)
        return bool(result.applied), result.detail
    except Exception as exc:  # noqa: BLE001 - a failed mitigation must not kill the run
        return False, f"{type(exc).__name__}: {exc}"


__all__ = ["ADVICE", "MITIGATIONS", "apply", "check_mitigations", "is_applicable", "applicability", "remaining_advice", "remove", "try_apply"]
