"""The planner's logged scalars, in GiB (the tags of :data:`lightning_seqmem.core.tags.TAGS`): one
measured step's figures and the budget view (the next stage's forecast, the largest length that
fits, the headroom), read off a :class:`~lightning_seqmem.plan.planner.SeqMemPlanner`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_seqmem.core.records import PHASES, StepRecord
from lightning_seqmem.core.units import to_gib

if TYPE_CHECKING:  # pragma: no cover
    from lightning_seqmem.plan.planner import SeqMemPlanner

__all__ = ["budget_view", "metrics"]


def budget_view(planner: "SeqMemPlanner", batch_size: int) -> dict[str, float]:
    """Forecast for the next stage (or this length), largest length that fits, headroom (cached)."""
    key = (planner.applied_mitigations, planner.forecaster.version, planner.stage, batch_size, len(planner.stages))
    if planner._cache.get("key") == key:
        return planner._cache["value"]
    out: dict[str, float] = {}
    target = planner.stages[planner.stage + 1] if planner.stage + 1 < len(planner.stages) else None
    target = target or (planner.records[-1].seq_len if planner.records else None)
    # the fit of the setting on now; before it has two lengths, the dry run (when there is one)
    fc = None if not target else (planner.forecaster.forecast(target, batch_size) if planner.forecaster.ready
                                   else planner._dry_judged(target, batch_size))
    if fc is not None:
        bound = planner.bound_of(fc)
        out["forecast_next_gib"] = to_gib(bound)
        budget = planner.usable_budget_bytes
        if budget is not None:
            out["budget_gib"] = to_gib(budget)
            out["max_seq_len"] = float(planner.max_seq_len(budget, batch_size))
            out["headroom_gib"] = to_gib(budget - bound)
            out["headroom_fraction"] = (budget - bound) / budget
    planner._cache = {"key": key, "value": out}
    return out

def metrics(planner: "SeqMemPlanner", record: StepRecord) -> dict[str, float]:
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
    if planner.last_verification_error is not None:
        out["verification_error"] = planner.last_verification_error
    if record.stage is not None:
        out["stage"] = record.stage
    out["mitigations_applied"] = len(record.mitigations)
    out.update(budget_view(planner, record.batch_size))
    return {k: float(v) for k, v in out.items()}
