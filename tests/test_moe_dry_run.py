"""Mixture-of-Experts steps in the dry run, against real steps measured by the live-tensor tracker.

Every expected figure is a real training step (``training_step_memory`` under
``make_probe("tracker", cpu)``, after one warm-up step) of a deep copy of a tiny random-config
Hugging Face MoE model (Mixtral, Qwen2-MoE, OLMoE), with each experts implementation transformers
runs on a CPU. Where no size depends on the routing (grouped and batched matmuls) the dry run is
exact whatever the routing; where sizes do (the eager loop over experts) it is the step of the
heaviest routing (:func:`~lightning_seqmem.dryrun.moe.routing_assignment`): real steps forced to
route every other way measured below it, never above.
"""

from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch
from torch import nn

from conftest import make_trainer
from lightning_seqmem import Curriculum, SeqMemCallback
from lightning_seqmem.reference.demo import SyntheticTokenDataModule
from lightning_seqmem.dryrun import accelerator
from lightning_seqmem.dryrun import session as session_module
from lightning_seqmem.dryrun.moe import DryRunFakeMode, is_moe_block, routing_assignment
from lightning_seqmem.dryrun.result import DryRunUnsupported
from lightning_seqmem.dryrun.step import dry_run_step
from lightning_seqmem.measure.probes import make_probe
from lightning_seqmem.measure.steps import training_step_memory
from lightning_seqmem.mitigations.checkpointing.checkpointing import ActivationCheckpointing

transformers = pytest.importorskip("transformers")
from lightning_seqmem.reference.hf import HFCausalLM  # noqa: E402

CPU = torch.device("cpu")
VOCAB = 256
L0 = 16  # the batch given; the dry run tiles it to 4x
EXACT = 0.02  # of the measured step peak, where no size depends on the routing
BOUND_FACTOR = 1.10  # the heaviest routing's step over the measured one, at most
CHECKPOINTED_BOUND_FACTOR = 1.25  # the same, with activation checkpointing
EXPERTS = {  # 4 experts, top-2, each model's own MoE block
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
}
IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")  # transformers' experts on a CPU
BF16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731 - as a forward_context
pytestmark = pytest.mark.filterwarnings("ignore:.*eos_token_id.*")


class MoELM(nn.Module):
    """A tiny random-config Hugging Face MoE causal LM; ``training_step`` returns its own loss."""

    def __init__(self, model_type: str, experts: str, dtype: torch.dtype = torch.float32,
                 **config) -> None:
        super().__init__()
        torch.manual_seed(0)
        fields = {**dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, intermediate_size=128, vocab_size=VOCAB),
                  **EXPERTS[model_type], **config}
        hf_config = transformers.AutoConfig.for_model(model_type, **fields)
        self.model = transformers.AutoModelForCausalLM.from_config(
            hf_config, attn_implementation="sdpa", experts_implementation=experts, dtype=dtype)

    def training_step(self, batch, batch_idx):
        out = self.model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False)
        return out.loss


def _batch(seq_len: int, batch_size: int = 2) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, VOCAB, (batch_size, seq_len), generator=g),
            "labels": torch.randint(0, VOCAB, (batch_size, seq_len), generator=g)}


def _loss(model, batch):
    return model.training_step(batch, 0)


def _force_routing(module: nn.Module, routing) -> nn.Module:
    """Every router of ``module`` chooses ``routing(tokens, k, experts)``: written into its own
    top-k indices (the tensor the step keeps), from a copy made at the first (warm-up) step, so
    that forcing allocates nothing in the measured one."""
    made: dict = {}

    def hook(router, inputs, out):
        logits, _, indices = out
        key = (tuple(indices.shape), logits.shape[-1])
        if key not in made:
            made[key] = routing(*indices.shape, logits.shape[-1]).to(indices.device)
        indices.data.copy_(made[key])  # .data: autograd's saved indices keep their version

    for block in module.modules():
        if is_moe_block(block):
            block.gate.register_forward_hook(hook)
    return module


def _measured(module: nn.Module, batch: dict, autocast=None, routing=None):
    """The real step of a deep copy (its routers forced to ``routing``, if given): one warm-up step,
    then the measured one."""
    real = copy.deepcopy(module)
    if routing is not None:
        _force_routing(real, routing)
    optimizer = torch.optim.AdamW(real.parameters(), lr=1e-3)
    training_step_memory(real, optimizer, batch, _loss, context=autocast)
    probe = make_probe("tracker", CPU)
    return training_step_memory(real, optimizer, batch, _loss, probe, context=autocast)


def _dry(module: nn.Module, seq_len: int = 4 * L0, **kwargs):
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    return dry_run_step(module, optimizer, _batch(L0), seq_len=seq_len, **kwargs)


# -- the grouped matmul's fake kernel is the real op's shape, layout and dtype rules ---------------
LAYOUTS = {  # (mat_a, mat_b, offsets) by dtype: MoE's forward and both backward products
    "2d x 3d": lambda d: (torch.randn(10, 16).to(d), torch.randn(3, 16, 24).to(d), [3, 3, 10]),
    "2d x 3d^T, unaligned": lambda d: (torch.randn(10, 16).to(d),
                                       torch.randn(3, 6, 16).to(d).transpose(-2, -1), [3, 5, 10]),
    "2d^T x 2d": lambda d: (torch.randn(10, 16).to(d).t(), torch.randn(10, 24).to(d), [4, 10]),
    "3d x 3d": lambda d: (torch.randn(3, 8, 16, dtype=d), torch.randn(3, 16, 8, dtype=d), None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grouped_mm_fake_is_the_real_op(dtype, layout):
    a, b, offsets = LAYOUTS[layout](dtype)
    offs = None if offsets is None else torch.tensor(offsets, dtype=torch.int32)
    real = torch._grouped_mm(a, b, offs=offs)
    mode = DryRunFakeMode(allow_non_fake_inputs=True)
    with mode:
        fake = torch._grouped_mm(mode.from_tensor(a), mode.from_tensor(b), offs=offs)
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)
    assert fake.untyped_storage().nbytes() == real.untyped_storage().nbytes()


def test_grouped_mm_fake_refuses_what_the_real_op_refuses():
    offs = torch.tensor([3, 10], dtype=torch.int32)
    cases = {
        "float64": (torch.randn(10, 16).double(), torch.randn(2, 16, 8).double(), offs, None),
        "int64 offsets": (torch.randn(10, 16), torch.randn(2, 16, 8), offs.long(), None),
        "float32 out of bf16": (torch.randn(10, 16).bfloat16(), torch.randn(2, 16, 8).bfloat16(),
                                offs, torch.float32),
        "strides not 16-byte multiples": (torch.randn(10, 6), torch.randn(2, 6, 8), offs, None),
    }
    mode = DryRunFakeMode(allow_non_fake_inputs=True)
    for name, (a, b, o, out_dtype) in cases.items():
        with pytest.raises(RuntimeError):
            torch._grouped_mm(a, b, offs=o, out_dtype=out_dtype)
        with mode, pytest.raises(RuntimeError):
            torch._grouped_mm(mode.from_tensor(a), mode.from_tensor(b), offs=o, out_dtype=out_dtype)


# -- each model, experts implementation, fp32 and bf16: the dry run at 4x against a real step ------
@pytest.mark.parametrize("precision", ["fp32", "bf16 weights", "bf16 autocast"])
@pytest.mark.parametrize("experts", IMPLEMENTATIONS)
@pytest.mark.parametrize("model_type", list(EXPERTS))
def test_dry_run_at_4x_against_the_measured_step(model_type, experts, precision):
    dtype = torch.bfloat16 if precision == "bf16 weights" else torch.float32
    module = MoELM(model_type, experts, dtype)
    autocast = BF16 if precision == "bf16 autocast" else None
    dry = _dry(module, autocast=autocast)
    measured = _measured(module, _batch(4 * L0), autocast)
    ratio = dry.peak_bytes / measured.peak_bytes
    if experts == "eager":  # each expert's tensors sized by its tokens: the heaviest routing's step
        assert 1.0 <= ratio <= BOUND_FACTOR, (ratio, dry.detail)
        assert "routing modelled" in dry.detail and "an upper bound" in dry.detail
    else:  # T*k rows whatever the routing
        assert abs(ratio - 1) <= EXACT, (ratio, dry.detail)
        assert "routing modelled" in dry.detail and "exact for any routing" in dry.detail


@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
def test_a_checkpointed_step_asked_as_a_rung(experts):
    """Checkpointing recomputes each layer in the backward, its router too: routed again alike."""
    module = MoELM("mixtral", experts)
    dry = _dry(module, mitigations=["checkpointing"])
    real = copy.deepcopy(module)
    assert ActivationCheckpointing().apply(real).applied
    ratio = dry.peak_bytes / _measured(real, _batch(4 * L0)).peak_bytes
    if experts == "eager":  # without the saved activations, the heavy experts' tensors weigh more
        assert 1.0 <= ratio <= CHECKPOINTED_BOUND_FACTOR, (ratio, dry.detail)
    else:
        assert abs(ratio - 1) <= EXACT, (ratio, dry.detail)


# -- exact where the routing does not matter, the heaviest step where it does ----------------------
def _loads_routing(loads):
    """A routing that sends ``loads[e]`` tokens to expert ``e`` (each at most the token count)."""
    def routing(tokens, k, experts):
        ids = torch.cat([torch.full((n,), e) for e, n in enumerate(loads)])
        return ids.view(k, tokens).t().contiguous()  # column-major: no token twice to one expert

    return routing


def _routings(tokens: int, k: int, experts: int, random_ones: int = 6) -> dict:
    rng = random.Random(0)
    out = {
        "balanced": lambda t, k_, e: (torch.arange(t * k_) % e).view(t, k_),
        "collapsed on the first k": lambda t, k_, e: torch.arange(k_).repeat(t, 1),
        "collapsed on the last k": lambda t, k_, e: torch.arange(e - k_, e).repeat(t, 1),
        "heaviest, reversed": lambda t, k_, e: e - 1 - routing_assignment(t, k_, e),
    }
    while len(out) < 4 + random_ones:
        weights = [rng.random() ** rng.choice([1, 4]) for _ in range(experts)]
        loads = [int(tokens * k * w / sum(weights)) for w in weights]
        loads[rng.randrange(experts)] += tokens * k - sum(loads)
        if all(0 <= n <= tokens for n in loads):
            out[f"loads {loads}"] = _loads_routing(loads)
    return out


@pytest.mark.parametrize("model_type, experts, k", [("mixtral", 4, 2), ("olmoe", 6, 3),
                                                    ("mixtral", 4, 1)])
def test_eager_experts_the_dry_run_is_the_heaviest_routing_and_every_other_is_below(model_type,
                                                                                   experts, k):
    count = "num_local_experts" if model_type == "mixtral" else "num_experts"
    sizes = {count: experts, "num_experts_per_tok": k}
    module = MoELM(model_type, "eager", num_hidden_layers=1, **sizes)
    dry = _dry(module, seq_len=L0)
    heaviest = _measured(module, _batch(L0), routing=routing_assignment)
    assert dry.peak_bytes == heaviest.peak_bytes, (dry.phase_peak_bytes, heaviest.phase_peak_bytes)
    assert dry.phase_peak_bytes == heaviest.phase_peak_bytes
    routings = {"the model's own": None, **_routings(2 * L0, k, experts, random_ones=4)}
    for name, routing in routings.items():
        other = _measured(module, _batch(L0), routing=routing)
        assert other.peak_bytes <= dry.peak_bytes, (name, other.phase_peak_bytes)
        assert other.phase_peak_bytes["backward"] <= dry.phase_peak_bytes["backward"], name


@pytest.mark.parametrize("experts", ["grouped_mm", "batched_mm"])
def test_grouped_and_batched_experts_are_exact_whatever_the_routing(experts):
    module = MoELM("mixtral", experts, num_hidden_layers=1)
    dry = _dry(module, seq_len=L0)
    routings = {"the model's own": None, **_routings(2 * L0, k=2, experts=4, random_ones=2)}
    for name, routing in routings.items():
        measured = _measured(module, _batch(L0), routing=routing)
        assert measured.phase_peak_bytes == dry.phase_peak_bytes, (name, measured.phase_peak_bytes)


# -- the simulated CUDA device ---------------------------------------------------------------------
@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
@pytest.mark.parametrize("model_type", list(EXPERTS))
def test_the_simulated_cuda_device_runs_moe_steps(model_type, experts):
    module = MoELM(model_type, experts, torch.bfloat16)
    cpu = _dry(module)
    cuda = _dry(module, device="cuda")
    assert "routing modelled" in cuda.detail and "512-byte blocks" in cuda.detail
    assert cuda.peak_bytes >= cpu.peak_bytes  # the same step's tensors, rounded up to 512 bytes
    if model_type == "mixtral":  # autocast on CUDA's op lists (its router casts with .float())
        device = accelerator.simulated_device()
        autocast = lambda: accelerator.autocast(device, torch.bfloat16)  # noqa: E731
        assert "routing modelled" in _dry(module, device="cuda", autocast=autocast).detail
        # checkpointing: the recomputation runs on the autograd engine's device thread, routed alike
        checkpointed = _dry(module, device="cuda", mitigations=["checkpointing"])
        assert "routing modelled" in checkpointed.detail
        assert checkpointed.peak_bytes < cuda.peak_bytes


# -- the real module is left as it was ------------------------------------------------------------
def _global_hooks() -> tuple:
    module_hooks = nn.modules.module
    return dict(module_hooks._global_forward_pre_hooks), dict(module_hooks._global_forward_hooks)


def test_the_real_module_its_parameters_and_the_rng_are_untouched():
    module = MoELM("mixtral", "eager", router_jitter_noise=0.1)  # the router draws random numbers
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    hooks = _global_hooks()
    rng = torch.get_rng_state()
    dry = dry_run_step(module, optimizer, _batch(L0), seq_len=4 * L0)
    assert "routing modelled" in dry.detail
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(p, params[n]) for n, p in module.named_parameters())
    assert all(p.grad is None for p in module.parameters()) and not optimizer.state
    assert _global_hooks() == hooks
    assert module.model.config._experts_implementation == "eager"
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


# -- refusals stay honest -------------------------------------------------------------------------
class _Block(nn.Module):
    """Top-2 of 4 experts, then the tokens that chose expert 0 (``nonzero``: a shape by value)."""

    def __init__(self, moe: bool) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.experts = nn.Linear(8, 8) if moe else None  # an MoE block holds its experts

    def forward(self, h):
        chosen = self.gate(h).topk(2).indices
        rows = (chosen == 0).any(-1).nonzero().squeeze(-1)
        return (self.experts or nn.Identity())(h[rows])


class _Router(nn.Module):
    def __init__(self, moe: bool) -> None:
        super().__init__()
        self.emb, self.block = nn.Embedding(VOCAB, 8), _Block(moe)

    def training_step(self, batch, batch_idx):
        return self.block(self.emb(batch["input_ids"]).flatten(0, 1)).sum()


def test_routing_is_modelled_inside_moe_blocks_only():
    outside = _Router(moe=False)
    with pytest.raises(DryRunUnsupported, match="nonzero"):
        _dry(outside)
    inside = _Router(moe=True)
    dry = _dry(inside)
    assert "sizes depended on it (nonzero)" in dry.detail


def test_an_op_the_real_step_refuses_is_refused_with_its_reason():
    class Float64GroupedMM(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(2, 16, 16, dtype=torch.float64))

        def training_step(self, batch, batch_idx):
            x = torch.ones(batch["input_ids"].numel(), 16, dtype=torch.float64)
            offs = torch.tensor([1, x.shape[0]], dtype=torch.int32)
            return torch._grouped_mm(x, self.w, offs=offs).sum()

    module = Float64GroupedMM()
    with pytest.raises(RuntimeError, match="Float32, BFloat16 or Float16"):
        module.training_step(_batch(L0), 0)
    with pytest.raises(DryRunUnsupported, match="Float32, BFloat16 or Float16"):
        _dry(module)


def test_routing_values_beyond_the_size_kept_refuse_the_eager_loop_not_grouped_matmuls(monkeypatch):
    # twins of 4 KiB at most: the batch's and the [T, k] routing's (2 KiB), not the eager loop's
    # [T, k, E+1] one_hot of it (10 KiB)
    monkeypatch.setattr(session_module, "value_max_bytes", lambda seq_len: 4096)
    with pytest.raises(DryRunUnsupported, match="nonzero"):
        _dry(MoELM("mixtral", "eager", num_hidden_layers=1))
    module = MoELM("mixtral", "grouped_mm", num_hidden_layers=1)
    dry = _dry(module)  # needs no routing values
    assert dry.peak_bytes == _measured(module, _batch(4 * L0)).peak_bytes


# -- the callback's curriculum judges an MoE model by dry run --------------------------------------
def test_the_callback_forecasts_an_moe_model_by_dry_run():
    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
                  **EXPERTS["mixtral"])
    module = HFCausalLM(model_type="mixtral", config=config, attn_implementation="sdpa")
    curriculum = Curriculum(start=16, target=64, steps_per_stage=2, multiple_of=16)
    cb = SeqMemCallback(dry_run=True, warmup_steps=1, curriculum=curriculum)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = SyntheticTokenDataModule(batch_size=2, seq_len=64, num_samples=32)
        make_trainer([cb], max_steps=6).fit(module, data)
    assert not [w for w in caught if "the dry run cannot simulate" in str(w.message)]
    forecast = cb.forecast(256)
    assert forecast.method == "dry_run", forecast
