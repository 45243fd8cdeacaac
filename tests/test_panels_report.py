"""TensorBoard panels and the report, read back from what a real (tiny) fit wrote."""

from __future__ import annotations

import json
import re

import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from lightning_seqmem import Curriculum, SeqMemCallback, StepRecord
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.core.advice import KINDS
from lightning_seqmem.trainer.outputs import log_figure, report_dir, write_layout, write_report
from lightning_seqmem.present.panels import (
    FIGURE_TAG, LAYOUT_CATEGORIES, custom_scalars_layout, memory_figure)
from lightning_seqmem.plan.planner import SeqMemPlanner
from lightning_seqmem.core.records import PHASES
from lightning_seqmem.present.report import JSON_NAME, build_report, load_report
from lightning_seqmem.present.render import render_console, render_markdown
from lightning_seqmem.plan.view import PlanView

from conftest import make_trainer

GIB = 2**30


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One fit: 9 steps, curriculum 16 → 32 → 64, TensorBoard logger; layout, figure and report
    written."""
    root = tmp_path_factory.mktemp("panels")
    callback = SeqMemCallback(memory_budget="64MiB",
                              curriculum=Curriculum(start=16, target=64, steps_per_stage=3))
    logger = TensorBoardLogger(save_dir=str(root), name="tb")
    trainer = make_trainer([callback], max_steps=9, logger=logger, log_every_n_steps=1)
    assert write_layout(trainer) == 1
    assert write_layout(trainer) == 0  # once per logger
    trainer.fit(LitGPT(n_layer=1, d_model=32, n_head=2),
                SyntheticTokenDataModule(batch_size=2, seq_len=64, num_samples=32))
    figure = log_figure(trainer, PlanView.of(callback.planner))
    paths = callback.write_report(trainer)
    accumulator = EventAccumulator(logger.log_dir,
                                   size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    accumulator.Reload()
    return {"callback": callback, "trainer": trainer, "logger": logger, "figure": figure,
            "paths": paths, "events": accumulator}


def _scalars(events, tag):
    return {e.step: e.value for e in events.Scalars(tag)}


def test_records_cover_three_lengths(run):
    cb = run["callback"]
    assert [r.seq_len for r in cb.records] == [16] * 3 + [32] * 3 + [64] * 3
    assert cb.forecaster.verifications, "the length 64 should verify a forecast"


def test_custom_scalars_layout_written(run):
    events = run["events"]
    tags = list(events.PluginTagToContent("custom_scalars"))
    assert tags == ["custom_scalars__config__"]
    written = events.Tensors(tags[0])
    assert len(written) == 1  # written once
    layout = layout_pb2.Layout()
    layout.ParseFromString(written[0].tensor_proto.string_val[0])
    assert [c.title for c in layout.category] == list(LAYOUT_CATEGORIES)
    expected = custom_scalars_layout()
    for category in layout.category:
        charts = {chart.title: list(chart.multiline.tag) for chart in category.chart}
        assert charts == {title: spec[1] for title, spec in expected[category.title].items()}


def test_layout_tags_are_exactly_the_callback_tags(run):
    documented = set(re.findall(r"``(seqmem/\w+)``", SeqMemCallback.__doc__))
    logged = {t for t in run["events"].Tags()["scalars"] if t.startswith("seqmem/")}
    in_layout = {tag for category in custom_scalars_layout().values() for spec in category.values()
                 for tag in spec[1]}
    assert in_layout == documented | logged
    assert all(spec[0] == "Multiline" for c in custom_scalars_layout().values()
               for spec in c.values())
    assert all(re.search(r"\((GiB|tokens|count|index|samples|of .*)", title) or "error" in title
               or "warm-up" in title
               for c in custom_scalars_layout().values() for title in c)  # units in titles


def test_layout_follows_the_logger_prefix(tmp_path):
    logger = TensorBoardLogger(save_dir=str(tmp_path), prefix="run1")
    trainer = make_trainer([], max_steps=1, logger=logger)
    assert write_layout(trainer) == 1
    logger.experiment.flush()
    events = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0})
    events.Reload()
    layout = layout_pb2.Layout()
    layout.ParseFromString(events.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    tags = {tag for c in layout.category for chart in c.chart for tag in chart.multiline.tag}
    # TensorBoardLogger(prefix="run1") logs "run1-seqmem/..."
    assert "run1-seqmem/headroom_gib" in tags
    assert all(tag.startswith("run1-seqmem/") for tag in tags)


def test_scalars_equal_the_records(run):
    events, records = run["events"], run["callback"].records
    tags = set(events.Tags()["scalars"])
    for name in ("seq_len", "batch_size", "warmup", "peak_allocated_gib", "peak_forward_gib",
                 "peak_backward_gib", "peak_optimizer_gib", "stage", "budget_gib",
                 "forecast_next_gib", "max_seq_len", "headroom_gib",
                 "headroom_fraction", "verification_error"):
        assert f"seqmem/{name}" in tags, name
    # CPU
    assert not any(t.startswith("seqmem/reserved")
                   or t.startswith("seqmem/fragmentation") for t in tags)
    peak = _scalars(events, "seqmem/peak_allocated_gib")
    seq_len = _scalars(events, "seqmem/seq_len")
    assert sorted(peak) == [r.global_step for r in records]
    for r in records:
        # float32 in the event file
        assert peak[r.global_step] == pytest.approx(r.peak_bytes / GIB, rel=1e-6)
        assert seq_len[r.global_step] == r.seq_len
        for phase in PHASES:
            value = getattr(r, f"{phase}_peak_bytes")
            if value is not None:
                assert _scalars(events, f"seqmem/peak_{phase}_gib")[r.global_step] == pytest.approx(
                    value / GIB, rel=1e-6)
    budget = _scalars(events, "seqmem/budget_gib")
    assert (budget and all(v == pytest.approx(run["callback"].usable_budget_bytes / GIB, rel=1e-6)
                           for v in budget.values()))


def test_figure_logged_as_image(run):
    assert FIGURE_TAG in run["events"].Tags()["images"]
    image = run["events"].Images(FIGURE_TAG)[-1]
    assert image.step == run["trainer"].global_step and image.width > 100 and image.height > 100
    labels = run["figure"].axes[0].get_legend_handles_labels()[1]
    assert any(label.startswith("timeline replay") for label in labels)
    assert any(label.startswith("quadratic fit") for label in labels)
    assert any(label.startswith("usable budget") for label in labels)
    assert any(label.startswith("measured peak") for label in labels)


def test_figure_is_logged_once_per_step(run):
    before = len(run["events"].Images(FIGURE_TAG))
    log_figure(run["trainer"], PlanView.of(run["callback"].planner))  # same step: skipped
    events = EventAccumulator(run["logger"].log_dir, size_guidance={"images": 0})
    events.Reload()
    # one figure as each stage ended (16 -> 32 at step 3, 32 -> 64 at step 6) and one at the end
    assert ([e.step for e in events.Images(FIGURE_TAG)] == [3, 6, 9]
            and len(events.Images(FIGURE_TAG)) == before)


def test_report_files(run):
    json_path, md_path, png_path = run["paths"]
    assert json_path.parent == md_path.parent == png_path.parent
    assert str(json_path.parent) == run["logger"].log_dir == report_dir(run["trainer"])
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = md_path.read_text()
    assert ("| seq_len | batch | peak | forward |" in markdown and "## Forecasts" in markdown
            and "seqmem_memory.png" in markdown)
    json.loads(json_path.read_text())  # plain JSON (no NaN)


def test_report_points_equal_the_records(run):
    cb, report = run["callback"], load_report(run["paths"][0])
    assert report == load_report(run["paths"][0].parent)
    measured = [r for r in cb.records if not r.warmup]
    expected = {}
    for r in measured:
        expected[(r.seq_len, r.batch_size)] = max(expected.get((r.seq_len, r.batch_size), 0),
                                                  r.peak_bytes)
    assert {(p["seq_len"], p["batch_size"]): p["peak_bytes"] for p in report["points"]} == expected
    for p in report["points"]:
        point = cb.forecaster.points[(p["seq_len"], p["batch_size"])]
        assert p["peak_bytes"] == point["step"]
        for phase in PHASES:
            assert p[f"{phase}_peak_bytes"] == point.get(phase)
        assert p["num_steps"] == sum(1 for r in measured if (r.seq_len, r.batch_size)
                                     == (p["seq_len"], p["batch_size"]))
    assert report["records"] == [r.to_dict() for r in cb.records]
    assert report["records_summary"]["num_records"] == len(cb.records)
    assert report["records_summary"]["max_peak_bytes"] == max(r.peak_bytes for r in cb.records)


def test_report_facts_and_predictors(run):
    cb, trainer, report = run["callback"], run["trainer"], load_report(run["paths"][0])
    facts = report["run"]
    assert facts["device"] == "cpu" and facts["probe"] == "tracker"
    assert (facts["budget_bytes"] == 64 * 2**20
            and facts["usable_budget_bytes"] == cb.usable_budget_bytes)
    # the class's own module
    assert facts["model_class"] == "lightning_seqmem.reference.demo.LitGPT"
    assert facts["num_parameters"] == sum(p.numel() for p in trainer.lightning_module.parameters())
    assert facts["precision"] == "32-true"
    assert (facts["curriculum"]["stages"] == [16, 32, 64]
            and facts["curriculum"]["stages_run"] == [16, 32, 64])
    pred = report["predictors"]
    assert (pred["replay"]["available"] and pred["replay"]["seq_lens"]
            == [t.seq_len for t in cb.forecaster.traces] == [16, 32, 64])
    # "step": the whole step
    assert pred["quadratic"]["available"] and set(pred["quadratic"]["phases"]) == {*PHASES, "step"}
    assert [(v["seq_len"], v["method"]) for v in pred["verifications"]] == [
        (v.seq_len, v.method) for v in cb.forecaster.verifications]
    # with a budget every new length is judged by the dry run first, so its forecasts are the ones
    # verified
    assert {v.method for v in cb.forecaster.verifications} == {"dry_run"}
    assert pred["accuracy"]["dry_run"]["max_abs_error"] == max(
        abs(v.relative_error) for v in cb.forecaster.verifications)
    assert pred["accuracy"]["dry_run"]["max_abs_error"] < 0.01
    fc = report["forecasts"]
    assert fc["max_seq_len"] == cb.max_seq_len()
    at = {f["seq_len"]: f for f in fc["at"]}
    assert {16, 32, 64, 128, 256} <= set(at)
    # the fit of the setting on now
    assert at[128]["peak_bytes"] == cb.forecaster.forecast(128, 2).peak_bytes
    # the callback's own forecast asks the dry run: it agrees with the fit here
    dry = cb.forecast(128)
    assert (dry.method == "dry_run"
            and abs(dry.peak_bytes - at[128]["peak_bytes"]) <= 0.01 * dry.peak_bytes)
    # where it sits, traced
    assert dry.detail.endswith(f"; peak at {cb.planner.evidence.dry.site(128, 2, ()).describe()}")
    assert at[64]["fits"] is True
    assert report["mitigations"]["active"] == [] and report["mitigations"]["changes"] == []
    # where the peak sits at the longest length run (64 tokens, no breakdown traced): the dry run of
    # that step
    site = report["peak_site"]
    assert (site["source"] == "dry_run"
            and (site["seq_len"], site["batch_size"], site["mitigations"]) == (64, 2, []))
    assert (site["describe"] == cb.planner.evidence.dry.site(64, 2, ()).describe()
            and site["phase"] in ("backward", "loss"))
    assert site["peak_bytes"] == pytest.approx(cb.planner.evidence.dry.peak(64, 2, ())[0], rel=0.01)
    assert report["mitigations"]["allowed"] == list(cb.mitigations)
    keys = [w["key"] for w in report["warnings"]]
    # each warning said once, all of them
    assert keys == sorted(set(keys)) and set(keys) == set(cb.planner.advice.warned)
    for w in report["warnings"]:
        assert (w["kind"] == cb.planner.advice.warned[w["key"]] and w["kind"] in KINDS
                and w["meaning"])


def test_render_console_and_markdown(run):
    from rich.console import Console

    report = load_report(run["paths"][0])
    console = Console(record=True, width=140)
    render_console(report, console)
    text = console.export_text()
    assert "seqmem: run" in text and "largest length that fits" in text and "replay" in text
    assert f"{report['forecasts']['max_seq_len']} tokens" in text
    assert render_markdown(report).startswith("# lightning-seqmem report")


def test_report_before_any_measurement(tmp_path):
    cb = SeqMemCallback()
    report = build_report(PlanView.of(cb.planner))
    assert report["points"] == [] and report["forecasts"]["error"]
    from rich.console import Console

    console = Console(record=True, width=140)
    render_console(report, console)
    text, markdown = console.export_text(), render_markdown(report)
    assert "seqmem: run" in text and report["forecasts"]["error"].split(":")[0] in text
    assert (markdown.startswith("# lightning-seqmem report")
            and "largest length that fits" not in text)
    json_path, _, png_path = write_report(PlanView.of(cb.planner), directory=tmp_path)
    assert json_path.name == JSON_NAME and png_path.exists()


def test_report_dir_without_logger(tmp_path):
    trainer = make_trainer([], max_steps=1, default_root_dir=str(tmp_path))
    assert report_dir(trainer) == str(tmp_path)


def _record(step, seq_len, peak, mitigations=()):
    return StepRecord(step=step, global_step=step, epoch=0, seq_len=seq_len, batch_size=2,
                      warmup=False, traced=False, peak_bytes=peak, forward_peak_bytes=peak,
                      backward_peak_bytes=peak // 2, optimizer_peak_bytes=peak // 4,
                      start_bytes=peak // 8, mitigations=tuple(mitigations))


def _callback_with_mitigations():
    cb = SeqMemPlanner(memory_budget_bytes=2**30)
    cb.evidence.measured.records = [_record(0, 128, 20 * 2**20), _record(1, 256, 60 * 2**20),
                  _record(2, 512, 90 * 2**20, ["attention"]),
                                    _record(3, 1024, 200 * 2**20, ["attention", "checkpointing"])]
    for r in cb.evidence.measured.records:
        cb.evidence.forecaster.add_measurement(r.seq_len, r.batch_size,
                                               {"forward": r.forward_peak_bytes})
    cb.evidence.measured.last_batch_size = 2
    return cb


def test_figure_marks_mitigations_from_records():
    cb = _callback_with_mitigations()
    labels = memory_figure(PlanView.of(cb)).axes[0].get_legend_handles_labels()[1]
    assert any("switched on at L=512: attention" in label for label in labels)
    assert any("switched on at L=1024: checkpointing" in label for label in labels)
    assert any(label.startswith("quadratic fit") for label in labels)
    assert not any(label.startswith("timeline replay") for label in labels)  # nothing traced
    report = build_report(PlanView.of(cb))
    assert [c["seq_len"] for c in report["mitigations"]["changes"]] == [512, 1024]
    assert [c["after"] for c in report["mitigations"]["changes"]] == [
        ["attention"], ["attention", "checkpointing"]]
    assert report["predictors"]["replay"]["available"] is False


def test_figure_and_report_use_the_mitigation_events():
    cb = _callback_with_mitigations()
    cb.ladder.events = [{"name": "attention", "step": 1, "seq_len": 256,
                         "detail": "attention eager -> sdpa",
                             "before_bytes": 60 * 2**20, "after_bytes": 30 * 2**20}]
    labels = memory_figure(PlanView.of(cb)).axes[0].get_legend_handles_labels()[1]
    # where it was decided
    assert any("switched on at L=256: attention" in label for label in labels)
    report = build_report(PlanView.of(cb))
    assert report["mitigations"]["events"] == cb.ladder.events
    markdown = render_markdown(report)
    assert ("attention eager -> sdpa" in markdown and "60.0 MiB" in markdown
            and "30.0 MiB" in markdown)
