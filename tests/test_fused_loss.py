"""The "fused_loss" rung on real models: the same loss and gradients as the plain loss (padding and
ignore_index included), a lower peak measured by the live-tensor tracker, a dry-run forecast within
1% of the measured step, and a curriculum run whose last stage fits only with it.

Tiny models whose vocabulary is large relative to d_model (64 vs 8192), so the logits are the peak.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from conftest import make_trainer
from lightning_seqmem import Curriculum, SeqMemCallback
from lightning_seqmem.core.rungs import MITIGATIONS, check_mitigations
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.dryrun.step import dry_run_step
from lightning_seqmem.measure.probes import TrackerProbe
from lightning_seqmem.measure.steps import training_step_memory
from lightning_seqmem.mitigations import ladder
from lightning_seqmem.mitigations.base import RungContext
from lightning_seqmem.mitigations.fused_loss.fused_loss import (
    FusedLinearCrossEntropy, FusedLossRung, fused_loss_backend)
from lightning_seqmem.mitigations.microbatch.microbatch_functional import (micro_batch_counts,
                                                                           split_batch)

VOCAB = 8192
MODEL = dict(n_layer=2, d_model=64, n_head=2, vocab_size=VOCAB, attention="sdpa")
LLAMA = {"vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 2}


def _batch(seq_len, rows=2, vocab=VOCAB, pad=0):
    """Random tokens; with ``pad``, the last ``pad`` positions of row 1 are padding (mask 0, label
    -100) and the first 5 labels of row 0 are ignored."""
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, vocab, (rows, seq_len), generator=g),
             "labels": torch.randint(0, vocab, (rows, seq_len), generator=g)}
    if pad:
        batch["labels"][0, :5] = -100
        batch["labels"][1, -pad:] = -100
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        batch["attention_mask"][1, -pad:] = 0
    return batch


def _quiet(module):
    module.log = lambda *args, **kwargs: None  # training_step outside a Trainer
    return module


def _step(module, batch):
    return module.training_step(batch, 0)


def _measured(module, batch) -> int:
    """Peak of a real step after a warm-up one (Lightning's order), by the live-tensor tracker."""
    optimizer = module.configure_optimizers()
    training_step_memory(module, optimizer, batch, _step)
    return training_step_memory(module, optimizer, batch, _step, TrackerProbe("cpu")).peak_bytes


def _loss_and_grads(module, batch):
    module.zero_grad(set_to_none=True)
    loss = _step(module, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()
                           if p.grad is not None}


def _assert_same(plain, fused):
    (loss_p, grads_p), (loss_f, grads_f) = plain, fused
    assert torch.allclose(loss_f, loss_p, rtol=1e-5, atol=1e-6), (loss_f, loss_p)
    assert grads_p.keys() == grads_f.keys() and grads_p
    for name in grads_p:
        assert torch.allclose(grads_f[name], grads_p[name], rtol=1e-4, atol=1e-6), name


def test_it_is_an_opt_in_rung():
    assert MITIGATIONS == ("attention", "checkpointing", "microbatch")
    assert check_mitigations(["attention", "fused_loss"]) == ("attention", "fused_loss")
    assert ladder.is_applicable("fused_loss", None, torch.nn.Linear(2, 2))[0] is False
    with pytest.raises(ValueError, match="`backend` must be one of"):
        FusedLossRung("xla")


def test_switched_on_mid_run_the_loss_and_gradients_are_the_plain_ones():
    torch.manual_seed(0)
    module = _quiet(LitGPT(**MODEL))
    optimizer = module.configure_optimizers()
    batch = _batch(128, pad=7)
    training_step_memory(module, optimizer, batch, _step)  # a run under way: optimizer state exists
    keys, params = list(module.state_dict()), [id(p) for g in optimizer.param_groups
                                               for p in g["params"]]
    twin = copy.deepcopy(module)
    result = ladder.apply("fused_loss", None, module)
    assert result.applied and result.after == "tiled" and "DeepSpeed" in result.detail
    assert fused_loss_backend(module) == "tiled" and ladder.is_on("fused_loss", module)
    assert list(module.state_dict()) == keys
    assert [id(p) for g in optimizer.param_groups for p in g["params"]] == params
    _assert_same(_loss_and_grads(twin, batch), _loss_and_grads(module, batch))
    # the loss is a mean over counted tokens: micro-batching's weights (label tokens) keep it
    rule, counts = micro_batch_counts(batch, 1)
    parts = split_batch(batch, 1)
    weighted = sum(c * _step(module, p) for c, p in zip(counts, parts)) / sum(counts)
    assert rule == "label_tokens" and counts[0] != counts[1]
    assert torch.allclose(weighted, _step(twin, batch), rtol=1e-5)
    # it comes off again: the plain loss
    assert (ladder.remove("fused_loss", None, module).after == "plain"
            and not ladder.is_on("fused_loss", module))
    assert module.model.fused_loss is None


def test_the_measured_peak_falls_and_the_dry_run_forecasts_it():
    torch.manual_seed(0)
    module = _quiet(LitGPT(**MODEL))
    batch = _batch(256)
    forecast = dry_run_step(module, module.configure_optimizers(), batch, 256,
                            mitigations=["fused_loss"])
    assert not ladder.is_on("fused_loss", module)  # the dry run put it on its copy only
    plain = _measured(module, batch)
    ladder.apply("fused_loss", None, module)
    fused = _measured(module, batch)
    logits_bytes = 2 * 256 * VOCAB * 4
    assert plain - fused > logits_bytes  # several [tokens, vocab] float32 tensors are gone
    assert abs(forecast.peak_bytes - fused) <= 0.01 * fused, (forecast.peak_bytes, fused)
    assert "fused_loss: loss plain -> tiled" in forecast.detail


def test_hugging_face_llama_from_a_random_config():
    pytest.importorskip("transformers")
    from lightning_seqmem.reference.hf import HFCausalLM

    torch.manual_seed(0)
    module = _quiet(HFCausalLM(config=LLAMA, attn_implementation="sdpa", shift_labels=True))
    llama = module.model
    batch = _batch(128, vocab=4096, pad=9)
    keys = list(module.state_dict())
    plain = _loss_and_grads(module, batch)
    long_batch = _batch(256, vocab=4096)
    forecast = dry_run_step(module, module.configure_optimizers(), long_batch, 256,
                            mitigations=["fused_loss"])
    result = ladder.apply("fused_loss", None, module)
    assert result.applied and result.detail.endswith("on model")
    # the instance's forward only
    assert "forward" in llama.__dict__ and list(module.state_dict()) == keys
    _assert_same(plain, _loss_and_grads(module, batch))
    out = llama(input_ids=batch["input_ids"], labels=batch["labels"])
    assert out.logits is None and out.loss is not None
    n = torch.tensor(40)  # Hugging Face's gradient accumulation: the sum over num_items_in_batch
    fused_sum = llama(input_ids=batch["input_ids"], labels=batch["labels"],
                      num_items_in_batch=n).loss
    ladder.remove("fused_loss", None, module)
    assert "forward" not in llama.__dict__ and not ladder.is_on("fused_loss", module)
    assert llama(input_ids=batch["input_ids"]).logits.shape == (2, 128, 4096)
    plain_sum = llama(input_ids=batch["input_ids"], labels=batch["labels"],
                      num_items_in_batch=n).loss
    assert torch.allclose(fused_sum, plain_sum, rtol=1e-5)
    plain_peak = _measured(module, long_batch)
    ladder.apply("fused_loss", None, module)
    fused_peak = _measured(module, long_batch)
    assert abs(forecast.peak_bytes - fused_peak) <= 0.01 * fused_peak, (
        forecast.peak_bytes, fused_peak)
    assert fused_peak < plain_peak - 2 * 256 * 4096 * 4


def test_models_it_cannot_take_are_refused_with_the_reason(monkeypatch):
    pytest.importorskip("transformers")
    from transformers import Gemma2Config, Gemma2ForCausalLM

    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32,
                                           num_hidden_layers=1, num_attention_heads=2,
                                           num_key_value_heads=1, head_dim=8))
    applies, why = FusedLossRung().is_applicable(RungContext(gemma))
    assert not applies and "final_logit_softcapping" in why
    applies, why = FusedLossRung().is_applicable(RungContext(torch.nn.Linear(2, 2)))
    assert not applies and "set_fused_loss" in why
    import lightning_seqmem.mitigations.fused_loss.fused_loss as fused_loss

    monkeypatch.setattr(fused_loss, "_installed", lambda module: False)
    applies, why = FusedLossRung().is_applicable(RungContext(LitGPT(**MODEL)))
    assert not applies and "lightning-seqmem[tiled]" in why
    with pytest.raises(RuntimeError, match=r"lightning-seqmem\[tiled\]"):
        FusedLinearCrossEntropy()(torch.zeros(1, 2, 4), torch.zeros(8, 4),
                                  torch.zeros(1, 2, dtype=torch.long))


def test_the_callback_switches_it_on_before_the_stage_that_needs_it():
    def dry(seq_len, mitigations=()):
        module = LitGPT(**MODEL)
        return dry_run_step(module, module.configure_optimizers(), _batch(64), seq_len,
                            mitigations=list(mitigations)).peak_bytes

    old_rungs = dry(256, ["checkpointing", "microbatch"])
    fits = max(dry(128), dry(256, ["checkpointing", "microbatch", "fused_loss"]))
    assert fits < old_rungs
    budget = (fits + old_rungs) // 2  # 128 fits as it is; 256 with the fused loss only
    cb = SeqMemCallback(warmup_steps=1, memory_budget=budget, safety_margin=0.0,
                        mitigations=["attention", "checkpointing", "microbatch", "fused_loss"],
                        curriculum=Curriculum(start=128, target=256, steps_per_stage=2,
                                              multiple_of=64))
    torch.manual_seed(0)
    module = LitGPT(**MODEL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer([cb], max_steps=4).fit(
            module, SyntheticTokenDataModule(batch_size=2, seq_len=256, num_samples=8,
                                             vocab_size=VOCAB))
    assert "fused_loss" in cb.applied_mitigations and ladder.is_on("fused_loss", module)
    event = next(e for e in cb.mitigation_events if e["name"] == "fused_loss")
    lengths = [r.seq_len for r in cb.records]
    assert lengths == [128, 128, 256, 256]  # never backwards, and the target reached
    assert event["seq_len"] == 256 and event["step"] == 2  # switched on before the first 256 step
    assert all("fused_loss" in r.mitigations for r in cb.records if r.seq_len == 256)
    assert max(r.peak_bytes for r in cb.records) <= budget  # measured by the tracker, every step


@pytest.mark.ddp
@pytest.mark.slow
def test_two_gloo_ranks_take_the_same_decision(tmp_path):
    """DDP, 2 CPU processes: rank 0 has 1 sample of 256 tokens, rank 1 2 samples of 128; both switch
    the fused loss on at the same step; their parameters stay equal (its gradients reach DDP)."""
    from test_ddp import _decisions, _run

    def dry(batch_size, seq_len, mitigations=()):
        module = LitGPT(n_layer=1, d_model=32, n_head=2, vocab_size=VOCAB)
        return dry_run_step(module, module.configure_optimizers(), _batch(64, rows=batch_size),
                            seq_len, mitigations=list(mitigations)).peak_bytes

    plain, fused = dry(2, 128), dry(2, 128, ["fused_loss"])
    assert dry(2, 64) < (plain + fused) // 2 < plain
    # the 64 stage fits as it is, the 128 one with the fused loss only
    budget = (plain + fused) // 2
    rank0, rank1 = _run(tmp_path, "--budget", str(budget), "--max-steps", "6", "--mitigations",
                        "fused_loss", "--vocab-size", str(VOCAB), "--curriculum", "64,256",
                        "--batch-sizes", "1,2", "--seq-lens", "256,128", timeout=100)
    assert rank0["applied_mitigations"] == rank1["applied_mitigations"] == ["fused_loss"]
    assert rank0["mitigation_events"] == rank1["mitigation_events"]
    assert rank0["mitigation_events"][0]["seq_len"] == 128  # before the stage that needs it
    assert rank0["decisions"] == rank1["decisions"] and _decisions(rank0) == _decisions(rank1)
    assert rank0["parameters_sum"] == pytest.approx(rank1["parameters_sum"], rel=1e-9)
    assert {(r["rank"], r["seq_len"]) for r in rank0["records"] if r["seq_len"] > 128} <= {(0, 256)}
    assert max(r["peak_bytes"] for r in rank0["records"]) <= budget


def test_gpt2_lm_head_model_takes_it_with_the_same_loss():
    # GPT2LMHeadModel (HF's causal LM loss under another class name) was refused as "not a
    # *ForCausalLM model": a GPT-2 fit under a 60 MiB budget stopped at 208 tokens, 240 with it
    pytest.importorskip("transformers")
    from lightning_seqmem.reference.hf import HFCausalLM

    torch.manual_seed(0)
    module = _quiet(HFCausalLM(model_type="gpt2", attn_implementation="sdpa", shift_labels=True,
                               config=dict(vocab_size=4096, n_embd=64, n_layer=2, n_head=4,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)))
    batch, long_batch = _batch(128, vocab=4096, pad=9), _batch(256, vocab=4096)
    plain = _loss_and_grads(module, batch)
    forecast = dry_run_step(module, module.configure_optimizers(), long_batch, 256,
                            mitigations=["fused_loss"])
    assert ladder.apply("fused_loss", None, module).applied
    _assert_same(plain, _loss_and_grads(module, batch))
    ladder.remove("fused_loss", None, module)
    plain_peak = _measured(module, long_batch)  # (a real step: the parameters change)
    ladder.apply("fused_loss", None, module)
    fused_peak = _measured(module, long_batch)
    assert abs(forecast.peak_bytes - fused_peak) <= 0.01 * fused_peak, (
        forecast.peak_bytes, fused_peak)
    assert fused_peak < plain_peak - 2 * 256 * 4096 * 4
