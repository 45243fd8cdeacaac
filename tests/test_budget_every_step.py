"""The budget promise on real training runs (live-tensor tracker): no measured step of any stage —
the first and the last included — exceeds the usable budget, and a warm-up step measured over the
budget changes what the next step runs."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from conftest import make_trainer
from lightning_seqmem import Curriculum, PredictedOOMWarning, SeqMemCallback
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule

MODEL = dict(n_layer=2, d_model=64, n_head=4)


@functools.lru_cache(maxsize=None)  # one measured run per (length, setting) for the whole module
def _peak(seq_len: int, batch_size: int = 4, **model) -> int:
    """The fitted peak of a step at ``seq_len``, measured by a separate run."""
    cb = SeqMemCallback(warmup_steps=2)
    torch.manual_seed(0)
    make_trainer([cb], max_steps=3).fit(
        LitGPT(**{**MODEL, **model}),
        SyntheticTokenDataModule(batch_size=batch_size, seq_len=seq_len, num_samples=16))
    return cb.records[-1].peak_bytes


def _fit(cb, max_steps, seq_len, batch_size=4, **model):
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([cb], max_steps=max_steps).fit(
            LitGPT(**{**MODEL, **model}),
            SyntheticTokenDataModule(batch_size=batch_size, seq_len=seq_len, num_samples=256))
    return [w for w in caught if issubclass(w.category, PredictedOOMWarning)]


def test_first_stage_change_is_not_blind():
    # the budget lies between the first two stages: before, the first change ran 4 steps over it
    p64, p128 = _peak(64), _peak(128)
    budget = (p64 + p128) // 2
    cb = SeqMemCallback(warmup_steps=1, memory_budget=budget, safety_margin=0.0, mitigations=(),
                        curriculum=Curriculum(start=64, target=512, steps_per_stage=2,
                                              multiple_of=16))
    oom = _fit(cb, 12, 512)
    assert max(r.peak_bytes for r in cb.records) <= budget, [
        (r.seq_len, r.peak_bytes) for r in cb.records]
    assert 128 not in {r.seq_len for r in cb.records}
    assert cb.planner.course.capped_at is not None and 64 <= cb.planner.course.capped_at < 128
    assert len(oom) == 1


def test_last_stage_stays_in_budget_with_rungs_available():
    # before, at the last stage nothing re-checked the budget: 12 of 12 steps ran over it
    p128, p256 = _peak(128), _peak(256)
    budget = (p128 + p256) // 2
    cb = SeqMemCallback(warmup_steps=1, memory_budget=budget, safety_margin=0.0,
                        mitigations=("checkpointing", "microbatch"),
                        curriculum=Curriculum(start=64, target=256, steps_per_stage=3,
                                              multiple_of=16))
    _fit(cb, 30, 256)
    assert max(r.peak_bytes for r in cb.records) <= budget, [
        (r.seq_len, r.peak_bytes, r.mitigations) for r in cb.records]
    assert cb.applied_mitigations, "a rung was needed to reach the last stage"
    assert cb.records[-1].seq_len == 256


def test_a_warmup_step_over_budget_switches_a_rung_on_before_the_next():
    # no curriculum, no dry run: the first (warm-up) step is measured over the budget
    p = _peak(256)
    budget = int(p * 0.8)
    cb = SeqMemCallback(warmup_steps=2, memory_budget=budget, safety_margin=0.0,
                        mitigations=("attention", "checkpointing"), dry_run=False)
    oom = _fit(cb, 4, 256)
    first, second = cb.records[0], cb.records[1]
    assert first.peak_bytes > budget and first.mitigations == ()
    assert second.mitigations == ("attention",) and second.peak_bytes < first.peak_bytes
    assert any("budget" in str(w.message) for w in oom)


def test_with_the_dry_run_not_even_the_first_step_is_over():
    p = _peak(256)
    budget = int(p * 0.8)
    cb = SeqMemCallback(warmup_steps=2, memory_budget=budget, safety_margin=0.0,
                        mitigations=("attention", "checkpointing"))
    _fit(cb, 4, 256)
    assert cb.records[0].mitigations and "mitigation:attention" in cb.records[0].events
    assert max(r.peak_bytes for r in cb.records) <= budget


@pytest.mark.parametrize("attention", ["eager"])
def test_no_step_over_budget_along_a_whole_ladder_run(attention):
    p = _peak(256, attention=attention)
    budget = int(p * 0.6)
    cb = SeqMemCallback(warmup_steps=1, memory_budget=budget, safety_margin=0.0,
                        curriculum=Curriculum(start=32, target=256, steps_per_stage=3,
                                              multiple_of=16))
    _fit(cb, 36, 256, attention=attention)
    assert max(r.peak_bytes for r in cb.records) <= budget, [
        (r.seq_len, r.peak_bytes, r.mitigations) for r in cb.records]
