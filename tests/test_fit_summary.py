"""At the end of every fit (rank zero), a few lines say what ran and where the report, figure and
panels are (the logger's ``version_N/``); ``summary=False`` silences them."""

from __future__ import annotations

import re
from pathlib import Path

from lightning.pytorch.loggers import TensorBoardLogger

from conftest import make_trainer
from lightning_seqmem import Curriculum, SeqMemCallback
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.core.units import format_bytes
from lightning_seqmem.plan.view import PlanView


def _fit(tmp_path, **kwargs):
    cb = SeqMemCallback(memory_budget="200MiB",
                        curriculum=Curriculum(start=16, target=64, steps_per_stage=3), **kwargs)
    logger = TensorBoardLogger(save_dir=str(tmp_path / "runs"), name="mine")
    trainer = make_trainer([cb], max_steps=9, logger=logger)
    trainer.fit(LitGPT(n_layer=1, d_model=32, n_head=2),
                datamodule=SyntheticTokenDataModule(batch_size=2, seq_len=64))
    return cb, logger


def test_the_end_of_fit_summary_says_what_ran_and_where_to_look(tmp_path, capsys):
    cb, logger = _fit(tmp_path)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("seqmem: ")]
    assert len(lines) == 2, lines
    folder = Path(logger.log_dir)
    assert folder.name == "version_0"
    longest = max(r.seq_len for r in cb.records)
    peak = max(r.peak_bytes for r in cb.records)
    assert longest == 64
    assert f"longest length {longest} tokens (batch 2); peak {format_bytes(peak)}" in lines[0]
    assert "usable budget 180.0 MiB (budget 200.0 MiB)" in lines[0] and "OVER" not in lines[0]
    assert f"rungs on: {', '.join(cb.applied_mitigations) or 'none'}" in lines[0]
    assert re.search(rf"; {len(cb.planner.advice.warned)} warnings?", lines[0])
    assert (f"report in {folder} (seqmem_report.md, seqmem_report.json, seqmem_memory.png)"
            in lines[1])
    assert f"tensorboard --logdir {folder}" in lines[1] and f"seqmem panels {folder}" in lines[1]
    for name in ("seqmem_report.md", "seqmem_report.json", "seqmem_memory.png"):
        assert (folder / name).is_file(), name  # the files it names are there
    assert any(p.name.startswith("events.out.tfevents") for p in folder.iterdir())


def test_summary_false_prints_nothing(tmp_path, capsys):
    _fit(tmp_path, summary=False)
    assert "seqmem: " not in capsys.readouterr().out


def test_the_printed_lines_the_report_its_renderings_and_the_oom_file_say_the_same_run(tmp_path,
                                                                                       capsys):
    """One :class:`~lightning_seqmem.present.summary.RunSummary` behind all of them: the end-of-fit
    line, the report's ``summary`` (its Markdown, ``seqmem report``'s console tables) and the OOM
    diagnosis, on a run that switches a rung on under a budget and caps its curriculum."""
    import json

    import torch

    from lightning_seqmem.present.report import load_report
    from lightning_seqmem.present.render import render_console, render_markdown
    from lightning_seqmem.present.summary import RunSummary, run_summary
    from lightning_seqmem.trainer.outputs import write_oom_diagnosis

    cb = SeqMemCallback(warmup_steps=1, memory_budget=1_300_000, safety_margin=0.0,
                        mitigations=("attention", "microbatch"), dry_run=False,
                        curriculum=Curriculum(start=16, target=256, steps_per_stage=2,
                                              multiple_of=16))
    logger = TensorBoardLogger(save_dir=str(tmp_path / "runs"), name="mine")
    trainer = make_trainer([cb], max_steps=24, logger=logger)
    trainer.fit(LitGPT(n_layer=1, d_model=32, n_head=2),
                datamodule=SyntheticTokenDataModule(batch_size=2, seq_len=256))
    first = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("seqmem: ")][0]
    summary = run_summary(PlanView.of(cb.planner))
    assert summary.rungs_on and summary.capped_at is not None  # the scenario: a rung on, a cap
    # the truth, from the records themselves
    assert (summary.peak_bytes == max(r.peak_bytes for r in cb.records)
            <= summary.usable_budget_bytes)
    assert summary.longest_seq_len == max(r.seq_len for r in cb.records) and not summary.over_budget
    assert (summary.rungs_on == cb.applied_mitigations
            and summary.num_warnings == len(cb.planner.advice.warned))
    assert first.startswith(f"seqmem: {summary.sentence()}")
    report = load_report(Path(logger.log_dir))
    assert RunSummary.from_dict(report["summary"]) == summary
    assert summary.sentence() in (Path(logger.log_dir) / "seqmem_report.md").read_text()
    assert summary.sentence() in render_markdown(report)
    from rich.console import Console

    console = Console(record=True, width=400)
    render_console(report, console)
    assert summary.sentence() in console.export_text()
    path = write_oom_diagnosis(PlanView.of(cb.planner), trainer,
                               torch.cuda.OutOfMemoryError("injected"))
    diagnosis = json.loads(Path(path).read_text())
    assert RunSummary.from_dict(diagnosis["summary"]) == summary
    assert (diagnosis["mitigations_applied"] == list(summary.rungs_on)
            and diagnosis["usable_budget_bytes"] == 1_300_000)
