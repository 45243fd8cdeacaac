"""Which batches are warm-ups, which are measured and which are traced: the measurement schedule, one
state of the planner (occurrences per shape and setting, warm-ups left after a resume), torch-free.

Example:
    >>> s = MeasurementSchedule()
    >>> [s.next((64, 2, ()), step, 1, after_change=1, every_n_steps=2, global_step=step)[:2] for step in range(5)]
    [(True, True), (False, True), (False, True), (False, False), (False, True)]
    >>> s.counts
    {(64, 2, ()): 5}
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MeasurementSchedule"]


@dataclass
class MeasurementSchedule:
    """The schedule's state: how often each ``(seq_len, batch_size, mitigations)`` ran (``counts``,
    checkpointed), and how many steps after a resume are warm-ups (``resume_warmup``: the gradients
    and optimizer state were not saved with the records)."""

    counts: dict[tuple, int] = field(default_factory=dict)
    resume_warmup: int = 0

    def next(self, key: tuple, step: int, warmup_steps: int, after_change: int, every_n_steps: int,
             global_step: int = 0) -> tuple[bool, bool, int]:
        """``(warmup, measure, occurrences before)`` for the batch about to run at ``key``.

        A warm-up is one of the first ``warmup_steps`` batches (or optimizer steps: with gradient
        accumulation, until one has happened), one of the first ``after_change`` occurrences of a new
        shape or setting, or a step right after a resume; it is measured, never fitted. Afterwards
        the first fitted occurrence is measured, then one batch in ``every_n_steps``.
        """
        count = self.counts.get(key, 0)
        self.counts[key] = count + 1
        warmup = step < warmup_steps or global_step < warmup_steps or count < after_change or self.resume_warmup > 0
        self.resume_warmup = max(0, self.resume_warmup - 1)
        measure = warmup or count == after_change or step % every_n_steps == 0
        return warmup, measure, count
