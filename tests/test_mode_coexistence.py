"""The tracker coexists with another callback's dispatch mode held over the step (issue 21):
PyTorch's ``MemTracker`` and ``FlopCounterMode``, the other callback listed before or after ours.
Before, whichever of the two left first popped the other's mode: ours then recorded the other
callback's end-of-step work, or theirs stayed entered for the rest of the run."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.flop_counter import FlopCounterMode

from conftest import make_trainer
from lightning_seqmem import Curriculum, SeqMemCallback
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.measure.mode_stack import stack
from lightning_seqmem.measure.tracker import LiveTensorTracker


def _names() -> list[str]:
    return ["ours" if isinstance(m, LiveTensorTracker) else "theirs" for m in stack()]


class HoldsAMode(pl.Callback):
    """Enters its own dispatch mode at batch start and leaves it at batch end, as a profiler
    does."""

    def __init__(self, kind: str) -> None:
        self.kind, self.mode, self.results, self.stacks = kind, None, [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.mode = FlopCounterMode(display=False) if self.kind == "flops" else MemTracker()
        self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        mode, self.mode = self.mode, None
        before = _names()
        (torch.ones(4, 4) @ torch.ones(4, 4)).sum()  # its own end-of-step work, under its own mode
        mode.__exit__(None, None, None)
        self.stacks.append((before, _names()))
        self.results.append(mode.get_total_flops() if self.kind == "flops"
                            else mode.get_tracker_snapshot("peak"))


def _run(extra=None, ours_first=True):
    cb = SeqMemCallback(warmup_steps=1, dry_run=False,
                        curriculum=Curriculum(start=16, target=64, steps_per_stage=2))
    callbacks = [cb] if extra is None else ([cb, extra] if ours_first else [extra, cb])
    torch.manual_seed(0)
    make_trainer(callbacks, max_steps=6).fit(
        LitGPT(n_layer=1, d_model=32, n_head=2),
        SyntheticTokenDataModule(batch_size=2, seq_len=64, num_samples=32))
    return cb


@pytest.fixture(scope="module")
def alone():
    return [(r.seq_len, r.peak_bytes) for r in _run().records]


@pytest.mark.parametrize("ours_first", [True, False], ids=["ours-first", "theirs-first"])
@pytest.mark.parametrize("kind", ["flops", "memtracker"])
def test_another_callbacks_dispatch_mode(alone, kind, ours_first):
    other = HoldsAMode(kind)
    cb = _run(other, ours_first)
    assert stack() == []  # every mode left, none left behind
    assert [(r.seq_len, r.peak_bytes) for r in cb.records] == alone  # the same peaks as alone
    assert cb.forecaster.timeline is not None, cb.forecaster.timeline_unavailable_reason
    assert len(other.results) == 6
    # at their batch end, before and after their exit: their mode on top, ours below it or gone
    # already
    want = (["theirs"], []) if ours_first else (["ours", "theirs"], ["ours"])
    assert other.stacks == [want] * 6, other.stacks
    if kind == "flops":
        assert all(f > 0 for f in other.results)
