"""flash-attn 2 and 3 without the package: their memory on fake tensors, and transformers' way in.

A run with ``attn_implementation="flash_attention_2"`` (or ``"_3"``) cannot even be built without
flash-attn. The kernels are modelled from their sources (Dao-AILab/flash-attention
``flash_attn_interface.py`` and ``flash_api.cpp``, in ``csrc/flash_attn`` and ``hopper``):

* :func:`flash_attn_func` / :func:`flash_attn_varlen_func` (flash-attn 2) allocate what
  ``FlashAttnFunc`` and ``mha_fwd`` do (head dims padded to 8, ``out``, fp32 ``softmax_lse``,
  split-KV accumulators, ``rng_state``) and save what they save; the backward's ``dq, dk, dv``
  and ``mha_bwd``'s own buffers: :func:`.kernels_scratch.fa2_backward_scratch`;
* :func:`flash_attn_3_func` / :func:`flash_attn_3_varlen_func` (flash-attn 3, Hopper) likewise
  (:func:`.kernels_scratch.fa3_backward_scratch`);
* on fake tensors they refuse what the kernels refuse (dtypes other than fp16/bf16, head dims
  above 256), with their messages; on real tensors they compute attention in eager torch;
* :func:`hf_implementation` registers them with transformers as ``"flash_attention_2_modelled"``
  / ``"flash_attention_3_modelled"``, run through transformers' own flash glue (unpadding, packed
  sequences, sliding windows); :func:`mapped_flash_requests` maps a request for the real one.

Example:
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode():
    ...     q = torch.empty(1, 4096, 8, 128, dtype=torch.bfloat16, requires_grad=True)
    ...     out = flash_attn_func(q, q, q, causal=True)
    >>> out.shape, [tuple(t.shape) for t in out.grad_fn.saved_tensors[3:]]
    (torch.Size([1, 4096, 8, 128]), [(1, 4096, 8, 128), (1, 8, 4096), (2,)])
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from lightning_seqmem.dryrun.kernels_scratch import (fa2_backward_scratch, fa2_forward_scratch,
                                                     fa3_backward_scratch, note_kernel)

__all__ = ["HF_IMPLEMENTATIONS", "flash_attn_3_func", "flash_attn_3_varlen_func",
           "flash_attn_func", "flash_attn_varlen_func", "hf_implementation",
           "mapped_flash_requests"]

HF_IMPLEMENTATIONS = {2: "flash_attention_2_modelled", 3: "flash_attention_3_modelled"}
"""flash-attn version -> the name of its modelled Hugging Face attention implementation."""

_PACKAGES = {2: "flash_attn", 3: "flash_attn_interface"}


def _allocate_and_free(buffers: list, device: torch.device) -> None:
    """Allocate each ``(shape, dtype)`` buffer (a kernel's own, beside its outputs), free them."""
    held = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in buffers]
    del held


def _contiguous_last(x: torch.Tensor) -> torch.Tensor:
    """flash-attn's ``maybe_contiguous``: a copy only where the last dim is not contiguous."""
    return x.contiguous() if x.stride(-1) != 1 else x


class _ModelledFlash(torch.autograd.Function):
    """flash-attn's autograd function (version 2 or 3), modelled on fake tensors; ``varlen`` holds
    the sequence boundaries of a varlen call (their shapes give the batch) and the longest ones."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, version: int,
                causal: bool, dropout_p: float, window: tuple, softcap: float,
                deterministic: bool, varlen: Any) -> torch.Tensor:
        head_og = q.shape[-1]
        if version == 2 and head_og % 8:
            q, k, v = (F.pad(x, [0, 8 - head_og % 8]) for x in (q, k, v))
        q, k, v = (_contiguous_last(x) for x in (q, k, v))
        out = torch.empty_like(q)
        if varlen is None:
            b, lq, h, d = q.shape
            lse = torch.empty(b, h, lq, dtype=torch.float32, device=q.device)
            if version == 2:
                _allocate_and_free(fa2_forward_scratch(b, h, lq, k.shape[1], d, dropout_p),
                                   q.device)
        else:
            lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        saved = [q, k, v, out, lse]
        if version == 2:
            saved.append(torch.empty(2, dtype=torch.int64, device=q.device))  # rng_state
        ctx.save_for_backward(*saved)
        ctx.settings = (version, causal, window, softcap, deterministic, varlen, head_og)
        return out[..., :head_og] if out.shape[-1] != head_og else out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple:
        q, k, v = ctx.saved_tensors[:3]
        version, causal, window, softcap, deterministic, varlen, head_og = ctx.settings
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if dout.shape[-1] != q.shape[-1]:
            dout = F.pad(dout, [0, q.shape[-1] - dout.shape[-1]])
        dout = _contiguous_last(dout)
        _allocate_and_free(_backward_buffers(q, k, version, causal, window, softcap,
                                             deterministic, varlen), q.device)
        del dout
        grads = tuple(g[..., :head_og] if g.shape[-1] != head_og else g for g in (dq, dk, dv))
        return grads + (None,) * 7


def _backward_buffers(q: torch.Tensor, k: torch.Tensor, version: int, causal: bool,
                      window: tuple, softcap: float, deterministic: bool, varlen: Any) -> list:
    """The buffers ``mha_bwd`` (or ``mha_varlen_bwd``) of flash-attn ``version`` allocates beside
    dq, dk, dv (``deterministic``: the caller's flag, as flash-attn 2 reads it)."""
    local = (window[0] >= 0 or window[1] >= 0) and not causal
    if varlen is None:
        b, lq, h, d = q.shape
        lk, hk = k.shape[1], k.shape[2]
        if version == 2:
            return fa2_backward_scratch(b, h, hk, lq, lk, d, q.dtype, deterministic)
        return fa3_backward_scratch(b, h, hk, lq, lk, d, causal, local, softcap)
    cu_q, _, max_q, max_k = varlen
    b = cu_q.shape[0] - 1
    total_q, h, d = q.shape
    total_k, hk = k.shape[0], k.shape[1]
    if version == 3:
        return fa3_backward_scratch(b, h, hk, max_q, max_k, d, causal, local, softcap, total_q,
                                    total_k)
    return fa2_backward_scratch(b, h, hk, total_q, total_k, d, q.dtype, deterministic, packed=True)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
               window: tuple, softcap: float) -> torch.Tensor:
    """Eager-torch attention on ``[B, L, H, D]`` tensors with flash-attn's semantics (causal aligned
    to the bottom right, ``window`` (left, right) inclusive, ``softcap``): real tensors' values."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if kt.shape[1] != qt.shape[1]:
        kt, vt = (x.repeat_interleave(qt.shape[1] // x.shape[1], dim=1) for x in (kt, vt))
    scores = (qt.float() @ kt.float().transpose(-2, -1)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    lq, lk = scores.shape[-2], scores.shape[-1]
    i = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
    j = torch.arange(lk, device=q.device)[None, :]
    keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    right = 0 if causal else window[1]
    if right >= 0:
        keep &= j <= i + right
    if window[0] >= 0:
        keep &= j >= i - window[0]
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1).nan_to_num(0.0)
    return (probs @ vt.float()).to(q.dtype).transpose(1, 2)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, version: int,
               softmax_scale: Optional[float], causal: bool, window: tuple, softcap: float,
               dropout_p: float, deterministic: bool, varlen: Any) -> torch.Tensor:
    if not is_fake(q):
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        if varlen is None:
            return _reference(q, k, v, scale, causal, tuple(window), softcap)
        cu_q, cu_k = (c.tolist() for c in varlen[:2])
        return torch.cat([_reference(q[None, a:b], k[None, c:d], v[None, c:d], scale, causal,
                                     tuple(window), softcap)[0]
                          for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])])
    if not (q.dtype == k.dtype == v.dtype and q.dtype in (torch.float16, torch.bfloat16)):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")  # as its mha_fwd
    if q.shape[-1] > 256:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
    note_kernel(
        f"flash-attn {version} ({'varlen ' if varlen is not None else ''}modelled: "
        f"{'mha_fwd/mha_bwd' if version == 2 else 'hopper mha_fwd/mha_bwd'} allocations)"
    )
    return _ModelledFlash.apply(q, k, v, version, causal, dropout_p, tuple(window),
                                softcap or 0.0, deterministic, varlen)


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: Optional[float] = None, causal: bool = False,
                    window_size: tuple = (-1, -1), softcap: float = 0.0, alibi_slopes: Any = None,
                    deterministic: bool = False, return_attn_probs: bool = False) -> torch.Tensor:
    """flash-attn 2's ``flash_attn_func`` (``[B, L, H, D]`` in and out; grouped-query heads in
    ``k``/``v``): its memory modelled on fake tensors, its result computed in torch on real ones."""
    if return_attn_probs or alibi_slopes is not None:
        raise ValueError(
            "the modelled flash_attn_func takes neither `return_attn_probs` nor `alibi_slopes`")
    return _attention(q, k, v, 2, softmax_scale, causal, window_size, softcap, dropout_p,
                      deterministic, None)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: tuple = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Any = None, deterministic: bool = False,
                           return_attn_probs: bool = False,
                           block_table: Any = None) -> torch.Tensor:
    """flash-attn 2's ``flash_attn_varlen_func`` (``[total, H, D]`` at ``cu_seqlens``), modelled."""
    if return_attn_probs or alibi_slopes is not None or block_table is not None:
        raise ValueError(
            "the modelled flash_attn_varlen_func takes no `return_attn_probs`, `alibi_slopes` "
            "or `block_table`")
    varlen = (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
    return _attention(q, k, v, 2, softmax_scale, causal, window_size, softcap, dropout_p,
                      deterministic, varlen)


def flash_attn_3_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      softmax_scale: Optional[float] = None, causal: bool = False,
                      window_size: tuple = (-1, -1), softcap: float = 0.0,
                      deterministic: bool = False) -> torch.Tensor:
    """flash-attn 3's ``flash_attn_func`` (``flash_attn_interface``, Hopper), modelled."""
    return _attention(q, k, v, 3, softmax_scale, causal, window_size, softcap, 0.0,
                      deterministic, None)


def flash_attn_3_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                             max_seqlen_q: int, max_seqlen_k: int,
                             softmax_scale: Optional[float] = None, causal: bool = False,
                             window_size: tuple = (-1, -1), softcap: float = 0.0,
                             deterministic: bool = False) -> torch.Tensor:
    """flash-attn 3's ``flash_attn_varlen_func``, modelled."""
    varlen = (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
    return _attention(q, k, v, 3, softmax_scale, causal, window_size, softcap, 0.0,
                      deterministic, varlen)


# -- Hugging Face ---------------------------------------------------------------------------------
_FUNCTIONS = {2: (flash_attn_func, flash_attn_varlen_func),
              3: (flash_attn_3_func, flash_attn_3_varlen_func)}
_REGISTERED: set[int] = set()


def _install(version: int) -> str:
    """Make transformers' flash glue (``lazy_import_flash_attention``) hand out the modelled
    functions for the modelled implementation's name (it keeps one implementation's at a time)."""
    import transformers.modeling_flash_attention_utils as glue

    name = HF_IMPLEMENTATIONS[version]
    if glue._loaded_implementation != name:
        dense, varlen = _FUNCTIONS[version]
        glue._flash_fn, glue._flash_varlen_fn, glue._flash_with_kvcache_fn = dense, varlen, None
        glue._pad_fn, glue._unpad_fn = glue._pad_input, glue._unpad_input
        glue._process_flash_kwargs_fn = glue._lazy_define_process_function(varlen)
        glue._process_with_kvcache_kwargs_fn = dict
        glue._loaded_implementation = name
    return name


def hf_implementation(version: int = 2) -> str:
    """The name of the modelled flash-attn ``version`` as a Hugging Face attention implementation,
    registered (once) with ``AttentionInterface`` and, for its masks, ``AttentionMaskInterface``.

    >>> hf_implementation(2)
    'flash_attention_2_modelled'
    """
    if version not in HF_IMPLEMENTATIONS:
        raise ValueError(f"`version` must be one of {sorted(HF_IMPLEMENTATIONS)}, got {version!r}")
    name = HF_IMPLEMENTATIONS[version]
    if version not in _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

        def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor],
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
            from transformers.integrations.flash_attention import flash_attention_forward

            _install(version)
            return flash_attention_forward(module, query, key, value, attention_mask, **kwargs)

        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, flash_attention_mask)
        _REGISTERED.add(version)
    return _install(version)


def flash_runs_here(version: int) -> bool:
    """Whether the real flash-attn ``version`` can run in this process (its package and CUDA).

    >>> installed = importlib.util.find_spec("flash_attn") is not None
    >>> flash_runs_here(2) == (installed and torch.cuda.is_available())
    True
    """
    return importlib.util.find_spec(_PACKAGES[version]) is not None and torch.cuda.is_available()


def _mapped(model: Any, requested: Any) -> Any:
    """``requested`` with a flash-attn that cannot run here replaced by its model (for models that
    take flash attention at all; others keep their request, and transformers' refusal)."""
    for version in HF_IMPLEMENTATIONS:
        if (requested == f"flash_attention_{version}" and not flash_runs_here(version)
                and getattr(model, "_supports_flash_attn", False)):
            return hf_implementation(version)
    return requested


_DEPTH = [0]


@contextlib.contextmanager
def mapped_flash_requests() -> Iterator[None]:
    """While it lasts, ``PreTrainedModel._check_and_adjust_attn_implementation`` (what a model's
    construction and ``set_attn_implementation`` ask) maps a request for flash-attn that cannot run
    here to the modelled one (:func:`hf_implementation`). Re-entrant; restored on exit."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.__dict__["_check_and_adjust_attn_implementation"]
    if _DEPTH[0] == 0:

        def adjusted(self: Any, attn_implementation: Any, *args: Any, **kwargs: Any) -> Any:
            return original(self, _mapped(self, attn_implementation), *args, **kwargs)

        PreTrainedModel._check_and_adjust_attn_implementation = adjusted
        adjusted.__wrapped__ = original  # type: ignore[attr-defined]
    _DEPTH[0] += 1
    try:
        yield
    finally:
        _DEPTH[0] -= 1
        if _DEPTH[0] == 0:
            current = PreTrainedModel.__dict__["_check_and_adjust_attn_implementation"]
            PreTrainedModel._check_and_adjust_attn_implementation = getattr(
                current, "__wrapped__", current)
