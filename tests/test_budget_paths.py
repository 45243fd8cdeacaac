"""Issue 30: the budget holds on every path, counted by a judge that sees the callback's own memory.

Every test here counts the steps over the usable budget with :class:`step_window.StepWindows`: the
profiler's allocator events over each step window, from the first callback's
``on_train_batch_start`` to the last callback's ``on_train_batch_end`` (so a dry run's real value
twins, a kept batch copy and a check's forwards are in it), beside the callback's own records. The
settings are the issue's: Lightning's demo Transformer with tuple batches and ``set_seq_len``; PEFT
LoRA on a tiny Hugging Face Llama with ``fused_loss`` allowed (both wrapper kinds);
``accumulate_grad_batches=4``; a ``training_step`` that counts its samples under micro-batching;
2 gloo ranks with batches of 4 and 1 (:mod:`test_budget_ddp`).
"""

from __future__ import annotations

import collections
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from conftest import make_trainer
from step_window import StepWindows
from test_demo_transformer import DemoTransformer, Tokens, tuples
from lightning_seqmem import Curriculum, SeqMemCallback
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.trainer.own_memory import resident_bytes

MIB = 2**20


def _fit(cb, model, data, max_steps, **trainer_kwargs):
    """``(windows, warnings)`` of a fit of ``model`` on ``data``, ``cb`` inside the step windows."""
    windows = StepWindows()
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(windows.around(cb), max_steps=max_steps, **trainer_kwargs).fit(model, data)
    return windows, [str(w.message) for w in caught]


def _over(windows, cb):
    """Windows and records over the usable budget: both must be none."""
    usable = cb.usable_budget_bytes
    records = [(r.step, r.seq_len, r.peak_bytes) for r in cb.records if r.peak_bytes > usable]
    return windows.over(usable), records


# -- 1. what the callback allocates itself: the demo Transformer, tuples, set_seq_len --------------
def test_demo_transformer_dry_runs_stay_within_the_budget_on_a_cpu_run():
    # the demo reads its [L, L] masks' values (nn.TransformerDecoder's causal check): the dry run
    # keeps real twins of them, which on a CPU run are the device's memory. Unbounded, a dry run
    # looking ahead in the batch start of a 512-token step took the window to 18.5 MiB of a 12 MiB
    # budget (the records said 4.5); now they are held within what the budget leaves
    curriculum = Curriculum(start=128, target=1024, steps_per_stage=2, multiple_of=64)
    cb = SeqMemCallback(warmup_steps=1, memory_budget="12MiB", safety_margin=0.0,
                        curriculum=curriculum)
    data = DataLoader(Tokens(num_samples=32, seq_len=1024), batch_size=1, collate_fn=tuples)
    windows, _ = _fit(cb, DemoTransformer(), data, 8)
    assert _over(windows, cb) == ([], [])
    records = {r.step: r.peak_bytes for r in cb.records}
    peaks = windows.peaks()
    assert len(peaks) == 8 and all(peaks[i] >= records[i] for i in records)  # and holds its step
    assert peaks[0] > 4 * records[0]  # and the dry runs in its batch start: the judge sees them


def test_a_forecast_past_the_demo_positional_table_says_the_model_fails():
    # issue 30 (8): the demo's PositionalEncoding has 5000 rows and reads pe[:, L]: at 8192 tokens
    # its step fails (IndexError); the forecast said 21 GB "by replay"
    cb = SeqMemCallback(warmup_steps=1, curriculum=_SHORT)
    _fit(cb, DemoTransformer(max_len=5000), _short_data(), 4)
    assert cb.forecast(4096, 1).method == "dry_run"
    with pytest.raises(ValueError, match=r"seq_len=8192.*IndexError.*out of bounds"):
        cb.forecast(8192, 1)


def _short_data():
    return DataLoader(Tokens(num_samples=8, seq_len=128), batch_size=1, collate_fn=tuples)


_SHORT = Curriculum(start=64, target=128, steps_per_stage=2, multiple_of=64)


# -- 3. PEFT: rungs on the real module structure ---------------------------------------------------
class PeftLM(pl.LightningModule):
    """LoRA on a tiny random Llama (nothing downloaded): ``kind="causal"`` through
    ``get_peft_model`` (a ``PeftModelForCausalLM``), ``"plain"`` a bare ``PeftModel``."""

    def __init__(self, kind: str, vocab_size: int = 4096) -> None:
        super().__init__()
        from peft import LoraConfig, PeftModel, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        base = LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024))
        task = "CAUSAL_LM" if kind == "causal" else None
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type=task)
        self.model = get_peft_model(base, config) if kind == "causal" else PeftModel(base, config)

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def _peft_peak(kind: str, mitigations=()) -> int:
    """The fitted peak of a real step of ``kind`` at 256 tokens, batch 2, from a separate run."""
    cb = SeqMemCallback(warmup_steps=1, dry_run=False, memory_budget=None)
    model = PeftLM(kind)
    from lightning_seqmem.mitigations import ladder

    for name in mitigations:
        assert ladder.apply(name, None, model).applied
    make_trainer([cb], max_steps=2).fit(model, _peft_data(8))
    return cb.records[-1].peak_bytes


def _peft_data(num_samples):
    return SyntheticTokenDataModule(batch_size=2, seq_len=256, num_samples=num_samples,
                                    vocab_size=4096)


@pytest.mark.parametrize("kind", ["causal", "plain"])
def test_peft_lora_takes_the_fused_loss_within_the_budget(kind):
    # before, on a PeftModelForCausalLM the rung took the wrapper for the causal LM and passed its
    # logits as hidden states (ValueError out of fit()); on a plain PeftModel it was refused unsaid
    pytest.importorskip("peft")
    plain, fused = _peft_peak(kind), _peft_peak(kind, ("fused_loss",))
    assert fused < 0.8 * plain  # a 4096-token vocabulary: the logits are most of the step
    usable = (plain + fused) // 2
    cb = SeqMemCallback(warmup_steps=1, memory_budget=usable, safety_margin=0.0,
                        mitigations=("fused_loss",))
    windows, messages = _fit(cb, PeftLM(kind), _peft_data(16), 4)
    assert cb.applied_mitigations == ("fused_loss",), messages
    assert _over(windows, cb) == ([], [])
    # the dry run's copy of the first batch: on a CPU run, the device's
    own = resident_bytes(cb.edge)
    assert 0 < own < 10_000
    assert [r.peak_bytes for r in cb.records[1:]] == [fused + own] * 3  # each with the fused loss
    assert abs(cb.forecast(256, 2, ("fused_loss",)).peak_bytes / (fused + own) - 1) < 0.01


def test_peft_fused_loss_is_the_plain_loss():
    pytest.importorskip("peft")
    from lightning_seqmem.mitigations import ladder

    ids = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids}
    for kind in ("causal", "plain"):
        model = PeftLM(kind)
        plain = model.training_step(batch, 0)
        result = ladder.apply("fused_loss", None, model)
        assert result.applied, result.detail
        assert torch.allclose(model.training_step(batch, 0), plain, atol=1e-5), kind


def test_a_forecast_never_claims_a_rung_that_does_not_apply():
    # the demo Transformer is no causal LM the fused loss knows: before, a forecast with
    # mitigations=("fused_loss",) returned the plain figure labelled as a dry run with fused_loss
    cb = SeqMemCallback(warmup_steps=1, curriculum=_SHORT)
    _fit(cb, DemoTransformer(), _short_data(), 4)
    assert cb.forecast(512, 1).method == "dry_run"
    with pytest.raises(ValueError, match="fused_loss does not apply to this model"):
        cb.forecast(512, 1, mitigations=("fused_loss",))


# -- 4. gradient accumulation: the window's worst batch is judged ----------------------------------
def _eager_llama():
    from lightning_seqmem.reference.hf import HFCausalLM

    torch.manual_seed(0)
    config = {"hidden_size": 192, "intermediate_size": 384, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256}
    return HFCausalLM(config=config, attn_implementation="eager")


def _llama_data():
    return SyntheticTokenDataModule(batch_size=2, seq_len=512, num_samples=64)


def test_accumulation_forecasts_the_window_s_last_batch_and_judges_by_it():
    # under accumulate_grad_batches=4 a window's later batches keep the earlier batches' gradients
    # through their backward: 3.3% above the first batch here. The dry run modelled the first batch
    # (gradients zeroed after its forward): with a budget between the two every later batch ran over
    cb = SeqMemCallback(warmup_steps=1)
    make_trainer([cb], max_steps=2, accumulate_grad_batches=4).fit(_eager_llama(), _llama_data())
    first, later, last = (cb.records[i].peak_bytes for i in (4, 5, 7))
    assert later == last > 1.02 * first
    dry = cb.forecast(512, 2)
    assert dry.method == "dry_run" and abs(dry.peak_bytes / last - 1) < 1e-4, (dry.peak_bytes, last)

    usable = int(first * 1.025)  # the first batch with the dry run's 2% fits; the later ones do not
    cb = SeqMemCallback(warmup_steps=1, memory_budget=usable, safety_margin=0.0,
                        mitigations=("checkpointing",))
    windows, _ = _fit(cb, _eager_llama(), _llama_data(), 3, accumulate_grad_batches=4)
    assert len(windows.peaks()) == 12 and _over(windows, cb) == ([], [])
    # judged over before the first batch: a level of checkpointing from the first step on
    assert all(len(r.mitigations) == 1 and r.mitigations[0].startswith("checkpointing")
               for r in cb.records)


# -- 5. the user's training_step once per sample under micro-batching ------------------------------
class CountingGPT(LitGPT):
    """Counts the samples its ``training_step`` sees (a side effect, as a metric's update is)."""

    def __init__(self) -> None:
        super().__init__(n_layer=1, d_model=32, n_head=2)
        self.samples_seen = 0

    def training_step(self, batch, batch_idx):
        self.samples_seen += int(batch["input_ids"].shape[0])
        return super().training_step(batch, batch_idx)


def test_training_step_runs_once_per_sample_under_micro_batching():
    # micro-batching's first-split check ran training_step three more times on the user's module
    # (324 samples counted for 320); it runs on its own copy now
    reference = SeqMemCallback(warmup_steps=1, dry_run=False)
    data = SyntheticTokenDataModule(batch_size=4, seq_len=256, num_samples=32)
    make_trainer([reference], max_steps=2).fit(CountingGPT(), data)
    usable = int(reference.records[-1].peak_bytes * 0.8)
    cb = SeqMemCallback(warmup_steps=1, memory_budget=usable, safety_margin=0.0,
                        mitigations=("microbatch",))
    model = CountingGPT()
    data = SyntheticTokenDataModule(batch_size=4, seq_len=256, num_samples=64)
    windows, _ = _fit(cb, model, data, 6)
    assert cb.applied_mitigations == ("microbatch",)
    assert model.training_step.verified  # the check ran (on the copy) and passed
    assert model.samples_seen == 6 * 4
    assert _over(windows, cb) == ([], [])


# -- 6. Hugging Face BatchEncoding batches, left padded --------------------------------------------
def _left_padded(num_samples: int = 32, length: int = 256):
    """Batches of 4 as a tokenizer gives them: ``BatchEncoding``, 1 to 95 pad tokens on the left
    of each row (so a curriculum's cut to 128 keeps real tokens only; the full length has pads)."""
    from transformers import BatchEncoding

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (num_samples, length), generator=g)
    mask = torch.ones_like(ids)
    for row, pads in enumerate(torch.randint(1, 96, (num_samples,), generator=g).tolist()):
        mask[row, :pads] = 0
    labels = ids.masked_fill(mask == 0, -100)

    def collate(rows):
        return BatchEncoding({k: torch.stack([r[k] for r in rows]) for k in rows[0]})

    rows = [dict(input_ids=i, attention_mask=m, labels=lab) for i, m, lab in zip(ids, mask, labels)]
    return DataLoader(rows, batch_size=4, collate_fn=collate)


def test_the_dry_run_of_a_left_padded_batch_encoding_sees_the_padding_the_step_will():
    # 1. the dry run kept its first batch with torch's tree_map, which takes a BatchEncoding for a
    # leaf: it held the batch itself, which the curriculum then cut in place to 64 real tokens. Its
    # forecast of the padded full length was that of an unpadded one (SDPA with is_causal and no
    # [B, 1, L, L] mask): 32.4 MiB for a measured 41.4 MiB on a Llama at 512, -21.7%.
    # 2. it cut a shorter length from the first token, the pads, where the callback keeps the last
    # (real) tokens: +5% to +18% on a Qwen2 at 64 to 256, so it was not trusted, and the replay of
    # those unpadded steps forecast the padded 512 at -25.8%
    from lightning_seqmem.reference.hf import HFCausalLM

    torch.manual_seed(0)
    cb = SeqMemCallback(warmup_steps=1, curriculum=Curriculum(start=64, target=256,
                                                              steps_per_stage=2))
    make_trainer([cb], max_steps=7).fit(HFCausalLM(attn_implementation="sdpa"), _left_padded())
    dry = [r for r in cb.records if r.forecast_method == "dry_run"]
    assert {r.seq_len for r in dry} == {128, 256}, [(r.step, r.seq_len) for r in cb.records]
    assert all(abs(r.forecast_peak_bytes / r.peak_bytes - 1) < 1e-3 for r in dry), [
        (r.seq_len, r.forecast_peak_bytes, r.peak_bytes) for r in dry]

    # a budget the unpadded forecast fits in (-6.8%) and the padded step does not: held below
    full = max(r.peak_bytes for r in dry)
    torch.manual_seed(0)
    cb = SeqMemCallback(warmup_steps=1, memory_budget=int(full * 0.96), safety_margin=0.0,
                        mitigations=(), curriculum=Curriculum(start=64, target=256,
                                                              steps_per_stage=2))
    windows, _ = _fit(cb, HFCausalLM(attn_implementation="sdpa"), _left_padded(), 7)
    assert _over(windows, cb) == ([], []) and cb.records[-1].seq_len < 256


# -- 7. a training_step that returns its logits beside the loss ------------------------------------
class LogitsGPT(LitGPT):
    """Returns ``{"loss", "logits"}``: Lightning keeps the logits (detached) to the batch end."""

    def training_step(self, batch, batch_idx):
        logits = self(batch["input_ids"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        return {"loss": loss, "logits": logits}


def test_a_dict_s_other_tensors_live_to_the_end_of_the_step_in_the_dry_run_too():
    # the dry run took the loss and dropped the dict: the [B, L, vocab] logits, alive in the real
    # step through backward and the optimizer step, were missing (-1.8% at 256 and -3.9% at 512
    # tokens on a small Llama, growing with L: 16 GiB of fp32 logits at 32K tokens of a 128K vocab)
    cb = SeqMemCallback(warmup_steps=1, curriculum=Curriculum(start=64, target=256,
                                                              steps_per_stage=2))
    torch.manual_seed(0)
    make_trainer([cb], max_steps=6).fit(LogitsGPT(n_layer=1, d_model=32, n_head=2, vocab_size=512),
                                        SyntheticTokenDataModule(batch_size=2, seq_len=256,
                                                                 vocab_size=512))
    dry = [r for r in cb.records if r.forecast_method == "dry_run"]
    assert {r.seq_len for r in dry} == {128, 256}, [(r.step, r.seq_len) for r in cb.records]
    assert all(abs(r.forecast_error) < 1e-4 for r in dry), [(r.seq_len, r.forecast_error)
                                                             for r in dry]


# -- 8. a training_step that returns None: Lightning skips that batch's backward -------------------
class SkippingGPT(LitGPT):
    """Returns None for every other batch (a bad batch skipped): no backward, no gradients."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 2 else loss


def test_a_skipped_batch_is_recorded_but_neither_fitted_nor_checked_against():
    # a skipped batch peaks below a trained one (no backward: 21.7 vs 24.5 MB at 256 tokens), yet
    # it was fitted and checked against like one: "the quadratic fit predicted +30%, beyond the
    # 15% tolerance; not trusted", and the curriculum stopped at 392 tokens, short of the 408 a
    # run that never skips reaches
    def fit(model):
        cb = SeqMemCallback(memory_budget="60MiB", dry_run=False, mitigations=(),
                            curriculum=Curriculum(start=64, target=512, steps_per_stage=4))
        return (cb, *_fit(cb, model, SyntheticTokenDataModule(seq_len=512), 16))

    cb, windows, messages = fit(SkippingGPT(d_model=64, n_layer=2))
    skipped = [r for r in cb.records if r.backward_peak_bytes is None]
    assert [r.step for r in skipped] == list(range(1, 16, 2))  # recorded as they ran
    assert not [m for m in messages if "tolerance" in m], messages
    reference, _, _ = fit(LitGPT(d_model=64, n_layer=2))
    assert cb.records[-1].seq_len == reference.records[-1].seq_len < 512
    assert _over(windows, cb) == ([], [])


class PlainBackwardGPT(LitGPT):
    """Manual optimization calling ``loss.backward()`` itself: Lightning sees no backward."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        super().training_step(batch, batch_idx).backward()
        optimizer.step()


def test_a_manual_step_whose_backward_lightning_never_sees_is_still_fitted():
    # the rule of the test above is automatic optimization's: here every step has an optimizer
    # phase and no backward one, and taking them for skipped batches left nothing to forecast from
    cb = SeqMemCallback(dry_run=False, mitigations=(),
                        curriculum=Curriculum(start=64, target=256, steps_per_stage=3))
    _fit(cb, PlainBackwardGPT(d_model=64, n_layer=2), SyntheticTokenDataModule(seq_len=256), 9)
    assert all(r.backward_peak_bytes is None for r in cb.records) and len(cb.records) == 9
    forecast = cb.forecast(512)
    assert forecast.method == "replay" and forecast.peak_bytes > cb.records[-1].peak_bytes


# -- 9. what earlier steps left alive: a user's callback keeping recent logits ---------------------
class KeepRecentLogits(pl.Callback):
    """A user's callback keeping the last three steps' logits (to plot them later)."""

    def __init__(self):
        self.recent = collections.deque(maxlen=3)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.recent.append(outputs["logits"])


def test_what_earlier_steps_left_alive_is_in_every_later_record():
    # on a GPU the allocator counts another callback's kept tensors in every later step; the
    # tracker counted what the module, its optimizers and the batch hold and what the step
    # allocated, so each record was up to three [2, 128, 512] fp32 logits (1.5 MiB) under the judge
    keeper = KeepRecentLogits()
    cb = SeqMemCallback(warmup_steps=1, dry_run=False, mitigations=())
    windows = StepWindows()
    torch.manual_seed(0)
    make_trainer([*windows.around(cb), keeper], max_steps=6).fit(
        LogitsGPT(n_layer=1, d_model=32, n_head=2, vocab_size=512),
        SyntheticTokenDataModule(batch_size=2, seq_len=128, vocab_size=512))
    logits_bytes = 2 * 128 * 512 * 4
    records, peaks = [r.peak_bytes for r in cb.records], windows.peaks()
    assert len(records) == len(peaks) == 6
    # what is left: 8 bytes allocated where no dispatch mode sees them, in every step
    assert all(0 <= p - r <= 16 for p, r in zip(peaks, records)), (records, peaks)
    # the first step holds none, the fourth and later three
    assert records[3] - records[0] >= 3 * logits_bytes


def test_a_curriculum_under_a_budget_counts_what_earlier_steps_left_alive():
    # the kept logits grow with each stage's length: measured 4.3 -> 9.2 -> 19.6 MB unbudgeted at
    # 128, 256 and 512 tokens; under 6 MiB the run stays within it on every step, and each record
    # is its window's (the judge also sees the dry runs' real twins in the batch start)
    cb = SeqMemCallback(warmup_steps=1, memory_budget="6MiB", safety_margin=0.0,
                        curriculum=Curriculum(start=64, target=512, steps_per_stage=3))
    windows = StepWindows()
    torch.manual_seed(0)
    make_trainer([*windows.around(cb), KeepRecentLogits()], max_steps=12).fit(
        LogitsGPT(n_layer=1, d_model=32, n_head=2, vocab_size=512),
        SyntheticTokenDataModule(batch_size=2, seq_len=512, vocab_size=512))
    assert _over(windows, cb) == ([], [])
    records, peaks = [r.peak_bytes for r in cb.records], windows.peaks()
    assert len(records) == len(peaks) == 12 and max(r.seq_len for r in cb.records) > 256
    assert all(0 <= p - r <= 0.002 * p for p, r in zip(peaks, records)), (records, peaks)
