"""The mitigation ladder on a real run: reach a target 8× beyond what fits, never exceed the budget.

The integration test on a real model with real measurement; the decisions' unit tests are their
millisecond twins in tests/test_planner_twins.py.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import lightning.pytorch as pl
from conftest import make_trainer
from lightning_seqmem import Curriculum, PredictedOOMWarning, SeqMemCallback
from lightning_seqmem.core.rungs import base_name
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.mitigations.checkpointing.checkpointing import is_checkpointed
from lightning_seqmem.mitigations.microbatch.microbatch_step import is_micro_batching
from lightning_seqmem.mitigations import ladder
from lightning_seqmem.core.rungs import MITIGATIONS

MODEL = dict(n_layer=4, d_model=64, n_head=4, vocab_size=64, attention="eager")
BUDGET = 10_700_000  # bytes; the unmitigated eager model fits 80 tokens at batch 4, not 96
TARGET = 640  # 8 × 80


@functools.lru_cache(maxsize=None)  # one measured run per (length, setting) for the whole module
def _peak(seq_len, names=()):
    """Measured peak of a step at ``seq_len`` with ``names`` switched on before training."""
    cb = SeqMemCallback(warmup_steps=2, mitigations=())

    class SwitchOn(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            for name in names:
                assert ladder.apply(name, trainer, pl_module).applied

    torch.manual_seed(0)
    make_trainer([SwitchOn(), cb], max_steps=3).fit(
        LitGPT(**MODEL), SyntheticTokenDataModule(batch_size=4, seq_len=seq_len, num_samples=16,
                                                  vocab_size=64)
    )
    return cb.records[-1].peak_bytes


def _run(mitigations, max_steps=20, **model):
    cb = SeqMemCallback(
        warmup_steps=1, memory_budget=BUDGET, safety_margin=0.0, mitigations=mitigations,
        curriculum=Curriculum(start=32, target=TARGET, steps_per_stage=2, multiple_of=16),
    )
    torch.manual_seed(0)
    module = LitGPT(**{**MODEL, **model})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([cb], max_steps=max_steps).fit(
            module, SyntheticTokenDataModule(batch_size=4, seq_len=TARGET,
                                             num_samples=4 * max_steps, vocab_size=64)
        )
    return cb, module, [w for w in caught if issubclass(w.category, PredictedOOMWarning)]


def test_unmitigated_model_fits_an_eighth_of_the_target():
    # one fit of batches of 80, 80 and 96 tokens: the measured peaks of the second and third steps,
    # both with the optimizer state (the first step starts without it)
    cb = SeqMemCallback(warmup_steps=1, mitigations=())
    lengths = [80, 80, 96]
    torch.manual_seed(0)
    make_trainer([cb], max_steps=len(lengths)).fit(
        LitGPT(**MODEL), torch.utils.data.DataLoader(_Padded(lengths), batch_size=None))
    assert [r.seq_len for r in cb.records] == lengths
    at_80, at_96 = (r.peak_bytes for r in cb.records[1:])
    assert at_80 <= BUDGET < at_96


def test_ladder_reaches_the_target_within_budget(monkeypatch):
    # the plan reaches 640 at step 10 (the 11th batch: two per length, 32 to 512 doubling)
    import lightning_seqmem.dryrun.run as run

    programs, dry_run_step = [], run.dry_run_step

    def counted(module, optimizer, batch, seq_len, batch_size, names, **kwargs):
        program = (seq_len, batch_size, names, module.attention_backend, is_checkpointed(module),
                   is_micro_batching(module), kwargs.get("autocast"))
        programs.append(program)
        return dry_run_step(module, optimizer, batch, seq_len, batch_size, names, **kwargs)

    monkeypatch.setattr(run, "dry_run_step", counted)
    cb, module, oom = _run(MITIGATIONS, max_steps=11)
    # no program dry-run twice: micro-batching's one-time check was counted by the dry runs made
    # before its first step, dropped then, and by none after (a later change of checkpointing
    # levels kept its answers)
    assert len(programs) == len(set(programs)) > 10, programs
    assert all(abs(r.forecast_error) < 1e-4 for r in cb.records if r.forecast_method == "dry_run")
    lengths = [r.seq_len for r in cb.records]
    assert lengths[-1] == TARGET and cb.planner.course.capped_at is None
    assert max(r.peak_bytes for r in cb.records) <= BUDGET  # never measured above the budget
    names = [e["name"] for e in cb.mitigation_events]
    # an upgrade (checkpointing 1 of 4 blocks -> 2 of 4) replaces its rung's entry: one per rung
    assert (list(dict.fromkeys(map(base_name, names)))
            == list(map(base_name, cb.applied_mitigations)))
    assert names[0] == "attention" and len(names) >= 2 and names[-1] in cb.applied_mitigations
    # each mitigation: when (a record carries the event), and its measured effect at that length
    for event in cb.mitigation_events:
        record = next(r for r in cb.records if f"mitigation:{event['name']}" in r.events)
        assert record.step == event["step"] and event["name"] in record.mitigations
        assert event["before_method"] in ("measured", "dry_run")
        if event["after_bytes"] is not None:  # measured at the length where it was decided
            assert event["after_bytes"] < event["before_bytes"], event
    assert any(e["after_bytes"] is not None for e in cb.mitigation_events)
    lengths_seen = [r.seq_len for r in cb.records]
    # the dry run plans the rungs: the curriculum never goes back
    assert lengths_seen == sorted(lengths_seen)
    assert module.attention_backend == "sdpa"
    assert is_checkpointed(module) == any(base_name(n) == "checkpointing" for n in names)
    assert is_micro_batching(module) == ("microbatch" in names)
    # one warning per decision, naming the rungs it switched on
    said = " ".join(str(w.message) for w in oom)
    assert all(repr(name) in said for name in names) and len(oom) <= len(names), said
    assert all("Switching on " in str(w.message) for w in oom)


def test_attention_switch_that_stays_quadratic_is_reported():
    """With attention dropout, SDPA on CPU takes its math path: the L² term stays, and we say so."""
    # switched on at step 2 (48 tokens), checked at step 3 (the last), capped at 48 from then on
    cb, module, oom = _run(("attention",), max_steps=4, attention_dropout=0.1)
    assert cb.applied_mitigations == ("attention",) and module.attention_backend == "sdpa"
    still = [w for w in oom if "still grows quadratically" in str(w.message)]
    assert len(still) == 1 and "attention dropout" in str(still[0].message)
    assert cb.mitigation_events[0].get("checked")


def test_attention_switch_to_a_fused_kernel_is_not_reported():
    # switched on at step 4 (96 tokens), checked at step 5 (the last)
    cb, _, oom = _run(("attention",), max_steps=6)
    assert cb.mitigation_events[0].get("checked")
    assert not [w for w in oom if "still grows quadratically" in str(w.message)]


def test_empty_ladder_warns_and_caps():
    # capped at 64 tokens from step 2 on, decided at step 4 (the last), where 128 would be next
    cb, module, oom = _run((), max_steps=5)
    assert cb.applied_mitigations == () and module.attention_backend == "eager"
    assert cb.planner.course.capped_at is not None and cb.planner.course.capped_at < 96
    assert max(r.peak_bytes for r in cb.records) <= BUDGET
    assert len(oom) == 1 and "switch attention to SDPA" in str(oom[0].message)


def test_ladder_validation():
    with pytest.raises(ValueError, match="`mitigations` must be a sequence of distinct names"):
        SeqMemCallback(mitigations=("attention", "attention"))
    with pytest.raises(ValueError, match="`mitigations`"):
        SeqMemCallback(mitigations="attention")


class _Padded(torch.utils.data.Dataset):
    """Dynamic padding: batch i (4 samples) has length lengths[i]."""

    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        tokens = torch.randint(0, 64, (4, self.lengths[i] + 1), generator=g)
        return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


# the padded length grows: over the budget from 96 tokens; the last rung goes on at 192
GROWING = [32, 48, 64, 32, 48, 64, 96, 128, 192]


def test_without_a_curriculum_an_over_budget_batch_switches_the_ladder_on_before_it_runs():
    cb = SeqMemCallback(warmup_steps=1, warmup_steps_after_change=0, memory_budget=BUDGET,
                        safety_margin=0.0)
    torch.manual_seed(0)
    module = LitGPT(**MODEL)
    loader = torch.utils.data.DataLoader(_Padded(GROWING), batch_size=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([cb], max_steps=len(GROWING)).fit(module, loader)
    assert [r.seq_len for r in cb.records] == GROWING  # every batch ran, none cut
    assert max(r.peak_bytes for r in cb.records) <= BUDGET
    assert cb.applied_mitigations and cb.applied_mitigations[0] == "attention"
    oom = [str(w.message) for w in caught if issubclass(w.category, PredictedOOMWarning)]
    assert any("switching on the next mitigation, 'attention'" in m for m in oom)
    # each mitigation was switched on at the start of the batch it protected
    for event in cb.mitigation_events:
        record = next(r for r in cb.records if f"mitigation:{event['name']}" in r.events)
        assert record.seq_len == event["seq_len"] and record.mitigations[-1] == event["name"]


def test_the_readme_attention_protocol_is_enough_for_the_switch():
    import torch.nn.functional as F
    from torch import nn

    from lightning_seqmem.mitigations.attention.attention import (AttentionSwitch,
                                                                  current_attention_backend)

    class MyAttention(nn.Module):
        attention_backend = "eager"

        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(16, 48)

        def set_attention_backend(self, backend: str) -> None:
            self.attention_backend = backend

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            if self.attention_backend == "sdpa":
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
            return ((q @ k.transpose(-1, -2)) / 4).masked_fill(mask, float("-inf")).softmax(-1) @ v

    model = nn.Sequential(MyAttention(), MyAttention())
    x = torch.randn(2, 8, 16)
    before = model(x)
    result = AttentionSwitch("auto").apply(model)
    assert result.applied and current_attention_backend(model) == "sdpa"
    torch.testing.assert_close(model(x), before, atol=1e-5, rtol=1e-5)


def test_a_rung_whose_check_fails_is_skipped_and_the_run_goes_on(monkeypatch):
    original = ladder.is_applicable

    def broken(name, *args, **kwargs):
        if name == "attention":
            raise RuntimeError("injected: odd model")
        return original(name, *args, **kwargs)

    monkeypatch.setattr(ladder, "is_applicable", broken)
    # the first rung goes on at step 4 (128 tokens); the run goes on at 128 in step 5
    cb, module, oom = _run(MITIGATIONS, max_steps=6)
    # the fastest setting that fits goes on first: micro-batching (prior +10%) before checkpointing
    # (+33%); the ladder's old prefix order took checkpointing first
    assert "attention" not in cb.applied_mitigations and cb.applied_mitigations[0] == "microbatch"
    assert any("attention: its check failed (RuntimeError: injected: odd model)" in str(w.message)
               for w in oom)
    assert max(r.peak_bytes for r in cb.records) <= BUDGET
    assert cb.records[-1].step > cb.mitigation_events[0]["step"]  # it trained on after the switch
