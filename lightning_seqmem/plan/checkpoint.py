"""The callback's checkpoint state: what it was written under (:func:`run_config`), whether it can
be trusted (:func:`validate_state`), how it meets a changed configuration (:func:`reconcile`) and
how big it may grow (:func:`compact_records`, with the same decisions and report).

Example:
    >>> run_config(1_000_000, 0.0, ("attention", "microbatch"), None)
    ... # doctest: +NORMALIZE_WHITESPACE
    {'memory_budget_bytes': 1000000, 'safety_margin': 0.0,
     'mitigations': ['attention', 'microbatch'], 'curriculum': None}
    >>> validate_state({"step": 3, "applied_mitigations": "attention"})
    ... # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    lightning_seqmem.plan.checkpoint.InvalidState: `applied_mitigations` is 'attention', expected a
    list of distinct rung names from ('attention', 'checkpointing', 'microbatch', 'fused_loss',
    'tiled_mlp', 'activation_offload')
"""

from __future__ import annotations

import ast
import math
import numbers
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

from lightning_seqmem.core.curriculum import Curriculum
from lightning_seqmem.core.records import PHASES, StepRecord
from lightning_seqmem.core.rungs import is_setting, rung_names
from lightning_seqmem.core.units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from lightning_seqmem.plan.view import PlanView

CHECKPOINT_LAST_RECORDS = 256
"""Records kept in a checkpoint besides the per-(length, batch size, mitigations) summary
(~0.12 KiB each); in memory, every measured step is kept up to :data:`MEMORY_RECORDS`."""

MEMORY_RECORDS = 100_000
"""Records :attr:`SeqMemPlanner.records` holds before it is compacted like a checkpoint's, keeping
the last half (a very long run; the report then counts the records kept)."""

_PHASE_NAMES = PHASES + ("step",)
_METHODS = ("replay", "quadratic", "dry_run")
_LEGACY_PREFIX = "SeqMemCallback{"


class InvalidState(ValueError):
    """A state this version cannot trust: ``field``, its ``value``, what is ``accepted``."""

    def __init__(self, field: str, value: Any, accepted: str) -> None:
        text = repr(value)
        text = text if len(text) <= 80 else text[:77] + "..."
        super().__init__(f"`{field}` is {text}, expected {accepted}")
        self.field, self.value, self.accepted = field, value, accepted


# -- the configuration saved beside the state ------------------------------------------------------
def run_config(memory_budget_bytes: Optional[int], safety_margin: float,
               mitigations: Sequence[str], curriculum: Optional[Curriculum]) -> dict[str, Any]:
    """The settings a resumed state is reconciled against, as plain values (saved as "config")."""
    return {"memory_budget_bytes": memory_budget_bytes, "safety_margin": float(safety_margin),
            "mitigations": list(mitigations),
            "curriculum": None if curriculum is None else curriculum.to_dict()}


def legacy_key_config(key: Any) -> Optional[dict[str, Any]]:
    """The configuration in an earlier version's state ``key`` (curriculum: stages only), else None.

    >>> legacy_key_config("SeqMemCallback{'probe': 'auto', 'curriculum': (16, 32), "
    ...                   "'memory_budget': 1500000, 'mitigations': ('attention',)}")
    ... # doctest: +NORMALIZE_WHITESPACE
    {'memory_budget_bytes': 1500000, 'safety_margin': None, 'mitigations': ['attention'],
     'curriculum': None, 'stages': [16, 32]}
    """
    if not isinstance(key, str) or not key.startswith(_LEGACY_PREFIX):
        return None
    try:
        values = ast.literal_eval(key[len(_LEGACY_PREFIX) - 1:])
    except (ValueError, SyntaxError):
        return None
    if not isinstance(values, dict) or not {"memory_budget", "mitigations"} <= set(values):
        return None
    stages = values.get("curriculum")
    return {"memory_budget_bytes": values["memory_budget"], "safety_margin": None,
            "mitigations": list(values["mitigations"]), "curriculum": None,
            "stages": None if stages is None else list(stages)}


def find_legacy_state(callback_states: Mapping[Any, Any]) -> Optional[tuple[Any, dict[str, Any]]]:
    """``(key, config)`` of the one state saved under an earlier version's key, or None (none, or
    several: which one is this callback's cannot be told)."""
    found = [(k, c) for k, c in ((k, legacy_key_config(k)) for k in callback_states)
             if c is not None]
    return found[0] if len(found) == 1 else None


# -- validation ------------------------------------------------------------------------------------
def _int(field: str, value: Any, minimum: int = 0, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise InvalidState(field, value, f"{'None or ' if optional else ''}an int >= {minimum}")


def _float(field: str, value: Any, optional: bool = False, minimum: float = -math.inf) -> None:
    if optional and value is None:
        return
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value < minimum):
        bound = "" if minimum == -math.inf else f" >= {minimum:g}"
        raise InvalidState(field, value, f"{'None or ' if optional else ''}a finite number{bound}")


def _bool(field: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidState(field, value, "a bool")


def _str(field: str, value: Any, optional: bool = False) -> None:
    if not (isinstance(value, str) or (optional and value is None)):
        raise InvalidState(field, value, f"{'None or ' if optional else ''}a string")


def _list(field: str, value: Any) -> list:
    if not isinstance(value, (list, tuple)):
        raise InvalidState(field, value, "a list")
    return list(value)


def _dict(field: str, value: Any) -> Mapping:
    if not isinstance(value, Mapping):
        raise InvalidState(field, value, "a mapping")
    return value


def _rungs(field: str, value: Any) -> None:
    if not isinstance(value, (list, tuple)) or not is_setting(value):
        raise InvalidState(field, value, f"a list of distinct rung names from {rung_names()}")


def _phases(field: str, value: Any, allowed: Sequence[str] = _PHASE_NAMES) -> Mapping:
    value = _dict(field, value)
    for phase, nbytes in value.items():
        if phase not in allowed:
            raise InvalidState(f"{field} key", phase, f"a phase name from {tuple(allowed)}")
        _int(f"{field}[{phase!r}]", nbytes)
    return value


_RECORD_INTS = {"step": 0, "global_step": 0, "epoch": 0, "seq_len": 1, "batch_size": 1,
                "peak_bytes": 0, "start_bytes": 0}
_RECORD_OPTIONAL_INTS = ("forward_peak_bytes", "backward_peak_bytes", "optimizer_peak_bytes",
                         "reserved_bytes", "fragmentation_bytes", "inactive_split_bytes",
                         "alloc_retries", "num_ooms", "stage", "forecast_peak_bytes",
                         "forecast_upper_bytes", "rank")


def _record(field: str, r: Any) -> None:
    r = _dict(field, r)
    for name, minimum in _RECORD_INTS.items():
        if name not in r:
            raise InvalidState(field, r, f"a record with {name!r}")
        _int(f"{field}.{name}", r[name], minimum)
    for name in ("warmup", "traced"):
        if name not in r:
            raise InvalidState(field, r, f"a record with {name!r}")
        _bool(f"{field}.{name}", r[name])
    for name in _RECORD_OPTIONAL_INTS:
        _int(f"{field}.{name}", r.get(name), optional=True)
    for name in ("fragmentation_fraction", "forecast_error"):
        _float(f"{field}.{name}", r.get(name), optional=True)
    _float(f"{field}.step_seconds", r.get("step_seconds"), optional=True, minimum=0.0)
    _rungs(f"{field}.mitigations", r.get("mitigations", []))
    _str(f"{field}.forecast_method", r.get("forecast_method"), optional=True)
    for i, event in enumerate(_list(f"{field}.events", r.get("events", []))):
        _str(f"{field}.events[{i}]", event)


def _forecast(field: str, fc: Any) -> None:
    fc = _dict(field, fc)
    for name, minimum in (("seq_len", 1), ("batch_size", 1), ("peak_bytes", 0),
                          ("upper_bytes", 0), ("reserved_upper_bytes", 0)):
        _int(f"{field}.{name}", fc.get(name), minimum)
    _str(f"{field}.method", fc.get("method"))
    _phases(f"{field}.phase_peak_bytes", fc.get("phase_peak_bytes", {}))


def _trace(field: str, t: Any) -> None:
    t = _dict(field, t)
    _int(f"{field}.seq_len", t.get("seq_len"), 1)
    _int(f"{field}.batch_size", t.get("batch_size"), 1)
    _int(f"{field}.block_bytes", t.get("block_bytes", 1), 1)
    _int(f"{field}.measured_peak_bytes", t.get("measured_peak_bytes"), optional=True)
    events = _dict(f"{field}.events", t.get("events"))
    sizes = _list(f"{field}.events.sizes", events.get("sizes", []))
    for i, size in enumerate(sizes):
        _int(f"{field}.events.sizes[{i}]", size)
    ops = _list(f"{field}.events.ops", events.get("ops", []))
    if len(ops) != len(sizes) or any(not isinstance(op, str) for op in ops):
        raise InvalidState(f"{field}.events.ops", ops, f"{len(sizes)} op names, one per size")
    sequence = _list(f"{field}.events.sequence", events.get("sequence", []))
    for i, x in enumerate(sequence):
        if (isinstance(x, bool) or not isinstance(x, numbers.Integral)
                or not -len(sizes) <= x < len(sizes)):
            raise InvalidState(f"{field}.events.sequence[{i}]", x,
                               f"an allocation index i or ~i with 0 <= i < {len(sizes)}")
    starts = _phases(f"{field}.events.phase_starts", events.get("phase_starts", {}), PHASES)
    for phase, position in starts.items():
        if position > len(sequence):
            raise InvalidState(f"{field}.events.phase_starts[{phase!r}]", position,
                               f"a position <= {len(sequence)}")
    _int(f"{field}.events.num_existing", events.get("num_existing", 0))
    _int(f"{field}.events.left_bytes", events.get("left_bytes", 0))


def _forecaster(field: str, f: Any) -> None:
    f = _dict(field, f)
    for i, point in enumerate(_list(f"{field}.points", f.get("points", []))):
        if not isinstance(point, (list, tuple)) or len(point) != 3:
            raise InvalidState(f"{field}.points[{i}]", point,
                               "[seq_len, batch_size, {phase: bytes}]")
        _int(f"{field}.points[{i}] seq_len", point[0], 1)
        _int(f"{field}.points[{i}] batch_size", point[1], 1)
        _phases(f"{field}.points[{i}] peaks", point[2])
    _float(f"{field}.reserved_ratio", f.get("reserved_ratio", 1.0), minimum=0.0)
    for i, t in enumerate(_list(f"{field}.traces", f.get("traces", []))):
        _trace(f"{field}.traces[{i}]", t)
    for i, v in enumerate(_list(f"{field}.verifications", f.get("verifications", []))):
        v = _dict(f"{field}.verifications[{i}]", v)
        for name, minimum in (("seq_len", 1), ("batch_size", 1), ("forecast_bytes", 0),
                              ("measured_bytes", 0)):
            _int(f"{field}.verifications[{i}].{name}", v.get(name), minimum)
        if v.get("method") not in _METHODS:
            raise InvalidState(f"{field}.verifications[{i}].method", v.get("method"),
                               f"one of {_METHODS}")


def _setting(field: str, key: Any) -> None:
    if not isinstance(key, str):
        raise InvalidState(field, key, "rung names joined by '|'")
    _rungs(field, key.split("|") if key else [])


def _config(field: str, config: Any) -> None:
    config = _dict(field, config)
    _int(f"{field}.memory_budget_bytes", config.get("memory_budget_bytes"), 1, optional=True)
    _float(f"{field}.safety_margin", config.get("safety_margin"), optional=True, minimum=0.0)
    _rungs(f"{field}.mitigations", config.get("mitigations", []))
    if config.get("curriculum") is not None:
        try:
            Curriculum.from_dict(_dict(f"{field}.curriculum", config["curriculum"]))
        except (TypeError, ValueError) as exc:
            raise InvalidState(f"{field}.curriculum", config["curriculum"],
                               f"a Curriculum's arguments ({exc})") from None


def validate_state(state: Any) -> None:
    """Check a loaded callback state field by field; raise :class:`InvalidState` on the first bad
    one. Unknown keys are ignored (a newer version's); known ones must hold what this version
    writes (ints where it writes ints, known rung and phase names, stages strictly increasing).

    >>> validate_state({"step": 4, "stages": [16, 32], "stage": 1})
    >>> validate_state({"step": -1})
    Traceback (most recent call last):
    ...
    lightning_seqmem.plan.checkpoint.InvalidState: `step` is -1, expected an int >= 0
    """
    state = _dict("state", state)
    for name in ("step", "stage", "stage_steps"):
        _int(name, state.get(name, 0))
    for i, r in enumerate(_list("records", state.get("records", []))):
        _record(f"records[{i}]", r)
    forecasters = state.get("forecasters")
    if forecasters is None and "forecaster" in state:
        _forecaster("forecaster", state["forecaster"])
    for key, f in _dict("forecasters", forecasters or {}).items():
        _setting("forecasters key", key)
        _forecaster(f"forecasters[{key!r}]", f)
    for i, row in enumerate(_list("key_counts", state.get("key_counts", []))):
        if not isinstance(row, (list, tuple)) or len(row) != 4:
            raise InvalidState(f"key_counts[{i}]", row, "[seq_len, batch_size, rungs, count]")
        _int(f"key_counts[{i}] seq_len", row[0], 1)
        _int(f"key_counts[{i}] batch_size", row[1], 1)
        _rungs(f"key_counts[{i}] rungs", row[2])
        _int(f"key_counts[{i}] count", row[3])
    for i, key in enumerate(_list("warned", state.get("warned", []))):
        _str(f"warned[{i}]", key)
    for key, kind in _dict("warned_kinds", state.get("warned_kinds") or {}).items():
        _str("warned_kinds key", key)
        _str(f"warned_kinds[{key!r}]", kind)
    _rungs("applied_mitigations", state.get("applied_mitigations", []))
    _rungs("mitigations_left", state.get("mitigations_left", []))
    for i, event in enumerate(_list("mitigation_events", state.get("mitigation_events", []))):
        event = _dict(f"mitigation_events[{i}]", event)
        if event.get("name") not in rung_names():
            raise InvalidState(f"mitigation_events[{i}].name", event.get("name"),
                               f"a rung name from {rung_names()}")
        _int(f"mitigation_events[{i}].step", event.get("step", 0))
        for name in ("before_bytes", "after_bytes"):
            _int(f"mitigation_events[{i}].{name}", event.get(name), optional=True)
    for i, row in enumerate(_list("validation", state.get("validation", []))):
        row = _dict(f"validation[{i}]", row)
        for name, low in (("global_step", 0), ("rank", 0), ("seq_len", 1), ("batch_size", 1),
                          ("peak_bytes", None), ("dry_run_peak_bytes", None)):  # None: optional
            _int(f"validation[{i}].{name}", row.get(name), low or 0, optional=low is None)
        _rungs(f"validation[{i}].mitigations", row.get("mitigations"))
    for i, L in enumerate(_list("refit_queue", state.get("refit_queue", []))):
        _int(f"refit_queue[{i}]", L, 1)
    for name in ("decide_now", "uses_datamodule_length"):
        _bool(name, state.get(name, False))
    stages = _list("stages", state.get("stages", []))
    for i, L in enumerate(stages):
        _int(f"stages[{i}]", L, 1)
    if any(b <= a for a, b in zip(stages, stages[1:])):
        raise InvalidState("stages", stages, "strictly increasing lengths")
    if stages and state.get("stage", 0) >= len(stages):
        raise InvalidState("stage", state.get("stage"),
                           f"an index into the {len(stages)} stages {stages}")
    _int("capped_at", state.get("capped_at"), 1, optional=True)
    _int("last_batch_size", state.get("last_batch_size"), 1, optional=True)
    _float("last_verification_error", state.get("last_verification_error"), optional=True)
    for key, fc in _dict("pending", state.get("pending", {})).items():
        shape, *rungs = str(key).split("|")
        parts = shape.split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise InvalidState("pending key", key,
                               "'<seq_len>x<batch_size>' then '|<rung>' per rung")
        _rungs(f"pending[{key!r}] rungs", rungs)
        _forecast(f"pending[{key!r}]", fc)
    if state.get("config") is not None:
        _config("config", state["config"])


# -- bounded records -------------------------------------------------------------------------------
_NON_WARMUP_MAXIMA = ("peak_bytes", "forward_peak_bytes", "backward_peak_bytes",
                      "optimizer_peak_bytes", "reserved_bytes", "fragmentation_bytes")


def compact_records(records: Sequence[StepRecord], keep_last: int,
                    bound: Callable[[StepRecord], int]) -> list[StepRecord]:
    """The records a checkpoint keeps, in order: the last ``keep_last``, and per ``(seq_len,
    batch_size, mitigations)`` the first, the first with the largest ``bound`` and peak (warm-ups
    included), the first with the largest of each peak field among fitted ones, and every record
    with a verification or events: at most 10 per key besides ``keep_last``.

    >>> rs = [StepRecord(i, i, 0, 64, 2, i == 0, False, 100 + (i == 5), None, None, None, 10)
    ...       for i in range(50)]
    >>> [r.step for r in compact_records(rs, 3, lambda r: r.peak_bytes)]
    [0, 5, 47, 48, 49]
    """
    keep = set(range(max(0, len(records) - keep_last), len(records)))
    best: dict[tuple, int] = {}  # (key, what) -> index of the first record with the largest value

    def consider(i: int, key: tuple, what: str, value: Optional[int]) -> None:
        if value is None:
            return
        if (key, what) not in best or value > values[(key, what)]:
            best[(key, what)], values[(key, what)] = i, value

    values: dict[tuple, int] = {}
    for i, r in enumerate(records):
        key = (r.seq_len, r.batch_size, tuple(r.mitigations))
        best.setdefault((key, "first"), i)
        consider(i, key, "bound", bound(r))
        consider(i, key, "peak", r.peak_bytes)
        if not r.warmup:
            for name in _NON_WARMUP_MAXIMA:
                consider(i, key, f"fitted {name}", getattr(r, name))
        if r.forecast_error is not None or r.events:
            keep.add(i)
    keep |= set(best.values())
    return [records[i] for i in sorted(keep)]


# -- reconciliation --------------------------------------------------------------------------------
_BUDGET_ADVICE = frozenset(("stage_over_budget", "batch_over_budget", "first_step_over_budget"))


def _usable(config: Mapping[str, Any], default_margin: float) -> Optional[float]:
    budget = config.get("memory_budget_bytes")
    margin = config.get("safety_margin")
    return None if budget is None else budget * (1 - (default_margin if margin is None else margin))


def _old_stages(config: Mapping[str, Any]) -> Optional[tuple[int, ...]]:
    if config.get("curriculum") is not None:
        return Curriculum.from_dict(config["curriculum"]).stages
    return None if config.get("stages") is None else tuple(config["stages"])


def _bytes(value: Optional[int]) -> str:
    return "none" if value is None else format_bytes(value)


def _curriculum_change(old: Mapping[str, Any], old_stages: Sequence[int], new: Curriculum) -> str:
    """``target 256 -> 512, steps_per_stage 2 -> 4`` (the stages when only they were saved)."""
    if old.get("curriculum") is None:
        return f"stages {list(old_stages)} -> {list(new.stages)}"
    before, after = old["curriculum"], new.to_dict()
    return ", ".join(f"{k} {before.get(k)} -> {after[k]}" for k in after
                     if before.get(k) != after[k])


def _reconcile_ladder(old: Mapping[str, Any], new: Mapping[str, Any], allowed: Sequence[str],
                      left: Optional[Sequence[str]], parts: "PlanView"
                      ) -> tuple[list[str], tuple[str, ...], list[str]]:
    """The ladder's part of :func:`reconcile`: ``(phrases, removed_rungs, newly_allowed_rungs)``."""
    phrases: list[str] = []
    old_ladder = old.get("mitigations")
    applied = tuple(parts.ladder.applied)
    kept = tuple(m for m in applied if m in allowed)
    removed = tuple(m for m in applied if m not in allowed)
    failed = (set() if old_ladder is None or left is None
              else set(old_ladder) - set(left) - set(applied))
    newly_allowed = [m for m in allowed
                     if old_ladder is not None and m not in old_ladder and m not in failed]
    if old_ladder is not None and list(old_ladder) != list(new["mitigations"]):
        phrases.append(f"mitigations {list(old_ladder)} -> {list(new['mitigations'])}")
    if old_ladder is not None:
        parts.ladder.allow(tuple(m for m in allowed if m not in failed))
    if removed:
        parts.ladder.keep_on(kept)
        parts.evidence.forecaster  # noqa: B018 - the fit of the setting now on
        parts.ladder.mark_removed(removed, "no longer allowed by `mitigations` on resume")
        parts.course.replan()
    return phrases, removed, newly_allowed


def reconcile(old: Optional[Mapping[str, Any]], new: Mapping[str, Any], allowed: Sequence[str],
              left: Optional[Sequence[str]],
              parts: "PlanView") -> tuple[list[str], tuple[str, ...]]:
    """Fit the just-loaded ``parts`` of a planner to the configuration ``new`` it resumes under,
    from the ``old`` one its state was written under. Returns ``(phrases, removed_rungs)``: what
    changed, one phrase each, and the rungs on that are no longer allowed. ``allowed``: the new
    ladder less the rungs this run cannot take; ``left``: the saved ``mitigations_left``. A raised
    (or removed) budget or a newly allowed rung lifts a curriculum cap; a changed curriculum keeps
    the length it had reached (on the new ``multiple_of``, within its start and target) and a cap
    that still binds; rungs that failed before stay out."""
    old = dict(old or {})
    phrases, removed, newly_allowed = _reconcile_ladder(old, new, allowed, left, parts)
    # -- the budget
    old_usable, new_usable = (_usable(old, parts.settings.safety_margin),
                              _usable(new, parts.settings.safety_margin))
    old_margin = new["safety_margin"] if old.get("safety_margin") is None else old["safety_margin"]
    budget_changed = "memory_budget_bytes" in old and (old["memory_budget_bytes"], old_margin) != (
        new["memory_budget_bytes"], new["safety_margin"])
    raised = (budget_changed and old_usable is not None
              and (new_usable is None or new_usable > old_usable))
    if budget_changed:
        margin = ("" if old_margin == new["safety_margin"]
                  else f", safety_margin {old_margin} -> {new['safety_margin']}")
        phrases.append(f"memory_budget {_bytes(old.get('memory_budget_bytes'))} -> "
                       f"{_bytes(new['memory_budget_bytes'])}{margin}")
        parts.advice.forget(_BUDGET_ADVICE)
    # -- the curriculum
    curriculum: Optional[Curriculum] = parts.settings.curriculum
    old_stages = _old_stages(old)
    here = parts.course.stages[parts.course.stage] if parts.course.stages else None
    cap = parts.course.capped_at
    lift = cap is not None and (raised or bool(newly_allowed))
    if curriculum is None:
        if parts.course.stages:
            phrases.append("curriculum removed: the data's own lengths run")
        parts.course.without_curriculum()
    else:
        changed = old_stages is not None and (tuple(old_stages) != curriculum.stages or (
            old.get("curriculum") is not None and old["curriculum"] != curriculum.to_dict()))
        if not parts.course.stages:  # no curriculum before: it starts at its first stage
            parts.course.resume_at(curriculum.stages, 0, parts.course.capped_at, restart_stage=True)
            if old_stages is None and "curriculum" in old:
                phrases.append(f"curriculum added: starts at seq_len={curriculum.stages[0]}")
        elif changed or lift:
            stages = list(curriculum.stages)
            cap = None if lift or cap is None or cap >= stages[-1] else cap
            if cap is not None:
                stages = [s for s in stages if s < cap] + [cap]
            position = max(min(here, stages[-1]), stages[0])
            if position not in stages:  # a length between two stages: kept, on the new multiple_of
                position = max(position - position % curriculum.multiple_of, stages[0])
                stages = sorted(set(stages) | {position})
            parts.course.resume_at(tuple(stages), stages.index(position), cap,
                                   restart_stage=position != here, decide_now=lift)
            if changed:
                phrases.append(f"curriculum {_curriculum_change(old, old_stages, curriculum)}: "
                               f"resumes at seq_len={position} "
                               f"(stage {parts.course.stage + 1} of {len(stages)})")
            if lift:
                why = ("the budget was raised" if raised
                       else f"{', '.join(map(repr, newly_allowed))} may now be switched on")
                phrases.append(f"the cap at seq_len={here} is lifted ({why}): the next stage is "
                               "judged at the next batch")
    return phrases, removed


__all__ = ["CHECKPOINT_LAST_RECORDS", "MEMORY_RECORDS", "InvalidState", "compact_records",
           "find_legacy_state", "legacy_key_config", "reconcile", "run_config", "validate_state"]
