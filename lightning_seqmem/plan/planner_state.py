"""The planner's checkpoint: its flat plain-value state (the keys of earlier versions kept, so their
checkpoints load), and loading it back all or nothing. The schema and its validation, the bounded
records and the reconciliation of a changed configuration are in :mod:`lightning_seqmem.plan.checkpoint`."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Mapping

from lightning_seqmem.core import advice as A
from lightning_seqmem.core.events import MitigationEvent
from lightning_seqmem.core.forecast import Forecast, MemoryForecaster
from lightning_seqmem.core.records import StepRecord
from lightning_seqmem.core.rungs import check_mitigations, check_setting
from lightning_seqmem.plan.checkpoint import compact_records

if TYPE_CHECKING:  # pragma: no cover
    from lightning_seqmem.plan.planner import SeqMemPlanner

__all__ = ["load_planner_state", "planner_state"]


def planner_state(planner: "SeqMemPlanner") -> dict[str, Any]:
    """Flat plain values (the keys of earlier versions kept, so their checkpoints load); the records
    are bounded (:func:`~lightning_seqmem.plan.checkpoint.compact_records`, ``checkpoint_records``)."""
    return {
        "step": planner.step,
        "records": [r.to_dict() for r in compact_records(planner.records, planner.checkpoint_records, planner._measured_bound)],
        "forecasters": {"|".join(k): f.state_dict() for k, f in planner.forecasters.items()},
        "key_counts": [[k[0], k[1], list(k[2]), v] for k, v in planner._key_counts.items()],
        "warned": sorted(planner.warned),
        "warned_kinds": dict(planner.warned),
        "applied_mitigations": list(planner.applied_mitigations),
        "mitigations_left": list(planner.mitigations),
        "mitigation_events": [e.to_dict() for e in planner.mitigation_events],
        "refit_queue": list(planner.refit_queue),
        "decide_now": planner.decide_now,
        "stages": list(planner.stages),
        "stage": planner.stage,
        "stage_steps": planner.stage_steps,
        "capped_at": planner.capped_at,
        "last_batch_size": planner.last_batch_size,
        "last_verification_error": planner.last_verification_error,
        "pending": {"x".join(map(str, k[:2])) + "".join(f"|{m}" for m in k[2]): asdict(v)
                    for k, v in planner._pending.items()},
    }

def load_planner_state(planner: "SeqMemPlanner", state: Mapping[str, Any]) -> None:
    """Restore :func:`planner_state` (raises on a state this version cannot read; nothing is half-set:
    the state is loaded into a fresh copy, which then replaces the planner's fields)."""
    fresh = type(planner).__new__(type(planner))
    fresh.__dict__.update(planner.__dict__)
    fresh.reset()
    _load(fresh, state)
    planner.__dict__.update(fresh.__dict__)


def _load(planner: "SeqMemPlanner", state: Mapping[str, Any]) -> None:
    planner.step = int(state.get("step", 0))
    planner.records = [StepRecord.from_dict(r) for r in state.get("records", [])]
    planner.forecasters = {}
    for key, value in state.get("forecasters", {"": state.get("forecaster", {})}).items():
        forecaster = MemoryForecaster(tolerance=planner.tolerance)
        forecaster.load_state_dict(value)
        planner.forecasters[tuple(key.split("|")) if key else ()] = forecaster
    planner._key_counts = {(int(k0), int(k1), tuple(k2)): int(v) for k0, k1, k2, v in state.get("key_counts", [])}
    kinds = state.get("warned_kinds") or {}
    planner.warned = {str(k): str(kinds.get(k, A.kind_of_key(k))) for k in state.get("warned", [])}
    planner.applied_mitigations = check_setting(list(state.get("applied_mitigations", ())), "applied_mitigations")
    if "mitigations_left" in state:
        left = set(check_mitigations(list(state["mitigations_left"])))
        planner.mitigations = tuple(m for m in planner.mitigations if m in left or m in planner.applied_mitigations)
    planner.forecaster  # noqa: B018
    planner.mitigation_events = [MitigationEvent.from_dict(e) for e in state.get("mitigation_events", [])]
    planner.refit_queue = [int(L) for L in state.get("refit_queue", [])]
    planner.decide_now = bool(state.get("decide_now", False))
    planner.stages = tuple(int(s) for s in state.get("stages", planner.stages))
    planner.stage = int(state.get("stage", 0))
    if planner.stages and not 0 <= planner.stage < len(planner.stages):
        raise ValueError(f"stage {planner.stage} is outside the {len(planner.stages)} stages {list(planner.stages)}")
    planner.stage_steps = int(state.get("stage_steps", 0))
    planner.capped_at = state.get("capped_at")
    planner.last_batch_size = state.get("last_batch_size")
    planner.last_verification_error = state.get("last_verification_error")
    planner.resume_warmup = max(1, planner.warmup_steps_after_change)
    planner._pending = {}
    for key, fc in state.get("pending", {}).items():
        shape, *mitigations = key.split("|")
        L, B = (int(x) for x in shape.split("x"))
        planner._pending[(L, B, tuple(mitigations))] = Forecast(**fc)
