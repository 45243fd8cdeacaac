"""The simulated CUDA device (``lightning_seqmem.dryrun.accelerator``): CUDA's autocast lists, no
phantom accelerator outside dry runs, and a clear refusal where it cannot be used."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_seqmem.dryrun.accelerator import autocast, simulated_device, simulating

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="a build with CUDA dry-runs CUDA itself")


def test_autocast_follows_cuda_op_lists():
    """ATen/autocast_mode.h's CUDA lists, which differ from the CPU's: softmax, log_softmax and sum
    run in float32 on CUDA (the dtype set, whether the caller passes it by position, by keyword or
    not at all), matmuls in the lower precision, addcmul promoted to the widest input."""
    device = simulated_device()
    with simulating(), FakeTensorMode():
        x = torch.empty(4, 8, device=device, dtype=torch.bfloat16)
        w = torch.nn.Parameter(torch.empty(8, 8, device=device))
        f32 = torch.empty(4, 8, device=device)
        with autocast(device, torch.bfloat16):
            assert ((x @ w).dtype == torch.bfloat16
                    and torch.nn.functional.linear(f32, w).dtype == torch.bfloat16)
            assert torch.softmax(x, -1).dtype == torch.float32
            assert torch.nn.functional.softmax(x, -1, dtype=torch.float).dtype == torch.float32
            assert torch.ops.aten.softmax.int(x, -1, None).dtype == torch.float32
            assert torch.log_softmax(x, 1).dtype == torch.float32 and x.sum().dtype == torch.float32
            assert torch.addcmul(x, x, f32).dtype == torch.float32
            assert torch.exp(x).dtype == torch.float32 and torch.relu(x).dtype == torch.bfloat16
        # the CPU's lists: softmax in the input's dtype
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cpu = torch.softmax(torch.empty(4, 8, dtype=torch.bfloat16), -1)
        assert cpu.dtype == torch.bfloat16


def test_no_accelerator_is_seen_outside_a_dry_run():
    """Registered before the first backward, the device reports itself available only while a dry
    run runs on it: outside, torch.accelerator, the DataLoader's pin_memory and distributed
    checkpointing (which failed on a phantom device's missing streams) see none."""
    from torch._utils import _get_available_device_type

    simulated_device()
    assert not torch.accelerator.is_available() and _get_available_device_type() is None
    with simulating():
        assert torch.accelerator.is_available() and _get_available_device_type() == "seqmem"
    assert not torch.accelerator.is_available()


_LATE = '''
import torch
w = torch.ones(2, requires_grad=True)
(w * 2).sum().backward()  # the first backward of the process, before the package is imported
from lightning_seqmem.dryrun.result import DryRunUnsupported
from lightning_seqmem.dryrun.step import dry_run_step
from lightning_seqmem.reference.demo import LitGPT
module = LitGPT(n_layer=1, d_model=32, n_head=2)
try:
    dry_run_step(module, None, {"input_ids": torch.zeros(2, 8, dtype=torch.long),
                                "labels": torch.zeros(2, 8, dtype=torch.long)}, 16, device="cuda")
except DryRunUnsupported as exc:
    print("refused:", exc.reason)
print("cpu:", dry_run_step(module, None, {"input_ids": torch.zeros(2, 8, dtype=torch.long),
                                          "labels": torch.zeros(2, 8, dtype=torch.long)},
                           16).peak_bytes > 0)
'''


def test_a_process_that_trained_before_the_import_gets_a_reason_and_cpu_dry_runs():
    """The autograd engine sizes its device queues at the process's first backward: imported after
    one, the simulated device cannot run a backward, and a CUDA dry run says so (what to do
    included) instead of failing inside the engine; dry runs of the CPU still work."""
    proc = subprocess.run([sys.executable, "-c", _LATE], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("refused: cannot simulate CUDA on this torch build without it: the simulated CUDA "
            "device was registered after this process ran its first backward"
            in proc.stdout), proc.stdout
    assert "cpu: True" in proc.stdout


def test_a_recompute_in_the_backward_caches_no_casts_into_the_optimizer_step():
    """Under bf16-mixed on the simulated device, DeepSpeed's tiled MLP recomputes each MLP in the
    backward, on the autograd engine's device thread, where torch's autocast-cache flag is on by
    default: the casts it made were cached and alive into the optimizer step (+6 GiB at a 4-layer 8B
    width, making the tiled MLP look worse than none). Lightning's MixedPrecision caches nothing:
    the optimizer phase peaks the same with and without the rung, and the tiled step's peak is
    lower."""
    from lightning_seqmem.dryrun.accelerator import step_context
    from lightning_seqmem.dryrun.step import dry_run_step
    from lightning_seqmem.reference.hf import HFCausalLM

    device = simulated_device()
    config = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 512,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
    with torch.device("meta"):
        module = HFCausalLM(config=config, attn_implementation="sdpa")
    plugin = type("Plugin", (), {"precision": "bf16-mixed", "train_step_context": None})()
    context = step_context(plugin, device)
    batch = {"input_ids": torch.zeros(1, 64, dtype=torch.long),
             "labels": torch.zeros(1, 64, dtype=torch.long)}
    plain = dry_run_step(module, None, batch, 8192, 1, (), context, "cuda")
    tiled = dry_run_step(module, None, batch, 8192, 1, ("tiled_mlp",), context, "cuda")
    assert tiled.phase_peak_bytes["optimizer"] == plain.phase_peak_bytes["optimizer"]
    assert tiled.peak_bytes < plain.peak_bytes


def test_the_optimizer_steps_as_a_cuda_run_would_foreach_and_a_cpu_run_per_tensor():
    """``foreach=None`` (AdamW's default) takes PyTorch's foreach kernels for parameters on CUDA and
    the per-tensor loop on the CPU; fake parameters always give the loop, so the dry run resolves it
    for the device it simulates. The CPU's answer is the measured step's to the byte, each way."""
    from lightning_seqmem.dryrun.step import dry_run_step
    from lightning_seqmem.dryrun.step_functions import plain_loss
    from lightning_seqmem.measure.probes import TrackerProbe
    from lightning_seqmem.measure.steps import training_step_memory
    from lightning_seqmem.reference.demo import LitGPT

    torch.manual_seed(0)
    model = LitGPT(n_layer=2, d_model=32, n_head=2, attention="eager")
    tokens = torch.randint(0, 256, (2, 257))
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    def optimizer_peak(device, foreach, measured=False):
        optimizer = torch.optim.AdamW(model.parameters(), foreach=foreach)
        if not measured:
            return dry_run_step(model, optimizer, batch, 256, device=device).phase_peak_bytes
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log without a Trainer
            training_step_memory(model, optimizer, batch, plain_loss)  # the state: a first step
            return training_step_memory(model, optimizer, batch, plain_loss, TrackerProbe(),
                                        record_events=True).phase_peak_bytes

    cuda = {foreach: optimizer_peak("cuda", foreach) for foreach in (None, True, False)}
    assert cuda[None] == cuda[True] and cuda[True]["optimizer"] > cuda[False]["optimizer"]
    cpu = {foreach: optimizer_peak("cpu", foreach) for foreach in (None, True, False)}
    assert cpu[None] == cpu[False] and cpu[True]["optimizer"] > cpu[False]["optimizer"]
    assert optimizer_peak("cpu", True, measured=True) == cpu[True]
    assert optimizer_peak("cpu", None, measured=True) == cpu[None]


def test_a_configured_per_tensor_step_is_kept_on_the_simulated_device():
    """``HFCausalLM(foreach=False)`` (what an 8B run on one H200 needs without offload: README) is
    planned as that: its ``configure_optimizers()`` optimizer, rebuilt over the fake copy, keeps
    ``foreach=False`` on the simulated GPU, where ``foreach=None`` takes the foreach step."""
    from lightning_seqmem.dryrun.step import dry_run_step
    from lightning_seqmem.reference.hf import HFCausalLM

    batch = {"input_ids": torch.randint(0, 256, (1, 64)), "labels": torch.randint(0, 256, (1, 64))}

    def optimizer_peak(foreach, explicit=False):
        torch.manual_seed(0)
        model = HFCausalLM(foreach=foreach, config=dict(num_hidden_layers=1, hidden_size=64,
                                                        intermediate_size=128))
        optimizer = torch.optim.AdamW(model.parameters(), foreach=foreach) if explicit else None
        return dry_run_step(model, optimizer, batch, 64, device="cuda").phase_peak_bytes[
            "optimizer"]

    assert optimizer_peak(False) == optimizer_peak(False, explicit=True) < optimizer_peak(None)


def test_a_sharded_step_on_the_simulated_device_steps_foreach_as_fsdp2_on_cuda():
    """FSDP2's parameters are DTensors, which PyTorch's ``foreach=None`` takes the foreach step for
    on CUDA: the sharded dry run's optimizer step peaks as with ``foreach=True``, above the
    per-tensor loop's, after the first step that makes the state (which runs foreach) too."""
    from lightning_seqmem.dryrun.sharded import sharded_dry_run_step, unsharded_template
    from lightning_seqmem.reference.demo import LitGPT

    def gpt(foreach):
        class GPT(LitGPT):
            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), foreach=foreach)
        return unsharded_template(GPT(n_layer=2, d_model=32, n_head=2, attention="eager"))

    tokens = torch.randint(0, 256, (2, 65))
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    optimizer = {foreach: sharded_dry_run_step(gpt(foreach), batch, 256, 2, device="cuda")
                 .phase_peak_bytes["optimizer"] for foreach in (None, True, False)}
    assert optimizer[None] == optimizer[True] > optimizer[False]
