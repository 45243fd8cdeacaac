"""Mitigations for long-sequence memory, cheapest first: attention kernel, activation checkpointing,
micro-batching (see :mod:`.ladder` for the order the callback tries them in); opt in: activation
offload to host memory (CUDA).

Each policy is a small class with ``is_applicable(model) -> (bool, reason)`` and
``apply(model) -> MitigationResult``, working on any ``nn.Module`` (a ``LightningModule``
included), beside pure functions that find what the policy acts on; each rung of the ladder wraps
one behind the :class:`~lightning_seqmem.mitigations.base.Rung` protocol. Nothing here imports
Lightning (strategies are recognised by class name) nor Hugging Face transformers (duck typing).
"""

from __future__ import annotations

from lightning_seqmem.mitigations.base import CopyPlan, MitigationResult, Rung, RungContext
from lightning_seqmem.mitigations.attention import (
    ATTENTION_SWITCH_BACKENDS,
    AttentionSwitch,
    current_attention_backend,
    find_attention_targets,
    flash_unavailable_reason,
    is_hf_pretrained_model,
    sdpa_kernel_context,
)
from lightning_seqmem.mitigations.checkpointing import (
    ActivationCheckpointing,
    find_repeated_blocks,
    is_checkpointed,
)
from lightning_seqmem.mitigations.microbatch import MicroBatching, is_micro_batching, split_batch
from lightning_seqmem.mitigations.offload import ActivationOffload, is_offloading, offloaded_bytes

__all__ = [
    "ATTENTION_SWITCH_BACKENDS",
    "ActivationCheckpointing",
    "ActivationOffload",
    "AttentionSwitch",
    "CopyPlan",
    "MicroBatching",
    "MitigationResult",
    "Rung",
    "RungContext",
    "current_attention_backend",
    "find_attention_targets",
    "find_repeated_blocks",
    "flash_unavailable_reason",
    "is_checkpointed",
    "is_hf_pretrained_model",
    "is_micro_batching",
    "is_offloading",
    "offloaded_bytes",
    "sdpa_kernel_context",
    "split_batch",
]
