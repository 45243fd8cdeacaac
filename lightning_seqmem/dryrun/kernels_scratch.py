"""What CUDA's attention kernels hold for themselves (from their sources), on which GPU, which ran.

Fake tensors see a kernel's outputs only. The buffers a CUDA kernel holds beside them while it runs
on :data:`CUDA_TARGET` (the GPU whose heuristics they read) are computed here from its source, in
512-byte blocks, for the tracker's ``scratch`` hook (:func:`kernel_scratch_bytes`, through
:func:`.cuda.cuda_kernel_scratch_bytes`): flash-attn 2's forward and backward (``flash_api.cpp``,
which PyTorch's flash backend is), flash-attn 3's backward (``hopper/flash_api.cpp``), and the
memory-efficient kernels (``attention_backward.cu``, ``kernel_backward.h``, ``cutlassB.h``).

>>> [tuple(s) for s, _ in fa2_backward_scratch(1, 32, 8, 4096, 4096, 128, torch.bfloat16)][:2]
[(1, 32, 4096), (1, 4096, 32, 128)]
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from lightning_seqmem.measure.probes import round_cuda_block_bytes

__all__ = ["CUDA_TARGET", "CudaTarget", "efficient_backward_workspace", "fa2_backward_scratch",
           "fa2_forward_scratch", "fa2_head_rounded", "fa2_num_splits", "fa3_backward_scratch",
           "fa3_head_rounded", "kernel_blocks", "kernel_scratch_bytes", "note_kernel", "recording"]

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class CudaTarget:
    """The GPU modelled: compute capability and SM count, which launch heuristics read."""

    name: str = "H100/H200 (sm90)"
    major: int = 9
    minor: int = 0
    sm_count: int = 132  # H100 SXM5 and H200; an H100 PCIe has 114


CUDA_TARGET = CudaTarget()
"""The target every modelled kernel takes its heuristics from."""


_RECORDS: list[dict[str, None]] = []


@contextlib.contextmanager
def recording() -> Iterator[list[str]]:
    """Names of the modelled kernels run inside the block, in first-run order (filled at its end).

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
    return (torch.are_deterministic_algorithms_enabled()
            and not torch.is_deterministic_algorithms_warn_only_enabled())


def fa2_num_splits(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head: int,
                   dropout_p: float) -> int:
    """flash-attn 2's forward split-KV count (``set_params_splitkv``, ``num_splits_heuristic``): 1
    unless the batch, heads and query blocks fill under 80% of the multiprocessors.

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


def fa2_forward_scratch(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head: int,
                        dropout_p: float) -> list:
    """``(shape, dtype)`` of the buffers flash-attn 2's ``mha_fwd`` holds while it runs beside its
    outputs: the split-KV accumulators where it splits (:func:`fa2_num_splits`)."""
    splits = fa2_num_splits(batch, heads, seqlen_q, seqlen_k, head, dropout_p)
    if splits <= 1:
        return []
    return [((splits, batch, heads, seqlen_q), torch.float32),
            ((splits, batch, heads, seqlen_q, fa2_head_rounded(head)), torch.float32)]


def fa2_backward_scratch(batch: int, heads: int, heads_k: int, seqlen_q: int, seqlen_k: int,
                         head: int, dtype: torch.dtype, deterministic: Optional[bool] = None,
                         packed: bool = False) -> list:
    """``(shape, dtype)`` of what flash-attn 2's ``mha_bwd`` allocates beside ``dq, dk, dv``
    (``flash_api.cpp``): fp32 ``softmax_d`` ``[B, H, round128(Lq)]`` and ``dq_accum``
    ``[B, round128(Lq), H, round(D)]`` (``[nsplits, ...]`` when deterministic), and for GQA
    ``dk_expanded``, ``dv_expanded`` ``[B, Lk, H, D]``. ``packed``: ``mha_varlen_bwd``'s, the
    lengths totals over ``batch`` sequences (no batch dim; ``total_q + 128 * B`` rows).
    ``deterministic``: flash-attn's flag (None: ``use_deterministic_algorithms``, not warn-only).

    >>> [s for s, _ in fa2_backward_scratch(1, 32, 8, 1000, 1000, 128, torch.bfloat16)]
    [(1, 32, 1024), (1, 1024, 32, 128), (1, 1000, 32, 128), (1, 1000, 32, 128)]
    """
    lead = () if packed else (batch,)
    lq = seqlen_q + 128 * batch if packed else _round(seqlen_q, 128)
    accum: tuple[int, ...] = (*lead, lq, heads, fa2_head_rounded(head))
    if _deterministic() if deterministic is None else deterministic:
        accum = (-(-CUDA_TARGET.sm_count // (batch * heads)),) + accum
    out = [((*lead, heads, lq), torch.float32), (accum, torch.float32)]
    if heads_k != heads:
        out += [((*lead, seqlen_k, heads, head), dtype)] * 2
    return out


def _flash_forward_scratch(args: Sequence[Any], out: Any) -> int:
    q, k = args[0], args[1]
    dropout = float(args[3]) if len(args) > 3 else 0.0
    return kernel_blocks(*fa2_forward_scratch(q.shape[0], q.shape[1], q.shape[2], k.shape[2],
                                              q.shape[3], dropout))


def _flash_backward_scratch(args: Sequence[Any], out: Any) -> int:
    """``_scaled_dot_product_flash_attention_backward_cuda``: ``grad_out`` made contiguous in
    ``[B, L, H, D]`` (``out`` is so on CUDA), then ``mha_bwd``."""
    grad, q, k = args[0], args[1], args[2]
    copy = [] if grad.transpose(1, 2).is_contiguous() else [(grad.shape, grad.dtype)]
    return kernel_blocks(*copy, *fa2_backward_scratch(q.shape[0], q.shape[1], k.shape[1],
                                                      q.shape[2], k.shape[2], q.shape[3], q.dtype))


def fa3_head_rounded(head: int) -> int:
    """flash-attn 3's ``round_up_headdim``: 64, 96, 128, 192 or 256.

    >>> fa3_head_rounded(80), fa3_head_rounded(128)
    (96, 128)
    """
    return next(r for r in (64, 96, 128, 192, 256) if head <= r) if head <= 256 else 256


def _fa3_blocks(head: int, causal: bool, local: bool, softcap: float) -> tuple[int, int]:
    """``(kBlockM, kBlockN)`` of flash-attn 3's backward on sm90 (as ``mha_bwd``'s kernel)."""
    d = fa3_head_rounded(head)
    if d <= 64:
        block_m = 96 if causal and softcap > 0 else 128
    elif d <= 96:
        block_m = 64
    elif d <= 128:
        block_m = 64 if causal or local or softcap > 0 else 80
    else:
        block_m = 64
    block_n = 128 if d <= 128 else (96 if d <= 192 else 80)
    return block_m, block_n


def fa3_backward_scratch(batch: int, heads: int, heads_k: int, seqlen_q: int, seqlen_k: int,
                         head: int, causal: bool, local: bool = False, softcap: float = 0.0,
                         total_q: Optional[int] = None, total_k: Optional[int] = None) -> list:
    """``(shape, dtype)`` of what flash-attn 3's ``mha_bwd`` allocates beside ``dq, dk, dv``: fp32
    ``softmax_d``, ``softmax_lse_log2`` ``[B, H, round(Lq, kBlockM)]`` and ``dq_accum`` (times
    ``round(D)``), int32 ``dq_semaphore``, and for GQA fp32 ``dk_accum``, ``dv_accum``
    ``[B, Hk, round(Lk, kBlockN) * round(D)]`` (varlen: ``total + B * kBlock`` rows, rounded).

    >>> [s for s, _ in fa3_backward_scratch(1, 32, 8, 4096, 4096, 128, causal=True)][:3]
    [(1, 32, 4096), (1, 32, 4096), (1, 32, 524288)]
    """
    block_m, block_n = _fa3_blocks(head, causal, local, softcap)
    d = fa3_head_rounded(head)
    if total_q is None:
        rows_q, rows_k = (batch, heads, _round(seqlen_q, block_m)), (
            batch, heads_k, _round(seqlen_k, block_n))
    else:
        rows_q = (heads, _round(total_q + batch * block_m, block_m))
        rows_k = (heads_k, _round((total_k or 0) + batch * block_n, block_n))
    out = [(rows_q, torch.float32), (rows_q, torch.float32),
           (rows_q[:-1] + (rows_q[-1] * d,), torch.float32),
           ((-(-seqlen_q // block_m), batch, heads), torch.int32)]
    if heads_k != heads:
        out += [(rows_k[:-1] + (rows_k[-1] * d,), torch.float32)] * 2
    return out


_CUTLASS_B_HALF = ((64, 64, 32, True), (64, 64, 32, False), (64, 64, 64, True),
                   (64, 64, 64, False), (128, 128, 128, True), (128, 128, 128, False),
                   (64, 64, 128, True), (64, 64, 128, False), (128, 64, 65536, False),
                   (64, 64, 65536, False))
_CUTLASS_B_FLOAT = ((64, 64, 32, False), (64, 64, 64, False), (128, 64, 128, False),
                    (64, 64, 128, False), (128, 64, 65536, False), (64, 64, 65536, False))
"""The sm80+ backward kernels of ``cutlassB.h`` in dispatch order: (kBlockSizeI, kBlockSizeJ,
kMaxK, needs lengths aligned to its blocks); the dropout variants have the same shapes."""


def efficient_backward_workspace(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head: int,
                                 head_v: int, dtype: torch.dtype) -> tuple[int, bool]:
    """``(workspace bytes, the kernel computes delta)`` of the memory-efficient backward: the first
    ``cutlassB`` kernel for these shapes, its split-keys count (``attention_backward.cu``) and
    ``Params::workspace_size`` (``kernel_backward.h``): fp32 grad-Q tiles and grad-K/V accumulators.

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
    """``_efficient_attention_forward``: an fp32 output accumulator where the half-precision kernel
    iterates over value dims (``cutlassF``: 64x64 to head dim 64, 64x128 to 128, else 32x128)."""
    q, v = args[0], args[2]
    if q.dtype in _HALF and max(q.shape[-1], v.shape[-1]) > 128:
        return kernel_blocks(((q.shape[0], q.shape[2], q.shape[1], v.shape[-1]), torch.float32))
    return 0


def _efficient_backward_scratch(args: Sequence[Any], out: Any) -> int:
    """``_efficient_attention_backward`` beside its gradients: ``grad_out`` made contiguous,
    ``delta`` (fp32 ``[B, H, M]``, from an fp32 ``grad_out * out`` in torch), the workspace."""
    grad, q, k, v = args[0], args[1], args[2], args[3]
    b, h, m, d = q.shape
    n, dv = k.shape[2], v.shape[3]
    copy = 0 if grad.transpose(1, 2).is_contiguous() else kernel_blocks((grad.shape, grad.dtype))
    workspace, kernel_delta = efficient_backward_workspace(b, h, m, n, d, dv, q.dtype)
    workspace = round_cuda_block_bytes(workspace) if workspace else 0
    delta = kernel_blocks(((b, h, m), torch.float32))
    if kernel_delta:
        return copy + delta + workspace
    product, summed = kernel_blocks(((b, m, h, dv), torch.float32)), kernel_blocks(
        ((b, m, h), torch.float32))
    return copy + max(product + summed, summed + delta, delta + workspace)


_SCRATCH: dict[Any, Callable[[Sequence[Any], Any], int]] = {
    aten._scaled_dot_product_flash_attention.default: _flash_forward_scratch,
    aten._scaled_dot_product_flash_attention_backward.default: _flash_backward_scratch,
    aten._scaled_dot_product_efficient_attention.default: _efficient_forward_scratch,
    aten._scaled_dot_product_efficient_attention_backward.default: _efficient_backward_scratch,
}


def kernel_scratch_bytes(func: Any, args: Sequence[Any], out: Any) -> int:
    """Bytes SDPA's CUDA kernel ``func`` holds beside its outputs while it runs (0 for other ops).

    >>> kernel_scratch_bytes(torch.ops.aten.mm.default, (), None)
    0
    """
    fn = _SCRATCH.get(func)
    return fn(args, out) if fn is not None else 0
