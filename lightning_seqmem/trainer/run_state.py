"""``EdgeState``: the callback's own run state for one fit (the planner's is in ``cb.planner``).

:class:`~lightning_seqmem.SeqMemCallback` keeps one as ``cb.edge``; :class:`~.guard.Guard`,
:class:`~.batch_cycle.BatchCycle` and :class:`~.fit_cycle.FitCycle` write it. A fresh one comes with
the callback and each fit after one that measured (:meth:`EdgeState.next_fit`).

Example:
    >>> state = EdgeState()
    >>> state.failed, state.pending, state.shape, state.applicable_cache
    (False, None, None, {})
    >>> EdgeState().resume_phrases is state.resume_phrases  # each state its own list
    False
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

    from lightning_seqmem.measure.probes import MemoryProbe
    from lightning_seqmem.plan.schedule import PendingStep

__all__ = ["EdgeState"]


@dataclass
class EdgeState:
    """The callback's per-fit run state (each field: what it holds; writers: the module doc)."""

    failed: bool = False  # this rank stopped measuring on an internal failure (Guard.fail)
    stopped: bool = False  # every rank agreed to stop: no more collectives (BatchCycle.gather)
    pending: Optional["PendingStep"] = None  # the measured step begun at the batch start
    step_started_s: Optional[float] = None  # perf_counter() as the step began
    shape: Optional[tuple[int, int]] = None  # (batch size, length) as cut, this rank
    # {(rungs on, rungs left, batch size): {rung: (applies, why not)}}, one entry
    applicable_cache: dict[tuple, dict[str, tuple[bool, str]]] = field(default_factory=dict)
    noop_rungs: tuple[str, ...] = ()  # rungs changing nothing on this rank's batch
    reapply_on_fit_start: bool = False  # a checkpoint's rungs go on at fit start
    resume_phrases: list[str] = field(default_factory=list)  # a changed configuration's changes
    resume_removed: tuple[str, ...] = ()  # rungs on before a resume, no longer allowed
    uses_datamodule_length: bool = False  # lengths set by the dataset's set_seq_len
    breakdowns: list[Any] = field(default_factory=list)  # traced with breakdown=True
    breakdown_table: Optional[Any] = None
    breakdown_report: Optional[dict[str, Any]] = None
    breakdown_batch: Optional[tuple[int, Any]] = None  # (length, batch): the longest seen
    dry_runner: Any = None  # the TrainingRunDryRun, or None (on_fit_start: rank zero, dry_run=True)
    compiled_reason: Optional[str] = None  # why the module counts as compiled
    sharding_template: Any = None  # an unsharded copy on meta for FSDP2 runs, or None (setup)
    probe: Optional["MemoryProbe"] = None  # this fit's MemoryProbe (setup: make_probe)
    device: Optional["torch.device"] = None  # the strategy's root device (setup)
    fit_refs: Optional[tuple[Any, Any]] = None  # weakrefs to (Trainer, module)
    window_batch: Any = None  # the open step window's batch: a dry run inside leaves room beside it
    validation: list[dict[str, Any]] = field(default_factory=list)  # measured validation batches

    def next_fit(self, continues: bool) -> "EdgeState":
        """A fresh state for the next fit; ``continues`` (same Trainer, module) keeps breakdowns and
        validation rows.

        >>> done = EdgeState(failed=True, breakdown_report={"peak": 1})
        >>> done.next_fit(continues=True).breakdown_report, done.next_fit(continues=True).failed
        ({'peak': 1}, False)
        >>> done.next_fit(continues=False).breakdown_report is None
        True
        """
        if not continues:
            return EdgeState()
        return EdgeState(breakdowns=self.breakdowns, breakdown_table=self.breakdown_table,
                         breakdown_report=self.breakdown_report, validation=self.validation)

    def abort_probe(self) -> None:
        """Leave the probe (its step, its dispatch mode), where there is one."""
        if self.probe is not None:
            self.probe.abort()
