"""The memory breakdown where users look: SeqMemCallback(breakdown=True) -> report, Markdown,
TensorBoard text."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_seqmem import Curriculum, SeqMemCallback, SeqMemFailureWarning
from lightning_seqmem.diagnostics.traced_step import copy_for_tracing, training_step_loss
from lightning_seqmem.diagnostics.section import safe_seq_lens, trace_breakdowns, width_dims
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.present.report import load_report
from lightning_seqmem.present.render import render_console
from conftest import make_trainer

# d_model 64, 4 heads (head size 16), d_ff 256, vocab 256, batch 2: no length below equals a width
STAGES = dict(start=24, target=96, steps_per_stage=3)


def _fit(tmp_path, attention="eager", breakdown=True, **kwargs):
    torch.manual_seed(0)
    callback = SeqMemCallback(curriculum=Curriculum(**STAGES), breakdown=breakdown, **kwargs)
    logger = TensorBoardLogger(save_dir=str(tmp_path), name="run")
    trainer = make_trainer([callback], max_steps=9, logger=logger)
    model = LitGPT(n_layer=2, d_model=64, n_head=4, attention=attention)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, SyntheticTokenDataModule(batch_size=2, seq_len=96, num_samples=64))
    return callback, trainer, model, logger


def test_breakdown_in_report_markdown_and_tensorboard(tmp_path, capsys):
    callback, trainer, model, logger = _fit(tmp_path)
    report = load_report(logger.log_dir)
    section = report["breakdown"]
    assert section["seq_lens"] == [24, 48, 96] and section["batch_size"] == 2
    # the traced peaks (sum of every part) are the tracker's measurements at those lengths, training
    measured = {}
    for r in callback.records:
        if not r.warmup:
            measured[r.seq_len] = max(measured.get(r.seq_len, 0), r.peak_bytes)
    for L, traced, in_training in zip(section["seq_lens"], section["peak_bytes"],
                                      section["measured_peak_bytes"]):
        assert in_training == measured[L]
        assert traced == pytest.approx(measured[L], rel=0.01)
        parts = [r for r in section["by_kind"]]
        assert sum(r["bytes"][section["seq_lens"].index(L)] for r in parts) == traced
    growth = {r["category"]: r["growth"] for r in section["activations"]}
    assert growth["attention_scores"] == "quadratic" and growth["ffn"] == "linear"
    assert {r["kind"]: r["growth"] for r in section["by_kind"]}["parameters"] == "constant"
    assert section["extrapolated_seq_len"] == 4 * 96 and section["crossover_seq_len"] > 96
    assert (section["attention_share"][0] < section["attention_share"][-1]
            < section["attention_share_extrapolated"])
    assert any("hand-written matmul" in d for d in section["diagnoses"])
    assert section["calibration"]["ratio"] == pytest.approx(1.0, abs=0.1)
    assert (len(callback.edge.breakdowns) == 3
            and callback.edge.breakdown_table.seq_lens == [24, 48, 96])
    assert any(w["key"].startswith("diagnosis-") for w in report["warnings"])
    # where the peak sits at the longest length run: the traced step's own kinds, summing to it
    site = report["peak_site"]
    assert (site["source"] == "breakdown" and site["seq_len"] == 96
            and site == {**site, **section["peak_site"]})
    assert site["peak_bytes"] == section["peak_bytes"][-1] == sum(b for _, b in site["top_kinds"])
    # the traced step peaks in the forward's cross-entropy over the logits: the site says "loss"
    assert (section["peak_phase"][-1] == "forward" and site["phase"] == "loss"
            and "logits" in dict(site["top_kinds"]))

    md = (tmp_path / "run" / "version_0" / "seqmem_report.md").read_text()
    assert "## Where the memory goes (breakdown)" in md
    assert "| kind | L=24 | L=48 | L=96 | L=384 (extrapolated) | growth |" in md
    assert "| attention_scores |" in md and "| attention share |" in md and "crossover length" in md
    assert "Korthikanti" in md and "peak measured in training" in md
    assert (f"| peak at (longest length) | seq_len 96, batch 2, no mitigation: {site['describe']} "
            "(a traced step" in md)
    assert f"Peak at L=96: {site['describe']}" in md

    render_console(report)
    text = capsys.readouterr().out
    assert "peak memory by module" in text and "attention share" in text

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0})
    events.Reload()
    tag = "seqmem/breakdown/text_summary"
    assert tag in events.Tags()["tensors"]
    event = events.Tensors(tag)[-1]
    assert event.step == trainer.global_step
    logged = event.tensor_proto.string_val[0].decode()
    assert "Peak memory by module" in logged and "attention_scores" in logged
    assert events.summary_metadata[tag].plugin_data.plugin_name == "text"


def test_breakdown_trains_nothing_and_sdpa_has_no_crossover(tmp_path):
    callback, trainer, model, _ = _fit(tmp_path, attention="sdpa")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = trainer.optimizers[0]
    state_before = {k: v.clone() for k, v in optimizer.state[next(model.parameters())].items()}
    section = callback.run_breakdown(trainer, model)  # again, by hand: nothing of the run changes
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    state_after = optimizer.state[next(model.parameters())]
    assert all(torch.equal(state_before[k], state_after[k]) for k in state_before)
    assert section["crossover_seq_len"] is None and section["diagnoses"] == []
    assert "attention_scores" not in {r["category"] for r in section["activations"]}
    assert section["attention_backend"] == "sdpa"


def test_breakdown_failure_is_one_warning_and_the_report_is_still_written(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr("lightning_seqmem.diagnostics.section.trace_breakdowns", broken)
    torch.manual_seed(0)
    callback = SeqMemCallback(curriculum=Curriculum(**STAGES), breakdown=True)
    trainer = make_trainer([callback], max_steps=6, default_root_dir=str(tmp_path))
    with pytest.warns(SeqMemFailureWarning, match="could not write the memory breakdown.*boom"):
        trainer.fit(LitGPT(n_layer=1, d_model=64, n_head=4),
                    SyntheticTokenDataModule(batch_size=2, seq_len=96))
    report = json.loads((tmp_path / "seqmem_report.json").read_text())
    assert "breakdown" not in report and report["records_summary"]["num_records"] == 6
    assert callback.edge.breakdown_report is None and not callback.edge.failed


def test_breakdown_argument_is_checked_and_off_by_default():
    assert SeqMemCallback().config.breakdown is False
    with pytest.raises(ValueError, match="`breakdown` must be a bool, got 'yes'"):
        SeqMemCallback(breakdown="yes")


def test_copies_lengths_and_micro_batches():
    torch.manual_seed(0)
    lit = LitGPT(n_layer=1, d_model=64, n_head=4)
    optimizer = torch.optim.AdamW(lit.parameters(), lr=0.1)
    batch = next(iter(SyntheticTokenDataModule(batch_size=4, seq_len=96).train_dataloader()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a trainer
        training_step_loss(lit, batch).backward()
    optimizer.step()
    moment = optimizer.state[lit.model.lm_head.weight]["exp_avg"].clone()
    model, model_optimizer = copy_for_tracing(lit, optimizer)
    assert (type(model_optimizer) is torch.optim.AdamW
            and model_optimizer.param_groups[0]["lr"] == 0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a trainer
        whole = trace_breakdowns(model, model_optimizer, batch, [40, 80], training_step_loss)
        micro = trace_breakdowns(model, model_optimizer, batch, [40, 80], training_step_loss,
                                 micro_batch_size=1)
    # the original is untouched
    assert torch.equal(optimizer.state[lit.model.lm_head.weight]["exp_avg"], moment)
    assert [b.seq_len for b in whole] == [40, 80] and whole[0].batch_size == 4
    # one sample's activations at a time
    assert micro[1].activation_bytes < whole[1].activation_bytes / 2
    # widths: d_model 64, qkv 192, d_ff and vocab 256, heads 4, head size 16, batch 4
    assert width_dims(lit, batch_size=4) == {4, 16, 64, 192, 256}
    lengths, notes = safe_seq_lens([64, 192, 200], width_dims(lit, batch_size=4), max_seq_len=200)
    assert lengths == [56, 184, 200] and len(notes) == 2 and "192" in notes[0]


def test_micro_batched_breakdown_step_weighs_label_tokens_as_the_policy():
    """The breakdown's micro-batched step is the policy's: a padded Hugging Face-style batch (loss =
    mean over label tokens) gives the full batch's gradient; weighting samples would not."""
    import torch.nn.functional as F

    from lightning_seqmem.diagnostics.traced_step import run_training_step
    from lightning_seqmem.reference.nn import GPT, GPTConfig

    class TokenMeanLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2))

        def training_step(self, batch, batch_idx):
            logits = self.model(batch["input_ids"])
            return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                   ignore_index=-100)

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (4, 24))
    labels = torch.randint(0, 256, (4, 24))  # the next tokens: not the inputs, counted whole
    labels[0, 4:] = -100  # padded rows: 4 and 10 label tokens against 24 and 24
    labels[2, 10:] = -100
    batch = {"input_ids": ids, "labels": labels}

    def gradients(**micro):
        lm = TokenMeanLM()
        lm.load_state_dict(reference.state_dict())
        # the step leaves its gradients, changes nothing
        optimizer = torch.optim.SGD(lm.parameters(), lr=0.0)
        run_training_step(lm, optimizer, batch, training_step_loss, **micro)
        return torch.cat([p.grad.flatten() for p in lm.parameters()])

    reference = TokenMeanLM()
    whole = gradients()
    micro = gradients(micro_batch_size=1)
    by_samples = gradients(micro_batch_size=1, weighting="samples")
    assert torch.allclose(micro, whole, rtol=1e-4, atol=1e-7)
    # the sample weighting the step used to apply
    assert (by_samples - whole).norm() > 0.1 * whole.norm()


def test_breakdown_after_fit_runs_the_micro_batching_now_on(tmp_path):
    from lightning_seqmem.mitigations.microbatch.microbatch import MicroBatching

    callback, trainer, model, _ = _fit(tmp_path, attention="sdpa")
    whole = callback.run_breakdown(trainer, model)
    assert MicroBatching(micro_batch_size=1).apply(trainer, model).applied
    micro = callback.run_breakdown(trainer, model)
    assert (micro["seq_lens"] == whole["seq_lens"]
            and not any("micro-batches" in n for n in whole["notes"]))
    assert any("micro-batches of 1 sample(s)" in n for n in micro["notes"])

    def activations(section):
        return sum(r["bytes"][-1] for r in section["activations"])

    assert activations(micro) < 0.6 * activations(whole)  # one sample of the batch of 2 at a time
