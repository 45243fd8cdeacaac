"""SDPA on the simulated CUDA device: the backend CUDA's dispatch picks, and that backend's aten op.

``F.scaled_dot_product_attention`` on the simulated device (:mod:`.accelerator`) runs the backend
PyTorch's CUDA dispatch picks on :data:`CUDA_TARGET` (``select_sdp_backend``; rules in
:func:`sdpa_backend`) as ``attention.cpp`` does: that backend's own aten op (flash, efficient, or
the math composite), whose meta kernels give CUDA's outputs and saved tensors. The composite's own
choice there would be math: an ``[B, H, L, L]`` matrix no CUDA flash run has. The kernels' own
buffers come through the tracker's ``scratch`` hook (:mod:`.kernels_scratch`); each backend that
runs is recorded (:func:`.kernels_scratch.recording`).

Example:
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> from lightning_seqmem.dryrun.accelerator import simulated_device
    >>> device = simulated_device()
    >>> with FakeTensorMode():
    ...     q = torch.empty(1, 8, 4096, 128, device=device, dtype=torch.bfloat16)
    ...     flash = sdpa_backend(q, q, q, is_causal=True)
    ...     mask = torch.ones(4096, 4096, device=device, dtype=torch.bool)
    ...     masked = sdpa_backend(q, q, q, attn_mask=mask)
    ...     fp32 = sdpa_backend(q.float(), q.float(), q.float())
    >>> flash[0], masked[0], fp32[0]
    ('flash', 'efficient', 'efficient')
    >>> masked[1]
    'flash: an explicit attn_mask'
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

from lightning_seqmem.dryrun.accelerator import on_registered
from lightning_seqmem.dryrun.kernels_scratch import CUDA_TARGET, note_kernel

__all__ = ["sdpa_backend"]

aten = torch.ops.aten


# -- SDPA: the backend CUDA's dispatch picks ------------------------------------------------------
_HALF = (torch.float16, torch.bfloat16)
_BACKEND_OF_PRIORITY = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn",
                        4: "overrideable"}  # SDPBackend values


def _priority_order() -> list[str]:
    """The backends in the order ``select_sdp_backend`` tries them (the global priority order,
    which ``sdpa_kernel(..., set_priority=True)`` sets)."""
    get = getattr(torch._C, "_get_sdp_priority_order", None)
    order = list(get()) if get is not None else [1, 2, 0, 3, 4]
    return [_BACKEND_OF_PRIORITY.get(int(b), "?") for b in order]


def _common_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool, gqa: bool,
                    ignore_singleton: bool, mask: Optional[torch.Tensor]) -> Optional[str]:
    """``check_tensor_shapes``, the dense checks (batch, heads, non-zero lengths, last strides)."""
    if not (q.dim() == k.dim() == v.dim() == 4):
        return "query, key and value are not 4-D"
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return "query, key and value batch sizes differ"
    hq, hk, hv = q.shape[1], k.shape[1], v.shape[1]
    if enable_gqa and gqa:
        if hk != hv or hq % hk:
            return f"grouped-query heads {hq}/{hk}/{hv} do not divide"
    elif not hq == hk == hv:
        return f"query, key and value heads differ ({hq}/{hk}/{hv})" + (
            " and GQA runs on flash and math only" if enable_gqa else "")
    if 0 in (q.shape[2], k.shape[2]):
        return "a sequence length is 0"
    strides_ok = all(x.stride(-1) == 1 or (ignore_singleton and x.shape[-1] == 1)
                     for x in (q, k, v))
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
    """``minimum_gemm_alignment`` (sm80+): 128-bit tensor-core operands, at least 4 elements."""
    return max(4, 128 // (16 if dtype in _HALF else 32)) if CUDA_TARGET.major >= 8 else 1


def _efficient_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: Optional[torch.Tensor], enable_gqa: bool) -> Optional[str]:
    """Why ``can_use_mem_efficient_attention`` refuses (None: it runs). Grouped-query attention
    (``enable_gqa`` with fewer key heads) runs on flash and math only, as in PyTorch 2.13 (its
    documentation; ``check_batch_size_and_num_heads_dense<false>``; later versions take it here):
    a float32 grouped-query model with SDPA and no mask runs math on CUDA."""
    if not torch.backends.cuda.mem_efficient_sdp_enabled():
        return "disabled (sdpa_kernel)"
    if q.dim() != 4:
        return _common_refusal(q, k, v, enable_gqa, False, False, mask)
    align = _efficient_alignment(q.dtype)
    if (q.shape[-1] != k.shape[-1] or q.shape[-1] % align or v.shape[-1] % align
            or 0 in (q.shape[-1], v.shape[-1])):
        return f"head dims {q.shape[-1]}/{v.shape[-1]} not multiples of {align}"
    if any(x.storage_offset() % align for x in (q, k, v)):
        return f"storage offsets not aligned to {align} elements"
    common = _common_refusal(q, k, v, enable_gqa, False, False, mask)
    if common is not None:
        return common
    if not (q.dtype == k.dtype == v.dtype
            and q.dtype in (torch.float16, torch.float32, torch.bfloat16)):
        return f"{q.dtype} (takes float16, bfloat16 and float32)"
    return None


def sdpa_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                 is_causal: bool = False, enable_gqa: bool = False) -> tuple[str, str]:
    """``(backend, why the earlier ones did not run)``: the backend
    ``F.scaled_dot_product_attention`` runs on :data:`CUDA_TARGET` by ``select_sdp_backend``'s
    rules: the priority order and enabled flags (``sdpa_kernel``); flash for fp16/bf16 with equal
    head dims up to 256 and no explicit ``attn_mask``; memory-efficient for fp32 too and with a
    mask, head dims multiples of 8 (half) or 4 (fp32), equal heads; else math.

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
    raise RuntimeError(
        f"No available kernel for scaled_dot_product_attention on {CUDA_TARGET.name}: "
        + "; ".join(refused))


def _bool_mask_to_float(mask: Optional[torch.Tensor],
                        dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``convert_boolean_attn_mask``: a boolean mask as an additive one of the query's dtype."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask.logical_not(), float("-inf"), zero)


def _efficient_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask``: expanded to ``[B, H, L, S]``, its last dim padded to 16, else made
    contiguous where its strides are not multiples of 16."""
    mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    last = mask.shape[-1]
    if last % 16:
        return F.pad(mask, (0, 16 - last % 16))[..., :last]
    return mask.contiguous() if any(mask.stride(i) % 16 for i in range(3)) else mask


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: Optional[torch.Tensor]) -> None:
    """``validate_sdpa_input``: what SDPA refuses on every device, with its messages."""
    if not q.dtype == k.dtype == v.dtype:
        raise RuntimeError("Expected query, key, and value to have the same dtype, but got query."
                           f"dtype: {q.dtype} key.dtype: {k.dtype} and value.dtype: {v.dtype}")
    if min(q.dim(), k.dim(), v.dim()) < 2:
        raise RuntimeError("Expected query, key, and value to all be  at least 2 dimensional")
    if mask is not None and mask.dtype not in (torch.bool, torch.float32, q.dtype):
        raise RuntimeError("Expected attn_mask dtype to be bool or float or to match query dtype, "
                           f"but got attn_mask.dtype: {mask.dtype}")


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
          is_causal: bool = False, scale: Optional[float] = None,
          enable_gqa: bool = False) -> torch.Tensor:
    """``aten::scaled_dot_product_attention`` on the simulated device (its autograd kernel): the
    backend of :func:`sdpa_backend`, run as ``attention.cpp`` runs it on CUDA."""
    _validate(query, key, value, attn_mask)
    backend, _ = sdpa_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    note_kernel(f"SDPA {backend} (PyTorch CUDA dispatch on {CUDA_TARGET.name})")
    if backend == "flash":
        head = query.shape[-1]
        og_scale = scale if scale is not None else 1.0 / math.sqrt(head)
        if head % 8:  # pad_last_dim<8>: the kernel takes head dims in multiples of 8
            query, key, value = (F.pad(x, [0, 8 - head % 8]) for x in (query, key, value))
        out = aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                       False, scale=og_scale)[0]
        return out[..., :head] if head % 8 else out
    mask = _bool_mask_to_float(attn_mask, query.dtype)
    if backend == "efficient":
        if mask is not None:
            mask = _efficient_mask(mask, query, key)
        lse = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, mask, lse, dropout_p, is_causal, scale=scale)[0]
    return aten._scaled_dot_product_attention_math(
        query, key, value, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]


# -- registration on the simulated device ---------------------------------------------------------
_LIBRARIES: list[Any] = []


def _register_on_device() -> None:
    """Put the SDPA dispatch on the simulated device (its autograd key: the composite runs math)."""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("scaled_dot_product_attention", _sdpa, "AutogradPrivateUse1")
    _LIBRARIES.append(lib)


on_registered(_register_on_device)
