"""Forecast without training: trace a few short training steps of a model and fit both predictors.

:func:`trace_training_steps` runs real training steps at a few short lengths under a memory probe,
as the callback measures them, and returns a fitted :class:`~lightning_seqmem.MemoryForecaster`. No
Lightning (:mod:`lightning_seqmem.cli.main` adapts a ``LightningModule``).

Example:
    >>> import torch
    >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
    >>> model = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2))
    >>> optimizer = torch.optim.AdamW(model.parameters())
    >>> batch = {"input_ids": torch.randint(0, 256, (2, 128))}
    >>> def loss_fn(model, batch):
    ...     return model(batch["input_ids"]).float().logsumexp(-1).mean()
    >>> forecaster = trace_training_steps(model, optimizer, batch, [16, 32, 64], loss_fn,
    ...                                   check_seq_lens=[128])
    >>> forecaster.forecast(1024, 2).method, round(forecaster.verifications[0].relative_error, 3)
    ('replay', 0.0)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping
from typing import Any, Callable, ContextManager, Iterable, Optional, Sequence

import torch
from torch import nn
from lightning_seqmem.measure.batch_tree import map_tensors
from lightning_seqmem.measure.tracker import flat_tensors

from lightning_seqmem.measure.batch_shape import infer_batch_shape
from lightning_seqmem.measure.batch import set_batch_sequence_length
from lightning_seqmem.core.checks import check_int
from lightning_seqmem.core.forecast import MemoryForecaster
from lightning_seqmem.core.records import PHASES, StepMemory
from lightning_seqmem.measure.probes import existing_tensors, make_probe
from lightning_seqmem.core.timeline import Trace

__all__ = ["batch_copy_at", "keep_outputs", "loss_of", "step_device", "trace_training_steps",
           "training_step_memory", "validation_step_memory"]

_KEPT: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("seqmem_kept", default=None)


def keep_outputs(output: Any) -> None:
    """Keep a ``training_step`` dict's other tensors, detached, to the end of the step running, as
    Lightning does for ``on_train_batch_end`` (the last call's: micro-batching returns its last)."""
    kept = _KEPT.get()
    if kept is not None and isinstance(output, Mapping):
        kept[:] = [t.detach() for k, v in output.items() if k != "loss" for t in flat_tensors(v)]

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def loss_of(output: Any, required: bool = True) -> Optional[torch.Tensor]:
    """The package's one reader of the loss in a ``training_step`` output, as Lightning reads it:
    the tensor, a mapping's ``"loss"`` or None (skipped; an error if ``required``); else TypeError.

    Example:
        >>> loss_of({"loss": torch.tensor(1.0), "log": 2})
        tensor(1.)
        >>> loss_of(None, required=False) is None
        True
        >>> loss_of({"logits": 1})  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        TypeError: training_step returned a dict without a 'loss' key; in automatic optimization it
        needs one
    """
    if isinstance(output, Mapping):
        loss = output.get("loss")
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"training_step returned a {type(output).__name__} without a 'loss' "
                            "key; in automatic optimization it needs one")
        return loss
    if output is None and not required:
        return None
    if not isinstance(output, torch.Tensor):
        raise TypeError(
            f"training_step returned {type(output).__name__}, not a loss tensor"
            + ("; a step that returns None is skipped by Lightning and has no backward to forecast"
               if output is None else "; return a Tensor, a dict with a 'loss' key, or None"))
    return output


def step_device(model: nn.Module, device: Optional[torch.device | str] = None) -> torch.device:
    """Where traced steps run: ``device``, else ``model``'s first parameter's (CPU without any).

    Example:
        >>> none = torch.nn.Identity()
        >>> step_device(torch.nn.Linear(2, 2)), step_device(none), step_device(none, "meta")
        (device(type='cpu'), device(type='cpu'), device(type='meta'))
    """
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    return torch.device(device)


def batch_copy_at(batch: Any, seq_len: int, device: torch.device) -> Any:
    """A copy of ``batch`` (new containers, tensors cut and copied) at ``seq_len``, on ``device``.

    Example:
        >>> batch = {"input_ids": torch.ones(2, 8, dtype=torch.long)}
        >>> batch_copy_at(batch, 4, torch.device("cpu"))["input_ids"].shape
        torch.Size([2, 4])
    """
    copy = map_tensors(batch, lambda x, *_: x, False)  # new containers, which the cut changes
    copy = set_batch_sequence_length(copy, seq_len) if not isinstance(copy, tuple) else copy
    return map_tensors(copy, lambda x, *_: x.to(device), False)


def training_step_memory(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any,
                         loss_fn: LossFn, probe: Any = None, record_events: bool = False,
                         context: Optional[Callable[[], ContextManager]] = None
                         ) -> Optional[StepMemory]:
    """Run one training step and return what ``probe`` measured (None without one). Lightning's
    order: forward (``loss_fn`` under ``context``, e.g. autocast), ``zero_grad(set_to_none=True)``,
    backward, optimizer step (the previous step's gradients are alive during the forward)."""
    if probe is not None:
        probe.start_step(existing_tensors(model, [optimizer], batch), record_events=record_events)
        probe.mark_phase("forward")
    kept = _KEPT.set([])  # (:func:`keep_outputs`)
    try:
        with (context() if context is not None else contextlib.nullcontext()):
            loss = loss_fn(model, batch)
        optimizer.zero_grad(set_to_none=True)
        if probe is not None:
            probe.mark_phase("backward")
        loss.backward()
        del loss
        if probe is not None:
            probe.mark_phase("optimizer")
        optimizer.step()
        return probe.end_step() if probe is not None else None
    except BaseException:
        if probe is not None:
            probe.abort()
        raise
    finally:
        _KEPT.reset(kept)


def validation_step_memory(model: nn.Module, optimizer: Any, batch: Any, probe: Any = None,
                           context: Optional[Callable[[], ContextManager]] = None
                           ) -> Optional[StepMemory]:
    """Run ``model.validation_step(batch, 0)`` as a fit's validation loop runs it (eval mode, no
    gradients; the parameters' gradients and ``optimizer``'s state alive) and return what
    ``probe`` measured: one ``forward`` phase (None without a probe). The mode is restored."""
    if probe is not None:
        probe.start_step(existing_tensors(model, [optimizer] if optimizer else [], batch),
                         record_events=True)
        probe.mark_phase("forward")
    training = model.training
    try:
        model.eval()
        with torch.no_grad(), (context() if context is not None else contextlib.nullcontext()):
            model.validation_step(batch, 0)
    except BaseException:
        if probe is not None:
            probe.abort()
        raise
    finally:
        model.train(training)
    return probe.end_step() if probe is not None else None


def trace_training_steps(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any,
                         seq_lens: Sequence[int], loss_fn: LossFn, *,
                         device: Optional[torch.device | str] = None, probe: str = "auto",
                         warmup_steps: int = 1,
                         context: Optional[Callable[[], ContextManager]] = None,
                         check_seq_lens: Iterable[int] = (),
                         forecaster: Optional[MemoryForecaster] = None) -> MemoryForecaster:
    """Trace one training step at each of ``seq_lens`` (after ``warmup_steps`` unmeasured ones);
    returns the forecaster with one measured point and one trace per length.

    Args:
        model, optimizer: what to step (changed: pass copies to keep the originals).
        batch: a batch at least as long as every length asked (each is cut from a copy of it).
        seq_lens: 2 or more short lengths to trace (tokens), e.g. ``[64, 128, 256]``.
        loss_fn: ``(model, batch) -> scalar loss``.
        device: where to run; default the model's parameters' device.
        probe: ``"auto"``, ``"cuda"`` or ``"tracker"`` (:func:`make_probe`).
        warmup_steps: unmeasured steps before each measured one (≥ 1: the first step has no
            optimizer state; on CUDA a new length may autotune kernels).
        context: a factory of the context the forward runs under (autocast for mixed precision).
        check_seq_lens: longer lengths measured after fitting, each verifying the forecast made
            for it beforehand (``forecaster.verifications``).
        forecaster: add to this forecaster instead of a new one.
    """
    lengths = sorted({int(L) for L in seq_lens})
    if len(lengths) < 2 or lengths[0] < 1:
        raise ValueError("`seq_lens` must hold 2 or more distinct positive lengths, got "
                         f"{list(seq_lens)!r}")
    check_int("warmup_steps", warmup_steps, accepted="an int >= 1")
    source_batch, source_len = infer_batch_shape(batch)
    too_long = [L for L in [*lengths, *check_seq_lens] if L > source_len]
    if too_long:
        raise ValueError(f"the batch has {source_len} tokens per row; cannot trace or check at "
                         f"{too_long} (lengths are cut from the batch, never padded): give a "
                         "longer batch or shorter lengths")
    device = step_device(model, device)
    memory_probe = make_probe(probe, device)
    block = 512 if memory_probe.name == "cuda" else 1
    forecaster = forecaster if forecaster is not None else MemoryForecaster()

    def measure(seq_len: int, record_events: bool) -> tuple[int, StepMemory]:
        step_batch = batch_copy_at(batch, seq_len, device)
        batch_size, _ = infer_batch_shape(step_batch)
        for _ in range(warmup_steps):
            training_step_memory(model, optimizer, step_batch, loss_fn, context=context)
        m = training_step_memory(model, optimizer, step_batch, loss_fn, memory_probe, record_events,
                                 context)
        assert m is not None
        return batch_size, m

    def add(seq_len: int, batch_size: int, m: StepMemory) -> None:
        phases = {p: m.phase_peak_bytes[p] for p in PHASES if p in m.phase_peak_bytes}
        forecaster.add_measurement(seq_len, batch_size, phases, m.reserved_bytes)

    model.train()
    for seq_len in lengths:
        batch_size, m = measure(seq_len, record_events=True)
        add(seq_len, batch_size, m)
        if m.events is not None:
            forecaster.add_trace(Trace(seq_len, batch_size, m.events, block_bytes=block,
                                       measured_peak_bytes=m.peak_bytes))
    for seq_len in sorted(set(int(L) for L in check_seq_lens) - set(lengths)):
        predicted = forecaster.forecast(seq_len, source_batch)
        batch_size, m = measure(seq_len, record_events=False)
        forecaster.verify(predicted, m.peak_bytes)
        add(seq_len, batch_size, m)
    return forecaster
