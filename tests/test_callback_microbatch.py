"""The callback and micro-batching's first-step check: a loss that is not a mean is refused on
every rank, the record says the step ran whole, and the rung is not tried again."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from conftest import make_trainer
from lightning_seqmem import SeqMemCallback
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.mitigations.microbatch.microbatch_step import is_micro_batching

MODEL = dict(n_layer=1, d_model=32, n_head=2)


class SumLossGPT(LitGPT):
    def training_step(self, batch, batch_idx):
        logits = self(batch["input_ids"])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
                               reduction="sum")


def _fit(module, budget):
    cb = SeqMemCallback(warmup_steps=1, memory_budget=budget, safety_margin=0.0,
                        mitigations=("microbatch",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([cb], max_steps=4).fit(
            module, SyntheticTokenDataModule(batch_size=4, seq_len=64, num_samples=64))
    return cb, [str(w.message) for w in caught]


def _first_peak(module_cls):
    cb = SeqMemCallback(warmup_steps=1, mitigations=())
    torch.manual_seed(0)
    make_trainer([cb], max_steps=1).fit(
        module_cls(**MODEL), SyntheticTokenDataModule(batch_size=4, seq_len=64, num_samples=16))
    return cb.records[0].peak_bytes


def test_a_sum_loss_refuses_micro_batching_and_the_records_say_so():
    # the first step is over: micro-batching is asked for at once
    budget = _first_peak(SumLossGPT) - 1
    torch.manual_seed(0)
    module = SumLossGPT(**MODEL)
    cb, messages = _fit(module, budget)
    assert (not is_micro_batching(module) and cb.applied_mitigations == ()
            and "microbatch" not in cb.mitigations)
    # no step ran micro-batched: none says it did
    assert [r.mitigations for r in cb.records] == [()] * 4
    assert (cb.mitigation_events[0]["name"] == "microbatch"
            and "refused" in cb.mitigation_events[0]["removed"])
    assert any("could not switch on 'microbatch'" in m and "refused" in m for m in messages)
    assert sum("switching on the next mitigation" in m for m in messages) == 1  # not tried again


def test_a_mean_loss_keeps_micro_batching_and_the_check_step_is_not_fitted():
    budget = _first_peak(LitGPT) - 1
    torch.manual_seed(0)
    module = LitGPT(**MODEL)
    cb, _ = _fit(module, budget)
    assert is_micro_batching(module) and cb.applied_mitigations == ("microbatch",)
    first = next(r for r in cb.records if r.mitigations == ("microbatch",))
    assert first.warmup  # its peak holds the check's extra forwards
