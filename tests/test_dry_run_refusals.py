"""A dry-run refusal is per shape and reason (issue 21): a model that fake tensors cannot run past
some length keeps its dry runs at every shorter length, and the refusal is said once, with why."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from conftest import fit_messages
from lightning_seqmem import Curriculum, SeqMemCallback
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule


class RefusesPast64(LitGPT):
    """Past 64 tokens a guard reads an activation's value; fake tensors have none: no dry run."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch["input_ids"].shape[1] > 64 and isinstance(loss, FakeTensor):
            if loss.detach().abs().max().item() > 1e9:  # a NaN guard, say, only on long batches
                raise RuntimeError("diverged")
        return loss


def test_a_refusal_at_a_long_length_keeps_the_shorter_dry_runs():
    cb = SeqMemCallback(warmup_steps=1, memory_budget="1GiB",
                        curriculum=Curriculum(start=16, target=128, steps_per_stage=2,
                                              multiple_of=16))
    torch.manual_seed(0)
    caught = fit_messages([cb], RefusesPast64(n_layer=1, d_model=32, n_head=2),
                          SyntheticTokenDataModule(batch_size=2, seq_len=128, num_samples=64),
                          max_steps=8)
    said = [m for m in caught if "the dry run cannot simulate" in m]
    assert (len(said) == 1 and ".item()" in said[0]
            and "shorter lengths keep their dry runs" in said[0]), said
    assert [r.seq_len for r in cb.records] == [16, 16, 32, 32, 64, 64, 128, 128]
    planner = cb.planner
    # refused there (and beyond)
    assert planner.evidence.dry.peak(128, 2) is None and planner.evidence.dry.peak(256, 2) is None
    for L in (16, 32, 48, 64):  # asked after the refusal at 128: each shorter length still answers
        assert planner.evidence.dry.peak(L, 2) is not None, L
    assert cb.forecast(64, 2).method == "dry_run"
    fc = cb.forecast(256, 2)  # the replay answers, and says why the dry run did not
    assert fc.method == "replay" and "dry run refused" in fc.detail and ".item()" in fc.detail
    assert len([m for m in caught if "the dry run cannot simulate" in m]) == 1


def test_a_tuple_batch_under_a_curriculum_warns_once_and_the_curriculum_holds():
    """README's rule for a batch that cannot be cut (a tuple, no `set_seq_len`): one warning, the
    record has the length that ran, the curriculum holds. It raised TypeError from
    on_train_batch_start."""
    from torch.utils.data import DataLoader

    from test_user_truth import TupleGPT, TupleTokens, tuple_collate

    class NoSetter(TupleTokens):
        set_seq_len = None

    cb = SeqMemCallback(warmup_steps=1, dry_run=False,
                        curriculum=Curriculum(start=16, target=64, steps_per_stage=2))
    caught = fit_messages([cb], TupleGPT(n_layer=1, d_model=32, n_head=2),
                          DataLoader(NoSetter(), batch_size=4, collate_fn=tuple_collate),
                          max_steps=4)
    said = [m for m in caught if "could not be cut" in m]
    assert len(said) == 1 and "set_seq_len" in said[0] and "dicts or lists" in said[0], said
    # what ran; held at the first stage
    assert [r.seq_len for r in cb.records] == [64] * 4 and cb.seq_len == 16
