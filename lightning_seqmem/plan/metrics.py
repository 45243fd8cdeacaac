"""The planner's logged scalars in GiB (:data:`lightning_seqmem.core.tags.TAGS`): one measured
step's figures and the budget view (:meth:`~lightning_seqmem.plan.evidence.Evidence.budget_view`).

Example:
    >>> from lightning_seqmem.plan.advice_queue import AdviceQueue
    >>> from lightning_seqmem.plan.ladder_state import LadderState
    >>> from lightning_seqmem.plan.settings import PlannerSettings
    >>> evidence = Evidence(PlannerSettings(budget_bytes=2**30), LadderState(()), AdviceQueue())
    >>> evidence.budget_view(None, 4)   # nothing measured: no forecast to log yet
    {}
"""

from __future__ import annotations

from lightning_seqmem.core.records import PHASES, StepRecord
from lightning_seqmem.core.units import to_gib
from lightning_seqmem.plan.curriculum_state import CurriculumState
from lightning_seqmem.plan.evidence import Evidence

__all__ = ["metrics"]


def metrics(record: StepRecord, evidence: Evidence, course: CurriculumState) -> dict[str, float]:
    """The logged scalars of ``record`` (tags without the ``seqmem/`` prefix; GiB = 2³⁰ bytes)."""
    out: dict[str, float] = {"seq_len": record.seq_len, "batch_size": record.batch_size,
                             "warmup": float(record.warmup),
                             "peak_allocated_gib": to_gib(record.peak_bytes)}
    for phase in PHASES:
        value = getattr(record, f"{phase}_peak_bytes")
        if value is not None:
            out[f"peak_{phase}_gib"] = to_gib(value)
    if record.reserved_bytes is not None:
        out["reserved_gib"] = to_gib(record.reserved_bytes)
        out["fragmentation_gib"] = to_gib(record.fragmentation_bytes or 0)
        out["fragmentation_fraction"] = record.fragmentation_fraction or 0.0
        out["inactive_split_gib"] = to_gib(record.inactive_split_bytes or 0)
        out["alloc_retries"] = record.alloc_retries or 0
        out["num_ooms"] = record.num_ooms or 0
    if evidence.measured.last_verification_error is not None:
        out["verification_error"] = evidence.measured.last_verification_error
    if record.stage is not None:
        out["stage"] = record.stage
    out["mitigations_applied"] = len(record.mitigations)
    out.update(evidence.budget_view(course.next_stage, record.batch_size))
    return {k: float(v) for k, v in out.items()}
