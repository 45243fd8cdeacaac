"""A new rung is one folder plus one registry line: ``tests/toy_rungs/no_dropout/`` (the rung, its
spec, its card) and ``ladder.register_folder("toy_rungs.no_dropout")`` plug it into the ladder, the
dry run (one rank and sharded), the callback and ``seqmem plan`` through the Rung protocol alone: no
other file knows its name.

The toy rung sets every ``nn.Dropout`` to ``p = 0``: its masks are no longer saved for backward, a
real, measurable saving (about 10% on the dropout GPT below).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from conftest import make_trainer, plan_config, plan_json
from lightning_seqmem import Curriculum, SeqMemCallback
from lightning_seqmem.core.rungs import check_mitigations, spec
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.dryrun.step import dry_run_step
from lightning_seqmem.mitigations import ladder
from lightning_seqmem.core.rungs import rung_names

MODEL = dict(n_layer=2, d_model=64, n_head=2, vocab_size=64, attention="sdpa")


@pytest.fixture
def no_dropout():
    rung = ladder.register_folder("toy_rungs.no_dropout")  # the one registry line
    yield rung
    ladder.unregister(rung.name)
    assert "no_dropout" not in rung_names()


def _batch(seq_len, rows=4):
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, 64, (rows, seq_len), generator=g),
            "labels": torch.randint(0, 64, (rows, seq_len), generator=g)}


def test_a_new_rung_is_one_folder_plus_one_registry_line(no_dropout):
    folder = Path(__file__).parent / "toy_rungs" / "no_dropout"
    assert sorted(p.name for p in folder.glob("*.py")) == [
        "__init__.py", "no_dropout.py", "no_dropout_spec.py"]
    assert "no_dropout" in rung_names() and ladder.rung("no_dropout") is no_dropout
    assert (spec("no_dropout").step_time_prior == 0.0
            and not no_dropout.is_on(LitGPT(**MODEL, dropout=0.1)))
    with pytest.raises(ValueError,
                       match=r"`path` must name a rung folder .*got 'toy_rungs.missing'"):
        ladder.register_folder("toy_rungs.missing")


def test_a_registered_rung_is_a_name_the_callback_and_the_planner_accept(no_dropout):
    assert check_mitigations(["attention", "no_dropout"]) == ("attention", "no_dropout")
    assert spec("no_dropout").advice == "set dropout to 0"
    SeqMemCallback(mitigations=["no_dropout"])  # validated against the registry
    with pytest.raises(ValueError, match="no_dropout"):
        ladder.unregister("no_dropout")
        check_mitigations(["no_dropout"])


def test_the_dry_run_puts_the_rung_on_its_copy_only(no_dropout):
    module = LitGPT(**MODEL, dropout=0.1)
    with_rung = dry_run_step(module, module.configure_optimizers(), _batch(64), 256,
                             mitigations=["no_dropout"])
    plain = dry_run_step(module, module.configure_optimizers(), _batch(64), 256)
    assert not no_dropout.is_on(module)  # the real module is untouched
    by_hand = LitGPT(**MODEL, dropout=0.0)
    expected = dry_run_step(by_hand, by_hand.configure_optimizers(), _batch(64), 256)
    assert with_rung.peak_bytes == expected.peak_bytes < plain.peak_bytes
    assert "no_dropout: dropout p -> 0" in with_rung.detail


def test_the_sharded_dry_run_puts_the_rung_on_its_copy_too(no_dropout):
    from lightning_seqmem.dryrun.sharded import sharded_dry_run_step

    def dry(dropout, mitigations=()):
        return sharded_dry_run_step(LitGPT(**MODEL, dropout=dropout), _batch(64), 256, world_size=2,
                                    mitigations=mitigations)

    with_rung = dry(0.1, ["no_dropout"])
    assert with_rung.peak_bytes == dry(0.0).peak_bytes < dry(0.1).peak_bytes
    assert "no_dropout: dropout p -> 0" in with_rung.detail


def test_the_callback_switches_the_rung_on_before_the_stage_that_needs_it(no_dropout):
    def dry(dropout):
        module = LitGPT(**MODEL, dropout=dropout)
        return dry_run_step(module, module.configure_optimizers(), _batch(64), 512).peak_bytes

    with_rung, without = dry(0.0), dry(0.1)
    budget = (with_rung + without) // 2  # the last stage fits with the rung only
    cb = SeqMemCallback(warmup_steps=1, memory_budget=budget, safety_margin=0.0,
                        mitigations=["no_dropout"], curriculum=Curriculum(
                            start=128, target=512, steps_per_stage=2, multiple_of=64))
    torch.manual_seed(0)
    module = LitGPT(**MODEL, dropout=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer([cb], max_steps=8).fit(
            module,
            SyntheticTokenDataModule(batch_size=4, seq_len=512, num_samples=32, vocab_size=64))
    assert cb.applied_mitigations == ("no_dropout",) and no_dropout.is_on(module)
    event = cb.mitigation_events[0]
    assert event["name"] == "no_dropout" and event["seq_len"] == 512
    at_target = [r for r in cb.records if r.seq_len == 512]
    assert at_target and all(r.mitigations == ("no_dropout",) for r in at_target)
    assert max(r.peak_bytes for r in cb.records) <= budget  # measured by the tracker, every step
    lengths = [r.seq_len for r in cb.records]
    assert lengths == sorted(lengths)


def test_seqmem_plan_dry_runs_the_registered_rung(no_dropout, tmp_path, capsys):
    config = plan_config(tmp_path, ["no_dropout"], {**MODEL, "dropout": 0.1},
                         {"batch_size": 4, "seq_len": 64, "num_samples": 8, "vocab_size": 64})
    doc = plan_json(config, capsys, [256])
    assert doc["mitigation_sets"] == [[], ["no_dropout"]]
    plain, with_rung = doc["lengths"][0]["rows"]
    assert (with_rung["mitigations"] == ["no_dropout"]
            and with_rung["peak_bytes"] < plain["peak_bytes"])
