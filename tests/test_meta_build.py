"""A model built without allocating it (the ``meta`` device, or Lightning's ``configure_model()``)
dry-runs to the byte as the same model built for real, and both equal a measured step.

Every expected figure is a real step measured by the live-tensor tracker (one warm-up step first) on
a real-built copy, or the dry run of that copy; nothing is hard-coded.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import lightning.pytorch as pl
import pytest
import torch

from lightning_seqmem.dryrun.step import dry_run_step
from lightning_seqmem.measure.probes import make_probe
from lightning_seqmem.measure.steps import training_step_memory
from lightning_seqmem.reference.demo import LitGPT
from lightning_seqmem.reference.hf import HFCausalLM
from lightning_seqmem.reference.nn import GPT, GPTConfig

CPU = torch.device("cpu")
LLAMA = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2}


def _batch(rows: int = 2, length: int = 16) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, 256, (rows, length), generator=g),
            "labels": torch.randint(0, 256, (rows, length), generator=g)}


def _loss(model, batch):
    return model.training_step(batch, 0)


def _measured(module, batch):
    real = copy.deepcopy(module)
    optimizer = real.configure_optimizers()
    training_step_memory(real, optimizer, batch, _loss)
    return training_step_memory(real, optimizer, batch, _loss, make_probe("tracker", CPU))


def _builders():
    return {
        "LitGPT eager": lambda: LitGPT(n_layer=2, d_model=64, n_head=4),
        "LitGPT sdpa": lambda: LitGPT(n_layer=2, d_model=64, n_head=4, attention="sdpa"),
        "HFCausalLM eager": lambda: HFCausalLM(config=LLAMA, attn_implementation="eager"),
        "HFCausalLM sdpa": lambda: HFCausalLM(config=LLAMA, attn_implementation="sdpa"),
    }


@pytest.mark.parametrize("name", list(_builders()))
@pytest.mark.parametrize("mitigations", [(), ("checkpointing",), ("microbatch",)],
                         ids=["none", "ckpt", "micro"])
def test_meta_built_equals_real_built_to_the_byte_and_the_measured_step(name, mitigations):
    build = _builders()[name]
    torch.manual_seed(0)
    real = build()
    with torch.device("meta"):
        meta = build()
    assert all(p.device.type == "meta" for p in meta.parameters())
    small, long = _batch(), 8 * 16
    a = dry_run_step(real, None, small, long, mitigations=mitigations)
    b = dry_run_step(meta, None, small, long, mitigations=mitigations)
    assert ((a.peak_bytes, a.phase_peak_bytes)
            == (b.peak_bytes, b.phase_peak_bytes)), (a.detail, b.detail)
    assert "on cpu" in b.detail
    if not mitigations:  # the dry run of each rung against measured steps: tests/test_dryrun.py
        measured = _measured(real, _batch(2, long))
        assert abs(a.peak_bytes - measured.peak_bytes) <= 0.01 * measured.peak_bytes, (a, measured)


class _OwnMetaLM(pl.LightningModule):
    """A user's module that builds its model on the meta device in ``__init__`` (for a large
    model)."""

    def __init__(self, meta: bool = True) -> None:
        super().__init__()
        with torch.device("meta") if meta else torch.device("cpu"):
            self.gpt = GPT(GPTConfig(n_layer=2, d_model=64, n_head=4, d_ff=256, vocab_size=256))

    def training_step(self, batch, batch_idx):
        return self.gpt.loss(batch["input_ids"], batch["labels"])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_a_module_built_on_meta_dry_runs_every_setting_in_any_order():
    """It was refused ("cannot simulate cpu for a module on meta") for most settings, and ran for
    some only after a fused-loss dry run had run first: now every setting answers, whatever the
    order, equal to the same module built for real."""
    settings = [(), ("attention",), ("checkpointing",), ("microbatch",),
                ("attention", "checkpointing"), ("fused_loss",), ("tiled_mlp",)]
    torch.manual_seed(0)
    real = _OwnMetaLM(meta=False)
    forward = {s: dry_run_step(_OwnMetaLM(), None, _batch(), 256, mitigations=s).peak_bytes
               for s in settings}
    backward = {s: dry_run_step(_OwnMetaLM(), None, _batch(), 256, mitigations=s).peak_bytes
                for s in reversed(settings)}
    expected = {s: dry_run_step(real, None, _batch(), 256, mitigations=s).peak_bytes
                for s in settings}
    assert forward == backward == expected
    assert len(set(expected.values())) > 3  # the settings do differ


class _ConfiguredLM(pl.LightningModule):
    """Lightning's pattern for large models: the layers are built in ``configure_model()``."""

    def __init__(self, n_layer: int = 2) -> None:
        super().__init__()
        self.n_layer = n_layer
        self.gpt = None

    def configure_model(self) -> None:
        if self.gpt is None:
            self.gpt = GPT(GPTConfig(n_layer=self.n_layer, d_model=64, n_head=4, d_ff=256,
                                     vocab_size=256))

    def training_step(self, batch, batch_idx):
        return self.gpt.loss(batch["input_ids"], batch["labels"])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _write_config(tmp_path, model_class: str, precision: str = "32-true",
                  accelerator: str = "cpu") -> str:
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(f"""
        trainer:
          accelerator: {accelerator}
          precision: {precision}
        model:
          class_path: {model_class}
        data:
          class_path: lightning_seqmem.reference.demo.SyntheticTokenDataModule
          init_args: {{batch_size: 2, seq_len: 16, num_samples: 4}}
    """))
    return str(path)


def test_configure_model_is_built_on_meta_and_planned_like_the_real_one(tmp_path):
    """``build_from_config(meta=True)`` (what ``seqmem plan`` builds) calls ``configure_model()`` on
    the meta device: the optimizer has parameters (it was "an empty parameter list"), nothing is
    allocated, and the dry run equals that of the module configured for real."""
    from lightning_seqmem.cli.common import build_from_config, first_optimizer

    cli = build_from_config(_write_config(tmp_path, "test_meta_build._ConfiguredLM"), meta=True)
    model = cli.model
    assert model.gpt is not None and {p.device.type for p in model.parameters()} == {"meta"}
    optimizer, name = first_optimizer(model)
    assert (name == "AdamW" and sum(len(g["params"]) for g in optimizer.param_groups)
            == len(list(model.parameters())))
    torch.manual_seed(0)
    real = _ConfiguredLM()
    real.configure_model()
    planned = dry_run_step(model, optimizer, _batch(), 256)
    expected = dry_run_step(real, None, _batch(), 256)
    assert ((planned.peak_bytes, planned.phase_peak_bytes)
            == (expected.peak_bytes, expected.phase_peak_bytes))


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_the_run_dtype_is_planned_on_meta_as_fit_converts_it(tmp_path, precision):
    """bf16-true: bf16 parameters (the precision plugin's conversion, free on meta); bf16-mixed:
    fp32 master weights under bf16 autocast. Either way the meta-built plan equals the real-built
    one."""
    from lightning_seqmem.cli.common import build_from_config

    cli = build_from_config(_write_config(tmp_path, "lightning_seqmem.reference.demo.LitGPT",
                                          precision), meta=True)
    plugin = cli.trainer.precision_plugin
    meta = plugin.convert_module(cli.model)
    want = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert {(p.device.type, p.dtype) for p in meta.parameters()} == {("meta", want)}
    torch.manual_seed(0)
    real = plugin.convert_module(LitGPT())
    context = plugin.train_step_context
    a = dry_run_step(meta, None, _batch(), 512, autocast=context)
    b = dry_run_step(real, None, _batch(), 512, autocast=context)
    assert (a.peak_bytes, a.phase_peak_bytes) == (b.peak_bytes, b.phase_peak_bytes)


def test_an_8b_wide_model_plans_in_a_few_hundred_megabytes(tmp_path):
    """``seqmem plan`` on a Llama of Llama-3.1-8B's width (vocab 128256, hidden 4096, MLP 14336, GQA
    32/8 heads; 2 of its 32 layers: 1.9 B parameters, 7.7 GB in fp32 if built) for CUDA, on this CPU
    machine under an 8 GB address-space limit: it exits 0 with dry runs on the simulated CUDA
    device, and the planning process's peak resident memory stays under 1.5 GiB."""
    config = tmp_path / "llama8b.yaml"
    config.write_text(textwrap.dedent("""
        trainer: {accelerator: cuda, precision: bf16-mixed}
        model:
          class_path: lightning_seqmem.reference.hf.HFCausalLM
          init_args:
            config: {vocab_size: 128256, hidden_size: 4096, intermediate_size: 14336,
                     num_hidden_layers: 2, num_attention_heads: 32, num_key_value_heads: 8,
                     max_position_embeddings: 131072}
            attn_implementation: sdpa
        data:
          class_path: lightning_seqmem.reference.demo.SyntheticTokenDataModule
          init_args: {batch_size: 1, seq_len: 64, num_samples: 2, vocab_size: 128256}
    """))
    child = ("import resource, runpy, sys\n"
             f"sys.argv = ['seqmem', 'plan', '--config', {str(config)!r}, '--lengths', '8192', "
             "'--budget', 'h100', '--json']\n"
             "try:\n    runpy.run_module('lightning_seqmem.cli.main', run_name='__main__')\n"
             "finally:\n    print('maxrss_kib', "
             "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n")
    proc = subprocess.run(
        ["bash", "-c", f"ulimit -v 8000000 && exec {sys.executable} -c \"$0\"", child],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["device"] == "seqmem:0" and doc["simulates"] == "cuda"
    assert all(r["peak_bytes"] for r in doc["lengths"][0]["rows"]), doc["lengths"][0]["rows"]
    # offload rows, host beside
    assert any(r["offload"] and r["host_peak_bytes"] for r in doc["lengths"][0]["rows"])
    assert ("CPUOffloadPolicy" in doc["offload_assumed"]
            and "DeepSpeedStrategy(stage=3" in doc["offload_assumed"])
    rss_kib = int(proc.stderr.rsplit("maxrss_kib", 1)[1].split()[0])
    assert rss_kib * 1024 < 1.5 * 2**30, rss_kib
