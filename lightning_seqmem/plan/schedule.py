"""The measurement schedule (a planner state): which batches are warm-ups, measured, traced.

A new shape's warm-up occurrences go unmeasured where it is *covered*: a measured step not shorter
and not smaller, with the same rungs, stayed in budget (under dynamic padding only new longest
shapes are measured). An unmeasured step is still judged, counted in ``unmeasured``, never recorded.

Example:
    >>> s = MeasurementSchedule()
    >>> [s.next((64, 2, ()), step, 1, after_change=1, every_n_steps=2, global_step=step)[:2]
    ...  for step in range(5)]
    [(True, True), (False, True), (False, True), (False, False), (False, True)]
    >>> s.counts
    {(64, 2, ()): 5}
    >>> kw = dict(after_change=1, every_n_steps=1, covered=True)
    >>> s.next((32, 2, ()), 5, 1, global_step=5, **kw)   # a new shape below 64
    (True, False, 0)
    >>> s.next((32, 2, ()), 6, 1, global_step=6, **kw)   # its first fitted one
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
    """What :meth:`~lightning_seqmem.plan.planner.SeqMemPlanner.begin_step` decided for a batch."""

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
    # ends with an optimizer step: under gradient accumulation the window's last, which the
    # predictors model (the highest: the earlier batches' gradients alive through its backward)
    optimizer_steps: bool = True


@dataclass
class MeasurementSchedule:
    """Per ``(seq_len, batch_size, mitigations)``: its runs (``counts``, checkpointed) and whether a
    fitted step was measured (``fitted``); warm-ups left after a resume; steps ``unmeasured``."""

    counts: dict[tuple, int] = field(default_factory=dict)
    fitted: set = field(default_factory=set)
    resume_warmup: int = 0
    unmeasured: int = 0

    def next(self, key: tuple, step: int, warmup_steps: int, after_change: int, every_n_steps: int,
             global_step: int = 0, covered: bool = False) -> tuple[bool, bool, int]:
        """``(warmup, measure, occurrences before)`` for the batch about to run at ``key``. A
        warm-up (one of the first ``warmup_steps`` batches or optimizer steps, of the first
        ``after_change`` occurrences of a key, or right after a resume) is measured unless only its
        key is new and ``covered``; never fitted. Then the first fitted one (after the run's warm-up
        too) and one batch in ``every_n_steps`` are measured."""
        count = self.counts.get(key, 0)
        self.counts[key] = count + 1
        early = step < warmup_steps or global_step < warmup_steps or self.resume_warmup > 0
        warmup = early or count < after_change
        self.resume_warmup = max(0, self.resume_warmup - 1)
        measure = warmup or key not in self.fitted or step % every_n_steps == 0
        if warmup and not early and covered:  # never fitted, and a measured longer step bounds it
            measure = False
            self.unmeasured += 1
        elif not warmup:
            self.fitted.add(key)
        return warmup, measure, count

    def state_dict(self) -> dict[str, Any]:
        """``key_counts``: the occurrences per shape and setting."""
        return {"key_counts": [[k[0], k[1], list(k[2]), v] for k, v in self.counts.items()]}

    def load_state_dict(self, state: Mapping[str, Any], resume_warmup: int) -> None:
        """Restore :meth:`state_dict`; the next ``resume_warmup`` steps are warm-ups (the gradients
        and optimizer state were not saved with the records)."""
        self.counts = {(int(k0), int(k1), tuple(k2)): int(v)
                       for k0, k1, k2, v in state.get("key_counts", [])}
        self.resume_warmup = resume_warmup
