"""Attention-kernel switch and activation checkpointing on real models, with measured memory.

Peaks are live tensor bytes of one forward+backward, measured by
``torch.distributed._tools.mem_tracker.MemTracker`` (exact on CPU, unlike process RSS).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.nn.attention import SDPBackend

from lightning_seqmem.mitigations.checkpointing.checkpointing import (
    ActivationCheckpointing, find_repeated_blocks, is_checkpointed)
from lightning_seqmem.mitigations.attention.attention import (
    AttentionSwitch, current_attention_backend, find_attention_targets, sdpa_kernel_context)
from lightning_seqmem.mitigations.base import MitigationResult
from lightning_seqmem.reference.nn import GPT, Block, CausalSelfAttention, GPTConfig

VOCAB = 64
CPU = torch.device("cpu")


def _gpt(n_layer: int = 4, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, n_layer=n_layer, n_head=4, d_model=64))  # no dropout


def _ids(length: int, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _gpt_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _hf_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def _step(model: nn.Module, ids: torch.Tensor,
          loss_fn=_gpt_loss) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward+backward from zero grads; returns the loss and a copy of the grads by state_dict
    key."""
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, ids)
    loss.backward()
    names = {id(t): key for key, t in model.state_dict(keep_vars=True).items()}
    return loss.detach(), {names[id(p)]: p.grad.clone() for p in model.parameters()}


def _peak_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor,
                loss_fn=_gpt_loss) -> int:
    """Peak live bytes of one forward+backward, grads of the previous step freed first."""
    model.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        loss_fn(model, ids).backward()
    model.zero_grad(set_to_none=True)
    return tracker.get_tracker_snapshot("peak")[CPU]["Total"]


def _assert_same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                       atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=1e-4, msg=key)


# --- attention switch -------------------------------------------------------------------------


def test_attention_switch_gpt_same_outputs_and_grads_less_memory():
    model = _gpt()
    optimizer = torch.optim.AdamW(model.parameters())
    params = list(model.parameters())
    keys = list(model.state_dict())
    ids = _ids(512)
    eager_loss, eager_grads = _step(model, ids)
    eager_peak = _peak_bytes(model, optimizer, ids)

    switch = AttentionSwitch()  # auto: sdpa on CPU
    assert switch.resolve_backend(model) == "sdpa"
    assert switch.is_applicable(model) == (True, "eager -> sdpa")
    result = switch.apply(model)

    assert result == MitigationResult("attention", True, "attention eager -> sdpa on <root>",
                                      "eager", "sdpa")
    assert current_attention_backend(model) == "sdpa"
    assert all(m.attention_backend == "sdpa" for m in model.modules()
               if isinstance(m, CausalSelfAttention))
    sdpa_loss, sdpa_grads = _step(model, ids)
    torch.testing.assert_close(sdpa_loss, eager_loss, atol=1e-5, rtol=1e-5)
    _assert_same_grads(eager_grads, sdpa_grads, atol=1e-5)
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    assert list(model.state_dict()) == keys
    sdpa_peak = _peak_bytes(model, optimizer, ids)
    # measured: 63.5 MiB -> 18.3 MiB (4 layers, d=64, batch 2, L=512): the B*H*L*L buffers are gone
    assert sdpa_peak < 0.5 * eager_peak, (eager_peak, sdpa_peak)

    again = switch.apply(model)
    assert (not again.applied and again.detail == "already on sdpa"
            and again.before == again.after == "sdpa")


def test_attention_switch_reasons_when_not_applicable():
    assert AttentionSwitch("sdpa").is_applicable(nn.Sequential(nn.Linear(4, 4))) == (
        False,
        "no attention module implements set_attention_backend and the model is not a Hugging Face "
        "PreTrainedModel",
    )
    result = AttentionSwitch().apply(nn.Linear(4, 4))
    assert not result.applied and result.before == result.after == "unknown"

    model = _gpt(n_layer=1)
    if not torch.cuda.is_available():
        applicable, reason = AttentionSwitch("flash").is_applicable(model)
        assert not applicable
        assert reason in ("flash-attn not installed", "CUDA not available")
        assert AttentionSwitch("auto").resolve_backend(model) == "sdpa"  # never flash on CPU
        assert AttentionSwitch("flash").apply(model).after == "eager"  # untouched


def test_find_attention_targets_top_down_and_inside_lightning_module():
    lightning = pytest.importorskip("lightning")

    class LitGPT(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _gpt(n_layer=2)

    lit = LitGPT()
    assert [(name, type(m).__name__) for name,
            m in find_attention_targets(lit)] == [("model", "GPT")]

    # bare attention modules (no GPT around them) are found one by one; a shared one once
    attn = CausalSelfAttention(GPTConfig(d_model=32, n_head=2))
    block = Block(GPTConfig(d_model=32, n_head=2))
    tree = nn.ModuleDict({"a": attn, "b": nn.Sequential(nn.Linear(32, 32), attn), "c": block})
    assert [name for name, _ in find_attention_targets(tree)] == ["a", "c.attn"]
    assert current_attention_backend(tree) == "eager"
    tree["c"].attn.set_attention_backend("sdpa")
    assert current_attention_backend(tree) == "mixed"
    assert AttentionSwitch("sdpa", sdpa_backends=[SDPBackend.MATH]).apply(tree).after == "sdpa"
    assert (attn.sdpa_backends == [SDPBackend.MATH]
            and tree["c"].attn.sdpa_backends == [SDPBackend.MATH])

    result = AttentionSwitch("sdpa").apply(lit)
    assert result.applied and result.detail == "attention eager -> sdpa on model"
    assert lit.model.attention_backend == "sdpa"


def test_sdpa_kernel_context_restores_flags_after_exception():
    flags = (
        torch.backends.cuda.flash_sdp_enabled,
        torch.backends.cuda.mem_efficient_sdp_enabled,
        torch.backends.cuda.math_sdp_enabled,
        torch.backends.cuda.cudnn_sdp_enabled,
    )
    original = [f() for f in flags]
    torch.backends.cuda.enable_mem_efficient_sdp(False)  # a non-default starting state
    try:
        before = [f() for f in flags]
        with pytest.raises(RuntimeError, match="boom"), sdpa_kernel_context([SDPBackend.MATH]):
            assert [f() for f in flags] == [False, False, True, False]
            raise RuntimeError("boom")
        assert [f() for f in flags] == before

        # driven from two hooks, as a callback would
        context = sdpa_kernel_context([SDPBackend.MATH])
        context.__enter__()
        assert not torch.backends.cuda.flash_sdp_enabled()
        context.__exit__(None, None, None)
        assert [f() for f in flags] == before

        with sdpa_kernel_context(None):  # no-op
            assert [f() for f in flags] == before
    finally:
        torch.backends.cuda.enable_mem_efficient_sdp(original[1])


def test_value_errors_name_argument_value_and_accepted():
    accepted = r"\('auto', 'eager', 'sdpa', 'flash'\)"
    with pytest.raises(ValueError, match=rf"`backend` must be one of {accepted}, got 'xformers'"):
        AttentionSwitch("xformers")
    with pytest.raises(ValueError, match=r"`sdpa_backends` must be None or a non-empty sequence .* "
                                         r"got \['math'\]"):
        AttentionSwitch("sdpa", sdpa_backends=["math"])
    with pytest.raises(ValueError, match=r"`sdpa_backends` applies only to backend 'sdpa' or "
                                         r"'auto', got backend='eag"):
        AttentionSwitch("eager", sdpa_backends=[SDPBackend.MATH])
    with pytest.raises(ValueError, match="`sdpa_backends`"), sdpa_kernel_context([]):
        pass
    with pytest.raises(ValueError,
                       match=r"`block_class_names` must be None or a non-empty sequence"):
        ActivationCheckpointing(block_class_names=[])
    with pytest.raises(ValueError,
                       match=r"`block_class_names`=\['DecoderLayer'\] matches no module.*'Block'"):
        find_repeated_blocks(_gpt(n_layer=1), ["DecoderLayer"])
    with pytest.raises(ValueError, match="matches no module"):
        ActivationCheckpointing(["DecoderLayer"]).apply(_gpt(n_layer=1))


# --- activation checkpointing -----------------------------------------------------------------


def test_checkpointing_gpt_same_loss_grads_params_keys_and_less_memory():
    model = _gpt(n_layer=4)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # created before wrapping
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ids = _ids(512)
    # one step before wrapping, so the optimizer has state that must survive untouched
    for m, opt in ((model, optimizer), (reference, reference_optimizer)):
        _step(m, ids)
        opt.step()
    plain_peak = _peak_bytes(model, optimizer, ids)
    params = list(model.parameters())
    keys = list(model.state_dict())
    state_before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}

    policy = ActivationCheckpointing()
    assert policy.is_applicable(model) == (True, "wrap 4 x Block")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = policy.apply(model)
        ckpt_loss, ckpt_grads = _step(model, ids)
        ckpt_peak = _peak_bytes(model, optimizer, ids)
    assert not [w for w in caught if "use_reentrant" in str(w.message)], [
        str(w.message) for w in caught]

    assert result.applied and (result.before, result.after) == ("off", "on")
    assert is_checkpointed(model) and not is_checkpointed(reference)
    assert all(type(b).__name__ == "CheckpointWrapper" for b in model.blocks)
    ref_loss, ref_grads = _step(reference, ids)
    torch.testing.assert_close(ckpt_loss, ref_loss, atol=0, rtol=0)
    _assert_same_grads(ref_grads, ckpt_grads, atol=0)
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    assert list(model.state_dict()) == keys
    assert {id(p) for p in optimizer.state} == state_before.keys() == {id(p) for p in params}
    for p, s in optimizer.state.items():
        for k, v in s.items():
            torch.testing.assert_close(v, state_before[id(p)][k], atol=0, rtol=0)

    # checkpoints stay interchangeable with an unwrapped model, both ways
    reference.load_state_dict(model.state_dict())
    model.load_state_dict(reference.state_dict())

    # the optimizer built before wrapping still steps the same parameters
    for m, opt in ((model, optimizer), (reference, reference_optimizer)):
        _step(m, ids)
        opt.step()
    for (key, a), b in zip(model.state_dict().items(), reference.state_dict().values(),
                           strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=key)

    # measured: 65.1 MiB -> 29.1 MiB (eager attention, 4 layers, d=64, batch 2, L=512, AdamW state)
    assert ckpt_peak < 0.6 * plain_peak, (plain_peak, ckpt_peak)

    again = policy.apply(model)
    assert (again.applied, again.detail, again.after) == (False, "already checkpointed", "on")
    assert policy.is_applicable(model) == (False, "already checkpointed")
    assert sum(type(m).__name__ == "CheckpointWrapper" for m in model.modules()) == 4


def test_find_repeated_blocks_heuristics():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # not one class
            self.mixed = nn.ModuleList([nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.Tanh()])
            self.first = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
            self.second = nn.ModuleList([nn.ReLU() for _ in range(3)])  # a tie: the first wins
            self.short = nn.ModuleList([nn.Tanh() for _ in range(2)])

    net = Net()
    assert find_repeated_blocks(net) == list(net.first)
    assert find_repeated_blocks(net, ["ReLU", "Tanh"]) == [net.mixed[1], net.mixed[3],
                                                           *net.second, *net.short]
    model = _gpt(n_layer=2)
    # nested dropped
    assert find_repeated_blocks(model, ["Block", "CausalSelfAttention"]) == list(model.blocks)
    assert find_repeated_blocks(nn.Linear(2, 2)) == []
    assert ActivationCheckpointing().apply(nn.Linear(2, 2)).applied is False
    detail = ActivationCheckpointing(["Linear"]).apply(net).detail
    assert detail == "wrapped 5 x Linear with checkpoint_wrapper (non-reentrant)"


# --- Hugging Face -----------------------------------------------------------------------------


@pytest.fixture
def tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def test_hf_attention_switch_and_checkpointing(tiny_llama):
    model = tiny_llama
    optimizer = torch.optim.AdamW(model.parameters())
    params = list(model.parameters())
    keys = list(model.state_dict())
    ids = torch.randint(0, 128, (1, 512), generator=torch.Generator().manual_seed(2))

    assert [name for name, _ in find_attention_targets(model)] == [""]
    assert current_attention_backend(model) == "eager"
    assert find_repeated_blocks(model) == list(model.model.layers)
    assert [type(b).__name__ for b in find_repeated_blocks(model)] == ["LlamaDecoderLayer"] * 2

    eager_loss, eager_grads = _step(model, ids, _hf_loss)
    eager_peak = _peak_bytes(model, optimizer, ids, _hf_loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        switched = AttentionSwitch().apply(model)
        sdpa_loss, sdpa_grads = _step(model, ids, _hf_loss)
        sdpa_peak = _peak_bytes(model, optimizer, ids, _hf_loss)
        ckpt = ActivationCheckpointing().apply(model)
        ckpt_loss, ckpt_grads = _step(model, ids, _hf_loss)
        ckpt_peak = _peak_bytes(model, optimizer, ids, _hf_loss)
    noisy = [str(w.message) for w in caught if "reentrant" in str(w.message)
             or "checkpointing" in str(w.message)]
    # neither torch's use_reentrant warning nor transformers' deprecation of the old name
    assert not noisy, noisy

    assert (switched.applied, switched.before, switched.after) == (True, "eager", "sdpa")
    assert model.config._attn_implementation == "sdpa"
    assert ckpt.applied and ckpt.after == "on" and is_checkpointed(model)
    assert ActivationCheckpointing().is_applicable(model) == (False, "already checkpointed")
    torch.testing.assert_close(sdpa_loss, eager_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ckpt_loss, sdpa_loss, atol=1e-6, rtol=1e-6)
    _assert_same_grads(eager_grads, sdpa_grads, atol=1e-5)
    _assert_same_grads(sdpa_grads, ckpt_grads, atol=1e-6)
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    assert list(model.state_dict()) == keys
    # measured: 20.0 MiB eager -> 6.3 MiB sdpa -> 3.8 MiB sdpa + checkpointing (2 layers, L=512)
    assert sdpa_peak < 0.5 * eager_peak, (eager_peak, sdpa_peak)
    assert ckpt_peak < 0.8 * sdpa_peak, (sdpa_peak, ckpt_peak)


def test_hf_model_inside_a_wrapper_module(tiny_llama):
    other = nn.ModuleDict({"backbone": copy.deepcopy(tiny_llama)})
    wrapper = nn.ModuleDict({"backbone": tiny_llama, "head": nn.Linear(4, 4)})
    assert [name for name, _ in find_attention_targets(wrapper)] == ["backbone"]
    assert AttentionSwitch("sdpa").apply(wrapper).detail == "attention eager -> sdpa on backbone"
    assert find_repeated_blocks(wrapper) == list(tiny_llama.model.layers)
    result = ActivationCheckpointing().apply(wrapper)
    assert (result.applied and result.detail.startswith(
        "Hugging Face activation checkpointing on LlamaForCausalLM"))
    assert is_checkpointed(wrapper)
    # explicit class names take the wrapper path instead (the copy is still on eager attention)
    assert not is_checkpointed(other)
    keys = list(other.state_dict())
    detail = ActivationCheckpointing(["LlamaDecoderLayer"]).apply(other).detail
    assert detail.startswith("wrapped 2 x LlamaDecoderLayer")
    assert list(other.state_dict()) == keys
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(
        _hf_loss(other["backbone"], ids), _hf_loss(wrapper["backbone"], ids), atol=1e-5, rtol=1e-5
    )
