"""Recognise a real out-of-memory error (:func:`is_oom`), for which the callback writes a diagnosis
(:func:`lightning_seqmem.trainer.outputs.write_oom_diagnosis`)."""

from __future__ import annotations

import torch


def is_oom(exception: BaseException) -> bool:
    """True for a real allocator out-of-memory error, on any device: a ``torch.OutOfMemoryError``
    (what the CUDA/HIP/XPU caching allocators raise), a ``RuntimeError`` (``torch.AcceleratorError``
    included) carrying an allocator's, driver's or library's own failure phrase (CPU, CUDA/HIP/XPU,
    MPS, cuBLAS/cuDNN), or an exception raised ``from`` one. Any other error is not an OOM, even if
    its text says "out of memory" (a dataset that "ran out of memory-mapped files", a Python
    ``MemoryError``): the callback must not blame sequence length for it.

    Example:
        >>> is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory")), is_oom(ValueError("x"))
        (True, False)
        >>> is_oom(RuntimeError("my dataset ran out of memory-mapped files"))
        False
    """
    oom_type = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)  # torch < 2.5
    allocator_phrases = (
        "defaultcpuallocator: can't allocate memory",
        "defaultcpuallocator: not enough memory",
        "cuda out of memory. tried to allocate",
        "hip out of memory. tried to allocate",
        "xpu out of memory. tried to allocate",
        "mps backend out of memory",
        "cuda error: out of memory",
        "hip error: out of memory",
        "cublas_status_alloc_failed",
        "cudnn_status_alloc_failed",
    )
    seen: set[int] = set()
    error: BaseException | None = exception
    while error is not None and id(error) not in seen:  # `raise X from oom`: X is an OOM too
        seen.add(id(error))
        if isinstance(error, (oom_type, torch.cuda.OutOfMemoryError)):
            return True
        if isinstance(error, RuntimeError):
            message = str(error).lower()
            if any(phrase in message for phrase in allocator_phrases):
                return True
        error = error.__cause__
    return False
