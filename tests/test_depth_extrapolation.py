"""Depth extrapolation (lightning_seqmem.dryrun.depth): dry runs of a stack of identical blocks
answered from dry runs of shallow copies give the full dry run's figures to the byte, on models
small enough to dry-run whole; models whose blocks differ, or whose steps do not repeat per block,
get the full dry run and say why."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from lightning_seqmem.diagnostics.peak_trace import trace_peak_site
from lightning_seqmem.dryrun.depth import (
    clear_depth_cache,
    depth_dry_run_step,
    depth_sharded_dry_run_step,
)
from lightning_seqmem.dryrun.result import DryRunUnsupported
from lightning_seqmem.dryrun.sharded import sharded_dry_run_step, unsharded_template
from lightning_seqmem.dryrun.step import dry_run_step
from lightning_seqmem.mitigations.checkpointing.checkpointing import is_checkpointed
from lightning_seqmem.reference.demo import LitGPT
from lightning_seqmem.reference.hf import HFCausalLM

# The full models' depth: deeper than every copy a proof runs (dryrun.repetition): 1, 2, 3 blocks
# (2, 3, 4 under FSDP2); a rung at "k/N" up to 4 (3 + 1, 2 + 2), or 5 under FSDP2 (2 + 3, 3 + 2),
# where the sharded test takes a block more.
BLOCKS = 5
PLAIN_PAST = f"checkpointing:2/{BLOCKS}"  # 3 plain blocks: one more than the copies hold
LEVELED_PAST = f"checkpointing:4/{BLOCKS}"  # 4 checkpointed blocks: one more than the copies
SETTINGS = [(), ("attention",), ("checkpointing",), (PLAIN_PAST,),
            ("checkpointing:selective",), ("microbatch",), ("fused_loss",), ("tiled_mlp",),
            ("activation_offload",)]  # host bytes grow per block: a base and a unit copy a length
FIRST = 128  # each setting's repetition is proved at the first length it is asked
ON_CPU_TOO = [((PLAIN_PAST,), 200), (("microbatch",), 200),  # answered from one copy
              (("attention", LEVELED_PAST, "microbatch"), 128)]
TINY_LLAMA = dict(num_hidden_layers=BLOCKS, hidden_size=32, intermediate_size=64,
                  num_attention_heads=2, num_key_value_heads=2, vocab_size=256)
MODELS = {
    "gpt": lambda blocks=BLOCKS: LitGPT(n_layer=blocks, d_model=32, n_head=2, attention="eager"),
    "llama": lambda blocks=BLOCKS: HFCausalLM(config=dict(TINY_LLAMA, num_hidden_layers=blocks),
                                              attn_implementation="eager"),
}


@functools.lru_cache(maxsize=None)
def _batch() -> dict:
    """One batch object for the module: the depth cache matches a batch by identity, so the tests
    asking about one model object share its proofs and copies (in the order pytest runs them)."""
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


def _figures(result) -> tuple:
    return (result.peak_bytes, result.phase_peak_bytes, result.host_bytes, result.resident_bytes,
            result.host_peak_bytes, result.host_phase_peak_bytes)


def _outcome(fn) -> tuple:
    """``(figures, detail, result)`` of a dry run, or ``("unsupported", reason, None)``."""
    try:
        result = fn()
    except DryRunUnsupported as exc:
        return "unsupported", exc.reason, None
    return _figures(result), result.detail, result


@functools.lru_cache(maxsize=None)
def _model(name: str) -> nn.Module:
    """The module's model of that name at BLOCKS blocks, one object (see ``_batch``)."""
    return MODELS[name]()


@functools.lru_cache(maxsize=None)
def _full_dry_run(model: nn.Module, names: tuple, seq_len: int, device: str):
    """The full dry run of ``model`` (one of ``_model``'s) on ``_batch()``, made once a module."""
    return dry_run_step(model, None, _batch(), seq_len, None, names, device=device)


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return _model(request.param)


# every setting on the GPT on the cpu and the Llama on the simulated CUDA device; the other two
# pairs a few (the rest is the same code on the same kinds of blocks)
FEW = [(), ("checkpointing",), (PLAIN_PAST,), ("microbatch",)]
EVERY = {("gpt", "cpu"), ("llama", "cuda")}


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # cuda: simulated (dryrun.accelerator)
def test_depth_extrapolated_equals_the_full_dry_run_to_the_byte(model, device):
    batch = _batch()
    name = next(n for n in MODELS if _model(n) is model)
    asked = [(names, FIRST) for names in (SETTINGS if (name, device) in EVERY else FEW)]
    asked += ON_CPU_TOO if device == "cpu" else []
    extrapolated = 0
    for names, seq_len in asked:
        deep, detail, result = _outcome(
            lambda: depth_dry_run_step(model, None, batch, seq_len, None, names, device=device))
        full, why, _ = _outcome(lambda: _full_dry_run(model, names, seq_len, device))
        assert deep == full, (names, seq_len, detail)
        if deep == "unsupported":  # the full dry run refuses it too, for the same reason
            assert detail == why
            continue
        assert detail.startswith(tuple(f"depth-extrapolated: {BLOCKS} blocks from {how} of "
                                       for how in ("a dry run of a copy", "dry runs of copies")))
        assert result.events is None and result.mitigations == names
        extrapolated += 1
    assert extrapolated >= len(asked) - 1  # fused_loss on the simulated device: refused by both


def test_partial_checkpointing_shares_its_copies_across_levels(model):
    """Every k of 'checkpointing:k/N' is answered from the same copies (one proof, one copy). On
    the cpu, as the test above: its proof at 128 tokens stands here, where it ran first."""
    batch = _batch()
    first = depth_dry_run_step(model, None, batch, 160, None, [PLAIN_PAST], device="cpu")
    copies = first.detail.split(" (each block")[0]
    for k in (1, BLOCKS - 1):
        names = [f"checkpointing:{k}/{BLOCKS}"]
        deep = depth_dry_run_step(model, None, batch, 160, None, names, device="cpu")
        full = dry_run_step(model, None, batch, 160, None, names, device="cpu")
        assert _figures(deep) == _figures(full)
        assert deep.detail.split(" (each block")[0] == copies
        assert deep.seconds < first.seconds  # the copy's dry run is cached: no new fake step


@pytest.mark.parametrize("names", [(), ("checkpointing",)])
def test_the_peak_site_is_extrapolated_where_it_stays_put(names):
    """On the cpu's GPT of the first test: its proofs at 128 tokens stand here, where it ran."""
    model, cpu = _model("gpt"), "cpu"
    deep = depth_dry_run_step(model, None, _batch(), 256, None, names, device=cpu,
                              site=trace_peak_site)
    full = dry_run_step(model, None, _batch(), 256, None, names, device=cpu, site=trace_peak_site)
    assert _figures(deep) == _figures(full)
    assert deep.peak_site is not None and deep.peak_site == full.peak_site
    assert "the peak site extrapolated from traced copies" in deep.detail
    short = depth_dry_run_step(model, None, _batch(), 128, None, names, device=cpu,
                               site=trace_peak_site)
    assert short.peak_site is None or short.peak_site == dry_run_step(
        model, None, _batch(), 128, None, names, device=cpu, site=trace_peak_site).peak_site


@pytest.mark.parametrize("offload", [False, True])
def test_a_layout_that_changes_with_the_length_is_proved_again_from_two_copies(offload):
    """The tiled MLP's tile count follows the length (here one tile per 32 tokens: 4, 7 and 8
    tiles), so each length lays its allocations out anew: the repetition proved on copies of 1, 2
    and 3 blocks at the first length is proved again from copies of 1 and 2 at the others (2 fake
    steps, not 3), and every answer equals the full dry run's, device and host, phase by phase
    (FSDP2 CPUOffloadPolicy with activation offload too). Without offload, on the simulated CUDA
    device's Llama of the first test: its proof at 128 tokens stands here, where it ran."""
    batch = _batch()
    if offload:
        clear_depth_cache()
        template = unsharded_template(MODELS["llama"]())
        names = ("checkpointing", "tiled_mlp", "activation_offload")
        deep_at = lambda n: depth_sharded_dry_run_step(  # noqa: E731
            template, batch, n, 1, None, names, "fsdp2", None, "cuda", offload=True)
        full_at = lambda n: sharded_dry_run_step(  # noqa: E731
            template, batch, n, 1, None, names, "fsdp2", None, "cuda", offload=True)
    else:
        model, names = _model("llama"), ("tiled_mlp",)
        deep_at = lambda n: depth_dry_run_step(  # noqa: E731
            model, None, batch, n, None, names, device="cuda")
        full_at = lambda n: _full_dry_run(model, names, n, "cuda")  # noqa: E731
    first = None
    for seq_len in (128, 200, 256):
        deep, full = deep_at(seq_len), full_at(seq_len)
        assert _figures(deep) == _figures(full), (seq_len, deep.detail)
        checked = deep.detail.split("the repetition checked on ")[1].split(")")[0]
        if first is None:
            first = checked
            assert checked.endswith("blocks at seq_len 128") and "and of" not in checked
        else:
            assert (checked.startswith(first + ", and of ")
                    and checked.endswith(f"blocks at seq_len {seq_len}"))


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_sharded_depth_extrapolated_equals_the_full_sharded_dry_run(strategy):
    clear_depth_cache()
    blocks = BLOCKS + 1 if strategy == "fsdp2" else BLOCKS  # past FSDP2's copies of 2 + 3, 3 + 2
    template = unsharded_template(MODELS["gpt"](blocks))
    batch = _batch()
    asked = [((), 128), ((), 200), ((f"checkpointing:2/{blocks}",), 128)]  # 2 plain past the copies
    asked += [(("microbatch",), 128)] if strategy == "fsdp2" else []
    for names, seq_len in asked:
        deep = depth_sharded_dry_run_step(template, batch, seq_len, 4, None, names, strategy)
        full = sharded_dry_run_step(template, batch, seq_len, 4, None, names, strategy)
        assert (deep.peak_bytes, deep.phase_peak_bytes) == (full.peak_bytes, full.phase_peak_bytes)
        assert deep.detail.startswith(f"depth-extrapolated: {blocks} blocks"), deep.detail


def test_sharded_hugging_face_model_answered_or_refused_alike():
    template = unsharded_template(MODELS["llama"]())
    deep, detail, _ = _outcome(lambda: depth_sharded_dry_run_step(template, _batch(), 128, 4))
    full, why, _ = _outcome(lambda: sharded_dry_run_step(template, _batch(), 128, 4))
    assert deep == full
    assert deep != "unsupported" or detail == why


def test_layers_that_differ_get_the_full_dry_run_with_the_reason():
    """Qwen2 with sliding-window attention on the layers past max_window_layers."""
    config = dict(TINY_LLAMA, use_sliding_window=True, sliding_window=64, max_window_layers=4)
    model = HFCausalLM(model_type="qwen2", config=config, attn_implementation="eager")
    deep = depth_dry_run_step(model, None, _batch(), 128)
    assert _figures(deep) == _figures(dry_run_step(model, None, _batch(), 128))
    why = "full depth: not depth-extrapolated: block 4 differs from block 0 at self_attn.layer_type"
    assert why in deep.detail, deep.detail


def test_a_block_of_another_width_is_seen():
    model = LitGPT(n_layer=6, d_model=32, n_head=2, d_ff=64)
    model.model.blocks[5] = LitGPT(n_layer=1, d_model=32, n_head=2, d_ff=96).model.blocks[0]
    deep = depth_dry_run_step(model, None, _batch(), 128)
    assert _figures(deep) == _figures(dry_run_step(model, None, _batch(), 128))
    assert "block 5 differs from block 0 at mlp" in deep.detail, deep.detail


class _IndexedStack(nn.Module):
    """Identical blocks, but the model's own loop makes a wider tensor after its third block: no
    block's attribute says so, only the step does."""

    def __init__(self, blocks: int = 6, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU())
                                    for _ in range(blocks))
        self.head = nn.Linear(width, 256)

    def training_step(self, batch, batch_idx):
        x = self.embed(batch["input_ids"])
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 2:
                x = torch.cat([x, x], -1)[..., : x.shape[-1]] * 2
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def test_a_step_that_does_not_repeat_per_block_gets_the_full_dry_run():
    model = _IndexedStack()
    deep = depth_dry_run_step(model, None, _batch(), 128)
    assert _figures(deep) == _figures(dry_run_step(model, None, _batch(), 128))
    assert "not depth-extrapolated: the allocations do not repeat per block" in deep.detail


def test_the_model_and_its_optimizer_are_left_as_they_were():
    model = MODELS["llama"]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    layers = list(model.model.model.layers)
    deep = depth_dry_run_step(model, optimizer, _batch(), 128, None, [PLAIN_PAST])
    assert deep.detail.startswith("depth-extrapolated")
    assert list(model.model.model.layers) == layers
    assert model.model.config.num_hidden_layers == BLOCKS
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert len(optimizer.state) == 0 and len(optimizer.param_groups[0]["params"]) == len(before)
    assert not is_checkpointed(model)


PLAN_BLOCKS = 4  # the plan's rows are of one kind of block: proved on copies of 1, 2, 3
PLAN_CONFIG = f"""\
trainer: {{accelerator: cpu, devices: 1}}
model: {{n_layer: {PLAN_BLOCKS}, d_model: 32, n_head: 2, attention: eager}}
data: {{batch_size: 2, seq_len: 64, num_samples: 8}}
"""


def test_seqmem_plan_figures_are_the_full_dry_runs(tmp_path, capsys):
    """``seqmem plan`` asks through the depth-extrapolated dry run: every row's peak, and the
    largest length it searched, are what full dry runs say."""
    import json

    from lightning_seqmem.cli.main import main
    from lightning_seqmem.reference.demo import SyntheticTokenDataModule

    config = tmp_path / "gpt.yaml"
    config.write_text(PLAN_CONFIG)
    assert main(["plan", "--config", str(config), "--lengths", "256", "2048", "--budget", "8MiB",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    model = MODELS["gpt"](PLAN_BLOCKS)
    data = SyntheticTokenDataModule(batch_size=2, seq_len=64, num_samples=8)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    rows = [(entry["seq_len"], row) for entry in doc["lengths"] for row in entry["rows"]]
    assert len(rows) == 8 and all(row["error"] is None for _, row in rows)
    for seq_len, row in rows:
        full = dry_run_step(model, None, batch, seq_len, None, row["mitigations"])
        assert row["peak_bytes"] == full.peak_bytes, (seq_len, row)
    largest, usable = doc["largest_fitting_seq_len"], doc["usable_budget_bytes"]
    last = doc["mitigation_sets"][-1]
    assert 256 < largest < 2048
    # the plan judges a peak as the callback does
    from lightning_seqmem.plan.judging import dry_run_bound

    assert dry_run_bound(dry_run_step(model, None, batch, largest, None, last).peak_bytes) <= usable
    assert (dry_run_bound(dry_run_step(model, None, batch, largest + 8, None, last).peak_bytes)
            > usable)


@pytest.mark.parametrize("names", [(), ("checkpointing",), ("checkpointing", "activation_offload")])
def test_offload_at_depth_equals_the_full_dry_run_on_device_and_host(names):
    """FSDP2 CPUOffloadPolicy on the simulated CUDA device (parameters, gradients and AdamW state on
    the host): the depth-extrapolated device and host peaks, phase by phase, equal the full dry
    run's. With activation offload too, the host peak is not affine in the block count at 128 tokens
    (1–4 blocks: +164,900, +197,540, +197,668 bytes): it is replayed from the pumped host trace, as
    the device's."""
    clear_depth_cache()
    template = unsharded_template(MODELS["llama"]())
    for world, seq_len in ((1, 128), (4, 128), (4, 200)):
        deep = depth_sharded_dry_run_step(template, _batch(), seq_len, world, None, names, "fsdp2",
                                          None, "cuda", offload=True)
        full = sharded_dry_run_step(template, _batch(), seq_len, world, None, names, "fsdp2", None,
                                    "cuda", offload=True)
        assert _figures(deep) == _figures(full) and full.host_peak_bytes > 0
        assert deep.detail.startswith(f"depth-extrapolated: {BLOCKS} blocks"), deep.detail
