"""The curriculum under a memory budget: forecast each stage, never enter one that won't fit.

The integration test on a real model with real measurement; the decisions' unit tests are their
millisecond twins in tests/test_planner_twins.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset, default_collate

from conftest import make_trainer
from lightning.pytorch.loggers import CSVLogger
from lightning_seqmem import Curriculum, MemoryBudgetError, PredictedOOMWarning, SeqMemCallback
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule, SyntheticTokens

MODEL = dict(n_layer=2, d_model=64, n_head=4)
STAGES = dict(start=32, target=512, steps_per_stage=3, multiple_of=16)


def _measured_peak(attention: str, seq_len: int) -> int:
    """Peak of a training step at ``seq_len``, measured separately by a fresh run."""
    cb = SeqMemCallback(warmup_steps=2)
    torch.manual_seed(0)
    make_trainer([cb], max_steps=3).fit(
        LitGPT(attention=attention, **MODEL),
        SyntheticTokenDataModule(batch_size=2, seq_len=seq_len, num_samples=16)
    )
    return cb.records[-1].peak_bytes


def _run(attention: str, budget: int, max_steps: int = 21, **kwargs):
    kwargs.setdefault("mitigations", ())  # warn and cap only: the ladder has its own tests
    cb = SeqMemCallback(warmup_steps=1, memory_budget=budget, safety_margin=0.0,
                        curriculum=Curriculum(**STAGES), **kwargs)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([cb], max_steps=max_steps).fit(
            LitGPT(attention=attention, **MODEL),
            SyntheticTokenDataModule(batch_size=2, seq_len=512, num_samples=64)
        )
    oom = [w for w in caught if issubclass(w.category, PredictedOOMWarning)]
    return cb, oom


@pytest.fixture(scope="module")
def eager_budget() -> int:
    """A budget between the eager peaks at 256 and 512 tokens: the curriculum stops in between."""
    return (_measured_peak("eager", 256) + _measured_peak("eager", 512)) // 2


@pytest.fixture(scope="module")
def eager_run(eager_budget):
    return _run("eager", eager_budget)


def test_eager_curriculum_stops_at_a_length_that_fits(eager_budget, eager_run):
    cb, oom = eager_run
    lengths = [r.seq_len for r in cb.records]
    assert max(r.peak_bytes for r in cb.records) <= eager_budget  # never measured above the budget
    cap = lengths[-1]
    assert 256 <= cap < 512 and cap % 16 == 0 and 512 not in lengths
    assert cb.planner.course.capped_at == cap and cb.seq_len == cap
    # the next stage, measured separately, would not have fit
    assert _measured_peak("eager", 512) > eager_budget
    # one warning, issued before the 512 stage would have started (at the end of the 256 stage)
    assert len(oom) == 1
    message = str(oom[0].message)
    assert ("seq_len=512" in message and "largest length forecast to fit" in message
            and "SDPA" in message)
    first_capped_step = lengths.index(cap) if cap != 256 else lengths.index(256) + 3
    assert first_capped_step == 12  # stages 32, 64, 128, 256 took 3 steps each
    # after the cap, training goes on at the cap
    assert lengths[12:] == [cap] * (len(lengths) - 12)


def test_sdpa_fits_further_under_the_same_budget(eager_budget, eager_run):
    eager, _ = eager_run
    sdpa, oom = _run("sdpa", eager_budget, max_steps=16)
    assert max(r.seq_len for r in sdpa.records) > max(r.seq_len for r in eager.records)
    assert max(r.peak_bytes for r in sdpa.records) <= eager_budget
    assert max(r.seq_len for r in sdpa.records) == 512 and not oom


def test_without_budget_problems_the_curriculum_reaches_the_target(tmp_path):
    cb = SeqMemCallback(warmup_steps=1, memory_budget="8GiB", curriculum=Curriculum(**STAGES))
    logger = CSVLogger(tmp_path, name="run")
    make_trainer([cb], max_steps=15, logger=logger, log_every_n_steps=1).fit(
        LitGPT(attention="sdpa", **MODEL),
        SyntheticTokenDataModule(batch_size=2, seq_len=512, num_samples=64)
    )
    assert [r.seq_len for r in cb.records] == [L for L in (32, 64, 128, 256, 512) for _ in range(3)]
    assert [r.stage for r in cb.records] == [i for i in range(5) for _ in range(3)]
    verified = {r.seq_len: (r.forecast_method, r.forecast_error) for r in cb.records
                if r.forecast_error is not None}
    # every stage was forecast first, by the dry run
    assert set(verified) == {32, 64, 128, 256, 512}
    assert all(method == "dry_run" and abs(e) <= 0.01 for method, e in verified.values())
    text = open(f"{logger.log_dir}/metrics.csv").read()
    for tag in ("seqmem/stage", "seqmem/forecast_next_gib", "seqmem/verification_error",
                "seqmem/headroom_fraction"):
        assert tag in text


def test_token_preserving_curriculum_keeps_every_token():
    cb = SeqMemCallback(warmup_steps=1, curriculum=Curriculum(
        start=16, target=64, steps_per_stage=2, truncate=False))
    make_trainer([cb], max_steps=6).fit(
        LitGPT(n_layer=1, d_model=32, n_head=2),
        SyntheticTokenDataModule(batch_size=2, seq_len=64, num_samples=32)
    )
    assert ([(r.seq_len, r.batch_size) for r in cb.records]
            == [(16, 8)] * 2 + [(32, 4)] * 2 + [(64, 2)] * 2)


def test_budget_below_the_parameters_stops_before_the_first_step():
    # (it used to warn and train every step over the budget, below the start: issue 23)
    cb = SeqMemCallback(memory_budget=1000, curriculum=Curriculum(
        start=16, target=64, steps_per_stage=2), mitigations=())
    trainer = make_trainer([cb], max_steps=6)
    with pytest.raises(MemoryBudgetError, match="parameters and buffers alone take"):
        trainer.fit(
            LitGPT(n_layer=1, d_model=32, n_head=2),
            SyntheticTokenDataModule(batch_size=2, seq_len=64, num_samples=32)
        )
    assert not cb.records and trainer.global_step == 0


class _TupleTokens(SyntheticTokens):
    def __getitem__(self, index):
        item = super().__getitem__(index)
        return item["input_ids"], item["labels"]


class _TupleLitGPT(LitGPT):
    def training_step(self, batch, batch_idx):
        input_ids, labels = batch
        return super().training_step({"input_ids": input_ids, "labels": labels}, batch_idx)


def test_tuple_batch_with_a_curriculum_warns_once_and_the_curriculum_holds():
    # README's rule for a batch that cannot be cut (issue 21): one warning, the length that ran, the
    # curriculum holds (this raised TypeError from on_train_batch_start and fit() died)
    cb = SeqMemCallback(curriculum=Curriculum(start=16, target=64))
    tokens = torch.randint(0, 256, (8, 65))
    dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])  # no set_seq_len
    loader = DataLoader(dataset, batch_size=2,
                        collate_fn=lambda items: tuple(default_collate(items)))
    with pytest.warns(UserWarning, match="tuple cannot change in place") as caught:
        make_trainer([cb], max_steps=2).fit(_TupleLitGPT(n_layer=1, d_model=32, n_head=2), loader)
    assert len([w for w in caught if "could not be cut" in str(w.message)]) == 1
    assert [r.seq_len for r in cb.records] == [64, 64] and cb.seq_len == 16


def test_tuple_batch_uses_the_dataset_length_setter():
    dataset = _TupleTokens(num_samples=64, seq_len=64)
    loader = DataLoader(dataset, batch_size=2,
                        collate_fn=lambda items: tuple(default_collate(items)))
    cb = SeqMemCallback(warmup_steps=1,
                        curriculum=Curriculum(start=16, target=64, steps_per_stage=3))
    make_trainer([cb], max_steps=9).fit(_TupleLitGPT(n_layer=1, d_model=32, n_head=2), loader)
    # the dataset changes length when asked, one batch ahead (before Lightning fetches the batch):
    # every batch, the first included, comes at its stage's length (it came a batch late before:
    # [64, 16, 16, 16, 16, 32, 32, 32, 32])
    assert [r.seq_len for r in cb.records] == [16, 16, 16, 32, 32, 32, 64, 64, 64]
    assert dataset.seq_len == 64
