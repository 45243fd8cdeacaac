"""The training-step wrapper behind micro-batching: its first-step check (the loss is a mean over
what the weights count) and the split step, run inside ``training_step`` (the method card and the
policy: :mod:`.microbatch`)."""

from __future__ import annotations

import contextlib
import inspect
import math
import warnings
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_seqmem.measure.steps import loss_of
from lightning_seqmem.mitigations.microbatch.microbatch_check import check_copy
from lightning_seqmem.mitigations.microbatch.microbatch_functional import (
    IGNORE_INDEX, RULE_TEXT, micro_batch_counts, split_batch)
from lightning_seqmem.mitigations.microbatch.microbatch_twin import check_pair, run_micro_batches

__all__ = ["REFUSED_ATTRIBUTE", "MicroBatchedTrainingStep", "MicroBatchingRefusedWarning",
           "is_micro_batching", "micro_batching_check_pending", "micro_batching_refusal",
           "unwrap_training_step", "wrapper_of"]

REFUSED_ATTRIBUTE = "_seqmem_micro_batching_refused"  # instance attribute: the refusal reason


class MicroBatchingRefusedWarning(UserWarning):
    """Micro-batching was switched off by its first-step check; the batch ran whole."""


def _trainer_of(pl_module: Any) -> Any:
    try:
        return pl_module.trainer
    except RuntimeError:  # not attached to a Trainer
        return None


def _positional_capacity(fn: Any) -> int | None:
    """How many positional arguments ``fn`` takes (None: unlimited)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                          inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params)


# --- the first-step check ------------------------------------------------------------------------

_DROPOUTS = frozenset(
    [getattr(F, name) for name in ("dropout", "dropout1d", "dropout2d", "dropout3d",
                                    "alpha_dropout", "feature_alpha_dropout") if hasattr(F, name)]
    + [getattr(torch, name) for name in ("dropout", "dropout_", "alpha_dropout", "alpha_dropout_",
                                         "feature_dropout", "feature_dropout_",
                                         "feature_alpha_dropout", "feature_alpha_dropout_")
       if hasattr(torch, name)]
)
_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


class _NoDropout(TorchFunctionMode):
    """Dropout off without ``eval()``: dropouts return their input, attention ``dropout_p=0``."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]
        if func is F.scaled_dot_product_attention:  # (query, key, value, attn_mask, dropout_p, ...)
            if "dropout_p" in kwargs:
                kwargs["dropout_p"] = 0.0
            elif len(args) > 4:
                args = (*args[:4], 0.0, *args[5:])
        elif func is F.multi_head_attention_forward:
            bound = _MHA_SIGNATURE.bind(*args, **kwargs)
            bound.arguments["dropout_p"] = 0.0
            args, kwargs = bound.args, bound.kwargs
        return func(*args, **kwargs)


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def _side_effects_contained(pl_module: Any):  # type: ignore[no-untyped-def]
    """No gradient, no dropout, the RNG and ``self.log`` as they were: for the check's forwards, on
    its own copy of the module (whose buffers and attributes are its own: dropped with it)."""
    cuda = sorted({
        p.device.index if p.device.index is not None else torch.cuda.current_device()
        for p in pl_module.parameters() if p.device.type == "cuda"
    })
    missing = object()
    logs = {name: pl_module.__dict__.get(name, missing) for name in ("log", "log_dict")}
    try:
        for name in logs:
            pl_module.__dict__[name] = _no_log
        with torch.no_grad(), torch.random.fork_rng(devices=cuda), _NoDropout():
            yield
    finally:
        for name, value in logs.items():
            if value is missing:
                pl_module.__dict__.pop(name, None)
            else:
                pl_module.__dict__[name] = value


def _low_precision(pl_module: Any, losses: list[torch.Tensor]) -> bool:
    sixteen = (torch.float16, torch.bfloat16)
    if (any(loss.dtype in sixteen for loss in losses)
            or any(p.dtype in sixteen for p in pl_module.parameters())):
        return True
    try:
        return torch.is_autocast_enabled(losses[0].device.type)
    except (RuntimeError, TypeError):
        return False


def _close(a: float, b: float, rtol: float, atol: float) -> bool:
    return abs(a - b) <= atol + rtol * max(abs(a), abs(b))


def _batch_norms(pl_module: Any) -> list[str]:
    return [name or type(m).__name__ for name, m in pl_module.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]


# --- the wrapper ---------------------------------------------------------------------------------


class _SkipNextZeroGrad:
    """Instance-level ``optimizer_zero_grad`` that skips one call, then puts the original back."""

    def __init__(self, pl_module: Any) -> None:
        self.pl_module = pl_module
        self.previous = pl_module.__dict__.get("optimizer_zero_grad")  # None: the class's method

    def restore(self) -> None:
        if self.pl_module.__dict__.get("optimizer_zero_grad") is self:
            if self.previous is None:
                del self.pl_module.optimizer_zero_grad
            else:
                self.pl_module.optimizer_zero_grad = self.previous

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.restore()  # the gradients were zeroed before the first micro-batch: keep them


class MicroBatchedTrainingStep:
    """The wrapper put on ``pl_module.training_step`` (a picklable object, for ``ddp_spawn``).

    Attributes: ``micro_batch_size``, ``weighting``, ``ignore_index``, ``verify`` (as given to
    :class:`MicroBatching`); ``verified`` (the first-step check passed); ``rule`` (the weighting
    rule of the last batch split, or None); ``refused_reason`` (why the check refused; the wrapper
    is then off the module)."""

    _seqmem_micro_batching = True

    def __init__(self, pl_module: Any, micro_batch_size: int, weighting: str = "auto",
                 verify: bool = True, ignore_index: int = IGNORE_INDEX) -> None:
        self.pl_module = pl_module
        # A training_step set on the instance before us, else None: the class's method, looked up
        # at call time (a stored bound method would pickle as getattr(module, "training_step"): us)
        self.previous = pl_module.__dict__.get("training_step")
        self.micro_batch_size = micro_batch_size
        self.weighting = weighting
        self.verify = verify
        self.ignore_index = ignore_index
        self.verified = False
        self.rule: Optional[str] = None
        self.refused_reason: Optional[str] = None
        self.num_args = _positional_capacity(self.original)

    @property
    def original(self) -> Any:
        if self.previous is not None:
            return self.previous
        return type(self.pl_module).training_step.__get__(self.pl_module)

    @property
    def __wrapped__(self) -> Any:  # Lightning's is_overridden("training_step", module) follows it
        return self.original

    @property
    def check_pending(self) -> bool:
        """Whether the next batch split runs the first-step check."""
        return self.verify and not self.verified and self.refused_reason is None

    def __call__(self, batch: Any, *args: Any) -> Any:
        if self.num_args is not None:  # Lightning passes batch_idx only if the signature asks
            args = args[: max(self.num_args - 1, 0)]
        trainer = _trainer_of(self.pl_module)
        if (trainer is None or not self.pl_module.automatic_optimization
                or not trainer.training or not torch.is_grad_enabled()):
            return self.original(batch, *args)  # validation_step calling training_step: whole
        parts = split_batch(batch, self.micro_batch_size)
        if len(parts) == 1:
            return self.original(batch, *args)
        self.rule, counts = micro_batch_counts(batch, self.micro_batch_size, self.weighting,
                                               self.ignore_index)
        if sum(counts) == 0:  # nothing the loss averages over: the plain step
            return self.original(batch, *args)
        if self.check_pending:
            reason = self._check(batch, parts, counts, args)
            if reason is not None:
                self._refuse(reason)
                return self.original(batch, *args)  # the plain step, for this batch and from now on
        return self._run(trainer, parts, counts, *args)

    # -- the check ----------------------------------------------------------------------------

    @staticmethod
    def _loss(step: Any, batch: Any, args: tuple) -> Optional[torch.Tensor]:
        loss = loss_of(step(batch, *args), required=False)
        return None if loss is None else loss.detach()

    def _check(self, batch: Any, parts: list[Any], counts: list[int], args: tuple) -> Optional[str]:
        """None when the loss passes (``verified`` set) or cannot be checked on this batch
        (deferred); else the reason for refusing. The forwards run on :func:`.check_copy`."""
        found = check_pair(batch, parts, counts)
        if found is None:
            return None  # one micro-batch with something to count: its loss is the batch's
        pair, used, start, length = found
        try:
            twin, step = check_copy(self.pl_module, self)
        except Exception as exc:  # noqa: BLE001 - a module that refuses a copy: never the user's
            why = f"{type(exc).__name__}: {exc}"
            return ("its first-step check runs on a copy of the module (so that training_step "
                    f"runs once per sample), which could not be made ({why}); pass verify=False if "
                    "the loss is a mean over what the weights count")
        with _side_effects_contained(twin):
            together = self._loss(step, pair, args)
            apart = [self._loss(step, parts[i], args) for i in used]
            if together is None or any(loss is None for loss in apart):
                return None
            losses = [together, *apart]
            values = [float(loss.float()) for loss in losses]
            weights = [counts[i] for i in used]
            expected = sum(w * v for w, v in zip(weights, values[1:])) / sum(weights)
            if not all(math.isfinite(v) for v in [*values, expected]):
                return None
            low = _low_precision(self.pl_module, losses)
            rtol, atol = (2e-2, 1e-4) if low else (1e-3, 1e-6)
            if _close(values[0], expected, rtol, atol):
                self.verified = True
                return None
            again = self._loss(step, pair, args)
        what = RULE_TEXT[self.rule or "samples"]
        samples = f"samples {start}..{start + length - 1}"
        if again is not None and not _close(float(again.float()), values[0], rtol, atol):
            return (
                f"cannot verify that the loss is a mean over {what}: training_step gave "
                f"{values[0]:.6g}, then {float(again.float()):.6g} on the same {samples} with "
                "torch's dropouts off; it draws random numbers the check cannot turn off (noise "
                "drawn in training_step, a dropout outside torch such as flash-attn's); pass "
                "verify=False if the loss is such a mean")
        reason = (
            f"the loss is not a mean over {what}: {samples} together gave {values[0]:.6g}, one "
            f"micro-batch at a time {expected:.6g} weighted by {what} ({weights[0]} and "
            f"{weights[1]}); split, it would be scaled wrongly (a sum, reduction='sum', or a mean "
            "over something else)")
        norms = _batch_norms(self.pl_module)
        if norms:
            reason += (f", or the batch norm in {', '.join(norms[:3])}"
                       f"{' ...' if len(norms) > 3 else ''} normalises over fewer samples")
        return reason

    def _refuse(self, reason: str) -> None:
        self.refused_reason = reason
        unwrap_training_step(self.pl_module, self)
        self.pl_module.__dict__[REFUSED_ATTRIBUTE] = reason
        warnings.warn(f"micro-batching refused, the batch runs whole: {reason}",
                      MicroBatchingRefusedWarning, stacklevel=2)

    # -- the micro-batched step ---------------------------------------------------------------

    def _run(self, trainer: Any, parts: list[Any], counts: list[int], *args: Any) -> Any:
        """The split step (:func:`.run_micro_batches`): each micro-batch but the last
        backpropagated through the strategy, the last one's loss returned."""
        accumulate = trainer.accumulate_grad_batches
        skip_backward = bool(getattr(trainer.fit_loop, "_skip_backward", False))
        optimizer = trainer.optimizers[0]

        def backward(scaled: torch.Tensor) -> None:
            trainer.strategy.backward(scaled / accumulate, optimizer)

        return run_micro_batches(
            parts, counts, lambda part: self.original(part, *args),
            None if skip_backward else backward,
            trainer.strategy.model if trainer.strategy.model is not None else self.pl_module,
            zero_grad=lambda: self._zero_grad_first(trainer, optimizer, skip_backward),
        )

    def _zero_grad_first(self, trainer: Any, optimizer: Any, skip_backward: bool) -> None:
        """Zero the gradients before the first micro-batch of an accumulation window (Lightning
        zeroes after ``training_step``, in ``Closure.closure``: its call is skipped once)."""
        if (not skip_backward
                and trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0):
            pending = self.pl_module.__dict__.get("optimizer_zero_grad")
            if isinstance(pending, _SkipNextZeroGrad):  # armed by a step whose zero_grad never came
                pending.restore()
            self.pl_module.optimizer_zero_grad(trainer.current_epoch,
                                               trainer.fit_loop.epoch_loop.batch_idx, optimizer)
            self.pl_module.optimizer_zero_grad = _SkipNextZeroGrad(self.pl_module)


def unwrap_training_step(pl_module: Any, wrapper: MicroBatchedTrainingStep) -> None:
    """Take ``wrapper`` off ``pl_module`` (and undo a pending zero-grad skip)."""
    if wrapper.previous is not None:
        pl_module.training_step = wrapper.previous
    else:
        del pl_module.training_step
    skip = pl_module.__dict__.get("optimizer_zero_grad")
    if isinstance(skip, _SkipNextZeroGrad):
        skip.restore()


def wrapper_of(pl_module: Any) -> Optional[MicroBatchedTrainingStep]:
    """The micro-batching wrapper on ``pl_module``'s ``training_step``, or None.

    Example:
        >>> import torch
        >>> wrapper_of(torch.nn.Linear(2, 2)) is None
        True
    """
    wrapper = pl_module.__dict__.get("training_step")
    return wrapper if isinstance(wrapper, MicroBatchedTrainingStep) else None


def is_micro_batching(pl_module: Any) -> bool:
    """Whether ``pl_module.training_step`` is wrapped by :class:`MicroBatching`.

    Example:
        >>> import torch
        >>> is_micro_batching(torch.nn.Linear(2, 2))
        False
    """
    return wrapper_of(pl_module) is not None


def micro_batching_refusal(pl_module: Any) -> Optional[str]:
    """Why the first-step check of :class:`MicroBatching` switched micro-batching off for
    ``pl_module``, or None; it stays (and ``is_applicable`` refuses) until ``verify=False``.

    Example:
        >>> import torch
        >>> micro_batching_refusal(torch.nn.Linear(2, 2)) is None
        True
    """
    return pl_module.__dict__.get(REFUSED_ATTRIBUTE)


def micro_batching_check_pending(pl_module: Any, batch: Any = None) -> bool:
    """Whether the next split ``training_step`` of ``pl_module`` (on ``batch``) runs the first-step
    check: three extra forwards without gradient, whose memory falls in that step's peak.

    Example:
        >>> import torch
        >>> micro_batching_check_pending(torch.nn.Linear(2, 2))
        False
    """
    wrapper = wrapper_of(pl_module)
    if wrapper is None or not wrapper.check_pending:
        return False
    if batch is None:
        return True
    try:
        parts = split_batch(batch, wrapper.micro_batch_size)
        if len(parts) < 2:
            return False
        _, counts = micro_batch_counts(batch, wrapper.micro_batch_size, wrapper.weighting,
                                       wrapper.ignore_index)
        return check_pair(batch, parts, counts) is not None
    except (TypeError, ValueError):
        return True  # as without the batch
