"""Offload planned by dry run: host memory counted beside the device (a second tracker in the same
fake step, on the simulated CUDA device), FSDP2 ``CPUOffloadPolicy`` at world sizes 1, 2 and 8,
activation offload through ``save_on_cpu`` itself, the host budget, the N-rank plan's offload rows,
and a 2-process gloo run of FSDP2 with CPU offload measured against its dry run.

Every expected figure is computed here from the model's parameters or the tensors' shapes: the
device counts 512-byte blocks (the CUDA allocator's), the host pinned blocks rounded up to a power
of two (PyTorch's caching host allocator) and pageable tensors at their own bytes.
"""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from limits import limit_s, shared_fixture
from lightning_seqmem.core.config import SeqMemConfig
from lightning_seqmem.dryrun.host import power_of_two_bytes
from lightning_seqmem.dryrun.sharded import sharded_dry_run_step, unsharded_template
from lightning_seqmem.dryrun.step import dry_run_step
from lightning_seqmem.plan.budgets import fits_budgets, host_budget_bytes, machine_memory_bytes
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule

SCRIPT = Path(__file__).parent / "scripts" / "offload_run.py"
VOCAB = 64


def _blocks_of_512(nbytes: int) -> int:
    return -(-nbytes // 512) * 512


def _batch(rows: int = 2, seq_len: int = 32):
    data = SyntheticTokenDataModule(batch_size=rows, seq_len=seq_len, vocab_size=VOCAB)
    return next(iter(data.train_dataloader()))


# -- (a) the host tracker
# -------------------------------------------------------------------------------
class _Exp(nn.Module):
    """Saves ``exp(x)`` twice for backward (exp's result, mul's input) and a parameter (kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return torch.exp(x) * self.scale


class _Chain(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, width)
        self.blocks = nn.ModuleList(_Exp() for _ in range(depth))

    def training_step(self, batch, batch_idx):
        x = self.emb(batch["input_ids"])
        for block in self.blocks:
            x = block(x)
        return x.sum()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


@pytest.mark.parametrize("width", [384, 512], ids=["not-a-power-of-two", "power-of-two"])
def test_adamw_step_scalars_and_save_on_cpu_copies_are_host_bytes(width):
    rows, seq_len, depth = 2, 16, 6
    model = _Chain(width, depth)
    batch = {"input_ids": torch.zeros(rows, seq_len, dtype=torch.long)}
    plain = dry_run_step(model, None, batch, seq_len, device="cuda")
    offloaded = dry_run_step(model, None, batch, seq_len, mitigations=["activation_offload"],
                             device="cuda")
    scalars = 4 * sum(1 for _ in model.parameters())  # AdamW's float32 `step`s, on the host
    # AdamW's foreach step (CUDA's default) adds one to them all with a float32 CPU tensor of 1.0
    one = 4
    assert plain.host_peak_bytes == scalars + one
    assert plain.host_phase_peak_bytes == {"forward": scalars, "backward": scalars,
                                           "optimizer": scalars + one}
    saved = rows * seq_len * width * 4  # exp(x) of one block, float32
    # save_on_cpu runs: two pinned host copies per block (each save is its own copy), alive through
    # the forward
    assert offloaded.host_bytes == 2 * depth * saved  # the rung's count (once modelled)
    pinned = power_of_two_bytes(saved)
    assert offloaded.host_phase_peak_bytes["forward"] == scalars + 2 * depth * pinned
    assert offloaded.host_phase_peak_bytes["optimizer"] == scalars + one  # copied back in backward
    if power_of_two_bytes(saved) == saved:
        assert offloaded.host_peak_bytes - scalars == offloaded.host_bytes
    # the device lets go of each block's exp(x) but the running block's: its forward peak falls by
    # depth - 1 of them
    drop = plain.phase_peak_bytes["forward"] - offloaded.phase_peak_bytes["forward"]
    assert drop == (depth - 1) * saved
    assert "save_on_cpu run, its host copies counted" in offloaded.detail
    assert "pinned blocks" in offloaded.detail


def test_on_the_cpu_there_is_no_host_apart():
    model = _Chain(64, 2)
    batch = {"input_ids": torch.zeros(2, 16, dtype=torch.long)}
    on_cpu = dry_run_step(model, None, batch, 16, mitigations=["activation_offload"], device="cpu")
    assert on_cpu.host_peak_bytes == 0 and on_cpu.host_phase_peak_bytes == {}
    assert on_cpu.host_bytes > 0
    assert "no host memory apart from the cpu simulated" in on_cpu.detail
    assert "(modelled)" in on_cpu.detail


# -- (b) FSDP2 CPUOffloadPolicy by dry run
# ---------------------------------------------------------------
def _tiny_llama():
    pytest.importorskip("transformers")
    from lightning_seqmem.reference.hf import HFCausalLM

    config = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
              "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": VOCAB}
    return HFCausalLM(config=config, attn_implementation="sdpa")


def _shares(model: nn.Module, world_size: int) -> dict[str, int]:
    """Rank 0's shares under FSDP2 (each parameter cut in ``world_size`` rows, padded to equal
    shards): the device's 512-byte blocks of parameter, gradient and two AdamW states without
    offload; the host's pinned parameter and gradient shards, pageable AdamW states and step scalars
    with it."""
    device = host = 0
    for p in model.parameters():
        rows, size = p.shape[0], p.element_size()
        per_row = p.numel() // rows
        padded = math.ceil(rows / world_size) * per_row * size
        own = min(math.ceil(rows / world_size), rows) * per_row * size  # rank 0: the largest shard
        device += 4 * _blocks_of_512(padded)
        host += power_of_two_bytes(padded) + power_of_two_bytes(own) + 2 * own + 4
    return {"device": device, "host": host}


@pytest.fixture(scope="module", params=["LitGPT", "tiny Llama"])
def template(request):
    torch.manual_seed(0)
    model = LitGPT(n_layer=2, d_model=64, n_head=2, vocab_size=VOCAB, attention="sdpa") \
        if request.param == "LitGPT" else _tiny_llama()
    return model, unsharded_template(model)


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_cpu_offload_moves_parameters_gradients_and_adamw_state_to_the_host(template, world_size):
    """Without offload the device holds parameters, the previous step's gradients and both AdamW
    states during the forward (all fp32 here); with it none of them: the forward's device peak falls
    by exactly their blocks. The gathered blocks and the buffers FSDP2 gathers them through are on
    the device in both settings (with offload each shard is copied to the device first, freed before
    the peak); at the backward's peak the gradients are not yet there in either, so it falls by
    parameters and states."""
    model, template = template
    batch = _batch()
    plain = sharded_dry_run_step(template, batch, 64, world_size, device="cuda")
    offloaded = sharded_dry_run_step(template, batch, 64, world_size, device="cuda", offload=True)
    shares = _shares(model, world_size)
    drop = {p: v - offloaded.phase_peak_bytes[p] for p, v in plain.phase_peak_bytes.items()}
    assert drop["forward"] == shares["device"]
    assert drop["backward"] == shares["device"] * 3 // 4  # parameters, two states
    smallest_block_shard = min(sum(_blocks_of_512(p.numel() * p.element_size() // world_size)
                                   for p in block.parameters()) for block in _blocks(model))
    assert offloaded.phase_peak_bytes["optimizer"] < smallest_block_shard  # it steps on the host
    # the host: pinned parameter shards, the previous step's pinned gradients, AdamW's states and
    # scalars
    host = offloaded.host_phase_peak_bytes
    assert host["forward"] == host["backward"] == shares["host"]
    assert offloaded.host_peak_bytes == host["optimizer"] >= shares["host"]
    scalars = 4 * sum(1 for _ in model.parameters())  # without offload: step scalars
    assert plain.host_phase_peak_bytes["forward"] == scalars
    assert plain.host_peak_bytes - scalars < 512  # (and a scalar AdamW makes in its step)
    assert "CPUOffloadPolicy (offload=True, pinned)" in offloaded.detail
    assert "pinned blocks" in offloaded.detail


def _blocks(model: nn.Module) -> list[nn.Module]:
    from lightning_seqmem.mitigations.checkpointing.checkpointing import find_repeated_blocks

    return [b for b in find_repeated_blocks(model) if b is not model]


def test_a_configure_model_that_shards_gets_the_policy_too():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from fsdp2_cpu import ShardedLitGPT

    module = ShardedLitGPT(n_layer=2, d_model=64, n_head=2, vocab_size=VOCAB, attention="sdpa")
    template = unsharded_template(module)
    own = sharded_dry_run_step(template, _batch(), 64, 2, device="cuda", offload=True)
    lit = LitGPT(n_layer=2, d_model=64, n_head=2, vocab_size=VOCAB, attention="sdpa")
    default = sharded_dry_run_step(unsharded_template(lit), _batch(), 64, 2, device="cuda",
                                   offload=True)
    assert "configure_model() sharded 3 modules" in own.detail and "CPUOffloadPolicy" in own.detail
    assert own.host_peak_bytes == default.host_peak_bytes and own.peak_bytes == default.peak_bytes


def test_offload_arguments_are_checked():
    template = unsharded_template(LitGPT(n_layer=1, d_model=32, n_head=2, vocab_size=VOCAB))
    needs = r"`offload` \(FSDP2 CPUOffloadPolicy\) needs strategy='fsdp2', got 'ddp'"
    with pytest.raises(ValueError, match=needs):
        sharded_dry_run_step(template, _batch(), 64, 2, strategy="ddp", offload=True)
    with pytest.raises(ValueError, match="`offload` must be a bool, got 'yes'"):
        sharded_dry_run_step(template, _batch(), 64, 2, offload="yes")


# -- (5) the host budget
# -----------------------------------------------------------------------------------
def test_host_memory_budget_is_checked_and_defaults_to_the_machines_ram():
    assert SeqMemConfig(host_memory_budget="3GiB").host_memory_budget_bytes == 3 * 2**30
    assert SeqMemConfig().host_memory_budget_bytes is None
    refused = r"^`host_memory_budget` must be a positive number of bytes.*got 'lots'"
    with pytest.raises(ValueError, match=refused):
        SeqMemConfig(host_memory_budget="lots")
    ram = machine_memory_bytes()
    assert ram is not None and ram > 2**28
    assert host_budget_bytes(None) == ram and host_budget_bytes(4096) == 4096
    fit = fits_budgets(100, 300, usable_bytes=200, host_budget_bytes=250)
    assert (fit.fits, fit.device_fits, fit.host_fits) == (False, True, False)
    assert "host peak" in fit.reason


def test_the_n_rank_plan_dry_runs_offload_and_holds_it_against_both_budgets():
    """Where no layout fits the device, the plan runs each again with CPU offload (a dry run, not
    the formula) and takes the first whose device and host peaks both fit."""
    from rich.console import Console

    from lightning_seqmem.cli.plan_parallel import parallel_plans

    model = LitGPT(n_layer=2, d_model=64, n_head=2, vocab_size=VOCAB, attention="sdpa")
    optimizer = model.configure_optimizers()
    template, batch, world = unsharded_template(model), _batch(1, 32), 2
    plain = sharded_dry_run_step(template, batch, 128, world, device="cuda")
    offloaded = sharded_dry_run_step(template, batch, 128, world, device="cuda", offload=True)
    usable = (plain.peak_bytes + offloaded.peak_bytes) // 2  # between the two: only offload fits
    row = {"mitigations": [], "peak_bytes": plain.peak_bytes, "error": None, "seconds": 0.0}
    results = [{"seq_len": 128, "rows": [row]}]

    def plan(host_budget):
        console = Console(file=io.StringIO(), width=200)
        entry, = parallel_plans(console, template, optimizer, batch, 1, [()], usable, None,
                                torch.device("cuda"), world, results, (), None, host_budget)
        return entry

    entry = plan(offloaded.host_peak_bytes)
    off = entry["plan"]
    assert off is not None and off["offload"] and off["peak_source"] == "dry run"
    assert off["peak_bytes"] == offloaded.peak_bytes
    assert off["host_bytes"] == offloaded.host_peak_bytes
    assert off["fit"].startswith("fits:")
    assert entry["host_budget_bytes"] == offloaded.host_peak_bytes
    tight = plan(offloaded.host_peak_bytes - 1)
    assert tight["plan"] is None and "over the host budget" in tight["rows"][-1]["fit"]


def test_zero3_offload_is_planned_as_fsdp2_cpu_offload_and_says_so():
    from lightning_seqmem.cli.emit import emit
    from lightning_seqmem.plan.parallel import ZERO3_OFFLOAD_NOTE, Layout

    plan = {**Layout("none", 1, 8, offload=True).to_json(), "mitigations": [], "seq_len": 4096,
            "batch_size": 1}
    text = emit("deepspeed", plan)
    config = json.loads(text[text.index("{"):text.rindex("}") + 1])
    assert config["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert ("planned as FSDP2 CPUOffloadPolicy: same placement of parameters, gradients, optimizer "
            "state") in text
    assert "fp32 master weights" in ZERO3_OFFLOAD_NOTE


# -- (c) a real FSDP2 CPU-offload run
# ------------------------------------------------------------------------
@shared_fixture
def gloo_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("offload")
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out)], capture_output=True, text=True,
                          timeout=limit_s(120))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.ddp
@pytest.mark.slow
def test_a_gloo_fsdp2_cpu_offload_run_measures_what_its_dry_run_says(gloo_ranks):
    """2 CPU processes, ``ModelParallelStrategy`` and ``fully_shard(...,
    offload_policy=CPUOffloadPolicy())``, the tracker on every step; rank 0's dry run of the same
    setting on ``device="cpu"``. On the CPU the device and the host are one memory (the dry run has
    no host apart: ``host_peak_bytes`` 0), so the totals compare: within 1%, per phase. Offload
    moves nothing there: the dry run equals the one without.

    One deviation is known and allowed, exactly: a phase (forward or backward) measured one block's
    parameters higher. That is FSDP2's flat all-gather output of a block, which gloo's worker
    thread keeps alive (in its work object) until it is scheduled again after ``wait()`` returned:
    in about a quarter of the runs under pytest on 2 cores, never the same way twice. The dry run
    counts program order; any other difference fails."""
    rank0 = gloo_ranks[0]
    block = rank0["block_bytes"]  # 199,936 B: 49,984 float32
    dry, plain = rank0["dry_offload"], rank0["dry_plain"]
    assert dry["host"] == 0 and "CPUOffloadPolicy (offload=True) on the CPU itself" in dry["detail"]
    assert "CPUOffloadPolicy (configure_model()) on the CPU itself" in plain["detail"]
    assert (dry["peak"], dry["phases"]) == (plain["peak"], plain["phases"])
    measured = [r for r in rank0["records"] if not r["warmup"]]
    assert len(measured) >= 2

    def matches(measured_bytes, dry_bytes, late_ok):
        return any(abs(measured_bytes - dry_bytes - late) <= 0.01 * measured_bytes
                   for late in ((0, block) if late_ok else (0,)))

    for record in measured:
        assert matches(record["peak"], dry["peak"], True), (record, dry)
        for phase, peak in dry["phases"].items():
            late_ok = phase != "optimizer"  # no collective in the optimizer step
            assert matches(record["phases"][phase], peak, late_ok), (phase, record, dry)
