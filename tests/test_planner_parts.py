"""The planner as a façade over its parts: the names on it read and write its parts' state, the parts
read each other's (the rungs on, the settings), a checkpoint round trip rebuilds them bound to each
other, and a state that cannot be read changes nothing. Milliseconds, no torch."""

from __future__ import annotations

import pytest

from lightning_seqmem.core.curriculum import Curriculum
from lightning_seqmem.plan.planner import SeqMemPlanner
from test_planner import ALL, peak, planner, run


def _parts(p: SeqMemPlanner) -> tuple:
    return p.settings, p.ladder, p.course, p.evidence, p.advice, p.schedule


def test_names_on_the_facade_are_the_parts_state():
    p = planner(peak(300, 4), Curriculum(start=64, target=512, steps_per_stage=2, multiple_of=16))
    run(p, (4, 512), 8, applicable=ALL)
    assert p.applied_mitigations and p.applied_mitigations == p.ladder.applied == p.evidence.applied_mitigations
    assert p.records is p.evidence.records and len(p.records) == 8
    assert (p.stages, p.stage, p.capped_at) == (p.course.stages, p.course.stage, p.course.capped_at)
    assert p.mitigation_events[0]["name"] == p.applied_mitigations[0]
    p.applied_mitigations = ()  # written through the façade: every part sees it
    assert p.evidence.applied_mitigations == () and p.forecaster is p.forecasters[()]
    p.bind_run(compare_reserved=True, block_bytes=512)
    assert p.evidence.compare_reserved and p.compare_reserved and p.block_bytes == 512
    with pytest.raises(TypeError, match="`bind_run` got `tolerance`"):
        p.bind_run(tolerance=0.5)


def test_checkpoint_round_trip_rebuilds_bound_parts():
    p = planner(peak(300, 4), Curriculum(start=64, target=512, steps_per_stage=2, multiple_of=16))
    run(p, (4, 512), 8, applicable=ALL)
    state = p.state_dict()
    q = planner(peak(300, 4), Curriculum(start=64, target=512, steps_per_stage=2, multiple_of=16))
    q.load_state_dict(state)
    assert q.state_dict() == state
    assert q.evidence.ladder is q.ladder and q.evidence.advice is q.advice and q.evidence.settings is q.settings
    q.applied_mitigations = ()
    assert q.evidence.applied_mitigations == ()  # the loaded parts read each other, not a copy's


def test_unreadable_state_changes_nothing():
    p = planner(peak(300, 4), Curriculum(start=64, target=512, steps_per_stage=2, multiple_of=16))
    run(p, (4, 512), 5, applicable=ALL)
    before, parts = p.state_dict(), _parts(p)
    broken = dict(before, stage=99)
    with pytest.raises(ValueError, match="stage 99 is outside"):
        p.load_state_dict(broken)
    assert _parts(p) == parts and all(a is b for a, b in zip(_parts(p), parts))
    assert p.state_dict() == before
