"""FSDP2 pieces on one process: N-rank plans in a fake process group (``seqmem plan --world-size``),
the fake world leaving a real process group intact, checkpointing composed with ``fully_shard``,
and which rungs each strategy takes. The 2-process runs are in test_fsdp2.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightning_seqmem.trainer import access as edge
from lightning_seqmem.cli.main import main
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.dryrun.result import DryRunUnsupported
from lightning_seqmem.mitigations.checkpointing.checkpointing import (
    ActivationCheckpointing, is_checkpointed)
from lightning_seqmem.core.rungs import MITIGATIONS
from lightning_seqmem.dryrun.sharded import (
    _shard, fake_world, sharded_dry_run_step, unsharded_template)

CONFIG = """
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 1
  logger: false
  callbacks: [{class_path: lightning_seqmem.SeqMemCallback, init_args: {mitigations: []}}]
model: {vocab_size: 8192, n_layer: 1, n_head: 2, d_model: 64, attention: sdpa}
data: {batch_size: 1, seq_len: 64, num_samples: 4, vocab_size: 8192}
"""


@pytest.fixture(scope="module")
def batch():
    return next(iter(SyntheticTokenDataModule(batch_size=2, seq_len=32,
                                              num_samples=4).train_dataloader()))


def test_plan_at_n_ranks_gives_the_smallest_world_size_that_fits(tmp_path, monkeypatch, capsys):
    # parameters, gradients and AdamW state (an 8192-token vocabulary) weigh: sharding decides
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(CONFIG)
    args = ["plan", "--config", "c.yaml", "--lengths", "128", "--budget", "22MB", "--safety-margin",
            "0", "--world-size", "8", "--json"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["world_size"] == 8 and doc["strategy"] == "fsdp2"
    row = doc["lengths"][0]["rows"][0]
    peaks = {int(n): v for n, v in row["peak_bytes_by_world_size"].items()}
    n = row["smallest_world_size"]
    # the smallest: half as many ranks do not fit
    assert n in (2, 4, 8) and peaks[n] <= 22_000_000 < peaks[n // 2]
    assert peaks[8] == row["peak_bytes"] and row["fits"]
    # fewer bytes per rank with more ranks
    assert sorted(peaks) == sorted(peaks, key=lambda k: -peaks[k])

    assert main(["plan", "--config", "c.yaml", "--lengths", "128", "--budget", "22MB",
                 "--world-size", "4", "--strategy", "ddp", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["lengths"][0]["rows"][0]
    assert row["smallest_world_size"] is None  # replicas: more ranks never shrink a rank's share
    assert len(set(row["peak_bytes_by_world_size"].values())) == 1


def test_fake_world_leaves_a_real_process_group_working(tmp_path, batch):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        before = sharded_dry_run_step(unsharded_template(LitGPT(n_layer=1, d_model=32, n_head=2)),
                                      batch, 64, world_size=4)
        assert "rank 0 of 4 (fsdp2)" in before.detail
        assert dist.get_world_size() == 1
        t = torch.ones(3)
        dist.all_reduce(t)  # the real group still resolves and communicates
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


def test_checkpointing_composes_with_fully_shard_and_keeps_every_name():
    from torch.distributed.fsdp import fully_shard

    lit = LitGPT(n_layer=2, d_model=32, n_head=2)
    with fake_world(2) as mesh:
        for block in lit.model.blocks:
            fully_shard(block, mesh=mesh["data_parallel"])
        fully_shard(lit, mesh=mesh["data_parallel"])
        names, keys = [n for n, _ in lit.named_parameters()], list(lit.state_dict())
        result = ActivationCheckpointing().apply(lit)
        assert result.applied and "composable" in result.detail and is_checkpointed(lit)
        assert [n for n, _ in lit.named_parameters()] == names and list(lit.state_dict()) == keys
        with pytest.raises(DryRunUnsupported, match="already sharded"):
            unsharded_template(lit)


def test_rungs_by_strategy():
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    module = LitGPT(n_layer=1, d_model=32, n_head=2)
    trainer = SimpleNamespace(
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))
    assert edge.unsupported_rungs(trainer, module, MITIGATIONS) == ([], "")
    dropped, why = edge.unsupported_rungs(SimpleNamespace(strategy=FSDPStrategy()), module,
                                          MITIGATIONS)
    assert (dropped == ["checkpointing", "microbatch"]
            and "ModelParallelStrategy with fully_shard" in why)


def test_bad_strategy_names_the_argument(batch):
    with pytest.raises(ValueError,
                       match=r"`strategy` must be one of \('fsdp2', 'ddp'\), got 'zero3'"):
        sharded_dry_run_step(LitGPT(n_layer=1, d_model=32, n_head=2), batch, 64, 2,
                             strategy="zero3")
    with pytest.raises(ValueError, match=r"`held` must be None or \(gradients alive, optimizer "
                       r"state made\), two bools .*got \(True,\)"):
        sharded_dry_run_step(LitGPT(n_layer=1, d_model=32, n_head=2), batch, 64, 2, held=(True,))


@pytest.mark.parametrize("mitigations", [(), ("checkpointing",)], ids=["plain", "checkpointing"])
def test_dry_run_equals_the_same_sharded_step_on_real_tensors(mitigations):
    """The same sharded module, world size 2 (fake process group): real tensors measured by the
    tracker after two warm-up steps vs the dry run. FSDP2 frees and regrows gathered parameters by
    resizing storages; a fake storage is on "meta", so its regrowth was once missed (here -10% with
    checkpointing; -3% without it at d_model 128, batch 4, 256 tokens)."""
    from lightning_seqmem.measure.steps import training_step_memory
    from lightning_seqmem.measure.probes import make_probe

    torch.manual_seed(0)
    batch = next(iter(SyntheticTokenDataModule(batch_size=2, seq_len=128,
                                               num_samples=2).train_dataloader()))
    dry = sharded_dry_run_step(LitGPT(n_layer=2, d_model=64, n_head=2), batch, 128, 2,
                               mitigations=mitigations)
    with fake_world(2) as mesh:
        lit = LitGPT(n_layer=2, d_model=64, n_head=2)
        lit.__dict__["_device_mesh"] = mesh
        _shard(lit, mesh, [])
        if mitigations:
            ActivationCheckpointing().apply(lit)
        optimizer = lit.configure_optimizers()
        for i in range(3):
            probe = make_probe("tracker", torch.device("cpu")) if i == 2 else None
            real = training_step_memory(lit, optimizer, batch,
                                        lambda m, b: m.training_step(b, 0), probe)
    assert dry.peak_bytes == real.peak_bytes and dry.phase_peak_bytes == real.phase_peak_bytes


def test_a_wrapped_hugging_face_model_is_sharded_where_the_training_step_calls_it():
    """``HFCausalLM.training_step`` calls ``self.model``, never the LightningModule's ``forward``:
    the default layout shards the wrapped ``LlamaForCausalLM`` last (its hooks gather the embeddings
    and the output layer), so the dry run runs (it failed on the embedding: "mixed torch.Tensor and
    DTensor"), and it equals the same sharded step on real tensors measured by the tracker, to the
    byte."""
    from lightning_seqmem.dryrun.sharded import sharding_root
    from lightning_seqmem.measure.probes import make_probe
    from lightning_seqmem.measure.steps import training_step_memory
    from lightning_seqmem.reference.hf import HFCausalLM

    config = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 2, "num_key_value_heads": 2}
    torch.manual_seed(0)
    batch = next(iter(SyntheticTokenDataModule(batch_size=2, seq_len=64,
                                               num_samples=2).train_dataloader()))
    module = HFCausalLM(config=config, attn_implementation="sdpa")
    assert type(sharding_root(module)).__name__ == "LlamaForCausalLM"
    dry = sharded_dry_run_step(unsharded_template(module), batch, 64, 2)
    assert ("blocks and the root (LlamaForCausalLM, holding every "
            "parameter)") in dry.detail, dry.detail
    with fake_world(2) as mesh:
        lit = HFCausalLM(config=config, attn_implementation="sdpa")
        lit.__dict__["_device_mesh"] = mesh
        _shard(lit, mesh, [])
        optimizer = lit.configure_optimizers()
        for i in range(3):
            probe = make_probe("tracker", torch.device("cpu")) if i == 2 else None
            real = training_step_memory(lit, optimizer, batch,
                                        lambda m, b: m.training_step(b, 0), probe)
    assert dry.peak_bytes == real.peak_bytes and dry.phase_peak_bytes == real.phase_peak_bytes


def test_a_sharded_dry_run_says_micro_batching_only_where_it_micro_batches(batch):
    """The callback's sharded dry run passes whether micro-batching's one-time check is included
    (a bool, always): the detail named micro-batching (``None per micro-batch``) with none on."""
    module = LitGPT(n_layer=1, d_model=32, n_head=2)
    plain = sharded_dry_run_step(module, batch, 64, 2, first_split_check=False)
    micro = sharded_dry_run_step(module, batch, 64, 2, mitigations=("microbatch",),
                                 first_split_check=True)
    assert "micro-batch" not in plain.detail and "None" not in plain.detail
    assert "2 micro-batches of 1" in micro.detail
