"""What the callback records is what ran: a batch the curriculum cannot cut is recorded at its real
length, with one warning, never at the stage's length."""

from __future__ import annotations

import warnings

import torch
from torch.utils.data import DataLoader

from conftest import make_trainer
from lightning_seqmem import Curriculum, SeqMemCallback
from lightning_seqmem.reference.demo import LitGPT


class TensorBatchGPT(LitGPT):
    """Takes a bare ``[B, L]`` token tensor as its batch (next-token targets from the same row)."""

    def training_step(self, batch, batch_idx):
        return super().training_step({"input_ids": batch[:, :-1], "labels": batch[:, 1:]},
                                     batch_idx)


def test_a_bare_tensor_batch_is_recorded_at_the_length_that_ran():
    data = torch.randint(0, 256, (64, 65))
    cb = SeqMemCallback(warmup_steps=1,
                        curriculum=Curriculum(start=16, target=64, steps_per_stage=2))
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([cb], max_steps=6).fit(TensorBatchGPT(n_layer=1, d_model=32, n_head=2),
                                            DataLoader(data, batch_size=4))
    # nothing was cut, and no record says otherwise
    assert [r.seq_len for r in cb.records] == [65] * 6
    said = [str(w.message) for w in caught if "the curriculum asked for" in str(w.message)]
    assert said and all("65 tokens" in m for m in said)


def test_seq_len_fn_returning_nonsense_is_a_clear_error_before_training():
    cb = SeqMemCallback(seq_len_fn=lambda batch: None)
    data = torch.randint(0, 256, (16, 33))
    try:
        make_trainer([cb], max_steps=1).fit(TensorBatchGPT(n_layer=1, d_model=32, n_head=2),
                                            DataLoader(data, batch_size=4))
    except ValueError as exc:
        assert "seq_len_fn" in str(exc) and "None" in str(exc)
    else:  # pragma: no cover - the test fails
        raise AssertionError("expected a ValueError naming seq_len_fn")
