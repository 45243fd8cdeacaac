"""Micro-batching on a real LitGPT (no dropout): same samples, steps and parameters as the full
batch.

Every comparison trains the same seeded model twice, with and without
:class:`~lightning_seqmem.mitigations.microbatch.microbatch.MicroBatching`, and checks the samples
seen by ``training_step``, the optimizer steps, ``global_step``, the first gradients and the final
parameters (fp32, allclose). Memory is live tensor bytes from :class:`TrackerProbe`.

Run as a script (``python tests/test_microbatch.py OUT``) this file is the DDP worker of
:func:`test_ddp_equals_full_batch`: Lightning's ``ddp`` launcher re-runs the script for rank 1.
"""

from __future__ import annotations

import functools
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import MixedPrecision
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader

from conftest import ddp_full_and_micro, launch_ddp_script, make_trainer
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule, SyntheticTokens
from lightning_seqmem.mitigations.base import MitigationResult
from lightning_seqmem.mitigations.microbatch.microbatch import MicroBatching
from lightning_seqmem.mitigations.microbatch.microbatch_step import is_micro_batching
from lightning_seqmem.mitigations.microbatch.microbatch_functional import split_batch
from lightning_seqmem.measure.probes import TrackerProbe

# no dropout: equality is exact up to rounding
SMALL = dict(vocab_size=64, n_layer=2, n_head=2, d_model=32)


class RecordingGPT(LitGPT):
    """LitGPT that records the sample indices each ``training_step`` call sees."""

    def __init__(self, optimizer: str = "adamw", **kwargs) -> None:
        super().__init__(**kwargs)
        self.optimizer_name = optimizer
        self.seen: list[list[int]] = []  # one entry per training_step call (per micro-batch)

    def training_step(self, batch, batch_idx):
        if torch.is_grad_enabled():  # not the no-grad forwards of micro-batching's first-step check
            self.seen.append(batch["index"].tolist())
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.0)
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


class Recorder(pl.Callback):
    """Applies micro-batching at batch ``apply_at`` and records steps, first gradients and
    losses."""

    def __init__(self, micro_batch_size: int | None = None, apply_at: int = 0) -> None:
        self.micro_batch_size = micro_batch_size
        self.apply_at = apply_at
        self.results: list[MitigationResult] = []
        self.optimizer_steps = 0
        self.first_grads: dict[str, torch.Tensor] | None = None
        self.batches: list[list[int]] = []
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch["index"].tolist())
        if self.micro_batch_size is not None and batch_idx == self.apply_at:
            self.results.append(
                MicroBatching(self.micro_batch_size).apply(trainer, pl_module, batch))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.optimizer_steps += 1
        if self.first_grads is None:
            self.first_grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


@dataclass
class Run:
    params: dict[str, torch.Tensor]
    first_grads: dict[str, torch.Tensor]
    seen: list[list[int]]
    batches: list[list[int]]
    losses: list[float]
    optimizer_steps: int
    global_step: int
    results: list[MitigationResult] = field(default_factory=list)
    model: RecordingGPT | None = None


# deterministic: the full-batch references are shared between tests
@functools.lru_cache(maxsize=None)
def _fit(
    micro_batch_size: int | None = None,
    apply_at: int = 0,
    optimizer: str = "adamw",
    accumulate: int = 1,
    num_samples: int = 24,
    batch_size: int = 4,
    seq_len: int = 16,
) -> Run:
    torch.manual_seed(0)
    model = RecordingGPT(optimizer=optimizer, **SMALL)
    datamodule = SyntheticTokenDataModule(batch_size, seq_len, num_samples,
                                          vocab_size=SMALL["vocab_size"])
    recorder = Recorder(micro_batch_size, apply_at)
    trainer = make_trainer([recorder], max_steps=-1, max_epochs=1,
                           accumulate_grad_batches=accumulate)
    trainer.fit(model, datamodule=datamodule)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return Run(
        params, recorder.first_grads, model.seen, recorder.batches, recorder.losses,
        recorder.optimizer_steps, trainer.global_step, recorder.results, model,
    )


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float,
                  rtol: float = 1e-4) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=rtol,
                                   msg=lambda m: f"{name}: {m}")


def _flat(seen: list[list[int]]) -> list[int]:
    return [i for indices in seen for i in indices]


# --- split_batch -------------------------------------------------------------------------------


def test_split_batch_cuts_batch_tensors_and_passes_the_rest():
    ids = torch.arange(10).reshape(5, 2)
    mask = torch.ones(3, 3)  # dim 0 is not the batch size: every micro-batch gets it whole
    batch = {"input_ids": ids, "index": torch.arange(5), "nested": [ids.float(), "tag"],
             "scale": torch.tensor(2.0), "mask": mask, "names": ["a", "b", "c", "d", "e"]}
    parts = split_batch(batch, 2)
    assert [p["input_ids"].shape[0] for p in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), ids)
    assert [p["index"].tolist() for p in parts] == [[0, 1], [2, 3], [4]]
    assert all(p["nested"][1] == "tag"
               and p["nested"][0].shape[0] == p["input_ids"].shape[0] for p in parts)
    assert all(p["scale"] is batch["scale"] and p["mask"] is mask
               and p["names"] == batch["names"] for p in parts)
    assert parts[0]["input_ids"].data_ptr() == ids.data_ptr()  # views, nothing copied
    assert batch["input_ids"] is ids and batch["index"].shape == (5,)  # the input is not mutated


def test_split_batch_tuples_namedtuples_and_bare_tensors():
    from collections import namedtuple

    ids = torch.arange(12).reshape(4, 3)
    pair = split_batch((ids, ids.clone()), 3)
    assert isinstance(pair[0], tuple) and [p[0].shape[0] for p in pair] == [3, 1]
    Batch = namedtuple("Batch", "input_ids labels")
    parts = split_batch(Batch(ids, ids), 1)
    assert len(parts) == 4 and all(isinstance(p, Batch) and p.labels.shape == (1, 3) for p in parts)
    assert [p.shape[0] for p in split_batch(ids, 4)] == [4]
    with pytest.raises(ValueError, match="micro_batch_size"):
        split_batch(ids, 0)
    with pytest.raises(ValueError, match="2-D integer tensor"):
        split_batch({"x": torch.zeros(4, 3)}, 1)


# --- equivalence with the full batch ----------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
# 3: micro-batches of 3 and 1, weighted n_i / N
@pytest.mark.parametrize("micro_batch_size", [1, 3])
def test_from_the_start_equals_full_batch(optimizer, micro_batch_size):
    full = _fit(None, optimizer=optimizer)
    micro = _fit(micro_batch_size, apply_at=0, optimizer=optimizer)
    assert micro.results[0].applied, micro.results[0]
    # every sample seen exactly once per epoch, in micro-batches of the asked size, in order
    assert sorted(_flat(micro.seen)) == list(range(24)) and _flat(micro.seen) == _flat(full.seen)
    assert len(full.seen) == 6 and len(micro.seen) == 6 * len(range(0, 4, micro_batch_size))
    assert max(len(s) for s in micro.seen) == micro_batch_size
    assert micro.batches == full.batches
    assert micro.optimizer_steps == full.optimizer_steps == 6
    assert micro.global_step == full.global_step == 6
    _assert_close(micro.first_grads, full.first_grads, atol=1e-6)
    # AdamW turns the rounding noise of gradients that are zero in exact arithmetic (the key bias
    # of attention) into updates of up to lr * O(1); SGD shows the gradients' agreement directly.
    _assert_close(micro.params, full.params, atol=1e-6 if optimizer == "sgd" else 2e-4)
    # training_step's returned loss is the full-batch loss, not the last micro-batch's
    assert micro.losses == pytest.approx(full.losses, rel=1e-5)


def test_apply_mid_epoch_equals_full_batch():
    full = _fit(None, optimizer="sgd")
    micro = _fit(1, apply_at=3, optimizer="sgd")
    assert micro.results[0].applied
    assert [len(s) for s in micro.seen] == [4, 4, 4] + [1] * 12  # batches 0-2 whole, then split
    assert _flat(micro.seen) == _flat(full.seen) and micro.global_step == full.global_step == 6
    _assert_close(micro.params, full.params, atol=1e-6)


def test_accumulate_grad_batches_equals_without_micro_batching():
    # applied at batch 3: in the middle of an accumulation window of 2
    full = _fit(None, optimizer="sgd", accumulate=2, num_samples=32)
    micro = _fit(2, apply_at=3, optimizer="sgd", accumulate=2, num_samples=32)
    assert (micro.optimizer_steps == full.optimizer_steps == 4
            and micro.global_step == full.global_step == 4)
    assert sorted(_flat(micro.seen)) == list(range(32))
    _assert_close(micro.first_grads, full.first_grads, atol=1e-6)
    _assert_close(micro.params, full.params, atol=1e-6)
    assert micro.losses == pytest.approx(full.losses, rel=1e-5)

    micro_from_start = _fit(1, apply_at=0, optimizer="sgd", accumulate=2, num_samples=32)
    _assert_close(micro_from_start.first_grads, full.first_grads, atol=1e-6)
    _assert_close(micro_from_start.params, full.params, atol=1e-6)


def test_apply_before_fit_and_remove_mid_training():
    torch.manual_seed(0)
    model = RecordingGPT(optimizer="sgd", **SMALL)
    trainer = make_trainer([], max_steps=-1, max_epochs=1)
    result = MicroBatching(2).apply(trainer, model)  # before fit: batch size unknown, applies
    assert result.applied and result.after == "micro_batch_size=2" and is_micro_batching(model)

    class RemoveAt(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 2:
                assert MicroBatching().remove(pl_module).applied

    trainer = make_trainer([RemoveAt()], max_steps=-1, max_epochs=1)
    trainer.fit(model,
                datamodule=SyntheticTokenDataModule(4, 16, 16, vocab_size=SMALL["vocab_size"]))
    assert [len(s) for s in model.seen] == [2, 2, 2, 2, 4, 4]
    assert not is_micro_batching(model) and "optimizer_zero_grad" not in model.__dict__
    full = _fit(None, optimizer="sgd", num_samples=16)
    _assert_close({n: p.detach() for n, p in model.named_parameters()}, full.params, atol=1e-6)


def _fit_fp16(micro_batch_size: int | None):
    torch.manual_seed(0)
    model = RecordingGPT(optimizer="sgd", **SMALL)
    recorder = Recorder(micro_batch_size, apply_at=0)
    # "16-mixed" on CPU falls back to bf16 without a scaler: pass a GradScaler explicitly.
    plugin = MixedPrecision("16-mixed", "cpu",
                            scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12))
    trainer = make_trainer([recorder], max_steps=-1, max_epochs=1, plugins=[plugin])
    trainer.fit(model,
                datamodule=SyntheticTokenDataModule(4, 16, 16, vocab_size=SMALL["vocab_size"]))
    return recorder.first_grads, {n: p.detach() for n,
                                  p in model.named_parameters()}, plugin.scaler.get_scale()


def test_grad_scaler_is_applied_to_every_micro_batch():
    # An unscaled micro-batch backward would be off by the scale (4096); fp16 rounding is ~1e-3.
    full_grads, full_params, full_scale = _fit_fp16(None)
    micro_grads, micro_params, micro_scale = _fit_fp16(1)
    assert micro_scale == full_scale == 2.0**12
    for name, grad in full_grads.items():
        torch.testing.assert_close(micro_grads[name], grad,
                                   atol=1e-2 * float(grad.abs().max()) + 1e-9, rtol=0)
    _assert_close(micro_params, full_params, atol=1e-3, rtol=0)


# --- memory ------------------------------------------------------------------------------------


class StepPeak(pl.Callback):
    """Live-tensor peak of the second step (the first has no optimizer state)."""

    def __init__(self) -> None:
        self.probe = TrackerProbe("cpu")
        self.memory = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx != 1:
            return
        existing = list(pl_module.parameters()) + [p.grad for p in pl_module.parameters()
                                                   if p.grad is not None]
        for state in trainer.optimizers[0].state.values():
            existing += [v for v in state.values() if isinstance(v, torch.Tensor)]
        existing += [v for v in batch.values() if isinstance(v, torch.Tensor)]
        self.probe.start_step(existing)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 1:
            self.memory = self.probe.end_step()


def _step_memory(micro_batch_size: int | None):
    torch.manual_seed(0)
    model = LitGPT(attention="eager")  # 2 layers, d=128, 4 heads: the DESIGN.md reference model
    peak = StepPeak()
    callbacks = [peak] + ([Recorder(micro_batch_size, 0)] if micro_batch_size else [])
    trainer = make_trainer(callbacks, max_steps=2)
    trainer.fit(model,
                datamodule=SyntheticTokenDataModule(batch_size=4, seq_len=256, num_samples=8))
    return peak.memory


def test_micro_batch_one_lowers_the_step_peak():
    full, micro = _step_memory(None), _step_memory(1)
    full_dynamic, micro_dynamic = (full.peak_bytes - full.start_bytes,
                                   micro.peak_bytes - micro.start_bytes)
    assert micro.peak_bytes < full.peak_bytes
    # activations of 1 sample instead of 4 (plus the gradients, alive during later micro-batches)
    assert micro_dynamic < 0.4 * full_dynamic, (micro_dynamic, full_dynamic)


# --- refusals and idempotence ------------------------------------------------------------------


class ManualGPT(LitGPT):
    def __init__(self):
        super().__init__(**SMALL)
        self.automatic_optimization = False


def test_is_applicable_refusals_and_idempotence():
    trainer = make_trainer([], max_steps=1)
    ok, reason = MicroBatching().is_applicable(trainer, ManualGPT())
    assert not ok and "manual optimization" in reason

    model = LitGPT(**SMALL)
    one = {"input_ids": torch.zeros(1, 8, dtype=torch.long)}
    ok, reason = MicroBatching(1).is_applicable(trainer, model, one)
    assert not ok and "already at most micro_batch_size=1" in reason
    four = {"input_ids": torch.zeros(4, 8, dtype=torch.long)}
    assert not MicroBatching(4).is_applicable(trainer, model, four)[0]
    ok, reason = MicroBatching(1).is_applicable(trainer, model, {"x": torch.zeros(4, 8)})
    assert not ok and "cannot split" in reason
    pair = (torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long))
    assert MicroBatching(2).is_applicable(trainer, model, pair) == (
        True, "split batches of 4 into micro-batches of 2")

    first = MicroBatching(2).apply(trainer, model, four)
    again = MicroBatching(2).apply(trainer, model, four)
    assert first.applied and not again.applied and "already" in again.detail
    resized = MicroBatching(1).apply(trainer, model, four)
    assert (resized.applied
            and (resized.before, resized.after) == ("micro_batch_size=2", "micro_batch_size=1"))
    assert model.training_step.micro_batch_size == 1 and model.training_step.previous is None
    removed = MicroBatching().remove(model)
    assert removed.applied and removed.after == "off"
    assert ("training_step" not in model.__dict__
            and model.training_step.__func__ is LitGPT.training_step)
    assert not MicroBatching().remove(model).applied


def test_is_applicable_reads_the_dataloader_batch_size():
    model = LitGPT(**SMALL)
    loader = DataLoader(SyntheticTokens(4, 8, 64), batch_size=1)

    class Check(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            self.answer = MicroBatching(1).is_applicable(trainer, pl_module)

    check = Check()
    make_trainer([check], max_steps=1).fit(model, loader)
    assert check.answer == (False, "batch size 1 is already at most micro_batch_size=1")


def test_remove_restores_an_instance_training_step():
    model = LitGPT(**SMALL)
    calls = []

    def custom(batch, batch_idx):
        calls.append(batch["input_ids"].shape[0])
        return LitGPT.training_step(model, batch, batch_idx)

    model.training_step = custom
    trainer = make_trainer([], max_steps=1)
    assert MicroBatching(2).apply(trainer, model).applied
    assert model.training_step.original is custom
    MicroBatching().remove(model)
    assert model.training_step is custom


def test_training_step_without_trainer_is_not_split():
    model = LitGPT(**SMALL)
    MicroBatching(1).apply(make_trainer([], max_steps=1), model)
    batch = {"input_ids": torch.zeros(3, 8, dtype=torch.long),
             "labels": torch.zeros(3, 8, dtype=torch.long)}
    with pytest.warns(Warning):  # self.log without a trainer
        loss = model.training_step(batch, 0)
    assert loss.requires_grad and loss.dim() == 0


class ValidatingGPT(LitGPT):
    """A module whose ``validation_step`` calls its ``training_step`` (a common shortcut)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.val_losses: list[float] = []

    def validation_step(self, batch, batch_idx):
        loss = self.training_step(batch, batch_idx)
        self.val_losses.append(float(loss))
        return loss


def test_a_validation_step_that_calls_training_step_runs_whole():
    """Validation runs without gradients: the split step, which backpropagates each micro-batch,
    would fail there ("does not require grad"); the wrapper runs the batch whole. The first loss is
    that of the same model without micro-batching (the sanity check: the same weights)."""
    losses = []
    for micro_batch_size in (None, 1):
        torch.manual_seed(0)
        model = ValidatingGPT(**SMALL)
        data = SyntheticTokenDataModule(4, 16, 16, vocab_size=SMALL["vocab_size"])
        data.val_dataloader = data.train_dataloader
        trainer = make_trainer([Recorder(micro_batch_size)], max_steps=4, val_check_interval=2,
                               num_sanity_val_steps=1, limit_val_batches=2)
        trainer.fit(model, datamodule=data)
        assert trainer.global_step == 4 and is_micro_batching(model) == (micro_batch_size == 1)
        losses.append(model.val_losses)
    assert len(losses[0]) == 5  # the sanity check's batch, then two at steps 2 and 4
    assert losses[1][0] == pytest.approx(losses[0][0], rel=1e-6)  # before any step: same weights
    assert all(torch.isfinite(torch.tensor(v)) for v in losses[1])


# --- DDP ---------------------------------------------------------------------------------------


def _ddp_fit(micro_batch_size: int | None) -> dict:
    """One DDP fit on 2 CPU processes (gloo); returns rank 0's parameters, counts and seen
    indices."""
    torch.manual_seed(0)
    model = RecordingGPT(optimizer="sgd", **SMALL)
    recorder = Recorder(micro_batch_size, apply_at=0)
    allreduces = [0]

    def counting_allreduce(state, bucket):  # called once per gradient bucket all-reduced
        allreduces[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    class CountAllreduces(pl.Callback):  # Lightning registers `ddp_comm_hook` on CUDA only
        def on_train_start(self, trainer, pl_module):
            trainer.strategy.model.register_comm_hook(None, counting_allreduce)

    trainer = make_trainer([recorder, CountAllreduces()], max_steps=-1, max_epochs=1,
                           strategy="ddp", devices=2)
    trainer.fit(model,
                datamodule=SyntheticTokenDataModule(4, 16, 32, vocab_size=SMALL["vocab_size"]))
    seen = trainer.strategy.all_gather(torch.tensor(_flat(model.seen)))
    return {
        "rank": trainer.global_rank,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "global_step": trainer.global_step,
        "optimizer_steps": recorder.optimizer_steps,
        "seen": seen.flatten().tolist(),
        "calls": len(model.seen),
        "allreduces": allreduces[0],
    }


@pytest.mark.ddp
def test_ddp_equals_full_batch(tmp_path):
    results = launch_ddp_script(Path(__file__).resolve(), tmp_path, 240)
    full, micro = results["full"], results["micro"]
    assert micro["global_step"] == full["global_step"] == 4  # 32 samples / (2 ranks x 4)
    assert micro["optimizer_steps"] == full["optimizer_steps"] == 4
    assert micro["calls"] == 4 * full["calls"] == 16  # per rank: 4 batches of 4, split into 1s
    assert sorted(micro["seen"]) == sorted(full["seen"]) == list(range(32))
    # gradients synced once per optimizer step
    assert micro["allreduces"] == full["allreduces"] == 4
    _assert_close(micro["params"], full["params"], atol=1e-6)


if __name__ == "__main__":
    ddp_full_and_micro(_ddp_fit, sys.argv[1])


# --- a Hugging Face model -----------------------------------------------------------------------


def test_hugging_face_model_same_gradients_and_less_memory():
    """Micro-batching a Hugging Face causal LM (random tiny Llama config): same first-step
    gradients as the full batch, and a lower measured step peak."""
    pytest.importorskip("transformers")
    from lightning_seqmem import SeqMemCallback
    from lightning_seqmem.reference.hf import HFCausalLM

    class GradsAtFirstStep(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 2:
                self.grads = {n: p.grad.clone() for n, p in pl_module.named_parameters()
                              if p.grad is not None}

    def run(micro):
        torch.manual_seed(0)
        module = HFCausalLM()
        grads, seqmem = GradsAtFirstStep(), SeqMemCallback(warmup_steps=2, mitigations=())

        class SwitchOn(pl.Callback):
            def on_fit_start(self, trainer, pl_module):
                if micro:
                    assert MicroBatching(micro).apply(trainer, pl_module).applied

        trainer = pl.Trainer(
            max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
            callbacks=[SwitchOn(), grads, seqmem], default_root_dir=tempfile.mkdtemp(),
        )
        data = SyntheticTokenDataModule(batch_size=4, seq_len=128, num_samples=16,
                                        vocab_size=module.model.config.vocab_size)
        trainer.fit(module, data)
        return grads.grads, seqmem.records[-1]

    full_grads, full = run(None)
    micro_grads, micro = run(1)
    assert full_grads.keys() == micro_grads.keys() and full_grads
    for name in full_grads:
        torch.testing.assert_close(micro_grads[name], full_grads[name], atol=2e-6, rtol=1e-4)
    assert micro.peak_bytes - micro.start_bytes < 0.6 * (full.peak_bytes - full.start_bytes)
