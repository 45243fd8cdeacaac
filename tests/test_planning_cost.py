"""Planning cost: fewer dry runs for the same, never less safe, decisions
(lightning_seqmem.plan.dry_search)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from conftest import make_trainer
from lightning_seqmem import Curriculum, SeqMemCallback
from lightning_seqmem.reference.demo import LitGPT
from lightning_seqmem.plan.dry_search import bucket_up, dominating, largest_fitting
from lightning_seqmem.dryrun.step import dry_run_step
from lightning_seqmem.plan.planner import SeqMemPlanner
from lightning_seqmem.core.rungs import MITIGATIONS

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_buckets_round_up_by_at_most_an_eighth():
    for L in range(1, 5000):
        b = bucket_up(L)
        assert L <= b <= max(L, L * 9 // 8 + 1), (L, b)
    assert len({bucket_up(L) for L in range(64, 1025)}) == 33  # 8 per doubling, from 64 to 1024


def test_largest_fitting_is_exact_and_cheaper_than_a_bisection():
    rng = random.Random(0)
    calls_total, bisect_total = 0, 0
    for i in range(400):
        c, a, b = rng.randint(0, 10**6), rng.randint(0, 10**4), rng.randint(0, 100)
        steps = i % 2  # every other one not smooth: exact all the same
        peak = (lambda c, a, b, s: lambda x: c + a * x + b * x * x + s * (x // 7) * 50 * a)(
            c, a, b, steps)
        lo, hi = rng.randint(1, 64), rng.randint(65, 8192)
        budget = peak(rng.randint(lo, hi))
        calls = []
        got = largest_fitting(lo, hi, lambda x: calls.append(x) or peak(x), budget)
        assert got == max(x for x in range(lo, hi + 1) if peak(x) <= budget)
        if not steps:  # a step's peak: a quadratic in the length
            calls_total += len(calls)
            bisect_total += 1 + (hi - lo).bit_length()
    assert calls_total < 0.6 * bisect_total, (calls_total, bisect_total)


def test_a_bound_comes_only_from_shapes_not_shorter_and_not_smaller():
    answers = {(64, 4): 10, (256, 2): 20, (256, 4): 40}
    assert dominating(answers, 100, 2) == (256, 2)
    assert dominating(answers, 100, 4) == (256, 4)
    assert dominating(answers, 300, 1) is None


def _planner(peak, budget, calls, **kwargs):
    def dry(L, B, m):
        calls.append((L, B, m))
        p = peak(L, B, m)
        return p, {"forward": p}

    return SeqMemPlanner(memory_budget_bytes=budget, safety_margin=0.0, dry_runner=dry, **kwargs)


def test_dynamic_padding_is_judged_as_exactly_with_a_few_dry_runs():
    """200 new lengths: every verdict is the exact dry run's (fits iff its bound fits), 'over' is
    said only from a dry run of that very shape, and a few dry runs answer all of them."""
    peak = lambda L, B, m: 1_000_000 + B * (3000 * L + 5 * L * L)  # noqa: E731
    budget = int(peak(700, 4, ()) * 1.02)  # lengths above ~700 are over
    calls = []
    p = _planner(peak, budget, calls, mitigations=())
    lengths = random.Random(0).sample(range(64, 1025), 200)
    for L in lengths:
        p.evidence.dry.longest_seen = max(p.evidence.dry.longest_seen, L)
        n = len(calls)
        v = p.evidence.judge(L, 4)
        exact_bound = int(peak(L, 4, ()) * 1.02)  # the dry run of this shape, with its 2% margin
        assert v.kind == ("fits" if exact_bound <= budget else "over"), (L, v, exact_bound)
        assert v.bound_bytes >= exact_bound  # a bound from a larger shape, never a smaller one
        if v.kind == "over":  # from this very shape's dry run
            assert v.bound_bytes == exact_bound and (L, 4, ()) in p.evidence.dry.answers
        assert len(calls) - n <= 2  # a bucket and, where it is over, the shape itself
    over = sum(int(peak(L, 4, ()) * 1.02) > budget for L in lengths)
    # one or two per length over, a handful for the rest
    assert len(calls) <= 2 * over + 12, (len(calls), over)
    assert len(calls) < 200 // 2


def test_a_capped_stage_finds_the_same_length_with_fewer_dry_runs():
    """The longest length that fits with every rung (a stage over the budget): the guided search
    gives the bisection's answer, each length it returns dry-run itself."""
    def peak(L, B, m):
        act = B * (20 * L + (1 if "attention" in m else 8) * L * L
                   // (4 if "checkpointing" in m else 1))
        return 2_000_000 + act

    budget = peak(1500, 4, MITIGATIONS)
    calls = []
    p = _planner(peak, budget, calls,
                 curriculum=Curriculum(start=512, target=2048, steps_per_stage=1, multiple_of=8))
    p.evidence.measured.last_batch_size, p.course.stage_steps = 4, 1
    p.course.stage = 1  # 1024 ran; 2048 is next
    d = p.decide((4, 2048), {m: (True, "") for m in MITIGATIONS})
    assert d.action == "cap" and d.rungs == MITIGATIONS
    truth = max(L for L in range(8, 2048, 8) if int(peak(L, 4, MITIGATIONS) * 1.02) <= budget)
    assert (d.seq_len == truth and (truth, 4, MITIGATIONS) in p.evidence.dry.answers
            and (truth + 8, 4, MITIGATIONS) in p.evidence.dry.answers)
    capped = [c for c in calls if c[2] == MITIGATIONS]
    assert len(capped) <= 5, capped  # a bisection of (1024, 2048) in steps of 8: 1 + 7


class _Shuffled(Dataset):
    def __init__(self, lengths, batch_size=2):
        self.lengths, self.batch_size = lengths, batch_size

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        tokens = torch.randint(0, 256, (self.batch_size, self.lengths[i] + 1),
                               generator=torch.Generator().manual_seed(i))
        return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


# 10 steps and a few dry runs of a tiny model (~20 s; minutes on a loaded machine)
@pytest.mark.slow
def test_a_real_dynamic_padding_run_stays_in_budget_with_few_dry_runs():
    """Lightning, a real model, a new length every batch, a budget the longest lengths exceed: every
    measured step (the tracker) is within the usable budget, every step left unmeasured ran below a
    measured one with the same rungs (never recorded as measured), and far fewer dry runs than
    lengths ran."""
    lengths = random.Random(1).sample(range(16, 97), 10)
    module = LitGPT(n_layer=1, d_model=32, n_head=2, attention="eager")
    batch = _Shuffled([8], 2)[0]
    budget = dry_run_step(module, module.configure_optimizers(), batch, 72, 2).peak_bytes
    cb = SeqMemCallback(memory_budget=budget, safety_margin=0.0, warmup_steps=1)
    calls, during = [], []

    class Count(pl_callback()):
        # after SeqMemCallback's, which wires the dry run
        def on_fit_start(self, trainer, pl_module):
            inner = cb.planner.settings.dry_runner
            cb.planner.bind_run(dry_runner=lambda *key: calls.append(key) or inner(*key))

        # after SeqMemCallback's decision
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            ran.append((batch["input_ids"].shape[1], cb.applied_mitigations))

        # the dry runs while training (the report's come after)
        def on_train_batch_end(self, *args):
            during[:] = calls

    ran = []
    make_trainer([cb, Count()], max_steps=len(lengths)).fit(
        module, DataLoader(_Shuffled(lengths), batch_size=None))
    assert [L for L, _ in ran] == lengths
    measured = [(r.seq_len, r.mitigations) for r in cb.records]
    it = iter(ran)
    # the records: the steps that ran measured, in order
    assert all(m in it for m in measured), (measured, ran)
    assert len(measured) + cb.planner.schedule.unmeasured == len(lengths)
    # each step left unmeasured: below a measured earlier one, in budget
    for i, (L, setting) in enumerate(ran):
        if (L, setting) not in measured:
            assert any(r.seq_len >= L and r.mitigations == setting
                       and r.step < i for r in cb.records), (L, setting)
    assert all(r.peak_bytes <= cb.usable_budget_bytes
               for r in cb.records), [(r.seq_len, r.peak_bytes) for r in cb.records]
    assert any(r.mitigations for r in cb.records)  # the budget did bite: a rung went on
    # (others: the logged max_seq_len's search, checks)
    judged = [key for key in during if key[0] in lengths]
    assert len(judged) <= len(lengths) // 2, calls  # one per new length before


def pl_callback():
    from lightning.pytorch.callbacks import Callback

    return Callback


@pytest.mark.slow  # ~1 min on the shared 2-core machine (a few dry runs and two tiny fits)
def test_planning_cost_quick_json_has_the_overhead_per_layer_count():
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "planning_cost.py"), "--quick",
                           "--json", "--layers", "2", "--steps", "4", "--length", "128"],
                          capture_output=True, text=True, timeout=600, cwd=BENCHMARKS.parent)
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(figures["overhead_fraction"]) == {"2"}
    assert isinstance(figures["overhead_fraction"]["2"], float)
    assert figures["decision_dry_runs"]["2"] >= 1 and figures["run_dry_runs"]["2"] >= 1
    assert figures["over_budget_steps"] == {"2": 0}
