"""Dry runs against real measured steps.

Every expected figure is a real training step measured with the live-tensor tracker
(:func:`lightning_seqmem.measure.steps.training_step_memory` under ``make_probe("tracker", cpu)``,
one warm-up step first, then the measured one) on a separate copy of the module carrying the same
settings; nothing is hard-coded. Tolerance 1% of the measured step peak.
"""

from __future__ import annotations

import copy
import dataclasses
import threading

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.data import DataLoader

from lightning_seqmem.reference.demo import LitGPT
from lightning_seqmem.dryrun.result import DryRunUnsupported
from lightning_seqmem.dryrun.cuda import allocator_block_bytes
from lightning_seqmem.dryrun.step import dry_run_step, replay_peaks
from lightning_seqmem.mitigations.attention.attention import (AttentionSwitch,
                                                              current_attention_backend)
from lightning_seqmem.mitigations.checkpointing.checkpointing import (
    ActivationCheckpointing, is_checkpointed)
from lightning_seqmem.mitigations.microbatch.microbatch import MicroBatching
from lightning_seqmem.measure.steps import training_step_memory
from lightning_seqmem.measure.probes import existing_tensors, make_probe, round_cuda_block_bytes

from conftest import make_trainer

pytestmark = pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")

TOLERANCE = 0.01  # of the measured step peak
VOCAB = 256
L0 = 16  # the shortest length: dry runs start from a batch this long
CPU = torch.device("cpu")
# a context factory, as Lightning's forward_context
BF16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731


def _batch(batch_size: int, seq_len: int, seed: int = 0, **extra: bool) -> dict:
    g = torch.Generator().manual_seed(seed)
    batch = {
        "input_ids": torch.randint(0, VOCAB, (batch_size, seq_len), generator=g),
        "labels": torch.randint(0, VOCAB, (batch_size, seq_len), generator=g),
    }
    if extra.get("attention_mask"):
        batch["attention_mask"] = torch.ones(batch_size, seq_len, dtype=torch.long)
    if extra.get("position_ids"):
        batch["position_ids"] = torch.arange(seq_len).unsqueeze(0)
    return batch


def _loss(model, batch):
    out = model.training_step(batch, 0)
    return out["loss"] if isinstance(out, dict) else out


def _apply(module: nn.Module, mitigations) -> nn.Module:
    for name in mitigations:
        policy = {"attention": AttentionSwitch, "checkpointing": ActivationCheckpointing}[name]()
        assert policy.apply(module).applied
    return module


def _measured(module: nn.Module, batch: dict, mitigations=(), autocast=None, optimizer_fn=None):
    """The real step: a separate copy with ``mitigations``, a warm-up step, then a measured one."""
    real = _apply(copy.deepcopy(module), mitigations)
    real.train()
    optimizer = (optimizer_fn or (lambda p: torch.optim.AdamW(p, lr=1e-3)))(real.parameters())
    training_step_memory(real, optimizer, batch, _loss, context=autocast)
    return training_step_memory(real, optimizer, batch, _loss, make_probe("tracker", CPU),
                                context=autocast)


def _check(dry, measured, phases=True):
    error = (dry.peak_bytes - measured.peak_bytes) / measured.peak_bytes
    assert abs(error) <= TOLERANCE, (error, dry.phase_peak_bytes, measured.phase_peak_bytes,
                                     dry.detail)
    if phases:
        for phase, peak in measured.phase_peak_bytes.items():
            assert abs(dry.phase_peak_bytes[phase] - peak) <= TOLERANCE * measured.peak_bytes, (
                phase, dry, measured)


def _gpt(**kwargs) -> LitGPT:
    torch.manual_seed(0)
    return LitGPT(**{"n_layer": 2, "d_model": 64, "n_head": 4, **kwargs})


def _snapshot(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {
        "params": {n: p.detach().clone() for n, p in module.named_parameters()},
        "grads": {n: (p.grad, None if p.grad is None else p.grad.clone())
                  for n, p in module.named_parameters()},
        "state": {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()},
        "attention": current_attention_backend(module),
        "checkpointed": is_checkpointed(module),
        "modules": [type(m) for m in module.modules()],
        "training_step": module.__dict__.get("training_step"),
    }


def _assert_unchanged(module: nn.Module, optimizer: torch.optim.Optimizer, before: dict) -> None:
    after = _snapshot(module, optimizer)
    assert (after["attention"] == before["attention"]
            and after["checkpointed"] == before["checkpointed"])
    assert (after["modules"] == before["modules"]
            and after["training_step"] is before["training_step"])
    for name, p in before["params"].items():
        assert torch.equal(after["params"][name], p), name
    for name, (grad, value) in before["grads"].items():
        now = dict(module.named_parameters())[name].grad
        assert now is grad and (grad is None or torch.equal(now, value)), name
    assert after["state"].keys() == before["state"].keys()
    for key, state in before["state"].items():
        assert all(torch.equal(after["state"][key][k], v) for k, v in state.items())


# -- the reference GPT and a Hugging Face LM at 16x the shortest length ----------------------------
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_gpt_matches_measured_step_at_16x(attention, checkpointing):
    """One real step (a copy with this attention and checkpointing) against three ways of asking."""
    measured = _measured(_gpt(attention=attention), _batch(2, 16 * L0),
                         ["checkpointing"] if checkpointing else [])
    configured = _gpt(attention=attention)  # 1. a module already set up this way
    if checkpointing:
        _apply(configured, ["checkpointing"])
    dry = dry_run_step(configured, torch.optim.AdamW(configured.parameters(), lr=1e-3),
                       _batch(2, L0), 16 * L0)
    assert (dry.seq_len, dry.batch_size, dry.mitigations) == (16 * L0, 2, ())
    _check(dry, measured)
    # 2. the plain eager module with the same setting asked as mitigations: applied to the copy only
    wanted = tuple(name for name, on in (("attention", attention == "sdpa"),
                                         ("checkpointing", checkpointing)) if on)
    if wanted:
        module = _gpt(attention="eager")
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        before = _snapshot(module, optimizer)
        dry = dry_run_step(module, optimizer, _batch(2, L0), 16 * L0, mitigations=wanted)
        _assert_unchanged(module, optimizer, before)
        assert before["attention"] == "eager" and not before["checkpointed"] and not optimizer.state
        assert all(p.grad is None for p in module.parameters()) and dry.mitigations == wanted
        _check(dry, measured)


class _HFWithPositions(pl.LightningModule):
    """A Hugging Face causal LM fed the batch's ``attention_mask`` and ``position_ids`` ([1, L])."""

    def __init__(self, model_type: str, attn_implementation: str, **config) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        fields = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, intermediate_size=128, vocab_size=VOCAB,
                      **config)  # fmt: skip
        hf_config = transformers.AutoConfig.for_model(model_type, **fields)
        self.model = transformers.AutoModelForCausalLM.from_config(
            hf_config, attn_implementation=attn_implementation)

    def training_step(self, batch, batch_idx):
        out = self.model(
            input_ids=batch["input_ids"],
            attention_mask=batch.get("attention_mask"),
            position_ids=batch.get("position_ids"),
            use_cache=False,
        )
        return F.cross_entropy(out.logits.flatten(0, 1).float(), batch["labels"].flatten())


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_hf_llama_matches_measured_step_at_16x(attention):
    module = _HFWithPositions("llama", attention)
    extra = {"attention_mask": True, "position_ids": True}
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    dry = dry_run_step(module, optimizer, _batch(2, L0, **extra), seq_len=16 * L0)
    _check(dry, _measured(module, _batch(2, 16 * L0, **extra)))


# -- programs that change with the length ----------------------------------------------------------
class _SwitchingAttentionLM(nn.Module):
    """One attention layer: eager (an L x L score matrix) below ``switch_len`` tokens, then SDPA."""

    def __init__(self, switch_len: int = 128, d_model: int = 32, n_head: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.switch_len, self.n_head = switch_len, n_head
        self.emb = nn.Embedding(VOCAB, d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.head = nn.Linear(d_model, VOCAB)

    def training_step(self, batch, batch_idx):
        x = self.emb(batch["input_ids"])
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.n_head, D // self.n_head).permute(2, 0, 3, 1, 4)
        if L < self.switch_len:
            scores = (q @ k.transpose(-2, -1)) / (D // self.n_head) ** 0.5
            scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
            y = scores.softmax(-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        logits = self.head(x + y.transpose(1, 2).reshape(B, L, D))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def test_model_switching_kernel_by_length_matches_on_both_sides():
    module = _SwitchingAttentionLM(switch_len=128)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    peaks = {}
    for seq_len in (127, 128):
        dry = dry_run_step(module, optimizer, _batch(2, L0), seq_len=seq_len)
        _check(dry, _measured(module, _batch(2, seq_len)))
        peaks[seq_len] = dry.peak_bytes
    assert peaks[128] < peaks[127]  # the switch is seen: longer, yet smaller


def test_hf_mistral_sliding_window_sdpa_matches_inside_and_beyond_the_window():
    module = _HFWithPositions("mistral", "sdpa", sliding_window=32)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    for seq_len in (16, 128):  # inside the window and 4x beyond it
        dry = dry_run_step(module, optimizer, _batch(2, 8), seq_len=seq_len)
        _check(dry, _measured(module, _batch(2, seq_len)))


# -- micro-batching: against a real Lightning step -------------------------------------------------
class _MeasureStep(pl.Callback):
    """The tracker around one real Lightning step (peak only: micro-batches interleave phases)."""

    def __init__(self, batch_idx: int) -> None:
        self.batch_idx, self.probe, self.memory = batch_idx, make_probe("tracker", CPU), None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.batch_idx:
            self.probe.start_step(existing_tensors(pl_module, trainer.optimizers, batch))
            self.probe.mark_phase("forward")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.probe.running:
            self.memory = self.probe.end_step()


def test_microbatch_matches_a_real_lightning_step_with_micro_batching():
    module = _gpt(attention="sdpa")
    batch = _batch(4, 8 * L0)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    before = _snapshot(module, optimizer)
    dry = dry_run_step(module, optimizer, _batch(4, L0), seq_len=8 * L0, mitigations=["microbatch"])
    _assert_unchanged(module, optimizer, before)
    assert "4 micro-batches of 1" in dry.detail

    real = copy.deepcopy(module)  # the real thing: Lightning, with MicroBatching on a separate copy
    measure = _MeasureStep(batch_idx=1)
    trainer = make_trainer([measure], max_steps=2)
    assert MicroBatching(1).apply(trainer, real, batch).applied
    trainer.fit(real, DataLoader([batch] * 2, batch_size=None))
    _check(dry, measure.memory, phases=False)
    whole = dry_run_step(module, optimizer, _batch(4, L0), seq_len=8 * L0)
    assert dry.peak_bytes < whole.peak_bytes
    # a module already micro-batched is dry-run as it trains
    assert (dry_run_step(real, trainer.optimizers[0], _batch(4, L0), seq_len=8 * L0).peak_bytes
            == dry.peak_bytes)


# -- precision -------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_bf16_autocast_matches_measured_step(attention):
    module = _gpt(attention=attention)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    dry = dry_run_step(module, optimizer, _batch(2, L0), seq_len=16 * L0, autocast=BF16)
    fp32 = dry_run_step(module, optimizer, _batch(2, L0), seq_len=16 * L0)
    assert dry.peak_bytes < fp32.peak_bytes
    _check(dry, _measured(module, _batch(2, 16 * L0), autocast=BF16))


# -- values read from the batch; what cannot run ---------------------------------------------------
class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)


class _ReadsBatchValues(_Tiny):
    """Reads batch values alone: a token count (.item()), positions (nonzero), a random mask."""

    def training_step(self, batch, batch_idx):
        labels = batch["labels"].masked_fill(torch.rand(batch["labels"].shape) < 0.1, -100)
        count = (labels != -100).sum().item()
        last = batch["input_ids"].nonzero()[-1]  # a data-dependent shape, from the batch only
        logits = self.head(self.emb(batch["input_ids"]) + self.emb(last).sum())
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                               reduction="sum") / max(count, 1)


class _ReadsActivations(_Tiny):
    def training_step(self, batch, batch_idx):
        h = self.emb(batch["input_ids"])
        if h.abs().max().item() > 100.0:  # a value of an activation: unknown without real weights
            h = h / 100.0
        return F.cross_entropy(self.head(h).flatten(0, 1), batch["labels"].flatten())


class _OverwritesBatchValues(_Tiny):
    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"].clone()
        h = self.emb(ids)
        ids[:, 0] = h.sum(-1).argmax(-1)  # the batch-derived ids now hold an activation's values
        if (ids == 0).any():  # so this read cannot be answered from the batch
            h = h * 2
        return F.cross_entropy(self.head(h).flatten(0, 1), batch["labels"].flatten())


class _NonzeroOfActivations(_Tiny):
    def training_step(self, batch, batch_idx):
        h = self.emb(batch["input_ids"])
        return F.cross_entropy(self.head(h[h.sum(-1) > 0]), batch["labels"][h.sum(-1) > 0])


def test_values_computed_from_the_batch_are_real_and_the_rng_is_restored():
    module = _ReadsBatchValues()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    dry = dry_run_step(module, optimizer, _batch(2, L0), seq_len=64)
    # torch.rand ran for real (on the batch's values)
    assert torch.equal(torch.get_rng_state(), rng)
    _check(dry, _measured(module, _batch(2, 64),
                          optimizer_fn=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)))


def test_reading_an_activation_value_is_unsupported_with_the_line():
    module = _ReadsActivations()
    with pytest.raises(DryRunUnsupported,
                       match=r"reads tensor values.*h\.abs\(\)\.max\(\)\.item\(\)") as info:
        dry_run_step(module, torch.optim.AdamW(module.parameters()), _batch(2, L0), seq_len=64)
    assert "test_dryrun.py" in info.value.reason
    with pytest.raises(DryRunUnsupported, match=r"reads tensor values.*if \(ids == 0\)\.any\(\)"):
        module = _OverwritesBatchValues()
        dry_run_step(module, torch.optim.AdamW(module.parameters()), _batch(2, L0), seq_len=64)
    with pytest.raises(DryRunUnsupported, match="output shape depends on tensor values"):
        module = _NonzeroOfActivations()
        dry_run_step(module, torch.optim.AdamW(module.parameters()), _batch(2, L0), seq_len=64)


def test_compiled_submodule_is_unsupported():
    module = _gpt()
    module.model.blocks[1] = torch.compile(module.model.blocks[1])  # lazy: nothing is compiled here
    with pytest.raises(DryRunUnsupported,
                       match=r"submodule 'model\.blocks\.1' .* torch\.compile'd"):
        dry_run_step(module, torch.optim.AdamW(module.parameters()), _batch(2, L0), seq_len=64)


# -- the real module, its optimizer and the RNG are left alone -------------------------------------
def test_real_module_optimizer_state_and_rng_are_unchanged():
    module = _gpt(dropout=0.1, attention_dropout=0.1)
    groups = [
        {"params": [p for n, p in module.named_parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for n, p in module.named_parameters() if p.dim() < 2], "weight_decay": 0.0,
         "lr": 3e-3},
    ]
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    # real grads and optimizer state exist
    training_step_memory(module, optimizer, _batch(2, L0), _loss)
    before = _snapshot(module, optimizer)
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    dry = dry_run_step(module, optimizer, _batch(2, L0), seq_len=128,
                       mitigations=["attention", "checkpointing"])
    assert torch.equal(torch.get_rng_state(), rng)
    _assert_unchanged(module, optimizer, before)
    assert all(p.grad is not None for p in module.parameters()) and dry.peak_bytes > 0


def test_optimizer_param_groups_and_class_are_rebuilt():
    module = _gpt(attention="sdpa")

    def sgd(params):
        params = list(params)
        return torch.optim.SGD(
            [{"params": params[::2], "momentum": 0.9}, {"params": params[1::2], "lr": 0.01}], lr=0.1
        )

    dry = dry_run_step(module, sgd(module.parameters()), _batch(2, L0), seq_len=128)
    _check(dry, _measured(module, _batch(2, 128), optimizer_fn=sgd))
    assert "with SGD" in dry.detail
    adamw = dry_run_step(module, torch.optim.AdamW(module.parameters()), _batch(2, L0), seq_len=128)
    # two states vs half a momentum
    assert adamw.phase_peak_bytes["optimizer"] > dry.phase_peak_bytes["optimizer"]
    # LitGPT.configure_optimizers: AdamW
    configured = dry_run_step(module, None, _batch(2, L0), seq_len=128)
    assert configured.peak_bytes == adamw.peak_bytes


class _SkipsZeroGradients(torch.optim.SGD):
    """Steps only parameters whose gradient is not all zero: a branch on a value."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.abs().sum() > 0:
                    p.add_(p.grad, alpha=-group["lr"])


@pytest.mark.parametrize("foreach", [False, True])
def test_adafactor_reads_norms_in_its_step_and_is_dry_run_to_the_byte(foreach):
    """Adafactor's step reads ``param.norm().item()`` (a float that scales the update): the dry run
    reads a stand-in there and is exact; its factored moments hold less than AdamW's two."""
    module = _gpt(attention="sdpa")

    def adafactor(params):
        return torch.optim.Adafactor(params, lr=1e-2, weight_decay=0.01, foreach=foreach)

    dry = dry_run_step(module, adafactor(module.parameters()), _batch(2, L0), seq_len=128)
    measured = _measured(module, _batch(2, 128), optimizer_fn=adafactor)
    assert dry.peak_bytes == measured.peak_bytes
    assert dry.phase_peak_bytes == measured.phase_peak_bytes and "with Adafactor" in dry.detail
    adamw = dry_run_step(module, torch.optim.AdamW(module.parameters()), _batch(2, L0), seq_len=128)
    assert dry.phase_peak_bytes["forward"] < adamw.phase_peak_bytes["forward"]  # less state held
    # a bool read in a step (a branch) still refuses, naming the line
    with pytest.raises(DryRunUnsupported, match=r"reads tensor values.*p\.grad\.abs\(\)\.sum"):
        dry_run_step(module, _SkipsZeroGradients(module.parameters(), lr=0.1), _batch(2, L0),
                     seq_len=128)


# -- the batch -------------------------------------------------------------------------------------
SEEN: list = []


class _Recorder(_Tiny):
    def training_step(self, batch, batch_idx):
        SEEN.append({k: (tuple(v.shape), v.tolist() if k in ("input_ids", "position_ids") else None)
                     for k, v in batch.items() if isinstance(v, torch.Tensor)})  # fmt: skip
        assert batch["tag"] == "keep"
        logits = self.head(self.emb(batch["input_ids"]) * batch["attention_mask"].unsqueeze(-1))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


@pytest.mark.parametrize("batch_size, seq_len", [(5, 37), (2, 4)])
def test_batch_is_cut_or_tiled_consistently(batch_size, seq_len):
    rows, length = 3, 10
    batch = _batch(rows, length, attention_mask=True, position_ids=True)
    batch.update(index=torch.arange(rows), tag="keep",
                 mask4d=torch.ones(rows, 1, length, length, dtype=torch.bool))
    SEEN.clear()
    module = _Recorder()
    dry_run_step(module, torch.optim.SGD(module.parameters(), lr=0.1), batch, seq_len=seq_len,
                 batch_size=batch_size)
    seen = SEEN[-1]
    for key in ("input_ids", "labels", "attention_mask"):
        assert seen[key][0] == (batch_size, seq_len), key
    assert seen["position_ids"] == ((1, seq_len), [list(range(seq_len))])
    assert (seen["index"][0] == (batch_size,)
            and seen["mask4d"][0] == (batch_size, 1, seq_len, seq_len))
    ids, source = seen["input_ids"][1], batch["input_ids"].tolist()
    for row in range(batch_size):  # rows repeated, tokens tiled (or cut)
        assert ids[row] == (source[row % rows] * 4)[:seq_len]


@dataclasses.dataclass(frozen=True)
class _Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    bias: torch.Tensor  # [B, 1, L, L], cut or tiled on both last dims
    name: str = "x"


class _DataclassRecorder(_Tiny):
    def training_step(self, batch, batch_idx):
        SEEN.append((type(batch), batch.name, tuple(batch.input_ids.shape),
                     tuple(batch.bias.shape)))
        return F.cross_entropy(self.head(self.emb(batch.input_ids)).flatten(0, 1),
                               batch.labels.flatten())


def test_dataclass_batch_is_rebuilt_at_the_new_shape():
    b = _batch(3, 10)
    batch = _Batch(b["input_ids"], b["labels"], torch.zeros(3, 1, 10, 10))
    SEEN.clear()
    module = _DataclassRecorder()
    dry_run_step(module, torch.optim.SGD(module.parameters(), lr=0.1), batch, seq_len=24,
                 batch_size=2)
    assert SEEN[-1] == (_Batch, "x", (2, 24), (2, 1, 24, 24))
    assert batch.input_ids.shape == (3, 10) and not isinstance(batch.input_ids, FakeTensor)


# -- allocator rounding ----------------------------------------------------------------------------
def test_replay_peaks_is_the_tracker_on_cpu_and_rounds_to_cuda_blocks():
    module = _gpt(attention="sdpa")
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    batch = _batch(2, 37)  # odd sizes: many storages are not multiples of 512 bytes
    training_step_memory(module, optimizer, batch, _loss)
    m = training_step_memory(module, optimizer, batch, _loss, make_probe("tracker", CPU),
                             record_events=True)
    assert replay_peaks(m.events) == (m.peak_bytes, m.phase_peak_bytes)
    peak, phases = replay_peaks(m.events, allocator_block_bytes("cuda"))
    live = best = 0
    for entry in m.events.sequence:  # brute force: each allocation rounded on its own
        size = round_cuda_block_bytes(m.events.sizes[entry if entry >= 0 else ~entry])
        live += size if entry >= 0 else -size
        best = max(best, live)
    assert peak == best > m.peak_bytes and max(phases.values()) == peak
    assert allocator_block_bytes(CPU) == 1 and allocator_block_bytes(torch.device("cuda", 1)) == 512


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="a CPU-only torch build cannot fake CUDA tensors")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a build with CUDA dry-runs CUDA itself")
def test_cuda_on_a_cpu_only_build_is_the_real_program_in_512_byte_blocks():
    """``device="cuda"`` on a CPU-only build runs the fake step on the simulated accelerator: the
    same program as a real CPU step here (eager attention in fp32: no kernel chosen by device),
    every storage rounded up to the CUDA allocator's 512-byte blocks: equal to the byte to the
    measured CPU step's events replayed in those blocks, phase by phase, less AdamW's ``step``
    counters, which live in host memory on an accelerator (a CPU scalar each, alive through the
    whole step). AdamW's default on CUDA is its foreach step, so the CPU step here takes it too."""
    module = _gpt()
    batch = _batch(2, 4 * L0)
    real = copy.deepcopy(module)
    optimizer = torch.optim.AdamW(real.parameters(), lr=1e-3, foreach=True)
    training_step_memory(real, optimizer, batch, _loss)
    measured = training_step_memory(real, optimizer, batch, _loss, make_probe("tracker", CPU),
                                    record_events=True)
    peak, phases = replay_peaks(measured.events, round_cuda_block_bytes(1))
    dry = dry_run_step(module, torch.optim.AdamW(module.parameters(), lr=1e-3), _batch(2, L0),
                       4 * L0, device="cuda")
    assert "on seqmem:0" in dry.detail and "512-byte blocks" in dry.detail, dry.detail
    block = round_cuda_block_bytes(1)
    counters = sum(block for state in optimizer.state.values() for k, v in state.items()
                   if k == "step")
    assert counters == block * len(list(real.parameters()))
    assert dry.peak_bytes == peak - counters > measured.peak_bytes
    assert dry.phase_peak_bytes == {p: phases[p] - counters for p in dry.phase_peak_bytes}


def test_bad_arguments():
    module = _gpt()
    optimizer = torch.optim.AdamW(module.parameters())
    with pytest.raises(ValueError, match="seq_len"):
        dry_run_step(module, optimizer, _batch(2, L0), seq_len=0)
    with pytest.raises(ValueError, match="mitigations"):
        dry_run_step(module, optimizer, _batch(2, L0), seq_len=32, mitigations=["fp8"])
    with pytest.raises(TypeError, match="training_step"):
        dry_run_step(nn.Linear(2, 2), optimizer, _batch(2, L0), seq_len=32)
    other = torch.optim.AdamW(_gpt().parameters())
    with pytest.raises(DryRunUnsupported, match="not a parameter"):
        dry_run_step(module, other, _batch(2, L0), seq_len=32)


def test_microbatch_switch_step_includes_the_first_split_check():
    """The step that switches micro-batching on also runs its one-time loss check (no-grad forwards
    of two micro-batches together and apart, while the last step's gradients are alive): the dry run
    of that step counts it, so the switch step is judged at what it will really peak. A large
    vocabulary over a narrow model makes the check's logits the peak (16% above the steady
    micro-batched step)."""
    module = _gpt(attention="sdpa", n_layer=1, d_model=32, n_head=2, vocab_size=4096)
    batch = _batch(4, 8 * L0)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    dry = dry_run_step(module, optimizer, _batch(4, L0), seq_len=8 * L0, mitigations=["microbatch"])
    assert "one-time check" in dry.detail

    real = copy.deepcopy(module)
    measure = _MeasureStep(batch_idx=1)
    trainer = make_trainer([measure], max_steps=2)

    class SwitchOnAtStep1(pl.Callback):  # as the callback does: after a plain step, before the next
        def on_train_batch_start(self, trainer, pl_module, batch_, batch_idx):
            if batch_idx == 1:
                assert MicroBatching(1).apply(trainer, pl_module, batch_).applied

    trainer.callbacks.insert(0, SwitchOnAtStep1())
    trainer.fit(real, DataLoader([batch] * 2, batch_size=None))
    assert measure.memory is not None
    _check(dry, measure.memory, phases=False)  # the switch step, its check included


_FAILING_RECOMPUTE = '''
import torch
from torch.utils.checkpoint import checkpoint
from lightning_seqmem.dryrun.step import dry_run_step
from lightning_seqmem.dryrun.result import DryRunUnsupported
calls = [0]
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
    def block(self, x):
        calls[0] += 1
        if calls[0] % 2 == 0:
            raise RuntimeError("boom in recompute")
        return self.lin(x).relu()
    def training_step(self, batch, batch_idx):
        x = batch["input_ids"].float().unsqueeze(-1).expand(-1, -1, 8)
        return checkpoint(self.block, x, use_reentrant=False).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
try:
    dry_run_step(M(), None, {"input_ids": torch.zeros(2, 4, dtype=torch.long)}, 16, device="cuda")
except DryRunUnsupported as exc:
    print("refused:", exc.reason)
'''


def test_a_failing_recompute_on_the_simulated_device_is_a_refusal_not_an_abort():
    """An exception in a checkpointed block's recompute (a saved-tensor unpack hook) on the
    simulated device used to abort the whole process ("terminate called without an active
    exception": the engine's device thread); now the dry run refuses with the reason, and the
    process lives on."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FAILING_RECOMPUTE], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("refused: the fake step failed: RuntimeError: boom in recompute"
            in proc.stdout), proc.stdout


class _HoldsATensor(torch.optim.SGD):
    """SGD that keeps a tensor beside its state (as some optimizers do): its first step must run."""

    def step(self, closure=None):
        self.scratch = torch.zeros(64)
        return super().step(closure)


class _SharesAStorage(torch.optim.SGD):
    """SGD whose state holds a view of its momentum buffer: one storage, two state tensors."""

    def step(self, closure=None):
        out = super().step(closure)
        for state in self.state.values():
            state["flat"] = state["momentum_buffer"].view(-1)
        return out


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: _HoldsATensor(ps, lr=0.1, momentum=0.9),
    lambda ps: _SharesAStorage(ps, lr=0.1, momentum=0.9)])
def test_a_later_dry_run_makes_the_first_step_s_state_from_its_layout_to_the_byte(
        make, monkeypatch):
    # a fake optimizer step made the state as after a first step in every dry run (a quarter of
    # a warm dry run of the 5-block GPT); a later one of the same optimizer and parameters makes
    # those tensors from the first one's layout, with the same figures and no step
    import lightning_seqmem.dryrun.step as step_module

    model, optimizer = _gpt(), None
    optimizer = make(model.parameters())
    steps = []
    original = type(optimizer).step
    monkeypatch.setattr(type(optimizer), "step", lambda self, *a, **k: (
        steps.append(1), original(self, *a, **k))[1])
    step_module._STATE_LAYOUTS.clear()
    cold = dry_run_step(model, optimizer, _batch(2, L0), 64, device=CPU)
    cold_steps, steps[:] = len(steps), []
    warm = dry_run_step(model, optimizer, _batch(2, L0), 64, device=CPU)
    assert (warm.peak_bytes, warm.phase_peak_bytes) == (cold.peak_bytes, cold.phase_peak_bytes)
    holds = isinstance(optimizer, (_HoldsATensor, _SharesAStorage))
    assert cold_steps == 2 and len(steps) == (2 if holds else 1)  # state and measured steps
    assert [type(v) for v in step_module._STATE_LAYOUTS.values()] == [type(None) if holds
                                                                      else list]


class _KeepsALock(torch.optim.SGD):
    """SGD with a value in its state that cannot be copied (a lock)."""

    def step(self, closure=None):
        out = super().step(closure)
        for state in self.state.values():
            state["lock"] = threading.Lock()
        return out


def test_a_state_the_layout_cannot_record_steps_each_time_and_is_still_dry_run():
    import lightning_seqmem.dryrun.step as step_module

    model = _gpt()
    optimizer = _KeepsALock(model.parameters(), lr=0.1, momentum=0.9)
    step_module._STATE_LAYOUTS.clear()
    first = dry_run_step(model, optimizer, _batch(2, L0), 64, device=CPU)
    second = dry_run_step(model, optimizer, _batch(2, L0), 64, device=CPU)
    assert (first.peak_bytes, first.phase_peak_bytes) == (second.peak_bytes,
                                                          second.phase_peak_bytes)
    assert not step_module._STATE_LAYOUTS
