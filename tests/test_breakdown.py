"""Breakdown: attribution to modules and kinds, growth classes, diagnoses, ablation, theory."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing)

from lightning_seqmem.diagnostics import findings, tracer
from lightning_seqmem.diagnostics.categories import (ATTENTION_CATEGORIES, find_attention_modules,
                                                     module_category)
from lightning_seqmem.diagnostics.compare import compare_breakdowns
from lightning_seqmem.diagnostics.findings import MemoryDiagnosisWarning, diagnose
from lightning_seqmem.diagnostics.growth import classify_growth, crossover_length, fit_growth
from lightning_seqmem.diagnostics.korthikanti import calibrate, korthikanti_activation_bytes
from lightning_seqmem.diagnostics.tracer import Breakdown
from lightning_seqmem.mitigations.checkpointing.checkpointing import ActivationCheckpointing
from lightning_seqmem.reference.nn import GPT, GPTConfig
from lightning_seqmem.measure.probes import TrackerProbe

def trace_breakdown(step_fn, model, *args, **kwargs) -> Breakdown:
    """One traced step (:func:`.tracer.trace_breakdown`), calibrated against Korthikanti et al."""
    breakdown = tracer.trace_breakdown(step_fn, model, *args, **kwargs)
    breakdown.calibration = breakdown.calibration or calibrate(breakdown, model)
    return breakdown


def attention_ablation(step_fn, model, *args, **kwargs):
    """:func:`.findings.attention_ablation`, both steps calibrated."""
    ablation = findings.attention_ablation(step_fn, model, *args, **kwargs)
    for breakdown in (ablation.with_attention, ablation.without_attention):
        breakdown.calibration = breakdown.calibration or calibrate(breakdown, model)
    return ablation


# Lengths and widths chosen so that no model width, head count or batch size equals a length.
LENGTHS = (48, 96)
BATCH = 2


def _gpt(attention="eager", **overrides):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, d_model=64, n_head=4, attention=attention, **overrides))


def _trainer(model, seq_len, autocast=False):
    """A warmed-up training step on a fixed batch: (step_fn, optimizer, batch)."""
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 256, (BATCH, seq_len))

    def step():
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()).backward()
        optimizer.step()

    step()  # warm-up: optimizer state exists, grads of the previous step are alive
    return step, optimizer, ids


def _trace(model, seq_len, autocast=False):
    step, optimizer, ids = _trainer(model, seq_len, autocast)
    return trace_breakdown(step, model, optimizer, [ids], seq_len=seq_len, batch_size=BATCH)


def _diagnoses(breakdown, model, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = diagnose(breakdown, model, **kwargs)
    emitted = [str(w.message) for w in caught if issubclass(w.category, MemoryDiagnosisWarning)]
    assert emitted == found  # each finding warned exactly once
    return found


# -- pure maths ------------------------------------------------------------------------------------
def test_korthikanti_known_configs():
    # GPT-3 175B (h=12288, a=96), s=2048, b=1: the paper's s·b·h·(34 + 5·a·s/h) = 114·s·b·h bytes
    assert korthikanti_activation_bytes(2048, 1, 12288, 96) == 2048 * 12288 * 114 == 2_868_903_936
    assert korthikanti_activation_bytes(2048, 1, 12288, 96, recompute=True) == 2 * 2048 * 12288
    # fp32 without dropout: 4·(16·s·b·h + a·s²·b)
    s, b, h, a = 64, 2, 128, 4
    assert (korthikanti_activation_bytes(s, b, h, a, bytes_per_element=4, dropout=False)
            == 4 * (16 * s * b * h + a * s * s * b))
    # 16-bit without dropout: the 2·s·b·h + 3·a·s²·b dropout bytes are gone
    with_dropout = korthikanti_activation_bytes(s, b, h, a)
    assert (with_dropout - korthikanti_activation_bytes(s, b, h, a, dropout=False)
            == 2 * s * b * h + 3 * a * s * s * b)
    with pytest.raises(ValueError, match="`heads` must be a positive int"):
        korthikanti_activation_bytes(64, 1, 128, 0)


def test_crossover_from_synthetic_polynomials():
    # attention = 10·L + 0.01·L², rest = 30·L  ->  0.01·L² = 20·L at L = 2000
    assert crossover_length((0, 10, 0.01), (0, 30, 0)) == pytest.approx(2000)
    # with constants: L² + 10·L + 100 vs 1000·L + 5000 -> root of L² - 990·L - 4900
    expected = (990 + math.sqrt(990**2 + 4 * 4900)) / 2
    assert crossover_length((100, 10, 1), (5000, 1000, 0)) == pytest.approx(expected)
    assert crossover_length((0, 10, 0), (0, 30, 0)) is None  # linear attention never dominates
    assert crossover_length((0, 40, 0), (0, 30, 0)) == 0.0  # dominates everywhere
    assert crossover_length((0, 0, 1), (0, 0, 2)) is None


def test_crossover_through_compare_breakdowns_on_synthetic_parts():
    def synthetic(L):
        activations = {"attention_scores": int(0.5 * L * L), "qkv_projection": 10 * L,
                       "ffn": 70 * L}
        parts = {c: {"activations": n} for c, n in activations.items()}
        parts["ffn"]["parameters"] = 1000
        return Breakdown(
            seq_len=L, batch_size=1, peak_bytes=1000 + sum(activations.values()),
            peak_phase="backward", peak_op="", start_bytes=1000,
            peak_by_part=parts,
            peak_by_module={}, activation_by_category=activations, layer_activation_bytes=[],
            autocast_dtype=None, attention_backend="eager", checkpointed=False, tensors=[],
            alive_at_peak=[],
        )

    table = compare_breakdowns([synthetic(L) for L in (64, 128)])
    # 10·L + 0.5·L² = 70·L  ->  L = 120
    assert table.crossover_seq_len == pytest.approx(120)
    growth = {(p.category, p.kind): p.growth for p in table.peak_parts}
    assert growth == {
        ("qkv_projection", "activations"): "linear",
        ("attention_scores", "activations"): "quadratic",
        ("ffn", "parameters"): "constant",
        ("ffn", "activations"): "linear",
    }
    assert table.attention_share_at(120) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="two or more sequence lengths"):
        compare_breakdowns([synthetic(64)])


def test_growth_fit_and_classification():
    assert fit_growth([64, 128], [3 * 64, 3 * 128]) == (0.0, 3.0, 0.0)
    c0, c1, c2 = fit_growth([32, 64, 128], [5 + 2 * L + 0.25 * L * L for L in (32, 64, 128)])
    assert (c0, c1, c2) == pytest.approx((5, 2, 0.25))
    assert classify_growth([64, 128], [7, 7]) == "constant"
    assert classify_growth([64, 128], [100 + 64, 100 + 128]) == "linear"
    assert classify_growth([64, 128], [64**2, 128**2]) == "quadratic"
    # L term < 2%
    assert classify_growth([32, 64, 128], [1e6 + L for L in (32, 64, 128)]) == "constant"
    assert classify_growth([32, 64, 128], [1000 * L + L * L for L in (32, 64, 128)]) == "quadratic"


def test_module_categories_from_paths():
    gpt = [("", "GPT"), ("blocks", "ModuleList"), ("0", "Block")]
    attn = gpt + [("attn", "CausalSelfAttention")]
    assert module_category(attn + [("qkv", "Linear")]) == "qkv_projection"
    assert module_category(attn + [("proj", "Linear")]) == "output_projection"
    assert module_category(attn) == "attention_other"
    assert module_category(gpt + [("mlp", "Sequential"), ("1", "GELU")]) == "ffn"
    assert module_category(gpt + [("mlp", "Sequential"), ("3", "Dropout")]) == "norms_dropout"
    assert (module_category(gpt + [("_checkpoint_wrapped_module", "Block"), ("ln1", "LayerNorm")])
            == "norms_dropout")
    assert module_category([("", "GPT"), ("tok_emb", "Embedding")]) == "embedding"
    assert module_category([("", "GPT"), ("lm_head", "Linear")]) == "loss_logits"
    assert module_category(gpt) == "other"
    llama = [("", "LlamaForCausalLM"), ("model", "LlamaModel"), ("layers", "ModuleList"),
             ("0", "LlamaDecoderLayer")]
    assert (module_category(llama + [("self_attn", "LlamaAttention"), ("k_proj", "Linear")])
            == "qkv_projection")
    assert (module_category(llama + [("self_attn", "LlamaAttention"), ("o_proj", "Linear")])
            == "output_projection")
    assert module_category(llama + [("mlp", "LlamaMLP"), ("down_proj", "Linear")]) == "ffn"
    assert module_category(llama + [("input_layernorm", "LlamaRMSNorm")]) == "norms_dropout"
    gpt2_mlp = [("", "GPT2"), ("h", "ModuleList"), ("0", "GPT2Block"), ("mlp", "GPT2MLP"),
                ("c_proj", "Conv1D")]
    # c_proj outside attention is not the output projection
    assert module_category(gpt2_mlp) == "ffn"


# -- traced steps ----------------------------------------------------------------------------------
def test_breakdown_sums_to_the_tracker_probe_peak_of_the_same_step():
    model = _gpt("eager")
    step, optimizer, ids = _trainer(model, LENGTHS[0])
    probe = TrackerProbe("cpu")
    probe.start_step(
        list(model.parameters())
        + [p.grad for p in model.parameters() if p.grad is not None]
        + [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        + [ids]
    )
    step()
    measured = probe.end_step().peak_bytes
    breakdown = trace_breakdown(step, model, optimizer, [ids], seq_len=LENGTHS[0], batch_size=BATCH)
    attributed = sum(sum(kinds.values()) for kinds in breakdown.peak_by_part.values())
    assert attributed == breakdown.peak_bytes == sum(breakdown.peak_by_module.values())
    assert abs(attributed - measured) <= 0.01 * measured, (attributed, measured)
    kinds = breakdown.peak_by_kind
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert kinds["parameters"] == params and kinds["optimizer_state"] >= 2 * params
    assert kinds["activations"] > 0 and breakdown.peak_phase == "backward"
    # per-layer activations of this fp32, dropout-free eager GPT are within 5% of Korthikanti
    calibration = breakdown.calibration
    assert (calibration is not None and not calibration.dropout
            and calibration.bytes_per_element == 4)
    assert calibration.ratio == pytest.approx(1.0, abs=0.05)
    assert "Korthikanti" in calibration.explanation and "_softmax" in calibration.explanation
    json.dumps(breakdown.to_dict())


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_eager_attention_is_quadratic_sdpa_is_not(attention):
    table = compare_breakdowns([_trace(_gpt(attention), L) for L in LENGTHS])
    growth = {p.category: p.growth for p in table.activation_parts}
    peak_growth = {(p.category, p.kind): p.growth for p in table.peak_parts}
    assert peak_growth[("ffn", "parameters")] == "constant"
    assert growth["ffn"] == "linear" and growth["norms_dropout"] == "linear"
    if attention == "eager":
        assert growth["attention_scores"] == "quadratic"
        assert peak_growth[("attention_scores", "activations")] == "quadratic"
        assert table.attention_share[1] > table.attention_share[0]
        assert table.crossover_seq_len is not None and table.crossover_seq_len > LENGTHS[0]
        # extrapolation from per-part fits: the share at the crossover is one half
        assert table.attention_share_at(table.crossover_seq_len) == pytest.approx(0.5, abs=1e-6)
    else:
        assert "attention_scores" not in growth
        assert "quadratic" not in set(growth.values()) | set(peak_growth.values())
        assert table.attention_share[0] == pytest.approx(table.attention_share[1], abs=0.01)
        assert table.crossover_seq_len is None
    md = table.to_markdown()
    assert "| attention share |" in md and "L=48" in md and "L=96" in md
    json.dumps(table.to_dict())


class UpcastAttention(nn.Module):
    """Hand-written attention that computes its scores in fp32 (the FAQ's "suddenly doubles")."""

    def __init__(self, width=64, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        b, length, width = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-2, -1)).float() / math.sqrt(q.shape[-1])
        weights = scores.softmax(-1).to(v.dtype)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, length, width))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok_emb = nn.Embedding(256, 64)
        self.attn = UpcastAttention()
        self.lm_head = nn.Linear(64, 256, bias=False)

    def forward(self, ids):
        x = self.tok_emb(ids)
        return self.lm_head(x + self.attn(x))


def test_fp32_scores_under_autocast_are_diagnosed():
    model = TinyLM()
    breakdown = _trace(model, LENGTHS[0], autocast=True)
    assert breakdown.autocast_dtype == "bfloat16"
    fp32 = [g for g in breakdown.quadratic_tensors()
            if g["dtype"] == "float32" and g["phase"] == "forward"]
    assert fp32 and {g["modules"][0] for g in fp32} == {"attn"}
    found = _diagnoses(breakdown, model)
    assert any("float32 under mixed precision" in f for f in found)
    assert any("hand-written matmul" in f for f in found)
    assert not any("mixed precision" in f for f in _diagnoses(breakdown, model, autocast=False))
    with pytest.warns(MemoryDiagnosisWarning, match="scaled_dot_product_attention"):
        diagnose(breakdown, model)


def test_package_gpt_eager_softmax_is_fp32_under_autocast_sdpa_is_clean():
    eager = _gpt("eager")
    breakdown = _trace(eager, LENGTHS[0], autocast=True)
    softmax = [g for g in breakdown.quadratic_tensors()
               if g["op"] == "aten::_softmax" and g["phase"] == "forward"]
    assert softmax and softmax[0]["dtype"] == "float32" and softmax[0]["saved_for_backward"]
    assert any("float32 under mixed precision" in f for f in _diagnoses(breakdown, eager))

    sdpa = _gpt("sdpa")
    breakdown = _trace(sdpa, LENGTHS[0], autocast=True)
    assert breakdown.autocast and not breakdown.quadratic_tensors()
    assert _diagnoses(breakdown, sdpa) == []


def test_checkpointing_that_misses_attention_is_diagnosed():
    covered = _gpt("eager")
    assert ActivationCheckpointing().apply(covered).applied
    breakdown = _trace(covered, LENGTHS[0])
    assert not [g for g in breakdown.quadratic_tensors()
                if g["saved_for_backward"] and g["phase"] == "forward"]
    assert not any("checkpointing" in f for f in _diagnoses(breakdown, covered))
    assert breakdown.calibration is not None and breakdown.calibration.recompute
    # full recompute: each block keeps its output only, e·s·b·h (fp32: 4·s·b·h)
    assert (breakdown.calibration.measured_bytes == breakdown.calibration.theory_bytes
            == 4 * LENGTHS[0] * BATCH * 64)

    missed = _gpt("eager")  # checkpointing "on", but wrapping the final norm only
    apply_activation_checkpointing(missed, check_fn=lambda m: m is missed.ln_f)
    breakdown = _trace(missed, LENGTHS[0])
    found = [f for f in _diagnoses(breakdown, missed) if "checkpointing" in f]
    assert len(found) == 1 and "blocks.0.attn" in found[0]


def test_attention_ablation_lowers_the_peak_and_restores_attention():
    model = _gpt("eager")
    step, optimizer, ids = _trainer(model, LENGTHS[1])
    ablation = attention_ablation(step, model, optimizer, [ids], seq_len=LENGTHS[1],
                                  batch_size=BATCH)
    assert ablation.replaced == ["blocks.0.attn", "blocks.1.attn"]
    assert ablation.without_attention.peak_bytes < ablation.with_attention.peak_bytes
    assert 0 < ablation.attention_peak_share < 1
    assert not any(c in ablation.without_attention.activation_by_category
                   for c in ("attention_scores", "attention_other"))
    assert all("forward" not in vars(m) for _, m in find_attention_modules(model))
    after = trace_breakdown(step, model, optimizer, [ids], seq_len=LENGTHS[1], batch_size=BATCH)
    assert "attention_scores" in after.activation_by_category  # attention is back
    json.dumps(ablation.to_dict())


def test_hf_llama_breakdown_and_ablation():
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 256, (BATCH, LENGTHS[0]))

    def step():
        optimizer.zero_grad()
        logits = model(input_ids=ids, use_cache=False).logits
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        optimizer.step()

    step()
    ablation = attention_ablation(step, model, optimizer, [ids], seq_len=LENGTHS[0],
                                  batch_size=BATCH)
    breakdown = ablation.with_attention
    assert set(breakdown.peak_by_part["qkv_projection"]) >= {"parameters", "optimizer_state"}
    scores = [g for g in breakdown.quadratic_tensors() if g["op"] == "aten::_softmax"]
    assert (scores and scores[0]["modules"][0].endswith("self_attn")
            and scores[0]["saved_for_backward"])
    assert breakdown.calibration is not None and breakdown.calibration.num_layers == 2
    assert ablation.without_attention.peak_bytes < breakdown.peak_bytes
    step()  # attention restored: a normal step still runs


def test_arguments_are_checked():
    model = _gpt()
    with pytest.raises(ValueError, match="`seq_len` must be a positive int"):
        trace_breakdown(lambda: None, model, seq_len=0, batch_size=1)
    with pytest.raises(ValueError, match="`step_fn` must be callable"):
        trace_breakdown(None, model, seq_len=8, batch_size=1)
    assert sum(ATTENTION_CATEGORIES.count(c) for c in ("attention_scores", "qkv_projection")) == 2
