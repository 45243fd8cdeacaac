"""The planner over its parts: a handful of public names, the parts read each other's state (the
rungs on, the settings) by reference, a checkpoint round trip rebuilds them bound to each other, and
a state that cannot be read changes nothing. Milliseconds, no torch."""

from __future__ import annotations

import pytest

from lightning_seqmem.core.curriculum import Curriculum
from lightning_seqmem.plan.planner import RUNG_EVENTS, SeqMemPlanner
from test_planner import ALL, peak, planner, run


def _parts(p: SeqMemPlanner) -> tuple:
    return p.settings, p.ladder, p.course, p.evidence, p.advice, p.schedule


PROTOCOL = {"decide", "commit", "begin_step", "observe", "on_rung", "bind_run", "restart",
            "state_dict", "load_state_dict"}


def test_the_planner_has_a_handful_of_public_names_and_its_parts_share_state():
    p = planner(peak(300, 4), Curriculum(start=64, target=512, steps_per_stage=2, multiple_of=16))
    run(p, (4, 512), 8, applicable=ALL)
    public = {n for n in dir(p) if not n.startswith("_")}
    print(f"SeqMemPlanner public names ({len(public)}): {sorted(public)}")
    assert (public == PROTOCOL | {"settings", "evidence", "ladder", "course", "advice", "schedule"}
            and len(public) <= 15)
    assert (p.ladder.applied and p.evidence.ladder is p.ladder
            and len(p.evidence.measured.records) == 8)
    assert p.ladder.events[0]["name"] == p.ladder.applied[0]
    p.ladder.applied = ()  # one owner: every part reads it
    assert p.evidence.forecaster is p.evidence.measured.forecasters[()]
    p.bind_run(compare_reserved=True, block_bytes=512)
    assert p.evidence.settings.compare_reserved and p.settings.block_bytes == 512
    with pytest.raises(TypeError, match="`bind_run` got `tolerance`"):
        p.bind_run(tolerance=0.5)
    with pytest.raises(ValueError, match="`event` is 'up': pass one of " + ", ".join(RUNG_EVENTS)):
        p.on_rung("up", "attention")


def test_checkpoint_round_trip_rebuilds_bound_parts():
    p = planner(peak(300, 4), Curriculum(start=64, target=512, steps_per_stage=2, multiple_of=16))
    run(p, (4, 512), 8, applicable=ALL)
    state = p.state_dict()
    q = planner(peak(300, 4), Curriculum(start=64, target=512, steps_per_stage=2, multiple_of=16))
    q.load_state_dict(state)
    assert q.state_dict() == state
    assert (q.evidence.ladder is q.ladder and q.evidence.advice is q.advice
            and q.evidence.settings is q.settings)
    q.ladder.applied = ()
    # the loaded parts read each other, not a copy's
    assert q.evidence.forecaster is q.evidence.measured.forecasters[()]


def test_unreadable_state_changes_nothing():
    p = planner(peak(300, 4), Curriculum(start=64, target=512, steps_per_stage=2, multiple_of=16))
    run(p, (4, 512), 5, applicable=ALL)
    before, parts = p.state_dict(), _parts(p)
    broken = dict(before, stage=99)
    with pytest.raises(ValueError, match="stage 99 is outside"):
        p.load_state_dict(broken)
    assert _parts(p) == parts and all(a is b for a, b in zip(_parts(p), parts))
    assert p.state_dict() == before


def test_a_callback_and_its_planner_pickle_and_deep_copy_after_measured_steps():
    """Lightning pickles callbacks (``ddp_spawn``) and deep-copies them; the planner's parts (the
    rung specs bound to it included) must survive both, with what they measured."""
    import copy
    import pickle

    from lightning_seqmem.trainer.callback import SeqMemCallback

    cb = SeqMemCallback(memory_budget="1GiB")
    p = planner(budget=10**9, curriculum=Curriculum(start=64, target=256, steps_per_stage=2))
    run(p, (4, 1024), 6)
    assert p.evidence.measured.records
    for clone in (pickle.loads(pickle.dumps(p)), copy.deepcopy(p)):
        assert len(clone.evidence.measured.records) == len(p.evidence.measured.records)
        assert clone.settings.rung_specs == p.settings.rung_specs
    pickle.loads(pickle.dumps(cb))
    copy.deepcopy(cb)
