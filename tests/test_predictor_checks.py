"""Every predictor answers to the measurements (issue 21): a dry run that misses measured steps is
not trusted for decisions, whichever predictor it is, and that is said once, naming it and the
miss."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from conftest import fit_messages
from lightning_seqmem import Curriculum, SeqMemCallback
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule


class FakeBlindGPT(LitGPT):
    """Deliberately mis-shaped for the dry run: a real step holds an extra ``[B, 32, L, L]`` buffer
    and its gradient through backward; a step on fake tensors does not (the dry run cannot see
    it)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if not isinstance(loss, FakeTensor):
            B, L = batch["input_ids"].shape
            extra = torch.ones(B, 32, L, L, requires_grad=True)
            loss = loss + 0 * extra.sum()
        return loss


def test_a_dry_run_wrong_at_measured_shapes_is_not_trusted():
    # measured: 128 tokens peak at 10.4 MB, 256 at 37.8 MB; the dry run says 256 peak at 4.2 MB
    cb = SeqMemCallback(warmup_steps=1, memory_budget="12MiB", safety_margin=0.0, mitigations=(),
                        curriculum=Curriculum(start=16, target=256, steps_per_stage=2,
                                              multiple_of=16))
    torch.manual_seed(0)
    caught = fit_messages([cb], FakeBlindGPT(n_layer=1, d_model=32, n_head=2),
                          SyntheticTokenDataModule(batch_size=2, seq_len=256, num_samples=64),
                          max_steps=12)
    messages = [m for m in caught if "seqmem" in m]
    # the budget held: decisions followed the replay (exact on the measured steps), not the dry run
    assert max(r.peak_bytes for r in cb.records) <= cb.usable_budget_bytes
    assert max(r.seq_len for r in cb.records) == 128
    said = [m for m in messages if "not trusted for decisions" in m]
    assert len(said) == 1 and "the dry run predicted" in said[0] and "-38." in said[0], said
    assert not any("program changes" in m for m in messages)  # no guessed cause
    fc = cb.forecast(256, 2)
    assert fc.method == "replay" and "dry run not trusted" in fc.detail
    measured_128 = max(r.peak_bytes for r in cb.records if r.seq_len == 128)
    assert cb.forecast(128, 2).peak_bytes == measured_128  # the replay, right where it was measured
