"""Encoder-decoder: the decoder's ``labels [B, L/2]`` keep their ratio to the encoder length.

A random Hugging Face T5 (SDPA, no download), its decoder at half the encoder's length: the
curriculum cuts both, the dry run tiles both, and the replay and the quadratic fit see both grow.
Before, the labels stayed at the data's length in the traced steps and in the dry run: the dry run
and the replay under-predicted the decoder at long lengths (−27% at 1024 on this model).
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch

from lightning_seqmem import SeqMemCallback
from lightning_seqmem.measure.batch import cut_batch
from lightning_seqmem.core.curriculum import Curriculum
from lightning_seqmem.measure.steps import training_step_memory
from lightning_seqmem.measure.probes import make_probe

transformers = pytest.importorskip("transformers")

VOCAB = 8192  # a large vocabulary: the decoder's logits [B, L/2, V] are a good part of the peak


class T5Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                       num_decoder_layers=2, num_heads=1, dropout_rate=0.0,
                                       decoder_start_token_id=0, pad_token_id=0)
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        self.model = transformers.T5ForConditionalGeneration(config)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def t5_batch(seq_len: int, batch_size: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seq_len)
    return {"input_ids": torch.randint(1, VOCAB, (batch_size, seq_len), generator=g),
            "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
            "labels": torch.randint(1, VOCAB, (batch_size, seq_len // 2), generator=g)}


class _Samples(torch.utils.data.Dataset):
    def __init__(self, seq_len: int, n: int) -> None:
        self.seq_len, self.n = seq_len, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return {k: v[0] for k, v in t5_batch(self.seq_len).items()}


def measured_peak(seq_len: int) -> int:
    """A real step of a fresh module at (seq_len, labels seq_len // 2), after an unmeasured one."""
    module = T5Module()
    optimizer = module.configure_optimizers()
    batch = t5_batch(seq_len)
    step = lambda model, b: model.training_step(b, 0)  # noqa: E731
    training_step_memory(module, optimizer, batch, step)
    return training_step_memory(module, optimizer, batch, step,
                                make_probe("tracker", torch.device("cpu"))).peak_bytes


def _fit(cb: SeqMemCallback, seq_len: int, max_steps: int) -> None:
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[cb], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(T5Module(), torch.utils.data.DataLoader(_Samples(seq_len, 4 * max_steps),
                                                            batch_size=1))


def test_cut_keeps_the_decoder_at_its_ratio():
    out = cut_batch(t5_batch(256), 64)
    assert {k: tuple(v.shape) for k, v in out.batch.items()} == {
        "input_ids": (1, 64), "attention_mask": (1, 64), "labels": (1, 32)}


@pytest.fixture(scope="module")
def measured() -> dict[int, int]:
    return {L: measured_peak(L) for L in (1024, 2048)}


def test_t5_forecasts_within_one_percent(measured):
    cb = SeqMemCallback(curriculum=Curriculum(start=64, target=256, steps_per_stage=3),
                        warmup_steps=1)
    _fit(cb, 256, max_steps=10)
    assert {r.seq_len for r in cb.records} == {64, 128, 256}
    for L, peak in measured.items():
        fc = cb.forecast(L, 1)
        assert fc.method == "dry_run"
        assert abs(fc.peak_bytes / peak - 1) < 0.01, (L, fc.peak_bytes, peak)
        replay = cb.forecaster.forecast(L, 1, method="replay")
        assert abs(replay.peak_bytes / peak - 1) < 0.01, (L, replay.peak_bytes, peak)


def test_t5_under_a_budget_no_step_over(measured):
    budget = (measured[1024] + measured[2048]) // 2  # 1024 tokens fit, 2048 do not
    cb = SeqMemCallback(memory_budget=budget, safety_margin=0.0, mitigations=(), warmup_steps=1,
                        curriculum=Curriculum(start=256, target=2048, steps_per_stage=2))
    _fit(cb, 2048, max_steps=10)
    assert max(r.peak_bytes for r in cb.records) <= cb.usable_budget_bytes
    # the curriculum went as far as the budget allows
    assert max(r.seq_len for r in cb.records) >= 1024
