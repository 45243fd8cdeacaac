"""Turn a real out-of-memory error into a diagnosis written next to the logs.

:func:`is_oom` recognises ``torch.cuda.OutOfMemoryError`` (and the plain ``RuntimeError`` that older
or other backends raise with "out of memory" in the message). :func:`lightning_seqmem.outputs.write_oom_diagnosis` writes
``seqmem_oom_diagnosis.json``: the last records, the forecast the callback had for the failing
length, what it would have done next, and — when the user turned on CUDA memory history with
``torch.cuda.memory._record_memory_history()`` — the allocator snapshot beside it as
``seqmem_oom_snapshot.pickle`` (open it at https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import torch


def is_oom(exception: BaseException) -> bool:
    """True for an out-of-memory error from any device.

    Example:
        >>> is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory")), is_oom(ValueError("x"))
        (True, False)
    """
    if isinstance(exception, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(exception, RuntimeError) and "out of memory" in str(exception).lower()
