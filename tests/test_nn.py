"""Tests for the reference GPT (lightning_seqmem.reference.nn) and the Lightning demo
(lightning_seqmem.reference.demo)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention import SDPBackend

from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule, SyntheticTokens
from lightning_seqmem.reference.nn import (
    ATTENTION_BACKENDS,
    GPT,
    CausalSelfAttention,
    GPTConfig,
    flash_attn_available,
    flash_attn_unavailable_reason,
)

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _tiny(**overrides) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, n_layer=2, n_head=4, d_model=32)
    cfg.update(overrides)
    return GPT(GPTConfig(**cfg))


def _logits_and_grads(model: GPT,
                      input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids)
    # A loss that touches every logit with distinct weights, so every gradient path is exercised.
    weights = torch.linspace(-1.0, 1.0, logits.numel(), device=logits.device).view_as(logits)
    (logits * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return logits.detach(), grads


# --- equivalence of kernels -------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 2, 7, 33, 64])
@pytest.mark.parametrize("sdpa_backends", [None, [SDPBackend.MATH]])
def test_eager_and_sdpa_give_same_logits_and_grads(length, sdpa_backends):
    model = _tiny()
    input_ids = torch.randint(0, 64, (3, length), generator=torch.Generator().manual_seed(length))

    model.set_attention_backend("eager")
    eager_logits, eager_grads = _logits_and_grads(model, input_ids)
    model.set_attention_backend("sdpa", sdpa_backends=sdpa_backends)
    sdpa_logits, sdpa_grads = _logits_and_grads(model, input_ids)

    assert eager_logits.shape == (3, length, 64)
    torch.testing.assert_close(sdpa_logits, eager_logits, atol=1e-5, rtol=1e-4)
    assert eager_grads.keys() == sdpa_grads.keys()
    for name in eager_grads:
        torch.testing.assert_close(sdpa_grads[name], eager_grads[name], atol=1e-5, rtol=1e-4,
                                   msg=name)


def test_backends_agree_in_eval_mode_with_dropout_configured():
    model = _tiny(dropout=0.2, attention_dropout=0.3).eval()
    input_ids = torch.randint(0, 64, (2, 11))
    eager = model(input_ids)
    model.set_attention_backend("sdpa")
    torch.testing.assert_close(model(input_ids), eager, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_causal_future_tokens_do_not_change_earlier_logits(backend):
    model = _tiny(attention=backend)
    input_ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    changed = input_ids.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 64
    before, after = model(input_ids), model(changed)
    torch.testing.assert_close(after[:, :10], before[:, :10], atol=1e-6, rtol=0)
    assert not torch.allclose(after[:, 10:], before[:, 10:])


def test_odd_width_and_long_length_without_maximum():
    model = GPT(GPTConfig(vocab_size=16, n_layer=1, n_head=3, d_model=9, attention="sdpa"))
    assert model(torch.zeros(1, 5000, dtype=torch.long)).shape == (1, 5000, 16)
    assert not any("pos" in name for name, _ in model.named_parameters())


# --- switching ------------------------------------------------------------------------------------


def test_switching_keeps_parameter_identity_and_state_dict_keys():
    model = _tiny()
    params = {name: p for name, p in model.named_parameters()}
    keys = list(model.state_dict().keys())
    for backend in ("sdpa", "eager", "sdpa"):
        model.set_attention_backend(backend)
        assert model.attention_backend == backend
        assert all(m.attention_backend == backend for m in model.modules()
                   if isinstance(m, CausalSelfAttention))
        assert list(model.state_dict().keys()) == keys
        assert all(p is params[name] for name, p in model.named_parameters())
    assert model.config.attention == "sdpa"


def test_attention_backend_reports_mixed():
    model = _tiny()
    model.blocks[0].attn.set_attention_backend("sdpa")
    assert model.attention_backend == "mixed"


def test_unknown_backend_raises_value_error_and_keeps_backend():
    model = _tiny(attention="sdpa")
    with pytest.raises(ValueError, match=r"`backend`.*'flash_v9'") as info:
        model.set_attention_backend("flash_v9")
    assert str(ATTENTION_BACKENDS) in str(info.value)
    assert model.attention_backend == "sdpa"


def test_sdpa_backends_only_with_sdpa():
    model = _tiny()
    with pytest.raises(ValueError, match="sdpa_backends"):
        model.set_attention_backend("eager", sdpa_backends=[SDPBackend.MATH])
    with pytest.raises(ValueError, match="sdpa_backends"):
        model.set_attention_backend("sdpa", sdpa_backends=["math"])
    model.set_attention_backend("sdpa", sdpa_backends=SDPBackend.MATH)  # a single value is accepted
    assert model.blocks[0].attn.sdpa_backends == [SDPBackend.MATH]


@pytest.mark.skipif(flash_attn_available(), reason="flash-attn is usable here")
def test_flash_unavailable_raises_runtime_error_with_reason():
    reason = flash_attn_unavailable_reason()
    assert reason
    model = _tiny()
    with pytest.raises(RuntimeError, match="flash") as info:
        model.set_attention_backend("flash")
    message = str(info.value)
    assert reason in message and "sdpa" in message
    assert model.attention_backend == "eager"
    with pytest.raises(RuntimeError, match="flash"):
        GPT(GPTConfig(attention="flash"))  # the config is valid; the machine is not


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(not flash_attn_available(), reason="flash-attn not installed")
def test_flash_matches_sdpa_on_cuda_bf16_and_rejects_fp32():
    model = _tiny().cuda()
    input_ids = torch.randint(0, 64, (2, 128), device="cuda")
    model.set_attention_backend("flash")
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        model(input_ids)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        flash = model(input_ids).float()
        model.set_attention_backend("sdpa")
        sdpa = model(input_ids).float()
    torch.testing.assert_close(flash, sdpa, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
def test_eager_and_sdpa_agree_on_cuda():
    model = _tiny().cuda()
    input_ids = torch.randint(0, 64, (2, 65), device="cuda")
    eager_logits, eager_grads = _logits_and_grads(model, input_ids)
    model.set_attention_backend("sdpa")
    sdpa_logits, sdpa_grads = _logits_and_grads(model, input_ids)
    torch.testing.assert_close(sdpa_logits, eager_logits, atol=1e-4, rtol=1e-3)
    for name in eager_grads:
        torch.testing.assert_close(sdpa_grads[name], eager_grads[name], atol=1e-4, rtol=1e-3,
                                   msg=name)


# --- config validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(d_model=30, n_head=4), r"`d_model`.*d_model=30.*n_head=4"),
        (dict(n_layer=0), r"`n_layer`.*0"),
        (dict(vocab_size=-1), r"`vocab_size`.*-1"),
        (dict(d_ff=0), r"`d_ff`.*0"),
        (dict(n_head=2.0), r"`n_head`.*2.0"),
        (dict(dropout=1.0), r"`dropout`.*\[0, 1\).*1.0"),
        (dict(attention_dropout=-0.1), r"`attention_dropout`.*-0.1"),
        (dict(attention="xformers"), r"`attention`.*'xformers'"),
    ],
)
def test_gpt_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_gpt_config_defaults():
    cfg = GPTConfig()
    assert (cfg.vocab_size, cfg.n_layer, cfg.n_head, cfg.d_model, cfg.d_ff) == (256, 2, 4, 128, 512)
    assert ((cfg.dropout, cfg.attention_dropout, cfg.attention, cfg.bias)
            == (0.0, 0.0, "eager", True))
    no_bias = GPT(GPTConfig(n_layer=1, bias=False))
    assert all(getattr(m, "bias", None) is None for m in no_bias.modules())


# --- demo data ------------------------------------------------------------------------------------


def test_synthetic_tokens_deterministic_and_shifted():
    ds = SyntheticTokens(num_samples=5, seq_len=12, vocab_size=20, seed=3)
    again = SyntheticTokens(num_samples=5, seq_len=12, vocab_size=20, seed=3)
    assert len(ds) == 5
    for i in range(5):
        item = ds[i]
        assert item["index"] == i
        assert item["input_ids"].dtype == torch.long and item["input_ids"].shape == (12,)
        assert item["labels"].shape == (12,)
        assert torch.equal(item["input_ids"][1:], item["labels"][:-1])
        assert int(item["input_ids"].max()) < 20 and int(item["input_ids"].min()) >= 0
        assert torch.equal(item["input_ids"], again[i]["input_ids"])
        assert torch.equal(item["input_ids"], ds[i]["input_ids"])
    assert not torch.equal(ds[0]["input_ids"], ds[1]["input_ids"])
    other_seed = SyntheticTokens(num_samples=5, seq_len=12, vocab_size=20, seed=4)
    assert torch.equal(other_seed[0]["input_ids"], ds[1]["input_ids"])  # item i uses seed + i
    with pytest.raises(IndexError):
        ds[5]


def test_synthetic_tokens_set_seq_len():
    ds = SyntheticTokens(num_samples=2, seq_len=8)
    ds.set_seq_len(3)
    assert ds[0]["input_ids"].shape == (3,) and ds[0]["labels"].shape == (3,)
    for bad in (0, -4, 2.5):
        with pytest.raises(ValueError, match="`seq_len`"):
            ds.set_seq_len(bad)
    with pytest.raises(ValueError, match="`num_samples`"):
        SyntheticTokens(num_samples=0)


def test_datamodule_batches_and_set_seq_len():
    dm = SyntheticTokenDataModule(batch_size=3, seq_len=10, num_samples=7)
    loader = dm.train_dataloader()
    batches = list(loader)
    assert len(batches) == 2  # drop_last
    batch = batches[0]
    assert set(batch) == {"input_ids", "labels", "index"}
    assert batch["input_ids"].shape == (3, 10) and batch["labels"].shape == (3, 10)
    assert batch["index"].tolist() == [0, 1, 2]  # no shuffle
    dm.set_seq_len(4)
    assert dm.seq_len == 4
    assert next(iter(dm.train_dataloader()))["input_ids"].shape == (3, 4)
    with pytest.raises(ValueError, match="`batch_size`"):
        SyntheticTokenDataModule(batch_size=8, num_samples=4)


# --- Lightning ------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_litgpt_trains_three_steps(attention):
    import lightning.pytorch as pl

    torch.manual_seed(0)
    model = LitGPT(vocab_size=32, n_layer=1, n_head=2, d_model=16, attention=attention)
    dm = SyntheticTokenDataModule(batch_size=2, seq_len=16, num_samples=16, vocab_size=32)
    trainer = pl.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 3
    loss = float(trainer.callback_metrics["train/loss"])
    assert math.isfinite(loss) and 0.5 * math.log(32) < loss < 2 * math.log(32)
    assert model.hparams.attention == attention
    model.set_attention_backend("sdpa" if attention == "eager" else "eager")
    assert model.model.attention_backend != attention


# --- memory: eager materialises L x L, sdpa does not ---------------------------------------------


def _peak_live_bytes(model: GPT, length: int) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    input_ids = torch.randint(0, 64, (4, length), generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:  # forward inside too: tensors created outside the tracker are not counted
        model(input_ids).float().mean().backward()
    model.zero_grad(set_to_none=True)
    return tracker.get_tracker_snapshot("peak")[CPU]["Total"]


def test_eager_memory_grows_quadratically_and_sdpa_linearly():
    # Narrow and shallow, so the [B, H, L, L] scores dominate eager's activations.
    model = _tiny(n_layer=1, d_model=32, n_head=4)
    ratios = {}
    for backend in ("eager", "sdpa"):
        model.set_attention_backend(backend)
        ratios[backend] = _peak_live_bytes(model, 256) / _peak_live_bytes(model, 128)
    # Measured on CPU (torch 2.13): eager ~3.6, sdpa ~1.9.
    assert ratios["eager"] > 3.0, ratios
    assert ratios["sdpa"] < 2.3, ratios
    assert ratios["eager"] > ratios["sdpa"] + 0.8, ratios
