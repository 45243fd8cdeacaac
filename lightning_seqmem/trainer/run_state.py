"""``EdgeState``: the callback's own run state for one fit (the planner's is in ``cb.planner``).

:class:`~lightning_seqmem.SeqMemCallback` keeps one as ``cb.edge``; :class:`~.guard.Guard`,
:class:`~.batch_cycle.BatchCycle` and :class:`~.fit_cycle.FitCycle` write it. A fresh one comes with
the callback and each fit after one that measured (:meth:`EdgeState.next_fit`).

==========================  ========================================================================
field                       what it holds (who writes it)
==========================  ========================================================================
``failed``                  this rank stopped measuring on an internal failure (:meth:`.Guard.fail`)
``stopped``                 every rank agreed to stop: no more collectives (``BatchCycle.gather``)
``pending``                 the step begun at this batch's start (``BatchCycle.start_measurement``),
                            taken by the batch end; None between batches
``step_started_s``          ``time.perf_counter()`` when the step itself began (the batch start,
                            after the decision), taken by the batch end; None between batches
``shape``                   ``(batch size, length)`` of the last batch as cut, on this rank
                            (``BatchCycle.start_measurement``)
``applicable_cache``        ``{(rungs on, rungs left, batch size): {rung: (applies here, why
                            not)}}``, one entry (``BatchCycle.applicability``)
``noop_rungs``              rungs that change nothing on this rank's batch (with several ranks:
                            agreed, not refused) (``BatchCycle.applicability``)
``reapply_on_fit_start``    a checkpoint's rungs are to be switched on again at ``on_fit_start``
                            (``FitCycle.load_state``; cleared by ``FitCycle.resume_rungs``)
``resume_phrases``          what a resume under a changed configuration changed, said in one
                            warning (``FitCycle.load_state``; emptied by ``FitCycle.say_resume``)
``resume_removed``          rungs that were on and are no longer allowed (as ``resume_phrases``)
``uses_datamodule_length``  a batch got its length through the dataset's ``set_seq_len``, saved in
                            the checkpoint (``BatchCycle.cut``, ``FitCycle.load_state``)
``breakdown*``              ``breakdowns`` (traced with ``breakdown=True``), ``breakdown_table``,
                            ``breakdown_report`` (the report's section) (``FitCycle.run_breakdown``)
``breakdown_batch``         ``(length, batch)``: the longest batch seen (the batch end, rank zero)
``dry_runner``              the :class:`~lightning_seqmem.dryrun.run.TrainingRunDryRun`, or None
                            (``on_fit_start``: rank zero, ``dry_run=True``)
``compiled_reason``         why the module counts as compiled, or None (``FitCycle.check_compiled``)
``sharding_template``       an unsharded copy on meta for FSDP2 runs, or None (``setup``:
                            :func:`.access.sharding_template`)
``probe``                   this fit's :class:`~.probes.MemoryProbe` (``setup``: ``make_probe``)
``device``                  the strategy's root device (``setup``)
``fit_refs``                weakrefs to (Trainer, module) (``setup``; read by ``FitCycle.next_fit``)
``window_batch``            the open step window's batch (batch start to end; None between): a dry
                            run inside leaves room beside it (:func:`.own_memory.value_room_bytes`)
``validation``              the validation batches measured (rank zero: the first of each shape
                            dry-run), their predicted and measured peaks (``ValidationCheck``)
==========================  ========================================================================

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
    """The callback's per-fit run state (the table in the module docstring)."""

    failed: bool = False
    stopped: bool = False
    pending: Optional["PendingStep"] = None
    step_started_s: Optional[float] = None
    shape: Optional[tuple[int, int]] = None
    applicable_cache: dict[tuple, dict[str, tuple[bool, str]]] = dataclasses.field(
        default_factory=dict)
    noop_rungs: tuple[str, ...] = ()
    reapply_on_fit_start: bool = False
    resume_phrases: list[str] = dataclasses.field(default_factory=list)
    resume_removed: tuple[str, ...] = ()
    uses_datamodule_length: bool = False
    breakdowns: list[Any] = dataclasses.field(default_factory=list)
    breakdown_table: Optional[Any] = None
    breakdown_report: Optional[dict[str, Any]] = None
    breakdown_batch: Optional[tuple[int, Any]] = None
    dry_runner: Any = None
    compiled_reason: Optional[str] = None
    sharding_template: Any = None
    probe: Optional["MemoryProbe"] = None
    device: Optional["torch.device"] = None
    fit_refs: Optional[tuple[Any, Any]] = None
    window_batch: Any = None
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
