"""The ladder as a plan: the dry run says which rungs a stage needs, they are switched on before it,
the curriculum never goes back, and no measured step exceeds the budget (real steps, tracker)."""

from __future__ import annotations

import warnings

import pytest
import torch

from conftest import make_trainer
from lightning_seqmem import Curriculum, SeqMemCallback
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule

# the same 4-layer eager GPT, its peak measured with rungs switched on first
from test_ladder import MODEL, _peak

TARGET = 256


@pytest.fixture(scope="module")
def two_rung_budget():
    one, two = _peak(TARGET, ("attention",)), _peak(TARGET, ("attention", "checkpointing"))
    assert two < one
    # the target fits with attention and checkpointing, not with attention alone
    return (one + two) // 2


def test_needed_rungs_are_on_before_the_stage_and_lengths_never_decrease(two_rung_budget):
    cb = SeqMemCallback(warmup_steps=1, memory_budget=two_rung_budget, safety_margin=0.0,
                        curriculum=Curriculum(start=32, target=TARGET, steps_per_stage=3,
                                              multiple_of=16))
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer([cb], max_steps=16).fit(
            LitGPT(**MODEL), SyntheticTokenDataModule(batch_size=4, seq_len=TARGET, num_samples=64,
                                                      vocab_size=64))
    lengths = [r.seq_len for r in cb.records]
    assert lengths == sorted(lengths) and lengths[-1] == TARGET  # never back to re-measure
    assert max(r.peak_bytes for r in cb.records) <= two_rung_budget
    # attention, then one more rung: the cheapest that the dry run says fits (by its step-time
    # prior: micro-batching, +10%, before checkpointing, +33%; plan.choose), not every rung
    assert cb.applied_mitigations[0] == "attention" and len(cb.applied_mitigations) == 2
    first_at_target = next(r for r in cb.records if r.seq_len == TARGET)
    assert first_at_target.mitigations == cb.applied_mitigations
    assert all(e["step"] <= first_at_target.step for e in cb.mitigation_events)
    # every forecast made before a length ran was the dry run's, and it was exact on the tracker
    verified = [r for r in cb.records if r.forecast_method is not None]
    assert (verified and all(r.forecast_method == "dry_run" and abs(r.forecast_error) < 0.01
                             for r in verified))


def test_forecast_method_is_the_dry_run_with_any_mitigations(two_rung_budget):
    cb = SeqMemCallback(warmup_steps=1, curriculum=Curriculum(
        start=32, target=64, steps_per_stage=2, multiple_of=16))
    torch.manual_seed(0)
    module = LitGPT(**MODEL)
    make_trainer([cb], max_steps=4).fit(
        module, SyntheticTokenDataModule(batch_size=4, seq_len=64, num_samples=32, vocab_size=64))
    plain, planned = (cb.forecast(TARGET),
                      cb.forecast(TARGET, mitigations=("attention", "checkpointing")))
    assert plain.method == planned.method == "dry_run"
    measured = _peak(TARGET, ("attention", "checkpointing"))
    assert abs(planned.peak_bytes - measured) <= 0.01 * measured
    assert planned.peak_bytes < plain.peak_bytes
    assert module.attention_backend == "eager"  # the forecast changed nothing on the real module
