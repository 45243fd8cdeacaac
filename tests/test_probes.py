"""The probes measure real memory: the tracker agrees with torch's MemTracker on the same step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from conftest import make_trainer
from lightning.pytorch.callbacks import Callback
from lightning_seqmem import SeqMemCallback
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.mitigations.checkpointing.checkpointing import ActivationCheckpointing
from lightning_seqmem.reference.nn import GPT, GPTConfig
from lightning_seqmem.measure.steps import training_step_memory
from lightning_seqmem.dryrun.cuda import resident_bytes
from lightning_seqmem.measure.probes import (
    CudaAllocatorProbe, TrackerProbe, existing_tensors, make_probe)
from lightning_seqmem.measure.tracker import LiveTensorTracker

CPU = torch.device("cpu")
VARIANTS = [("eager", False), ("eager", True), ("sdpa", False), ("sdpa", True)]


def _loss(model, input_ids):
    return F.cross_entropy(model(input_ids).flatten(0, 1), input_ids.flatten())


def _step(model, optimizer, input_ids, probe=None):
    """One training step in Lightning's order, measured by ``probe`` (events recorded) if given."""
    return training_step_memory(model, optimizer, input_ids, _loss, probe, record_events=True)


def _memtracker_peak(model, optimizer, input_ids) -> int:
    mt = MemTracker()
    mt.track_external(model, optimizer, input_ids)
    with mt:
        _step(model, optimizer, input_ids)
    return mt.get_tracker_snapshot("peak")[CPU]["Total"]


@pytest.mark.parametrize("attention,checkpointing", VARIANTS)
def test_tracker_matches_memtracker_on_the_same_step(attention, checkpointing):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, d_model=64, n_head=4, attention=attention))
    if checkpointing:
        assert ActivationCheckpointing().apply(model).applied
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):  # warm-up: optimizer state and grads exist afterwards
        _step(model, optimizer, torch.randint(0, 256, (2, 64)))
    for seq_len in (64, 128):
        x = torch.randint(0, 256, (2, seq_len))
        ours = _step(model, optimizer, x, TrackerProbe("cpu"))
        reference = _memtracker_peak(model, optimizer, x)
        assert abs(ours.peak_bytes - reference) <= 0.02 * reference, (ours.peak_bytes, reference)
        phases = ours.phase_peak_bytes
        assert set(phases) == {"forward", "backward", "optimizer"}
        assert max(phases.values()) == ours.peak_bytes
        assert ours.start_bytes > 0 and ours.events is not None and ours.events.num_existing > 0


def test_tracker_counts_views_and_inplace_ops_once():
    base = torch.zeros(1024)  # untracked pre-existing tensor: its views are not new memory
    tracker = LiveTensorTracker("cpu")
    with tracker:
        view = base[:10]
        base.add_(1)
        new = base * 2
    assert tracker.peak_bytes == new.untyped_storage().nbytes() == 4096
    del view


def test_tracker_sees_frees_and_existing_tensors():
    w = torch.randn(256, 256)
    tracker = LiveTensorTracker("cpu", record_events=True)
    tracker.track_existing([w, w])  # counted once
    tracker.mark_phase("forward")
    with tracker:
        a = w @ w
        del a
        b = w + 1
    assert tracker.peak_bytes == 2 * w.nbytes
    assert tracker.live_bytes == 2 * w.nbytes  # w and b
    assert tracker.events.sequence == [0, 1, ~1, 2]
    assert tracker.events.ops[1:] == ["aten::mm", "aten::add.Tensor"]
    del b


class _MemTrackerReference(Callback):
    """Independent measurement of the same steps: torch's MemTracker around each batch.

    Listed before SeqMemCallback, it enters first (outer mode); the LightningModule's own
    ``on_train_batch_end`` (called after every callback's) closes it, so the modes nest properly.
    """

    def __init__(self):
        self.peaks: dict[int, int] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        mt = MemTracker()
        mt.track_external(pl_module, *trainer.optimizers, batch["input_ids"], batch["labels"],
                          batch["index"])
        mt.__enter__()
        pl_module._reference = (self, mt, batch_idx)


class _ReferencedLitGPT(LitGPT):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        reference, mt, idx = self._reference
        mt.__exit__(None, None, None)
        reference.peaks[idx] = mt.get_tracker_snapshot("peak")[CPU]["Total"]


@pytest.mark.parametrize("attention,checkpointing", VARIANTS)
def test_trainer_records_match_an_independent_measurement(attention, checkpointing):
    torch.manual_seed(0)
    model = _ReferencedLitGPT(n_layer=2, d_model=64, n_head=4, attention=attention)
    if checkpointing:
        ActivationCheckpointing().apply(model.model)
    reference, cb = _MemTrackerReference(), SeqMemCallback(warmup_steps=2)
    trainer = make_trainer([reference, cb], max_steps=6)
    trainer.fit(model, SyntheticTokenDataModule(batch_size=2, seq_len=96, num_samples=64))
    assert [r.step for r in cb.records] == list(range(6))
    assert [r.warmup for r in cb.records] == [True, True, False, False, False, False]
    for r in cb.records:
        if r.warmup:
            continue
        expected = reference.peaks[r.step]
        assert abs(r.peak_bytes - expected) <= 0.02 * expected, (r.step, r.peak_bytes, expected)
        assert r.seq_len == 96 and r.batch_size == 2
        assert r.forward_peak_bytes and r.backward_peak_bytes and r.optimizer_peak_bytes
        assert r.reserved_bytes is None and r.fragmentation_bytes is None  # no allocator on CPU


def test_make_probe_choices():
    assert make_probe("auto", CPU).name == "tracker"
    assert make_probe("tracker", CPU).name == "tracker"
    with pytest.raises(ValueError, match="probe='cuda'"):
        make_probe("cuda", CPU)
    with pytest.raises(ValueError, match="`probe` must be one of"):
        make_probe("nvml", CPU)


def test_cuda_probe_phase_glue_with_fake_counters(monkeypatch):
    """Hook glue only: the CUDA probe's phase bookkeeping, driven by scripted allocator counters.

    The counters themselves are read for real in the GPU test below and in benchmarks/gpu_check.py.
    """
    peaks = iter([100, 300, 200])  # forward, backward, optimizer
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 50)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: next(peaks))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d=None: 400)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 400)
    monkeypatch.setattr(
        torch.cuda,
        "memory_stats",
        lambda d=None: {"inactive_split_bytes.all.current": 7, "num_alloc_retries": 1,
                        "num_ooms": 0},
    )
    probe = CudaAllocatorProbe("cuda:0")
    probe.start_step([])
    for phase in ("forward", "backward", "optimizer"):
        probe.mark_phase(phase)
    m = probe.end_step()
    assert m.phase_peak_bytes == {"forward": 100, "backward": 300, "optimizer": 200}
    assert m.peak_bytes == 300 and m.reserved_bytes == 400
    assert m.fragmentation_bytes == 100 and m.fragmentation_fraction == 0.25
    assert (m.inactive_split_bytes, m.alloc_retries, m.num_ooms) == (7, 1, 0)


@pytest.mark.gpu
def test_cuda_probe_matches_torch_cuda_counters():
    device = torch.device("cuda")
    model = GPT(GPTConfig(n_layer=2, d_model=128, n_head=4, attention="sdpa")).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 256, (4, 512), device=device)
    for _ in range(2):
        training_step_memory(model, optimizer, x, _loss)
    # independent reading of an identical step: one reset before, one read after
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    training_step_memory(model, optimizer, x, _loss)
    torch.cuda.synchronize()
    reference = torch.cuda.max_memory_allocated()
    m = _step(model, optimizer, x, CudaAllocatorProbe(device))  # phase peaks, tracer alongside
    assert abs(m.peak_bytes - reference) <= 0.01 * reference, (m.peak_bytes, reference)
    assert set(m.phase_peak_bytes) == {"forward", "backward", "optimizer"}
    assert (m.reserved_bytes >= m.peak_bytes
            and m.fragmentation_bytes == m.reserved_bytes - m.peak_bytes)
    # the tracer saw the same tensors: its live-byte peak cannot exceed what the allocator held,
    # and what it misses is what the allocator holds outside them (cuBLAS workspaces) plus the
    # kernels' own scratch buffers (SDPA here: none of size)
    outside = resident_bytes(device, existing_tensors(model, [optimizer], x))
    tracked = TrackerProbe("cuda")
    traced = _step(model, optimizer, x, tracked)
    assert traced.peak_bytes <= m.peak_bytes
    assert m.peak_bytes - outside - traced.peak_bytes <= 0.05 * m.peak_bytes, (
        m.peak_bytes, outside, traced.peak_bytes)
