"""Millisecond twins of the Trainer runs that assert decisions (tests/test_ladder.py,
tests/test_budget_curriculum.py): the same scenarios on the torch-free planner, with a synthetic
step peak ``static + B·(a·L + b·L²)`` per setting and a dry run that answers it exactly (as the dry
run does on CPU). These are the unit tests of the decisions; the Trainer files keep one run per
scenario as the integration test on a real model with real measurement.
"""

from __future__ import annotations

from conftest import planner_batches
from test_planner import ALL, STATIC, planner

from lightning_seqmem.core.curriculum import Curriculum

# bytes per sample (per token, per token²): attention removes the L² term, checkpointing most of
# the linear one, micro-batching (batch 4 -> 1) divides the dynamic part by the batch size
COEFFS = {(): (3000, 40), ("attention",): (3000, 0), ("attention", "checkpointing"): (700, 0)}
STILL_QUADRATIC = {(): (3000, 40), ("attention",): (3000, 38)}  # an attention switch that stays L²


def peak(L, B, setting=(), coeffs=COEFFS):
    setting = tuple(setting)
    rows = 1 if "microbatch" in setting else B
    a, b = coeffs.get(tuple(m for m in setting if m != "microbatch"), coeffs[()])
    return STATIC + rows * (a * L + b * L * L)


def dry(coeffs=COEFFS):
    def dry_run(L, B, setting):
        value = peak(L, B, setting, coeffs)
        return value, {"forward": value}
    return dry_run


def run(p, shape, n, applicable=ALL, peak_fn=peak):
    """``n`` batches as the callback runs them (decide, commit, apply a rung where it was decided,
    measure, observe), each rung reported with the length and batch size it was decided at."""
    def switch_on(p, d, L, B):
        if d.rung is not None:
            p.on_rung("before", d.rung, seq_len=L, batch_size=B)
            p.on_rung("on", d.rung, "applied", L, B)

    return planner_batches(p, shape, n, applicable, peak_fn, STATIC, switch_on)


def _fits_unmitigated(budget, B=4):
    L = 16
    while peak(L + 16, B) <= budget:
        L += 16
    return L


LADDER_CURR = dict(start=32, target=640, steps_per_stage=2, multiple_of=16)
# like tests/test_ladder.py: the plain model fits 80 tokens, the target is 8x
BUDGET = peak(80, 4) + 1


def _ladder_run(mitigations, coeffs=COEFFS, steps=24):
    p = planner(BUDGET, Curriculum(**LADDER_CURR), mitigations=mitigations, dry_runner=dry(coeffs))
    out = run(p, (4, 640), steps, applicable=ALL, peak_fn=lambda L, B, s: peak(L, B, s, coeffs))
    return p, out, p.advice.take_advice()


def test_twin_the_ladder_reaches_the_target_within_budget_rungs_in_order():
    assert _fits_unmitigated(BUDGET) == 80
    p, out, advice = _ladder_run(("attention", "checkpointing", "microbatch"))
    lengths = [r.seq_len for _, r in out]
    assert lengths[-1] == 640 and p.course.capped_at is None
    assert lengths == sorted(lengths)  # the curriculum never goes back
    assert max(r.peak_bytes for _, r in out) <= BUDGET
    names = [e["name"] for e in p.ladder.events]
    assert names == list(p.ladder.applied) and names[0] == "attention" and len(names) >= 2
    # each switched on before the step it protected, its effect measured
    for event in p.ladder.events:
        record = next(r for _, r in out if f"mitigation:{event['name']}" in r.events)
        assert record.step == event["step"] and event["name"] in record.mitigations
        assert event["before_method"] in ("measured", "dry_run")
        if event["after_bytes"] is not None:
            assert event["after_bytes"] < event["before_bytes"], event
    warned = [a for a in advice if a.kind in ("stage_over_budget", "batch_over_budget")]
    assert (len(warned) <= len(names)
            and all(repr(n) in " ".join(a.text for a in warned) for n in names))


def test_twin_an_empty_ladder_warns_once_and_caps():
    p, out, advice = _ladder_run((), steps=10)
    assert p.ladder.applied == () and p.course.capped_at is not None and p.course.capped_at <= 80
    assert max(r.peak_bytes for _, r in out) <= BUDGET
    over = [a for a in advice if a.kind == "stage_over_budget"]
    assert len(over) == 1 and "switch attention to SDPA" in over[0].text


def test_twin_an_attention_switch_that_stays_quadratic_is_said_once():
    p, out, advice = _ladder_run(("attention",), coeffs=STILL_QUADRATIC, steps=12)
    assert p.ladder.applied == ("attention",) and p.ladder.events[0].get("checked")
    assert [a.kind for a in advice].count("attention_still_quadratic") == 1
    assert max(r.peak_bytes for _, r in out) <= BUDGET


def test_twin_a_fused_attention_switch_is_not_reported():
    p, _, advice = _ladder_run(("attention",), steps=12)
    assert p.ladder.events[0].get("checked")
    assert "attention_still_quadratic" not in [a.kind for a in advice]


def test_twin_the_curriculum_caps_between_stages_at_the_step_the_trainer_run_asserts():
    """tests/test_budget_curriculum.py: stages 32..512, 3 steps each, a budget between the peaks at
    256 and 512 (batch 2), no rung: one warning at the end of the 256 stage, capped from step 12."""
    budget = (peak(256, 2) + peak(512, 2)) // 2
    p = planner(budget, Curriculum(start=32, target=512, steps_per_stage=3, multiple_of=16),
                mitigations=(), dry_runner=dry())
    out = run(p, (2, 512), 21, applicable=ALL)
    lengths = [r.seq_len for _, r in out]
    cap = lengths[-1]
    assert max(r.peak_bytes for _, r in out) <= budget and 512 not in lengths
    assert 256 <= cap < 512 and cap % 16 == 0 and p.course.capped_at == cap
    over = [a for a in p.advice.take_advice() if a.kind == "stage_over_budget"]
    assert len(over) == 1 and "seq_len=512" in over[0].text and "SDPA" in over[0].text
    first_capped_step = lengths.index(cap) if cap != 256 else lengths.index(256) + 3
    assert first_capped_step == 12 and lengths[12:] == [cap] * (len(lengths) - 12)
