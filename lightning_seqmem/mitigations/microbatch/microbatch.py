"""Micro-batching: run each training batch as several smaller ones, accumulating their gradients.

The step holds one micro-batch's activations: the peak's part ``B * (a*L + b*L^2)`` scales by
``micro_batch_size / B``; optimizer steps, ``global_step`` and LR schedule stay the full batch's,
gradients equal up to rounding. It acts from the next ``training_step``, mid-epoch too;
``accumulate_grad_batches`` and the dataloader are untouched (DESIGN.md says why).

Weighting. ``training_step`` returns a *mean*; micro-batch ``i``'s loss is weighted by its share
``c_i / C`` of what that mean is over (:func:`micro_batch_counts`; no ``num_items_in_batch``
needed), one with ``c_i = 0`` skipped (under DDP, unless last), a batch with ``C = 0`` unsplit:

* a mapping batch with integer ``"labels"`` (Hugging Face: the mean over label tokens ``!= -100``):
  its label tokens, of ``labels[..., 1:]`` where the labels equal ``input_ids`` at every counted
  position or there are no ``input_ids`` (``"shifted_label_tokens"``: ``ForCausalLMLoss`` shifts
  them), else all (``"label_tokens"``: already the next tokens, or seq2seq targets); 1-D labels
  count the samples not ignored. Weighting samples instead moved a tiny Llama's first gradient on a
  padded batch by 95% (tests/test_microbatch_weighting.py).
* any other batch: its samples (``"samples"``: a mean over samples, or equally many elements each).

First-step check (``verify=True``): on the first batch split, before any backward, ``training_step``
runs gradient-free on the first two counted micro-batches (``c_i > 0``) and on their samples
together; that loss must equal the ``c_i``-weighted mean of theirs within ``rtol`` 1e-3 (2e-2 with
16-bit autocast, parameters or loss), else (a sum, batch norm, ...) it refuses, running the batch
unsplit (:class:`MicroBatchingRefusedWarning`; why: :func:`micro_batching_refusal`). A non-finite
loss or under two counted micro-batches defers it. Its forwards run on :func:`.check_copy` in
``fork_rng``, dropout off by a ``TorchFunctionMode`` (``eval()`` would change batch norm),
``self.log`` silenced; a loss that changes when rerun (flash-attn's dropout) is refused. Its memory
is in that step's peak (:func:`micro_batching_check_pending`). Under DDP, ranks decide alone.

Mechanism: a wrapper of the instance's ``training_step`` (:meth:`MicroBatching.remove` restores it)
splits the batch (:func:`split_batch`). On an accumulation window's first batch it zeroes the
gradients itself and skips the next ``optimizer_zero_grad`` (it would erase earlier micro-batches'
gradients). Each counted micro-batch but the last runs ``training_step``, scales its loss by
``c_i / C / accumulate_grad_batches`` and calls ``trainer.strategy.backward`` without gradient sync
(DDP's ``no_sync()``; FSDP2's ``set_requires_gradient_sync(False)``, one more unsharded gradient
copy till the last backward; DeepSpeed's ``set_gradient_accumulation_boundary(False)``). The last's
scaled loss goes to Lightning's synced backward as ``scaled_last + sum(others).detach()`` (the
full-batch loss, as logged); a dict output's other keys are the last micro-batch's.

Caveats: the check catches a wrong scale surely, wrong weights only as far as the two losses differ
(at initialisation a per-sample mean of token means passes a token-weighted check: pass
``weighting="samples"``); a per-batch auxiliary loss is exact only if equal across micro-batches;
``self.log`` runs per micro-batch (pass ``batch_size=``); only training batches are split; under DDP
with ``find_unused_parameters=True`` a parameter only an earlier micro-batch used counts as unused.
Supported: single device, DDP, FSDP2, DeepSpeed ZeRO 0-2 (updates equal the whole batch's to 4e-6,
tests/test_deepspeed.py). Refused, saying why: manual optimization, ZeRO stage 3 (an update
0.83-0.96 relative off), DeepSpeed's pipeline engine, FSDP1 and other model-parallel strategies.

Example:
    >>> import torch
    >>> from lightning_seqmem.mitigations.microbatch.microbatch_functional import split_batch
    >>> batch = {"input_ids": torch.zeros(5, 3, dtype=torch.long), "index": torch.arange(5),
    ...          "tag": "x"}
    >>> parts = split_batch(batch, 2)
    >>> [len(p["input_ids"]) for p in parts], [p["index"].tolist() for p in parts], parts[2]["tag"]
    ([2, 2, 1], [[0, 1], [2, 3], [4]], 'x')
    >>> ids = torch.tensor([[5, 6, 7, 0], [5, 6, 0, 0], [5, 0, 0, 0]])
    >>> micro_batch_counts({"input_ids": ids, "labels": ids.masked_fill(ids == 0, -100)}, 1)
    ('shifted_label_tokens', [2, 1, 0])
"""

from __future__ import annotations

from typing import Any, Optional

from torch.nn.parallel import DistributedDataParallel

from lightning_seqmem.core.checks import check_int, is_a
from lightning_seqmem.measure.batch_shape import infer_batch_shape
from lightning_seqmem.mitigations.microbatch.microbatch_spec import SPEC
from lightning_seqmem.mitigations.base import (CopyPlan, MitigationResult, Rung, RungContext,
                                               fsdp2_modules, wrapping_strategy_refusal)
from lightning_seqmem.mitigations.microbatch.microbatch_functional import (
    IGNORE_INDEX,
    check_weighting,
    is_deepspeed_engine,
    micro_batch_counts,
)
from lightning_seqmem.mitigations.microbatch.microbatch_step import (
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


def _manual_refusal(pl_module: Any) -> Optional[str]:
    """Why a module with manual optimization cannot be micro-batched, or None (automatic)."""
    if getattr(pl_module, "automatic_optimization", True):
        return None
    return "manual optimization runs its own backward, which cannot be split"


def _dataloader_batch_size(trainer: Any) -> int | None:
    loader = getattr(trainer, "train_dataloader", None)
    size = getattr(loader, "batch_size", None)
    return size if isinstance(size, int) else None


def _deepspeed_stage(strategy: Any) -> Optional[int]:
    """The ZeRO stage of a ``DeepSpeedStrategy`` (its engine's, else its config's), or None.

    Example:
        >>> from types import SimpleNamespace
        >>> config = {"zero_optimization": {"stage": 3}}
        >>> _deepspeed_stage(SimpleNamespace(model=None, config=config))
        3
    """
    engine = getattr(strategy, "model", None)
    if engine is not None and hasattr(engine, "zero_optimization_stage"):
        return int(engine.zero_optimization_stage())
    stage = ((getattr(strategy, "config", None) or {}).get("zero_optimization") or {}).get("stage")
    return None if stage is None else int(stage)


class MicroBatching:
    """Policy: split each training batch into micro-batches of ``micro_batch_size`` samples (``1``:
    lowest peak, least parallel work per kernel), each loss weighted by what it is a mean over
    (``weighting``: ``"auto"`` or a kind of *Weighting*). ``verify``: the *First-step check*
    (``False`` also overrides an earlier refusal); ``ignore_index``: the label the loss skips.

    Example:
        >>> MicroBatching(0)
        Traceback (most recent call last):
        ...
        ValueError: `micro_batch_size` must be an int >= 1, got 0
        >>> MicroBatching(weighting="tokens")  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        ValueError: `weighting` must be one of ('auto', 'samples', 'label_tokens',
        'shifted_label_tokens'), got 'tokens'
    """

    name = "microbatch"

    def __init__(self, micro_batch_size: int = 1, weighting: str = "auto", verify: bool = True,
                 ignore_index: int = IGNORE_INDEX) -> None:
        self.micro_batch_size = check_int("micro_batch_size", micro_batch_size,
                                          accepted="an int >= 1")
        self.weighting = check_weighting(weighting)
        if not isinstance(verify, bool):
            raise ValueError(f"`verify` must be a bool, got {verify!r}")
        self.verify = verify
        self.ignore_index = check_int("ignore_index", ignore_index, minimum=-(2**63),
                                      accepted="an int")

    def _settings(self) -> tuple[int, str, bool, int]:
        return self.micro_batch_size, self.weighting, self.verify, self.ignore_index

    def check_refusal(self, pl_module: Any) -> Optional[str]:
        """Why the first-step check refused ``pl_module`` (unless ``verify=False``), or None."""
        refusal = micro_batching_refusal(pl_module)
        if refusal is None or not self.verify:
            return None
        return f"refused by its first-step check: {refusal}"

    def is_applicable(self, trainer: Any, pl_module: Any, batch: Any = None) -> tuple[bool, str]:
        """``(True, what would change)`` or ``(False, why)``, on ``batch`` (else the loader's)."""
        if not getattr(pl_module, "automatic_optimization", True):
            return False, ("manual optimization (automatic_optimization=False): the module runs "
                           "its own backward")
        refusal = self.check_refusal(pl_module)
        if refusal is not None:
            return False, refusal
        strategy = trainer.strategy
        model = strategy.model
        deepspeed = is_a(strategy, "DeepSpeedStrategy")
        if getattr(strategy, "handles_gradient_accumulation", False) and not (
                deepspeed and (model is None or is_deepspeed_engine(model))):
            return False, f"{type(strategy).__name__} accumulates gradients itself"
        if deepspeed and model is not None and type(model).__name__ == "PipelineEngine":
            return False, "DeepSpeed's pipeline engine splits batches into micro-batches itself"
        if deepspeed and _deepspeed_stage(strategy) == 3:
            return False, ("under DeepSpeed ZeRO stage 3 a split step's update is not the whole "
                           "batch's (measured 0.83-0.96 relative off on CPU, "
                           "tests/test_deepspeed.py; the cause in ZeRO-3's gradient partitioning "
                           "is not traced); lower the batch size and raise "
                           "Trainer(accumulate_grad_batches=...), which DeepSpeed runs as its "
                           "gradient_accumulation_steps, or use ZeRO stage 1 or 2")
        fsdp2 = is_a(strategy, "ModelParallelStrategy") and bool(fsdp2_modules(pl_module))
        if not is_a(strategy, "SingleDeviceStrategy", "DDPStrategy") and not fsdp2:
            return False, (f"strategy {type(strategy).__name__} not supported (single device, "
                           "DDP, DeepSpeed and ModelParallelStrategy with fully_shard (FSDP2) "
                           "modules are)")
        if (model is not None and model is not pl_module
                and not isinstance(model, DistributedDataParallel)
                and not (deepspeed and is_deepspeed_engine(model))):
            return False, (f"the strategy wraps the module in {type(model).__name__} (not "
                           "DistributedDataParallel)")
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
        """Why ``batch`` (or the loader's) has nothing to split if nothing else refuses, or None."""
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
        """Wrap ``pl_module.training_step`` (call it outside ``training_step``); called again with
        other settings, it changes them. ``unsplit_ok``: wrap it even where this batch has nothing
        to split (other ranks' do; batches of at most ``micro_batch_size`` run whole)."""
        before = _describe(pl_module)
        applicable, reason = self.is_applicable(trainer, pl_module, batch)
        unsplit = not applicable and unsplit_ok and self.unsplit_reason(trainer, pl_module, batch)
        if unsplit:
            reason = (f"{reason}: its batches run whole, larger ones are split into micro-batches "
                      f"of {self.micro_batch_size}")
        elif not applicable:
            return MitigationResult(self.name, applied=False, detail=reason, before=before,
                                    after=before)
        pl_module.__dict__.pop(REFUSED_ATTRIBUTE, None)  # verify=False overrides an earlier refusal
        wrapper = wrapper_of(pl_module)
        if wrapper is not None:
            if (wrapper.weighting, wrapper.ignore_index) != (self.weighting, self.ignore_index):
                wrapper.verified = False  # other weights: check them again
            (wrapper.micro_batch_size, wrapper.weighting, wrapper.verify,
             wrapper.ignore_index) = self._settings()
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
            return MitigationResult(self.name, applied=False, detail="not micro-batching",
                                    before=before, after=before)
        unwrap_training_step(pl_module, wrapper)
        detail = "restored the original training_step"
        return MitigationResult(self.name, applied=True, detail=detail, before=before, after="off")

    def __repr__(self) -> str:
        extra = "".join(
            f", {name}={value!r}" for name, value, default in
            (("weighting", self.weighting, "auto"), ("verify", self.verify, True),
             ("ignore_index", self.ignore_index, IGNORE_INDEX))
            if value != default
        )
        return f"{type(self).__name__}(micro_batch_size={self.micro_batch_size}{extra})"


class MicroBatchRung(Rung):
    """The ``"microbatch"`` rung: one-sample :class:`MicroBatching`; dry runs change the step.

    Example:
        >>> import torch
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
        """Why this rank's batch would run whole (:meth:`MicroBatching.unsplit_reason`), or None."""
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
        """Refused only where the module refuses it (a dry run models it on any batch)."""
        return _manual_refusal(ctx.pl_module) or self.policy.check_refusal(ctx.pl_module)

    def strategy_refusal(self, trainer: Any) -> str | None:
        return wrapping_strategy_refusal(trainer)

    def setup_refusal(self, trainer: Any, pl_module: Any) -> str | None:
        return _manual_refusal(pl_module) or self.strategy_refusal(trainer)

    def check_pending(self, module: Any, batch: Any = None) -> bool:
        return micro_batching_check_pending(module, batch)

    def refusal(self, module: Any) -> str | None:
        return micro_batching_refusal(module)

RUNG = MicroBatchRung
"""This folder's rung (what :data:`~lightning_seqmem.core.rungs.RUNG_FOLDERS` names)."""
