"""``seqmem plan``: the dry-run planner of a LightningCLI config, run as a user runs it."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_seqmem.cli.main import main
from lightning_seqmem.plan.judging import dry_run_bound
from limits import limit_s, shared_fixture

ROOT = Path(__file__).resolve().parents[1]
CPU_DEMO = ROOT / "configs" / "cpu_demo.yaml"
# two lengths with different plans: 1024 (eager fits) and 32768 (the whole ladder)
LENGTHS = [1024, 32768]


def _seqmem(args, cwd, timeout=120):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "COLUMNS": "140"}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "lightning_seqmem.cli.main", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=limit_s(timeout))
    return proc, time.perf_counter() - started


@shared_fixture  # once per module; a failure fails one test, the others skip
def plan(tmp_path_factory):
    """``seqmem plan --config configs/cpu_demo.yaml --lengths 1024 32768 --json``: (document, wall
    seconds)."""
    cwd = tmp_path_factory.mktemp("plan")
    proc, seconds = _seqmem(["plan", "--config", str(CPU_DEMO), "--lengths", *map(str, LENGTHS),
                             "--json"], cwd)
    assert proc.returncode == 0, (f"seqmem plan failed ({proc.returncode}):\n"
                                  f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    assert not list(cwd.iterdir()), "plan must not create the config's logger or any file"
    return json.loads(proc.stdout), seconds  # stdout holds the JSON document alone


def test_plan_json_on_cpu_demo(plan):
    doc, seconds = plan
    # its own clock sits inside the process's (no limit on time: see benchmarks/)
    assert doc["seconds"] < seconds
    assert doc["method"] == "dry_run" and doc["config"] == str(CPU_DEMO)
    assert "attention: eager" in CPU_DEMO.read_text()  # the demo model materialises L x L scores
    # the config's SeqMemCallback: 1 GiB, 10% margin, the whole ladder (all three rungs apply to
    # LitGPT, batch 4)
    assert doc["budget_bytes"] == 2**30 and doc["usable_budget_bytes"] == int(2**30 * 0.9)
    assert doc["batch_size"] == 4 and doc["skipped"] == {}
    sets = [[], ["attention"], ["attention", "checkpointing"],
            ["attention", "checkpointing", "microbatch"]]
    assert doc["mitigation_sets"] == sets
    assert [entry["seq_len"] for entry in doc["lengths"]] == LENGTHS
    usable = doc["usable_budget_bytes"]
    for entry in doc["lengths"]:
        rows = entry["rows"]
        assert [r["mitigations"] for r in rows] == sets
        for r in rows:
            assert (r["error"] is None and isinstance(r["peak_bytes"], int)
                    and r["peak_bytes"] > 0), r
            # judged as the callback judges a dry run before its first steps: the peak with the dry
            # run's margin
            assert r["bound_bytes"] == dry_run_bound(r["peak_bytes"]) > r["peak_bytes"], r
            assert r["fits"] is (r["bound_bytes"] <= usable), r
            assert r["seconds"] > 0
        assert entry["plan"] == next((r["mitigations"] for r in rows if r["fits"]), None)
    for i in range(len(sets)):  # each set's peak grows with the length
        peaks = [entry["rows"][i]["peak_bytes"] for entry in doc["lengths"]]
        assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks), (sets[i], peaks)
    at_32k = {tuple(r["mitigations"]): r["peak_bytes"] for r in doc["lengths"][1]["rows"]}
    assert at_32k[("attention",)] < at_32k[()] / 10  # SDPA: no [4, 4, 32768, 32768] scores
    # the plan changes with the length on this budget: something fits everywhere, and not always
    # without help
    assert all(entry["plan"] is not None for entry in doc["lengths"])
    assert len({tuple(entry["plan"]) for entry in doc["lengths"]}) > 1
    assert doc["largest_fitting_seq_len"] is None  # no search when something fits at every length


def test_plan_lists_the_fastest_fitting_setting_per_length(plan):
    """Per length, the fastest setting that fits (by the rungs' priors) among every setting dry-run,
    and per setting the longest of the dry-run lengths it fits."""
    from lightning_seqmem.plan.pricing import prior_factor

    doc, _ = plan
    usable = doc["usable_budget_bytes"]
    for entry in doc["lengths"]:
        fast = entry["fastest"]
        every = entry["rows"] + entry["searched_rows"]
        assert fast is not None and dry_run_bound(fast["peak_bytes"]) <= usable and fast["why"]
        # priors are per device type where a rung's differs
        device_type = doc["device"].split(":")[0]
        assert fast["step_time_factor"] == pytest.approx(
            prior_factor(fast["mitigations"], device_type))
        fitting = [r for r in every if r["peak_bytes"] is not None
                   and dry_run_bound(r["peak_bytes"]) <= usable]
        assert fast["step_time_factor"] == pytest.approx(
            min(prior_factor(r["mitigations"], device_type) for r in fitting))
        prefixes = [r["mitigations"] for r in entry["rows"]]
        # each set dry-run once
        assert all(r["mitigations"] not in prefixes for r in entry["searched_rows"])
    for item in doc["longest_fitting_by_set"]:
        fits = [e["seq_len"] for e in doc["lengths"] for r in e["rows"] + e["searched_rows"]
                if r["mitigations"] == item["mitigations"]
                and dry_run_bound(r["peak_bytes"]) <= usable]
        assert item["seq_len"] == (max(fits) if fits else None)


def test_a_setting_over_at_a_shorter_length_is_not_dry_run_again(tmp_path, monkeypatch, capsys):
    """The fastest-setting search takes a setting over the budget at a shorter length as over at a
    longer one (a step's peak does not fall as the sequence grows) without dry-running it there; the
    answer is the one a plan of that length alone gives, which dry-runs every setting it judges.
    (450 MiB: at 32768 tokens the settings beyond the ladder's prefixes are judged and over, and the
    whole ladder fits; at 34816 it still fits, so neither plan searches a largest length.)"""
    monkeypatch.chdir(tmp_path)

    def planned(*lengths):
        assert main(["plan", "--config", str(CPU_DEMO), "--budget", "450MiB", "--lengths",
                     *map(str, lengths), "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    doc = planned(32768, 34816)
    usable = doc["usable_budget_bytes"]
    first, second = doc["lengths"]
    over = {tuple(r["mitigations"]) for r in first["rows"] + first["searched_rows"]
            if r["peak_bytes"] is not None and dry_run_bound(r["peak_bytes"]) > usable}
    judged_again = over - {tuple(r["mitigations"]) for r in second["rows"]}
    # something to skip
    assert {tuple(r["mitigations"]) for r in first["searched_rows"]} & judged_again
    assert not {tuple(r["mitigations"]) for r in second["searched_rows"]} & over
    alone = planned(34816)["lengths"][0]
    assert second["fastest"] is not None and alone["fastest"] == second["fastest"]
    assert len(alone["searched_rows"]) > len(second["searched_rows"])  # the dry runs it saved


def test_plan_says_where_the_peak_sits_per_length(plan):
    """The "peak at" field: the chosen plan's step, its phase and kinds traced on the fake step."""
    doc, _ = plan
    for entry in doc["lengths"]:
        site = entry["peak_at"]
        assert site["mitigations"] == entry["plan"], entry
        chosen = next(r for r in entry["rows"] if r["mitigations"] == entry["plan"])
        # the kinds add up to its peak
        assert site["peak_bytes"] == pytest.approx(chosen["peak_bytes"], rel=0.01)
    first, last = doc["lengths"][0]["peak_at"], doc["lengths"][-1]["peak_at"]
    # eager at 1024 tokens
    assert first["mitigations"] == [] and first["top_kinds"][0][0] == "attention_scores"
    assert "checkpointing" in last["mitigations"] and last["phase"] == "recompute"


@pytest.mark.parametrize("mitigations", [(), ("attention",)])
def test_plan_matches_a_real_training_step(plan, mitigations):
    """The dry-run peak at 1024 tokens is the peak of a real training step of the config's model
    there."""
    from lightning_seqmem.measure.batch import set_batch_sequence_length
    from lightning_seqmem.cli.common import build_from_config
    from lightning_seqmem.mitigations.ladder import apply
    from lightning_seqmem.measure.steps import training_step_memory
    from lightning_seqmem.measure.probes import make_probe

    doc, _ = plan
    predicted = next(r["peak_bytes"] for r in doc["lengths"][0]["rows"]
                     if tuple(r["mitigations"]) == mitigations)
    cli = build_from_config(str(CPU_DEMO))
    cli.datamodule.prepare_data()
    cli.datamodule.setup("fit")
    batch = set_batch_sequence_length(next(iter(cli.datamodule.train_dataloader())), LENGTHS[0])
    model = copy.deepcopy(cli.model).train()
    for name in mitigations:
        assert apply(name, cli.trainer, model, batch).applied
    optimizer = model.configure_optimizers()

    def loss_fn(m, b):
        return m.training_step(b, 0)

    # warm-up: gradients and AdamW state exist afterwards
    training_step_memory(model, optimizer, batch, loss_fn)
    measured = training_step_memory(model, optimizer, batch, loss_fn,
                                    make_probe("tracker", torch.device("cpu")))
    assert predicted == pytest.approx(measured.peak_bytes, rel=0.01), (
        mitigations, predicted, measured.peak_bytes)


def test_plan_rejects_bad_lengths_before_any_work(tmp_path):
    proc, seconds = _seqmem(["plan", "--config", str(CPU_DEMO), "--lengths", "1024", "0"], tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "argument --lengths: must be a positive whole number (≥ 1), got '0'" in proc.stderr
    assert "Seed set" not in proc.stderr  # refused before the config is built


@pytest.mark.parametrize("args, message", [
    (["--config", "no/such.yaml", "--lengths", "64"],
     "argument --config: no such file: 'no/such.yaml'"),
    (["--config", str(CPU_DEMO), "--lengths", "64", "x"],
     "argument --lengths: must be a positive whole number"),
    (["--config", str(CPU_DEMO), "--lengths", "64", "--batch-size", "-2"],
     "argument --batch-size: must be a positive"),
    (["--config", str(CPU_DEMO), "--lengths", "64", "--budget", "80 parsecs"],
     "argument --budget: must be a positive"),
    (["--config", str(CPU_DEMO), "--lengths", "64", "--safety-margin", "1.5"],
     "argument --safety-margin: must be a fraction in [0, 1)"),
])
def test_plan_bad_input_names_the_argument(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_under_the_optimizer_steps_own_peak_only_offload_could_fit_and_nothing_is_searched(
        tmp_path, monkeypatch, capsys):
    """Under the optimizer step's own peak (parameters, gradients, AdamW state and the step's
    temporaries: no rung lowers it) no setting without offload fits at any length: the plan says
    so once, with the lowest optimizer-phase peak of its dry runs, and searches no length (the
    search's bisection would dry-run lengths down to 8 tokens)."""
    from lightning_seqmem.core.units import format_bytes

    monkeypatch.chdir(tmp_path)
    args = ["plan", "--config", str(CPU_DEMO), "--lengths", "64", "256", "--budget", "6MiB"]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = [r for entry in doc["lengths"] for r in entry["rows"]]
    floor = min(r["optimizer_peak_bytes"] for r in rows)
    assert dry_run_bound(floor) > doc["usable_budget_bytes"] > floor // 2
    assert all(r["fits"] is False for r in rows) and doc["largest_fitting_seq_len"] is None
    assert doc["dry_runs"] == len(rows) == 8  # the table's: no search
    assert main(args) == 0
    text = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    said = f"the optimizer step alone peaks at {format_bytes(floor)} (parameters, gradients,"
    assert text.count("the optimizer step alone peaks at") == 1 and said in text
    assert "no setting without offload fits at any length" in text
    assert "foreach=False" not in text  # on the CPU AdamW steps per tensor already
    assert text.count("not even 8 tokens fit with") == 2  # a line per length, not searched
    # a budget over it: not said
    assert main(["plan", "--config", str(CPU_DEMO), "--lengths", "64", "--budget", "16MiB"]) == 0
    assert "the optimizer step alone" not in capsys.readouterr().out


def test_on_the_simulated_gpu_the_floor_names_the_per_tensor_step_where_it_is_foreach(
        tmp_path, monkeypatch, capsys):
    """A CUDA config's AdamW (``foreach=None``) takes the foreach step, whose temporaries (one more
    fp32 copy of the parameters) are in the floor: the line names ``foreach=False``; planned with
    ``HFCausalLM(foreach=False)`` the floor is lower and the line does not name it."""
    monkeypatch.chdir(tmp_path)
    floors, named = {}, {}
    for foreach in (None, False):
        config = tmp_path / f"llama_{foreach}.yaml"
        config.write_text(f"""
trainer:
  accelerator: cuda
  precision: bf16-mixed
  callbacks: [{{class_path: lightning_seqmem.SeqMemCallback, init_args: {{mitigations: []}}}}]
model:
  class_path: lightning_seqmem.reference.hf.HFCausalLM
  init_args: {{foreach: {json.dumps(foreach)}, config: {{num_hidden_layers: 1, hidden_size: 64,
                                                       intermediate_size: 128}}}}
data:
  class_path: lightning_seqmem.reference.demo.SyntheticTokenDataModule
  init_args: {{batch_size: 1, seq_len: 64, num_samples: 2}}
""")
        args = ["plan", "--config", str(config), "--lengths", "64", "--budget", "1.4MB"]
        assert main([*args, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        rows = doc["lengths"][0]["rows"]
        floors[foreach] = min(r["optimizer_peak_bytes"] for r in rows if not r["offload"])
        assert dry_run_bound(floors[foreach]) > doc["usable_budget_bytes"]  # over, both ways
        assert main(args) == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "no setting without offload fits at any length" in text
        named[foreach] = "foreach=False steps one tensor at a time" in text
    assert floors[None] > floors[False], floors
    assert named == {None: True, False: False}


def test_plan_nothing_fits_searches_the_largest_length(tmp_path, monkeypatch, capsys):
    """Over a tiny budget nothing fits; the largest length that fits with the whole ladder is
    searched."""
    from lightning_seqmem.cli.common import build_from_config, first_optimizer
    from lightning_seqmem.dryrun.step import dry_run_step

    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--config", str(CPU_DEMO), "--lengths", "1024", "--budget", "16MiB"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    ladder = ("attention", "checkpointing", "microbatch")
    assert ("NO" in text and "yes" not in text
            and "seq_len 1024: nothing fits: the lowest peak is" in text)
    found = re.search(r"the largest length that fits with attention \+ checkpointing \+ microbatch "
                      r"is (\d+) tokens", text)
    assert found, text
    largest = int(found.group(1))
    assert largest % 8 == 0 and 0 < largest < 1024
    # the search's answer, checked by two more dry runs: it fits (with the dry run's margin), 8
    # tokens more do not
    cli = build_from_config(str(CPU_DEMO))
    cli.datamodule.prepare_data()
    cli.datamodule.setup("fit")
    batch = next(iter(cli.datamodule.train_dataloader()))
    optimizer, _ = first_optimizer(cli.model)
    usable = int(16 * 2**20 * 0.9)
    assert dry_run_bound(dry_run_step(cli.model, optimizer, batch, largest,
                                      mitigations=ladder).peak_bytes) <= usable
    assert dry_run_bound(dry_run_step(cli.model, optimizer, batch, largest + 8,
                                      mitigations=ladder).peak_bytes) > usable


def test_plan_longest_searches_the_longest_length_each_setting_fits(tmp_path, monkeypatch, capsys):
    """``--longest``: per setting dry-run, the longest multiple of 8 it fits, checked by two dry
    runs (at 16 MiB, attention alone fits 64 tokens and not 128)."""
    from lightning_seqmem.cli.common import build_from_config, first_optimizer
    from lightning_seqmem.dryrun.step import dry_run_step

    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--config", str(CPU_DEMO), "--lengths", "64", "128", "--budget", "16MiB",
                 "--longest", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    usable = doc["usable_budget_bytes"]
    searched = {tuple(e["mitigations"]): e["searched_seq_len"]
                for e in doc["longest_fitting_by_set"]}
    assert searched[("attention",)] is not None and 64 <= searched[("attention",)] < 128
    cli = build_from_config(str(CPU_DEMO))
    cli.datamodule.prepare_data()
    cli.datamodule.setup("fit")
    batch = next(iter(cli.datamodule.train_dataloader()))
    optimizer, _ = first_optimizer(cli.model)
    found = searched[("attention",)]
    peak = dry_run_step(cli.model, optimizer, batch, found, mitigations=("attention",)).peak_bytes
    assert dry_run_bound(peak) <= usable
    assert dry_run_bound(dry_run_step(cli.model, optimizer, batch, found + 8,
                                      mitigations=("attention",)).peak_bytes) > usable
    fastest = {e["seq_len"]: e["fastest"] for e in doc["lengths"]}
    assert fastest[64]["mitigations"] == [] and dry_run_bound(fastest[128]["peak_bytes"]) <= usable


def test_plan_skips_rungs_that_do_not_apply_and_runs_without_budget(tmp_path, monkeypatch, capsys):
    """An SDPA model at batch 1 without a budget: no attention or micro-batching rung, no fits
    column, no plan."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "sdpa.yaml"
    text = CPU_DEMO.read_text().replace("attention: eager", "attention: sdpa")
    config.write_text(text.replace('memory_budget: "1GiB"', "memory_budget: null"))
    assert main(["plan", "--config", str(config), "--lengths", "512", "2048", "--batch-size", "1",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["budget_bytes"] is None and doc["usable_budget_bytes"] is None
            and doc["batch_size"] == 1)
    assert doc["mitigation_sets"] == [[], ["checkpointing"]]
    assert (set(doc["skipped"]) == {"attention", "microbatch"}
            and "sdpa" in doc["skipped"]["attention"])
    for entry in doc["lengths"]:
        assert (entry["plan"] is None
                and all(r["fits"] is None and r["peak_bytes"] > 0 for r in entry["rows"]))
        # checkpointing saves memory
        assert entry["rows"][1]["peak_bytes"] < entry["rows"][0]["peak_bytes"]

    assert main(["plan", "--config", str(config), "--lengths", "512", "--batch-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "no budget" in out and "fits" not in out.split("no budget")[0]
    assert "rung attention skipped: already on sdpa" in out


def test_plan_says_where_the_dry_run_is_unsupported(tmp_path, monkeypatch, capsys):
    """A training_step that reads an activation's value cannot run on fake tensors: each row says
    why, exit 0."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan_item_model.py").write_text(
        "from lightning_seqmem.reference.demo import LitGPT\n\n\n"
        "class ItemGPT(LitGPT):\n"
        "    def training_step(self, batch, batch_idx):\n"
        "        loss = super().training_step(batch, batch_idx)\n"
        "        assert loss.item() < 1e9  # reads the loss's value\n"
        "        return loss\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "item.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  max_steps: 1\n"
        "model:\n  class_path: plan_item_model.ItemGPT\n  init_args:\n    n_layer: 1\n"
        "    d_model: 32\n    n_head: 2\n"
        "data:\n  class_path: lightning_seqmem.reference.demo.SyntheticTokenDataModule\n"
        "  init_args:\n    batch_size: 2\n    seq_len: 64\n    num_samples: 8\n"
    )
    assert main(["plan", "--config", str(config), "--lengths", "128", "--budget", "1GiB",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["lengths"][0]["rows"]
    # no callback: whole ladder
    assert [r["mitigations"] for r in rows] == doc["mitigation_sets"] and len(rows) == 4
    for r in rows:
        assert r["peak_bytes"] is None and r["fits"] is None
        assert (r["error"].startswith("unsupported: an op reads tensor values")
                and "plan_item_model.py" in r["error"])
    assert doc["lengths"][0]["plan"] is None

    assert main(["plan", "--config", str(config), "--lengths", "128", "--budget", "1GiB"]) == 0
    text = capsys.readouterr().out
    assert (text.count("unsupported [1]") == 4
            and "[1] unsupported: an op reads tensor values" in text)
    assert "seqmem forecast" in text and "no plan: the dry run failed for every set" in text


def test_the_plan_says_what_the_callback_does_at_the_safety_edge(tmp_path, monkeypatch, capsys):
    """A budget whose usable part lies between the unmitigated step's dry-run peak and that peak
    with the dry run's margin: the plan judges the row as the callback judges the batch (over), and
    the setting it names as the fastest that fits is the one the callback switches on before step 0;
    the steps that run stay within the usable budget (measured by the tensor tracker)."""
    import lightning.pytorch as pl
    import yaml

    from lightning_seqmem.cli.main import _parser
    from lightning_seqmem.cli.plan import _set_up
    from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
    from lightning_seqmem.trainer.callback import SeqMemCallback

    L, margin = 512, 0.1
    config = yaml.safe_load(CPU_DEMO.read_text())
    config["trainer"]["callbacks"][0]["init_args"]["curriculum"] = None
    config["data"]["seq_len"] = L

    def written(budget=None):
        if budget is not None:
            config["trainer"]["callbacks"][0]["init_args"]["memory_budget"] = budget
        path = tmp_path / f"edge_{budget}.yaml"
        path.write_text(yaml.safe_dump(config))
        return ["plan", "--config", str(path), "--lengths", str(L)]

    monkeypatch.chdir(tmp_path)
    # the plan's dry run of the unmitigated step (the one its row reports: checked below)
    peak = _set_up(_parser().parse_args(written())).dry(L, ())["peak_bytes"]
    # usable: 1% over the peak, under the peak with the 2% margin
    budget = int(peak * 1.01 / (1 - margin)) + 1
    usable = int(budget * (1 - margin))
    assert peak < usable < dry_run_bound(peak)
    assert main([*written(budget), "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)["lengths"][0]
    plain = next(r for r in entry["rows"] if r["mitigations"] == [])
    assert (plain["peak_bytes"] == peak and plain["fits"] is False and entry["fastest"] is not None
            and entry["fastest"]["mitigations"] != [])

    model_args = {k: v for k, v in config["model"].items() if k != "lr"}
    cb = SeqMemCallback(memory_budget=budget, safety_margin=margin, warmup_steps=2, curriculum=None)
    trainer = pl.Trainer(accelerator="cpu", max_steps=3, callbacks=[cb], logger=False,
                         enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.warns(UserWarning, match="over the usable budget"):
        trainer.fit(LitGPT(**model_args),
                    SyntheticTokenDataModule(batch_size=4, seq_len=L, num_samples=16))
    records = cb.planner.evidence.measured.records
    assert len(records) == 3 and all(r.seq_len == L for r in records)
    assert [list(r.mitigations) for r in records] == [entry["fastest"]["mitigations"]] * 3
    assert max(r.peak_bytes for r in records) <= usable


def test_the_plans_fastest_setting_is_the_planners_decision_on_the_same_dry_runs():
    """``seqmem plan``'s fastest setting that fits, per budget, is what the callback's planner
    decides before a batch of that shape when its dry run answers with the plan's own dry runs: at
    budgets on either side of each ladder set's bound (where the choice changes), the same rungs."""
    from lightning_seqmem.cli.main import _parser
    from lightning_seqmem.cli.plan import _set_up
    from lightning_seqmem.cli.plan_run import fastest
    from lightning_seqmem.plan.choose import combine
    from lightning_seqmem.plan.planner import SeqMemPlanner

    L, margin = 1024, 0.1
    run = _set_up(_parser().parse_args(["plan", "--config", str(CPU_DEMO), "--lengths", str(L)]))

    def dry_runner(seq_len, batch_size, mitigations):
        row = run.dry(seq_len, tuple(mitigations))
        if row["peak_bytes"] is None:
            raise RuntimeError(row["error"])
        return row["peak_bytes"], {"optimizer": row["optimizer_peak_bytes"] or 0}

    bounds = sorted(dry_run_bound(run.dry(L, s)["peak_bytes"]) for s in run.sets)
    budgets = [int(b / (1 - margin)) + d for b in bounds for d in (-2_000, 2_000)]
    choices = []
    for budget in budgets:
        usable = int(budget * (1 - margin))
        planned, _ = fastest(run, L, run.rows(L, run.sets, usable), usable)
        planner = SeqMemPlanner(memory_budget_bytes=budget, safety_margin=margin, curriculum=None,
                                mitigations=tuple(run.ladder_rungs), dry_runner=dry_runner)
        decision = planner.decide((run.batch_size, L), run.checks)
        decided = list(combine((), decision.rungs)) if decision.action == "mitigate" else []
        if planned is None:  # nothing fits: the planner runs over with every rung it has, or warns
            assert decision.action in ("mitigate", "over"), (budget, decision)
            choices.append(None)
            continue
        assert decided == planned["mitigations"], (budget, decided, planned)
        choices.append(tuple(decided))
    assert len(set(choices)) >= 3, choices  # the budgets cross the choice more than once
