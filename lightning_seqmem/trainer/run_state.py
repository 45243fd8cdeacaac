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

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

    from lightning_seqmem.measure.probes import MemoryProbe
    from lightning_seqmem.plan.schedule import PendingStep

__all__ = ["EdgeState"]


@dataclasses.dataclass
class EdgeState:
    """The callback's per-fit run state (each field: what it holds, who writes it)."""

    failed: bool = False  # this rank stopped measuring on an internal failure (Guard.fail)
    stopped: bool = False  # every rank agreed to stop: no more collectives (BatchCycle.gather)
    # the step begun at this batch's start (BatchCycle.start_measurement), taken by the batch end
    pending: Optional["PendingStep"] = None
    # perf_counter() when the step itself began (after the decision); None between batches
    step_started_s: Optional[float] = None
    # (batch size, length) of the last batch as cut, on this rank
    shape: Optional[tuple[int, int]] = None
    # {(rungs on, rungs left, batch size): {rung: (applies, why not)}}, one entry
    applicable_cache: dict[tuple, dict[str, tuple[bool, str]]] = dataclasses.field(
        default_factory=dict)
    # rungs that change nothing on this rank's batch (several ranks: agreed)
    noop_rungs: tuple[str, ...] = ()
    # a checkpoint's rungs go on again at on_fit_start (FitCycle.load_state)
    reapply_on_fit_start: bool = False
    # what a resume under a changed configuration changed, said in one warning (FitCycle)
    resume_phrases: list[str] = dataclasses.field(default_factory=list)
    # rungs that were on and are no longer allowed (as resume_phrases)
    resume_removed: tuple[str, ...] = ()
    # a batch got its length through the dataset's set_seq_len (checkpointed)
    uses_datamodule_length: bool = False
    # traced with breakdown=True; the table and the report section below (FitCycle)
    breakdowns: list[Any] = dataclasses.field(default_factory=list)
    breakdown_table: Optional[Any] = None
    breakdown_report: Optional[dict[str, Any]] = None
    # (length, batch): the longest batch seen (the batch end, rank zero)
    breakdown_batch: Optional[tuple[int, Any]] = None
    dry_runner: Any = None  # the TrainingRunDryRun, or None (on_fit_start: rank zero, dry_run=True)
    # why the module counts as compiled, or None (FitCycle.check_compiled)
    compiled_reason: Optional[str] = None
    sharding_template: Any = None  # an unsharded copy on meta for FSDP2 runs, or None (setup)
    probe: Optional["MemoryProbe"] = None  # this fit's MemoryProbe (setup: make_probe)
    device: Optional["torch.device"] = None  # the strategy's root device (setup)
    # weakrefs to (Trainer, module) (setup; read by FitCycle.next_fit)
    fit_refs: Optional[tuple[Any, Any]] = None
    window_batch: Any = None  # the open step window's batch: a dry run inside leaves room beside it
    # validation batches measured (rank zero dry-runs the first of each shape)
    validation: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def next_fit(self, continues: bool) -> "EdgeState":
        """A fresh state for the next fit; ``continues`` (same Trainer and module) keeps breakdowns.

        >>> done = EdgeState(failed=True, breakdown_report={"peak": 1})
        >>> done.next_fit(continues=True).breakdown_report, done.next_fit(continues=True).failed
        ({'peak': 1}, False)
        >>> done.next_fit(continues=False).breakdown_report is None
        True
        """
        if not continues:
            return EdgeState()
        return EdgeState(breakdowns=self.breakdowns, breakdown_table=self.breakdown_table,
                         breakdown_report=self.breakdown_report)

    def abort_probe(self) -> None:
        """Leave the probe (its step, its dispatch mode), where there is one."""
        if self.probe is not None:
            self.probe.abort()
