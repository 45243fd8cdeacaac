"""The "tiled_mlp" rung (DeepSpeed's TiledMLP on every block's MLP) on real models, measured.

Every memory figure is a real step measured by the live-tensor tracker (a warm-up step, then the
measured one) or a dry run of the same step; the expected savings are computed from the shapes.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import make_trainer, measured_step, plan_config, plan_json
from limits import limit_s
from lightning_seqmem import Curriculum, SeqMemCallback
from lightning_seqmem.core.rungs import EXTRA_RUNGS, MITIGATIONS, check_mitigations
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.dryrun.step import dry_run_step
from lightning_seqmem.mitigations import ladder
from lightning_seqmem.mitigations.tiled_mlp.tiled_mlp import (
    TiledMLP, find_mlps, tile_count_rule, tiled_mlp_tiles)
from lightning_seqmem.core.rungs import rung_names

pytestmark = pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")

VOCAB = 64
TOLERANCE = 0.01  # of the measured step peak


def _batch(rows: int, seq_len: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, VOCAB, (rows, seq_len), generator=g),
            "labels": torch.randint(0, VOCAB, (rows, seq_len), generator=g)}


def _loss(model, batch):
    out = model.training_step(batch, 0)
    return out["loss"] if isinstance(out, dict) else out


def _gpt(**kwargs) -> LitGPT:
    torch.manual_seed(0)
    return LitGPT(**{"n_layer": 2, "d_model": 64, "n_head": 2, "vocab_size": VOCAB,
                     "attention": "sdpa", **kwargs})


class _HFLlama(nn.Module):
    """A random-config Hugging Face Llama (no download) trained on next-token cross entropy."""

    def __init__(self, intermediate_size: int = 256) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=4,
                                          intermediate_size=intermediate_size, vocab_size=VOCAB)
        self.model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="sdpa")

    def training_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch["input_ids"], use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())


MODELS = {"gpt": lambda: _gpt(dropout=0.1), "llama": _HFLlama}


def _measured(module: nn.Module, batch: dict):
    return measured_step(module, torch.optim.AdamW(module.parameters(), lr=1e-3), batch, _loss)


@pytest.mark.parametrize("kind", MODELS)
def test_switched_on_mid_run_the_loss_and_gradients_are_unchanged(kind):
    """Two copies train a step; the rung goes on one of them between steps; the next step's loss
    and gradients agree, with the same parameters, optimizer state and state_dict keys."""
    plain = MODELS[kind]()
    plain.train()
    tiled = copy.deepcopy(plain)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, tiled)]

    def step(model, optimizer, seed):
        torch.manual_seed(seed)  # the same dropout masks in both copies (the GPT has dropout 0.1)
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(model, _batch(2, 96, seed))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        return loss.detach(), grads

    for model, optimizer in zip((plain, tiled), optimizers):
        step(model, optimizer, 1)
    params_before = [id(p) for p in tiled.parameters()]
    keys_before = list(tiled.state_dict())
    state_before = {k: v.clone() for k, v in optimizers[1].state[next(tiled.parameters())].items()}
    result = ladder.apply("tiled_mlp", None, tiled)
    assert result.applied and ladder.is_on("tiled_mlp", tiled), result
    # intermediate 256 / hidden 64: the rule, the same on every rank
    assert tiled_mlp_tiles(tiled) == 4
    assert ([id(p) for p in tiled.parameters()] == params_before
            and list(tiled.state_dict()) == keys_before)
    state_after = optimizers[1].state[next(tiled.parameters())]
    assert all(torch.equal(state_after[k], v) for k, v in state_before.items())

    (loss_a, grads_a), (loss_b, grads_b) = (step(m, o, 2) for m,
                                            o in zip((plain, tiled), optimizers))
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-6, msg=name)
    assert ladder.remove("tiled_mlp", None, tiled).applied and not ladder.is_on("tiled_mlp", tiled)
    assert all("forward" not in m.__dict__ for m in find_mlps(tiled))  # the class's forward again


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_the_measured_peak_falls_by_the_saved_intermediates_and_the_dry_run_forecasts_it(kind):
    """A wide MLP at a long length holds the peak: tiled, the step's measured peak falls by at least
    the MLP intermediates every block but the last would keep; the dry run matches within 1%."""
    seq_len, rows, d_ff = 256, 2, 512
    module = _gpt(d_ff=d_ff) if kind == "gpt" else _HFLlama(intermediate_size=d_ff)
    plain = _measured(copy.deepcopy(module), _batch(rows, seq_len))
    tiled_module = copy.deepcopy(module)
    assert TiledMLP().apply(tiled_module).applied
    tiled = _measured(tiled_module, _batch(rows, seq_len))
    # GELU in/out; gate, up, silu, product
    saved_per_block = (2 if kind == "gpt" else 4) * rows * seq_len * d_ff * 4
    assert plain.peak_bytes - tiled.peak_bytes >= (2 - 1) * saved_per_block, (
        plain.phase_peak_bytes, tiled.phase_peak_bytes)

    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    dry = dry_run_step(module, optimizer, _batch(rows, 16), seq_len, mitigations=["tiled_mlp"])
    assert not ladder.is_on("tiled_mlp", module)  # the rung went on the fake copy only
    assert "tiled_mlp: tile" in dry.detail and "into 8 sequence tiles" in dry.detail
    assert abs(dry.peak_bytes - tiled.peak_bytes) <= TOLERANCE * tiled.peak_bytes, (
        dry.phase_peak_bytes, tiled.phase_peak_bytes)
    for phase, peak in tiled.phase_peak_bytes.items():
        assert abs(dry.phase_peak_bytes[phase] - peak) <= TOLERANCE * tiled.peak_bytes, phase


def test_the_callback_switches_it_on_under_a_budget_only_it_meets():
    model, rows, target = dict(d_ff=512), 2, 256

    def dry(mitigations):
        module = _gpt(**model)
        return dry_run_step(module, module.configure_optimizers(), _batch(rows, 64), target,
                            mitigations=mitigations).peak_bytes

    with_rung, without = dry(["tiled_mlp"]), dry([])
    budget = (with_rung + without) // 2  # the target length fits with the rung only
    cb = SeqMemCallback(warmup_steps=1, memory_budget=budget, safety_margin=0.0,
                        mitigations=["attention", "tiled_mlp"], curriculum=Curriculum(
                            start=128, target=target, steps_per_stage=2, multiple_of=64))
    module = _gpt(**model)  # already on SDPA: the attention rung does not apply
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer([cb], max_steps=5).fit(
            module, SyntheticTokenDataModule(batch_size=rows, seq_len=target, num_samples=5 * rows,
                                             vocab_size=VOCAB))
    assert cb.applied_mitigations == ("tiled_mlp",) and ladder.is_on("tiled_mlp", module)
    assert (cb.mitigation_events[0]["name"] == "tiled_mlp"
            and cb.mitigation_events[0]["seq_len"] == target)
    at_target = [r for r in cb.records if r.seq_len == target]
    assert at_target and all(r.mitigations == ("tiled_mlp",) for r in at_target)
    assert max(r.peak_bytes for r in cb.records) <= budget  # measured by the tracker, every step
    lengths = [r.seq_len for r in cb.records]
    assert lengths == sorted(lengths)


def test_it_is_opt_in_and_says_why_it_does_not_apply(monkeypatch):
    assert "tiled_mlp" in EXTRA_RUNGS and "tiled_mlp" not in MITIGATIONS
    # the default ladder is unchanged
    assert MITIGATIONS == ("attention", "checkpointing", "microbatch")
    assert check_mitigations(["attention", "tiled_mlp"]) == ("attention", "tiled_mlp")
    ladder.unregister("tiled_mlp")  # a built-in: stays
    assert "tiled_mlp" in rung_names()

    assert ladder.is_applicable("tiled_mlp", None, nn.Linear(2, 2))[0] is False
    dropout_in_mlp = nn.ModuleList(
        [nn.ModuleDict({"mlp": nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.1), nn.Linear(32, 8))})
                                    for _ in range(2)])
    applies, why = ladder.is_applicable("tiled_mlp", None, dropout_in_mlp)
    assert not applies and "Dropout(p=0.1)" in why and "set its p to 0" in why
    moe = nn.ModuleList([nn.ModuleDict(
        {"mlp": nn.ModuleDict({"experts": nn.ModuleList([nn.Linear(8, 8)])})}) for _ in range(2)])
    assert "mixture of experts" in ladder.is_applicable("tiled_mlp", None, moe)[1]

    gpt = _gpt()
    assert tile_count_rule(find_mlps(gpt)) == 4  # d_ff 256 / d_model 64
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed"
                        else real_find_spec(name, *a))
    applies, why = ladder.is_applicable("tiled_mlp", None, gpt)
    assert not applies and "pip install 'lightning-seqmem[tiled]'" in why
    with pytest.raises(ValueError, match="`tiles` must be None"):
        TiledMLP(tiles=0)


@pytest.mark.ddp
def test_ddp_ranks_with_different_lengths_take_the_same_decision_and_tile_count(tmp_path):
    """2 gloo ranks, rank 0 at 64 tokens and rank 1 at 128: only rank 1's step needs the rung under
    this budget; both switch it on at the same step with the same tile count, DDP reduces every
    gradient (no "marked ready twice"), the parameters stay equal, no step exceeds the budget."""
    # between the dry-run peaks of rank 1's step tiled and untiled, above rank 0's untiled
    budget = 2_500_000
    script = Path(__file__).parent / "scripts" / "ddp_run.py"
    args = ["--batch-sizes", "2,2", "--seq-lens", "64,128", "--mitigations", "tiled_mlp", "--d-ff",
            "512", "--budget", str(budget), "--max-steps", "4", "--no-curriculum"]
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), *args], capture_output=True,
                          text=True, timeout=limit_s(240))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert (rank0["decisions"] == rank1["decisions"]
            and rank0["global_step"] == rank1["global_step"] == 4)
    assert rank0["applied_mitigations"] == rank1["applied_mitigations"] == ["tiled_mlp"]
    # d_ff 512 / d_model 32, whatever the length
    assert rank0["tiled_mlp_tiles"] == rank1["tiled_mlp_tiles"] == 16
    assert rank0["parameters"] == rank1["parameters"]
    assert max(r["peak_bytes"] for r in rank0["records"] + rank1["records"]) <= budget


def test_strategies_that_shard_or_wrap_the_model_refuse_it_at_set_up():
    from types import SimpleNamespace

    class DeepSpeedStrategy: ...

    class FSDPStrategy: ...

    rung = ladder.rung("tiled_mlp")
    assert "DeepSpeed's own TiledMLP" in rung.setup_refusal(
        SimpleNamespace(strategy=DeepSpeedStrategy()), _gpt())
    assert "FSDPStrategy" in rung.setup_refusal(SimpleNamespace(strategy=FSDPStrategy()), _gpt())
    assert rung.setup_refusal(None, _gpt()) is None
    only_dropouts = nn.ModuleList([nn.ModuleDict({"mlp": nn.Sequential(nn.Dropout(0.1))})
                                   for _ in range(2)])
    assert "nothing to tile" in ladder.is_applicable("tiled_mlp", None, only_dropouts)[1]


def test_seqmem_plan_forecasts_the_rung(tmp_path, capsys):
    config = plan_config(tmp_path, ["tiled_mlp"],
                         {"n_layer": 2, "d_model": 64, "n_head": 2, "vocab_size": VOCAB,
                          "attention": "sdpa", "d_ff": 512},
                         {"batch_size": 2, "seq_len": 64, "num_samples": 4, "vocab_size": VOCAB})
    doc = plan_json(config, capsys, [256])
    assert doc["mitigation_sets"] == [[], ["tiled_mlp"]]
    plain, tiled = doc["lengths"][0]["rows"]
    assert tiled["mitigations"] == ["tiled_mlp"] and tiled["peak_bytes"] < plain["peak_bytes"]


def test_outside_training_the_mlp_runs_untiled_with_the_same_output():
    module = _gpt(dropout=0.1)
    module.eval()
    ids = _batch(2, 32)["input_ids"]
    with torch.no_grad():
        expected = module(ids)
        TiledMLP(tiles=3).apply(module)
        assert tiled_mlp_tiles(module) == 3
        # no_grad: the MLP's own forward
        torch.testing.assert_close(module(ids), expected, rtol=0, atol=0)


def test_at_long_lengths_the_tile_count_follows_the_length_as_alst():
    """Above ``floor * hidden`` tokens a call runs ALST's ``ceil(L / hidden)`` tiles (one tile per
    32 tokens here: d_model 32), at least the floor (d_ff 128 / d_model 32 = 4); counted by the
    calls of the MLP's first linear layer in a real step: one per tile in forward, again in
    backward's recompute."""
    module = _gpt(d_model=32, d_ff=128)
    assert TiledMLP().apply(module).applied
    assert tiled_mlp_tiles(module) == 4
    calls = []
    first_linear = find_mlps(module)[0][0]
    first_linear.register_forward_hook(lambda *_: calls.append(1))
    for seq_len, tiles in ((64, 4), (128, 4), (1024, 32)):
        calls.clear()
        _loss(module, _batch(2, seq_len)).backward()
        assert tiled_mlp_tiles(module, seq_len=seq_len) == tiles
        assert len(calls) == 2 * tiles, (seq_len, len(calls))
    fixed = _gpt(d_model=32, d_ff=128)
    TiledMLP(tiles=3).apply(fixed)
    assert tiled_mlp_tiles(fixed, seq_len=1024) == 3  # set by hand: the same at every length
