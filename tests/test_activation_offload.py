"""The ``activation_offload`` rung: refused on CPU with its reason, its ``save_on_cpu`` mechanism on
a real model (loss and gradients unchanged, ``state_dict`` keys unchanged, removable, with
checkpointing in either order), and its dry-run model checked against the tracker on real steps.

On CPU there is no second memory to offload to, so the device side of the model is checked by
running the same hooks with a *hidden host*: the copy to the host runs outside every dispatch mode
(the tracker does not see it, as the CUDA allocator does not see pinned host memory), the copy back
runs under the tracker (as a GPU allocates it again on the device). What a GPU adds (512-byte
blocks, workspaces) is the GPU test's to check (``pytest -m gpu``).
"""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from conftest import measured_step, plan_config, plan_json
from lightning_seqmem.reference.demo import LitGPT
from lightning_seqmem.dryrun.offload_saving import offload_forecast
from lightning_seqmem.dryrun.step import dry_run_step
from lightning_seqmem.measure.probes import make_probe
from lightning_seqmem.mitigations import ladder
from lightning_seqmem.mitigations.checkpointing.checkpointing import (
    ActivationCheckpointing, is_checkpointed)
from lightning_seqmem.core.rungs import MITIGATIONS, check_mitigations
from lightning_seqmem.mitigations.activation_offload.activation_offload import (
    CPU_REFUSAL,
    ActivationOffload,
    OffloadedForward,
    is_offloading,
    offloaded_bytes,
    reset_offloaded_bytes,
)

MODEL = dict(n_layer=2, d_model=64, n_head=2, vocab_size=64, attention="sdpa")
L, ROWS = 256, 2


def _module(**kw):
    torch.manual_seed(0)
    return LitGPT(**{**MODEL, **kw})


def _batch(seq_len=L, rows=ROWS):
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, 64, (rows, seq_len), generator=g),
            "labels": torch.randint(0, 64, (rows, seq_len), generator=g)}


def _loss(model, batch):
    return model.training_step(batch, 0)


def _loss_and_grads(module, batch):
    module.zero_grad(set_to_none=True)
    loss = _loss(module, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}


# -- the rung on CPU -------------------------------------------------------------------------------
def test_on_cpu_the_rung_is_refused_with_its_reason_and_changes_nothing():
    module = _module()
    assert (ladder.applicability(["activation_offload"], None, module)
            == {"activation_offload": (False, CPU_REFUSAL)})
    assert ladder.try_apply("activation_offload", None, module) == (False, CPU_REFUSAL)
    assert not is_offloading(module) and not ladder.is_on("activation_offload", module)
    assert "activation_offload" not in MITIGATIONS  # opt in: not in the default ladder
    assert (check_mitigations(["attention", "activation_offload"])
            == ("attention", "activation_offload"))


# -- the mechanism on CPU (the policy called directly) ---------------------------------------------
@pytest.mark.parametrize("order", ["offload", "checkpointing+offload", "offload+checkpointing"])
def test_save_on_cpu_around_each_block_keeps_loss_grads_and_state_dict_keys(order):
    plain, offloaded = _module(), _module()
    seq_len = 128
    batch = _batch(seq_len)
    keys, params = list(plain.state_dict()), [id(p) for p in offloaded.parameters()]
    steps = order.split("+")
    for step in steps:
        policy = ActivationOffload() if step == "offload" else ActivationCheckpointing()
        assert policy.apply(offloaded).applied, step
    if "checkpointing" in steps:
        ActivationCheckpointing().apply(plain)
    assert is_offloading(offloaded) and is_checkpointed(offloaded) == ("checkpointing" in steps)
    assert [id(p) for p in offloaded.parameters()] == params  # the optimizer's parameters, in place
    assert list(offloaded.state_dict()) == keys
    reset_offloaded_bytes(offloaded)
    loss0, grads0 = _loss_and_grads(plain, batch)
    loss1, grads1 = _loss_and_grads(offloaded, batch)
    assert torch.equal(loss0, loss1)
    assert (grads0.keys() == grads1.keys()
            and all(torch.allclose(grads0[n], grads1[n], atol=1e-6) for n in grads0))
    moved = offloaded_bytes(offloaded)
    # the hooks are inside the checkpoint then: they stand aside
    if order == "offload+checkpointing":
        assert moved == 0
    # each checkpoint's input, one (rows, L, d) float tensor per block
    elif order == "checkpointing+offload":
        assert moved == MODEL["n_layer"] * ROWS * seq_len * MODEL["d_model"] * 4
    else:
        assert moved > MODEL["n_layer"] * ROWS * seq_len * MODEL["d_model"] * 4
    removed = ActivationOffload().remove(offloaded)
    assert removed.applied and removed.after == "off" and not is_offloading(offloaded)
    # the class's forward is back
    assert not any("forward" in m.__dict__ for m in offloaded.modules())
    assert list(offloaded.state_dict()) == keys
    loss2, _ = _loss_and_grads(offloaded, batch)
    assert torch.equal(loss0, loss2)


@pytest.mark.parametrize("order", ["checkpointing+offload", "offload+checkpointing"])
def test_with_hugging_face_checkpointing_the_checkpoint_inputs_go_to_the_host_in_either_order(
        order):
    """Hugging Face checkpoints inside the layer's class ``forward``, below the instance ``forward``
    the offload puts on each ``LlamaDecoderLayer``: its hooks are outside the checkpoint anyway."""
    pytest.importorskip("transformers")
    from lightning_seqmem.reference.hf import HFCausalLM

    hidden, seq_len = 32, 64
    config = {"num_hidden_layers": 2, "hidden_size": hidden, "intermediate_size": 64,
              "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 64}

    def model():
        torch.manual_seed(0)
        return HFCausalLM(config=config, attn_implementation="sdpa").train()

    plain, offloaded = model(), model()
    ActivationCheckpointing().apply(plain)
    for step in order.split("+"):
        assert (ActivationOffload() if step == "offload"
                else ActivationCheckpointing()).apply(offloaded).applied
    batch = _batch(seq_len)
    loss0, grads0 = _loss_and_grads(plain, batch)
    loss1, grads1 = _loss_and_grads(offloaded, batch)
    assert (torch.equal(loss0, loss1)
            and all(torch.allclose(grads0[n], grads1[n], atol=1e-6) for n in grads0))
    # the inputs
    assert offloaded_bytes(offloaded) == config["num_hidden_layers"] * ROWS * seq_len * hidden * 4
    assert list(plain.state_dict()) == list(offloaded.state_dict())


def test_parameters_and_buffers_stay_on_the_device():
    module = _module()
    ActivationOffload().apply(module)
    _loss_and_grads(module, _batch(64))
    wrappers = [m.__dict__["forward"] for m in module.modules() if "forward" in m.__dict__]
    assert (len(wrappers) == MODEL["n_layer"]
            and all(isinstance(w, OffloadedForward) for w in wrappers))
    # the Linear weights, saved by mm: kept
    assert all(w.kept_bytes > 0 and w.host_bytes > 0 for w in wrappers)
    # torch.save of the whole module works, and still offloads
    clone = pickle.loads(pickle.dumps(module))
    reset_offloaded_bytes(clone)
    _loss_and_grads(clone, _batch(64))
    assert offloaded_bytes(clone) == sum(w.host_bytes for w in wrappers)
    with pytest.raises(ValueError, match="block_class_names"):
        ActivationOffload(block_class_names=[""])


# -- the dry-run model against the tracker ---------------------------------------------------------
def _measured(module, host="pinned"):
    """One real CPU step (after a warm-up) with the offload hooks, measured by the tracker; the
    tracker's bytes of the host copies (the allocations made inside save_on_cpu's pack) or, with the
    hidden host, the device side only."""
    optimizer = module.configure_optimizers()
    batch = _batch()
    ActivationOffload().apply(module)
    wrappers = [m.__dict__["forward"] for m in module.modules()
                if isinstance(m.__dict__.get("forward"), OffloadedForward)]
    probe = make_probe("tracker", torch.device("cpu"))
    packed: list[int] = []  # the tracker's allocation indices made inside each host copy
    for w in wrappers:
        if host == "hidden":
            def to_host(t):
                with _disable_current_modes():
                    return t.detach().clone()
            w._to_host, w._from_host = to_host, lambda h: h.clone()
        else:
            def to_host(t, inner=w._to_host):
                tracker = probe._tracker
                before = len(tracker._finalizers) if tracker is not None else 0
                out = inner(t)
                if tracker is not None:
                    packed.extend(range(before, len(tracker._finalizers)))
                return out
            w._to_host = to_host
    memory = measured_step(module, optimizer, batch, _loss, probe, record_events=True,
                           after_warmup=lambda m=module: reset_offloaded_bytes(m))
    return memory, sum(memory.events.sizes[i] for i in packed), offloaded_bytes(module)


def test_the_dry_runs_bytes_moved_are_the_host_copies_the_tracker_measures():
    module = _module()
    dry = dry_run_step(module, module.configure_optimizers(), _batch(64), L, ROWS,
                       ["activation_offload"])
    _, tracked_host_bytes, counted = _measured(_module())
    assert tracked_host_bytes > 0
    # fake copy vs real storages the tracker saw
    assert dry.host_bytes == tracked_host_bytes == counted
    assert "moved to host memory (modelled)" in dry.detail


def test_the_modelled_device_peak_is_the_measured_one_within_1_percent():
    module = _module()
    forecast = offload_forecast(module, module.configure_optimizers(), _batch(64), L, ROWS)
    memory, _, counted = _measured(_module(), host="hidden")
    plain = _module()
    measured_plain = measured_step(plain, plain.configure_optimizers(), _batch(), _loss)
    assert abs(forecast.peak_bytes_with - memory.peak_bytes) <= 0.01 * memory.peak_bytes
    assert (abs(forecast.peak_bytes_without - measured_plain.peak_bytes)
            <= 0.01 * measured_plain.peak_bytes)
    assert memory.peak_bytes < measured_plain.peak_bytes and forecast.saved_bytes > 0
    assert forecast.host_bytes == counted and not forecast.measured
    # at the end of the forward the device has let go of what went to the host
    assert forecast.phase_peak_bytes_with["forward"] < forecast.phase_peak_bytes_without["forward"]


# -- seqmem plan -----------------------------------------------------------------------------------
def test_seqmem_plan_shows_the_modelled_saving_where_the_rung_is_refused(tmp_path, capsys):
    from lightning_seqmem.cli.main import main

    config = plan_config(tmp_path, ["activation_offload"], MODEL,
                         {"batch_size": ROWS, "seq_len": 64, "num_samples": 4, "vocab_size": 64})
    doc = plan_json(config, capsys, [L])
    assert doc["skipped"] == {"activation_offload": CPU_REFUSAL} and doc["mitigation_sets"] == [[]]
    (row,) = doc["modelled"]
    plain = doc["lengths"][0]["rows"][0]
    module = _module()
    dry = dry_run_step(module, None, _batch(64), L, ROWS, ["activation_offload"])
    assert row["measured"] is False and row["mitigations"] == ["activation_offload"]
    assert row["peak_bytes_without"] == plain["peak_bytes"]
    # the data module's batch, here ours
    assert abs(row["peak_bytes"] - dry.peak_bytes) <= 1e-3 * dry.peak_bytes
    assert (row["host_bytes"] == dry.host_bytes > 0
            and row["saved_bytes"] == plain["peak_bytes"] - row["peak_bytes"] > 0)
    assert main(["plan", "--config", str(config), "--lengths", str(L)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert ("activation_offload is refused here (CUDA only" in text
            and "modelled by a dry run, not measured" in text)


# -- on a GPU --------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_measured_peak_falls_as_the_dry_run_says():
    """The allocator's peak with and without the rung, against the dry run of each (fp32, SDPA)."""
    from lightning_seqmem.mitigations.base import RungContext
    from lightning_seqmem.mitigations.activation_offload.activation_offload import (
        ActivationOffloadRung)

    cuda = torch.device("cuda")
    seq_len, rows = 2048, 4
    peaks = {}
    for on in (False, True):
        module = _module(n_layer=4, d_model=256, n_head=4).to(cuda)
        optimizer = module.configure_optimizers()
        batch = {k: v.to(cuda) for k, v in _batch(seq_len, rows).items()}
        dry = dry_run_step(module, optimizer, batch, seq_len, rows,
                           ["activation_offload"] if on else [])
        if on:
            assert ActivationOffloadRung().apply(RungContext(module)).applied
        measured = measured_step(module, optimizer, batch, _loss, make_probe("cuda", cuda),
                                 after_warmup=lambda m=module: reset_offloaded_bytes(m))
        peaks[on] = (dry.peak_bytes, measured.peak_bytes, dry.host_bytes, offloaded_bytes(module))
        del module, optimizer, batch
        torch.cuda.empty_cache()
    for dry_peak, measured_peak, _, _ in peaks.values():
        assert abs(dry_peak - measured_peak) <= 0.02 * measured_peak, peaks
    assert peaks[True][1] < peaks[False][1], peaks
    # modelled bytes moved = what save_on_cpu copied
    assert peaks[True][2] == peaks[True][3] > 0, peaks
