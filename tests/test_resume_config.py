"""Resuming under a changed configuration, a state that cannot be trusted, and bounded checkpoints.

One measured run (the CPU tracker, a tiny GPT, no dry run) reaches a capped curriculum with
'attention' and 'microbatch' on and is checkpointed once; every test resumes from that checkpoint.
"""

from __future__ import annotations

import copy
import json
import math
import pickle
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from conftest import make_trainer
from lightning_seqmem import Curriculum, SeqMemCallback, SeqMemFailureWarning
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.mitigations.checkpointing.checkpointing import is_checkpointed
from lightning_seqmem.mitigations.microbatch.microbatch_step import is_micro_batching
from lightning_seqmem.plan.checkpoint import legacy_key_config

# bytes: 'attention' then 'microbatch' go on, and the curriculum is capped at 144 tokens
BUDGET = 1_300_000
LADDER = ("attention", "microbatch")
STEPS = 30  # the cap is reached at step 20: ten steps at one (length, batch size, mitigations)
KEEP_LAST = 4  # records the checkpoint keeps besides the per-key summary
CAP = 144


def _callback(**changes):
    kwargs = dict(warmup_steps=1, memory_budget=BUDGET, safety_margin=0.0, dry_run=False,
                  mitigations=LADDER,
                  curriculum=Curriculum(start=16, target=256, steps_per_stage=2, multiple_of=16))
    kwargs.update(changes)
    return SeqMemCallback(**kwargs)


def _fit(callbacks, max_steps, root, ckpt_path=None, module=None):
    torch.manual_seed(0)
    trainer = make_trainer(callbacks, max_steps=max_steps, default_root_dir=root)
    module = module or LitGPT(n_layer=1, d_model=32, n_head=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, SyntheticTokenDataModule(batch_size=2, seq_len=256, num_samples=64),
                    ckpt_path=ckpt_path)
    return trainer, [str(w.message) for w in caught]


class _StateSizes(Callback):
    """The pickled size of the seqmem state after every batch (what a checkpoint would hold)."""

    def __init__(self, cb):
        self.cb, self.sizes, self.num_records = cb, [], []

    def on_train_batch_end(self, *args):
        self.sizes.append(len(pickle.dumps(self.cb.state_dict())))
        self.num_records.append(len(self.cb.records))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("seqmem-resume")
    cb = _callback()
    cb.planner.bind_run(checkpoint_records=KEEP_LAST)
    sizes = _StateSizes(cb)
    trainer, _ = _fit([cb, sizes], STEPS, root)
    # the scenario holds
    assert cb.applied_mitigations == LADDER and cb.planner.course.capped_at == CAP
    ckpt = root / "capped.ckpt"
    trainer.save_checkpoint(ckpt)
    return SimpleNamespace(cb=cb, ckpt=str(ckpt), sizes=sizes, module=trainer.lightning_module,
                           root=root)


def _saved_state(run):
    return torch.load(run.ckpt, weights_only=False)["callbacks"]["SeqMemCallback"]


def _resumed_lines(messages):
    return [m for m in messages if m.startswith("seqmem: resumed with")]


def test_the_state_key_ignores_budget_ladder_and_curriculum():
    keys = {_callback().state_key, _callback(memory_budget="1GiB").state_key,
            _callback(mitigations=("checkpointing", "attention")).state_key,
            _callback(curriculum=None).state_key}
    assert keys == {"SeqMemCallback"}
    assert _callback(name="encoder").state_key != _callback(name="decoder").state_key
    with pytest.raises(ValueError, match="`name` must be a non-empty string or None, got 3"):
        SeqMemCallback(name=3)
    # two in one Trainer: give them names
    with pytest.raises(RuntimeError, match="state_key` must be unique"):
        make_trainer([_callback(), _callback(memory_budget="1GiB")], max_steps=1)


def test_raising_the_budget_and_the_target_on_resume_lifts_the_cap(run, tmp_path):
    cb = _callback(memory_budget=2 * BUDGET,
                   curriculum=Curriculum(start=16, target=512, steps_per_stage=2, multiple_of=16))
    trainer, messages = _fit([cb], STEPS + 3, tmp_path, ckpt_path=run.ckpt)
    # Lightning found the state
    assert not [m for m in messages if "callbacks used to create the checkpoint" in m]
    print("DBG", [m[:200] for m in messages if "seqmem" in m])
    (line,) = _resumed_lines(messages)
    assert "memory_budget 1.2 MiB -> 2.5 MiB" in line and "curriculum target 256 -> 512" in line
    assert f"the cap at seq_len={CAP} is lifted (the budget was raised)" in line
    restored = [r.to_dict() for r in cb.records if r.step < STEPS]
    assert restored == _saved_state(run)["records"]  # the records came back
    module = trainer.lightning_module  # the rungs on at the checkpoint are on again
    assert module.attention_backend == "sdpa" and is_micro_batching(module)
    # 512 may be capped again, above 256
    assert cb.planner.course.stages[:6] == (16, 32, 64, 128, CAP, 256)
    after = [r for r in cb.records if r.step >= STEPS]
    # grows at once, within the new budget
    assert after[0].seq_len == 256 and after[0].mitigations == LADDER
    assert max(r.peak_bytes for r in after) <= 2 * BUDGET


def test_a_changed_curriculum_keeps_the_length_reached(run):
    cb = _callback(curriculum=Curriculum(start=32, target=512, steps_per_stage=3, multiple_of=32))
    cb.load_state_dict(_saved_state(run))
    # the cap still binds (same budget): kept, as the stage it was
    assert (cb.planner.course.stages == (32, 64, 128, CAP) and cb.planner.course.stage == 3
            and cb.planner.course.capped_at == CAP)
    assert cb.planner.course.stage_steps == run.cb.planner.course.stage_steps
    assert cb.edge.resume_phrases == ["curriculum start 16 -> 32, target 256 -> 512, "
                                      "steps_per_stage 2 -> 3, multiple_of "
                                  f"16 -> 32: resumes at seq_len={CAP} (stage 4 of 4)"]


def test_a_reordered_ladder_keeps_rungs_on_and_takes_removed_ones_off(run, tmp_path):
    cb = _callback(mitigations=("checkpointing", "attention"))
    trainer, messages = _fit([cb], STEPS + 2, tmp_path, ckpt_path=run.ckpt)
    (line,) = _resumed_lines(messages)
    assert ("mitigations ['attention', 'microbatch'] -> ['checkpointing', 'attention']" in line
            and "rung 'microbatch' no longer allowed: off." in line
            and line.count("microbatch' no longer") == 1), line
    assert f"the cap at seq_len={CAP} is lifted ('checkpointing' may now be switched on)" in line
    module = trainer.lightning_module
    assert module.attention_backend == "sdpa" and not is_micro_batching(module)
    after = [r for r in cb.records if r.step >= STEPS]
    assert (after and all("microbatch" not in r.mitigations
                          and r.mitigations[0] == "attention" for r in after))
    # checkpointing, new to the ladder, may go on
    assert set(cb.planner.ladder.allowed) == {"checkpointing", "attention"}


def test_a_rung_removed_from_a_reused_module_or_said_to_stay(run, tmp_path):
    module = copy.deepcopy(run.module)  # the trained module, rungs still on
    assert module.attention_backend == "sdpa" and is_micro_batching(module)
    cb = _callback(mitigations=("checkpointing",))
    _, messages = _fit([cb], STEPS + 1, tmp_path, ckpt_path=run.ckpt, module=module)
    (line,) = _resumed_lines(messages)
    assert "rung 'microbatch' no longer allowed: taken off this module" in line
    assert ("rung 'attention' no longer allowed: it stays on this module "
            "(it cannot be undone" in line)
    assert not is_micro_batching(module)
    after = [r for r in cb.records if r.step >= STEPS]
    assert (after and all(r.mitigations in ((), ("checkpointing",))
                          for r in after)), [r.mitigations for r in after]


def _set(path, value):
    def change(state):
        target = state
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return change


@pytest.mark.parametrize("change, named", [
    (_set(["applied_mitigations"], "attention"),
     "`applied_mitigations` is 'attention', expected a list of distinct rung names"),
    (_set(["step"], -3), "`step` is -3, expected an int >= 0"),
    (_set(["records", -1, "peak_bytes"], math.nan),
     r"`records\[\d+\].peak_bytes` is nan, expected an int >= 0"),
    (_set(["forecasters", "attention", "points", 0, 2], {"fwd": 1}),
     r"`forecasters\['attention'\].points\[0\] peaks key` is 'fwd'"),
    (_set(["mitigation_events", 0, "name"], "flash"), r"`mitigation_events\[0\].name` is 'flash'"),
    (_set(["stage"], 9), r"`stage` is 9, expected an index into the 5 stages"),
    (_set(["last_verification_error"], math.inf),
     "`last_verification_error` is inf, expected None or a finite number"),
    (_set(["config", "mitigations"], ["flash"]), r"`config.mitigations` is \['flash'\]"),
])
def test_a_bad_field_is_rejected_by_name_and_the_callback_starts_fresh(run, change, named):
    state = _saved_state(run)
    change(state)
    cb = _callback()
    with pytest.warns(SeqMemFailureWarning, match="could not restore the callback state") as caught:
        cb.load_state_dict(state)
    assert len(caught) == 1
    assert re.search(named, str(caught[0].message)), str(caught[0].message)
    assert (cb.records == [] and cb.planner.course.step == 0 and cb.applied_mitigations == ()
            and cb.planner.course.capped_at is None)
    assert (cb.planner.course.stages == cb.config.curriculum.stages and cb.mitigations == LADDER
            and not cb.edge.reapply_on_fit_start)


def test_a_rejected_state_in_a_checkpoint_leaves_training_going(run, tmp_path):
    ckpt = torch.load(run.ckpt, weights_only=False)
    ckpt["callbacks"]["SeqMemCallback"]["records"][0]["seq_len"] = 0
    torch.save(ckpt, tmp_path / "bad.ckpt")
    cb = _callback()
    trainer, messages = _fit([cb], STEPS + 2, tmp_path, ckpt_path=str(tmp_path / "bad.ckpt"))
    (line,) = [m for m in messages if "could not restore" in m]
    assert "`records[0].seq_len` is 0, expected an int >= 1" in line
    # measured afresh
    assert trainer.global_step == STEPS + 2 and [r.step for r in cb.records] == [0, 1]
    # nothing re-applied from the rejected state
    assert trainer.lightning_module.attention_backend == "eager"


def test_the_checkpoint_is_bounded_and_forecasts_come_back_the_same(run):
    sizes, counts = run.sizes.sizes, run.sizes.num_records
    at_cap = [i for i, r in enumerate(run.cb.records) if r.seq_len == CAP
              and r.mitigations == LADDER]
    # from here the last records kept are past the cap's summary records
    first = at_cap[0] + KEEP_LAST + 1
    # in memory: every record
    assert counts[-1] - counts[first] >= 4 and len(run.cb.records) == counts[-1]
    # more steps, the same checkpoint
    assert max(sizes[first:]) - min(sizes[first:]) <= 16, sizes[first:]
    state = _saved_state(run)
    keys = {(r.seq_len, r.batch_size, tuple(r.mitigations)) for r in run.cb.records}
    assert (len(state["records"]) < len(run.cb.records)
            and len(state["records"]) <= KEEP_LAST + 4 * len(keys))

    restored = _callback()
    restored.load_state_dict(state)
    before, after = run.cb.planner, restored.planner
    for setting in before.evidence.measured.forecasters:
        for seq_len in (48, CAP, 256, 1024):
            a, b = before.evidence.forecast(seq_len, 2,
                                            setting), after.evidence.forecast(seq_len, 2, setting)
            assert (b.method, b.phase_peak_bytes.keys()) == (a.method, a.phase_peak_bytes.keys())
            assert b.peak_bytes == pytest.approx(a.peak_bytes, rel=1e-9)
            assert b.upper_bytes == pytest.approx(a.upper_bytes, rel=1e-9)
    assert after.evidence.max_seq_len(BUDGET, 2) == before.evidence.max_seq_len(BUDGET, 2)
    # judged the same, measured or not
    for seq_len, batch_size, _ in keys | {(CAP + 16, 2, ()), (256, 2, ())}:
        assert (after.evidence.judge(seq_len, batch_size)
                == before.evidence.judge(seq_len, batch_size))
    no_rung = {"checkpointing": (False, "not here")}
    assert after.decide((2, 256), no_rung) == before.decide((2, 256), no_rung)


def test_a_checkpoint_of_an_earlier_version_resumes(run, tmp_path):
    """``data_old_state.json``: a state written before the planner, under the key of that time
    (the configuration in it); the callback finds it in a real checkpoint and resumes from it."""
    data = json.loads((Path(__file__).parent / "data_old_state.json").read_text())
    assert legacy_key_config(data["state_key"])["memory_budget_bytes"] == 1_500_000
    ckpt = torch.load(run.ckpt, weights_only=False)
    ckpt["callbacks"] = {data["state_key"]: data["state"]}
    torch.save(ckpt, tmp_path / "old.ckpt")
    cb = _callback(memory_budget=1_500_000,
                   mitigations=("attention", "checkpointing", "microbatch"))
    trainer, messages = _fit([cb], STEPS + 1, tmp_path, ckpt_path=str(tmp_path / "old.ckpt"))
    # same configuration
    assert not [m for m in messages if "could not restore" in m] and not _resumed_lines(messages)
    old = data["state"]["records"]
    assert [r.to_dict() for r in cb.records[: len(old)]] == [{**r, "rank": None} for r in old]
    module = trainer.lightning_module
    assert module.attention_backend == "sdpa" and is_checkpointed(module)


def test_a_long_run_keeps_its_records_bounded_in_memory(tmp_path):
    cb = _callback(memory_budget=10 * BUDGET,
                   curriculum=Curriculum(start=16, target=32, steps_per_stage=3, multiple_of=16))
    cb.planner.bind_run(memory_records=6)  # MEMORY_RECORDS (100 000) in a real run
    sizes = _StateSizes(cb)
    _fit([cb, sizes], 12, tmp_path)
    assert max(sizes.num_records) <= 7 and len(cb.records) < 12
    # the last ones, every length
    assert cb.records[-1].step == 11 and {r.seq_len for r in cb.records} == {16, 32}
    # the records the decisions read are kept
    assert cb.planner.evidence.judge(32, 2).method == "measured"
    _fit([cb], 3, tmp_path)  # the same instance in a new fit starts fresh
    assert [r.step for r in cb.records] == [0, 1, 2] and cb.planner.course.stage == 0


@pytest.mark.parametrize("rung", ["tiled_mlp", "fused_loss"])
def test_an_opt_in_rung_added_on_resume_lifts_the_cap_and_is_taken_within_the_budget(
        run, tmp_path, rung):
    """A ladder that gains an opt-in rung on resume: the cap is lifted for it, the rungs on at the
    checkpoint are on again, the new one goes on only when a length needs it, and every measured
    step (the tracker) stays within the same budget."""
    cb = _callback(mitigations=(*LADDER, rung))
    trainer, messages = _fit([cb], STEPS + 12, tmp_path, ckpt_path=run.ckpt)
    (line,) = _resumed_lines(messages)
    assert ("mitigations ['attention', 'microbatch'] -> "
            f"['attention', 'microbatch', '{rung}']" in line), line
    assert f"the cap at seq_len={CAP} is lifted ('{rung}' may now be switched on)" in line, line
    module = trainer.lightning_module
    assert module.attention_backend == "sdpa" and is_micro_batching(module)
    after = [r for r in cb.records if r.step >= STEPS]
    assert after and max(r.peak_bytes for r in after) <= BUDGET, [
        (r.seq_len, r.peak_bytes) for r in after]
    assert all(r.mitigations[:2] == LADDER for r in after)
    # tried for the stage the cap held back
    (event,) = [e for e in cb.mitigation_events if e["name"] == rung]
    assert event["seq_len"] >= CAP and event["step"] >= STEPS
    assert all(rung in r.mitigations for r in after if r.step >= event["step"])
    # nothing past the old cap without it
    assert all(r.step >= event["step"] for r in after if r.seq_len > CAP)
    # measured: its tiles free enough here to grow past the old cap (176 tokens)
    if rung == "tiled_mlp":
        assert max(r.seq_len for r in after) > CAP and cb.planner.course.capped_at > CAP
    else:  # the fused loss saves nothing on this 256-token vocabulary: capped again where it was
        assert max(r.seq_len for r in after) == CAP and cb.planner.course.capped_at == CAP
