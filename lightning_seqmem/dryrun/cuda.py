"""What a dry run adds on CUDA beyond the step's tensors: the allocator's block size, kernel
scratch the tracker cannot see, cuBLAS workspaces and what else the allocator holds."""

from __future__ import annotations

from typing import Any

import torch

from lightning_seqmem.measure.probes import round_cuda_block_bytes
from lightning_seqmem.dryrun.accelerator import stands_for
from lightning_seqmem.dryrun.kernels_scratch import kernel_scratch_bytes

__all__ = ['allocator_block_bytes', 'cuda_kernel_scratch_bytes', 'resident_bytes',
           'warm_cuda_workspaces']

def allocator_block_bytes(device: torch.device | str) -> int:
    """Granularity of what the device's allocator counts: 512 bytes on CUDA (and the simulated
    device that stands for it, :mod:`.accelerator`), 1 (exact storage bytes) elsewhere.

    Example:
        >>> allocator_block_bytes("cuda:0"), allocator_block_bytes("cpu")
        (512, 1)
    """
    return round_cuda_block_bytes(1) if stands_for(device) == "cuda" else 1


def cuda_kernel_scratch_bytes(func: Any, args: Any, out: Any) -> int:
    """Bytes a CUDA kernel allocates for itself beside its output, where measured (else 0).

    Fake tensors see outputs only. On an H200 (torch 2.11, ``benchmarks/cuda_peak_anatomy.py``)
    the softmax backward kernel held one more buffer the size of its output: eager attention's
    backward peaked one ``[B, H, L, L]`` block above the tensors (9% at 512 tokens, 18% at 2048
    for a 2-layer GPT); other kernels showed none (SDPA, Llama, Mistral: within 0.05%). SDPA's
    fused kernels' own buffers: :func:`.kernels_scratch.kernel_scratch_bytes`.

    Example:
        >>> out = torch.empty(2, 4, 8, 8)
        >>> cuda_kernel_scratch_bytes(torch.ops.aten._softmax_backward_data.default, (), out)
        2048
        >>> cuda_kernel_scratch_bytes(torch.ops.aten.mm.default, (), out)
        0
    """
    if func is torch.ops.aten._softmax_backward_data.default and isinstance(out, torch.Tensor):
        return round_cuda_block_bytes(out.numel() * out.element_size())
    return kernel_scratch_bytes(func, args, out)


def warm_cuda_workspaces(device: torch.device) -> None:
    """Make cuBLAS and cuBLASLt allocate their workspaces on ``device`` now, as a first step does.
    They stay allocated, so ``max_memory_allocated`` counts them in every step (tens of MiB); a tiny
    matmul with and without bias (the two libraries), forward and backward, fp32 and bf16, allocates
    them before :func:`resident_bytes` reads the device."""
    dtypes = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_bf16_supported() else [])
    for dtype in dtypes:
        x = torch.ones(8, 8, device=device, dtype=dtype, requires_grad=True)
        w = torch.ones(8, 8, device=device, dtype=dtype, requires_grad=True)
        b = torch.ones(8, device=device, dtype=dtype, requires_grad=True)
        (torch.nn.functional.linear(x, w, b).sum() + (x @ w).sum()).backward()
    torch.cuda.synchronize(device)


def resident_bytes(device: torch.device, tensors: Any) -> int:
    """Bytes the CUDA allocator holds on ``device`` outside ``tensors`` (what a step starts with):
    ``torch.cuda.memory_allocated`` minus the 512-byte blocks of the distinct storages among
    ``tensors`` on that device (cuBLAS workspaces, a second model, an EMA copy), added to a dry
    run's peak so it compares with what the allocator reports. 0 off CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    seen: set[int] = set()
    known = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device == device:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                known += round_cuda_block_bytes(storage.nbytes())
    return max(0, torch.cuda.memory_allocated(device) - known)
