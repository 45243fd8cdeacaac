"""The dry run inside a training run, on models where extrapolation fails or fake tensors cannot go:
a sliding-window Mistral (the replay of short traces is caught disagreeing), and a module that reads
an activation's value (one warning, and the replay answers)."""

from __future__ import annotations

import warnings

import pytest
import torch

from conftest import make_trainer
from lightning_seqmem import Curriculum, SeqMemCallback
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule

pytest.importorskip("transformers")
from lightning_seqmem.reference.hf import HFCausalLM  # noqa: E402

MISTRAL = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 4, "sliding_window": 64,
           "max_position_embeddings": 4096}


def _fit(cb, module, max_steps, seq_len, batch_size=2):
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([cb], max_steps=max_steps).fit(
            module, SyntheticTokenDataModule(batch_size=batch_size, seq_len=seq_len,
                                             num_samples=64))
    return [str(w.message) for w in caught]


def test_a_sliding_window_fools_the_replay_not_the_dry_run():
    # traced inside the window (16, 32, 64); the target 512 is far beyond it
    cb = SeqMemCallback(warmup_steps=1, curriculum=Curriculum(
        start=16, target=512, steps_per_stage=2, multiple_of=16))
    module = HFCausalLM(model_type="mistral", config=MISTRAL, attn_implementation="sdpa")
    messages = _fit(cb, module, 9, 512)
    check = cb.planner.evidence.measured.replay_checks[()]
    assert check["seq_len"] == 512 and abs(check["relative_error"]) > cb.config.tolerance, check
    # no guessed cause (issue 21)
    assert any("The measured steps tell which one is right" in m for m in messages)
    assert cb.forecast(512).method == "dry_run"


class ItemGPT(LitGPT):
    """Reads a value computed in the step (fake tensors have none)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if loss.detach().abs().max().item() > 1e9:  # a real model's NaN guard, say
            raise RuntimeError("diverged")
        return loss


def test_a_model_the_dry_run_cannot_simulate_falls_back_once():
    cb = SeqMemCallback(warmup_steps=1, memory_budget="1GiB",
                        curriculum=Curriculum(start=16, target=64, steps_per_stage=2,
                                              multiple_of=16))
    messages = _fit(cb, ItemGPT(n_layer=1, d_model=32, n_head=2), 6, 64)
    said = [m for m in messages if "the dry run cannot simulate" in m]
    assert len(said) == 1 and ".item()" in said[0]
    assert [r.seq_len for r in cb.records] == [16, 16, 32, 32, 64, 64]
    assert cb.forecast(128).method == "replay"
