"""The one micro-batch twin (:mod:`lightning_seqmem.mitigations.microbatch.microbatch_twin`): the
wrapper in a real Lightning step, the dry run's step and the breakdown's step run the same loop, so
they give the whole batch's loss and gradients alike, and the dry run's forecast of that loop is the
tracker's measurement of it on real tensors, to the byte."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_seqmem.diagnostics.traced_step import run_training_step, training_step_loss
from lightning_seqmem.dryrun.step import dry_run_step, state_after_a_step
from lightning_seqmem.dryrun.step_functions import step_functions
from lightning_seqmem.measure.probes import make_probe
from lightning_seqmem.measure.steps import training_step_memory
from lightning_seqmem.mitigations.microbatch import microbatch_twin
from lightning_seqmem.mitigations.base import CopyPlan
from lightning_seqmem.mitigations.microbatch.microbatch import MicroBatching
from lightning_seqmem.reference.nn import GPT, GPTConfig

from conftest import make_trainer

pytestmark = pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")

L = 24


class TokenMeanLM(pl.LightningModule):
    """A mean over label tokens, as Hugging Face's loss: the padded rows make the weights matter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, attention="sdpa"))

    def training_step(self, batch, batch_idx):
        logits = self.model(batch["input_ids"])
        return {"loss": F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                        ignore_index=-100)}

    def configure_optimizers(self):
        # the step leaves its gradients, changes nothing
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _batch() -> dict:
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 256, (4, L), generator=g)
    labels[0, 4:] = -100  # 4, 24, 10, 24 label tokens
    labels[2, 10:] = -100
    return {"input_ids": torch.randint(0, 256, (4, L), generator=g), "labels": labels}


def _grads(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in module.parameters()])


class _Capture(pl.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads = _grads(pl_module).clone()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.loss = outputs["loss"].detach().clone()


def test_wrapper_dry_run_and_breakdown_run_the_one_twin_and_get_the_whole_batch(monkeypatch):
    batch, reference = _batch(), TokenMeanLM()
    whole_loss = training_step_loss(reference, batch)
    whole_loss.backward()
    whole = _grads(reference)
    calls: list[str] = []
    shared = microbatch_twin.run_micro_batches

    def counted(parts, counts, *args, **kwargs):
        calls.append(f"{len(parts)} parts")
        return shared(parts, counts, *args, **kwargs)

    # the wrapper's name for it, and the others'
    for module in ("microbatch_step", "microbatch_twin"):
        monkeypatch.setattr(f"lightning_seqmem.mitigations.microbatch.{module}.run_micro_batches",
                            counted)

    # the wrapper, in a real Lightning step
    wrapped, capture = TokenMeanLM(), _Capture()
    trainer = make_trainer([capture], max_steps=1)
    assert MicroBatching(1).apply(trainer, wrapped, batch).applied
    trainer.fit(wrapped, DataLoader([batch], batch_size=None))
    # the dry run's step functions, on real tensors
    dry = TokenMeanLM()
    loss_fn, step_optimizer = step_functions(dry, dry.configure_optimizers(),
                                             CopyPlan(micro_batch_size=1), 4)
    dry_loss = loss_fn(dry, batch)
    dry_loss.backward()
    # the breakdown's step
    broken = TokenMeanLM()
    run_training_step(broken, broken.configure_optimizers(), batch, training_step_loss,
                      micro_batch_size=1)

    assert calls == ["4 parts"] * 3
    for loss in (capture.loss, dry_loss.detach()):
        torch.testing.assert_close(loss, whole_loss.detach(), rtol=1e-5, atol=1e-6)
    for grads in (capture.grads, _grads(dry), _grads(broken)):
        torch.testing.assert_close(grads, whole, rtol=1e-4, atol=1e-7)
    # the same loop, the same floats
    torch.testing.assert_close(_grads(dry), _grads(broken), rtol=0, atol=0)


@pytest.mark.parametrize("check", [False, True])
def test_the_dry_run_of_the_micro_batched_step_is_the_tracked_real_step_to_the_byte(check):
    """The fake step and the real one run the twin's loop, with the memory of the first-step check
    (the rung switched on by the dry run) or without (a module micro-batched with ``verify=False``):
    the dry run counts what the live-tensor tracker measures on real tensors."""
    module, batch = TokenMeanLM(), _batch()
    if not check:
        assert MicroBatching(1, verify=False).apply(make_trainer([], max_steps=1), module,
                                                    batch).applied
    optimizer = module.configure_optimizers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dry = dry_run_step(module, optimizer, batch, seq_len=L, mitigations=["microbatch"] if check
                           else ())
    assert "4 micro-batches of 1" in dry.detail and ("one-time check" in dry.detail) == check

    real = TokenMeanLM()
    real_optimizer = real.configure_optimizers()
    state_after_a_step(real, real_optimizer)  # as the dry run's first step leaves them
    plan = CopyPlan(micro_batch_size=1)
    loss_fn, step_optimizer = step_functions(real, real_optimizer, plan, 4, first_split_check=check)
    measured = training_step_memory(real, step_optimizer, batch, loss_fn,
                                    make_probe("tracker", torch.device("cpu")))
    assert measured.peak_bytes == dry.peak_bytes, (measured.phase_peak_bytes, dry.phase_peak_bytes)
    assert measured.phase_peak_bytes == dry.phase_peak_bytes
