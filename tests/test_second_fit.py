"""A second ``trainer.fit()`` with the same callback: on the same Trainer and module it continues
the first fit's state (rungs on, records, fits, curriculum position); on a new Trainer it starts
afresh, says so in one line, and still reports the rungs that are on the module as on.

Real runs of a tiny eager GPT on the CPU tracker, whose first fit switches 'attention' and
'checkpointing' on before the 128-token stage (the dry run says it then fits).
"""

from __future__ import annotations

import warnings

import torch

from conftest import make_trainer
from lightning_seqmem import Curriculum, SeqMemCallback
from lightning_seqmem.core.rungs import base_name
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.mitigations.checkpointing.checkpointing import is_checkpointed

# bytes: the eager 128-token step (3.7 MB) is over, with SDPA and checkpointing it fits
BUDGET = 3_000_000
RUNGS = ("attention", "checkpointing")


def _callback():
    return SeqMemCallback(warmup_steps=1, memory_budget=BUDGET, safety_margin=0.0,
                          mitigations=RUNGS, curriculum=Curriculum(
                              start=32, target=256, steps_per_stage=2, multiple_of=16))


def _fit(trainer, module, dm):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, dm)
    return [str(w.message) for w in caught if str(w.message).startswith("seqmem:")]


def _first_fit():
    torch.manual_seed(0)
    cb, module = _callback(), LitGPT(n_layer=1, d_model=32, n_head=2)
    dm = SyntheticTokenDataModule(batch_size=4, seq_len=256, num_samples=64)
    trainer = make_trainer([cb], max_steps=6)
    _fit(trainer, module, dm)
    # the rungs, checkpointing at the level the price-based choice took (plan.choose: the cheapest
    # that fits)
    assert tuple(map(base_name, cb.applied_mitigations)) == RUNGS
    assert module.attention_backend == "sdpa" and is_checkpointed(module)
    return cb, module, dm, trainer


def test_a_second_fit_on_the_same_trainer_continues_with_the_rungs_and_records():
    cb, module, dm, trainer = _first_fit()
    first = [r.to_dict() for r in cb.records]
    stage_len, events = cb.planner.course.seq_len, [dict(e) for e in cb.mitigation_events]
    trainer.fit_loop.epoch_loop.max_steps = 10  # four more steps
    messages = _fit(trainer, module, dm)
    assert not [m for m in messages if "afresh" in m]
    # the first fit's records are kept
    assert [r.to_dict() for r in cb.records[: len(first)]] == first
    after = cb.records[len(first):]
    assert [r.step for r in after] == [6, 7, 8, 9]
    # the same rungs, checkpointing raised where a longer stage needs it (an upgrade, never a rung
    # off)
    assert all(tuple(map(base_name, r.mitigations)) == RUNGS for r in after)
    assert after[-1].mitigations == cb.applied_mitigations
    # what is reported is what is on
    assert module.attention_backend == "sdpa" and is_checkpointed(module)
    assert min(r.seq_len for r in after) >= stage_len  # the curriculum did not go back to its start
    assert cb.mitigation_events[: len(events)] == events
    assert max(r.peak_bytes for r in cb.records) <= BUDGET


def test_a_new_trainer_starts_afresh_says_so_and_reports_the_rungs_still_on():
    cb, module, dm, _ = _first_fit()
    on = cb.applied_mitigations
    messages = _fit(make_trainer([cb], max_steps=2), module, dm)
    (line,) = [m for m in messages if "afresh" in m]
    assert "a new Trainer" in line and f"still on this module: {', '.join(on)}" in line
    # records and curriculum restart
    assert [r.step for r in cb.records] == [0, 1] and cb.records[0].seq_len == 32
    assert cb.applied_mitigations == on  # never reported as off while they are on
    assert all(r.mitigations == on for r in cb.records)
