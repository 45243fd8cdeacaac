"""The ``seqmem`` command, the example scripts and the YAML configs, run as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_seqmem.cli.main import main
from limits import limit_s, shared_fixture

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
EXAMPLES = ROOT / "examples"


def _run(args, cwd, timeout=240):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "COLUMNS": "140"}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=limit_s(timeout))
    assert proc.returncode == 0, (f"{args} failed ({proc.returncode}):\n{proc.stdout[-4000:]}"
                                  f"\n{proc.stderr[-4000:]}")
    return proc.stdout + proc.stderr


# the demo's curriculum (its defaults: 64 -> 1024 tokens), 3 steps per stage, and no steps after
# the last stage (the default adds 6 per mitigation, all at 1024 tokens)
STAGES, STEPS_PER_STAGE = [64, 128, 256, 512, 1024], 3
DEMO_STEPS = len(STAGES) * STEPS_PER_STAGE


@shared_fixture  # once per module; a failure fails one test, the others skip
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "runs"
    # the README's main job, shorter
    text = _run(["-m", "lightning_seqmem.cli.main", "demo", "--out", str(out), "--steps-per-stage",
                 str(STEPS_PER_STAGE), "--max-steps", str(DEMO_STEPS)], cwd=out.parent)
    return out, text


def test_demo_trains_logs_and_reports(demo):
    out, text = demo
    log_dir = out / "demo" / "version_0"
    assert any(p.name.startswith("events.out.tfevents") for p in log_dir.iterdir())
    for name in ("seqmem_report.json", "seqmem_report.md", "seqmem_memory.png"):
        assert (log_dir / name).is_file(), name
        assert name in text
    assert ("seqmem: run" in text and "largest length that fits" in text
            and "tensorboard --logdir" in text)
    report = json.loads((log_dir / "seqmem_report.json").read_text())
    assert report["records_summary"]["num_records"] == DEMO_STEPS  # every step measured
    # eager attention at 1024 tokens is forecast over the 200 MiB default budget: SDPA is switched
    # on before that stage, and the curriculum reaches its target within the budget
    assert report["run"]["curriculum"]["stages_run"] == STAGES
    assert report["mitigations"]["active"] == ["attention"]
    # decided before the 1024 stage, from the dry run's 1024 peak
    event = report["mitigations"]["events"][0]
    assert event["seq_len"] == 1024 and event["before_method"] == "dry_run"
    assert event["after_bytes"] < event["before_bytes"]
    assert report["records_summary"]["max_peak_bytes"] <= 0.9 * 200 * 2**20
    assert report["forecasts"]["max_seq_len"] is not None
    assert "switched on attention" in text


def test_panels_command_draws_the_run(demo, tmp_path):
    out, _ = demo
    png = tmp_path / "panels.png"
    assert main(["panels", str(out / "demo" / "version_0"), "--out", str(png)]) == 0
    assert png.stat().st_size > 20_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_command_renders_saved_report(demo, capsys):
    out, _ = demo
    path = out / "demo" / "version_0" / "seqmem_report.json"
    assert main(["report", str(path)]) == 0
    text = capsys.readouterr().out
    assert "seqmem: run" in text and "measured peaks" in text and "forecasts" in text
    assert main(["report", str(path.parent), "--markdown"]) == 0
    assert capsys.readouterr().out.startswith("# lightning-seqmem report")


def test_forecast_command_from_config(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    json_path = tmp_path / "forecast.json"
    assert main(["forecast", "--config", str(CONFIGS / "cpu_demo.yaml"), "--lengths", "256", "512",
                 "4096", "--trace-lengths", "32", "64", "128", "--budget", "256MiB", "--json",
                 str(json_path)]) == 0
    text = capsys.readouterr().out
    assert "largest length that fits" in text and "4096" in text
    result = json.loads(json_path.read_text())
    assert [f["seq_len"] for f in result["forecasts"]] == [256, 512, 4096]
    assert all(f["method"] == "replay" for f in result["forecasts"])
    assert [f["fits"] for f in result["forecasts"]] == [True, True, False]
    assert (result["budget_bytes"] == 256 * 2**20
            and result["usable_budget_bytes"] == int(256 * 2**20 * 0.9))
    assert 512 < result["max_seq_len"] < 4096
    assert not list(tmp_path.glob("seqmem_runs")), "forecast must not create the config's logger"
    # where the memory goes (on by default): 32 and 128 are widths of the model (head size, d_model)
    assert ("peak memory by kind" in text and "peak memory by module" in text
            and "attention share" in text)
    assert ("L=4096 (extrapolated)" in text and "crossover length" in text
            and "hand-written matmul" in text)
    breakdown = result["breakdown"]
    assert breakdown["seq_lens"] == [24, 64, 120] and breakdown["extrapolated_seq_len"] == 4096
    assert ({r["category"]: r["growth"] for r in breakdown["activations"]}["attention_scores"]
            == "quadratic")
    assert 120 < breakdown["crossover_seq_len"] < 4096
    assert breakdown["attention_share_extrapolated"] > 0.5 > breakdown["attention_share"][0]


def test_forecast_breakdown_with_sdpa_has_no_crossover(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "sdpa.yaml"
    config.write_text(
        (CONFIGS / "cpu_demo.yaml").read_text().replace("attention: eager", "attention: sdpa"))
    json_path = tmp_path / "forecast.json"
    assert main(["forecast", "--config", str(config), "--lengths", "2048", "--trace-lengths", "40",
                 "80", "--json", str(json_path)]) == 0
    text = capsys.readouterr().out
    assert "never exceed the rest" in text and "sdpa" in text and "diagnosis" not in text
    breakdown = json.loads(json_path.read_text())["breakdown"]
    assert breakdown["crossover_seq_len"] is None and breakdown["diagnoses"] == []
    assert "quadratic" not in {r["growth"] for r in breakdown["activations"]}


def test_forecast_matches_training(demo, tmp_path, monkeypatch):
    """The forecast without training predicts the peak the demo measured training (same model)."""
    out, _ = demo
    report = json.loads((out / "demo" / "version_0" / "seqmem_report.json").read_text())
    # the demo measures 128 tokens twice: with eager attention (as cpu_demo.yaml) and after SDPA
    measured = {p["seq_len"]: p["peak_bytes"] for p in report["points"] if not p.get("mitigations")}
    monkeypatch.chdir(tmp_path)
    json_path = tmp_path / "forecast.json"
    assert main(["forecast", "--config", str(CONFIGS / "cpu_demo.yaml"), "--lengths", "128",
                 "--trace-lengths", "32", "48", "64", "--no-breakdown", "--json",
                 str(json_path)]) == 0
    assert json.loads(json_path.read_text())["breakdown"] is None
    forecast = json.loads(json_path.read_text())["forecasts"][0]
    assert forecast["peak_bytes"] == pytest.approx(measured[128], rel=0.01)


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "demo" in text and "report" in text and "forecast" in text


@pytest.mark.parametrize("config",
                         ["cpu_demo.yaml", pytest.param("ddp_cpu.yaml", marks=pytest.mark.ddp)])
def test_gpt_configs_run_through_lightning_cli(config, tmp_path):
    text = _run([str(EXAMPLES / "train_gpt_cli.py"), "fit", "--config", str(CONFIGS / config),
                 "--trainer.max_steps", "3", "--trainer.enable_progress_bar", "false"],
                 cwd=tmp_path)
    assert "seqmem report:" in text
    reports = list(tmp_path.glob("seqmem_runs/*/version_0/seqmem_report.json"))
    assert len(reports) == 1
    report = json.loads(reports[0].read_text())
    assert report["records_summary"]["num_records"] == 3
    if config == "ddp_cpu.yaml":
        assert report["run"]["world_size"] == 2


@pytest.mark.slow
def test_hf_config_runs_through_lightning_cli(tmp_path):
    _run([str(EXAMPLES / "hf_causal_lm.py"), "fit", "--config", str(CONFIGS / "hf_causal_lm.yaml"),
          "--trainer.max_steps", "3", "--trainer.enable_progress_bar", "false"], cwd=tmp_path)
    assert list(tmp_path.glob("seqmem_runs/hf_causal_lm/version_0/events.out.tfevents*"))


def test_every_config_parses_with_its_callback(tmp_path, monkeypatch):
    """All configs (the CUDA one on CPU with a small model) give the documented callback values."""
    pytest.importorskip("transformers")
    from lightning_seqmem import SeqMemCallback
    from lightning_seqmem.cli.common import build_from_config

    monkeypatch.chdir(tmp_path)
    small = ["--model.init_args.n_layer=1", "--model.init_args.d_model=32",
             "--model.init_args.n_head=2", "--model.init_args.d_ff=64",
             "--model.init_args.vocab_size=512", "--data.init_args.vocab_size=512",
             "--trainer.accelerator=cpu"]
    expected = {
        "cpu_demo.yaml": (2**30, (64, 128, 256, 512, 1024), "32-true", []),
        "ddp_cpu.yaml": (512 * 2**20, (64, 128, 256), "32-true", []),
        "fsdp2_cpu.yaml": (64 * 2**20, (256, 512, 1024), "32-true", []),
        "gpt2_small_8k_80gb.yaml": (76 * 2**30, (512, 1024, 2048, 4096, 8192), "bf16-mixed", small),
        "hf_causal_lm.yaml": (900 * 10**6, (64, 128, 256, 512), "32-true", []),
        "sequence_parallel_8gpu.yaml": (512 * 2**20, (32768, 65536, 131072), "32-true", []),
        # Llama-3.1-8B and 70B shapes on the meta device, as seqmem plan builds them (no allocation)
        "llama3_8b_long.yaml": (None, (16384, 32768, 65536, 131072), "bf16-mixed", []),
        "llama3_70b_node.yaml": (None, None, "bf16-mixed", []),
    }
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(expected)
    for name, (budget, stages, precision, overrides) in expected.items():
        cli = build_from_config(str(CONFIGS / name), overrides=overrides,
                                meta=name.startswith("llama3"))
        callback = next(c for c in cli.trainer.callbacks if isinstance(c, SeqMemCallback))
        assert callback.config.memory_budget_bytes == budget, name
        assert ((callback.config.curriculum.stages if callback.config.curriculum else None)
                == stages), name
        assert str(cli.trainer.precision) == precision, name


@pytest.mark.parametrize("script", ["hf_causal_lm.py", "forecast_without_training.py"])
def test_examples_run_as_the_readme_says(script, tmp_path):
    text = _run([str(EXAMPLES / script)], cwd=tmp_path)
    assert "largest length that fits" in text
