"""Planning cost at the end of fit: the largest length that fits confirmed by one dry run, report
rows and the figure's curve from the dry runs cached (lightning_seqmem.plan.dry_search,
present/dry_fit.py).

No model: the planner's dry run is an exact function of the length (a quadratic, or a max of two,
as a step's peak is), so every answer can be checked against the truth."""

from __future__ import annotations

import random
import pytest

from lightning_seqmem.core.records import StepRecord
from lightning_seqmem.plan.dry_search import confirmed_largest, fitted_bytes
from lightning_seqmem.plan.planner import SeqMemPlanner
from lightning_seqmem.present.dry_fit import DRY_RUN_FIT
from lightning_seqmem.present.panels import memory_figure
from lightning_seqmem.present.report import build_report
from lightning_seqmem.present.render import render_markdown
from lightning_seqmem.plan.view import PlanView


def test_confirmed_largest_fits_is_close_and_costs_one_call_on_a_quadratic():
    rng = random.Random(0)
    calls_total = 0
    for i in range(300):
        c, a, b = rng.randint(10**5, 10**7), rng.randint(0, 10**4), rng.randint(1, 100)
        # a second regime past `bend`: piecewise
        bend = rng.randint(200, 3000) if i % 3 == 0 else None
        peak = (lambda c, a, b, bend: lambda x: c + a * x + b * x * x
                + (3 * b * (x - bend) ** 2 if bend and x > bend else 0))(c, a, b, bend)
        lo = rng.randint(64, 512)
        truth_at = rng.randint(2 * lo, 8 * lo)
        budget = peak(truth_at)
        truth = max(x for x in range(lo, 16 * lo + 1) if peak(x) <= budget)
        calls = []
        # two or three lengths known
        known = {L: peak(L) for L in (lo // 2, 3 * lo // 4, lo)[i % 2:]}
        got = confirmed_largest(lo, 16 * lo, lambda x: calls.append(x) or peak(x), budget, known)
        assert lo <= got <= truth and peak(got) <= budget  # a lower bound, its own bound fits
        assert got in calls or got == lo  # backed by a call at that very length
        assert len(calls) <= 2
        if bend is None:
            assert got >= 0.97 * truth, (got, truth)
            if len(known) == 3:
                calls_total += len(calls)
    # one call on a quadratic with three lengths known (a bisection: about 11)
    assert calls_total <= 1.1 * 100, calls_total


def test_fitted_bytes_is_exact_at_the_points_and_never_falls_between_them():
    peak = {64: 1000, 128: 1500, 256: 1400 + 100, 512: 9000}
    assert all(fitted_bytes(peak, L) == v for L, v in peak.items())
    values = [fitted_bytes(peak, L) for L in range(64, 513)]
    assert all(b >= a for a, b in zip(values, values[1:]))


def _planner(peak, budget, calls):
    def dry(L, B, m):
        calls.append(L)
        return peak(L), {"forward": peak(L) // 2, "backward": peak(L)}

    p = SeqMemPlanner(memory_budget_bytes=budget, safety_margin=0.0, dry_runner=dry)
    p.evidence.measured.last_batch_size = 2
    return p


def _record(step, seq_len, peak):
    return StepRecord(step=step, global_step=step, seq_len=seq_len, batch_size=2, stage=None,
                      warmup=True, epoch=0, traced=False, peak_bytes=peak,
                      forward_peak_bytes=peak // 2, backward_peak_bytes=peak,
                      optimizer_peak_bytes=None, start_bytes=peak // 8, mitigations=())


def test_max_seq_len_before_a_fit_is_one_dry_run_a_lower_bound_and_stable():
    peak = lambda L: 2_000_000 + 300 * L + 4 * L * L  # noqa: E731
    budget = int(peak(1118) * 1.02)
    calls = []
    p = _planner(peak, budget, calls)
    # what the run dry-ran (a stage, the look-ahead)
    p.evidence.dry.peak(512, 2), p.evidence.dry.peak(1024, 2)
    p.evidence.measured.records = [_record(5, 500, peak(500))]
    calls.clear()
    got = p.evidence.max_seq_len()
    truth = max(L for L in range(512, 2049) if int(peak(L) * 1.02) <= budget)
    assert calls == [got] and int(peak(got) * 1.02) <= budget and 0.99 * truth <= got <= truth
    assert p.evidence.max_seq_len() == got and calls == [got]  # the same answer, no dry run
    assert build_report(PlanView.of(p))["forecasts"]["max_seq_len"] == got and calls == [got]


def test_report_and_figure_before_a_fit_run_no_dry_run_and_say_the_fit():
    peak = lambda L: 2_000_000 + 300 * L + 4 * L * L  # noqa: E731
    calls = []
    p = _planner(peak, int(peak(1118) * 1.02), calls)
    for L in (256, 512, 1024):
        p.evidence.dry.peak(L, 2)
    p.evidence.measured.records = [_record(3, 400, peak(400)), _record(4, 500, peak(500))]
    p.evidence.max_seq_len()  # (its one dry run: the report's first question)
    calls.clear()
    report = build_report(PlanView.of(p))
    rows = {r["seq_len"]: r for r in report["forecasts"]["at"]}
    assert calls == []  # every row from the dry runs cached or the fit through them
    assert {1000, 2000} <= set(rows) and rows[512]["method"] == "dry_run"
    assert (rows[2000]["method"] == DRY_RUN_FIT
            and "a fit, not a dry run at 2000" in rows[2000]["detail"])
    assert rows[500]["method"] == DRY_RUN_FIT  # the longest measured: between two dry runs
    # a quadratic: the fit is exact
    assert abs(rows[500]["peak_bytes"] - peak(500)) <= 0.001 * peak(500)
    assert rows[2000]["fits"] is False and rows[512]["fits"] is True
    assert ("method `dry_run_fit`: a quadratic through the lengths dry-run"
            in render_markdown(report))
    labels = memory_figure(PlanView.of(p)).axes[0].get_legend_handles_labels()[1]
    assert calls == []
    assert any(label.startswith("quadratic through the dry runs") for label in labels)
    assert any(label.startswith("dry run (batch 2") for label in labels)


@pytest.mark.parametrize("offset, linear, quadratic, most_dry_runs",
                         [(0, 90_000, 2, 1), (0, 300, 40, 1), (2_000_000, 90_000, 2, 2)])
def test_after_a_dynamic_padding_run_what_a_step_begins_with_anchors_the_guess(
        offset, linear, quadratic, most_dry_runs):
    """One length dry-run (the first decision's) and measured steps just below it (dynamic padding):
    what a step begins with is the peak's floor at length 0, a third point for the guess. Where the
    peak starts from it (near-linear growth, SDPA, or quadratic, eager attention): one confirming
    dry run, within 1% of the largest. Where the peak at length 0 sits above it (``offset``), the
    guess runs long and one more dry run answers: a lower bound within 2%."""
    from dataclasses import replace

    held = 20_000_000
    peak = lambda L: held + offset + linear * L + quadratic * L * L  # noqa: E731
    budget = int(peak(1118) * 1.02)
    calls = []
    p = _planner(peak, budget, calls)
    p.evidence.dry.peak(512, 2)
    p.evidence.measured.records = [replace(_record(s, L, peak(L)), start_bytes=held)
                                   for s, L in ((1, 401), (2, 498), (3, 509), (4, 512))]
    calls.clear()
    got = p.evidence.max_seq_len()
    truth = max(L for L in range(512, 2049) if int(peak(L) * 1.02) <= budget)
    # confirmed by its own dry run: a lower bound
    assert got in calls and int(peak(got) * 1.02) <= budget
    assert 0.98 * truth <= got <= truth and len(calls) <= most_dry_runs
    if most_dry_runs == 1:
        assert got >= 0.99 * truth
