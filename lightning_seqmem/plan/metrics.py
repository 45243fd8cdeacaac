"""The planner's logged scalars, in GiB (the tags of :data:`lightning_seqmem.core.tags.TAGS`): one
measured step's figures and the budget view (the next stage's forecast, the largest length that
fits, the headroom), read off the planner's evidence and where its curriculum stands.

Example:
    >>> from lightning_seqmem.plan.advice_queue import AdviceQueue
    >>> from lightning_seqmem.plan.ladder_state import LadderState
    >>> from lightning_seqmem.plan.settings import PlannerSettings
    >>> evidence = Evidence(PlannerSettings(budget_bytes=2**30), LadderState(()), AdviceQueue())
    >>> budget_view(evidence, CurriculumState(None), 4)   # nothing measured: no forecast to log yet
    {}
"""

from __future__ import annotations

from lightning_seqmem.core.records import PHASES, StepRecord
from lightning_seqmem.core.units import to_gib
from lightning_seqmem.plan.curriculum_state import CurriculumState
from lightning_seqmem.plan.evidence import Evidence

__all__ = ["budget_view", "metrics"]


def budget_view(evidence: Evidence, course: CurriculumState, batch_size: int) -> dict[str, float]:
    """Forecast for the next stage (or this length), largest length that fits, headroom (cached
    on ``evidence`` by the setting on, its fit, the stage and ``batch_size``)."""
    ev, stage, stages = evidence, course.stage, course.stages
    key = (ev.ladder.applied, ev.forecaster.version, stage, batch_size, len(stages))
    if ev.view_cache.get("key") == key:
        return ev.view_cache["value"]
    out: dict[str, float] = {}
    target = stages[stage + 1] if stage + 1 < len(stages) else None
    target = target or (ev.measured.records[-1].seq_len if ev.measured.records else None)
    # the fit of the setting on now; before it has two lengths, the dry run (when there is one)
    fc = None if not target else (ev.forecaster.forecast(target, batch_size) if ev.forecaster.ready
                                   else ev.dry.judged(target, batch_size))
    if fc is not None:
        bound = ev.bound_of(fc)
        out["forecast_next_gib"] = to_gib(bound)
        budget = ev.settings.usable_budget_bytes
        if budget is not None:
            out["budget_gib"] = to_gib(budget)
            out["max_seq_len"] = float(ev.max_seq_len(budget, batch_size))
            out["headroom_gib"] = to_gib(budget - bound)
            out["headroom_fraction"] = (budget - bound) / budget
    ev.view_cache = {"key": key, "value": out}
    return out


def metrics(record: StepRecord, evidence: Evidence, course: CurriculumState) -> dict[str, float]:
    """The logged scalars of ``record`` (tags without the ``seqmem/`` prefix; GiB = 2³⁰ bytes)."""
    out: dict[str, float] = {"seq_len": record.seq_len, "batch_size": record.batch_size,
                             "warmup": float(record.warmup), "peak_allocated_gib": to_gib(record.peak_bytes)}
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
    out.update(budget_view(evidence, course, record.batch_size))
    return {k: float(v) for k, v in out.items()}
