"""What a dry run adds on CUDA beyond the step's tensors: the caching allocator's block size, kernel
scratch the tracker cannot see, cuBLAS workspaces and what else the allocator holds."""

from __future__ import annotations

from typing import Any

import torch


from lightning_seqmem.measure.probes import round_cuda_block_bytes
from lightning_seqmem.dryrun.accelerator import stands_for
from lightning_seqmem.dryrun.kernels_scratch import kernel_scratch_bytes

__all__ = ['allocator_block_bytes', 'cuda_kernel_scratch_bytes', 'resident_bytes', 'warm_cuda_workspaces']

def allocator_block_bytes(device: torch.device | str) -> int:
    """Granularity of what the device's allocator counts: 512 bytes on CUDA (and the simulated device that
    stands for it, :mod:`.accelerator`), 1 (exact storage bytes) elsewhere.

    Example:
        >>> allocator_block_bytes("cuda:0"), allocator_block_bytes("cpu")
        (512, 1)
    """
    return round_cuda_block_bytes(1) if stands_for(device) == "cuda" else 1


def cuda_kernel_scratch_bytes(func: Any, args: Any, out: Any) -> int:
    """Bytes a CUDA kernel allocates for itself beside its output, where measured (else 0).

    Fake tensors see outputs only. On an H200 (torch 2.11, ``benchmarks/cuda_peak_anatomy.py``)
    the softmax backward kernel (``structured_softmax_backward_cuda_out``) held one more buffer
    the size of its output while it ran: eager attention's backward peaked one ``[B, H, L, L]``
    block above what the tensors account for (9% at 512 tokens, 18% at 2048 for a 2-layer GPT).
    Other kernels showed no such buffer above the allocator's rounding (SDPA in fp32, Llama and
    Mistral with SDPA: within 0.05%). SDPA's fused kernels' own buffers (flash-attn 2's ``dq_accum``
    and ``softmax_d``, the memory-efficient backward's workspace), modelled from their sources:
    :func:`~lightning_seqmem.dryrun.kernels_scratch.kernel_scratch_bytes`.

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
    """Make cuBLAS and cuBLASLt allocate their workspaces on ``device`` now, as a first training step does.

    The workspaces come from PyTorch's caching allocator and stay allocated, so
    ``torch.cuda.max_memory_allocated`` counts them in every step (tens of MiB on recent GPUs);
    a tiny real matrix product with and without a bias (the two libraries), forward and
    backward, in fp32 and bf16, allocates them before :func:`resident_bytes` reads the device.
    """
    dtypes = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_bf16_supported() else [])
    for dtype in dtypes:
        x = torch.ones(8, 8, device=device, dtype=dtype, requires_grad=True)
        w = torch.ones(8, 8, device=device, dtype=dtype, requires_grad=True)
        b = torch.ones(8, device=device, dtype=dtype, requires_grad=True)
        (torch.nn.functional.linear(x, w, b).sum() + (x @ w).sum()).backward()
    torch.cuda.synchronize(device)


def resident_bytes(device: torch.device, tensors: Any) -> int:
    """Bytes the CUDA allocator holds on ``device`` outside ``tensors`` (what a step starts with).

    ``torch.cuda.memory_allocated`` minus the 512-byte blocks of the distinct storages among
    ``tensors`` on that device: cuBLAS/cuBLASLt workspaces, and anything else the process keeps
    there (a second model, an EMA copy). A dry run counts only the step's own tensors; this is
    added to its peak so it compares with what the allocator reports. 0 off CUDA.
    """
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
