"""Issue #13: what the user trains on is what the callback says.

A curriculum that cannot reach its length holds instead of advancing on paper; a dataset-side length
that worker processes would never see is refused before training; a compiled module still compiles
with the tracker on CPU, and its forecasts say which program they describe; advice is recomputed
from the current forecast and only given where it applies. Tiny real models, real measurement.
"""

from __future__ import annotations

import tempfile
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from conftest import make_trainer
from lightning_seqmem import Curriculum, MemoryBudgetError, SeqMemCallback
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.measure.batch_shape import infer_batch_shape
from lightning_seqmem.plan.view import PlanView


def _fit(cb, model, data, max_steps, **trainer_kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([cb], max_steps=max_steps, **trainer_kwargs).fit(model, data)
    return [str(w.message) for w in caught if str(w.message).startswith("seqmem")]


def _gpt(**kwargs):
    torch.manual_seed(0)
    return LitGPT(**{"n_layer": 1, "d_model": 32, "n_head": 2, **kwargs})


# -- 3. curriculum vs data ------------------------------------------------------------------------
def test_curriculum_holds_when_the_data_is_shorter_than_the_stage():
    """40-token data under stages 16, 32, 64, 128: the old code advanced to 128 on paper while every
    batch ran at 40; now the curriculum holds at 64 (the first stage the data does not reach)."""
    cb = SeqMemCallback(warmup_steps=1, dry_run=False,
                        curriculum=Curriculum(start=16, target=128, steps_per_stage=2,
                                              multiple_of=16))
    said = _fit(cb, _gpt(), SyntheticTokenDataModule(batch_size=2, seq_len=40, num_samples=64),
                max_steps=10)
    assert [r.seq_len for r in cb.records] == [16, 16, 32, 32] + [40] * 6  # what ran
    assert cb.seq_len == 64 and cb.planner.course.stage == 2  # held, not advanced to 128
    held = [m for m in said if "asked for seq_len=64" in m]
    assert len(held) == 1 and "40 tokens" in held[0] and "holds" in held[0]


# -- 4. dataset-side length with worker processes --------------------------------------------------
class TupleTokens(Dataset):
    """(input_ids, labels) tuples, whose length only the dataset can change (``set_seq_len``)."""

    def __init__(self, num_samples=64, seq_len=64):
        self.num_samples, self.seq_len = num_samples, seq_len

    def set_seq_len(self, seq_len):
        self.seq_len = seq_len

    def __len__(self):
        return self.num_samples

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        tokens = torch.randint(0, 256, (self.seq_len + 1,), generator=g)
        return tokens[:-1], tokens[1:]


def tuple_collate(samples):
    """Tuple batches (the default collate makes lists, which the callback cuts itself)."""
    return tuple(torch.utils.data.default_collate(samples))


class TupleGPT(LitGPT):
    def training_step(self, batch, batch_idx):
        return super().training_step({"input_ids": batch[0], "labels": batch[1]}, batch_idx)


def test_dataset_length_setter_with_worker_processes_is_refused_before_training():
    """The old code set the length in the main process only: with num_workers=2 every batch kept 64
    tokens and the curriculum never took effect. Now the run is refused at its first batch, saying
    what to do."""
    cb = SeqMemCallback(warmup_steps=1, dry_run=False,
                        curriculum=Curriculum(start=16, target=64, steps_per_stage=2))
    loader = DataLoader(TupleTokens(), batch_size=4, num_workers=2, collate_fn=tuple_collate)
    with pytest.raises(ValueError) as info:
        _fit(cb, TupleGPT(n_layer=1, d_model=32, n_head=2), loader, max_steps=4)
    message = str(info.value)
    assert "num_workers=2" in message and "set_seq_len" in message and "num_workers=0" in message
    assert cb.records == []  # nothing ran under a length the workers never saw


def test_dataset_length_setter_without_workers_still_drives_the_curriculum():
    cb = SeqMemCallback(warmup_steps=1, dry_run=False,
                        curriculum=Curriculum(start=16, target=32, steps_per_stage=2))
    _fit(cb, TupleGPT(n_layer=1, d_model=32, n_head=2),
         DataLoader(TupleTokens(), batch_size=4, collate_fn=tuple_collate), max_steps=8)
    # the setter reached the data (a batch or two late)
    assert 32 in [r.seq_len for r in cb.records]


# -- 1. torch.compile inside the module ------------------------------------------------------------
class CompiledGPT(LitGPT):
    """``self.model = torch.compile(self.model)`` in ``configure_model`` (the "eager" backend:
    dynamo's graph capture, the part a dispatch mode turns off, without a C++ build)."""

    def configure_model(self):
        if not hasattr(self.model, "_orig_mod"):
            self.model = torch.compile(self.model, backend="eager")


def test_a_compiled_module_still_compiles_on_cpu_with_the_tracker_and_forecasts_say_eager():
    """The old code kept the tracker's dispatch mode on at every step: torch.compile fell back to
    eager on all of them (0 graphs), silently. Now most steps run compiled, one warning says which
    run eager, and forecasts say they are of the eager program."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cb = SeqMemCallback(warmup_steps=1,
                        curriculum=Curriculum(start=16, target=32, steps_per_stage=4))
    said = _fit(cb, CompiledGPT(n_layer=1, d_model=32, n_head=2),
                SyntheticTokenDataModule(batch_size=2, seq_len=32, num_samples=64), max_steps=8)
    assert counters["stats"]["unique_graphs"] >= 1  # compiled steps ran
    # measured (eager) steps only: warm-ups and the first steps at each length
    assert len(cb.records) < 8
    assert sorted({r.seq_len for r in cb.records if not r.warmup}) == [16, 32]
    compiled = [m for m in said if "torch.compile" in m and "tracker is on only for" in m]
    assert len(compiled) == 1 and "'model'" in compiled[0]
    assert "eager program" in cb.forecast(64, 2).detail


class _GraphCounts(pl.Callback):
    """Dynamo's count of compiled graphs after every batch, by global step."""

    def __init__(self):
        self.after_step = {}

    def on_train_batch_end(self, trainer, *args):
        from torch._dynamo.utils import counters

        self.after_step[trainer.global_step - 1] = counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("rung", ["checkpointing", "tiled_mlp", "microbatch"])
def test_a_rung_switched_on_in_a_compiled_module_runs_compiled_and_within_the_budget(rung):
    """``torch.compile`` and a rung switched on mid-run: the rung finds its targets through the
    compiled wrapper, later unmeasured steps compile again with it (dynamo recompiles on the changed
    modules), and every measured step (the tracker, eager) is within a budget only the rung
    meets."""
    from lightning_seqmem.dryrun.step import dry_run_step
    from lightning_seqmem.mitigations import ladder
    from torch._dynamo.utils import counters

    model = dict(n_layer=2, d_ff=512) if rung == "tiled_mlp" else dict(n_layer=2)
    rows, target = 2, 256

    def dry(mitigations):
        module = _gpt(**model)
        ids = torch.randint(0, 100, (rows, 64), generator=torch.Generator().manual_seed(0))
        return dry_run_step(module, module.configure_optimizers(),
                            {"input_ids": ids, "labels": ids}, target,
                            mitigations=mitigations).peak_bytes

    budget = (dry([rung]) + dry([])) // 2  # the target length fits with the rung only
    torch._dynamo.reset()
    counters.clear()
    cb = SeqMemCallback(warmup_steps=1, memory_budget=budget, safety_margin=0.0, mitigations=[rung],
                        curriculum=Curriculum(start=64, target=target, steps_per_stage=2,
                                              multiple_of=64))
    graphs = _GraphCounts()
    torch.manual_seed(0)
    module = CompiledGPT(**{"n_layer": 1, "d_model": 32, "n_head": 2, **model})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer([cb, graphs], max_steps=16).fit(
            module, SyntheticTokenDataModule(batch_size=rows, seq_len=target, num_samples=64))
    assert cb.applied_mitigations == (rung,) and ladder.is_on(rung, module)
    (event,) = cb.mitigation_events
    # compiled steps ran with the rung on
    assert graphs.after_step[15] > graphs.after_step[event["step"]]
    assert max(r.seq_len for r in cb.records) == target
    assert max(r.peak_bytes for r in cb.records) <= budget, [
        (r.seq_len, r.peak_bytes) for r in cb.records]
    assert all(r.mitigations == (rung,) for r in cb.records if r.seq_len == target)


# -- 2. advice that applies ------------------------------------------------------------------------
def test_bf16_is_not_advised_where_a_bf16_dry_run_raises_the_peak():
    """Eager attention, d=64, 2 layers, fp32, target 512: bf16 autocast raises this step's peak (the
    dry run says +5%). The old code advised bf16 from the first quadratic fit's L² share."""
    cb = SeqMemCallback(warmup_steps=1,
                        curriculum=Curriculum(start=128, target=512, steps_per_stage=2))
    said = _fit(cb, _gpt(n_layer=2, d_model=64, n_head=4, attention="eager"),
                SyntheticTokenDataModule(batch_size=2, seq_len=512, num_samples=64), max_steps=6)
    assert [r.seq_len for r in cb.records][-1] == 512
    assert not [m for m in said if "bf16" in m] and "precision" not in cb.planner.advice.warned


def test_bf16_is_advised_with_the_dry_run_numbers_where_it_lowers_the_peak():
    cb = SeqMemCallback(warmup_steps=1,
                        curriculum=Curriculum(start=64, target=256, steps_per_stage=2))
    said = _fit(cb, _gpt(attention="sdpa"),
                SyntheticTokenDataModule(batch_size=2, seq_len=256, num_samples=64), max_steps=6)
    bf16 = [m for m in said if "bf16" in m]
    assert (len(bf16) == 1 and "seq_len=256" in bf16[0] and "dry run" in bf16[0]
            and "-" in bf16[0].split("(")[-1])


def test_over_budget_advice_never_names_the_kernel_the_model_is_on_nor_a_length_of_zero():
    """An SDPA model with a budget nothing fits in: the old code advised "switch attention to SDPA"
    and its report said the largest length that fits is 0 tokens."""
    cb = SeqMemCallback(warmup_steps=1, memory_budget="64KiB",
                        curriculum=Curriculum(start=16, target=64, steps_per_stage=2))
    # a budget the parameters alone exceed stops the run (issue 23)
    with pytest.raises(MemoryBudgetError) as err:
        _fit(cb, _gpt(attention="sdpa"),
             SyntheticTokenDataModule(batch_size=2, seq_len=64, num_samples=64), max_steps=2)
    said = [str(err.value)]
    assert ("cannot be met" in said[0]
            and not [m for m in said if "SDPA" in m or "sdpa" in m.lower()])
    from lightning_seqmem.present.report import build_report
    from lightning_seqmem.present.render import render_markdown

    markdown = render_markdown(build_report(PlanView.of(cb.planner)))
    # stopped before any step: the report forecasts nothing, and never "0 tokens" nor SDPA
    assert ("not enough measurements to forecast" in markdown and "0 tokens" not in markdown
            and "SDPA" not in markdown)


class EmbeddingEncoder(pl.LightningModule):
    """A model fed float embeddings ``x [B, L, 32]`` with float targets: no token ids anywhere."""

    def __init__(self) -> None:
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    def training_step(self, batch, batch_idx):
        return (self.encoder(batch["x"]) - batch["y"]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def test_a_curriculum_cuts_embeddings_by_the_shape_seq_len_fn_reads():
    # with seq_len_fn given, a batch of float embeddings stopped the fit before its first step:
    # the cut looked for token ids, and its error said to pass the seq_len_fn that was passed
    rows = [{"x": torch.randn(256, 32), "y": torch.randn(256, 32)} for _ in range(16)]
    cb = SeqMemCallback(warmup_steps=1, seq_len_fn=lambda b: tuple(b["x"].shape[:2]),
                        curriculum=Curriculum(start=64, target=256, steps_per_stage=2))
    make_trainer([cb], max_steps=6).fit(EmbeddingEncoder(), DataLoader(rows, batch_size=2))
    assert [r.seq_len for r in cb.records] == [64, 64, 128, 128, 256, 256]
    assert abs(cb.records[-1].forecast_error) < 0.01


def test_the_dry_run_reads_the_shape_seq_len_fn_reads():
    # the dry run looked for token ids: with seq_len_fn given and float embeddings, it refused
    # every length ("Pass `seq_len_fn`", which was passed), so no stage was forecast before it ran
    rows = [{"x": torch.randn(256, 32), "y": torch.randn(256, 32)} for _ in range(16)]
    cb = SeqMemCallback(warmup_steps=1, seq_len_fn=lambda b: tuple(b["x"].shape[:2]),
                        curriculum=Curriculum(start=64, target=256, steps_per_stage=2))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        make_trainer([cb], max_steps=6).fit(EmbeddingEncoder(), DataLoader(rows, batch_size=2))
    assert not [w for w in said if "cannot simulate" in str(w.message)]
    assert [r.seq_len for r in cb.records] == [64, 64, 128, 128, 256, 256]
    forecast = [r for r in cb.records if r.forecast_method is not None]
    assert {r.seq_len for r in forecast} == {128, 256}
    assert all(r.forecast_method == "dry_run" and abs(r.forecast_error) < 0.02 for r in forecast)
    # under a budget the 256 stage exceeds (1.36 MB measured above), it never runs: the dry run
    # says so before it, and no step is over
    budget = 1_200_000
    assert max(r.peak_bytes for r in cb.records if r.seq_len == 256) > budget
    cb = SeqMemCallback(warmup_steps=1, seq_len_fn=lambda b: tuple(b["x"].shape[:2]),
                        memory_budget=budget, safety_margin=0.0, mitigations=(),
                        curriculum=Curriculum(start=64, target=256, steps_per_stage=2))
    make_trainer([cb], max_steps=6).fit(EmbeddingEncoder(), DataLoader(rows, batch_size=2))
    assert max(r.seq_len for r in cb.records) < 256
    assert all(r.peak_bytes <= budget for r in cb.records)


def test_micro_batching_splits_embeddings_by_the_shape_seq_len_fn_reads():
    # the rung's split looked for token ids: refused ("Pass `seq_len_fn`", which was passed), so
    # the curriculum stopped at 88 tokens where micro-batches of one sample reach 256
    rows = [{"x": torch.randn(256, 32), "y": torch.randn(256, 32)} for _ in range(32)]
    budget = 1_200_000
    cb = SeqMemCallback(warmup_steps=1, seq_len_fn=lambda b: tuple(b["x"].shape[:2]),
                        memory_budget=budget, safety_margin=0.0, mitigations=("microbatch",),
                        curriculum=Curriculum(start=64, target=256, steps_per_stage=2))
    make_trainer([cb], max_steps=6).fit(EmbeddingEncoder(), DataLoader(rows, batch_size=4))
    assert cb.applied_mitigations == ("microbatch",)
    assert [r.seq_len for r in cb.records] == [64, 64, 128, 128, 256, 256]
    assert all(r.peak_bytes <= budget for r in cb.records)
    assert all(abs(r.forecast_error) < 0.01 for r in cb.records if r.forecast_error is not None)


def test_the_shape_reading_ends_with_the_fit_when_a_batch_never_ends():
    # the module's on_train_batch_start returning -1 ends the epoch with no on_train_batch_end:
    # the batch's seq_len_fn scope stayed open, and after the fit infer_batch_shape read every
    # batch of the process with the user's function (here (2, 3) for a float tensor)
    class StopsAtTheThirdBatch(EmbeddingEncoder):
        def on_train_batch_start(self, batch, batch_idx):
            return -1 if batch_idx == 2 else None

    rows = [{"x": torch.randn(64, 32), "y": torch.randn(64, 32)} for _ in range(8)]
    cb = SeqMemCallback(warmup_steps=1, seq_len_fn=lambda b: tuple(b["x"].shape[:2]))
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                         default_root_dir=tempfile.mkdtemp(prefix="seqmem-test-"))
    trainer.fit(StopsAtTheThirdBatch(), DataLoader(rows, batch_size=2))
    assert len(cb.records) == 2
    with pytest.raises(ValueError, match="Could not infer"):
        infer_batch_shape({"x": torch.zeros(2, 3, 4)})
