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
* any other batch: ``c_i`` = its samples ``n_i`` (``"samples"``, ``n_i / N`` as before): the loss
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

The check's forwards run with dropout off (the ``torch.nn.functional`` and ``torch`` dropouts return
their input and ``dropout_p`` of ``scaled_dot_product_attention`` and
``multi_head_attention_forward`` is 0, through a ``TorchFunctionMode``; ``module.eval()`` is not
used: it would change batch norm), inside ``torch.random.fork_rng`` (the step then draws the random
numbers it would have drawn without the check), with ``self.log``/``self.log_dict`` silenced and the
module's buffers (batch-norm statistics) restored afterwards; any other side effect of
``training_step`` (a user's counters) happens three more times. When the losses disagree, the pair
is run again: if its loss changed, the step is random in a way the check cannot turn off (noise
drawn in ``training_step``, a dropout outside ``torch``, such as flash-attn's), the loss cannot be
verified, and the rung is refused, saying so. The check's memory (a no-grad forward of the pair)
falls in that step's measured peak: :func:`micro_batching_check_pending`
tells, before a step, whether it will run the check. Under DDP each rank checks its own batch and
decides alone (a collective would hang when one rank's batch is not split); either way each rank's
gradient is exact, and each runs one synced backward per batch, so ranks that decide differently
still all-reduce correctly; only their memory differs.

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
  Manual optimization, DeepSpeed (it accumulates itself), FSDP and other model-parallel
  strategies are refused by :meth:`MicroBatching.is_applicable`.

Example:
    >>> import torch
    >>> batch = {"input_ids": torch.zeros(5, 3, dtype=torch.long), "index": torch.arange(5), "tag": "x"}
    >>> parts = split_batch(batch, 2)
    >>> [p["input_ids"].shape[0] for p in parts], [p["index"].tolist() for p in parts], parts[2]["tag"]
    ([2, 2, 1], [[0, 1], [2, 3], [4]], 'x')
    >>> ids = torch.tensor([[5, 6, 7, 0], [5, 6, 0, 0], [5, 0, 0, 0]])
    >>> micro_batch_counts({"input_ids": ids, "labels": ids.masked_fill(ids == 0, -100)}, 1)
    ('shifted_label_tokens', [2, 1, 0])
"""

from __future__ import annotations

import contextlib
import inspect
import math
import warnings
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.overrides import TorchFunctionMode

from lightning_seqmem.measure.batch import infer_batch_shape, map_tensors
from lightning_seqmem.measure.steps import loss_of
from lightning_seqmem.core.checks import check_int, is_a
from lightning_seqmem.core.rungs import spec
from lightning_seqmem.mitigations.base import CopyPlan, MitigationResult, Rung, RungContext, wrapping_strategy_refusal

__all__ = [
    "IGNORE_INDEX",
    "WEIGHTINGS",
    "MicroBatchRung",
    "MicroBatching",
    "MicroBatchingRefusedWarning",
    "is_micro_batching",
    "micro_batch_counts",
    "micro_batching_check_pending",
    "micro_batching_refusal",
    "split_batch",
]

IGNORE_INDEX = -100  # label value a loss skips (torch's cross_entropy and Hugging Face's default)
WEIGHTINGS = ("auto", "samples", "label_tokens", "shifted_label_tokens")
_RULE_TEXT = {
    "samples": "samples",
    "label_tokens": "label tokens (labels != ignore_index)",
    "shifted_label_tokens": "label tokens after the causal shift (labels[..., 1:] != ignore_index)",
}
_REFUSED = "_seqmem_micro_batching_refused"  # instance attribute holding the refusal reason


class MicroBatchingRefusedWarning(UserWarning):
    """Micro-batching was switched off by its first-step check; the batch ran whole."""


def _micro_batch_sizes(batch_size: int, micro_batch_size: int) -> list[int]:
    full, rest = divmod(batch_size, micro_batch_size)
    return [micro_batch_size] * full + ([rest] if rest else [])


def _slice(obj: Any, batch_size: int, start: int, length: int) -> Any:
    """``obj`` with every tensor whose dim 0 is ``batch_size`` narrowed to ``[start, start+length)``
    (views: no copy of the batch), in new containers of the same types (dataclasses included)."""
    def narrow(tensor: torch.Tensor, key: Any, top_key: Any) -> torch.Tensor:
        return tensor.narrow(0, start, length) if tensor.dim() >= 1 and tensor.shape[0] == batch_size else tensor

    return map_tensors(obj, narrow, in_place=False)


def split_batch(batch: Any, micro_batch_size: int) -> list[Any]:
    """Split a batch into consecutive micro-batches of at most ``micro_batch_size`` samples.

    The batch size ``N`` is read with :func:`lightning_seqmem.measure.batch.infer_batch_shape` (the first
    dimension of its 2-D integer token tensor). Every tensor whose dim 0 equals ``N`` is cut along
    dim 0 (as views, nothing is copied); other values (scalars, strings, tensors of another first
    dimension) are passed unchanged to every micro-batch. Mappings, lists, tuples and namedtuples
    are rebuilt with their type; the input is never mutated. A list of ``N`` strings is a list, not
    a tensor: it is *not* cut. The last micro-batch is smaller when ``micro_batch_size`` does not
    divide ``N``.

    Raises:
        ValueError: bad ``micro_batch_size``, or no 2-D integer tensor in the batch.

    Example:
        >>> import torch
        >>> ids = torch.arange(8).reshape(4, 2)
        >>> [t.tolist() for t, _ in split_batch((ids, torch.tensor(1.0)), 3)]
        [[[0, 1], [2, 3], [4, 5]], [[6, 7]]]
    """
    micro_batch_size = check_int("micro_batch_size", micro_batch_size, accepted="an int >= 1")
    batch_size, _ = infer_batch_shape(batch)
    parts, start = [], 0
    for length in _micro_batch_sizes(batch_size, micro_batch_size):
        parts.append(_slice(batch, batch_size, start, length))
        start += length
    return parts


def _is_label_tensor(labels: Any, batch_size: int) -> bool:
    return (
        isinstance(labels, torch.Tensor)
        and labels.dim() >= 1
        and labels.shape[0] == batch_size
        and not labels.is_floating_point()
        and not labels.is_complex()
        and labels.dtype != torch.bool
    )


def _labels_are_inputs(batch: Mapping, labels: torch.Tensor, ignore_index: int) -> bool:
    """Whether ``labels`` are ``input_ids`` (ignored positions aside): then the loss shifts them."""
    input_ids = batch.get("input_ids")
    if not isinstance(input_ids, torch.Tensor):
        return input_ids is None  # inputs_embeds: Hugging Face's convention, the loss shifts
    if input_ids.shape != labels.shape:
        return False  # seq2seq targets: not shifted
    return bool(((labels == input_ids) | (labels == ignore_index)).all())


def micro_batch_counts(
    batch: Any, micro_batch_size: int, weighting: str = "auto", ignore_index: int = IGNORE_INDEX
) -> tuple[str, list[int]]:
    """What the loss of ``batch`` averages over, counted in each micro-batch of :func:`split_batch`.

    Returns ``(rule, counts)``: ``rule`` is ``"samples"``, ``"label_tokens"`` or
    ``"shifted_label_tokens"`` (see the module docstring for how ``"auto"`` picks it), ``counts[i]``
    the samples or label tokens of micro-batch ``i``. Micro-batch ``i``'s loss weighs
    ``counts[i] / sum(counts)`` in the batch's loss. This is the functional twin of the weighting
    :class:`MicroBatching` applies; an offline micro-batched step should weight its losses with it.

    Raises:
        ValueError: bad ``micro_batch_size`` or ``weighting``, a batch :func:`split_batch` cannot
            cut, or a token ``weighting`` asked for a batch without an integer ``"labels"`` tensor.

    Example:
        >>> import torch
        >>> ids = torch.arange(1, 9).reshape(4, 2)
        >>> next_tokens = torch.tensor([[2, 3], [4, -100], [-100, -100], [8, 9]])  # not the inputs: not shifted
        >>> micro_batch_counts({"input_ids": ids, "labels": next_tokens}, 2)
        ('label_tokens', [3, 2])
        >>> micro_batch_counts({"input_ids": ids, "labels": ids.masked_fill(ids == 4, -100)}, 2)
        ('shifted_label_tokens', [1, 2])
        >>> micro_batch_counts((ids, ids), 3)
        ('samples', [3, 1])
    """
    micro_batch_size = check_int("micro_batch_size", micro_batch_size, accepted="an int >= 1")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"`weighting` must be one of {WEIGHTINGS}, got {weighting!r}")
    batch_size, _ = infer_batch_shape(batch)
    sizes = _micro_batch_sizes(batch_size, micro_batch_size)
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if weighting == "samples" or (weighting == "auto" and not _is_label_tensor(labels, batch_size)):
        return "samples", sizes
    if not _is_label_tensor(labels, batch_size):
        raise ValueError(
            f"`weighting={weighting!r}` needs a mapping batch with an integer 'labels' tensor of "
            f"{batch_size} rows; this batch has none (use 'auto' or 'samples')"
        )
    if labels.dim() == 1:  # one label per sample: never shifted
        rule, valid = "label_tokens", labels != ignore_index
    else:
        shifted = _labels_are_inputs(batch, labels, ignore_index) if weighting == "auto" else weighting == "shifted_label_tokens"
        rule = "shifted_label_tokens" if shifted else "label_tokens"
        valid = (labels[..., 1:] if shifted else labels) != ignore_index
    per_sample = valid.reshape(batch_size, -1).sum(dim=1).tolist()
    counts, start = [], 0
    for size in sizes:
        counts.append(int(sum(per_sample[start : start + size])))
        start += size
    return rule, counts


def _loss_of(output: Any) -> torch.Tensor | None:
    """The loss in a ``training_step`` output, or None where Lightning would skip the batch."""
    return loss_of(output, required=False)


def _with_loss(output: Any, loss: torch.Tensor) -> Any:
    if isinstance(output, Mapping):
        return {**output, "loss": loss}
    return loss


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
    return sum(p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params)


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Leave the precision plugin's autocast (``training_step`` runs inside it) for a backward."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False) if enabled else contextlib.nullcontext()


# --- the first-step check ------------------------------------------------------------------------

_DROPOUTS = frozenset(
    [getattr(F, name) for name in ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
                                    "feature_alpha_dropout") if hasattr(F, name)]
    + [getattr(torch, name) for name in ("dropout", "dropout_", "alpha_dropout", "alpha_dropout_", "feature_dropout",
                                         "feature_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_")
       if hasattr(torch, name)]
)
_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


class _NoDropout(TorchFunctionMode):
    """Dropout off without ``eval()``: dropouts return their input, attention gets ``dropout_p=0``."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
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
    """No gradient, no dropout, the RNG, buffers and ``self.log`` as they were: for the check's forwards."""
    cuda = sorted({
        p.device.index if p.device.index is not None else torch.cuda.current_device()
        for p in pl_module.parameters() if p.device.type == "cuda"
    })
    buffers = [(b, b.detach().clone()) for b in pl_module.buffers()]
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
        with torch.no_grad():
            for buffer, value in buffers:
                if buffer.shape == value.shape:
                    buffer.copy_(value)


def _low_precision(pl_module: Any, losses: list[torch.Tensor]) -> bool:
    sixteen = (torch.float16, torch.bfloat16)
    if any(loss.dtype in sixteen for loss in losses) or any(p.dtype in sixteen for p in pl_module.parameters()):
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


class _MicroBatchedTrainingStep:
    """The wrapper put on ``pl_module.training_step`` (a picklable object, for ``ddp_spawn``).

    Attributes: ``micro_batch_size``, ``weighting``, ``ignore_index``, ``verify`` (as given to
    :class:`MicroBatching`); ``verified`` (the first-step check passed; False while pending or
    when ``verify=False``); ``rule`` (the weighting rule of the last batch split, e.g.
    ``"shifted_label_tokens"``; None before); ``refused_reason`` (why the check refused; the
    wrapper is then no longer on the module).
    """

    _seqmem_micro_batching = True

    def __init__(
        self, pl_module: Any, micro_batch_size: int, weighting: str = "auto", verify: bool = True,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        self.pl_module = pl_module
        # A training_step set on the instance before us, else None: the class's method, looked up at
        # call time (a stored bound method would pickle as getattr(module, "training_step"): us).
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
        if self.num_args is not None:  # Lightning passes batch_idx only if the signature asks for it
            args = args[: max(self.num_args - 1, 0)]
        trainer = _trainer_of(self.pl_module)
        if trainer is None or not self.pl_module.automatic_optimization:
            return self.original(batch, *args)
        parts = split_batch(batch, self.micro_batch_size)
        if len(parts) == 1:
            return self.original(batch, *args)
        self.rule, counts = micro_batch_counts(batch, self.micro_batch_size, self.weighting, self.ignore_index)
        if sum(counts) == 0:  # nothing the loss averages over: the plain step, as without micro-batching
            return self.original(batch, *args)
        if self.check_pending:
            reason = self._check(batch, parts, counts, args)
            if reason is not None:
                self._refuse(reason)
                return self.original(batch, *args)  # the plain step, for this batch and from now on
        return self._run(trainer, parts, counts, *args)

    # -- the check --------------------------------------------------------------------------------

    def _loss(self, batch: Any, args: tuple) -> Optional[torch.Tensor]:
        loss = _loss_of(self.original(batch, *args))
        return None if loss is None else loss.detach()

    def _check(self, batch: Any, parts: list[Any], counts: list[int], args: tuple) -> Optional[str]:
        """None when the loss passes (``verified`` set) or cannot be checked on this batch (deferred);
        else the reason for refusing."""
        used = [i for i, c in enumerate(counts) if c > 0][:2]
        if len(used) < 2:
            return None  # one micro-batch with something to count: its loss is the batch's; check later
        sizes = [infer_batch_shape(part)[0] for part in parts]
        start, length = sum(sizes[: used[0]]), sum(sizes[used[0] : used[1] + 1])
        pair = _slice(batch, sum(sizes), start, length)
        with _side_effects_contained(self.pl_module):
            together = self._loss(pair, args)
            apart = [self._loss(parts[i], args) for i in used]
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
            again = self._loss(pair, args)
        what = _RULE_TEXT[self.rule or "samples"]
        samples = f"samples {start}..{start + length - 1}"
        if again is not None and not _close(float(again.float()), values[0], rtol, atol):
            return (
                f"cannot verify that the loss is a mean over {what}: training_step gave {values[0]:.6g}, then "
                f"{float(again.float()):.6g} on the same {samples} with torch's dropouts off; it draws random numbers "
                "the check cannot turn off (noise drawn in training_step, a dropout outside torch such as "
                "flash-attn's); pass verify=False if the loss is such a mean"
            )
        reason = (
            f"the loss is not a mean over {what}: {samples} together gave {values[0]:.6g}, one micro-batch at a "
            f"time {expected:.6g} weighted by {what} ({weights[0]} and {weights[1]}); split, it would be scaled "
            "wrongly (a sum, reduction='sum', or a mean over something else)"
        )
        norms = _batch_norms(self.pl_module)
        if norms:
            reason += f", or the batch norm in {', '.join(norms[:3])}{' ...' if len(norms) > 3 else ''} normalises over fewer samples"
        return reason

    def _refuse(self, reason: str) -> None:
        self.refused_reason = reason
        _unwrap(self.pl_module, self)
        self.pl_module.__dict__[_REFUSED] = reason
        warnings.warn(
            f"micro-batching refused, the batch runs whole: {reason}", MicroBatchingRefusedWarning, stacklevel=2
        )

    # -- the micro-batched step -------------------------------------------------------------------

    def _run(self, trainer: Any, parts: list[Any], counts: list[int], *args: Any) -> Any:
        total = sum(counts)
        used = [i for i, c in enumerate(counts) if c > 0]  # c_i = 0: nothing counted, no gradient: not run
        accumulate = trainer.accumulate_grad_batches
        skip_backward = bool(getattr(trainer.fit_loop, "_skip_backward", False))
        optimizer = trainer.optimizers[0]
        if not skip_backward and trainer.fit_loop.epoch_loop.batch_idx % accumulate == 0:
            # Lightning zeroes after training_step (Closure.closure): zero now, and skip its call.
            pending = self.pl_module.__dict__.get("optimizer_zero_grad")
            if isinstance(pending, _SkipNextZeroGrad):  # armed by a step whose zero_grad never came
                pending.restore()
            self.pl_module.optimizer_zero_grad(trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx, optimizer)
            self.pl_module.optimizer_zero_grad = _SkipNextZeroGrad(self.pl_module)
        model = trainer.strategy.model if trainer.strategy.model is not None else self.pl_module
        no_sync = lambda: deferred_gradient_reduction(model)  # noqa: E731
        done: torch.Tensor | None = None  # sum of the scaled losses already backpropagated, detached
        for i in used[:-1]:
            output = self.original(parts[i], *args)
            loss = _loss_of(output)
            del output
            if loss is None:  # this micro-batch is skipped, as Lightning skips a batch returning None
                continue
            scaled = loss * (counts[i] / total)
            if not skip_backward:
                with no_sync(), _autocast_off(scaled.device.type):
                    trainer.strategy.backward(scaled / accumulate, optimizer)
            done = scaled.detach() if done is None else done + scaled.detach()
            del loss, scaled
        output = self.original(parts[used[-1]], *args)
        loss = _loss_of(output)
        if loss is None:
            return output
        scaled = loss * (counts[used[-1]] / total)
        return _with_loss(output, scaled if done is None else scaled + done)


@contextlib.contextmanager
def deferred_gradient_reduction(model: Any) -> Any:
    """Backward passes inside accumulate gradients locally, without reducing them across ranks:
    ``DistributedDataParallel.no_sync()``, or ``set_requires_gradient_sync(False)`` on every FSDP2
    module (``fully_shard``) of ``model``, switched back on afterwards; nothing for anything else.

    Example:
        >>> with deferred_gradient_reduction(torch.nn.Linear(2, 2)):
        ...     pass
    """
    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
        return
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in model.modules()] if isinstance(model, torch.nn.Module) else []
    sharded = [m for m in sharded if isinstance(m, FSDPModule)]
    for m in sharded:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for m in sharded:
            m.set_requires_gradient_sync(True, recurse=False)


def _unwrap(pl_module: Any, wrapper: _MicroBatchedTrainingStep) -> None:
    if wrapper.previous is not None:
        pl_module.training_step = wrapper.previous
    else:
        del pl_module.training_step
    skip = pl_module.__dict__.get("optimizer_zero_grad")
    if isinstance(skip, _SkipNextZeroGrad):
        skip.restore()


def _wrapper_of(pl_module: Any) -> Optional[_MicroBatchedTrainingStep]:
    wrapper = pl_module.__dict__.get("training_step")
    return wrapper if isinstance(wrapper, _MicroBatchedTrainingStep) else None


def is_micro_batching(pl_module: Any) -> bool:
    """Whether ``pl_module.training_step`` is wrapped by :class:`MicroBatching`.

    Example:
        >>> import torch
        >>> is_micro_batching(torch.nn.Linear(2, 2))
        False
    """
    return _wrapper_of(pl_module) is not None


def micro_batching_refusal(pl_module: Any) -> Optional[str]:
    """Why the first-step check of :class:`MicroBatching` switched micro-batching off for
    ``pl_module`` (None: it never did). The reason stays until ``MicroBatching(verify=False)`` is
    applied; while it is there, :meth:`MicroBatching.is_applicable` refuses with it.

    Example:
        >>> import torch
        >>> micro_batching_refusal(torch.nn.Linear(2, 2)) is None
        True
    """
    return pl_module.__dict__.get(_REFUSED)


def micro_batching_check_pending(pl_module: Any) -> bool:
    """Whether the next split ``training_step`` of ``pl_module`` runs the first-step check (three
    extra forwards without gradient, whose memory falls in that step's peak).

    Example:
        >>> import torch
        >>> micro_batching_check_pending(torch.nn.Linear(2, 2))
        False
    """
    wrapper = _wrapper_of(pl_module)
    return wrapper is not None and wrapper.check_pending


def _describe(pl_module: Any) -> str:
    wrapper = _wrapper_of(pl_module)
    return f"micro_batch_size={wrapper.micro_batch_size}" if wrapper is not None else "off"


def _has_fsdp2(module: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, torch.nn.Module) and any(isinstance(m, FSDPModule) for m in module.modules())


def _dataloader_batch_size(trainer: Any) -> int | None:
    loader = getattr(trainer, "train_dataloader", None)
    size = getattr(loader, "batch_size", None)
    return size if isinstance(size, int) else None


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
        if getattr(strategy, "handles_gradient_accumulation", False):
            return False, f"{type(strategy).__name__} accumulates gradients itself"
        fsdp2 = is_a(strategy, "ModelParallelStrategy") and _has_fsdp2(pl_module)
        if not is_a(strategy, "SingleDeviceStrategy", "DDPStrategy") and not fsdp2:
            return False, (f"strategy {type(strategy).__name__} not supported (single device, DDP, and "
                           "ModelParallelStrategy with fully_shard (FSDP2) modules are)")
        model = strategy.model
        if model is not None and model is not pl_module and not isinstance(model, DistributedDataParallel):
            return False, f"the strategy wraps the module in {type(model).__name__} (not DistributedDataParallel)"
        wrapper = _wrapper_of(pl_module)
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
            return False, f"batch size {batch_size} is already at most micro_batch_size={self.micro_batch_size}"
        size = "?" if batch_size is None else str(batch_size)
        return True, f"split batches of {size} into micro-batches of {self.micro_batch_size}"

    def apply(self, trainer: Any, pl_module: Any, batch: Any = None) -> MitigationResult:
        """Wrap ``pl_module.training_step``; takes effect at the next training step.

        Call it outside ``training_step`` (e.g. from ``on_train_batch_start`` or before ``fit``).
        A second call with the same settings changes nothing; with others it changes them. The
        first batch split is checked (``verify``): a refusal then shows in
        :func:`micro_batching_refusal`, not in the result returned here.
        """
        before = _describe(pl_module)
        applicable, reason = self.is_applicable(trainer, pl_module, batch)
        if not applicable:
            return MitigationResult(self.name, applied=False, detail=reason, before=before, after=before)
        pl_module.__dict__.pop(_REFUSED, None)  # verify=False overrides an earlier refusal
        wrapper = _wrapper_of(pl_module)
        if wrapper is not None:
            if (wrapper.weighting, wrapper.ignore_index) != (self.weighting, self.ignore_index):
                wrapper.verified = False  # other weights: check them again
            wrapper.micro_batch_size, wrapper.weighting, wrapper.verify, wrapper.ignore_index = self._settings()
        else:
            pl_module.training_step = _MicroBatchedTrainingStep(pl_module, *self._settings())
        after = _describe(pl_module)
        detail = f"{reason} ({before} -> {after})"
        return MitigationResult(self.name, applied=True, detail=detail, before=before, after=after)

    def remove(self, pl_module: Any) -> MitigationResult:
        """Restore the original ``training_step`` (call it between training steps)."""
        before = _describe(pl_module)
        wrapper = _wrapper_of(pl_module)
        if wrapper is None:
            return MitigationResult(self.name, applied=False, detail="not micro-batching", before=before, after=before)
        _unwrap(pl_module, wrapper)
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

    spec = spec("microbatch")

    def __init__(self, policy: MicroBatching | None = None) -> None:
        self.policy = policy or MicroBatching(1)

    def is_applicable(self, ctx: RungContext) -> tuple[bool, str]:
        if ctx.batch_size is not None and ctx.batch_size <= self.policy.micro_batch_size:
            return False, f"batch size {ctx.batch_size}: nothing to split"
        return self.policy.is_applicable(ctx.trainer, ctx.pl_module, ctx.batch)

    def apply(self, ctx: RungContext) -> MitigationResult:
        return self.policy.apply(ctx.trainer, ctx.pl_module, ctx.batch)

    def remove(self, ctx: RungContext) -> MitigationResult:
        return self.policy.remove(ctx.pl_module)

    def is_on(self, module: Any) -> bool:
        return is_micro_batching(module)

    def apply_to_copy(self, copy: Any, plan: CopyPlan) -> None:
        plan.micro_batch_size = self.policy.micro_batch_size

    def strategy_refusal(self, trainer: Any) -> str | None:
        return wrapping_strategy_refusal(trainer)

    def setup_refusal(self, trainer: Any, pl_module: Any) -> str | None:
        if not getattr(pl_module, "automatic_optimization", True):
            return "manual optimization runs its own backward, which cannot be split"
        return self.strategy_refusal(trainer)

    def check_pending(self, module: Any) -> bool:
        return micro_batching_check_pending(module)

    def refusal(self, module: Any) -> str | None:
        return micro_batching_refusal(module)
