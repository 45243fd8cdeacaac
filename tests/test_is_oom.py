"""lightning_seqmem.trainer.oom.is_oom: only a real allocator out-of-memory error counts."""

import pytest
import torch

from lightning_seqmem.trainer.oom import is_oom


class _MyOOM(torch.OutOfMemoryError):
    pass


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("anything"),
        torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        _MyOOM("a subclass"),
        # the allocators' own phrases, as plain RuntimeErrors (older torch, other backends)
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 4611686018427387904 bytes. Error code 12 (Cannot "
            "allocate memory)"
        ),
        RuntimeError(
            r"[enforce fail at ..\c10\core\impl\alloc_cpu.cpp:72] data. DefaultCPUAllocator: not "
            "enough memory: you tried to allocate 1073741824 bytes."
        ),
        RuntimeError(
            "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.90 GiB total capacity)"),
        RuntimeError("HIP out of memory. Tried to allocate 1.00 GiB"),
        RuntimeError("XPU out of memory. Tried to allocate 1.00 GiB"),
        RuntimeError(
            "MPS backend out of memory (MPS allocated: 1.49 GiB, other allocations: 6.01 GiB)"),
        RuntimeError(
            "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
        *([torch.AcceleratorError("CUDA error: out of memory")]
          if hasattr(torch, "AcceleratorError") else []),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    ],
    ids=lambda e: f"{type(e).__name__}:{str(e)[:40]}",
)
def test_allocator_errors_are_oom(error):
    assert is_oom(error)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("my dataset ran out of memory-mapped files"),
        RuntimeError("out of memory"),
        RuntimeError("worker ran OUT OF MEMORY budget for the cache"),
        # user code imitating, without the allocator's "Tried to allocate"
        RuntimeError("CUDA out of memory"),
        RuntimeError("CUDA error: device-side assert triggered"),
        MemoryError(),  # Python objects, not a tensor allocator
        ValueError("CUDA out of memory. Tried to allocate 2 GiB"),  # not a RuntimeError
        KeyboardInterrupt(),
        Exception("DefaultCPUAllocator: can't allocate memory"),
    ],
    ids=lambda e: f"{type(e).__name__}:{str(e)[:40]}",
)
def test_other_errors_are_not_oom(error):
    assert not is_oom(error)


def test_cause_chain_is_followed_but_not_context():
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
    wrapped = RuntimeError("training step failed")
    wrapped.__cause__ = oom  # raise RuntimeError(...) from oom
    assert is_oom(wrapped)
    twice = ValueError("outer")
    twice.__cause__ = wrapped
    assert is_oom(twice)

    during = RuntimeError("cleanup failed")
    during.__context__ = oom  # raised while handling the OOM, not from it
    assert not is_oom(during)

    loop = RuntimeError("a")
    loop.__cause__ = RuntimeError("b")
    loop.__cause__.__cause__ = loop  # a cycle ends the walk
    assert not is_oom(loop)


def test_a_real_cpu_allocation_failure_is_oom():
    try:
        torch.empty(2**62, dtype=torch.uint8)  # 4 EiB: past any address space, fails at once
    except RuntimeError as error:
        assert is_oom(error), str(error)
        wrapped = RuntimeError("the training step failed")
        wrapped.__cause__ = error
        assert is_oom(wrapped)
    else:  # pragma: no cover - an allocator that lazily accepts 4 EiB
        pytest.skip("the CPU allocator accepted 2**62 bytes")


@pytest.mark.gpu
def test_a_real_cuda_allocation_failure_is_oom():
    free, _ = torch.cuda.mem_get_info()
    with pytest.raises(torch.OutOfMemoryError) as err:
        torch.empty(2 * free + 2**40, dtype=torch.uint8, device="cuda")
    assert is_oom(err.value)
