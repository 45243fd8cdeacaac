"""Which batches are warm-ups, which are measured and which are traced: the measurement schedule, one
state of the planner (occurrences per shape and setting, warm-ups left after a resume, steps left
unmeasured), torch-free.

A step is measured for the evidence it gives. The first ``warmup_steps`` batches, a batch after a
resume, the first fitted occurrence of a shape and one batch in ``every_n_steps`` after it are.
The warm-up occurrences of a new shape (measured, never fitted) are too, unless the planner says the
shape is *covered*: a step at a shape not shorter and not smaller, with the same rungs, was measured
within the budget already (a step's peak does not fall as the length or the batch grows, the
assumption of :mod:`lightning_seqmem.plan.dry_search`), so that measured step bounds this one and
its measurement would be neither fitted nor needed. That is what dynamic padding is (a new length
every batch): only the steps that set a new longest shape are measured. An unmeasured step is still
judged before it runs; it leaves no record (records are measured steps) and is counted in
``unmeasured``.

Example:
    >>> s = MeasurementSchedule()
    >>> [s.next((64, 2, ()), step, 1, after_change=1, every_n_steps=2, global_step=step)[:2] for step in range(5)]
    [(True, True), (False, True), (False, True), (False, False), (False, True)]
    >>> s.counts
    {(64, 2, ()): 5}
    >>> s.next((32, 2, ()), 5, 1, after_change=1, every_n_steps=1, global_step=5, covered=True)   # a new shape below 64
    (True, False, 0)
    >>> s.next((32, 2, ()), 6, 1, after_change=1, every_n_steps=1, global_step=6, covered=True)   # its first fitted one
    (False, True, 1)
    >>> s.unmeasured
    1
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

__all__ = ["MeasurementSchedule", "PendingStep"]


@dataclass
class PendingStep:
    """What :meth:`~lightning_seqmem.plan.planner.SeqMemPlanner.begin_step` decided for the batch
    about to run."""

    step: int
    global_step: int
    epoch: int
    seq_len: int
    batch_size: int
    warmup: bool
    measure: bool
    traced: bool
    stage: Optional[int]
    mitigations: tuple[str, ...]
    events: list[str] = field(default_factory=list)
    # the batch ends with an optimizer step: under gradient accumulation the window's last, which
    # the predictors model (the highest: the earlier batches' gradients alive through its backward)
    optimizer_steps: bool = True


@dataclass
class MeasurementSchedule:
    """The schedule's state: how often each ``(seq_len, batch_size, mitigations)`` ran (``counts``,
    checkpointed), how many steps after a resume are warm-ups (``resume_warmup``: the gradients
    and optimizer state were not saved with the records) and how many steps ran unmeasured
    because a measured step covered them (``unmeasured``)."""

    counts: dict[tuple, int] = field(default_factory=dict)
    resume_warmup: int = 0
    unmeasured: int = 0

    def next(self, key: tuple, step: int, warmup_steps: int, after_change: int, every_n_steps: int,
             global_step: int = 0, covered: bool = False) -> tuple[bool, bool, int]:
        """``(warmup, measure, occurrences before)`` for the batch about to run at ``key``.

        A warm-up is one of the first ``warmup_steps`` batches (or optimizer steps: with gradient
        accumulation, until one has happened), one of the first ``after_change`` occurrences of a new
        shape or setting, or a step right after a resume; it is measured, never fitted, except a
        warm-up of a new shape only (not one of the first batches, not after a resume) that is
        ``covered`` (see the module doc): it runs unmeasured. Afterwards the first fitted
        occurrence is measured, then one batch in ``every_n_steps``.
        """
        count = self.counts.get(key, 0)
        self.counts[key] = count + 1
        early = step < warmup_steps or global_step < warmup_steps or self.resume_warmup > 0
        warmup = early or count < after_change
        self.resume_warmup = max(0, self.resume_warmup - 1)
        measure = warmup or count == after_change or step % every_n_steps == 0
        if warmup and not early and covered:  # never fitted, and a measured longer step bounds it
            measure = False
            self.unmeasured += 1
        return warmup, measure, count

    def state_dict(self) -> dict[str, Any]:
        """``key_counts``: the occurrences per shape and setting."""
        return {"key_counts": [[k[0], k[1], list(k[2]), v] for k, v in self.counts.items()]}

    def load_state_dict(self, state: Mapping[str, Any], resume_warmup: int) -> None:
        """Restore :meth:`state_dict`; the next ``resume_warmup`` steps are warm-ups (the gradients
        and optimizer state were not saved with the records)."""
        self.counts = {(int(k0), int(k1), tuple(k2)): int(v) for k0, k1, k2, v in state.get("key_counts", [])}
        self.resume_warmup = resume_warmup
