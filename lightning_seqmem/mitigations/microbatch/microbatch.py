"""Micro-batching: run each training batch as several smaller ones, accumulating their gradients.

The activations of a step are those of one micro-batch, so the batch-proportional part of the peak
(``B * (a*L + b*L^2)``) drops to ``micro_batch_size / B`` of itself, while the learning dynamics stay
those of the full batch: the same batches in the same order (no sample dropped or repeated), the
same number of optimizer steps, ``global_step`` and LR schedule, and gradients equal to the
full-batch ones up to rounding. It takes effect at the next ``training_step``, mid-epoch included:
neither ``trainer.accumulate_grad_batches`` nor the dataloader is touched (see DESIGN.md for why
changing either mid-epoch is wrong).

Weighting (what makes the split exact). ``training_step`` returns a *mean*; the split reproduces it
by weighting micro-batch ``i``'s loss by its share ``c_i / C`` of what that mean is over
(:func:`micro_batch_counts`, ``weighting="auto"``):

* a mapping batch with an integer ``"labels"`` tensor (Hugging Face models: their loss is the mean
  over label tokens ``!= -100``, the ``ignore_index``): ``c_i`` = its label tokens. Where the labels
  equal ``input_ids`` at every counted position (or there are no ``input_ids``), the loss shifts
  them: ``ForCausalLMLoss`` of transformers 5.x pads the labels with -100 and drops their first
  position, so it averages over ``labels[..., 1:] != -100``, and that is what is counted
  (``"shifted_label_tokens"``). Labels that differ from the inputs (already the next tokens, as
  :class:`~lightning_seqmem.reference.demo.SyntheticTokenDataModule` gives them; seq2seq targets) are counted
  whole (``"label_tokens"``); 1-D labels (a class per sample) count one per sample not ignored.
  Weighting samples ``1/N`` instead changed the first step's gradient of a tiny Llama on a padded
  batch by 95% (relative L2 norm; 1.2e-7 with label tokens: tests/test_microbatch_weighting.py).
* any other batch: ``c_i`` = its samples ``n_i`` (``"samples"``, ``n_i / N``): the loss
  is assumed to be a mean over samples, or over equally many elements per sample.

A micro-batch with ``c_i = 0`` (all its labels ignored; its Hugging Face loss would be 0/0 = NaN)
is not run at all: it has nothing the loss counts, so no gradient changes (under DDP nothing changes
either: only non-final micro-batches are ever left out, and the final one is the last with
``c_i > 0``). A batch with ``C = 0`` is not split: the plain step runs, as without micro-batching.
Passing ``num_items_in_batch=C`` to a Hugging Face model with weights 1 would be exact too, but
only where the user's ``training_step`` passes such keyword arguments through to the model, which
a wrapper cannot make it do; weights ask nothing of ``training_step``. ``weighting`` can be forced
(``"samples"``, ``"label_tokens"``, ``"shifted_label_tokens"``).

Verification (``verify=True``, the default). The weights are exact only for a loss that is such a
mean, so the first batch split is checked before any gradient is touched: ``training_step`` runs
without gradient on the first two micro-batches with ``c_i > 0`` and on the samples from the first
to the second of them together (a sub-batch, usually ``2 * micro_batch_size`` samples, so the check
never needs the whole batch's memory; no backward; once per :meth:`MicroBatching.apply`), and the
loss of the pair must equal the
``c_i``-weighted mean of theirs within ``rtol`` 1e-3 (2e-2 under a 16-bit autocast or with 16-bit
parameters or loss). A sum (``reduction="sum"``) is off by a factor of about 2 and is refused (no rescaling is
attempted: a sum's right weights are 1, but what else the loss is cannot be told from its values), as is
any loss normalised by something other than what is counted, or layers that mix samples (batch
norm). A refusal puts the original ``training_step`` back and runs the batch unsplit (the plain
step: the same gradient as a run without micro-batching), warns
(:class:`MicroBatchingRefusedWarning`) and keeps the reason: :func:`micro_batching_refusal` returns
it, the wrapper's ``refused_reason`` holds it, and :meth:`MicroBatching.is_applicable` answers it
from then on (``verify=False`` skips the check and overrides an earlier refusal). A loss that is not
finite, or fewer than two micro-batches with ``c_i > 0``, defers the check to the next batch split.

The check's forwards run on the check's own copy of the module
(:func:`~lightning_seqmem.mitigations.microbatch.microbatch_check.check_copy`: its parameters shared, its
buffers, attribute tensors and every other attribute copied), so whatever ``training_step`` does
besides its loss (a user's sample counter, a ``torchmetrics`` update, batch-norm statistics) lands
on the copy and is dropped with it: the user's ``training_step`` runs exactly once per sample. They
run with dropout off (the ``torch.nn.functional`` and ``torch`` dropouts return their input and
``dropout_p`` of ``scaled_dot_product_attention`` and ``multi_head_attention_forward`` is 0, through
a ``TorchFunctionMode``; ``module.eval()`` is not used: it would change batch norm), inside
``torch.random.fork_rng`` (the step then draws the random numbers it would have drawn without the
check), with ``self.log``/``self.log_dict`` silenced. A module that cannot be copied so is refused,
saying why (``verify=False`` skips the check). When the losses disagree, the pair
is run again: if its loss changed, the step is random in a way the check cannot turn off (noise
drawn in ``training_step``, a dropout outside ``torch``, such as flash-attn's), the loss cannot be
verified, and the rung is refused, saying so. The check's memory (the copies of the buffers and
attribute tensors, a no-grad forward of the pair) falls in that step's measured peak:
:func:`micro_batching_check_pending` tells, before a step, whether it will run the check. Under
DDP each rank checks its own batch and decides alone (a collective would hang when one rank's batch
is not split); either way each rank's gradient is exact, and each runs one synced backward per
batch, so ranks that decide differently still all-reduce correctly; only their memory differs.

Mechanism (automatic optimization; Lightning's ``Closure.closure`` runs ``training_step``, then
``zero_grad`` on the first batch of an accumulation window, then ``backward`` of the returned loss):

1. ``training_step`` of the module *instance* is replaced by a wrapper (the class is untouched;
   :meth:`MicroBatching.remove` restores the original). The wrapper splits the batch with
   :func:`split_batch` into ``k`` micro-batches of ``n_1 .. n_k`` samples (``N`` in all) and counts
   ``c_1 .. c_k`` (``C`` in all).
2. On the first batch of an accumulation window (``batch_idx % accumulate_grad_batches == 0``,
   Lightning's own test) it zeroes the gradients itself, through the module's
   ``optimizer_zero_grad`` hook, and replaces that hook on the instance with a one-shot no-op, so
   that Lightning's ``zero_grad``, which comes after ``training_step``, does not erase the
   gradients of the first micro-batches. The ``on_before_zero_grad`` hooks still run at
   Lightning's usual point.
3. Each micro-batch with ``c_i > 0`` but the last: the original ``training_step``, its loss scaled
   by ``c_i / C / accumulate_grad_batches`` (Lightning divides the returned loss by
   ``accumulate_grad_batches``; these losses never reach Lightning, so the wrapper divides them
   itself), and ``trainer.strategy.backward(scaled, optimizer)``: the precision plugin scales the
   loss (``GradScaler`` under ``16-mixed``) and the ``on_before_backward``/``on_after_backward``
   hooks run, once per micro-batch as they run once per batch under ``accumulate_grad_batches``.
   Under DDP these backward calls run inside ``DistributedDataParallel.no_sync()``, so gradients
   are all-reduced once per optimizer step. (With torch 2.13 the reducer is armed only in DDP's
   ``_post_forward``, after ``training_step`` returns, so they would not all-reduce anyway;
   ``no_sync`` keeps that true whatever DDP does inside its forward.) Under FSDP2 (``fully_shard``
   through Lightning's ``ModelParallelStrategy``) they run with
   ``FSDPModule.set_requires_gradient_sync(False)`` on every sharded module instead: each rank
   accumulates its unsharded gradients locally (one more unsharded copy of each block's gradients
   held until the last micro-batch) and the reduce-scatter runs once, in the last backward.
4. The last micro-batch with ``c_i > 0`` is not backpropagated by the wrapper: its scaled loss is
   returned, and Lightning backpropagates it (with the DDP gradient sync).

What ``training_step`` returns: the last micro-batch's output, its ``"loss"`` replaced by
``scaled_last + sum(scaled_i for the others).detach()``. Its gradient is that of the last
micro-batch alone (the others are constants, already backpropagated), its value is the
``c_i``-weighted mean of the micro-batch losses, i.e. the full-batch loss: the ``outputs["loss"]``
seen by ``on_train_batch_end`` and the progress bar are what they would be without micro-batching.
Other keys of a dict output come from the last micro-batch.

Caveats:

* The loss must be a mean over what ``weighting`` counts (see above). The check catches a wrong
  scale (a sum) surely, but a wrong choice of weights only as far as the two micro-batch losses
  differ: at initialisation every token's loss is about ``ln(vocab)``, so a per-sample mean of
  per-sample token means (whose exact weights are samples) passes a check weighted by tokens. For
  such a loss over labelled tokens, pass ``weighting="samples"``. A loss plus a term that is not a
  mean over the same items (a per-batch auxiliary loss) is exact only when that term is the same
  for every micro-batch.
* Batch norm (statistics of a smaller batch) is refused by the check when it changes the loss
  beyond the tolerance; with ``verify=False`` it breaks the equality with the full-batch run. So
  does dropout (a different random stream); the memory saving remains.
* ``self.log`` inside ``training_step`` runs once per micro-batch: a value logged ``on_step`` shows
  the last micro-batch's, one logged ``on_epoch`` is averaged over micro-batches weighted by the
  ``batch_size`` passed to ``self.log`` (pass ``batch_size=`` to weight by micro-batch size).
* Only the training step is split; validation and prediction batches are not.
* Under DDP with ``find_unused_parameters=True``, unused parameters are found from the last
  micro-batch's graph: a parameter used by an earlier micro-batch only (data-dependent routing)
  would be treated as unused. Not tested with ``static_graph=True``.
* Supported: automatic optimization on a single device or DDP (``ddp``, ``ddp_spawn``, ...).
  Lightning's ``DeepSpeedStrategy`` at ZeRO stages 0-2 too: the earlier micro-batches' backwards run
  with the engine's ``set_gradient_accumulation_boundary(False)`` (its documented way to run several
  backwards per ``engine.step()``), so gradients are reduced once, in the last one; DeepSpeed's own
  division of the loss by ``gradient_accumulation_steps`` applies to every micro-batch as to the
  whole batch (the updates equal the whole batch's to 4e-6, tests/test_deepspeed.py). Manual
  optimization, ZeRO stage 3 (a split step's update measured 0.96 relative off the whole batch's;
  the cause in its gradient partitioning not traced),
  DeepSpeed's pipeline engine, FSDP1 and other model-parallel strategies are refused by
  :meth:`MicroBatching.is_applicable`, saying why.

Example:
    >>> import torch
    >>> from lightning_seqmem.mitigations.microbatch.microbatch_functional import split_batch
    >>> batch = {"input_ids": torch.zeros(5, 3, dtype=torch.long), "index": torch.arange(5), "tag": "x"}
    >>> parts = split_batch(batch, 2)
    >>> [p["input_ids"].shape[0] for p in parts], [p["index"].tolist() for p in parts], parts[2]["tag"]
    ([2, 2, 1], [[0, 1], [2, 3], [4]], 'x')
    >>> ids = torch.tensor([[5, 6, 7, 0], [5, 6, 0, 0], [5, 0, 0, 0]])
    >>> micro_batch_counts({"input_ids": ids, "labels": ids.masked_fill(ids == 0, -100)}, 1)
    ('shifted_label_tokens', [2, 1, 0])
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_seqmem.core.checks import check_int, is_a
from lightning_seqmem.measure.batch_shape import infer_batch_shape
from lightning_seqmem.mitigations.microbatch.microbatch_spec import SPEC
from lightning_seqmem.mitigations.base import CopyPlan, MitigationResult, Rung, RungContext, wrapping_strategy_refusal
from lightning_seqmem.mitigations.microbatch.microbatch_functional import (  # the functional twin, re-exported
    IGNORE_INDEX,
    WEIGHTINGS,
    is_deepspeed_engine,
    micro_batch_counts,
)
from lightning_seqmem.mitigations.microbatch.microbatch_step import (  # the wrapper, re-exported
    REFUSED_ATTRIBUTE,
    MicroBatchedTrainingStep,
    unwrap_training_step,
    wrapper_of,
    is_micro_batching,
    micro_batching_check_pending,
    micro_batching_refusal,
)

__all__ = ["MicroBatchRung", "MicroBatching"]

def _describe(pl_module: Any) -> str:
    wrapper = wrapper_of(pl_module)
    return f"micro_batch_size={wrapper.micro_batch_size}" if wrapper is not None else "off"


def _has_fsdp2(module: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, torch.nn.Module) and any(isinstance(m, FSDPModule) for m in module.modules())


def _dataloader_batch_size(trainer: Any) -> int | None:
    loader = getattr(trainer, "train_dataloader", None)
    size = getattr(loader, "batch_size", None)
    return size if isinstance(size, int) else None


def _deepspeed_stage(strategy: Any) -> Optional[int]:
    """The ZeRO stage of a ``DeepSpeedStrategy`` (its engine's, else its config's), None where unknown.

    Example:
        >>> from types import SimpleNamespace
        >>> _deepspeed_stage(SimpleNamespace(model=None, config={"zero_optimization": {"stage": 3}}))
        3
    """
    engine = getattr(strategy, "model", None)
    if engine is not None and hasattr(engine, "zero_optimization_stage"):
        return int(engine.zero_optimization_stage())
    stage = ((getattr(strategy, "config", None) or {}).get("zero_optimization") or {}).get("stage")
    return None if stage is None else int(stage)


class MicroBatching:
    """Policy: split every training batch into micro-batches of ``micro_batch_size`` samples.

    See the module docstring for the mechanism, the weighting, the first-step check and the
    caveats.

    Args:
        micro_batch_size: samples per micro-batch (the last one of a batch may be smaller).
            ``1`` gives the lowest peak, at the cost of the least parallel work per kernel.
        weighting: what the loss is a mean over, so what each micro-batch's loss is weighted by:
            ``"auto"`` (label tokens when the batch has integer ``"labels"``, shifted as Hugging
            Face's causal-LM loss shifts them when they are the inputs; samples otherwise),
            ``"samples"``, ``"label_tokens"`` or ``"shifted_label_tokens"``.
        verify: check on the first batch split that the loss is such a mean; refuse (and run
            the plain step) when it is not. ``False`` also overrides an earlier refusal.
        ignore_index: the label value the loss skips.

    Example:
        >>> MicroBatching(0)
        Traceback (most recent call last):
        ...
        ValueError: `micro_batch_size` must be an int >= 1, got 0
        >>> MicroBatching(weighting="tokens")
        Traceback (most recent call last):
        ...
        ValueError: `weighting` must be one of ('auto', 'samples', 'label_tokens', 'shifted_label_tokens'), got 'tokens'
    """

    name = "microbatch"

    def __init__(
        self, micro_batch_size: int = 1, weighting: str = "auto", verify: bool = True, ignore_index: int = IGNORE_INDEX
    ) -> None:
        self.micro_batch_size = check_int("micro_batch_size", micro_batch_size, accepted="an int >= 1")
        if weighting not in WEIGHTINGS:
            raise ValueError(f"`weighting` must be one of {WEIGHTINGS}, got {weighting!r}")
        if not isinstance(verify, bool):
            raise ValueError(f"`verify` must be a bool, got {verify!r}")
        self.weighting = weighting
        self.verify = verify
        self.ignore_index = check_int("ignore_index", ignore_index, minimum=-(2**63), accepted="an int")

    def _settings(self) -> tuple[int, str, bool, int]:
        return self.micro_batch_size, self.weighting, self.verify, self.ignore_index

    def is_applicable(self, trainer: Any, pl_module: Any, batch: Any = None) -> tuple[bool, str]:
        """``(True, what would change)`` or ``(False, reason)``.

        Args:
            trainer: the ``Trainer`` (its strategy and dataloader are checked).
            pl_module: the ``LightningModule``.
            batch: a training batch, to read the batch size from; without it the train
                dataloader's ``batch_size`` is used when known.
        """
        if not getattr(pl_module, "automatic_optimization", True):
            return False, "manual optimization (automatic_optimization=False): the module runs its own backward"
        refusal = micro_batching_refusal(pl_module)
        if refusal is not None and self.verify:
            return False, f"refused by its first-step check: {refusal}"
        strategy = trainer.strategy
        model = strategy.model
        deepspeed = is_a(strategy, "DeepSpeedStrategy")
        if getattr(strategy, "handles_gradient_accumulation", False) and not (
                deepspeed and (model is None or is_deepspeed_engine(model))):
            return False, f"{type(strategy).__name__} accumulates gradients itself"
        if deepspeed and model is not None and type(model).__name__ == "PipelineEngine":
            return False, "DeepSpeed's pipeline engine splits batches into micro-batches itself"
        if deepspeed and _deepspeed_stage(strategy) == 3:
            return False, ("under DeepSpeed ZeRO stage 3 a split step's update is not the whole batch's (measured "
                           "0.96 relative off on CPU, tests/test_deepspeed.py; the cause in ZeRO-3's gradient "
                           "partitioning is not traced); "
                           "lower the batch size and raise Trainer(accumulate_grad_batches=...), which DeepSpeed "
                           "runs as its gradient_accumulation_steps, or use ZeRO stage 1 or 2")
        fsdp2 = is_a(strategy, "ModelParallelStrategy") and _has_fsdp2(pl_module)
        if not is_a(strategy, "SingleDeviceStrategy", "DDPStrategy") and not fsdp2:
            return False, (f"strategy {type(strategy).__name__} not supported (single device, DDP, DeepSpeed and "
                           "ModelParallelStrategy with fully_shard (FSDP2) modules are)")
        if model is not None and model is not pl_module and not isinstance(model, DistributedDataParallel) and not (
                deepspeed and is_deepspeed_engine(model)):
            return False, f"the strategy wraps the module in {type(model).__name__} (not DistributedDataParallel)"
        wrapper = wrapper_of(pl_module)
        if wrapper is not None and (
            wrapper.micro_batch_size, wrapper.weighting, wrapper.verify, wrapper.ignore_index
        ) == self._settings():
            return False, f"already micro-batching with micro_batch_size={self.micro_batch_size}"
        if batch is not None:
            try:
                batch_size: int | None = infer_batch_shape(batch)[0]
                micro_batch_counts(batch, self.micro_batch_size, self.weighting, self.ignore_index)
            except ValueError as err:
                return False, f"cannot split the batch: {err}"
        else:
            batch_size = _dataloader_batch_size(trainer)
        if batch_size is not None and batch_size <= self.micro_batch_size:
            return False, self._unsplit(batch_size)
        size = "?" if batch_size is None else str(batch_size)
        return True, f"split batches of {size} into micro-batches of {self.micro_batch_size}"

    def _unsplit(self, batch_size: int) -> str:
        size = self.micro_batch_size
        return f"batch size {batch_size} is already at most micro_batch_size={size}"

    def unsplit_reason(self, trainer: Any, pl_module: Any, batch: Any = None) -> str | None:
        """Why ``batch`` (else the dataloader's batch size) has nothing to split where nothing else
        refuses micro-batching (its batches would run whole, as without it), else None."""
        applicable, reason = self.is_applicable(trainer, pl_module, batch)
        if applicable:
            return None
        try:
            size = _dataloader_batch_size(trainer) if batch is None else infer_batch_shape(batch)[0]
        except ValueError:
            return None
        return reason if size is not None and reason == self._unsplit(size) else None

    def apply(self, trainer: Any, pl_module: Any, batch: Any = None,
              unsplit_ok: bool = False) -> MitigationResult:
        """Wrap ``pl_module.training_step``; takes effect at the next training step.

        Call it outside ``training_step`` (e.g. from ``on_train_batch_start`` or before ``fit``).
        A second call with the same settings changes nothing; with others it changes them. The
        first batch split is checked (``verify``): a refusal then shows in
        :func:`micro_batching_refusal`, not in the result returned here. ``unsplit_ok``: wrap it
        even where this batch has nothing to split (a rank of a run whose other ranks' batches do:
        its batches of at most ``micro_batch_size`` samples run whole, as without it).
        """
        before = _describe(pl_module)
        applicable, reason = self.is_applicable(trainer, pl_module, batch)
        unsplit = not applicable and unsplit_ok and self.unsplit_reason(trainer, pl_module, batch)
        if unsplit:
            reason = (f"{reason}: its batches run whole, larger ones are split into micro-batches "
                      f"of {self.micro_batch_size}")
        elif not applicable:
            return MitigationResult(self.name, applied=False, detail=reason, before=before, after=before)
        pl_module.__dict__.pop(REFUSED_ATTRIBUTE, None)  # verify=False overrides an earlier refusal
        wrapper = wrapper_of(pl_module)
        if wrapper is not None:
            if (wrapper.weighting, wrapper.ignore_index) != (self.weighting, self.ignore_index):
                wrapper.verified = False  # other weights: check them again
            wrapper.micro_batch_size, wrapper.weighting, wrapper.verify, wrapper.ignore_index = self._settings()
        else:
            pl_module.training_step = MicroBatchedTrainingStep(pl_module, *self._settings())
        after = _describe(pl_module)
        detail = f"{reason} ({before} -> {after})"
        return MitigationResult(self.name, applied=True, detail=detail, before=before, after=after)

    def remove(self, pl_module: Any) -> MitigationResult:
        """Restore the original ``training_step`` (call it between training steps)."""
        before = _describe(pl_module)
        wrapper = wrapper_of(pl_module)
        if wrapper is None:
            return MitigationResult(self.name, applied=False, detail="not micro-batching", before=before, after=before)
        unwrap_training_step(pl_module, wrapper)
        detail = "restored the original training_step"
        return MitigationResult(self.name, applied=True, detail=detail, before=before, after="off")

    def __repr__(self) -> str:
        extra = "".join(
            f", {name}={value!r}" for name, value, default in
            (("weighting", self.weighting, "auto"), ("verify", self.verify, True), ("ignore_index", self.ignore_index, IGNORE_INDEX))
            if value != default
        )
        return f"{type(self).__name__}(micro_batch_size={self.micro_batch_size}{extra})"


class MicroBatchRung(Rung):
    """The ladder's ``"microbatch"`` rung: :class:`MicroBatching` into micro-batches of one sample
    behind the :class:`~lightning_seqmem.mitigations.base.Rung` protocol. It can be removed (the
    original ``training_step`` comes back), its first split step checks that the loss is a mean
    (:func:`micro_batching_check_pending`, :func:`micro_batching_refusal`), and in a dry run it
    changes the step, not the copy: micro-batches of ``micro_batch_size``.

    Example:
        >>> rung = MicroBatchRung()
        >>> plan = CopyPlan()
        >>> rung.apply_to_copy(torch.nn.Linear(2, 2), plan)
        >>> plan.micro_batch_size, rung.is_on(torch.nn.Linear(2, 2))
        (1, False)
    """

    spec = SPEC

    def __init__(self, policy: MicroBatching | None = None) -> None:
        self.policy = policy or MicroBatching(1)

    def is_applicable(self, ctx: RungContext) -> tuple[bool, str]:
        if ctx.batch_size is not None and ctx.batch_size <= self.policy.micro_batch_size:
            return False, f"batch size {ctx.batch_size}: nothing to split"
        return self.policy.is_applicable(ctx.trainer, ctx.pl_module, ctx.batch)

    def noop(self, ctx: RungContext) -> str | None:
        """Where this rank's batch has at most ``micro_batch_size`` samples and nothing else refuses
        it: it would run whole, as without the rung (a rank may take it where others split)."""
        return self.policy.unsplit_reason(ctx.trainer, ctx.pl_module, ctx.batch)

    def apply(self, ctx: RungContext) -> MitigationResult:
        return self.policy.apply(ctx.trainer, ctx.pl_module, ctx.batch, unsplit_ok=ctx.noop_ok)

    def remove(self, ctx: RungContext) -> MitigationResult:
        return self.policy.remove(ctx.pl_module)

    def is_on(self, module: Any) -> bool:
        return is_micro_batching(module)

    def apply_to_copy(self, copy: Any, plan: CopyPlan) -> None:
        plan.micro_batch_size = self.policy.micro_batch_size

    def copy_refusal(self, ctx: RungContext) -> str | None:
        """A dry run changes the step, not the copy: it models micro-batching on any batch (one of
        at most ``micro_batch_size`` samples runs whole, as the wrapper runs it); refused only where
        the module itself refuses it (manual optimization, its first-step check)."""
        if not getattr(ctx.pl_module, "automatic_optimization", True):
            return "manual optimization runs its own backward, which cannot be split"
        refusal = micro_batching_refusal(ctx.pl_module)
        if refusal is None or not self.policy.verify:
            return None
        return f"refused by its first-step check: {refusal}"

    def strategy_refusal(self, trainer: Any) -> str | None:
        return wrapping_strategy_refusal(trainer)

    def setup_refusal(self, trainer: Any, pl_module: Any) -> str | None:
        if not getattr(pl_module, "automatic_optimization", True):
            return "manual optimization runs its own backward, which cannot be split"
        return self.strategy_refusal(trainer)

    def check_pending(self, module: Any, batch: Any = None) -> bool:
        return micro_batching_check_pending(module, batch)

    def refusal(self, module: Any) -> str | None:
        return micro_batching_refusal(module)

RUNG = MicroBatchRung
"""This folder's rung (what :data:`~lightning_seqmem.core.rungs.RUNG_FOLDERS` names)."""
