"""The GPU's kernels on a CPU (issue 29): a dry run on the simulated CUDA device counts what the
CUDA kernels the run will use allocate, modelled from their sources
(:mod:`lightning_seqmem.dryrun.kernels`).

Every expected figure here is computed in the test from the shapes, by the formulas of the kernels'
sources (flash-attn's ``flash_api.cpp``, PyTorch's ``attention_backward.cu`` and
``kernel_backward.h``, the libraries' Python), and each buffer is rounded to the CUDA allocator's
512-byte blocks.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_seqmem.dryrun.accelerator import SIMULATED, simulated_device, stands_for
from lightning_seqmem.dryrun.cuda import cuda_kernel_scratch_bytes
from lightning_seqmem.dryrun.kernels_loss import cce_loss, liger_loss
from lightning_seqmem.dryrun.kernels_flash import flash_attn_3_func, flash_attn_func
from lightning_seqmem.dryrun.kernels import modelled_kernels
from lightning_seqmem.dryrun.kernels_scratch import recording
from lightning_seqmem.dryrun.kernels_sdpa import sdpa_backend
from lightning_seqmem.dryrun.kernels_loss import liger_chunks
from lightning_seqmem.dryrun.result import DryRunUnsupported
from lightning_seqmem.dryrun.step import dry_run_step
from lightning_seqmem.measure.probes import round_cuda_block_bytes as blocks
from lightning_seqmem.measure.tracker import LiveTensorTracker
from lightning_seqmem.mitigations.attention.attention import (
    AttentionSwitch, current_attention_backend)
from lightning_seqmem.plan.pricing import prior_factor

BF16 = torch.bfloat16
VOCAB = 512


def _r(x: int, m: int) -> int:
    return -(-x // m) * m


class _Traced:
    """Live bytes of fake tensors on the simulated device in the CUDA allocator's 512-byte blocks
    (the tracker's events replayed, each allocation rounded): what the forward leaves alive, and the
    backward's peak above what was live when it began (the kernels' scratch counted by the dry run's
    hook)."""

    def __init__(self, existing: list[torch.Tensor]) -> None:
        self.tracker = LiveTensorTracker(SIMULATED, record_events=True)
        self.tracker.scratch = cuda_kernel_scratch_bytes
        self.tracker.track_existing(existing)

    def _live(self, upto: int) -> list[int]:
        """Rounded live bytes after each of the first ``upto`` events."""
        events, live, out = self.tracker.events, 0, []
        for entry in events.sequence[:upto]:
            live += blocks(events.sizes[entry if entry >= 0 else ~entry]) * (
                1 if entry >= 0 else -1
            )
            out.append(live)
        return out

    def run(self, forward, grad: torch.Tensor, saved=lambda node: None):
        """Run ``forward``, read ``saved(out.grad_fn)`` (what autograd saved: ``self.saved``),
        backward."""
        sequence = self.tracker.events.sequence
        start = len(sequence)
        with recording() as self.kernels, self.tracker:
            out = forward()
            forward_end = len(sequence)
            self.saved = saved(out.grad_fn)
            out.backward(grad)
        live = self._live(len(sequence))
        before = live[forward_end - 1]
        self.forward_bytes = before - live[start - 1]
        self.backward_bytes = max(live[forward_end - 1 :]) - before
        self.tracker.stop()
        return out


def _qkv(b: int, length: int, heads: int, heads_k: int, head: int, dtype=BF16, layout="blhd"):
    """Fake q, k, v (and a gradient for the output) on the simulated device, in flash layout ``[B,
    L, H, D]``; ``layout="bhld"``: the same memory seen as SDPA's ``[B, H, L, D]``."""
    device = simulated_device()
    q = torch.empty(b, length, heads, head, device=device, dtype=dtype, requires_grad=True)
    k = torch.empty(b, length, heads_k, head, device=device, dtype=dtype, requires_grad=True)
    v = torch.empty(b, length, heads_k, head, device=device, dtype=dtype, requires_grad=True)
    grad = torch.empty(b, length, heads, head, device=device, dtype=dtype)
    if layout == "bhld":
        return tuple(x.transpose(1, 2) for x in (q, k, v, grad)) + ((q, k, v, grad),)
    return q, k, v, grad, (q, k, v, grad)


def _fa2_backward_bytes(b, length, heads, heads_k, head, size=2) -> int:
    """dq, dk, dv and what ``mha_bwd`` allocates (flash_api.cpp): softmax_d fp32 [B, H,
    round128(Lq)], dq_accum fp32 [B, round128(Lq), H, round(D, 32)], dk/dv_expanded [B, Lk, H, D]
    for GQA."""
    lq, d_rounded = _r(length, 128), _r(head, 32 if head <= 128 else 64)
    grads = blocks(b * length * heads * head * size) + 2 * blocks(
        b * length * heads_k * head * size
    )
    scratch = blocks(b * heads * lq * 4) + blocks(b * lq * heads * d_rounded * 4)
    if heads_k != heads:
        scratch += 2 * blocks(b * length * heads * head * size)
    return grads + scratch


def test_modelled_flash_attn_2_saves_out_and_lse_and_its_backward_holds_mha_bwd_buffers():
    """flash-attn 2's forward saves q, k, v and exactly out + softmax_lse (+ its 16-byte rng_state);
    its backward holds dq, dk, dv, softmax_d, dq_accum and, with grouped-query heads, the expanded
    dk/dv.
    """
    b, length, heads, heads_k, head = 2, 1000, 4, 2, 80
    with FakeTensorMode():
        q, k, v, grad, existing = _qkv(b, length, heads, heads_k, head)
        traced = _Traced(list(existing))
        traced.run(
            lambda: flash_attn_func(q, k, v, causal=True), grad, lambda node: node.saved_tensors
        )
        saved = traced.saved
    assert [x.untyped_storage()._cdata for x in saved[:3]] == [
        x.untyped_storage()._cdata for x in (q, k, v)
    ]
    assert [(tuple(x.shape), x.dtype) for x in saved[3:]] == [
        ((b, length, heads, head), BF16),
        ((b, heads, length), torch.float32),
        ((2,), torch.int64),
    ]
    out_bytes, lse_bytes, rng_bytes = (
        blocks(b * length * heads * head * 2),
        blocks(b * heads * length * 4),
        blocks(16),
    )
    assert traced.forward_bytes == out_bytes + lse_bytes + rng_bytes
    assert traced.backward_bytes == _fa2_backward_bytes(b, length, heads, heads_k, head)
    assert traced.kernels == ["flash-attn 2 (modelled: mha_fwd/mha_bwd allocations)"]



@pytest.mark.parametrize("torch_deterministic", [False, True], ids=["torch-free", "torch-strict"])
def test_flash_attn_2s_deterministic_split_follows_its_own_argument(torch_deterministic):
    """flash-attn 2's ``mha_bwd`` gives dq_accum a leading ``nsplits`` dimension when *its*
    ``deterministic`` argument is set (flash_api.cpp; transformers passes it from
    ``FLASH_ATTENTION_DETERMINISTIC``), whatever ``torch.use_deterministic_algorithms`` says: the
    modelled backward read PyTorch's setting instead."""
    b, length, heads, head = 1, 1000, 4, 64
    lq = _r(length, 128)
    split = (-(-132 // (b * heads)) - 1) * blocks(b * lq * heads * head * 4)  # H100: 132 SMs
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(torch_deterministic)
    try:
        backward = {}
        for deterministic in (False, True):
            with FakeTensorMode():
                q, k, v, grad, existing = _qkv(b, length, heads, heads, head)
                traced = _Traced(list(existing))
                traced.run(lambda: flash_attn_func(q, k, v, deterministic=deterministic), grad,
                           lambda node: node.saved_tensors)
            backward[deterministic] = traced.backward_bytes
    finally:
        torch.use_deterministic_algorithms(before)
    assert backward[False] == _fa2_backward_bytes(b, length, heads, heads, head)
    assert backward[True] == backward[False] + split


def test_sdpa_in_bf16_on_the_simulated_device_is_the_modelled_flash_kernel():
    """bf16 SDPA (causal, grouped-query heads) runs PyTorch's flash op: the same outputs and saved
    bytes as flash-attn 2, whose ``rng_state`` PyTorch's ``mha_fwd`` keeps too, with an ``_unused``
    uint64 scalar as the philox offset (one more block), and the same backward buffers, counted by
    the scratch hook.
    """
    b, length, heads, heads_k, head = 2, 1000, 4, 2, 80
    with FakeTensorMode():
        q, k, v, grad, existing = _qkv(b, length, heads, heads_k, head, layout="bhld")
        assert sdpa_backend(q, k, v, is_causal=True, enable_gqa=True)[0] == "flash"
        sdpa = _Traced(list(existing))
        sdpa.run(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            grad,
            lambda node: type(node).__name__,
        )
        assert sdpa.saved == "ScaledDotProductFlashAttentionBackward0"
        fq, fk, fv, fgrad, existing = _qkv(b, length, heads, heads_k, head)
        flash = _Traced(list(existing))
        flash.run(lambda: flash_attn_func(fq, fk, fv, causal=True), fgrad)
    assert sdpa.forward_bytes == flash.forward_bytes + blocks(8)
    assert (
        sdpa.backward_bytes
        == flash.backward_bytes
        == _fa2_backward_bytes(b, length, heads, heads_k, head)
    )
    assert sdpa.kernels == ["SDPA flash (PyTorch CUDA dispatch on H100/H200 (sm90))"]


def test_fp32_sdpa_goes_memory_efficient_with_its_logsumexp_delta_and_workspace():
    """fp32 runs the memory-efficient kernel: it saves out and a logsumexp padded to 32 queries (and
    its seed and offset scalars, which CUDA keeps in host memory and the fake kernel on the device);
    its backward holds the gradients and the larger of its fp32 delta computation (``grad_out *
    out`` in float32, summed) and ``delta`` + the grad-Q workspace of kernel 64x64 (head dim 64,
    kernel_backward.h: per query block and column block an [I x J] fp32 tile and 16 bytes)."""
    b, length, heads, head = 1, 1000, 4, 64
    with FakeTensorMode():
        q, k, v, grad, existing = _qkv(b, length, heads, heads, head, torch.float32, layout="bhld")
        assert sdpa_backend(q, k, v)[0] == "efficient"
        traced = _Traced(list(existing))
        traced.run(
            lambda: F.scaled_dot_product_attention(q, k, v),
            grad,
            lambda node: (type(node).__name__, node._saved_log_sumexp),
        )
        name, lse = traced.saved
    assert name == "ScaledDotProductEfficientAttentionBackward0"
    assert tuple(lse.shape) == (b, heads, _r(length, 32)) and lse.dtype == torch.float32
    seed_and_offset = 2 * blocks(8)
    assert traced.forward_bytes == (
        blocks(b * length * heads * head * 4)
        + blocks(b * heads * _r(length, 32) * 4)
        + seed_and_offset
    )
    block_i = block_j = 64
    grad_q_tiles = -(-length // block_i) * -(-head // block_j) * (16 + 4 * block_i * block_j) // 4
    workspace = blocks(b * heads * _r(grad_q_tiles, 4) * 4)
    product, summed, delta = (
        blocks(b * length * heads * head * 4),
        blocks(b * length * heads * 4),
        blocks(b * heads * length * 4),
    )
    grads = 3 * blocks(b * length * heads * head * 4)
    assert traced.backward_bytes == grads + max(product + summed, summed + delta, delta + workspace)


def test_an_explicit_mask_goes_memory_efficient_or_math_as_cuda_would():
    """With a boolean mask, bf16 SDPA runs memory-efficient (flash takes no mask): the mask becomes
    an additive bf16 one expanded to [B, H, L, S] and padded to 16 keys (saved for backward); with
    grouped-query heads as well (``enable_gqa``) only math runs, with its [B, H, L, L] scores."""
    b, length, heads, head = 1, 1000, 4, 64
    device = simulated_device()
    with FakeTensorMode():
        q, k, v, grad, existing = _qkv(b, length, heads, heads, head, layout="bhld")
        mask = torch.ones(length, length, device=device, dtype=torch.bool).tril()
        backend, why = sdpa_backend(q, k, v, attn_mask=mask)
        assert (backend, why) == ("efficient", "flash: an explicit attn_mask")
        traced = _Traced(list(existing) + [mask])
        traced.run(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), grad)
        assert traced.forward_bytes == (
            blocks(b * length * heads * head * 2)
            + blocks(b * heads * _r(length, 32) * 4)
            + blocks(b * heads * length * _r(length, 16) * 2)
            + 2 * blocks(8)
        )

        gq, gk, gv, ggrad, existing = _qkv(b, length, heads, heads // 2, head, layout="bhld")
        backend, why = sdpa_backend(gq, gk, gv, attn_mask=mask, enable_gqa=True)
        assert backend == "math" and "GQA runs on flash and math only" in why, why
        math_path = _Traced(list(existing) + [mask])
        math_path.run(
            lambda: F.scaled_dot_product_attention(gq, gk, gv, attn_mask=mask, enable_gqa=True),
            ggrad,
        )
        assert math_path.forward_bytes > b * heads * length * length * 2
        assert math_path.kernels == ["SDPA math (PyTorch CUDA dispatch on H100/H200 (sm90))"]

        odd, _, _, _, _ = _qkv(b, length, heads, heads, 36, layout="bhld")
        assert (
            sdpa_backend(odd, odd, odd, is_causal=True)[0] == "flash"
        )  # padded to 40 by attention.cpp
        node = F.scaled_dot_product_attention(odd, odd, odd, is_causal=True).grad_fn
        while not hasattr(node, "_saved_output"):  # past the slice back to the head dim of 36
            node = node.next_functions[0][0]
        assert node._saved_output.shape[-1] == 40
        with sdpa_kernel([SDPBackend.MATH]):
            assert sdpa_backend(q, k, v, is_causal=True) == (
                "math",
                "flash: disabled (sdpa_kernel); " "efficient: disabled (sdpa_kernel)",
            )


def test_on_the_cpu_sdpa_is_untouched():
    """Fake CPU tensors run the CPU's own SDPA kernel: no model, nothing recorded."""
    with FakeTensorMode(), recording() as seen:
        q = torch.empty(1, 2, 64, 16, requires_grad=True)
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert (
        type(out.grad_fn).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0" and seen == []
    )


class _Llama(nn.Module):
    """A random-config Hugging Face Llama (grouped-query heads, bf16; no download) training on its
    own loss."""

    def __init__(self, attn_implementation: str, vocab_size: int = VOCAB, dtype=BF16) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=vocab_size,
        )
        self.model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation=attn_implementation, dtype=dtype
        )

    def training_step(self, batch, batch_idx):
        return self.model(
            input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False
        ).loss


def _batch(rows: int = 1, length: int = 16) -> dict:
    ids = torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _dry(module: nn.Module, seq_len: int, mitigations=(), device="cuda"):
    return dry_run_step(
        module,
        torch.optim.AdamW(module.parameters(), lr=1e-3),
        _batch(),
        seq_len,
        mitigations=mitigations,
        device=device,
    )


def test_hf_llama_with_flash_attention_2_builds_and_dry_runs_with_no_quadratic_term():
    """``attn_implementation="flash_attention_2"`` cannot be built here without the context; under
    it the model gets the modelled kernel, reads as flash, and dry-runs on the simulated device:
    doubling the length doubles what the step adds (eager attention, the control, quadruples it),
    and the result says flash-attn 2 was modelled."""
    with pytest.raises(ImportError, match="FlashAttention2"):
        _Llama("flash_attention_2")
    with modelled_kernels():
        module = _Llama("flash_attention_2")
    assert module.model.config._attn_implementation == "flash_attention_2_modelled"
    assert current_attention_backend(module.model) == "flash"
    peaks = [_dry(module, n).peak_bytes for n in (1024, 2048, 4096)]
    assert 1.9 <= (peaks[2] - peaks[1]) / (peaks[1] - peaks[0]) <= 2.1, peaks
    eager = [_dry(_Llama("eager"), n).peak_bytes for n in (1024, 2048, 4096)]
    assert (eager[2] - eager[1]) / (eager[1] - eager[0]) > 3.5, eager
    dry = _dry(module, 4096)
    assert dry.modelled_kernels == ("flash-attn 2 (modelled: mha_fwd/mha_bwd allocations)",)
    assert "kernels modelled for H100/H200 (sm90): flash-attn 2" in dry.detail
    assert (
        _dry(module, 4096, device="cpu").modelled_kernels == dry.modelled_kernels
    )  # fake CPU: the same kernel


def test_a_flash_config_in_float32_is_refused_as_flash_attn_refuses_it():
    """flash-attn runs float16 and bfloat16 only: the dry run of a float32 model asking for it says
    so, with the kernel's own message, where the real run would fail."""
    with modelled_kernels():
        module = _Llama("flash_attention_2", dtype=torch.float32)
    with pytest.raises(DryRunUnsupported, match="FlashAttention only support fp16 and bf16"):
        _dry(module, 256)


def test_the_attention_rung_switches_to_the_modelled_flash_on_the_simulated_device():
    """The rung's ``auto`` picks flash where it is modelled (a bf16 Hugging Face model on the
    simulated device) and switches a fake copy to it; a model of one's own with
    ``set_attention_backend`` gets sdpa there, which runs CUDA's flash kernel."""
    module = _Llama("eager")
    dry = _dry(module, 2048, ["attention"])
    assert (
        "attention eager -> flash" in dry.detail
        and current_attention_backend(module.model) == "eager"
    )
    assert dry.modelled_kernels == ("flash-attn 2 (modelled: mha_fwd/mha_bwd allocations)",)
    with modelled_kernels():
        flash = _Llama("flash_attention_2")
    assert dry.peak_bytes == _dry(flash, 2048).peak_bytes

    from lightning_seqmem.reference.nn import GPT, GPTConfig

    with FakeTensorMode(), torch.device(simulated_device()):
        gpt = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2))
        assert AttentionSwitch("auto").resolve_backend(gpt) == "sdpa"
        assert "for Hugging Face models only" in AttentionSwitch("flash").is_applicable(gpt)[1]


def test_flash_attention_3_builds_and_its_backward_holds_hopper_buffers():
    """flash-attn 3 builds under the context and dry-runs; its backward (hopper/flash_api.cpp, sm90,
    head dim 128, causal: kBlockM 64, kBlockN 128) holds softmax_d and softmax_lse_log2 fp32 [B, H,
    round(Lq, 64)], dq_accum fp32 [B, H, round(Lq, 64) * 128], dq_semaphore int32 and, for
    grouped-query heads, fp32 dk_accum and dv_accum [B, Hk, round(Lk, 128) * 128]."""
    with modelled_kernels():
        module = _Llama("flash_attention_3")
    assert _dry(module, 1024).modelled_kernels == (
        "flash-attn 3 (modelled: hopper mha_fwd/mha_bwd allocations)",
    )
    b, length, heads, heads_k, head = 1, 1000, 4, 2, 128
    with FakeTensorMode():
        q, k, v, grad, existing = _qkv(b, length, heads, heads_k, head)
        traced = _Traced(list(existing))
        traced.run(lambda: flash_attn_3_func(q, k, v, causal=True), grad)
    assert traced.forward_bytes == blocks(b * length * heads * head * 2) + blocks(
        b * heads * length * 4
    )
    lq, lk = _r(length, 64), _r(length, 128)
    grads = blocks(b * length * heads * head * 2) + 2 * blocks(b * length * heads_k * head * 2)
    scratch = (
        2 * blocks(b * heads * lq * 4)
        + blocks(b * heads * lq * head * 4)
        + blocks(-(-length // 64) * b * heads * 4)
        + 2 * blocks(b * heads_k * lk * head * 4)
    )
    assert traced.backward_bytes == grads + scratch


def test_fused_loss_on_the_simulated_device_runs_the_modelled_cce_and_says_so():
    """The rung's ``auto`` on CUDA is Cut Cross-Entropy: on the simulated device it runs modelled,
    the logits never materialise, and the result says so."""
    module = _Llama("sdpa", vocab_size=8192)
    plain, fused = _dry(module, 4096), _dry(module, 4096, ["fused_loss"])
    assert "loss plain -> cce (Apple Cut Cross-Entropy, modelled" in fused.detail
    assert any(k.startswith("Cut Cross-Entropy") for k in fused.modelled_kernels)
    logits = 4096 * 8192 * 4  # one fp32 copy of the logits
    assert plain.peak_bytes - fused.peak_bytes > 2 * logits, (plain.peak_bytes, fused.peak_bytes)


def test_cce_and_liger_allocate_and_save_what_their_sources_do():
    """CCE saves lse fp32 [N], the int32 indices of the counted tokens [N] and logit_avg fp32 [V]
    (with e, c and the targets), and never allocates an [N, V] block; its backward holds de, dc, the
    sorted vocabulary and lock arrays. Liger saves grad_input [N, d] and grad_weight [V, d] computed
    in forward, chunk by chunk ([chunk, V] logits, torch.mm(...).float() of the weight gradient)."""
    n, d, vocab = 8192, 64, 4096
    device = simulated_device()
    for fn in (cce_loss, liger_loss):
        with FakeTensorMode():
            h = torch.empty(n, d, device=device, dtype=BF16, requires_grad=True)
            w = torch.empty(vocab, d, device=device, dtype=BF16, requires_grad=True)
            y = torch.zeros(n, dtype=torch.long, device=device)
            traced = _Traced([h, w, y])
            traced.run(
                lambda: fn(h, w, y, -100),
                torch.ones((), device=device),
                lambda node: [
                    (tuple(t.shape), t.dtype) for t in node.saved_tensors if t is not None
                ],
            )
            saved = traced.saved
        largest = max(traced.tracker.events.sizes)
        scalar = blocks(4)
        if fn is cce_loss:
            assert saved == [
                ((n, d), BF16),
                ((vocab, d), BF16),
                ((n,), torch.float32),
                ((n,), torch.long),
                ((n,), torch.int32),
                ((vocab,), torch.float32),
            ]
            assert (
                traced.forward_bytes == blocks(4 * n) + blocks(4 * n) + blocks(4 * vocab) + scalar
            )
            assert largest < n * vocab * 2
            locks = blocks(4 * -(-n // 128) * -(-d // 64)) + blocks(
                4 * -(-vocab // 128) * -(-d // 64)
            )
            assert (
                traced.backward_bytes
                == blocks(n * d * 2) + blocks(vocab * d * 2) + blocks(4 * vocab) + locks
            )
        else:
            chunk, chunks = liger_chunks(n, d, vocab)
            assert (chunk, chunks) == (
                2 ** math.ceil(math.log2(n / math.ceil(vocab / d))),
                n // chunk,
            )
            assert saved == [((n, d), BF16), ((vocab, d), BF16)]
            assert traced.forward_bytes == blocks(n * d * 2) + blocks(vocab * d * 2) + scalar
            sizes = traced.tracker.events.sizes
            assert (
                sizes.count(blocks(chunk * vocab * 2)) >= chunks and blocks(vocab * d * 4) in sizes
            )
            assert largest < n * vocab * 2


def test_a_plan_of_the_simulated_device_is_priced_with_cuda_priors():
    """Step-time priors depend on the device (fused_loss costs more on a CPU): a dry run on the
    simulated device answers for CUDA, and is priced so."""
    setting = ("checkpointing", "fused_loss")
    assert stands_for(simulated_device()) == "cuda"
    assert prior_factor(setting, stands_for(simulated_device())) == prior_factor(setting, "cuda")
    assert prior_factor(setting, "cuda") < prior_factor(setting, "cpu")


def test_the_context_is_reentrant_and_restores_transformers():
    def current():
        return transformers.PreTrainedModel.__dict__["_check_and_adjust_attn_implementation"]

    original = current()
    with modelled_kernels():
        adjusted = current()
        with modelled_kernels():
            assert current() is adjusted is not original
        assert current() is adjusted
    assert current() is original
