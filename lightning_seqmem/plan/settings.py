"""``PlannerSettings``: what a :class:`~lightning_seqmem.plan.planner.SeqMemPlanner` is configured with
(its constructor's keywords) and what the run binds at set-up (the device, the allocator's
granularity, the dry run, the model's length limit). One object, shared by reference by the planner's
parts, so a value bound once is read by all of them.

Example:
    >>> s = PlannerSettings(budget_bytes=1000, safety_margin=0.1)
    >>> s.usable_budget_bytes, s.within_limit(10**9)
    (900, True)
    >>> s.bind_run(compare_reserved=True, block_bytes=512, device_type="cuda")
    >>> s.compare_reserved, s.block_bytes, s.device_type
    (True, 512, 'cuda')
    >>> s.bind_run(blocks=1)
    Traceback (most recent call last):
    ...
    TypeError: `bind_run` got `blocks`: pass only budget_bytes, compare_reserved, block_bytes, precision, device_type, dry_run
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from lightning_seqmem.core.curriculum import Curriculum
from lightning_seqmem.plan.checkpoint import CHECKPOINT_LAST_RECORDS, MEMORY_RECORDS

__all__ = ["PlannerSettings"]

_RUN_FIELDS = ("budget_bytes", "compare_reserved", "block_bytes", "precision", "device_type", "dry_run")


@dataclass
class PlannerSettings:
    """The planner's settings (see :class:`~lightning_seqmem.plan.planner.SeqMemPlanner`'s arguments)."""

    warmup_steps: int = 2
    tolerance: float = 0.15
    budget_bytes: Optional[int] = None
    safety_margin: float = 0.1
    curriculum: Optional[Curriculum] = None
    warmup_steps_after_change: int = 1
    trace_lengths: int = 3
    measure_every_n_steps: int = 1
    compare_reserved: bool = False
    block_bytes: int = 1
    precision: str = "32-true"
    dry_run: Optional[Callable[..., Any]] = None  # (seq_len, batch_size, mitigations) -> (peak, phase peaks), or raises
    device_type: str = "cpu"  # the run's device type, for advice that fits the machine (set by the callback)
    checkpoint_records: int = CHECKPOINT_LAST_RECORDS  # last records a checkpoint keeps (see checkpoint.compact_records)
    memory_records: int = MEMORY_RECORDS  # past this many, `records` is compacted to its summary and last half
    length_limit: Optional[int] = None  # the model's longest sequence (positions), tokens; None: no limit
    length_limit_reason: str = ""  # where it comes from, e.g. "config.max_position_embeddings=2048"

    @property
    def usable_budget_bytes(self) -> Optional[int]:
        """``budget × (1 − safety_margin)``, or None without a budget."""
        return None if self.budget_bytes is None else int(self.budget_bytes * (1 - self.safety_margin))

    def within_limit(self, seq_len: int) -> bool:
        """Whether the model can take ``seq_len`` tokens at all (``length_limit``: its positions)."""
        return self.length_limit is None or int(seq_len) <= self.length_limit

    def bind_run(self, **values: Any) -> None:
        """Set what the run decides at set-up: any of ``budget_bytes`` (the device's memory when no
        budget was given), ``compare_reserved``, ``block_bytes``, ``precision``, ``device_type``,
        ``dry_run``."""
        for name, value in values.items():
            if name not in _RUN_FIELDS:
                raise TypeError(f"`bind_run` got `{name}`: pass only {', '.join(_RUN_FIELDS)}")
            setattr(self, name, value)
