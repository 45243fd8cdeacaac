"""Sequence/context parallelism in the N-rank plan (issue 19): constraint skips, the ``--json``
keys, ``--emit`` configs, and a 2-process gloo Ulysses step measured against the plan's per-rank
figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from limits import limit_s, shared_fixture

from lightning_seqmem.cli.emit import emit
from lightning_seqmem.cli.main import main
from lightning_seqmem.core.units import format_bytes
from lightning_seqmem.plan.parallel import Layout, layouts, skip_reason

SCRIPT = Path(__file__).parent / "scripts" / "sp_run.py"
WORLD = 4
LENGTHS = [512, 508]  # 508: not divisible by 2*4 (load-balanced ring at degree 4)
MODEL = dict(n_layer=2, d_model=64, n_head=2, attention="sdpa")  # 2 heads: Ulysses 4 impossible


def _config(tmp_path: Path, budget: int) -> Path:
    path = tmp_path / "sp.yaml"
    model = "\n".join(f"  {k}: {v}" for k, v in MODEL.items())
    path.write_text(f"""seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  logger: false
  enable_checkpointing: false
  callbacks:
    - class_path: lightning_seqmem.SeqMemCallback
      init_args:
        memory_budget: {budget}
        safety_margin: 0.0
        mitigations: [checkpointing]
model:
{model}
data:
  batch_size: 1
  seq_len: 64
  num_samples: 4
""")
    return path


@shared_fixture
def peaks():
    """Per-rank dry-run peaks of the tiny model at 512 tokens on 4 ranks: whole sequence, Ulysses 2,
    ring 2."""
    from lightning_seqmem.dryrun.sequence_parallel import sequence_parallel_dry_run_step
    from lightning_seqmem.dryrun.sharded import unsharded_template
    from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule

    template = unsharded_template(LitGPT(**MODEL))
    batch = next(iter(SyntheticTokenDataModule(batch_size=1, seq_len=64,
                                               num_samples=4).train_dataloader()))
    return {(kind, d): sequence_parallel_dry_run_step(template, batch, 512, WORLD, d,
                                                      kind).peak_bytes
            for kind, d in (("none", 1), ("ulysses", 2), ("ring", 2))}


def _plan(tmp_path, capsys, budget, *more):
    config = _config(tmp_path, budget)
    rc = main(["plan", "--config", str(config), "--lengths", *map(str, LENGTHS), "--world-size",
               str(WORLD), "--json", *more])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    return json.loads(out)


def test_constraint_violations_are_never_planned_and_say_why():
    ok, skipped = layouts(8, 4100, n_heads=12, n_kv_heads=4, masked=True)
    assert [(layout.kind, layout.degree) for layout in ok] == [
        ("none", 1), ("ulysses", 2), ("ulysses", 4)]
    reasons = {(k, d): why for k, d, why in skipped}
    assert reasons[("ulysses", 8)] == "heads 12 not divisible by degree 8"
    assert reasons[("ring", 2)].startswith("ring attention takes is_causal or no mask")
    assert reasons[("ring", 4)] == "length 4100 not divisible by 2*degree = 8 (load-balanced ring)"
    assert skip_reason("ulysses", 4, 4096, 8, 2, False) == "KV heads 2 not divisible by degree 4"
    with pytest.raises(ValueError, match="`kind` must be one of"):
        skip_reason("tensor", 2, 64, 2, 2, False)


def test_json_names_each_plans_degrees_and_skips(tmp_path, capsys, peaks):
    # a budget between the whole sequence and its Ulysses/ring halves (peaks are computed, not
    # constants)
    assert max(peaks[("ulysses", 2)], peaks[("ring", 2)]) < peaks[("none", 1)]
    budget = (max(peaks[("ulysses", 2)], peaks[("ring", 2)]) + peaks[("none", 1)]) // 2
    large = 2 * peaks[("none", 1)]  # a second device: each gets its own layout search
    doc = _plan(tmp_path, capsys, budget, "--budget", f"{budget}B", f"{large}B")
    by_len = {p["seq_len"]: p for p in doc["parallel_plans"]}
    assert doc["parallel_plans"] == doc["devices"][0]["parallel_plans"]
    plan = next(p["plan"] for p in doc["devices"][1]["parallel_plans"] if p["seq_len"] == 512)
    assert (plan["layout"], plan["peak_bytes"]) == (f"dp_shard {WORLD}", peaks[("none", 1)])
    assert sorted(by_len) == sorted(LENGTHS)
    plan = by_len[512]["plan"]
    for key in ("sequence_parallel_degree", "context_parallel_degree", "fsdp_degree", "offload"):
        assert key in plan
    # the whole sequence does not fit: the first layout that does is Ulysses at degree 2, no rung
    assert (plan["sequence_parallel_degree"], plan["context_parallel_degree"],
            plan["fsdp_degree"]) == (2, 1, 2)
    assert (plan["offload"] is False and plan["mitigations"] == []
            and plan["peak_source"] == "dry run")
    assert plan["peak_bytes"] == peaks[("ulysses",
                                        2)] <= budget < by_len[512]["rows"][0]["peak_bytes"]
    assert plan["tokens_per_rank"] == 256 and by_len[512]["state_over_budget"] is False
    # offload is modelled from each rank's share of the state: AdamW's 2 states counted from a real
    # step
    from lightning_seqmem.dryrun.sequence_parallel import state_bytes
    from lightning_seqmem.reference.demo import LitGPT

    assert by_len[512]["optimizer_states_per_parameter"] == 2
    assert by_len[512]["state_bytes_per_rank"] == state_bytes(LitGPT(**MODEL), WORLD, 2)
    skips = {(s["kind"], s["degree"]): s["reason"] for s in by_len[508]["skipped_degrees"]}
    assert skips[("ulysses", 4)] == "heads 2 not divisible by degree 4"
    assert skips[("ring", 4)] == "length 508 not divisible by 2*degree = 8 (load-balanced ring)"
    assert all((r["sequence_parallel_degree"], r["context_parallel_degree"]) not in ((4, 1), (1, 4))
               for p in doc["parallel_plans"] for r in p["rows"] if p["seq_len"] == 508)


def test_emit_prints_each_engines_own_keys(tmp_path, capsys, peaks):
    budget = (max(peaks[("ulysses", 2)], peaks[("ring", 2)]) + peaks[("none", 1)]) // 2
    doc = _plan(tmp_path, capsys, budget, "--emit", "torchtitan")
    plan = next(p["plan"] for p in doc["parallel_plans"] if p["seq_len"] == 512)
    # torchtitan runs ring only
    assert plan["sequence_parallel"] == "ring" and plan["context_parallel_degree"] == 2
    assert plan["peak_bytes"] == peaks[("ring", 2)]
    assert ("[parallelism]" in plan["launch_config"]
            and "context_parallel_degree = 2" in plan["launch_config"])
    assert "data_parallel_shard_degree = 2" in plan["launch_config"]
    ulysses = {**Layout("ulysses", 2, 8).to_json(), "mitigations": ["checkpointing"],
               "seq_len": 4096, "batch_size": 1}
    text = emit("deepspeed", ulysses)
    config = json.loads(text[text.index("{"):text.rindex("}") + 1])
    assert config["sequence_parallel_size"] == 2 and config["zero_optimization"]["stage"] == 3
    assert "Trainer(strategy=DeepSpeedStrategy(stage=3), devices=8)" in text
    offloaded = {**Layout("ulysses", 2, 8, offload=True).to_json(), "mitigations": [],
                 "seq_len": 4096, "batch_size": 1}
    assert "DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True)" in emit(
        "deepspeed", offloaded)
    ring = {**Layout("ring", 4, 8, offload=True).to_json(), "mitigations": [], "seq_len": 4096,
            "batch_size": 1}
    assert "ParallelismConfig(dp_shard_size=2, cp_size=4)" in emit("accelerate", ring)
    assert "cpu_offload=True" in emit("accelerate", ring)
    whole = {**Layout("none", 1, 8).to_json(), "mitigations": [], "seq_len": 4096, "batch_size": 1}
    assert "ModelParallelStrategy(data_parallel_size=8, tensor_parallel_size=1)" in emit(
        "lightning", whole)
    with pytest.raises(ValueError, match="deepspeed does not run ring"):
        emit("deepspeed", ring)


def test_the_microbatch_rung_is_emitted_as_accumulation_over_batches_of_one_sample():
    """The rung the plan dry-ran splits each rank's 4 rows into 4 micro-batches of 1: each engine
    gets 4 accumulated steps of 1 sample per rank (the same 4 samples per optimizer step), not its
    full batch twice over."""
    import re

    def deepspeed_batch(text):
        config = json.loads(text[text.index("{"):text.rindex("}") + 1])
        return config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]

    plan = {**Layout("ulysses", 2, 8).to_json(), "mitigations": ["checkpointing", "microbatch"],
            "seq_len": 4096, "batch_size": 4}
    text = emit("deepspeed", plan)
    assert deepspeed_batch(text) == (1, 4)
    assert "accumulate_grad_batches=4) over a DataLoader of batch 1" in text
    ring = {**plan, **Layout("ring", 2, 8).to_json()}
    text = emit("accelerate", ring)
    assert "gradient_accumulation_steps=4)" in text and "per-rank batch 1 of 4096 tokens" in text
    text = emit("torchtitan", ring)  # global = local x dp_shard (4) x accumulation steps (4)
    assert re.search(r"^local_batch_size = 1$", text, re.M)
    assert re.search(r"^global_batch_size = 16  #", text, re.M)
    whole = {**plan, "mitigations": ["checkpointing"]}  # no micro-batches: the batch as planned
    assert deepspeed_batch(emit("deepspeed", whole)) == (4, 1)
    assert re.search(r"^local_batch_size = 4$",
                     emit("torchtitan", {**ring, "mitigations": ["checkpointing"]}), re.M)


def test_the_lightning_launch_config_names_the_device_the_plan_dry_ran(tmp_path, capsys, peaks):
    """A plan dry-run on the CPU (this config's accelerator) emits a CPU Trainer: FSDP2 under
    ModelParallelStrategy runs there over gloo, and its peaks are the CPU's, not a GPU's."""
    budget = (max(peaks[("ulysses", 2)], peaks[("ring", 2)]) + peaks[("none", 1)]) // 2
    doc = _plan(tmp_path, capsys, budget, "--emit", "lightning")
    assert doc["simulates"] == "cpu"
    plan = next(p["plan"] for p in doc["parallel_plans"] if p["seq_len"] == 512)
    assert plan["sequence_parallel"] == "none"  # Lightning's strategy shards no sequence
    text = plan["launch_config"]
    assert f"Trainer(accelerator='cpu', devices={WORLD}, strategy=strategy)" in text
    # the peak in the header as the table gives it (a few MiB here, not "0.00 GiB")
    assert f"per-rank peak {format_bytes(plan['peak_bytes'])} (dry run)" in text.splitlines()[0]
    whole = {**Layout("none", 1, 8).to_json(), "mitigations": [], "seq_len": 4096, "batch_size": 1}
    assert "Trainer(accelerator='cuda', devices=8, " in emit("lightning", whole, "cuda")


def test_the_layout_plan_is_never_dearer_than_the_fastest_setting_that_fits(tmp_path, capsys):
    """``configs/fsdp2_cpu.yaml`` at 1024 tokens on 2 ranks, 30 MiB: the ladder's cheapest prefix
    that fits is attention + checkpointing + microbatch (+43% by the priors), while attention +
    microbatch (+10%, beyond the prefixes) fits too and is what the callback would take. The layout
    plan, and the launch config it emits, name the cheaper one, with that setting's dry-run peak."""
    from lightning_seqmem.plan.pricing import prior_factor

    config = Path(__file__).resolve().parents[1] / "configs" / "fsdp2_cpu.yaml"
    assert main(["plan", "--config", str(config), "--lengths", "1024", "--world-size", "2",
                 "--budget", "30MiB", "--emit", "lightning", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    entry, layout = doc["lengths"][0], doc["parallel_plans"][0]["plan"]
    fastest = entry["fastest"]
    # the case this is about: the fastest setting is cheaper than the ladder's plan
    assert prior_factor(fastest["mitigations"], "cpu") < prior_factor(entry["plan"], "cpu")
    assert (layout["layout"], layout["mitigations"]) == ("dp_shard 2", fastest["mitigations"])
    assert layout["peak_bytes"] == fastest["peak_bytes"] and layout["fits"] is True
    assert ("switches the planned rungs on: " + ", ".join(fastest["mitigations"])
            in layout["launch_config"])


def test_a_fastest_setting_with_a_partial_rung_is_not_a_layout_candidate():
    """``checkpointing:selective`` or ``checkpointing:3/8`` cannot be launched by an engine's
    all-or-nothing switch (its config would run without checkpointing, over the planned peak), nor
    a rung the searched sets leave out: the layout search keeps to those sets there; a fastest
    setting of their whole rungs joins them."""
    from lightning_seqmem.cli.plan_parallel import _by_cost

    ladder = [(), ("attention",), ("attention", "checkpointing"),
              ("attention", "checkpointing", "microbatch")]
    # fused_loss: a rung left out of the sets (an engine without its switch, --emit torchtitan)
    for partial in (["attention", "checkpointing:selective"], ["checkpointing:3/8"],
                    ["attention", "fused_loss"]):
        assert _by_cost({"fastest": {"mitigations": partial}}, ladder, "cpu") == ladder
    whole = _by_cost({"fastest": {"mitigations": ["attention", "microbatch"]}}, ladder, "cpu")
    assert whole == [*ladder[:2], ("attention", "microbatch"), *ladder[2:]]
    assert _by_cost({"fastest": None}, ladder, "cpu") == ladder


def test_a_set_whose_largest_degree_does_not_fit_runs_no_other_degree():
    """Per-rank peaks fall as the degree rises (each rank's share of the tokens does): where a set
    fits neither at degree 1 nor at the largest degree, its middle degrees are not dry-run; the plan
    is the one the exhaustive search finds (the first that fits, degree ascending)."""
    from lightning_seqmem.cli.plan_parallel import _first_fit

    ok = layouts(8, 4096, 8, 8, False, ("ulysses",))[0]  # degree 1, Ulysses 2, 4, 8
    peaks = {(): [16, 8, 4, 2], ("checkpointing",): [4, 2, 1, 0.5]}  # budget 1.5
    asked = []

    def row_of(names, layout):
        asked.append((names, layout.degree))
        return {"fits": peaks[names][ok.index(layout)] <= 1.5, "degree": layout.degree}

    rows = []
    plan = _first_fit(rows, list(peaks), ok, row_of)
    ck = ("checkpointing",)
    assert asked == [((), 1), ((), 8), (ck, 1), (ck, 8), (ck, 2), (ck, 4)]
    assert [r["degree"] for r in rows] == [1, 8, 1, 2, 4] and plan is rows[-1]
    exhaustive = next((n, x.degree) for n in peaks for x in ok if peaks[n][ok.index(x)] <= 1.5)
    assert exhaustive == (ck, plan["degree"])


def test_the_middle_degrees_skipped_would_not_have_fit(tmp_path, capsys, peaks):
    """A real plan whose budget holds the optimizer step's state but neither degree 1 nor ring 4
    with either set: per set only those two rows run (ring 2 is skipped), and ring 2's own dry run
    shows it would not have fit either."""
    from lightning_seqmem.dryrun.sequence_parallel import sequence_parallel_dry_run_step
    from lightning_seqmem.dryrun.sharded import unsharded_template
    from lightning_seqmem.plan.judging import dry_run_bound
    from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule

    template = unsharded_template(LitGPT(**MODEL))
    batch = next(iter(SyntheticTokenDataModule(batch_size=1, seq_len=64,
                                               num_samples=4).train_dataloader()))
    floor = sequence_parallel_dry_run_step(template, batch, 512, WORLD, 1,
                                           "none").phase_peak_bytes["optimizer"]
    ring4 = sequence_parallel_dry_run_step(template, batch, 512, WORLD, 4, "ring",
                                           mitigations=["checkpointing"]).peak_bytes
    budget = (dry_run_bound(floor) + ring4) // 2
    assert dry_run_bound(floor) < budget < ring4 < peaks[("ring", 2)]  # the case this is about
    doc = _plan(tmp_path, capsys, budget, "--sequence-parallel", "ring")
    entry = next(p for p in doc["parallel_plans"] if p["seq_len"] == 512)
    assert entry["state_over_budget"] is False
    ran = [(tuple(r["mitigations"]), r["layout"]) for r in entry["rows"] if not r["offload"]]
    assert ran == [((), f"dp_shard {WORLD}"), ((), "ring 4 x dp_shard 1"),
                   (("checkpointing",), f"dp_shard {WORLD}"),
                   (("checkpointing",), "ring 4 x dp_shard 1")]
    ring2 = sequence_parallel_dry_run_step(template, batch, 512, WORLD, 2, "ring",
                                           mitigations=["checkpointing"]).peak_bytes
    assert min(ring2, peaks[("ring", 2)]) > budget  # ring 2 would not have fit, either set


def test_a_rung_an_engine_cannot_switch_is_never_in_its_launch_config(tmp_path, capsys):
    """torchtitan has no switch for ``fused_loss``: a launch config planned with it would run
    without it, over the planned peak. ``--emit torchtitan`` searches only the sets it can launch
    (and says which rungs it left out); ``emit`` refuses such a plan; Lightning runs every rung."""
    config = _config(tmp_path, 1000)  # nothing fits: every set and layout is searched
    config.write_text(config.read_text().replace("[checkpointing]", "[checkpointing, fused_loss]"))

    def searched(engine):
        assert main(["plan", "--config", str(config), "--lengths", "512", "--world-size",
                     str(WORLD), "--emit", engine, "--json"]) == 0
        entry = json.loads(capsys.readouterr().out)["parallel_plans"][0]
        # the state shards alone are over 1000 B: no degree > 1 is dry-run without offload
        assert entry["state_over_budget"] and {
            r["sequence_parallel_degree"] * r["context_parallel_degree"]
            for r in entry["rows"] if not r["offload"]} == {1}
        return entry["rungs_left_out"], {tuple(r["mitigations"]) for r in entry["rows"]}

    assert searched("lightning") == ([], {(), ("checkpointing",), ("checkpointing", "fused_loss")})
    assert searched("torchtitan") == (["fused_loss"], {(), ("checkpointing",)})
    plan = {**Layout("ring", 2, 8).to_json(), "mitigations": ["checkpointing", "fused_loss"],
            "seq_len": 4096, "batch_size": 1}
    for engine in ("torchtitan", "accelerate", "deepspeed"):
        with pytest.raises(ValueError, match=f"{engine} has no switch for fused_loss"):
            emit(engine, {**plan, **Layout("ulysses", 2, 8).to_json()} if engine == "deepspeed"
                 else plan)
    assert "fused_loss" in emit("lightning", {**plan, **Layout("none", 1, 8).to_json()})
    sdpa = emit("accelerate", {**plan, "mitigations": ["attention"]})
    assert 'attn_implementation="sdpa"' in sdpa


def test_a_flash_attention_model_is_planned_with_ulysses_as_alst_runs_it():
    """A transformers model on flash-attn makes no SDPA call: its attention function is wrapped
    instead (ALST's ``UlyssesSPAttentionHF``): at Ulysses 2 the kernel runs all 1024 tokens on half
    the heads, and the rank's peak falls; ring (PyTorch's, over SDPA) is skipped, saying why. The
    float32 model reads its calls under the plan's bf16 autocast (flash-attn refuses float32)."""
    import torch
    from transformers.modeling_utils import AttentionInterface

    from lightning_seqmem.dryrun.accelerator import simulated_device, step_context
    from lightning_seqmem.dryrun.kernels import modelled_kernels
    from lightning_seqmem.dryrun.sequence_parallel import (
        attention_calls, sequence_parallel_dry_run_step)
    from lightning_seqmem.dryrun.sharded import unsharded_template
    from lightning_seqmem.reference.hf import HFCausalLM

    config = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, vocab_size=512)
    with modelled_kernels():
        template = unsharded_template(HFCausalLM("llama", config,
                                                 attn_implementation="flash_attention_2"))
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    batch, device = {"input_ids": ids, "labels": ids.clone()}, simulated_device()
    bf16 = step_context(type("P", (), {"precision": "bf16-mixed"})(), device)
    calls = attention_calls(template, batch, autocast=bf16, device=device)
    name = template.model.config._attn_implementation
    assert (calls.calls, calls.n_heads, calls.n_kv_heads, calls.attention) == (2, 4, 2, name)
    kernel, shapes = AttentionInterface._global_mapping[name], []

    def spy(module, query, *args, **kwargs):
        shapes.append(tuple(query.shape))
        return kernel(module, query, *args, **kwargs)

    AttentionInterface._global_mapping[name] = spy
    try:
        whole, ulysses = (sequence_parallel_dry_run_step(
            template, batch, 1024, 2, degree, kind, autocast=bf16, device=device).peak_bytes
            for degree, kind in ((1, "none"), (2, "ulysses")))
    finally:
        AttentionInterface._global_mapping[name] = kernel
    assert shapes[0] == (1, 4, 1024, 16) and shapes[-1] == (1, 2, 1024, 16)  # [B, H/d, L, D]
    assert ulysses < 0.7 * whole
    ok, skipped = layouts(2, 1024, calls.n_heads, calls.n_kv_heads, calls.masked,
                          attention=calls.attention)
    assert [(x.kind, x.degree) for x in ok] == [("none", 1), ("ulysses", 2)]
    assert skipped == [("ring", 2, f"ring attention shards SDPA calls; the model's attention is "
                                   f"{name}")]


def test_a_transformers_attention_function_that_calls_sdpa_is_split_once():
    """A registered attention function that calls SDPA itself is split around the function; its
    own SDPA call is neither counted nor split a second time."""
    import torch
    import torch.nn.functional as F
    from transformers import AttentionInterface

    from lightning_seqmem.dryrun.sequence_parallel import (
        attention_calls, sequence_parallel_dry_run_step)
    from lightning_seqmem.dryrun.sharded import unsharded_template
    from lightning_seqmem.reference.hf import HFCausalLM

    def own(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        key, value = (t.repeat_interleave(query.shape[1] // t.shape[1], 1) for t in (key, value))
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("seqmem_test_own", own)
    try:
        config = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, vocab_size=512)
        template = unsharded_template(HFCausalLM("llama", config,
                                                 attn_implementation="seqmem_test_own"))
        ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "labels": ids.clone()}
        calls = attention_calls(template, batch)
        assert (calls.calls, calls.n_heads, calls.attention) == (2, 4, "seqmem_test_own")
        whole, ulysses = (sequence_parallel_dry_run_step(template, batch, 512, 2, d, kind)
                          for d, kind in ((1, "none"), (2, "ulysses")))
        assert ulysses.peak_bytes < whole.peak_bytes
        assert "2 attention calls sharded" in ulysses.detail
    finally:
        AttentionInterface._global_mapping.pop("seqmem_test_own", None)


@pytest.mark.ddp
def test_ulysses_step_over_two_gloo_ranks_is_within_3_percent_of_the_plan(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "512", "2"],
                          capture_output=True, text=True, timeout=limit_s(180))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        # the all-to-all layout: each rank's chunk of full attention
        assert rank["ulysses_max_abs_err"] < 1e-5
        assert rank["attention_calls"] == 2 * 2  # 2 blocks x (warm-up, measured step)
    planned = ranks[0]["dry_run_peak_bytes"]
    for rank in ranks:
        assert abs(planned - rank["measured_peak_bytes"]) / rank["measured_peak_bytes"] <= 0.03, (
            planned, rank)
    assert "ulysses sequence parallel over 2 ranks: 256 of 512 tokens per rank" in ranks[0][
        "dry_run_detail"]
