"""Dry runs against the CUDA allocator: what fake tensors cannot see, and how it is added back.

On CUDA ``torch.cuda.max_memory_allocated`` counts more than the step's tensors: the cuBLAS and
cuBLASLt workspaces (65 MiB on an H200, resident from the first matrix product on) and scratch
buffers kernels take for themselves (the softmax backward: one output-sized block). The CPU tests
check the bookkeeping of a kernel's scratch on real tensors; the GPU tests compare the dry run with
the allocator's counters (run them with ``pytest -m gpu`` on a CUDA machine).
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_seqmem.reference.demo import LitGPT
from lightning_seqmem.dryrun.cuda import (cuda_kernel_scratch_bytes, resident_bytes,
                                          warm_cuda_workspaces)
from lightning_seqmem.dryrun.step import dry_run_step, replay_peaks
from lightning_seqmem.measure.steps import training_step_memory
from lightning_seqmem.measure.tracker import LiveTensorTracker
from lightning_seqmem.measure.probes import make_probe

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _softmax_step(scratch):
    x = torch.randn(4, 64, 64, requires_grad=True)
    tracker = LiveTensorTracker("cpu", record_events=True)
    tracker.scratch = scratch
    tracker.track_existing([x])
    with tracker:
        y = torch.softmax(x, dim=-1)
        y.backward(torch.ones_like(y))
    return tracker


def test_scratch_is_counted_at_its_op_and_freed_at_once():
    plain = _softmax_step(None)
    with_scratch = _softmax_step(cuda_kernel_scratch_bytes)
    block = 4 * 64 * 64 * 4  # the softmax backward's output, fp32
    # x, the saved output, the incoming gradient and the grad input are live while it runs: the peak
    assert plain.peak_bytes == 4 * block and with_scratch.peak_bytes == plain.peak_bytes + block
    assert with_scratch.live_bytes == plain.live_bytes  # nothing left behind
    ops = with_scratch.events.ops
    assert ([op for op in ops if op.endswith("(scratch)")]
            == ["aten::_softmax_backward_data (scratch)"])
    peak, _ = replay_peaks(with_scratch.events)
    assert peak == with_scratch.peak_bytes  # the replay sees the transient as the tracker did


def test_resident_bytes_is_zero_off_cuda():
    assert resident_bytes(torch.device("cpu"), [torch.ones(3)]) == 0


def _gpt(attention):
    torch.manual_seed(0)
    return LitGPT(n_layer=2, d_model=128, n_head=4, attention=attention, vocab_size=256).cuda()


def _batch(seq_len):
    tokens = torch.randint(0, 256, (4, seq_len + 1), device="cuda")
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


def _loss(model, batch):
    return model.training_step(batch, 0)


@pytest.mark.gpu
@needs_cuda
def test_workspaces_are_resident_after_warming():
    model = _gpt("sdpa")
    warm_cuda_workspaces(torch.device("cuda"))
    resident = resident_bytes(torch.device("cuda"), list(model.parameters()))
    optimizer = torch.optim.AdamW(model.parameters())
    batch = _batch(128)
    training_step_memory(model, optimizer, batch, _loss)
    after_a_step = resident_bytes(
        torch.device("cuda"), list(model.parameters()) + [batch["input_ids"], batch["labels"]]
        + [p.grad for p in model.parameters()]
        + [v for s in optimizer.state.values() for v in s.values()])  # fmt: skip
    assert resident > 0 and abs(after_a_step - resident) <= 0.1 * resident, (resident, after_a_step)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_dry_run_matches_the_allocator(attention):
    module = _gpt(attention)
    optimizer = torch.optim.AdamW(module.parameters())
    dry = dry_run_step(module, optimizer, _batch(32), 1024)
    module.cpu()  # only the measured copy on the device
    real = copy.deepcopy(module).cuda()
    opt = torch.optim.AdamW(real.parameters())
    batch = _batch(1024)
    training_step_memory(real, opt, batch, _loss)
    measured = training_step_memory(real, opt, batch, _loss,
                                    make_probe("cuda", torch.device("cuda")))
    assert abs(dry.peak_bytes - measured.peak_bytes) <= 0.01 * measured.peak_bytes, (
        dry.peak_bytes, measured.peak_bytes)


def test_replay_adds_what_the_allocator_counted_beyond_the_traced_tensors():
    """Traces made on the CPU and labelled as allocator traces (512-byte blocks) with a measured
    peak above the replay by ``a + c·L²``, as workspaces plus a kernel's scratch make it on CUDA."""
    from lightning_seqmem.core.forecast import MemoryForecaster
    from lightning_seqmem.measure.probes import TrackerProbe
    from lightning_seqmem.core.timeline import Trace

    w = torch.randn(16, 16, requires_grad=True)
    workspaces, scratch_per_token2 = 65 * 2**20, 64  # bytes; bytes per L²

    def traced(seq_len, block):
        probe = TrackerProbe("cpu")
        x = torch.randn(2, seq_len, 16)
        probe.start_step([w, x], record_events=True)
        probe.mark_phase("forward")
        loss = ((x @ w) @ x.transpose(1, 2)).softmax(-1).sum()
        probe.mark_phase("backward")
        loss.backward()
        w.grad = None
        m = probe.end_step()
        return Trace(seq_len, 2, m.events, block_bytes=block)

    exact = lambda L: workspaces + scratch_per_token2 * L * L  # noqa: E731
    cuda_like = MemoryForecaster()
    cpu = MemoryForecaster()
    for L in (32, 64, 128):
        cpu.add_trace(traced(L, 1))
        cuda_like.add_trace(traced(L, 512))
    for t in cuda_like.traces:  # measured = replayed tensors + what the allocator adds
        t.measured_peak_bytes = (cuda_like.timeline.predict(t.seq_len, 2).peak_bytes
                                 + exact(t.seq_len))
    for t in cpu.traces:
        t.measured_peak_bytes = cpu.timeline.predict(t.seq_len, 2).peak_bytes
    base = cuda_like.timeline.predict(512, 2).peak_bytes
    got = cuda_like.forecast(512, 2).peak_bytes - base
    # a + c·L² is recovered at 4x the longest trace
    assert abs(got - exact(512)) <= 2, (got, exact(512))
    # the tracker: nothing added
    assert cpu.forecast(512, 2).peak_bytes == cpu.timeline.predict(512, 2).peak_bytes
