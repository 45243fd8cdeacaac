"""Mitigations for long-sequence memory, cheapest first: attention kernel, activation checkpointing,
micro-batching (see :mod:`.ladder` for the order the callback tries them in).

Each policy is a small class with ``is_applicable(model) -> (bool, reason)`` and
``apply(model) -> MitigationResult``, working on any ``nn.Module`` (a ``LightningModule``
included), beside pure functions that find what the policy acts on. Nothing here imports Lightning;
Hugging Face transformers is recognised by duck typing and never imported.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MitigationResult:
    """What one ``apply(model)`` did.

    Example:
        >>> MitigationResult("attention", applied=True, detail="attention eager -> sdpa", before="eager", after="sdpa")
        MitigationResult(name='attention', applied=True, detail='attention eager -> sdpa', before='eager', after='sdpa')
    """

    name: str  # the policy, e.g. "attention", "activation_checkpointing"
    applied: bool  # whether the model was changed
    detail: str  # what was done, or why nothing was
    before: str  # the policy's state before, e.g. "eager" or "off"
    after: str  # the policy's state after, e.g. "sdpa" or "on"


# Defined above the submodule imports: they import MitigationResult from this package.
from lightning_seqmem.mitigations.attention import (  # noqa: E402
    ATTENTION_SWITCH_BACKENDS,
    AttentionSwitch,
    current_attention_backend,
    find_attention_targets,
    flash_unavailable_reason,
    is_hf_pretrained_model,
    sdpa_kernel_context,
)
from lightning_seqmem.mitigations.checkpointing import (  # noqa: E402
    ActivationCheckpointing,
    find_repeated_blocks,
    is_checkpointed,
)
from lightning_seqmem.mitigations.microbatch import MicroBatching, is_micro_batching, split_batch  # noqa: E402

__all__ = [
    "ATTENTION_SWITCH_BACKENDS",
    "ActivationCheckpointing",
    "AttentionSwitch",
    "MicroBatching",
    "MitigationResult",
    "current_attention_backend",
    "find_attention_targets",
    "find_repeated_blocks",
    "flash_unavailable_reason",
    "is_checkpointed",
    "is_hf_pretrained_model",
    "is_micro_batching",
    "sdpa_kernel_context",
    "split_batch",
]
