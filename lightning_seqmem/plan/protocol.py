"""``Planner``: the planner's protocol, what the Lightning edge calls (a :class:`typing.Protocol`).

The edge objects (:mod:`lightning_seqmem.trainer`) are written against it: only the callback, which
builds the planner, imports :class:`~lightning_seqmem.plan.planner.SeqMemPlanner`.

Example:
    >>> from lightning_seqmem.plan.planner import SeqMemPlanner
    >>> isinstance(SeqMemPlanner(), Planner)
    True
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol, Sequence, runtime_checkable

from lightning_seqmem.core.records import StepMemory, StepRecord
from lightning_seqmem.plan.advice_queue import AdviceQueue
from lightning_seqmem.plan.curriculum_state import CurriculumState
from lightning_seqmem.plan.decisions import Decision
from lightning_seqmem.plan.evidence import Evidence
from lightning_seqmem.plan.ladder_state import LadderState
from lightning_seqmem.plan.schedule import MeasurementSchedule, PendingStep
from lightning_seqmem.plan.settings import PlannerSettings

__all__ = ["Planner"]


@runtime_checkable
class Planner(Protocol):
    """Decide before a batch, commit it on every rank, switch rungs, measure, checkpoint."""

    settings: PlannerSettings
    evidence: Evidence
    ladder: LadderState
    course: CurriculumState
    advice: AdviceQueue
    schedule: MeasurementSchedule

    def decide(self, shape: tuple[int, int],
               applicable: Mapping[str, tuple[bool, str]]) -> Decision: ...

    def commit(self, decision: Decision) -> None: ...

    def on_rung(self, event: str, name: "str | Sequence[str]", detail: str = "",
                seq_len: Optional[int] = None, batch_size: Optional[int] = None,
                pending: Optional[PendingStep] = None) -> None: ...

    def begin_step(self, seq_len: int, batch_size: int, optimizer_steps: bool = True,
                   global_step: int = 0, epoch: int = 0) -> PendingStep: ...

    def observe(self, pending: PendingStep, memory: StepMemory, seq_len: Optional[int] = None,
                batch_size: Optional[int] = None,
                trace: Optional[tuple[int, int, StepMemory]] = None, rank: Optional[int] = None,
                step_seconds: Optional[float] = None, trained: bool = True) -> StepRecord: ...

    def bind_run(self, **facts: Any) -> None: ...

    def restart(self, allowed: Sequence[str], still_on: Sequence[str] = ()) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any],
                        run_config: Optional[Mapping[str, Any]] = None
                        ) -> tuple[list[str], tuple[str, ...]]: ...
