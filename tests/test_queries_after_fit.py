"""Queries after fit answer from what is known (issue 21): a rung that went on at the last steps,
with one length measured after it, left ``max_seq_len()`` raising ``NotEnoughMeasurements``."""

from __future__ import annotations

from test_planner import ALL, peak, planner, step


def test_max_seq_len_answers_after_a_rung_at_the_last_steps():
    budget = peak(300, 4)
    p = planner(budget, mitigations=("attention",))
    for L in (64, 64, 128, 128, 192, 192):
        step(p, (4, L), ALL)
    d, r = step(p, (4, 512), ALL)  # forecast over: attention goes on, one length measured after it
    assert r.mitigations == ("attention",) and not p.forecaster.ready
    answer = p.max_seq_len()  # raised NotEnoughMeasurements
    # the setting before the rung bounds this one (a mitigation never adds memory)
    assert answer == p.forecasters[()].max_seq_len(p.usable_budget_bytes, 4) > 0
    assert peak(answer, 4) <= budget
