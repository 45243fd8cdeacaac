"""Micro-batching weights and its first-step check, on real models (no mock of the maths).

* A Hugging Face causal LM (random tiny Llama config, nothing downloaded) on right-padded batches
  whose samples have different numbers of label tokens (one with none after the causal shift):
  inside a real ``Trainer``, the micro-batched gradients equal the plain step's, and the old
  ``1/N`` weighting (``weighting="samples"``) does not.
* A sum-reduced loss, a random loss and batch norm are refused by the check, and the run then
  trains exactly as one without micro-batching.
* Dropout is turned off for the check only: with it, a run trains exactly as one without the check.

Run as a script (``python tests/test_microbatch_weighting.py OUT``) this file is the DDP worker of
:func:`test_ddp_padded_hugging_face_equals_full_batch`.
"""

from __future__ import annotations

import functools
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from conftest import ddp_full_and_micro, launch_ddp_script, make_trainer
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.mitigations.microbatch.microbatch import MicroBatching
from lightning_seqmem.mitigations.microbatch.microbatch_step import (
    MicroBatchingRefusedWarning, is_micro_batching, micro_batching_check_pending,
    micro_batching_refusal)
from lightning_seqmem.mitigations.microbatch.microbatch_functional import micro_batch_counts

transformers = pytest.importorskip("transformers")

VOCAB = 256
SEQ_LEN = 24
# Right-padded rows, 3 batches of 4. After the causal shift a row of n tokens has n - 1 labels: the
# last row of the first batch (the one Lightning would backpropagate) and the first of the third
# have none (their Hugging Face loss alone is 0/0 = NaN).
LENGTHS = [3, 24, 10, 1, 24, 2, 17, 5, 1, 12, 24, 8]


class PaddedTokens(Dataset):
    """Rows of ``LENGTHS`` random tokens padded with 0 to ``SEQ_LEN``: ``input_ids``,
    ``attention_mask``, ``labels`` (-100 on padding), ``index``.

    ``labels="inputs"``: the labels are the inputs (Hugging Face's convention; its loss shifts
    them). ``labels="next"``: the labels are already the next tokens (the loss does not shift).
    """

    def __init__(self, labels: str = "inputs", lengths: tuple[int, ...] = tuple(LENGTHS),
                 seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.items = []
        for i, n in enumerate(lengths):
            ids = torch.zeros(SEQ_LEN, dtype=torch.long)
            ids[:n] = torch.randint(1, VOCAB, (n,), generator=generator)
            mask = (torch.arange(SEQ_LEN) < n).long()
            if labels == "inputs":
                target = ids.masked_fill(mask == 0, -100)
            else:
                target = torch.full((SEQ_LEN,), -100, dtype=torch.long)
                target[: n - 1] = ids[1:n]
            self.items.append({"input_ids": ids, "attention_mask": mask, "labels": target,
                               "index": i})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def _llama_config():
    return transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=VOCAB, attention_dropout=0.0,
    )


class _Seen:
    """A counter every copy of the module shares (a deep copy gives it back itself)."""

    no_grad_calls = 0

    def __deepcopy__(self, memo):
        return self


class HFLossLM(pl.LightningModule):
    """A Llama trained on the loss the Hugging Face model computes itself (``ForCausalLMLoss``)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = transformers.LlamaForCausalLM(_llama_config())
        self.model.set_attn_implementation("eager")
        self.no_grad_calls = 0  # on this module (the micro-batching check runs on its own copy)
        self.seen = _Seen()  # on this module and its copies
        self.sizes: list[int] = []  # samples of each training_step call with gradient

    def training_step(self, batch, batch_idx):
        if not torch.is_grad_enabled():
            self.no_grad_calls += 1
            self.seen.no_grad_calls += 1
        else:
            self.sizes.append(batch["input_ids"].shape[0])
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         labels=batch["labels"], use_cache=False)
        self.log("train/loss", out.loss, batch_size=batch["input_ids"].shape[0])
        return out.loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _project_hf_module():
    """The project's :class:`HFCausalLM` (``shift_labels=False``: labels already the next
    tokens)."""
    from lightning_seqmem.reference.hf import HFCausalLM

    class SGDCausalLM(HFCausalLM):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    fields = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=VOCAB, attention_dropout=0.0)
    return SGDCausalLM(config=fields)


class Grads(pl.Callback):
    """Applies a policy before fit; keeps the first step's gradients and the check's outcome."""

    def __init__(self, policy: MicroBatching | None) -> None:
        self.policy = policy
        self.first_grads: dict[str, torch.Tensor] | None = None
        self.pending_before: list[bool] = []
        self.wrapper = None

    def on_fit_start(self, trainer, pl_module):
        if self.policy is not None:
            assert self.policy.apply(trainer, pl_module).applied
            self.wrapper = pl_module.__dict__["training_step"]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.pending_before.append(micro_batching_check_pending(pl_module))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.first_grads is None:
            self.first_grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()
                                if p.grad is not None}


@dataclass
class Run:
    first_grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    losses: list[float]
    global_step: int
    callback: Grads
    module: pl.LightningModule


class LossRecorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


@functools.lru_cache(maxsize=None)
def _fit_hf(module: str, micro: int | None, weighting: str = "auto", verify: bool = True,
            accumulate: int = 1,
            precision: str = "32-true", lengths: tuple[int, ...] = tuple(LENGTHS)) -> Run:
    torch.manual_seed(0)
    pl_module = HFLossLM() if module == "hf_loss" else _project_hf_module()
    data = PaddedTokens("inputs" if module == "hf_loss" else "next", lengths)
    policy = MicroBatching(micro, weighting=weighting, verify=verify) if micro else None
    grads, losses = Grads(policy), LossRecorder()
    trainer = make_trainer([grads, losses], max_steps=-1, max_epochs=1,
                           accumulate_grad_batches=accumulate, precision=precision)
    trainer.fit(pl_module, DataLoader(data, batch_size=4))
    params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
    return Run(grads.first_grads, params, losses.losses, trainer.global_step, grads, pl_module)


def _relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``||a - b|| / ||b||`` over all parameters (L2 norm)."""
    num = sum(float((a[n].double() - b[n].double()).pow(2).sum()) for n in b)
    den = sum(float(b[n].double().pow(2).sum()) for n in b)
    return (num / den) ** 0.5


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float = 1e-4,
                  atol: float = 1e-6):
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol,
                                   msg=lambda m: f"{name}: {m}")


# --- what Hugging Face's loss averages over ------------------------------------------------------


def test_hugging_face_loss_is_a_mean_over_shifted_label_tokens():
    """transformers' ForCausalLMLoss divides by ``(labels[..., 1:] != -100).sum()``: what
    ``micro_batch_counts`` counts for labels that are the inputs."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config())
    batch = DataLoader(PaddedTokens("inputs"), batch_size=4).__iter__().__next__()
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                labels=batch["labels"])
    shifted = batch["labels"][:, 1:]
    token_losses = F.cross_entropy(out.logits[:, :-1].float().reshape(-1, VOCAB),
                                   shifted.reshape(-1), ignore_index=-100, reduction="sum")
    valid = shifted != -100
    torch.testing.assert_close(out.loss, token_losses / valid.sum(), rtol=1e-6, atol=0)
    # not the unshifted count
    assert not torch.isclose(out.loss, token_losses / (batch["labels"] != -100).sum())
    rule, counts = micro_batch_counts(batch, 1)
    assert rule == "shifted_label_tokens" and counts == valid.sum(1).tolist() == [2, 23, 9, 0]
    # weighted by those counts, per-sample losses give the batch's loss; weighted 1/N, they do not
    per_sample = [model(input_ids=batch["input_ids"][i:i + 1],
                        attention_mask=batch["attention_mask"][i:i + 1],
                        labels=batch["labels"][i:i + 1]).loss for i in range(3)]
    weighted = sum(c * loss for c, loss in zip(counts, per_sample)) / sum(counts)
    torch.testing.assert_close(weighted, out.loss, rtol=1e-5, atol=0)
    # 0 label tokens
    assert torch.isnan(model(input_ids=batch["input_ids"][3:], labels=batch["labels"][3:]).loss)


def test_micro_batch_counts_rules():
    ids = torch.arange(1, 13).reshape(4, 3)
    assert micro_batch_counts({"input_ids": ids}, 2) == ("samples", [2, 2])  # no labels: samples
    # regression
    assert micro_batch_counts({"input_ids": ids, "labels": ids.float()}, 3) == ("samples", [3, 1])
    assert micro_batch_counts({"inputs_embeds": torch.zeros(4, 3, 2), "labels": ids},
                              2) == ("shifted_label_tokens", [4, 4])
    assert micro_batch_counts({"input_ids": ids, "labels": torch.ones(4, 5, dtype=torch.long)},
                              2) == ("label_tokens", [10, 10])
    # sequence classification: one label per sample, never shifted
    classes = torch.tensor([1, -100, 0, 2])
    assert (micro_batch_counts({"input_ids": ids, "labels": classes}, 1)
            == ("label_tokens", [1, 0, 1, 1]))
    assert micro_batch_counts({"input_ids": ids, "labels": ids}, 2,
                              weighting="label_tokens") == ("label_tokens", [6, 6])
    assert micro_batch_counts({"input_ids": ids, "labels": ids + 1}, 2,
                              "shifted_label_tokens") == ("shifted_label_tokens", [4, 4])
    assert (micro_batch_counts({"input_ids": ids, "labels": ids}, 2, "samples")
            == ("samples", [2, 2]))
    assert micro_batch_counts({"input_ids": ids, "labels": ids.masked_fill(ids > 4, 7)}, 2,
                              ignore_index=7) == ("shifted_label_tokens", [2, 0])
    with pytest.raises(ValueError, match="needs a mapping batch with an integer 'labels'"):
        micro_batch_counts((ids, ids), 2, "label_tokens")
    with pytest.raises(ValueError, match="`weighting` must be one of"):
        micro_batch_counts({"input_ids": ids}, 2, "tokens")


# --- exact on a padded Hugging Face batch, in a Trainer ------------------------------------------


@pytest.mark.parametrize("module", ["hf_loss", "HFCausalLM"])
def test_padded_hugging_face_batches_equal_full_batch(module):
    full = _fit_hf(module, None)
    micro = _fit_hf(module, 1)
    old = _fit_hf(module, 1, weighting="samples", verify=False)  # the former 1/N weighting
    wrapper = micro.callback.wrapper
    assert wrapper.rule == ("shifted_label_tokens" if module == "hf_loss" else "label_tokens")
    assert wrapper.verified and wrapper.refused_reason is None and is_micro_batching(micro.module)
    assert (micro.callback.pending_before == [True, False, False]
            and full.global_step == micro.global_step == 3)
    _assert_close(micro.first_grads, full.first_grads, rtol=1e-4, atol=1e-6)
    _assert_close(micro.params, full.params, rtol=1e-4, atol=1e-6)
    assert micro.losses == pytest.approx(full.losses, rel=1e-5)  # the returned loss is the batch's
    # the 0-token micro-batch: no NaN
    assert all(torch.isfinite(g).all() for g in micro.first_grads.values())
    new_error, old_error = _relative_difference(micro.first_grads,
                                                full.first_grads), _relative_difference(
        old.first_grads, full.first_grads)
    print(f"\n{module}: first-step gradient vs the plain step, relative L2: label-token weights "
          f"{new_error:.3g}, 1/N weights {old_error:.3g}")
    assert new_error < 1e-5 and old_error > 0.01


def test_padded_hugging_face_with_accumulation_and_the_check_runs_once():
    full = _fit_hf("hf_loss", None, accumulate=3)
    # micro-batches of 2: counts [25, 9], [24, 20], [11, 30]
    micro = _fit_hf("hf_loss", 2, accumulate=3)
    assert micro.global_step == full.global_step == 1
    _assert_close(micro.first_grads, full.first_grads, rtol=1e-4, atol=1e-6)
    _assert_close(micro.params, full.params, rtol=1e-4, atol=1e-6)
    # the pair and its two micro-batches, on the first batch only, on the check's copy of the module
    assert micro.module.seen.no_grad_calls == 3 and micro.module.no_grad_calls == 0
    assert micro.callback.pending_before == [True, False, False]


def test_no_label_tokens_runs_whole_and_one_counted_micro_batch_defers_the_check():
    # batch 0: no label token at all (the plain step runs; its loss is 0/0 but no gradient is NaN);
    # batch 1: one row with labels (its loss is the batch's; nothing to compare: the check waits);
    # batch 2: three rows with labels, one without: checked, micro-batched
    lengths = (1, 1, 1, 1, 1, 1, 6, 1, 3, 5, 1, 9)
    full = _fit_hf("hf_loss", None, lengths=lengths)
    micro = _fit_hf("hf_loss", 1, lengths=lengths)
    assert full.module.sizes == [4, 4, 4]
    assert micro.module.sizes == [4, 1, 1, 1, 1]  # rows without labels are not run
    assert micro.callback.pending_before == [True, True, True] and micro.callback.wrapper.verified
    assert micro.module.seen.no_grad_calls == 3 and micro.module.no_grad_calls == 0
    _assert_close(micro.params, full.params, rtol=1e-4, atol=1e-6)
    assert all(torch.isfinite(p).all() for p in micro.params.values())


def test_bf16_autocast_passes_the_check():
    full = _fit_hf("hf_loss", None, precision="bf16-mixed")
    micro = _fit_hf("hf_loss", 1, precision="bf16-mixed")
    assert micro.callback.wrapper.verified and micro_batching_refusal(micro.module) is None
    assert _relative_difference(micro.first_grads, full.first_grads) < 2e-2


# --- refusals -------------------------------------------------------------------------------------


SMALL = dict(vocab_size=64, n_layer=2, n_head=2, d_model=32)


class SumLossGPT(LitGPT):
    """A LitGPT whose loss is a sum over tokens (``reduction="sum"``): not a mean."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**SMALL, **kwargs)
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        if torch.is_grad_enabled():
            self.sizes.append(batch["input_ids"].shape[0])
        logits = self(batch["input_ids"])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
                               reduction="sum")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class RandomLossGPT(SumLossGPT):
    """A mean loss times noise drawn in ``training_step``: the check cannot verify it."""

    def training_step(self, batch, batch_idx):
        if torch.is_grad_enabled():
            self.sizes.append(batch["input_ids"].shape[0])
        logits = self(batch["input_ids"])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
        return loss * (1 + 0.5 * torch.rand(()))


class BatchNormLM(pl.LightningModule):
    """Embedding, batch norm over the batch's tokens, linear head: samples mix through the
    statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 64)
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        if torch.is_grad_enabled():
            self.sizes.append(batch["input_ids"].shape[0])
        x = self.embed(batch["input_ids"])
        x = self.norm(x.reshape(-1, 16)) * 4
        return F.cross_entropy(self.head(x), batch["labels"].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit_refused(cls, micro: int | None):
    torch.manual_seed(0)
    module = cls()
    callback = Grads(MicroBatching(micro) if micro else None)
    trainer = make_trainer([callback], max_steps=-1, max_epochs=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=SyntheticTokenDataModule(4, 16, 16, vocab_size=64))
    # parameters and buffers
    state = {n: t.detach().clone() for n, t in module.state_dict().items()}
    refused = [w for w in caught if issubclass(w.category, MicroBatchingRefusedWarning)]
    return module, state, callback, refused, trainer


@pytest.mark.parametrize("cls, expected", [
    (SumLossGPT, r"the loss is not a mean over label tokens .*a sum, reduction='sum'"),
    (RandomLossGPT, r"cannot verify that the loss is a mean over .*draws random numbers"),
    (BatchNormLM,
     r"the loss is not a mean over .*or the batch norm in norm normalises over fewer samples"),
])
def test_refused_loss_trains_as_without_micro_batching(cls, expected):
    full_module, full_state, _, _, _ = _fit_refused(cls, None)
    module, state, callback, refused, trainer = _fit_refused(cls, 1)
    reason = micro_batching_refusal(module)
    assert reason is not None and callback.wrapper.refused_reason == reason
    assert re.search(expected, reason), reason
    assert len(refused) == 1 and reason in str(refused[0].message)
    assert not is_micro_batching(module) and "training_step" not in module.__dict__
    assert "optimizer_zero_grad" not in module.__dict__ and "log" not in module.__dict__
    # every batch whole, the first one included
    assert module.sizes == full_module.sizes == [4, 4, 4, 4]
    assert callback.pending_before == [True, False, False, False]
    # bit for bit: parameters, batch-norm statistics (the check restores buffers) and the noise of
    # RandomLossGPT (the check drew its random numbers from a forked generator)
    assert state.keys() == full_state.keys()
    for name in full_state:
        assert torch.equal(state[name], full_state[name]), name
    # the refusal is the answer from then on; verify=False overrides it
    ok, why = MicroBatching(1).is_applicable(trainer, module)
    assert not ok and why == f"refused by its first-step check: {reason}"
    assert (MicroBatching(1, verify=False).apply(trainer, module).applied
            and micro_batching_refusal(module) is None)


# --- dropout is off for the check only ------------------------------------------------------------


class DropoutGPT(LitGPT):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


# F.dropout on the weights / dropout_p of sdpa
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_dropout_is_off_for_the_check_and_the_run_is_unchanged(attention):
    def fit(verify):
        torch.manual_seed(0)
        module = DropoutGPT(**SMALL, dropout=0.2, attention_dropout=0.2, attention=attention)
        callback = Grads(MicroBatching(1, verify=verify))
        make_trainer([callback], max_steps=-1, max_epochs=1).fit(
            module, datamodule=SyntheticTokenDataModule(4, 16, 12, vocab_size=64))
        return callback, {n: p.detach().clone() for n, p in module.named_parameters()}

    checked, checked_params = fit(True)
    unchecked, unchecked_params = fit(False)
    assert checked.wrapper.verified and checked.wrapper.refused_reason is None
    assert not unchecked.wrapper.verified and unchecked.pending_before == [False] * 3
    # the check drew no random number from the run's stream: the dropout masks, hence the run, are
    # the same
    for name in checked_params:
        assert torch.equal(checked_params[name], unchecked_params[name]), name


# --- DDP ------------------------------------------------------------------------------------------


def _ddp_fit(micro: int | None) -> dict:
    torch.manual_seed(0)
    module = HFLossLM()
    callback = Grads(MicroBatching(micro) if micro else None)
    trainer = make_trainer([callback], max_steps=-1, max_epochs=1, strategy="ddp", devices=2)
    # rank 0 gets rows 0, 2, 4, 6 (DistributedSampler, no shuffle): its first batch ends with a
    # 0-label row; rank 1's first batch has a 0-label row (row 3) in the middle
    lengths = (3, 24, 10, 1, 24, 2, 1, 5, 1, 12, 24, 8, 7, 7, 9, 1)
    trainer.fit(module, DataLoader(PaddedTokens("inputs", lengths), batch_size=4))
    return {
        "rank": trainer.global_rank,
        "params": {n: p.detach().clone() for n, p in module.named_parameters()},
        "global_step": trainer.global_step,
        "verified": bool(callback.wrapper.verified) if callback.wrapper else None,
    }


@pytest.mark.ddp
def test_ddp_padded_hugging_face_equals_full_batch(tmp_path):
    results = launch_ddp_script(Path(__file__).resolve(), tmp_path, 300)
    full, micro = results["full"], results["micro"]
    assert micro["global_step"] == full["global_step"] == 2 and micro["verified"]
    _assert_close(micro["params"], full["params"], rtol=1e-4, atol=1e-6)


if __name__ == "__main__":
    ddp_full_and_micro(_ddp_fit, sys.argv[1])
