"""``MitigationEvent``: a frozen value that reads, saves and loads as the event dict of earlier
versions; the ladder changes one only by replacement. The gathered rank row read by name.
Milliseconds, no Trainer."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

import pytest

from lightning_seqmem.core.curriculum import Curriculum
from lightning_seqmem.core.events import EVENT_KEYS, MitigationEvent
from lightning_seqmem.core.records import PHASES, StepMemory
from lightning_seqmem.plan.ladder_state import LadderState
from test_planner import ALL, peak, planner, run


def _old_dict(**later) -> dict:
    """The dict ``LadderState.switched_on`` built before the value (and what was set on it
    later)."""
    return {"name": "checkpointing", "step": 3, "seq_len": 512, "batch_size": 4,
            "detail": "4 blocks",
            "before_bytes": 10_000, "before_method": "measured", "after_bytes": None,
            "mitigations_before": ["attention"], **later}


def test_round_trip_is_the_old_dict_byte_for_byte():
    for old in (_old_dict(), _old_dict(after_bytes=6_000, checked=True, removed="it broke"),
                _old_dict(removed="it broke", checked=True)):
        event = MitigationEvent.from_dict(old)
        assert event.to_dict() == old and dict(event) == old
        assert json.dumps(event.to_dict()) == json.dumps(old)  # the same keys in the same order
        assert MitigationEvent.from_dict(event.to_dict()).to_dict() == old
    assert (event.mitigations_before == ("attention",) and event.checked is True
            and event.removed == "it broke")


def test_frozen_and_a_read_only_mapping():
    event = MitigationEvent.from_dict(_old_dict())
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.after_bytes = 1  # type: ignore[misc]
    assert isinstance(event, Mapping) and not hasattr(event, "__setitem__")
    assert (event["name"] == "checkpointing" and event.get("checked") is None
            and "removed" not in event)
    with pytest.raises(KeyError):
        event["removed"]
    assert len(event) == 9 and list(event) == list(EVENT_KEYS[:9])
    assert event == _old_dict() and [event] == [_old_dict()] and event != _old_dict(step=4)
    event["mitigations_before"].append("x")  # a copy: the value does not change
    assert event.mitigations_before == ("attention",)
    # reads as the dict (tests/scripts/fsdp2_run.py)
    assert "'before_method': 'measured'" in str(event)
    with pytest.raises(ValueError, match="needs a `name`"):
        MitigationEvent.from_dict({"step": 1})


def test_an_old_checkpoints_events_load_and_save_unchanged():
    """``data_old_state.json`` (before the planner): events without batch_size, before_method,
    mitigations_before; one with ``checked``. They load and are saved as they came."""
    old = json.loads((Path(__file__).parent
                      / "data_old_state.json").read_text())["state"]["mitigation_events"]
    events = [MitigationEvent.from_dict(e) for e in old]
    assert ([e.to_dict() for e in events] == old
            and json.dumps([e.to_dict() for e in events]) == json.dumps(old))
    assert events[0].checked and events[0].batch_size is None and events[1].get("checked") is None
    assert "batch_size" not in events[0] and events[0].mitigations_before == ()
    # a newer version's key is kept
    newer = MitigationEvent.from_dict({**old[1], "a_newer_key": [1, 2]})
    assert newer["a_newer_key"] == [1, 2] and newer.to_dict() == {**old[1], "a_newer_key": [1, 2]}


def test_the_ladder_replaces_events():
    ladder = LadderState(("attention", "checkpointing"))
    ladder.switched_on("checkpointing", 3, 512, 4, "4 blocks", 10_000, "measured")
    first = ladder.events[-1]
    assert first == _old_dict(mitigations_before=[])
    ladder.measured_after(-1, 6_000)
    ladder.mark_checked(-1)
    ladder.removed("checkpointing", "it broke")
    last = ladder.events[-1]
    # the value read before did not change
    assert first.after_bytes is None and "checked" not in first
    assert last == _old_dict(mitigations_before=[], after_bytes=6_000, checked=True,
                             removed="it broke")
    # in the order they were set, as the dict had them
    assert list(last)[-2:] == ["checked", "removed"]
    ladder.removed("checkpointing", "again")  # marked once
    assert ladder.events[-1]["removed"] == "it broke"
    ladder.events.append(first)  # a copy: the ladder's own list does not change
    assert len(ladder.events) == 1


def test_assigning_dicts_gives_values():
    p = planner(peak(300, 4), Curriculum(start=64, target=512, steps_per_stage=2, multiple_of=16))
    p.ladder.events = [_old_dict()]
    assert isinstance(p.ladder.events[0], MitigationEvent) and p.ladder.events == [_old_dict()]


def test_a_planner_checkpoint_saves_plain_dicts_and_loads_values():
    p = planner(peak(300, 4), Curriculum(start=64, target=512, steps_per_stage=2, multiple_of=16))
    run(p, (4, 512), 8, applicable=ALL)
    state = p.state_dict()
    assert state["mitigation_events"] and all(type(e) is dict for e in state["mitigation_events"])
    # measured after the rung, by replacement
    assert state["mitigation_events"][0]["after_bytes"] is not None
    q = planner(peak(300, 4), Curriculum(start=64, target=512, steps_per_stage=2, multiple_of=16))
    q.load_state_dict(json.loads(json.dumps(state)))
    assert all(isinstance(e, MitigationEvent) for e in q.ladder.events)
    assert json.dumps(q.state_dict()["mitigation_events"]) == json.dumps(state["mitigation_events"])


def test_the_gathered_row_is_read_by_name():
    from lightning_seqmem.trainer.ranks import _INT_FIELDS, MeasuredRow

    values = {f: 1000 + 10 * i for i, f in enumerate(_INT_FIELDS)}  # each counter its own value
    memory = StepMemory(phase_peak_bytes={p: 500 + i for i, p in enumerate(PHASES)},
                        fragmentation_fraction=values["fragmentation_bytes"]
                        / values["reserved_bytes"], **values)
    row = MeasuredRow.from_list(MeasuredRow.of(False, False, memory, (4, 256)).to_list())
    assert (row.memory(None) == memory and row.peak_bytes == memory.peak_bytes
            and (row.seq_len, row.batch_size) == (256, 4))
