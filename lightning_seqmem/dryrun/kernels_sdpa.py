"""SDPA on the simulated CUDA device: the backend CUDA's dispatch picks, its aten op, its kernels' scratch.

``F.scaled_dot_product_attention`` on the simulated device (:mod:`.accelerator`) runs the backend
PyTorch's CUDA dispatch picks on :data:`CUDA_TARGET` (``sdp_utils.cpp: select_sdp_backend``, the rules
in :func:`sdpa_backend`), as ``attention.cpp`` runs it: that backend's own aten op on the fake tensors
(``aten._scaled_dot_product_flash_attention``, ``aten._scaled_dot_product_efficient_attention``, or the
math composite), whose meta kernels give CUDA's outputs and what autograd saves. The composite's own
choice would be math there: an ``[B, H, L, L]`` matrix no CUDA run of flash has.

What the CUDA kernels allocate for themselves, which fake tensors cannot see, is
:func:`kernel_scratch_bytes` (the live-tensor tracker's ``scratch`` hook): flash-attn 2's ``mha_fwd``
split-KV accumulators and ``mha_bwd``'s ``softmax_d``, ``dq_accum`` and the expanded ``dk``/``dv`` of
grouped-query attention (``flash_api.cpp``); the memory-efficient backward's ``delta`` and workspace
(``attention_backward.cu``, ``kernel_backward.h``) and its forward's fp32 accumulator above head dim 128.
Each modelled kernel that runs is recorded (:func:`recording`).

Example:
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> from lightning_seqmem.dryrun.accelerator import simulated_device
    >>> device = simulated_device()
    >>> with FakeTensorMode():
    ...     q = torch.empty(1, 8, 4096, 128, device=device, dtype=torch.bfloat16)
    ...     flash = sdpa_backend(q, q, q, is_causal=True)
    ...     masked = sdpa_backend(q, q, q, attn_mask=torch.ones(4096, 4096, device=device, dtype=torch.bool))
    ...     fp32 = sdpa_backend(q.float(), q.float(), q.float())
    >>> flash[0], masked[0], fp32[0]
    ('flash', 'efficient', 'efficient')
    >>> masked[1]
    'flash: an explicit attn_mask'
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F

from lightning_seqmem.dryrun.accelerator import SIMULATED, on_registered
from lightning_seqmem.measure.probes import round_cuda_block_bytes

__all__ = ["CUDA_TARGET", "CudaTarget", "efficient_backward_workspace", "fa2_backward_scratch", "fa2_forward_scratch",
           "fa2_head_rounded", "fa2_num_splits", "kernel_blocks", "kernel_scratch_bytes", "note_kernel", "recording",
           "sdpa_backend"]

aten = torch.ops.aten


@dataclass(frozen=True)
class CudaTarget:
    """The GPU whose kernels are modelled: its compute capability and multiprocessor count (what the
    kernels' launch heuristics read)."""

    name: str = "H100/H200 (sm90)"
    major: int = 9
    minor: int = 0
    sm_count: int = 132  # H100 SXM5 and H200; an H100 PCIe has 114


CUDA_TARGET = CudaTarget()
"""The target every modelled kernel takes its heuristics from."""


# -- which kernels were modelled ---------------------------------------------------------------------
_RECORDS: list[dict[str, None]] = []


@contextlib.contextmanager
def recording() -> Iterator[list[str]]:
    """Collect the names of the modelled kernels that run inside the block, in first-run order (the list
    is filled when the block ends).

    >>> with recording() as seen:
    ...     note_kernel("example kernel")
    >>> seen
    ['example kernel']
    """
    seen: dict[str, None] = {}
    names: list[str] = []
    _RECORDS.append(seen)
    try:
        yield names
    finally:
        _RECORDS.remove(seen)
        names.extend(seen)


def note_kernel(name: str) -> None:
    """Record that the modelled kernel ``name`` ran (for every :func:`recording` open now)."""
    for seen in _RECORDS:
        seen.setdefault(name)


# -- SDPA: the backend CUDA's dispatch picks -----------------------------------------------------------
_HALF = (torch.float16, torch.bfloat16)
_BACKEND_OF_PRIORITY = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}  # SDPBackend values


def _priority_order() -> list[str]:
    """The backends in the order ``select_sdp_backend`` tries them (the global priority order, which
    ``sdpa_kernel(..., set_priority=True)`` sets)."""
    get = getattr(torch._C, "_get_sdp_priority_order", None)
    order = list(get()) if get is not None else [1, 2, 0, 3, 4]
    return [_BACKEND_OF_PRIORITY.get(int(b), "?") for b in order]


def _common_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool, gqa: bool,
                    ignore_singleton: bool, mask: Optional[torch.Tensor]) -> Optional[str]:
    """``check_tensor_shapes``, the dense checks (batch and heads, non-zero lengths, last-dim strides)."""
    if not (q.dim() == k.dim() == v.dim() == 4):
        return "query, key and value are not 4-D"
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return "query, key and value batch sizes differ"
    hq, hk, hv = q.shape[1], k.shape[1], v.shape[1]
    if enable_gqa and gqa:
        if hk != hv or hq % hk:
            return f"grouped-query heads {hq}/{hk}/{hv} do not divide"
    elif not hq == hk == hv:
        return (f"query, key and value heads differ ({hq}/{hk}/{hv})" + (" and GQA runs on flash and math only"
                                                                          if enable_gqa else ""))
    if 0 in (q.shape[2], k.shape[2]):
        return "a sequence length is 0"
    strides_ok = all(x.stride(-1) == 1 or (ignore_singleton and x.shape[-1] == 1) for x in (q, k, v))
    if not strides_ok or (mask is not None and mask.stride(-1) != 1):
        return "a last dimension is not contiguous"
    return None


def _flash_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                   is_causal: bool, enable_gqa: bool) -> Optional[str]:
    """Why ``can_use_flash_attention`` refuses (None: flash runs)."""
    if not torch.backends.cuda.flash_sdp_enabled():
        return "disabled (sdpa_kernel)"
    if mask is not None:
        return "an explicit attn_mask"
    if q.dim() == 4 and not (q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] <= 256):
        return f"head dims {q.shape[-1]}/{k.shape[-1]}/{v.shape[-1]} differ or exceed 256"
    if is_causal and q.dim() == 4 and q.shape[-2] != k.shape[-2]:
        return "is_causal with seqlen_q != seqlen_k"
    if not (q.dtype == k.dtype == v.dtype and q.dtype in _HALF):
        return f"{q.dtype} (flash takes float16 and bfloat16)"
    return _common_refusal(q, k, v, enable_gqa, True, True, None)


def _efficient_alignment(dtype: torch.dtype) -> int:
    """``minimum_gemm_alignment`` on sm80+: 128 bits of tensor-core operands, at least 4 elements."""
    return max(4, 128 // (16 if dtype in _HALF else 32)) if CUDA_TARGET.major >= 8 else 1


def _efficient_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                       enable_gqa: bool) -> Optional[str]:
    """Why ``can_use_mem_efficient_attention`` refuses (None: it runs). Grouped-query attention
    (``enable_gqa`` with fewer key heads) runs on flash and math only (PyTorch's documentation)."""
    if not torch.backends.cuda.mem_efficient_sdp_enabled():
        return "disabled (sdpa_kernel)"
    if q.dim() != 4:
        return _common_refusal(q, k, v, enable_gqa, False, False, mask)
    align = _efficient_alignment(q.dtype)
    if q.shape[-1] != k.shape[-1] or q.shape[-1] % align or v.shape[-1] % align or 0 in (q.shape[-1], v.shape[-1]):
        return f"head dims {q.shape[-1]}/{v.shape[-1]} not multiples of {align}"
    if any(x.storage_offset() % align for x in (q, k, v)):
        return f"storage offsets not aligned to {align} elements"
    common = _common_refusal(q, k, v, enable_gqa, False, False, mask)
    if common is not None:
        return common
    if not (q.dtype == k.dtype == v.dtype and q.dtype in (torch.float16, torch.float32, torch.bfloat16)):
        return f"{q.dtype} (takes float16, bfloat16 and float32)"
    return None


def sdpa_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, is_causal: bool = False,
                 enable_gqa: bool = False) -> tuple[str, str]:
    """``(backend, why the earlier ones did not run)``: the backend ``F.scaled_dot_product_attention``
    runs on :data:`CUDA_TARGET`, by PyTorch's ``select_sdp_backend`` rules (``sdp_utils.cpp``): the
    priority order (flash, memory-efficient, math unless set otherwise) and the enabled flags
    (``sdpa_kernel``); flash for float16/bfloat16 with head dims equal and at most 256, no explicit
    ``attn_mask`` (``is_causal`` is fine, with equal lengths), grouped-query heads with ``enable_gqa``;
    memory-efficient for float32 too and with an ``attn_mask``, head dims multiples of 8 (half) or 4
    (float32), the same heads; else math.

    Raises:
        RuntimeError: no backend can run (PyTorch's "No available kernel").
    """
    refused: list[str] = []
    for backend in _priority_order():
        if backend == "flash":
            why = _flash_refusal(query, key, value, attn_mask, is_causal, enable_gqa)
        elif backend == "efficient":
            why = _efficient_refusal(query, key, value, attn_mask, enable_gqa)
        elif backend == "math":
            why = None if torch.backends.cuda.math_sdp_enabled() else "disabled (sdpa_kernel)"
        else:
            continue  # cuDNN and overrideable backends: not modelled (see the module docstring)
        if why is None:
            return backend, "; ".join(refused)
        refused.append(f"{backend}: {why}")
    raise RuntimeError(f"No available kernel for scaled_dot_product_attention on {CUDA_TARGET.name}: "
                       + "; ".join(refused))


def _bool_mask_to_float(mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``convert_boolean_attn_mask``: a boolean mask as an additive one of the query's dtype."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask.logical_not(), float("-inf"), zero)


def _efficient_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask``: expanded to ``[B, H, L, S]``, its last dim padded to 16, else made contiguous
    where its strides are not multiples of 16."""
    mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    last = mask.shape[-1]
    if last % 16:
        return F.pad(mask, (0, 16 - last % 16))[..., :last]
    if any(mask.stride(i) % 16 for i in range(3)):
        return mask.contiguous()
    return mask


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
          dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
          enable_gqa: bool = False) -> torch.Tensor:
    """``aten::scaled_dot_product_attention`` on the simulated device (its autograd kernel): the backend
    of :func:`sdpa_backend`, run as ``attention.cpp`` runs it on CUDA."""
    backend, _ = sdpa_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    note_kernel(f"SDPA {backend} (PyTorch CUDA dispatch on {CUDA_TARGET.name})")
    if backend == "flash":
        head = query.shape[-1]
        og_scale = scale if scale is not None else 1.0 / math.sqrt(head)
        if head % 8:  # pad_last_dim<8>: the kernel takes head dims in multiples of 8
            query, key, value = (F.pad(x, [0, 8 - head % 8]) for x in (query, key, value))
        out = aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                       scale=og_scale)[0]
        return out[..., :head] if head % 8 else out
    mask = _bool_mask_to_float(attn_mask, query.dtype)
    if backend == "efficient":
        if mask is not None:
            mask = _efficient_mask(mask, query, key)
        lse = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
        return aten._scaled_dot_product_efficient_attention(query, key, value, mask, lse, dropout_p, is_causal,
                                                            scale=scale)[0]
    return aten._scaled_dot_product_attention_math(query, key, value, mask, dropout_p, is_causal, None,
                                                   scale=scale, enable_gqa=enable_gqa)[0]


# -- what the kernels allocate for themselves (the tracker's scratch hook) ---------------------------------
def kernel_blocks(*shapes_and_dtypes: tuple[Sequence[int], torch.dtype]) -> int:
    """Bytes of buffers of these shapes, each rounded to the CUDA allocator's 512-byte blocks."""
    total = 0
    for shape, dtype in shapes_and_dtypes:
        numel = math.prod(int(s) for s in shape)
        if numel:
            total += round_cuda_block_bytes(numel * dtype.itemsize)
    return total


def _round(x: int, m: int) -> int:
    return -(-x // m) * m


def fa2_head_rounded(head: int) -> int:
    """flash-attn 2's ``head_size_rounded``: the head dim to 32 (up to 128), else to 64.

    >>> fa2_head_rounded(64), fa2_head_rounded(80), fa2_head_rounded(192)
    (64, 96, 192)
    """
    return _round(head, 32 if head <= 128 else 64)


def _deterministic() -> bool:
    return torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


def fa2_num_splits(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head: int, dropout_p: float) -> int:
    """flash-attn 2's split-KV count of a forward (``set_params_splitkv``, ``num_splits_heuristic``):
    1 unless the batch, heads and query blocks fill under 80% of the multiprocessors.

    >>> fa2_num_splits(1, 32, 4096, 4096, 128, 0.0), fa2_num_splits(1, 2, 64, 64, 64, 0.0)
    (1, 1)
    >>> fa2_num_splits(1, 2, 64, 1024, 128, 0.0)
    8
    """
    if dropout_p > 0:
        return 1
    block_n = 256 if head <= 64 else (128 if head <= 128 else 64)
    n_blocks = -(-seqlen_k // block_n)
    work = batch * heads * -(-seqlen_q // 64)
    sms = CUDA_TARGET.sm_count * 2  # 128 threads per block
    if work >= 0.8 * sms:
        return 1
    most = min(128, sms, n_blocks)
    efficiency = []
    for splits in range(1, most + 1):
        eligible = splits == 1 or -(-n_blocks // splits) != -(-n_blocks // (splits - 1))
        waves = work * splits / sms
        efficiency.append(waves / math.ceil(waves) if eligible else 0.0)
    best = max(efficiency, default=0.0)
    return next((i + 1 for i, e in enumerate(efficiency) if e and e >= 0.85 * best), 1)


def fa2_forward_scratch(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head: int, dropout_p: float) -> list:
    """``(shape, dtype)`` of the buffers flash-attn 2's ``mha_fwd`` holds while it runs beside its outputs:
    the split-KV accumulators where it splits (:func:`fa2_num_splits`)."""
    splits = fa2_num_splits(batch, heads, seqlen_q, seqlen_k, head, dropout_p)
    if splits <= 1:
        return []
    return [((splits, batch, heads, seqlen_q), torch.float32),
            ((splits, batch, heads, seqlen_q, fa2_head_rounded(head)), torch.float32)]


def fa2_backward_scratch(batch: int, heads: int, heads_k: int, seqlen_q: int, seqlen_k: int, head: int,
                         dtype: torch.dtype) -> list:
    """``(shape, dtype)`` of the buffers flash-attn 2's ``mha_bwd`` allocates beside ``dq, dk, dv`` (its
    ``flash_api.cpp``): ``softmax_d`` fp32 ``[B, H, round128(Lq)]``, ``dq_accum`` fp32 ``[B,
    round128(Lq), H, round(D)]`` (``[nsplits, ...]`` zeros when deterministic), and for grouped-query
    attention ``dk_expanded``, ``dv_expanded`` ``[B, Lk, H, D]`` before their sum over the groups.

    >>> [s for s, _ in fa2_backward_scratch(1, 32, 8, 1000, 1000, 128, torch.bfloat16)]
    [(1, 32, 1024), (1, 1024, 32, 128), (1, 1000, 32, 128), (1, 1000, 32, 128)]
    """
    lq = _round(seqlen_q, 128)
    accum: tuple[int, ...] = (batch, lq, heads, fa2_head_rounded(head))
    if _deterministic():
        accum = (-(-CUDA_TARGET.sm_count // (batch * heads)),) + accum
    out = [((batch, heads, lq), torch.float32), (accum, torch.float32)]
    if heads_k != heads:
        out += [((batch, seqlen_k, heads, head), dtype)] * 2
    return out


def _flash_forward_scratch(args: Sequence[Any], out: Any) -> int:
    q, k = args[0], args[1]
    dropout = float(args[3]) if len(args) > 3 else 0.0
    return kernel_blocks(*fa2_forward_scratch(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], dropout))


def _flash_backward_scratch(args: Sequence[Any], out: Any) -> int:
    """``_scaled_dot_product_flash_attention_backward_cuda``: ``grad_out`` made contiguous in ``[B, L, H,
    D]`` (``out`` is so on CUDA), then ``mha_bwd``."""
    grad, q, k = args[0], args[1], args[2]
    copy = [] if grad.transpose(1, 2).is_contiguous() else [(grad.shape, grad.dtype)]
    return kernel_blocks(*copy, *fa2_backward_scratch(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2],
                                               q.shape[3], q.dtype))


_CUTLASS_B_HALF = ((64, 64, 32, True), (64, 64, 32, False), (64, 64, 64, True), (64, 64, 64, False),
                   (128, 128, 128, True), (128, 128, 128, False), (64, 64, 128, True), (64, 64, 128, False),
                   (128, 64, 65536, False), (64, 64, 65536, False))
_CUTLASS_B_FLOAT = ((64, 64, 32, False), (64, 64, 64, False), (128, 64, 128, False), (64, 64, 128, False),
                    (128, 64, 65536, False), (64, 64, 65536, False))
"""The sm80+ backward kernels of ``cutlassB.h`` in dispatch order: (kBlockSizeI, kBlockSizeJ, kMaxK,
needs lengths aligned to its blocks); the dropout variants have the same shapes."""


def efficient_backward_workspace(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head: int, head_v: int,
                                 dtype: torch.dtype) -> tuple[int, bool]:
    """``(workspace bytes, the kernel computes delta)`` of the memory-efficient backward on
    :data:`CUDA_TARGET`: the first ``cutlassB`` kernel that takes these shapes, its split-keys count
    (``attention_backward.cu``) and ``Params::workspace_size`` (``kernel_backward.h``): fp32 grad-Q
    tiles of ``[I x J]`` per query block and column block, plus grad-K/V accumulators where they
    are not kept in registers.

    >>> efficient_backward_workspace(1, 8, 1024, 1024, 128, 128, torch.bfloat16)[1]
    True
    """
    half = dtype in _HALF
    max_k = max(head, head_v)
    for block_i, block_j, kernel_max_k, aligned in (_CUTLASS_B_HALF if half else _CUTLASS_B_FLOAT):
        if kernel_max_k >= max_k and not (aligned and (seqlen_q % block_i or seqlen_k % block_j)):
            break
    in_registers = half and kernel_max_k <= block_i
    accum_kv = half and not in_registers
    splits = -(-seqlen_k // block_j)
    if batch * heads >= 256 and seqlen_k <= 2 * block_j:
        splits = 1
    if accum_kv:
        splits = min(splits, 200 // (batch * heads))
    if splits < 1 or _deterministic():
        splits = 1
    gk = splits * block_j * _round(head, block_i) if accum_kv else 0
    gv = splits * block_j * _round(head_v, block_i) if accum_kv else 0
    gq = -(-seqlen_q // block_i) * -(-head // block_j) * (16 + 4 * block_i * block_j) // 4
    return batch * heads * _round(gk + gv + gq, 4) * 4, half


def _efficient_forward_scratch(args: Sequence[Any], out: Any) -> int:
    """``_efficient_attention_forward``: an fp32 output accumulator where the kernel (``cutlassF``
    64x64 up to head dim 64, 64x128 up to 128, else 32x128 over gmem) iterates over the value dims
    in half precision."""
    q, v = args[0], args[2]
    if q.dtype in _HALF and max(q.shape[-1], v.shape[-1]) > 128:
        return kernel_blocks(((q.shape[0], q.shape[2], q.shape[1], v.shape[-1]), torch.float32))
    return 0


def _efficient_backward_scratch(args: Sequence[Any], out: Any) -> int:
    """``_efficient_attention_backward`` beside its gradients: ``grad_out`` made contiguous, ``delta`` (fp32
    ``[B, H, M]``; computed in torch from an fp32 ``grad_out * out`` in float32), the workspace."""
    grad, q, k, v = args[0], args[1], args[2], args[3]
    b, h, m, d = q.shape
    n, dv = k.shape[2], v.shape[3]
    copy = 0 if grad.transpose(1, 2).is_contiguous() else kernel_blocks((grad.shape, grad.dtype))
    workspace, kernel_delta = efficient_backward_workspace(b, h, m, n, d, dv, q.dtype)
    workspace = round_cuda_block_bytes(workspace) if workspace else 0
    delta = kernel_blocks(((b, h, m), torch.float32))
    if kernel_delta:
        return copy + delta + workspace
    product, summed = kernel_blocks(((b, m, h, dv), torch.float32)), kernel_blocks(((b, m, h), torch.float32))
    return copy + max(product + summed, summed + delta, delta + workspace)


_SCRATCH: dict[Any, Callable[[Sequence[Any], Any], int]] = {
    aten._scaled_dot_product_flash_attention.default: _flash_forward_scratch,
    aten._scaled_dot_product_flash_attention_backward.default: _flash_backward_scratch,
    aten._scaled_dot_product_efficient_attention.default: _efficient_forward_scratch,
    aten._scaled_dot_product_efficient_attention_backward.default: _efficient_backward_scratch,
}


def kernel_scratch_bytes(func: Any, args: Sequence[Any], out: Any) -> int:
    """Bytes SDPA's CUDA kernel ``func`` holds for itself beside its outputs while it runs (0 for any other
    op), in 512-byte blocks: the live-tensor tracker's ``scratch`` hook (see
    :func:`~lightning_seqmem.dryrun.cuda.cuda_kernel_scratch_bytes`). Modelled from the sources.

    >>> kernel_scratch_bytes(torch.ops.aten.mm.default, (), None)
    0
    """
    fn = _SCRATCH.get(func)
    return fn(args, out) if fn is not None else 0


# -- registration on the simulated device -----------------------------------------------------------
_LIBRARIES: list[Any] = []


def _register_on_device() -> None:
    """Put the SDPA dispatch on the simulated device (its autograd key: the composite would run math)."""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("scaled_dot_product_attention", _sdpa, "AutogradPrivateUse1")
    _LIBRARIES.append(lib)


on_registered(_register_on_device)
