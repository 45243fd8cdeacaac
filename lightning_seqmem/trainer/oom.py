"""Turn a real out-of-memory error into a diagnosis written next to the logs.

:func:`is_oom` recognises a real allocator out-of-memory error (see its docstring);
:func:`lightning_seqmem.trainer.outputs.write_oom_diagnosis` writes ``seqmem_oom_diagnosis.json``: the last records, the forecast the callback had for the failing
length, what it would have done next, and — when the user turned on CUDA memory history with
``torch.cuda.memory._record_memory_history()`` — the allocator snapshot beside it as
``seqmem_oom_snapshot.pickle`` (open it at https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import torch


def is_oom(exception: BaseException) -> bool:
    """True only for a real allocator out-of-memory error, on any device.

    That is:

    - ``torch.OutOfMemoryError`` (the same class as ``torch.cuda.OutOfMemoryError``) or a subclass:
      what the CUDA/HIP/XPU caching allocators raise;
    - a ``RuntimeError`` (``torch.AcceleratorError`` included) whose message carries an allocator's
      own failure phrase: the CPU allocator's ``"DefaultCPUAllocator: can't allocate memory"`` (or
      ``"not enough memory"``, its Windows form), the ``"CUDA out of memory. Tried to allocate"`` /
      ``"HIP out of memory. Tried to allocate"`` / ``"XPU out of memory. Tried to allocate"`` of
      torch builds that raised a plain ``RuntimeError``, ``"MPS backend out of memory"``, the driver's
      ``"CUDA error: out of memory"`` / ``"HIP error: out of memory"``, or the
      ``CUBLAS_STATUS_ALLOC_FAILED`` / ``CUDNN_STATUS_ALLOC_FAILED`` of a library that could not get
      its workspace;
    - any exception raised ``from`` one of the above (its ``__cause__`` chain is followed).

    Any other error is not an OOM, even if its text says "out of memory" (a dataset that "ran out of
    memory-mapped files", a ``MemoryError`` from Python objects): the callback must not write an OOM
    diagnosis, or blame sequence length, for an error the allocator did not raise.

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
