"""``PlanView``: a planner's parts (settings, evidence, ladder, curriculum, advice) by reference,
without its methods. :mod:`lightning_seqmem.present` and the Lightning edge's outputs take a view,
never the planner, so nothing that draws or writes can decide, commit or observe; a resume
reconciles a loaded state's parts through one (:func:`~lightning_seqmem.plan.checkpoint.reconcile`).

Example:
    >>> from lightning_seqmem.plan.planner import SeqMemPlanner
    >>> p = SeqMemPlanner(memory_budget_bytes=2**20)
    >>> view = PlanView.of(p)
    >>> view.settings.usable_budget_bytes, view.evidence is p.evidence, view.ladder.applied
    (943718, True, ())
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_seqmem.plan.advice_queue import AdviceQueue
from lightning_seqmem.plan.curriculum_state import CurriculumState
from lightning_seqmem.plan.evidence import Evidence
from lightning_seqmem.plan.ladder_state import LadderState
from lightning_seqmem.plan.settings import PlannerSettings

__all__ = ["PlanView"]


@dataclass(frozen=True)
class PlanView:
    """A planner's parts, for reading (see the module doc)."""

    settings: PlannerSettings
    evidence: Evidence
    ladder: LadderState
    course: CurriculumState
    advice: AdviceQueue

    @classmethod
    def of(cls, planner: Any) -> "PlanView":
        """``planner``'s parts now (a later reset or load replaces them: take a new view)."""
        return cls(planner.settings, planner.evidence, planner.ladder, planner.course,
                   planner.advice)
