"""A budget that nothing can meet, on the demo model: one clear error before training (or before
the batch where it is first known), never a run trained below the curriculum's start and over the
budget; advice that fits a CPU single-process run."""

from __future__ import annotations

import pytest

from conftest import make_trainer
from lightning_seqmem import Curriculum, MemoryBudgetError, SeqMemCallback
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.core.units import parse_bytes


def _fit(budget, max_steps=12, **kwargs):
    cb = SeqMemCallback(memory_budget=budget,
                        curriculum=Curriculum(start=64, target=256, steps_per_stage=3), **kwargs)
    trainer = make_trainer([cb], max_steps=max_steps)
    model = LitGPT()  # the demo's model: 2 layers, d=128, 1.8 MiB of parameters
    data = SyntheticTokenDataModule(batch_size=4, seq_len=256, num_samples=4 * max_steps)
    return cb, trainer, model, data


def test_a_budget_below_the_parameters_stops_before_the_first_step():
    cb, trainer, model, data = _fit("1MiB")
    param_bytes = sum(p.nbytes for p in model.parameters())
    assert param_bytes > parse_bytes("1MiB") * 0.9  # the premise: the parameters alone are over
    with pytest.raises(MemoryBudgetError,
                       match=r"memory_budget=1\.0 MiB cannot be met: the parameters and buffers "
                                                r"alone take 1\.8 MiB") as err:
        trainer.fit(model, datamodule=data)
    assert trainer.global_step == 0 and not cb.records and cb.applied_mitigations == ()
    assert "ZeRO" not in str(err.value) and "across GPUs" not in str(err.value)


def test_a_budget_that_even_the_first_stage_with_every_rung_cannot_meet_stops_before_the_first_step(
):
    # above the parameters (1.8 MiB), below weights + grads + AdamW
    cb, trainer, model, data = _fit("5MiB")
    with pytest.raises(MemoryBudgetError) as err:
        trainer.fit(model, datamodule=data)
    text = str(err.value)
    # no step ran, none below the start, none over
    assert trainer.global_step == 0 and not cb.records
    assert cb.applied_mitigations == ()  # nothing was switched on for a run that cannot happen
    assert "memory_budget=5.0 MiB cannot be met: seq_len=64 (batch 4)" in text
    assert ("with 'attention', 'checkpointing', 'microbatch' on" in text
            and "no length from 8 tokens up" in text)
    assert "ZeRO" not in text and "across GPUs" not in text


def test_the_stop_was_right_a_measured_step_at_the_start_is_over_that_budget():
    """The measurement behind the previous test's verdict: real steps at the start length, without a
    budget, each peak over the 5 MiB budget's usable 4.5 MiB (AdamW state and gradients alone)."""
    cb, trainer, model, data = _fit(None, max_steps=3)
    trainer.fit(model, datamodule=data)
    usable = parse_bytes("5MiB") * 0.9
    peaks = [r.peak_bytes for r in cb.records if r.step > 0]
    assert peaks and all(r.seq_len == 64 for r in cb.records) and min(peaks) > usable


def test_without_the_dry_run_the_run_stops_once_measured_steps_say_nothing_fits():
    cb, trainer, model, data = _fit("5MiB", max_steps=40, dry_run=False)
    with pytest.raises(MemoryBudgetError, match="cannot be met: a measured step began with") as err:
        trainer.fit(model, datamodule=data)
    assert "ZeRO" not in str(err.value) and "no mitigation lowers that" in str(err.value)
    # the second step is the first to begin with the optimizer state: the decision after it stops
    assert trainer.global_step == 2 and [r.step for r in cb.records] == [0, 1]
    # each step that ran was over
    assert min(r.peak_bytes for r in cb.records) > parse_bytes("5MiB") * 0.9


def test_summary_is_validated():
    with pytest.raises(ValueError, match="`summary` must be a bool, got 'no'"):
        SeqMemCallback(summary="no")
