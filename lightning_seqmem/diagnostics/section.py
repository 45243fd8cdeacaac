"""Breakdowns of real training steps, on copies, at safe lengths: what ``seqmem forecast`` and
``SeqMemCallback(breakdown=True)`` show.

:mod:`lightning_seqmem.diagnostics.breakdown` attributes one traced step to modules and kinds. This module runs
those steps the way :mod:`lightning_seqmem.measure.steps` runs forecast steps (Lightning's order: forward,
``zero_grad``, backward, optimizer step; micro-batches when the model's ``training_step`` is
micro-batched) and turns several of them into one plain, JSON-able *section* for the CLI, the report
and TensorBoard:

* :func:`copy_for_tracing`: a deep copy of a model and its optimizer (a new optimizer of the same
  class over the copy's parameters, loaded with a deep copy of the original's state), so that the
  traced steps train nothing the user holds;
* :func:`width_dims` / :func:`safe_seq_lens`: a tensor is counted as attention scores when two of
  its dimensions equal L, so L must differ from every model width (``d_model``, ``d_ff``, the
  vocabulary, heads, head size, batch size); a colliding length is replaced by the nearest safe one;
* :func:`trace_breakdowns`: one warm-up step then one traced step at each length;
* :func:`breakdown_section`: :func:`~lightning_seqmem.diagnostics.breakdown.compare_breakdowns` as per-kind,
  per-category and per-activation tables, each part extrapolated to a longer length with its own
  polynomial, the attention share, the crossover length, :func:`~lightning_seqmem.diagnostics.breakdown.diagnose`
  findings and the Korthikanti et al. 2022 calibration.

Bytes everywhere; :mod:`lightning_seqmem.present.report` renders the section.

Example:
    >>> import torch
    >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
    >>> model = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2))
    >>> lens, notes = safe_seq_lens([16, 32, 64], width_dims(model, batch_size=2), max_seq_len=64)
    >>> lens, notes[0]
    ([8, 24, 64], 'seq_len 32 equals a model width (an L×L tensor could not be told apart): traced at 24 instead')
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any, Callable, ContextManager, Iterable, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_seqmem.measure.batch import infer_batch_shape
from lightning_seqmem.diagnostics.breakdown import (
    Breakdown,
    MemoryDiagnosisWarning,
    _model_dims,
    classify_growth,
    compare_breakdowns,
    diagnose,
    fit_growth,
    trace_breakdown,
)
from lightning_seqmem.measure.steps import _cut, training_step_memory

__all__ = [
    "breakdown_section",
    "copy_for_tracing",
    "safe_seq_lens",
    "trace_breakdowns",
    "training_step_loss",
    "width_dims",
]

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def training_step_loss(module: nn.Module, batch: Any) -> torch.Tensor:
    """``module.training_step(batch, 0)``'s loss, read as Lightning reads it (a tensor or ``["loss"]``)."""
    output = module.training_step(batch, 0)  # type: ignore[operator]
    if isinstance(output, dict):
        output = output.get("loss")
    if not isinstance(output, torch.Tensor):
        raise ValueError("training_step returned no loss tensor (manual optimisation is not supported)")
    return output


# ----------------------------------------------------------------------------------------------
# Copies
# ----------------------------------------------------------------------------------------------
def copy_for_tracing(
    model: nn.Module, optimizer: Optional[torch.optim.Optimizer]
) -> tuple[nn.Module, Optional[torch.optim.Optimizer]]:
    """A deep copy of ``model`` and an optimizer of the same class over the copy's parameters.

    The new optimizer gets the original's hyper-parameters (``param_groups``, the learning rate a
    scheduler set included) and a deep copy of its state (step counts, moments), so a step of the
    copy allocates what a step of the original would, and changes nothing of the original. An
    optimizer whose constructor does not take its ``defaults`` back is deep-copied instead, its
    parameters mapped to the copy's. A ``LightningModule`` copy is detached from its trainer.

    Example:
        >>> lin = nn.Linear(4, 4)
        >>> opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
        >>> lin(torch.ones(2, 4)).sum().backward(); opt.step()
        >>> lin2, opt2 = copy_for_tracing(lin, opt)
        >>> type(opt2).__name__, opt2.param_groups[0]["lr"], opt2.state[lin2.weight]["step"].item()
        ('AdamW', 0.1, 1.0)
        >>> opt2.state[lin2.weight]["exp_avg"] is opt.state[lin.weight]["exp_avg"]
        False
    """
    memo: dict[int, Any] = {}
    model_copy = copy.deepcopy(model, memo)
    if optimizer is None:
        return model_copy, None
    params = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [i for i, p in enumerate(params) if id(p) not in memo]
    if missing:
        raise ValueError(f"the optimizer holds {len(missing)} parameter(s) that are not the model's; cannot copy it")
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [memo[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    try:
        optimizer_copy = type(optimizer)(groups, **optimizer.defaults)
        optimizer_copy.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # deep: load_state_dict keeps tensors
    except Exception:  # noqa: BLE001 - an optimizer with its own constructor: copy it, parameters mapped
        optimizer_copy = copy.deepcopy(optimizer, {**memo})
    return model_copy, optimizer_copy


# ----------------------------------------------------------------------------------------------
# Lengths
# ----------------------------------------------------------------------------------------------
def width_dims(model: nn.Module, batch_size: Optional[int] = None) -> set[int]:
    """Sizes a sequence length must not equal: activation dimensions other than L.

    Every dimension of every parameter (widths, ``d_ff``, the vocabulary through the output layer)
    except an embedding table's number of rows (a position table's rows are not an activation
    dimension), embedding widths, the batch size, and the head count and head size read from the
    model's config.

    Example:
        >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
        >>> sorted(width_dims(GPT(GPTConfig(n_layer=1, d_model=32, n_head=2)), batch_size=4))
        [2, 4, 16, 32, 96, 128, 256]
    """
    dims: set[int] = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            shape = tuple(p.shape)
            if isinstance(module, nn.Embedding) and p is module.weight:
                shape = shape[1:]
            dims.update(int(d) for d in shape)
    if batch_size:
        dims.add(int(batch_size))
    found = _model_dims(model)
    if found is not None:
        hidden, heads, ffn = found
        dims.update({hidden, heads, ffn})
        if heads and hidden % heads == 0:
            dims.add(hidden // heads)
    dims.discard(1)
    return dims


def safe_seq_lens(
    candidates: Iterable[int],
    forbidden: set[int],
    max_seq_len: int,
    num: int = 3,
    step: int = 8,
) -> tuple[list[int], list[str]]:
    """Up to ``num`` lengths to trace, the longest candidates first, none in ``forbidden``.

    Candidates that are safe are kept as they are (the longest ``num``); when fewer than ``num``
    are, each colliding candidate (longest first) is replaced by the nearest safe length
    ``L ∓ step, L ∓ 2·step, …`` (shorter first, never above ``max_seq_len``) until ``num`` are
    chosen. Two lengths at least when possible (the shortest chosen halved, made safe). Returns
    the lengths, ascending, and one note per replacement.
    """
    cands = sorted({int(L) for L in candidates if 1 <= int(L) <= max_seq_len}, reverse=True)
    chosen: list[int] = []
    notes: list[str] = []

    def ok(L: int) -> bool:
        return 1 <= L <= max_seq_len and L not in forbidden and L not in chosen

    def nearest(L: int) -> Optional[int]:
        for k in range(1, 64):
            for s in (L - k * step, L + k * step):
                if ok(s):
                    return s
        return None

    for L in cands:
        if len(chosen) < num and ok(L):
            chosen.append(L)
    for L in cands:
        if len(chosen) >= num:
            break
        if L in forbidden:
            s = nearest(L)
            if s is not None:
                chosen.append(s)
                notes.append(
                    f"seq_len {L} equals a model width (an L×L tensor could not be told apart): traced at {s} instead"
                )
    if len(chosen) == 1:
        s = chosen[0] // 2 // step * step or chosen[0] // 2
        s = s if ok(s) else nearest(max(s, 1))
        if s is not None and s < chosen[0]:
            chosen.append(s)
    return sorted(chosen), notes


# ----------------------------------------------------------------------------------------------
# Steps
# ----------------------------------------------------------------------------------------------
def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, loss_fn: LossFn,
          context: Optional[Callable[[], ContextManager]], micro_batch_size: Optional[int]) -> None:
    """One training step in Lightning's order (micro-batched like :mod:`.mitigations.microbatch`)."""
    if not micro_batch_size:
        training_step_memory(model, optimizer, batch, loss_fn, context=context)
        return
    ctx = context if context is not None else contextlib.nullcontext
    from lightning_seqmem.mitigations import split_batch

    parts = split_batch(batch, micro_batch_size)
    total = sum(infer_batch_shape(p)[0] for p in parts)
    optimizer.zero_grad(set_to_none=True)  # the micro-batching wrapper zeroes before the first part
    for part in parts:
        with ctx():
            loss = loss_fn(model, part) * (infer_batch_shape(part)[0] / total)
        loss.backward()
        del loss
    optimizer.step()


def trace_breakdowns(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    seq_lens: Sequence[int],
    loss_fn: LossFn,
    *,
    device: Optional[torch.device | str] = None,
    context: Optional[Callable[[], ContextManager]] = None,
    warmup_steps: int = 1,
    micro_batch_size: Optional[int] = None,
) -> list[Breakdown]:
    """One :func:`~lightning_seqmem.diagnostics.breakdown.trace_breakdown` per length, after warm-up steps.

    Each length is cut from a copy of ``batch`` (never padded). The steps train ``model`` and
    ``optimizer``: pass copies (:func:`copy_for_tracing`). Buffers of the model count as inputs
    (they are alive before the step, as the callback's probe counts them). ``micro_batch_size``:
    run each step as micro-batches of that many samples, as the ``microbatch`` mitigation does.
    """
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    device = torch.device(device)
    _, source_len = infer_batch_shape(batch)
    model.train()
    out: list[Breakdown] = []
    for seq_len in sorted({int(L) for L in seq_lens}):
        if seq_len > source_len:
            raise ValueError(f"the batch has {source_len} tokens per row; cannot trace a breakdown at {seq_len}")
        step_batch = _cut(batch, seq_len, device)
        batch_size, _ = infer_batch_shape(step_batch)

        def step() -> None:
            _step(model, optimizer, step_batch, loss_fn, context, micro_batch_size)

        for _ in range(warmup_steps):
            step()
        existing = list(model.buffers()) + [t for t in tree_flatten(step_batch)[0] if isinstance(t, torch.Tensor)]
        out.append(trace_breakdown(step, model, optimizer, existing, seq_len=seq_len, batch_size=batch_size,
                                   device_type=device.type))
    return out


# ----------------------------------------------------------------------------------------------
# The section
# ----------------------------------------------------------------------------------------------
def _at(coefficients: Sequence[float], seq_len: float) -> int:
    return max(0, int(round(sum(c * seq_len**p for p, c in enumerate(coefficients)))))


def _row(name: dict[str, str], values: list[int], lens: list[int], coefficients: Optional[Sequence[float]],
         growth: Optional[str], extrapolate_to: Optional[int]) -> dict[str, Any]:
    if coefficients is None:
        coefficients = fit_growth(lens, values)
    if growth is None:
        growth = classify_growth(lens, values)
    row: dict[str, Any] = {**name, "bytes": list(values), "growth": growth, "coefficients": list(coefficients)}
    row["extrapolated_bytes"] = None if extrapolate_to is None else _at(coefficients, extrapolate_to)
    return row


def breakdown_section(
    breakdowns: Sequence[Breakdown],
    model: nn.Module,
    *,
    extrapolate_to: Optional[int] = None,
    measured_peak_bytes: Optional[Sequence[Optional[int]]] = None,
    forecast_peak_bytes: Optional[int] = None,
    notes: Sequence[str] = (),
) -> dict[str, Any]:
    """Plain values of breakdowns at two or more lengths (bytes, fractions).

    Keys: ``seq_lens``, ``batch_size``, ``peak_bytes`` (traced) and ``measured_peak_bytes`` (what
    training measured at each length, ``None`` where it did not run), ``extrapolated_seq_len``,
    ``by_kind`` / ``by_category`` / ``by_part`` (what is alive at the peak) and ``activations``
    (alive when backward starts, by category), each row with ``bytes`` per length, ``growth``
    (constant / linear / quadratic), the polynomial ``coefficients`` and ``extrapolated_bytes``;
    ``extrapolated_peak_bytes`` (sum of the extrapolated kinds: where the parts are at the
    traced peak moment, which can move at longer lengths) beside ``forecast_peak_bytes`` (the
    forecaster's, when given); ``attention_share`` per length and extrapolated,
    ``crossover_seq_len`` (``None``: attention activations never outgrow the rest), ``diagnoses``
    (the :func:`~lightning_seqmem.diagnostics.breakdown.diagnose` findings at the longest length; not warned
    here), ``calibration`` (longest length), ``notes`` and ``breakdowns`` (each ``to_dict()``).
    """
    table = compare_breakdowns(breakdowns)
    lens = list(table.seq_lens)
    by_len = {b.seq_len: b for b in breakdowns}
    longest = by_len[lens[-1]]
    if extrapolate_to is not None and extrapolate_to <= lens[-1]:
        extrapolate_to = None
    by_kind = [_row({"kind": p.kind}, p.bytes, lens, p.coefficients, p.growth, extrapolate_to) for p in table.peak_kinds]
    by_part = [_row({"category": p.category, "kind": p.kind}, p.bytes, lens, p.coefficients, p.growth, extrapolate_to)
               for p in table.peak_parts]
    categories: dict[str, list] = {}
    for p in table.peak_parts:
        values, coeffs = categories.setdefault(p.category, [[0] * len(lens), [0.0, 0.0, 0.0]])
        for i, b in enumerate(p.bytes):
            values[i] += b
        for i, c in enumerate(p.coefficients):
            coeffs[i] += c
    by_category = [_row({"category": c}, v, lens, k, None, extrapolate_to) for c, (v, k) in categories.items()]
    activations = [_row({"category": p.category}, p.bytes, lens, p.coefficients, p.growth, extrapolate_to)
                   for p in table.activation_parts]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemoryDiagnosisWarning)
        found = diagnose(longest, model)
    measured = list(measured_peak_bytes) if measured_peak_bytes is not None else [None] * len(lens)
    return {
        "seq_lens": lens,
        "batch_size": table.batch_size,
        "peak_bytes": list(table.peak_bytes),
        "measured_peak_bytes": measured,
        "peak_phase": [by_len[L].peak_phase for L in lens],
        "extrapolated_seq_len": extrapolate_to,
        "extrapolated_peak_bytes": None if extrapolate_to is None else sum(r["extrapolated_bytes"] for r in by_kind),
        "forecast_peak_bytes": forecast_peak_bytes,
        "by_kind": by_kind,
        "by_category": by_category,
        "by_part": by_part,
        "activations": activations,
        "attention_share": list(table.attention_share),
        "attention_share_extrapolated": None if extrapolate_to is None else table.attention_share_at(extrapolate_to),
        "attention_coefficients": list(table.attention_coefficients),
        "rest_coefficients": list(table.rest_coefficients),
        "crossover_seq_len": table.crossover_seq_len,
        "attention_backend": longest.attention_backend,
        "autocast_dtype": longest.autocast_dtype,
        "checkpointed": longest.checkpointed,
        "diagnoses": list(found),
        "calibration": longest.calibration.to_dict() if longest.calibration is not None else None,
        "notes": list(notes),
        "breakdowns": [by_len[L].to_dict() for L in lens],
    }


def run_breakdown(planner: Any, kept: Optional[tuple[int, Any]], shape_of: Callable[[Any], tuple[int, int]],
                  device: Any, trainer: Any, pl_module: Any) -> tuple[dict[str, Any], list[Any], Any]:
    """The memory breakdown at the end of fit (``SeqMemCallback(breakdown=True)``).

    One warm-up and one traced training step at each of up to 3 lengths (the longest measured
    under the mitigations now on, none equal to a model width), on a copy of ``pl_module`` and of
    the first optimizer, from ``kept`` = ``(seq_len, CPU copy of the longest batch)``, with the
    precision plugin's autocast and the micro-batching now on. The RNG state is restored.
    Returns ``(section, breakdowns, table)``: the report's section, a ``Breakdown`` per length
    and their comparison; each diagnosis is given to ``planner`` as advice.
    """
    from lightning_seqmem.mitigations import is_micro_batching
    from lightning_seqmem.measure.probes import existing_tensors

    if kept is None:
        raise RuntimeError("no training batch was kept (SeqMemCallback(breakdown=True) keeps one per step)")
    if not trainer.optimizers:
        raise RuntimeError("the trainer has no optimizer to step")
    batch_len, batch = kept
    batch_size = int(shape_of(batch)[0])
    device = device or pl_module.device
    optimizer = trainer.optimizers[0]
    records = [r for r in planner.records if r.seq_len <= batch_len]
    same = [r for r in records if not r.warmup and r.mitigations == planner.applied_mitigations and r.batch_size == batch_size]
    candidates = sorted({r.seq_len for r in same})
    if len(candidates) < 2:  # e.g. one length since the last mitigation: any length the batch covers
        candidates = sorted({r.seq_len for r in records} | {batch_len})
    notes: list[str] = []
    if device.type == "cuda":  # the copy sits beside the trained model: trace only what fits next to it
        state = sum(t.numel() * t.element_size() for t in existing_tensors(pl_module, [optimizer], None))
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        room = 0.9 * (free - state)
        dynamic = {L: max(r.peak_bytes - r.start_bytes for r in records if r.seq_len == L) for L in candidates if
                   any(r.seq_len == L for r in records)}
        fitting = [L for L in candidates if dynamic.get(L, 0) <= room]
        if len(fitting) < len(candidates):
            notes.append(f"lengths {sorted(set(candidates) - set(fitting))} not traced: a copy of the model would "
                         "not fit beside the trained one on the GPU")
        candidates = fitting
        batch_len = max(candidates, default=0)
    step = planner.curriculum.multiple_of if planner.curriculum is not None else 8
    lengths, replaced = safe_seq_lens(candidates, width_dims(pl_module, batch_size), batch_len, num=3, step=step)
    notes += replaced
    if len(lengths) < 2:
        raise RuntimeError(f"fewer than two lengths to trace (candidates {candidates}, kept batch of {batch_len} tokens)")
    wrapper = pl_module.__dict__.get("training_step")
    micro = wrapper.micro_batch_size if is_micro_batching(pl_module) else None
    rng_devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*`callback.log\\(\\)`.*")
        model, model_optimizer = copy_for_tracing(pl_module, optimizer)
        assert model_optimizer is not None
        try:
            breakdowns = trace_breakdowns(
                model, model_optimizer, batch, lengths, training_step_loss, device=device,
                context=trainer.precision_plugin.train_step_context, micro_batch_size=micro,
            )
        finally:
            del model_optimizer
    longest = lengths[-1]
    target = planner.curriculum.target if planner.curriculum is not None else 0
    extrapolate_to = target if target > longest else 4 * longest
    try:
        forecast_peak = planner.forecaster.forecast(extrapolate_to, batch_size).peak_bytes
    except Exception:  # noqa: BLE001 - the table stands without it
        forecast_peak = None
    measured = []
    for L in lengths:
        peaks = [r.peak_bytes for r in same if r.seq_len == L]
        measured.append(max(peaks) if peaks else None)
    if micro:
        notes.append(f"traced with micro-batches of {micro} sample(s), as the microbatch mitigation runs")
    section = breakdown_section(breakdowns, model, extrapolate_to=extrapolate_to, measured_peak_bytes=measured,
                                forecast_peak_bytes=forecast_peak, notes=notes)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    from lightning_seqmem.core.advice import Advice

    for i, finding in enumerate(section["diagnoses"]):
        planner.advise(Advice("diagnosis", f"diagnosis-{i}", f"seqmem: {finding}", MemoryDiagnosisWarning))
    return section, breakdowns, compare_breakdowns(breakdowns)
