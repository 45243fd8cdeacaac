"""Lightning's own demo model, ``lightning.pytorch.demos.Transformer`` (an ``nn.Transformer``
encoder-decoder that caches its positional table and causal mask as plain module attributes), with
tuple batches from a dataset with ``set_seq_len`` and synthetic tokens: dry runs at long lengths,
module-attribute tensors counted as existing memory, and every batch at its stage's length."""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch.demos import LightningTransformer, Transformer
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from conftest import make_trainer
from lightning_seqmem import Curriculum, SeqMemCallback
from lightning_seqmem.dryrun.step import dry_run_step
from lightning_seqmem.measure.steps import training_step_memory
from lightning_seqmem.measure.tracker import LiveTensorTracker
from lightning_seqmem.measure.probes import TrackerProbe, existing_tensors

VOCAB = 64


class DemoTransformer(LightningTransformer):
    """Lightning's demo module (its own ``training_step`` and ``configure_optimizers``), tiny, on
    synthetic data (no WikiText2 download)."""

    def __init__(self, max_len: int = 8200, **sizes) -> None:
        super().__init__(vocab_size=VOCAB)
        self.model = Transformer(
            vocab_size=VOCAB, **{**dict(ninp=8, nhead=1, nhid=8, nlayers=1, dropout=0.0), **sizes})
        self.model.pos_encoder.max_len = max_len  # the demo reads pe[:, L]: more than L positions

    def prepare_data(self) -> None:
        pass


class Tokens(Dataset):
    """``(inputs, targets)`` rows of random tokens; ``set_seq_len`` sets the next rows' length."""

    def __init__(self, num_samples: int = 64, seq_len: int = 1024) -> None:
        self.data = torch.randint(0, VOCAB, (num_samples, seq_len + 1),
                                  generator=torch.Generator().manual_seed(0))
        self.seq_len = seq_len

    def set_seq_len(self, seq_len: int) -> None:
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        row = self.data[i, : self.seq_len + 1]
        return row[:-1], row[1:]


def tuples(rows):
    # default_collate makes a list, which the callback cuts in place
    return tuple(default_collate(rows))


def _batch(seq_len: int):
    x = torch.randint(0, VOCAB, (1, seq_len + 1), generator=torch.Generator().manual_seed(1))
    return x[:, :-1], x[:, 1:]


def _measured(model, batch) -> int:
    """Peak of a real step after a warm-up one (Lightning's order), by the live-tensor tracker."""
    optimizer = model.configure_optimizers()
    step = lambda m, b: m.training_step(b, 0)  # noqa: E731
    training_step_memory(model, optimizer, batch, step)
    return training_step_memory(model, optimizer, batch, step, TrackerProbe("cpu")).peak_bytes


class CountedDemo(DemoTransformer):
    """The demo module counting each step's peak with its own tracker, independently of the
    callback: from its ``on_train_batch_start`` (after every callback's: dry runs done, the
    callback's tracker entered) to the end of its ``optimizer_step`` (before the callback's
    ``on_train_batch_end``)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.tracker, self.peaks = None, []  # (tokens, peak bytes) of every step

    def on_train_batch_start(self, batch, batch_idx):
        self.tracker = LiveTensorTracker("cpu")
        self.tracker.track_existing(existing_tensors(self, self.trainer.optimizers, batch))
        self.tracker.__enter__()
        self._tokens = batch[0].shape[1]

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        tracker, self.tracker = self.tracker, None
        tracker.__exit__(None, None, None)
        tracker.stop()
        assert tracker.error is None
        self.peaks.append((self._tokens, tracker.peak_bytes))


def _fit(cb, dataset, max_steps, model=None):
    model = model or CountedDemo()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer([cb], max_steps=max_steps).fit(
            model, DataLoader(dataset, batch_size=1, collate_fn=tuples))
    return getattr(model, "peaks", None)


def test_module_attribute_tensors_are_existing_memory():
    model, batch = DemoTransformer(), _batch(256)
    optimizer = model.configure_optimizers()
    model.training_step(batch, 0).backward()  # creates the cached pe and src_mask
    cached = [model.model.pos_encoder.pe, model.model.src_mask]
    assert all(isinstance(t, torch.Tensor) for t in cached)
    keys = {t.untyped_storage()._cdata for t in existing_tensors(model, [optimizer], batch)}
    assert {t.untyped_storage()._cdata for t in cached} <= keys
    probe = TrackerProbe("cpu")
    probe.start_step(existing_tensors(model, [optimizer], batch))
    start = probe.end_step().start_bytes
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in
                [*model.parameters(), *(p.grad for p in model.parameters()), *cached, *batch]}
    expected = sum(storages.values())  # (the two halves of the batch share one storage)
    assert start == expected
    # the dry run counts them too: after a real step, its figure is the measured one to the byte
    long = _batch(1024)
    measured = _measured(model, long)
    assert dry_run_step(model, optimizer, long, 1024).peak_bytes == measured


def test_demo_is_dry_run_at_long_lengths():
    # nn.TransformerDecoder reads its [L, L] mask's values (is it causal?): 16 MiB at 2048 tokens,
    # 256 MiB at 8192; with a fixed 8 MiB limit the dry run refused the demo from 2048 tokens on
    measured = _measured(DemoTransformer(), _batch(2048))
    cb = SeqMemCallback(warmup_steps=1, curriculum=Curriculum(
        start=64, target=128, steps_per_stage=2, multiple_of=64))
    _fit(cb, Tokens(num_samples=8, seq_len=128), 4, DemoTransformer())
    at_2048, at_8192 = cb.forecast(2048, 1), cb.forecast(8192, 1)
    assert at_2048.method == at_8192.method == "dry_run", (at_2048.detail, at_8192.detail)
    assert abs(at_2048.peak_bytes / measured - 1) < 0.01, (at_2048.peak_bytes, measured)
    assert at_8192.peak_bytes > 12 * at_2048.peak_bytes  # the [L, L] masks: ~quadratic


# real steps at 4096 tokens (290 MiB); 8192 (1.1 GiB): benchmarks/demo_transformer.py
@pytest.mark.slow
def test_demo_dry_run_at_4096_is_the_measured_step():
    measured = _measured(DemoTransformer(), _batch(4096))
    dry = dry_run_step(DemoTransformer(), None, _batch(64), 4096).peak_bytes
    assert abs(dry / measured - 1) < 0.01, (dry, measured)


def test_tuple_batches_through_the_dataset_arrive_at_their_stage_length_within_budget():
    # before, the first batch was fetched before the first stage's length was set (step 0 ran at the
    # data's 512 tokens, over the budget) and every stage's first batch came at the previous length
    p256, p512 = (_measured(DemoTransformer(), _batch(256)),
                  _measured(DemoTransformer(), _batch(512)))
    usable = (p256 + p512) // 2
    cb = SeqMemCallback(warmup_steps=1, memory_budget=usable, safety_margin=0.0, mitigations=(),
                        curriculum=Curriculum(start=64, target=256, steps_per_stage=2,
                                              multiple_of=64))
    peaks = _fit(cb, Tokens(num_samples=16, seq_len=512), 7)
    assert [L for L, _ in peaks] == [64, 64, 128, 128, 256, 256, 256], peaks
    over = [(L, p) for L, p in peaks if p > usable]
    assert not over, (usable, over)
    assert [r.seq_len for r in cb.records] == [L for L, _ in peaks]


class _Stream(IterableDataset):
    def __init__(self):
        self.tokens = Tokens(num_samples=8, seq_len=256)

    def set_seq_len(self, seq_len):
        self.tokens.set_seq_len(seq_len)

    def __iter__(self):
        return (self.tokens[i] for i in range(len(self.tokens)))


def test_tuple_batches_from_an_unsized_stream_are_refused_before_the_first_step():
    # Lightning fetches one batch ahead from a loader without a length: the length set through the
    # dataset would always come one batch late
    cb = SeqMemCallback(curriculum=Curriculum(start=64, target=128, steps_per_stage=2,
                                              multiple_of=64))
    model = DemoTransformer()
    with pytest.raises(ValueError, match="__len__"):
        _fit(cb, _Stream(), 4, model)
    assert not cb.records


def test_demo_refused_at_a_longer_length_still_dry_runs_the_shorter_ones():
    """Issue 21: one refusal is not a verdict. The demo's positional table has ``max_len`` rows: a
    dry run past them fails (the real step would too), and shorter lengths keep their dry runs. The
    forecast there says the model fails (issue 30: before, it gave the replay's figure)."""
    cb = SeqMemCallback(warmup_steps=1, curriculum=Curriculum(
        start=64, target=128, steps_per_stage=2, multiple_of=64))
    _fit(cb, Tokens(num_samples=8, seq_len=128), 4, DemoTransformer(max_len=1100))
    with pytest.raises(ValueError, match="IndexError: index 2048 is out of bounds"):  # no figure
        cb.forecast(2048, 1)
    after = [cb.forecast(L, 1) for L in (1024, 512)]
    assert [fc.method for fc in after] == ["dry_run", "dry_run"], [fc.detail for fc in after]
    assert after[0].peak_bytes > after[1].peak_bytes
