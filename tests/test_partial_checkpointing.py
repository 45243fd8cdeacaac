"""The levels of the checkpointing rung (selective, k of N blocks, all) on the reference GPT and a
random-config Hugging Face Llama: switched on mid-run with equal loss and gradients, peaks measured
by the live-tensor tracker that fall with the level, dry runs of a variant within 1% of the measured
step, upgrades in place, and the callback's full rung as before.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from conftest import make_trainer
from limits import limit_s
from lightning_seqmem import Curriculum, SeqMemCallback
from lightning_seqmem.core.rungs import check_mitigations, spec
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.dryrun.step import dry_run_step
from lightning_seqmem.measure.probes import make_probe
from lightning_seqmem.measure.steps import training_step_memory
from lightning_seqmem.mitigations import ladder
from lightning_seqmem.mitigations.base import RungContext
from lightning_seqmem.mitigations.checkpointing.checkpointing import CheckpointingRung
from lightning_seqmem.mitigations.checkpointing.checkpointing_levels import FULL, NONE, SELECTIVE

pytestmark = pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")

VOCAB = 64
CPU = torch.device("cpu")
LEVELS = ("selective", "1/4", "2/4", "3/4", None)  # None: the full rung, every block


class LitLlama(pl.LightningModule):
    """A random-config Hugging Face Llama (4 layers, no download) as a LightningModule."""

    def __init__(self, n_layer: int = 4) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=n_layer, num_attention_heads=4,
                                          num_key_value_heads=4)
        self.model = transformers.LlamaForCausalLM(config).train()
        self.model.config._attn_implementation = "sdpa"

    def training_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch["input_ids"], use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _gpt(n_layer: int = 4) -> LitGPT:
    torch.manual_seed(0)
    return LitGPT(vocab_size=VOCAB, n_layer=n_layer, d_model=64, n_head=4, attention="sdpa")


MODELS = {"gpt": _gpt, "llama": LitLlama}


def _batch(seq_len: int, rows: int = 2, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, VOCAB, (rows, seq_len), generator=g),
            "labels": torch.randint(0, VOCAB, (rows, seq_len), generator=g)}


def _loss(module, batch):
    return module.training_step(batch, 0)


def _apply(module, level):
    rung = ladder.rung("checkpointing" if level is None else f"checkpointing:{level}")
    result = rung.apply(RungContext(module))
    assert result.applied and rung.is_on(module), result
    return result


def _measured(module, batch, optimizer_class=torch.optim.AdamW):
    """Peak of a real step counted by the live-tensor tracker, gradients and optimizer state alive
    as after a first step (a zero gradient each and one optimizer step: a warm-up step's state for
    half its cost, as the dry run does)."""
    optimizer = optimizer_class(module.parameters(), lr=1e-3)
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return training_step_memory(module, optimizer, batch, _loss, make_probe("tracker", CPU))


def _grads(module, batch):
    module.zero_grad(set_to_none=True)
    loss = _loss(module, batch)
    loss.backward()
    keys = {id(t): k for k, t in module.state_dict(keep_vars=True).items()}
    return loss.detach(), {keys[id(p)]: p.grad.clone() for p in module.parameters()}


def test_variants_names_levels_and_priors():
    rung = ladder.rung("checkpointing")
    assert rung.variants(RungContext(_gpt(8))) == (
        "checkpointing:selective", *(f"checkpointing:{k}/8" for k in range(1, 8)), "checkpointing")
    assert rung.variants(RungContext(_gpt(4))) == (
        "checkpointing:selective", "checkpointing:1/4", "checkpointing:2/4", "checkpointing:3/4",
        "checkpointing")
    three = ladder.rung("checkpointing:3/8")
    assert three.name == three.spec.name == "checkpointing:3/8"
    assert three.spec.step_time_prior == pytest.approx(spec("checkpointing").step_time_prior * 3
                                                       / 8)
    assert 0 < ladder.rung("checkpointing:selective").spec.step_time_prior < spec(
        "checkpointing").step_time_prior
    for bad in ("0/8", "9/8", "half", "3/"):
        with pytest.raises(ValueError, match=f"'selective' or 'k/N'.*got '{bad}'"):
            ladder.rung(f"checkpointing:{bad}")
    table = ladder.applicability(["checkpointing"], None, _gpt(4))
    assert (set(table) == set(rung.variants(RungContext(_gpt(4))))
            and all(ok for ok, _ in table.values()))
    assert ladder.is_applicable("checkpointing:3/8", None, _gpt(4)) == (
        False, "level '3/8' is for a model of 8 blocks; this one has 4 (4 x Block): use 'k/4'")
    assert check_mitigations(["checkpointing:3/8"], variants=True) == ("checkpointing:3/8",)
    with pytest.raises(ValueError, match="mitigations"):
        # the callback takes rung names only: the planner picks levels
        check_mitigations(["checkpointing:3/8"])


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_switched_on_mid_run_same_loss_grads_params_state_and_keys(kind):
    plain = MODELS[kind]()
    batch, later = _batch(32, seed=1), _batch(32, seed=2)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    _loss(plain, batch).backward()
    optimizer.step()  # one real step: the optimizer has state when the level is switched on
    plain_loss, plain_grads = _grads(plain, later)
    for level in ("selective", "2/4", None):  # the others are the same code with another k
        module = copy.deepcopy(plain)
        params, keys = list(module.parameters()), list(module.state_dict())
        _apply(module, level)
        assert all(a is b for a, b in zip(params, module.parameters(), strict=True))
        assert list(module.state_dict()) == keys
        loss, grads = _grads(module, later)
        torch.testing.assert_close(loss, plain_loss, atol=1e-6, rtol=1e-6)
        assert grads.keys() == plain_grads.keys()
        for key in grads:
            torch.testing.assert_close(grads[key], plain_grads[key], atol=1e-6, rtol=1e-5,
                                       msg=f"{level} {key}")
    # the same optimizer keeps stepping the same parameters after a switch
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    _apply(plain, "2/4")
    assert {id(p) for p in optimizer.state} == set(before) == {id(p) for p in plain.parameters()}
    _loss(plain, later).backward()
    optimizer.step()
    assert all(int(s["step"]) == int(before[id(p)]["step"]) + 1 for p, s in optimizer.state.items())


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_measured_peak_falls_with_the_level(kind):
    batch = _batch(256, rows=1)
    peaks = {}
    for level in ("none", *LEVELS):
        module = MODELS[kind]()
        if level != "none":
            _apply(module, level)
        # no optimizer state: cheaper
        peaks[level] = _measured(module, batch, torch.optim.SGD).peak_bytes
    order = [peaks[k] for k in ("none", "1/4", "2/4", "3/4", None)]
    assert order == sorted(order, reverse=True) and len(set(order)) == len(order), peaks
    assert peaks[None] < peaks["selective"] < peaks["none"], peaks


@pytest.mark.parametrize("kind,level", [("gpt", "2/4"), ("gpt", "selective"), ("llama", "3/4"),
                                        ("llama", "selective")])
def test_dry_run_of_a_variant_within_one_percent_of_the_measured_step(kind, level):
    name = f"checkpointing:{level}"
    module = MODELS[kind]()
    real = copy.deepcopy(module)
    _apply(real, level)
    measured = _measured(real, _batch(128))
    dry = dry_run_step(module, module.configure_optimizers(), _batch(16), 128, mitigations=(name,))
    assert (dry.mitigations == (name,)
            and not CheckpointingRung().policy.block_levels(module).count(FULL))
    assert abs(dry.peak_bytes - measured.peak_bytes) <= 0.01 * measured.peak_bytes, (
        dry.detail, measured.peak_bytes)
    # the copy also comes from the ladder directly, as the planner's dry runs put it on
    fake = copy.deepcopy(module)
    plan = ladder.apply_to_copy([name], fake)
    assert ladder.is_on(name, fake) and plan.notes[0].startswith(name + ": ")


def test_dry_run_of_the_upgrade_of_a_module_already_partly_checkpointed():
    module = _gpt()
    _apply(module, "1/4")
    real = copy.deepcopy(module)
    _apply(real, None)  # 1/4 -> all four blocks
    measured = _measured(real, _batch(128))
    dry = dry_run_step(module, module.configure_optimizers(), _batch(16), 128,
                       mitigations=("checkpointing",))
    assert abs(dry.peak_bytes - measured.peak_bytes) <= 0.01 * measured.peak_bytes
    # the module untouched
    assert CheckpointingRung().policy.block_levels(module) == [FULL, NONE, NONE, NONE]


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_upgrades_in_place(kind):
    module = MODELS[kind]()
    rung = CheckpointingRung()
    plain = copy.deepcopy(module)
    params, keys = list(module.parameters()), list(module.state_dict())
    half = _apply(module, "2/4")
    assert (half.before, half.after) == ("off", "2/4")
    assert rung.policy.block_levels(module) == [FULL, FULL, NONE, NONE]
    assert not rung.at("1/4").is_applicable(RungContext(module))[0] and rung.at("1/4").is_on(module)
    assert not rung.is_on(module) and rung.is_applicable(RungContext(module))[0]
    full = _apply(module, None)
    assert ((full.before, full.after) == ("2/4", "on")
            and rung.policy.block_levels(module) == [FULL] * 4)
    assert rung.is_applicable(RungContext(module)) == (False, "already checkpointed")
    assert rung.at("3/4").is_on(module) and rung.at("selective").is_on(module)
    # selective, then 2/4 on top (two blocks raised to full, the rest stay selective), then all
    other = MODELS[kind]()
    _apply(other, "selective")
    assert rung.policy.block_levels(other) == [SELECTIVE] * 4 and not rung.at("1/4").is_on(other)
    assert _apply(other, "2/4").after == "2/4+selective"
    assert rung.policy.block_levels(other) == [FULL, FULL, SELECTIVE, SELECTIVE]
    _apply(other, None)
    assert rung.policy.block_levels(other) == [FULL] * 4
    for upgraded in (module, other):
        assert all(a is b for a, b in zip(params if upgraded is module else other.parameters(),
                                          upgraded.parameters()))
        assert list(upgraded.state_dict()) == keys
        loss, grads = _grads(upgraded, _batch(32))
        plain_loss, plain_grads = _grads(plain, _batch(32))
        torch.testing.assert_close(loss, plain_loss, atol=1e-6, rtol=1e-6)
        for key in grads:
            torch.testing.assert_close(grads[key], plain_grads[key], atol=1e-6, rtol=1e-5, msg=key)


def test_the_callback_takes_the_fewest_blocks_that_fit():
    """With ``mitigations=["checkpointing"]`` and a budget the full rung meets with room to spare,
    the callback switches on the cheapest level (by its step-time prior) that the dry run says fits,
    not every block: the choice agrees with dry runs of every level, and no measured step is
    over."""
    module = _gpt(4)
    variants = ladder.rung("checkpointing").variants(RungContext(module))

    def dry(names):
        m = _gpt(4)
        return dry_run_step(m, m.configure_optimizers(), _batch(16), 256,
                            mitigations=names).peak_bytes

    with_rung, without = dry(("checkpointing",)), dry(())
    budget = (with_rung + without) // 2
    fitting = [v for v in variants if dry((v,)) <= budget]
    cheapest = min(fitting, key=lambda v: spec(v).step_time_prior)
    cb = SeqMemCallback(warmup_steps=1, memory_budget=budget, safety_margin=0.0,
                        mitigations=["checkpointing"], curriculum=Curriculum(
                            start=128, target=256, steps_per_stage=2, multiple_of=64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer([cb], max_steps=4).fit(
            module,
            SyntheticTokenDataModule(batch_size=2, seq_len=256, num_samples=16, vocab_size=VOCAB))
    # fewer blocks than all
    assert cb.applied_mitigations == (cheapest,) and cheapest != "checkpointing"
    assert ladder.is_on(cheapest, module) and not ladder.is_on("checkpointing", module)
    assert max(r.peak_bytes for r in cb.records) <= budget
    lengths = [r.seq_len for r in cb.records]
    assert lengths == sorted(lengths) and lengths[-1] == 256


@pytest.mark.ddp
def test_ddp_two_ranks_take_the_same_variant_with_different_lengths(tmp_path):
    """2 gloo ranks (lengths 32 and 48) switch the variant on inside DDP between steps: the same
    decision and levels on both, gradients (all-reduced) equal to a plain DDP twin's, parameters
    equal across ranks after the step."""
    variant = "checkpointing:2/4"
    script = Path(__file__).parent / "scripts" / "ckpt_ddp_run.py"
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), variant, "--seq-lens",
                           "32,48"],
                          capture_output=True, text=True, timeout=limit_s(60))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for key in ("variants", "applied", "levels"):
        assert rank0[key] == rank1[key], key
    assert rank0["applied"][0] and variant in rank0["variants"]
    assert rank0["levels"] == [FULL, FULL, NONE, NONE]
    for rank in (rank0, rank1):
        assert rank["grads"]["variant"] == pytest.approx(rank["grads"]["plain"], rel=1e-5, abs=1e-8)
    assert rank0["param_sums"] == rank1["param_sums"]


def test_fsdp2_partial_level_composes_with_fully_shard_and_its_sharded_dry_run_is_exact():
    """Under FSDP2 (a fake 2-rank process group) ``k/N`` goes on with the composable checkpoint,
    names and keys unchanged, and upgrades to every block; selective is not offered there. The
    sharded dry run of ``"checkpointing:1/2"`` equals the same sharded step on real tensors."""
    from torch.distributed.fsdp import fully_shard

    from lightning_seqmem.dryrun.sharded import _shard, fake_world, sharded_dry_run_step

    rung = CheckpointingRung()
    lit = _gpt(4)
    with fake_world(2) as mesh:
        for block in lit.model.blocks:
            fully_shard(block, mesh=mesh["data_parallel"])
        fully_shard(lit, mesh=mesh["data_parallel"])
        names, keys = [n for n, _ in lit.named_parameters()], list(lit.state_dict())
        assert "checkpointing:selective" not in rung.variants(RungContext(lit))
        assert not rung.at("selective").is_applicable(RungContext(lit))[0]
        assert ("composable" in _apply(lit, "2/4").detail
                and rung.policy.block_levels(lit) == [FULL, FULL, NONE, NONE])
        _apply(lit, None)
        assert rung.policy.block_levels(lit) == [FULL] * 4
        assert [n for n, _ in lit.named_parameters()] == names and list(lit.state_dict()) == keys

    batch = _batch(128)
    dry = sharded_dry_run_step(_gpt(2), batch, 128, 2, mitigations=("checkpointing:1/2",))
    with fake_world(2) as mesh:
        lit = _gpt(2)
        lit.__dict__["_device_mesh"] = mesh
        _shard(lit, mesh, [])
        _apply(lit, "1/2")
        optimizer = lit.configure_optimizers()
        for i in range(3):
            probe = make_probe("tracker", CPU) if i == 2 else None
            real = training_step_memory(lit, optimizer, batch, _loss, probe)
    assert dry.peak_bytes == real.peak_bytes
