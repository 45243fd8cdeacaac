"""Every scalar tag the callback logs, with its meaning: the one table that the planner's metrics,
the TensorBoard panels, the callback's docstring and the README agree with (``tests/test_tags.py``).

Tags are logged with the prefix ``seqmem/``; GiB = 2³⁰ bytes; "CUDA only" tags come from the
caching allocator's counters and are absent with the CPU tracker.

Example:
    >>> TAGS["headroom_fraction"]
    'headroom over the usable budget'
    >>> PREFIX + "seq_len" in tag_names()
    True
"""

from __future__ import annotations

PREFIX = "seqmem/"

TAGS: dict[str, str] = {
    "seq_len": "sequence length of the batch (tokens)",
    "batch_size": "samples in the batch",
    "peak_allocated_gib": "peak allocated (CUDA) or live-tensor (tracker) memory",
    "peak_forward_gib": "peak during forward (batch start → before backward)",
    "peak_backward_gib": "peak during backward",
    "peak_optimizer_gib": "peak during the optimizer step (absent while accumulating)",
    "reserved_gib": "peak reserved by the CUDA caching allocator (CUDA only)",
    "fragmentation_gib": "reserved minus allocated at the peak (CUDA only)",
    "fragmentation_fraction": "fragmentation over reserved (CUDA only)",
    "inactive_split_gib": "inactive split blocks (CUDA only)",
    "alloc_retries": "cudaMalloc retries after a failure, cumulative (CUDA only)",
    "num_ooms": "allocator OOMs, cumulative (CUDA only)",
    "warmup": "1 for a warm-up batch (measured, not fitted)",
    "verification_error": "latest (forecast − measured) / measured at a new length",
    "stage": "curriculum stage index (with a curriculum)",
    "mitigations_applied": "number of mitigations switched on so far",
    "forecast_next_gib": "forecast upper bound for the next stage (or this length)",
    "max_seq_len": "largest length that fits the usable budget (with a budget)",
    "budget_gib": "usable budget: budget × (1 − safety_margin)",
    "headroom_gib": "usable budget − forecast_next",
    "headroom_fraction": "headroom over the usable budget",
    "validation_peak_gib": "measured peak of a validation batch of a new shape",
    "validation_seq_len": "length of that validation batch (tokens)",
}
"""Tag (without :data:`PREFIX`) -> meaning, in the order of the tables."""


def tag_names(prefix: str = PREFIX) -> tuple[str, ...]:
    """Every logged scalar tag, with ``prefix``."""
    return tuple(prefix + name for name in TAGS)


__all__ = ["PREFIX", "TAGS", "tag_names"]
