"""The report's breakdown section: breakdowns of real training steps, on copies, at safe lengths.

What ``seqmem forecast`` and ``SeqMemCallback(breakdown=True)`` show. Steps run the way forecast
steps run (:mod:`.traced_step`: Lightning's order, micro-batched as the ``microbatch`` mitigation
runs it) and several become one plain, JSON-able *section* (bytes) for the CLI, the report
(:mod:`lightning_seqmem.present.report` renders it) and TensorBoard:

* :func:`width_dims` / :func:`safe_seq_lens`: a tensor with two dimensions equal to L counts as
  attention scores, so L must differ from every model width (``d_model``, ``d_ff``, vocabulary,
  heads, head size, batch size); a colliding length is replaced by the nearest safe one;
* :func:`trace_breakdowns`: one warm-up then one traced step at each length, each with its
  Korthikanti et al. 2022 calibration (:func:`~.korthikanti.calibrate`);
* :func:`breakdown_section`: :func:`~.compare.compare_breakdowns` as per-kind, per-category and
  per-activation tables, each part extrapolated with its own polynomial, the attention share, the
  crossover length, :func:`~.findings.diagnose` findings and the calibration;
* :func:`end_of_fit_plan` / :func:`end_of_fit_section`: the breakdown at the end of a fit, from
  what training measured and a copy of the trained model.

Example:
    >>> import torch
    >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
    >>> model = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2))
    >>> lens, notes = safe_seq_lens([16, 32, 64], width_dims(model, batch_size=2),
    ...                             max_seq_len=64)
    >>> lens, notes[0]  # doctest: +NORMALIZE_WHITESPACE
    ([8, 24, 64], 'seq_len 32 equals a model width (an L×L tensor could not be told apart): traced
    at 24 instead')
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_seqmem.diagnostics.compare import compare_breakdowns
from lightning_seqmem.diagnostics.findings import MemoryDiagnosisWarning, diagnose
from lightning_seqmem.diagnostics.growth import classify_growth, fit_growth, polynomial_at
from lightning_seqmem.diagnostics.korthikanti import calibrate, model_dims
from lightning_seqmem.diagnostics.peak_trace import peak_site
from lightning_seqmem.diagnostics.traced_step import (LossFn, copy_for_tracing, run_training_step,
                                                      training_step_loss)
from lightning_seqmem.diagnostics.tracer import Breakdown, trace_breakdown
from lightning_seqmem.measure.batch_shape import infer_batch_shape
from lightning_seqmem.measure.steps import batch_copy_at, step_device
from lightning_seqmem.mitigations.microbatch.microbatch_functional import IGNORE_INDEX

__all__ = ["EndOfFitPlan", "breakdown_section", "end_of_fit_plan", "end_of_fit_section",
           "safe_seq_lens", "trace_breakdowns", "width_dims"]


# ----------------------------------------------------------------------------------------------
# Lengths
# ----------------------------------------------------------------------------------------------
def width_dims(model: nn.Module, batch_size: Optional[int] = None) -> set[int]:
    """Sizes a sequence length must not equal: activation dimensions other than L. Every
    dimension of every parameter except an embedding table's rows (not an activation dimension),
    the batch size, and the head count and head size read from the model's config.

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
    found = model_dims(model)
    if found is not None:
        hidden, heads, ffn = found
        dims.update({hidden, heads, ffn})
        if heads and hidden % heads == 0:
            dims.add(hidden // heads)
    dims.discard(1)
    return dims


def safe_seq_lens(candidates: Iterable[int], forbidden: set[int], max_seq_len: int, num: int = 3,
                  step: int = 8) -> tuple[list[int], list[str]]:
    """Up to ``num`` lengths to trace, none in ``forbidden``: the longest safe candidates; when
    fewer than ``num`` are safe, each colliding candidate (longest first) is replaced by the nearest
    safe length ``L ∓ step, L ∓ 2·step, …`` (shorter first, at most ``max_seq_len``). Two lengths at
    least when possible (the shortest chosen halved, made safe). Returns the lengths, ascending,
    and one note per replacement."""
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
                notes.append(f"seq_len {L} equals a model width (an L×L tensor could not be told "
                             f"apart): traced at {s} instead")
    if len(chosen) == 1:
        s = chosen[0] // 2 // step * step or chosen[0] // 2
        s = s if ok(s) else nearest(max(s, 1))
        if s is not None and s < chosen[0]:
            chosen.append(s)
    return sorted(chosen), notes


# ----------------------------------------------------------------------------------------------
# Steps
# ----------------------------------------------------------------------------------------------
def trace_breakdowns(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any,
                     seq_lens: Sequence[int], loss_fn: LossFn, *,
                     device: Optional[torch.device | str] = None,
                     context: Optional[Callable[[], ContextManager]] = None,
                     warmup_steps: int = 1, micro_batch_size: Optional[int] = None,
                     weighting: str = "auto", ignore_index: int = IGNORE_INDEX) -> list[Breakdown]:
    """One :func:`~.tracer.trace_breakdown` per length, after warm-up steps, each with its
    :func:`~.korthikanti.calibrate` calibration. Each length is cut from a copy of ``batch`` (never
    padded). The steps train ``model`` and ``optimizer``: pass copies (:func:`copy_for_tracing`).
    The model's buffers count as inputs (alive before the step, as the probe counts them).
    ``micro_batch_size``: run each step as micro-batches of that many samples, weighted as the
    ``microbatch`` mitigation weighs them (``weighting``, ``ignore_index``:
    :func:`~.traced_step.run_training_step`)."""
    device = step_device(model, device)
    _, source_len = infer_batch_shape(batch)
    model.train()
    out: list[Breakdown] = []
    for seq_len in sorted({int(L) for L in seq_lens}):
        if seq_len > source_len:
            raise ValueError(f"the batch has {source_len} tokens per row; cannot trace a breakdown "
                             f"at {seq_len}")
        step_batch = batch_copy_at(batch, seq_len, device)
        batch_size, _ = infer_batch_shape(step_batch)

        def step() -> None:
            run_training_step(model, optimizer, step_batch, loss_fn, context, micro_batch_size,
                              weighting, ignore_index)

        for _ in range(warmup_steps):
            step()
        existing = list(model.buffers()) + [t for t in tree_flatten(step_batch)[0]
                                            if isinstance(t, torch.Tensor)]
        breakdown = trace_breakdown(step, model, optimizer, existing, seq_len=seq_len,
                                    batch_size=batch_size, device_type=device.type)
        breakdown.calibration = calibrate(breakdown, model)
        out.append(breakdown)
    return out


# ----------------------------------------------------------------------------------------------
# The section
# ----------------------------------------------------------------------------------------------
def _row(name: dict[str, str], values: list[int], lens: list[int],
         coefficients: Optional[Sequence[float]], growth: Optional[str],
         extrapolate_to: Optional[int]) -> dict[str, Any]:
    if coefficients is None:
        coefficients = fit_growth(lens, values)
    if growth is None:
        growth = classify_growth(lens, values)
    row: dict[str, Any] = {**name, "bytes": list(values), "growth": growth,
                           "coefficients": list(coefficients)}
    row["extrapolated_bytes"] = (None if extrapolate_to is None else
                                 max(0, int(round(polynomial_at(coefficients, extrapolate_to)))))
    return row


def breakdown_section(breakdowns: Sequence[Breakdown], model: nn.Module, *,
                      extrapolate_to: Optional[int] = None,
                      measured_peak_bytes: Optional[Sequence[Optional[int]]] = None,
                      forecast_peak_bytes: Optional[int] = None,
                      notes: Sequence[str] = ()) -> dict[str, Any]:
    """Plain values (bytes, fractions) of breakdowns at two or more lengths: ``seq_lens``,
    ``peak_bytes`` (traced) and ``measured_peak_bytes`` (by training; ``None`` where not run);
    ``by_kind`` / ``by_category`` / ``by_part`` (alive at the peak) and ``activations`` (alive when
    backward starts), each row with ``bytes`` per length, ``growth``, polynomial ``coefficients``
    and ``extrapolated_bytes``; ``peak_site`` (:func:`~.peak_trace.peak_site`);
    ``extrapolated_peak_bytes`` (sum of the extrapolated kinds, at the traced peak moment, which
    can move at longer lengths) beside ``forecast_peak_bytes``; ``attention_share``;
    ``crossover_seq_len`` (``None``: never); ``diagnoses`` (at the longest length, not warned
    here); ``calibration`` (the longest length's); ``notes``; ``breakdowns`` (``to_dict()``)."""
    table = compare_breakdowns(breakdowns)
    lens = list(table.seq_lens)
    by_len = {b.seq_len: b for b in breakdowns}
    longest = by_len[lens[-1]]
    if extrapolate_to is not None and extrapolate_to <= lens[-1]:
        extrapolate_to = None
    by_kind = [_row({"kind": p.kind}, p.bytes, lens, p.coefficients, p.growth, extrapolate_to)
               for p in table.peak_kinds]
    by_part = [_row({"category": p.category, "kind": p.kind}, p.bytes, lens, p.coefficients,
                    p.growth, extrapolate_to)
               for p in table.peak_parts]
    categories: dict[str, list] = {}
    for p in table.peak_parts:
        values, coeffs = categories.setdefault(p.category, [[0] * len(lens), [0.0, 0.0, 0.0]])
        for i, b in enumerate(p.bytes):
            values[i] += b
        for i, c in enumerate(p.coefficients):
            coeffs[i] += c
    by_category = [_row({"category": c}, v, lens, k, None, extrapolate_to)
                   for c, (v, k) in categories.items()]
    activations = [_row({"category": p.category}, p.bytes, lens, p.coefficients, p.growth,
                        extrapolate_to)
                   for p in table.activation_parts]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemoryDiagnosisWarning)
        found = diagnose(longest, model)
    calibration = (longest.calibration if longest.calibration is not None
                   else calibrate(longest, model))
    measured = (list(measured_peak_bytes) if measured_peak_bytes is not None
                else [None] * len(lens))
    return {
        "seq_lens": lens, "batch_size": table.batch_size, "peak_bytes": list(table.peak_bytes),
        "measured_peak_bytes": measured, "peak_phase": [by_len[L].peak_phase for L in lens],
        "extrapolated_seq_len": extrapolate_to,
        "extrapolated_peak_bytes": (None if extrapolate_to is None
                                    else sum(r["extrapolated_bytes"] for r in by_kind)),
        "forecast_peak_bytes": forecast_peak_bytes,
        "by_kind": by_kind, "by_category": by_category, "by_part": by_part,
        "activations": activations,
        "attention_share": list(table.attention_share),
        "attention_share_extrapolated": (None if extrapolate_to is None
                                         else table.attention_share_at(extrapolate_to)),
        "attention_coefficients": list(table.attention_coefficients),
        "rest_coefficients": list(table.rest_coefficients),
        "crossover_seq_len": table.crossover_seq_len,
        "attention_backend": longest.attention_backend,
        "autocast_dtype": longest.autocast_dtype, "checkpointed": longest.checkpointed,
        "diagnoses": list(found), "peak_site": peak_site(longest).to_dict(),
        "calibration": calibration.to_dict() if calibration is not None else None,
        "notes": list(notes), "breakdowns": [by_len[L].to_dict() for L in lens],
    }


# ----------------------------------------------------------------------------------------------
# At the end of a fit
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EndOfFitPlan:
    """What the end-of-fit breakdown traces (:func:`end_of_fit_plan`)."""

    seq_lens: list[int]  # ascending, none equal to a model width
    measured_peak_bytes: list[Optional[int]]  # measured by training at each length (None: not run)
    extrapolate_to: int  # the curriculum's target when longer, else 4x the longest traced length
    notes: list[str]


def end_of_fit_plan(records: Sequence[Any], mitigations: Any, batch_len: int, batch_size: int,
                    forbidden: set[int], *, multiple_of: int = 8, target: int = 0,
                    room_bytes: Optional[float] = None) -> EndOfFitPlan:
    """Up to 3 lengths to trace at the end of a fit, from the run's ``records``
    (:class:`~lightning_seqmem.core.records.StepRecord`): the lengths measured (not warm-ups) under
    ``mitigations`` (the rungs on now) at ``batch_size``, up to ``batch_len`` (the kept batch's);
    with fewer than two, any length measured up to ``batch_len`` and ``batch_len`` itself.
    ``room_bytes`` (on a GPU: what a copy may take beside the trained model) leaves out, with a
    note, lengths whose measured growth in a step exceeds it. Lengths equal to a ``forbidden``
    width are replaced (:func:`safe_seq_lens`, in steps of ``multiple_of``). Raises RuntimeError
    with fewer than two lengths to trace.

    Example:
        >>> from types import SimpleNamespace as R
        >>> runs = [R(seq_len=L, warmup=False, mitigations=(), batch_size=2, peak_bytes=L,
        ...           start_bytes=0) for L in (32, 64)]
        >>> plan = end_of_fit_plan(runs, (), 64, 2, {32}, target=1024)
        >>> plan.seq_lens, plan.measured_peak_bytes, plan.extrapolate_to, len(plan.notes)
        ([24, 64], [None, 64], 1024, 1)
    """
    records = [r for r in records if r.seq_len <= batch_len]
    same = [r for r in records
            if not r.warmup and r.mitigations == mitigations and r.batch_size == batch_size]
    candidates = sorted({r.seq_len for r in same})
    if len(candidates) < 2:  # e.g. one length since the last rung: any length the batch covers
        candidates = sorted({r.seq_len for r in records} | {batch_len})
    notes: list[str] = []
    if room_bytes is not None:  # the copy sits beside the trained model: trace only what fits
        growth = {L: max(r.peak_bytes - r.start_bytes for r in records if r.seq_len == L)
                  for L in candidates if any(r.seq_len == L for r in records)}
        fitting = [L for L in candidates if growth.get(L, 0) <= room_bytes]
        if len(fitting) < len(candidates):
            notes.append(f"lengths {sorted(set(candidates) - set(fitting))} not traced: a copy of "
                         "the model would not fit beside the trained one on the GPU")
        candidates = fitting
        batch_len = max(candidates, default=0)
    lengths, replaced = safe_seq_lens(candidates, forbidden, batch_len, num=3, step=multiple_of)
    if len(lengths) < 2:
        raise RuntimeError(f"fewer than two lengths to trace (candidates {candidates}, kept batch "
                           f"of {batch_len} tokens)")
    measured = [max((r.peak_bytes for r in same if r.seq_len == L), default=None)
                for L in lengths]
    longest = lengths[-1]
    return EndOfFitPlan(lengths, measured, target if target > longest else 4 * longest,
                        notes + replaced)


def end_of_fit_section(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any,
                       plan: EndOfFitPlan, *, device: torch.device | str,
                       context: Optional[Callable[[], ContextManager]] = None,
                       micro_batch_size: Optional[int] = None, weighting: str = "auto",
                       ignore_index: int = IGNORE_INDEX, forecast_peak_bytes: Optional[int] = None,
                       ) -> tuple[dict[str, Any], list[Breakdown]]:
    """``(section, breakdowns)`` of a trained ``model``: one warm-up and one traced step at each of
    ``plan.seq_lens``, on a copy of it and of ``optimizer`` (:func:`copy_for_tracing`), under
    ``context`` (autocast) and micro-batched as the run is; the RNG state is restored."""
    device = torch.device(device)
    rng_devices = ([device.index if device.index is not None else torch.cuda.current_device()]
                   if device.type == "cuda" else [])
    with torch.random.fork_rng(devices=rng_devices), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*`callback.log\\(\\)`.*")
        copy, copy_optimizer = copy_for_tracing(model, optimizer)
        try:
            breakdowns = trace_breakdowns(
                copy, copy_optimizer, batch, plan.seq_lens, training_step_loss, device=device,
                context=context, micro_batch_size=micro_batch_size, weighting=weighting,
                ignore_index=ignore_index)
        finally:
            del copy_optimizer
    notes = list(plan.notes)
    if micro_batch_size:
        notes.append(f"traced with micro-batches of {micro_batch_size} sample(s), as the "
                     "microbatch mitigation runs")
    section = breakdown_section(breakdowns, copy, extrapolate_to=plan.extrapolate_to,
                                measured_peak_bytes=plan.measured_peak_bytes,
                                forecast_peak_bytes=forecast_peak_bytes, notes=notes)
    del copy
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return section, breakdowns
