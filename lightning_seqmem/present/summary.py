"""``RunSummary``: what ran, in one value.

The end-of-fit lines (:func:`lightning_seqmem.trainer.outputs.fit_summary`), the report's
``summary`` and the OOM diagnosis all take "what ran" from :func:`run_summary`, so they cannot
disagree. The peak is the one the budget is judged on: reserved bytes where the run compares
reserved memory and the step recorded them, else the allocated (or tracked) peak.

Example:
    >>> from lightning_seqmem.core.records import StepMemory
    >>> from lightning_seqmem.plan.planner import SeqMemPlanner
    >>> p = SeqMemPlanner(memory_budget_bytes=2**20, mitigations=("attention", "checkpointing"))
    >>> s = p.begin_step(128, 2)
    >>> _ = p.observe(s, StepMemory(600_000, {"forward": 600_000}, 100_000, 100_000))
    >>> summary = run_summary(p)
    >>> summary.longest_seq_len, summary.peak_bytes, summary.over_budget, summary.rungs_left
    (128, 600000, False, ('attention', 'checkpointing'))
    >>> summary.sentence()  # doctest: +NORMALIZE_WHITESPACE
    'longest length 128 tokens (batch 2); peak 585.9 KiB; usable budget 921.6 KiB (budget 1.0 MiB);
    rungs on: none; 0 warnings'
    >>> RunSummary.from_dict(summary.to_dict()) == summary
    True
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from lightning_seqmem.core.units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from lightning_seqmem.plan.view import PlanView

__all__ = ["RunSummary", "rung_changes", "run_summary"]


@dataclass(frozen=True)
class RunSummary:
    """What ran: bytes and tokens (``None`` where nothing was measured or no budget was given)."""

    num_measured: int  # measured steps (warm-ups included)
    longest_seq_len: Optional[int]  # the longest measured length, tokens
    longest_batch_size: Optional[int]  # its batch size (the largest at that length)
    peak_bytes: Optional[int]  # the largest measured peak, on the level the budget is judged on
    peak_level: str  # "reserved" (judged on reserved memory) or "allocated"
    budget_bytes: Optional[int]
    usable_budget_bytes: Optional[int]  # budget × (1 − safety_margin)
    over_budget: bool  # a measured peak above the usable budget
    rungs_on: tuple[str, ...]  # the rungs on at the end, in the order switched on
    rungs_left: tuple[str, ...]  # the rungs this run may still switch on
    capped_at: Optional[int]  # the curriculum's cap, tokens (None: not capped)
    num_warnings: int

    def sentence(self) -> str:
        """One line: the first one printed at the end of fit, after ``seqmem:``."""
        if self.num_measured and self.longest_seq_len is not None:
            ran = (f"longest length {self.longest_seq_len} tokens "
                   f"(batch {self.longest_batch_size}); peak {format_bytes(self.peak_bytes)}")
        else:
            ran = "no training step was measured"
        if self.usable_budget_bytes is None:
            budget = "no memory budget"
        else:
            budget = (f"usable budget {format_bytes(self.usable_budget_bytes)} "
                      f"(budget {format_bytes(self.budget_bytes)})"
                      f"{' — OVER it' if self.over_budget else ''}")
        capped = f"; curriculum capped at {self.capped_at}" if self.capped_at is not None else ""
        warned = f"{self.num_warnings} warning{'' if self.num_warnings == 1 else 's'}"
        return f"{ran}; {budget}; rungs on: {', '.join(self.rungs_on) or 'none'}{capped}; {warned}"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (tuples as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "RunSummary":
        """The inverse of :meth:`to_dict` (a report read back)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: tuple(v) if k in ("rungs_on", "rungs_left") else v
                      for k, v in values.items() if k in names})


def run_summary(view: "PlanView") -> RunSummary:
    """The :class:`RunSummary` of ``view``'s run so far."""
    records = view.evidence.measured.records
    reserved = bool(view.settings.compare_reserved)
    longest = max(records, key=lambda r: (r.seq_len, r.batch_size), default=None)
    peak = max((r.reserved_bytes if reserved and r.reserved_bytes is not None else r.peak_bytes
                for r in records), default=None)
    usable = view.settings.usable_budget_bytes
    return RunSummary(
        num_measured=len(records),
        longest_seq_len=None if longest is None else longest.seq_len,
        longest_batch_size=None if longest is None else longest.batch_size,
        peak_bytes=peak,
        peak_level="reserved" if reserved else "allocated",
        budget_bytes=view.settings.budget_bytes,
        usable_budget_bytes=usable,
        over_budget=peak is not None and usable is not None and peak > usable,
        rungs_on=tuple(view.ladder.applied),
        rungs_left=tuple(m for m in view.ladder.allowed if m not in view.ladder.applied),
        capped_at=view.course.capped_at,
        num_warnings=len(view.advice.warned),
    )


def rung_changes(records: Sequence[Any]) -> list[tuple[Any, tuple[str, ...], tuple[str, ...]]]:
    """``(record, rungs before, rungs after)`` of each record whose ``mitigations`` differ from the
    previous record's (the first record's: from none)."""
    rungs = [()] + [tuple(r.mitigations) for r in records]
    return [(r, before, after) for r, before, after in zip(records, rungs, rungs[1:])
            if after != before]
