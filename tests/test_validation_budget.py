"""Validation batches inside a fit: the dry run of ``validation_step`` equals the measured step to
the byte, and a validation batch over the budget is said before it runs (once), on a real run."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import Logger
import pytest
import torch

from conftest import make_trainer
from lightning_seqmem import Curriculum, PredictedOOMWarning, SeqMemCallback
from lightning_seqmem.dryrun.step import dry_run_step
from lightning_seqmem.dryrun.step_functions import plain_loss
from lightning_seqmem.measure.probes import TrackerProbe, existing_tensors
from lightning_seqmem.measure.steps import training_step_memory, validation_step_memory
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.reference.hf import HFCausalLM
from lightning_seqmem.trainer.outputs import report_dir

MODEL = dict(n_layer=4, d_model=64, n_head=4, vocab_size=64)
BUDGET = 10_700_000  # bytes: the eager model trains 80 tokens at batch 4 (tests/test_ladder.py)


class ValidatedGPT(LitGPT):
    def validation_step(self, batch, batch_idx):
        return self.training_step(batch, batch_idx)


def _batch(rows: int, seq_len: int, vocab: int = 64) -> dict:
    seed = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (rows, seq_len + 1), generator=seed)
    return {"input_ids": tokens[:, :-1].clone(), "labels": tokens[:, 1:].clone()}


@pytest.mark.parametrize("name", ["gpt-eager", "gpt-sdpa", "llama-sdpa"])
def test_the_validation_dry_run_equals_the_measured_validation_step(name):
    """After a real training step (gradients and AdamW state alive, as in a fit's validation),
    the measured no-gradient eval step and its dry run count the same bytes."""
    torch.manual_seed(0)
    if name.startswith("gpt"):
        model = ValidatedGPT(**MODEL, attention=name.split("-")[1])
    else:
        model = HFCausalLM(config=dict(num_hidden_layers=2, hidden_size=64, vocab_size=64,
                                       intermediate_size=128, num_attention_heads=4,
                                       num_key_value_heads=2), attn_implementation="sdpa")
        model.validation_step = model.training_step
    optimizer = torch.optim.AdamW(model.parameters())
    batch = _batch(4, 512)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer
        training_step_memory(model, optimizer, batch, plain_loss)
        measured = validation_step_memory(model, optimizer, batch, TrackerProbe())
        dry = dry_run_step(model, optimizer, batch, 512, evaluate=True)
    assert model.training and dry.phase_peak_bytes == {"forward": dry.peak_bytes}
    assert dry.peak_bytes == measured.peak_bytes
    assert dry.detail.startswith("a fake validation_step of")


class ValidationPeaks(pl.Callback):
    """The measured peak of every validation batch, and the warnings said before each ran."""

    def __init__(self, caught: list) -> None:
        self.caught, self.runs = caught, []

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.said = sum(issubclass(w.category, PredictedOOMWarning)
                        and "validation batch" in str(w.message) for w in self.caught)
        self.probe = TrackerProbe()
        self.probe.start_step(existing_tensors(pl_module, trainer.optimizers, batch))
        self.probe.mark_phase("forward")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx,
                                dataloader_idx=0):
        self.runs.append((batch["input_ids"].shape[1], self.probe.end_step().peak_bytes, self.said))


def _fit_with_validation(lengths: list[int], max_steps: int = 4, budget: int = BUDGET,
                         logger=False):
    cb = SeqMemCallback(memory_budget=budget, safety_margin=0.0, warmup_steps=1,
                        curriculum=Curriculum(start=64, target=1024, steps_per_stage=2,
                                              multiple_of=16))
    data = SyntheticTokenDataModule(batch_size=4, seq_len=1024, num_samples=4 * max_steps,
                                    vocab_size=64)
    data.val_dataloader = lambda: torch.utils.data.DataLoader(
        [_batch(4, n) for n in lengths], batch_size=None)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peaks = ValidationPeaks(caught)
        cb.trainer = make_trainer([cb, peaks], max_steps=max_steps, val_check_interval=2,
                                  num_sanity_val_steps=1, logger=logger)
        cb.trainer.fit(ValidatedGPT(**MODEL, attention="eager"), data)
    said = [str(w.message) for w in caught if issubclass(w.category, PredictedOOMWarning)
            and "validation batch" in str(w.message)]
    return cb, peaks.runs, said


def test_a_validation_batch_over_the_budget_is_said_once_before_it_runs():
    cb, runs, said = _fit_with_validation([1024])
    # the sanity check's batch, then one at steps 2 and 4 (SDPA on by then): all over the budget
    assert len(runs) == 3 and all(peak > BUDGET for _, peak, _ in runs)
    assert runs[0][1] > 10 * BUDGET and runs[1][1] > 10 * BUDGET
    assert runs[0][2] == 1  # said before the first validation batch ran
    assert len(said) == 1 and "seq_len=1024, batch 4 is predicted to peak at" in said[0]
    assert "no rung left makes its dry run fit" in said[0]  # SDPA: 14 MiB (the third run)
    # the sanity check runs before any step, beside no gradients and no optimizer state: so does its
    # dry run, equal to it; after a step (AdamW state, gradients zeroed) the batch peaks higher, but
    # the warning is given once a run: no later batch is dry-run
    assert {key[3] for key in cb._validation.judged} == {(False, False)}  # (the rungs tried too)
    predicted = cb._validation.judged[(1024, 4, (), (False, False))]
    assert predicted == runs[0][1] < runs[1][1]
    assert max(r.peak_bytes for r in cb.records) <= BUDGET  # the training batches kept it
    # the callback measured the batch it judged (the sanity check's), as the test's probe did
    (row,) = cb.edge.validation
    assert (row["global_step"], row["seq_len"], row["dry_run_peak_bytes"]) == (0, 1024, predicted)
    assert row["peak_bytes"] == runs[0][1]


def test_validation_batches_that_fit_are_never_said_and_the_shorter_not_dry_run():
    cb, runs, said = _fit_with_validation([64, 32, 64], max_steps=2)
    assert said == [] and len(runs) == 4  # the sanity check's first batch, then all three
    assert all(peak <= BUDGET for _, peak, _ in runs)
    # 64 tokens judged in the sanity check, and again beside the optimizer state made since (the
    # gradients zeroed before validation); 32 within it: not dry-run
    judged = [(key[0], key[3]) for key in cb._validation.judged]
    assert judged == [(64, (False, False)), (64, (False, True))]
    assert all(row["dry_run_peak_bytes"] == row["peak_bytes"] for row in cb.edge.validation)


class Scalars(Logger):
    """Every scalar logged, as ``(step, tag, value)``."""

    name, version, logged = "scalars", 0, None

    def log_metrics(self, metrics, step=None):
        self.logged = (self.logged or []) + [(step, k, v) for k, v in metrics.items()]

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def test_each_measured_validation_batch_is_logged_at_the_step_its_validation_ran():
    logger = Scalars()
    cb, runs, _ = _fit_with_validation([64, 32, 64], max_steps=2, logger=logger)
    logged = [(step, tag, value) for step, tag, value in logger.logged if "validation" in tag]
    rows = [(r["global_step"], r["seq_len"], r["peak_bytes"]) for r in cb.edge.validation]
    lengths = [(step, n) for step, tag, n in logged if tag == "seqmem/validation_seq_len"]
    assert len(rows) == 2 and lengths == [(s, n) for s, n, _ in rows]
    assert [(step, value * 2**30) for step, tag, value in logged  # (a power of 2: exact)
            if tag == "seqmem/validation_peak_gib"] == [(s, p) for s, _, p in rows]
    assert rows[0][2] == runs[0][1]  # what ran: the test's own probe measured the same batch


def test_a_rung_that_makes_the_validation_batch_fit_goes_on_before_it_runs():
    """At 17 MB the 4 × 1024 validation batch fits with SDPA (14 MiB), not eager (139 MiB): the
    attention rung goes on before the sanity check's batch runs, and every validation batch and
    training step is measured within the budget."""
    budget = 17_000_000
    cb, runs, said = _fit_with_validation([1024], budget=budget)
    assert len(said) == 1 and "switched on attention before it runs" in said[0], said
    assert len(runs) == 3 and all(peak <= budget for _, peak, _ in runs)
    assert runs[0][2] == 1  # said (and switched) before the first validation batch ran
    assert cb.applied_mitigations[0] == "attention" and cb.mitigation_events[0]["step"] == 0
    assert cb.records[0].mitigations[0] == "attention"
    assert max(r.peak_bytes for r in cb.records) <= budget
    # recorded and reported: the batch with SDPA on, its dry run and its measured peak
    first = cb.edge.validation[0]
    assert first["mitigations"] == ["attention"] and first["peak_bytes"] == runs[0][1]
    assert first["dry_run_peak_bytes"] == first["peak_bytes"]  # beside the same (no) state
    folder = Path(report_dir(cb.trainer))
    assert json.loads((folder / "seqmem_report.json").read_text())["validation"][0] == first
    assert "## Validation batches" in (folder / "seqmem_report.md").read_text()


def test_each_state_a_validation_runs_beside_is_dry_run_as_it_is():
    """Validation after every batch of 2-batch accumulation windows: the sanity check (no gradients,
    no optimizer state), inside the first window (gradients, no state), after a step (state, the
    gradients freed by Lightning) and inside a later window (both): each is judged again, and each
    dry run equals the callback's measurement of that batch to the byte."""
    cb = SeqMemCallback(memory_budget=BUDGET, safety_margin=0.0, warmup_steps=1)
    data = SyntheticTokenDataModule(batch_size=4, seq_len=64, num_samples=32, vocab_size=64)
    data.val_dataloader = lambda: torch.utils.data.DataLoader([_batch(4, 64)], batch_size=None)
    torch.manual_seed(0)
    make_trainer([cb], max_steps=3, val_check_interval=1, num_sanity_val_steps=1,
                 accumulate_grad_batches=2).fit(ValidatedGPT(**MODEL, attention="eager"), data)
    held = [key[3] for key in cb._validation.judged]
    assert held == [(False, False), (True, False), (False, True), (True, True)]
    rows = cb.edge.validation
    assert len(rows) == 4 and all(r["dry_run_peak_bytes"] == r["peak_bytes"] for r in rows), rows
    assert len({r["peak_bytes"] for r in rows}) == 4  # four different states, four peaks


def test_a_failing_validation_check_is_said_once_and_training_is_still_measured(monkeypatch):
    from lightning_seqmem.trainer.validation_check import ValidationCheck

    def broken(*args, **kwargs):
        raise RuntimeError("injected: the validation probe")

    monkeypatch.setattr(ValidationCheck, "_start", broken)
    cb, runs, said = _fit_with_validation([64], max_steps=2)
    assert len(runs) == 2 and not cb.edge.failed  # validation ran; the callback measures on
    assert [r.global_step for r in cb.records] == [0, 1]
    assert sum("injected: the validation probe" in w for w in cb.planner.advice.warned) <= 1
    assert any(kind == "output_failed" for kind in cb.planner.advice.warned.values())



def test_validate_outside_a_fit_is_said_once_and_never_recorded():
    """``trainer.validate()`` after a fit: the callback has no hook there, so it says once that
    nothing is measured or judged, records nothing and leaves the fit's state as it was."""
    cb, runs, _ = _fit_with_validation([64], max_steps=2)
    rows, records = list(cb.edge.validation), list(cb.records)
    data = SyntheticTokenDataModule(batch_size=4, seq_len=64, num_samples=8, vocab_size=64)
    data.val_dataloader = lambda: torch.utils.data.DataLoader([_batch(4, 1024)], batch_size=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            cb.trainer.validate(cb.trainer.lightning_module, data, verbose=False)
    said = [str(w.message) for w in caught if "outside a fit" in str(w.message)]
    assert said == ["seqmem: trainer.validate() runs outside a fit: its batches are neither "
                    "measured nor judged against the memory budget (the callback watches "
                    "trainer.fit(); forecast(seq_len) or `seqmem plan` bound a length's training "
                    "step, which a no-gradient step stays under)."]
    assert cb.edge.validation == rows and cb.records == records  # nothing recorded
    assert "outside-fit-validate" in cb.planner.advice.warned


def test_validation_rows_survive_a_resume_and_a_continuing_fit(tmp_path):
    """The measured validation rows are in the checkpoint (a resume's report has them) and a
    second fit on the same Trainer and module keeps them, as it keeps the training records."""
    cb, _, _ = _fit_with_validation([64, 32], max_steps=2)
    rows = [dict(row) for row in cb.edge.validation]
    assert len(rows) == 2  # the sanity check's 64, then 64 after step 2 (32: within it)
    cb.trainer.save_checkpoint(tmp_path / "two.ckpt")
    model, data = cb.trainer.lightning_module, cb.trainer.datamodule
    resumed = SeqMemCallback(memory_budget=BUDGET, safety_margin=0.0, warmup_steps=1,
                             curriculum=cb.config.curriculum)
    trainer = make_trainer([resumed], max_steps=4, val_check_interval=2)
    trainer.fit(ValidatedGPT(**MODEL, attention="eager"), data, ckpt_path=tmp_path / "two.ckpt")
    assert resumed.edge.validation[:2] == rows and len(resumed.edge.validation) == 3
    saved = json.loads((Path(report_dir(trainer)) / "seqmem_report.json").read_text())
    assert [row["global_step"] for row in saved["validation"]] == [0, 2, 4]
    cb.trainer.fit_loop.epoch_loop.max_steps = 4  # the first run goes on: its sanity check, and
    cb.trainer.fit(model, data)                   # the validation at step 4, add rows
    assert cb.edge.validation[:2] == rows
    assert [row["global_step"] for row in cb.edge.validation] == [0, 2, 2, 4]
