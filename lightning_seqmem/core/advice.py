"""Every warning the planner gives, as values: what kind it is, a key it is given once under, and
its words. Plain Python (no torch, no Lightning); the callback turns each into ``rank_zero_warn``.

Example:
    >>> a = over_budget_stage(512, 9_000_000, 10_000_000, "replay", 8_000_000, 10_000_000, 0.2,
    ...                       fit=384, action="cap at seq_len=384", skipped=[])
    >>> a.kind, a.key
    ('stage_over_budget', 'oom-512-none')
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

from lightning_seqmem.core.records import (ForecastMismatchWarning, PredictedOOMWarning,
                                           SeqMemFailureWarning)
from lightning_seqmem.core.rungs import remaining_advice
from lightning_seqmem.core.trust import NAMES
from lightning_seqmem.core.units import format_bytes

KINDS = {
    "stage_over_budget": "a curriculum stage (or the current one) did not fit: a mitigation was "
                         "switched on or the curriculum capped",
    "batch_over_budget": "a batch was predicted or measured over the budget",
    "validation_over_budget": "a validation batch was predicted over the budget (its dry run): "
                              "rungs switched on before it, or what to change",
    "replay_disagrees": "the replay of short traces disagreed with the dry run at the target "
                        "length",
    "dry_run_unavailable":
        "the dry run could not simulate this model: the replay and quadratic fit answer",
    "first_step_over_budget": "the first step already exceeded the usable budget",
    "forecast_mismatch": "a forecast missed the measurement by more than the tolerance",
    "predictor_wrong": "a predictor (dry run, replay or quadratic fit) missed a measured step "
                       "beyond the tolerance: not trusted until right again",
    "mitigation_failed": "a mitigation could not be switched on and was skipped",
    "mitigation_dropped": "a mitigation is not available to this run",
    "attention_still_quadratic": "after the attention switch, memory still grew quadratically",
    "rung_added_memory":
        "a rung switched on raised the measured peak at the length it was decided for",
    "precision": "32-bit precision: bf16-mixed recommended",
    "diagnosis": "the memory breakdown found a problem (see the breakdown's diagnoses)",
    "failure": "internal failure: the callback stopped measuring",
    "output_failed": "the report, the figure, the TensorBoard layout or the memory breakdown could "
                     "not be made",
    "budget_unreachable":
        "no setting can meet the memory budget: the run stopped before training over it",
    "curriculum_not_applied": "the batch could not be cut to the curriculum's length",
    "compiled_module": "the module is torch.compile'd: which steps are measured and which program "
                       "forecasts describe",
    "length_limit":
        "the curriculum reaches past the model's own position limit: it stops at that limit",
    "outside_fit": "trainer.validate(), test() or predict(): not measured, not judged",
}
"""Every kind of advice, with what it means (the report groups warnings by kind)."""


@dataclass(frozen=True)
class Advice:
    """One warning: ``kind`` (a key of :data:`KINDS`), ``key`` (given once per run), ``text``."""

    kind: str
    key: str
    text: str
    category: type = UserWarning


def _usable(budget: int, usable: int, margin: float) -> str:
    return (f"the usable budget {format_bytes(usable)} (budget {format_bytes(budget)} minus "
            f"safety_margin={margin})")


def _measured(peak: int, bound: int) -> str:
    """A measured peak, with the reserved memory it was judged by where that is larger (CUDA)."""
    if bound > peak:
        return f"{format_bytes(peak)} allocated, {format_bytes(bound)} reserved by the allocator"
    return format_bytes(peak)


def _peaked(peak: int, bound: int, method: str, measured: bool) -> str:
    """How a length or batch peaks: as measured, or as ``method`` predicts (with its bound)."""
    if measured:
        return f"already peaked at {_measured(peak, bound)}"
    return (f"is predicted to peak at {format_bytes(peak)} (upper bound {format_bytes(bound)}, "
            f"{method})")


def over_budget_stage(seq_len: int, peak: int, bound: int, method: str, usable: int, budget: int,
                      margin: float, fit: int, action: str, skipped: Sequence[str],
                      measured: bool = False, applied: Sequence[str] = ()) -> Advice:
    """A stage (the next, or the one running) does not fit: what was seen and what is done."""
    why = f"seq_len={seq_len} {_peaked(peak, bound, method, measured)}"
    fits = (f"The largest length forecast to fit is {fit}. " if fit > 0
            else "No length is forecast to fit. ")
    skipped_text = f" (skipped: {'; '.join(skipped)})" if skipped else ""
    return Advice("stage_over_budget", f"oom-{seq_len}-{'+'.join(applied) or 'none'}",
                  f"seqmem: {why}, over {_usable(budget, usable, margin)}. "
                  f"{fits}{action}{skipped_text}.", PredictedOOMWarning)


def over_budget_batch(seq_len: int, batch_size: int, peak: int, bound: int, method: str,
                      usable: int, budget: int, margin: float, fit: int, applied: Sequence[str],
                      rungs: Sequence[str] = (), measured: bool = False, still_over: bool = False,
                      inapplicable: Sequence[str] = (), device: str = "cuda") -> Advice:
    """Without a curriculum: a batch of the data's own length does not fit."""
    head = (f"seqmem: a batch of seq_len={seq_len}, batch {batch_size} "
            f"{_peaked(peak, bound, method, measured)}, over {_usable(budget, usable, margin)}")
    if rungs:
        names = ", ".join(map(repr, rungs))
        tail = (f"; switching on {names} before it runs, but it is forecast over the budget even "
                "then: cap the padded length of your collate function or lower the batch size."
                if still_over else
                f"; switching on the next mitigation{'s' if len(rungs) > 1 else ''}, {names}, "
                "before it runs.")
        return Advice("batch_over_budget",
                      f"oom-batch-{seq_len}-{batch_size}-{'+'.join(applied) or 'none'}",
                      head + tail, PredictedOOMWarning)
    fits = (f"the largest length forecast to fit is {fit}" if fit > 0
            else "no length is forecast to fit")
    return Advice("batch_over_budget", f"oom-batch-{seq_len}-{batch_size}",
                  f"{head}; {fits}, and no mitigation is left to switch on. Cap the padded length "
                  "of your collate function, lower the batch size, or "
                  f"{remaining_advice(applied, inapplicable, device)}.", PredictedOOMWarning)


def validation_over_budget(seq_len: int, batch_size: int, peak: int, bound: int, usable: int,
                           budget: int, margin: float, applied: Sequence[str],
                           ranks_apart: bool = False) -> Advice:
    """A validation batch is predicted over the budget and no rung was switched for it: said once,
    before it runs; nothing is cut."""
    why = ("the ranks, counting their validation batches differently, cannot agree on rungs for it"
           if ranks_apart else "no rung left makes its dry run fit")
    return Advice(
        "validation_over_budget", "validation",  # once a run: the first shape over says it
        f"seqmem: a validation batch of seq_len={seq_len}, batch {batch_size} "
        f"{_peaked(peak, bound, 'dry run of validation_step', False)} with the rungs on now "
        f"({', '.join(applied) or 'none'}), over {_usable(budget, usable, margin)}, and "
        f"{why}. Validation batches are never cut: lower the validation batch size or padded "
        "length, or build the model with the attention kernel and loss it needs at that length.",
        PredictedOOMWarning)


def budget_unreachable(seq_len: int, batch_size: int, bound: int, method: str, usable: int,
                       budget: int, margin: float, applied: Sequence[str], shortest: int,
                       device: str = "cuda") -> Advice:
    """Nothing can meet the budget: ``seq_len`` does not fit with every rung this run can take
    (``applied``), and no length from ``shortest`` tokens up is forecast to fit. Training stops
    (:class:`~lightning_seqmem.core.records.MemoryBudgetError`) instead of running over the budget.

    >>> budget_unreachable(64, 4, 12_900_000, "dry_run", 943_718, 1_048_576, 0.1, ("attention",),
    ...                    8, "cpu").text[:72]
    'seqmem: memory_budget=1.0 MiB cannot be met: seq_len=64 (batch 4) is for'
    """
    how = "measured at" if method == "measured" else f"forecast ({method}) at"
    setting = f"with {', '.join(map(repr, applied))} on" if applied else "with no mitigation on"
    needed = format_bytes(int(bound / (1 - margin)) + 1) if margin < 1 else format_bytes(bound)
    return Advice("budget_unreachable", f"unreachable-{seq_len}-{batch_size}",
                  f"seqmem: memory_budget={format_bytes(budget)} cannot be met: seq_len={seq_len} "
                  f"(batch {batch_size}) is {how} {format_bytes(bound)} {setting}, over "
                  f"{_usable(budget, usable, margin)}, and no length from {shortest} tokens up is "
                  "forecast to fit. Training stops here instead of running over the budget. "
                  f"To run: raise `memory_budget` to at least {needed} for this length, lower the "
                  "batch size"
                  f"{', shard the model across GPUs (FSDP)' if device == 'cuda' else ''}, or "
                  "train a smaller model.", PredictedOOMWarning)


def held_over_budget(held: int, usable: int, budget: int, margin: float,
                     device: str = "cuda") -> Advice:
    """Nothing can meet the budget: the memory a measured step began with (parameters, gradients,
    optimizer state, the batch), which no rung lowers, is over it. Training stops.

    >>> held_over_budget(5_700_000, 4_718_592, 5_242_880, 0.1, "cpu").text[:70]
    'seqmem: memory_budget=5.0 MiB cannot be met: a measured step began wit'
    """
    needed = format_bytes(int(held / (1 - margin)) + 1)
    return Advice("budget_unreachable", "unreachable-held",
                  f"seqmem: memory_budget={format_bytes(budget)} cannot be met: a measured step "
                  f"began with {format_bytes(held)} already held (parameters, gradients, optimizer "
                  f"state, the batch), over {_usable(budget, usable, margin)}, and no mitigation "
                  "lowers that. Training stops here instead of running over the budget. To run: "
                  f"raise `memory_budget` well above {needed}"
                  f"{', shard the model across GPUs (FSDP)' if device == 'cuda' else ''}, use an "
                  "optimizer with less state, or train a smaller model.", PredictedOOMWarning)


def parameters_over_budget(param_bytes: int, usable: int, budget: int, margin: float) -> str:
    """Words for a budget below the model's own parameters and buffers (known before any step).

    >>> parameters_over_budget(1_900_000, 943_718, 1_048_576, 0.1)[:75]
    'seqmem: memory_budget=1.0 MiB cannot be met: the parameters and buffers alo'
    """
    needed = format_bytes(int(param_bytes / (1 - margin)) + 1)
    return (f"seqmem: memory_budget={format_bytes(budget)} cannot be met: the parameters and "
            f"buffers alone take {format_bytes(param_bytes)}, over "
            f"{_usable(budget, usable, margin)}, before any activation, gradient or optimizer "
            f"state. Raise `memory_budget` well above {needed} (training also holds gradients and "
            "optimizer state), or train a smaller model.")


def first_step_over_budget(start: int, peak: int, usable: int, budget: int,
                           margin: float) -> Advice:
    return Advice("first_step_over_budget", "budget-first-step",
                  f"seqmem: the first step already used {format_bytes(peak)} at its peak "
                  f"({format_bytes(start)} before it began), more than the usable budget "
                  f"{format_bytes(usable)}. The next batch switches a mitigation on or runs "
                  f"shorter; to avoid it, raise `memory_budget` (now {format_bytes(budget)}), "
                  f"lower `safety_margin` (now {margin}), or start the curriculum shorter.",
                  PredictedOOMWarning)


def forecast_mismatch(seq_len: int, batch_size: int, method: str, forecast: int, measured: int,
                      error: float, tolerance: float) -> Advice:
    if error < 0:
        why = ("Likely causes: dynamic padding or sequence packing (the batch's real length "
               "differs from its shape), a kernel whose choice depends on the length, or memory "
               "held outside the step. Later forecasts widen their bounds by this miss, and this "
               "length is traced again.")
    elif method == "quadratic":
        why = ("An over-prediction is safe. A quadratic fit of so few lengths puts all growth in "
               "the L² term; it tightens as more lengths are measured.")
    else:
        why = ("An over-prediction is safe. The traced program may differ at this length (a kernel "
               "choice that depends on the length); this length is traced again.")
    return Advice("forecast_mismatch", f"mismatch-{seq_len}-{batch_size}",
                  f"seqmem: the {method} forecast for seq_len={seq_len} (batch {batch_size}) was "
                  f"{format_bytes(forecast)}, measured {format_bytes(measured)} ({error:+.1%}, "
                  f"tolerance {tolerance:.0%}). {why}", ForecastMismatchWarning)


def mitigation_failed(name: str, detail: str) -> Advice:
    return Advice("mitigation_failed", f"mitigation-failed-{name}",
                  f"seqmem: could not switch on {name!r} ({detail}); skipping it on every rank.",
                  SeqMemFailureWarning)


def mitigations_dropped(names: Sequence[str], why: str) -> Advice:
    return Advice("mitigation_dropped", "mitigations-dropped",
                  f"seqmem: mitigations {list(names)} are off for this run: {why}.", UserWarning)


def length_limit(limit: int, reason: str, dropped: Sequence[int], stop: int) -> Advice:
    """The curriculum's stages past the model's own limit (its positions) are never run or dry-run.

    >>> print(length_limit(256, "n_positions", [512], 256).text)  # doctest: +NORMALIZE_WHITESPACE
    seqmem: the curriculum stage(s) [512] are past this model's limit of 256 tokens (n_positions):
    the curriculum stops at seq_len=256 and no length past 256 is dry-run or proposed.
    """
    return Advice("length_limit", "length-limit",
                  f"seqmem: the curriculum stage(s) {list(dropped)} are past this model's limit of "
                  f"{limit} tokens ({reason}): the curriculum stops at seq_len={stop} and no "
                  f"length past {limit} is dry-run or proposed.", UserWarning)


def attention_still_quadratic(detail: str, new_b: float, old_b: float) -> Advice:
    return Advice("attention_still_quadratic", "attention-still-quadratic",
                  f"seqmem: after switching attention ({detail}), memory still grows quadratically "
                  f"with the length ({new_b:.0f} B/token², was {old_b:.0f}): the kernel likely "
                  "fell back to a path that materialises the scores — an explicit attention mask, "
                  "attention dropout, or a dtype the fused kernel does not support.",
                  PredictedOOMWarning)


def rung_added_memory(name: str, seq_len: int, batch_size: int, before_bytes: int,
                      after_bytes: int) -> Advice:
    """A rung that raised the measured peak where it was switched on: later judgements stop taking
    the setting before it as a bound
    (:meth:`lightning_seqmem.plan.measured.MeasuredEvidence.memory_added`).

    >>> rung_added_memory("fused_loss", 128, 2, 2_000_000, 2_150_000).text[:73]
    'seqmem: switching on fused_loss raised the measured peak at seq_len=128 ('
    """
    return Advice("rung_added_memory", f"rung-added-memory-{name}",
                  f"seqmem: switching on {name} raised the measured peak at seq_len={seq_len} "
                  f"(batch {batch_size}) from {format_bytes(before_bytes)} to "
                  f"{format_bytes(after_bytes)} "
                  f"({(after_bytes - before_bytes) / max(before_bytes, 1):+.1%}): it costs memory "
                  "here (a fused loss on a small vocabulary, a tiled MLP at short lengths). "
                  f"Forecasts no longer count on it saving any; remove {name!r} from `mitigations` "
                  "if longer lengths do not need it.")


def precision(target: int, batch_size: int, fp32_peak: int, bf16_peak: int) -> Advice:
    """bf16-mixed advice, given only where a dry run of the step with bf16 autocast lowers the peak.

    >>> precision(512, 2, 6_000_000, 5_000_000).text[:60]
    'seqmem: this run is in 32-bit precision; a dry run of its st'
    """
    return Advice("precision", "precision",
                  "seqmem: this run is in 32-bit precision; a dry run of its step at "
                  f"seq_len={target} (batch {batch_size}) with bf16 autocast peaks at "
                  f"{format_bytes(bf16_peak)} instead of {format_bytes(fp32_peak)} "
                  f"({bf16_peak / max(fp32_peak, 1) - 1:+.0%}). Precision cannot change mid-run: "
                  "restart with Trainer(precision='bf16-mixed') to lower the peak.", UserWarning)


def nothing_fits(applied: Sequence[str], batch_size: int,
                 inapplicable: Sequence[str] = ()) -> str:
    """Words for a largest fitting length of 0: nothing fits, and what would.

    >>> nothing_fits(("attention",), 4)[:74]
    "nothing fits at any length with the current setting (mitigations ['attenti"
    """
    return (f"nothing fits at any length with the current setting (mitigations {list(applied)}, "
            f"batch {batch_size}); what would: a larger `memory_budget`, a smaller batch, or "
            f"{remaining_advice(applied, inapplicable)}")


def failure(where: str, error: str) -> Advice:
    return Advice("failure", "failure",
                  f"seqmem: internal failure in {where} ({error}); the callback stops measuring "
                  "and predicting for the rest of this run, and the curriculum stays at its "
                  "current length. Training goes on.", SeqMemFailureWarning)


def output_failed(what: str, error: str) -> Advice:
    return Advice("output_failed", f"failed-{what}", f"seqmem: could not write {what} ({error})",
                  SeqMemFailureWarning)


def curriculum_not_applied(asked: int, ran: int) -> Advice:
    """A batch ran at another length than the curriculum's (said once per asked length).

    >>> curriculum_not_applied(128, 96).text.split("; ")[1]
    'the record says 96, the length that ran'
    """
    why = ("the data is shorter than the stage" if ran < asked else
           "the batch could not be cut: a bare tensor or a tuple cannot change in place; return "
           "dicts or lists from the dataloader, or give the datamodule or dataset a "
           "`set_seq_len(n)` method")
    return Advice("curriculum_not_applied", f"curriculum-{asked}",
                  f"seqmem: the curriculum asked for seq_len={asked} but the batch the model "
                  f"received has {ran} tokens ({why}); the record says {ran}, the length that ran; "
                  "the curriculum holds: a stage counts only steps that ran at its length, so it "
                  "does not advance while batches do not reach it.", UserWarning)


def program_note(compiled: Optional[str], probe: str) -> str:
    """Which program the measurements and forecasts describe; empty for a module not compiled.

    >>> program_note(None, "tracker"), program_note("the module is compiled", "cuda")
    ('', 'of the compiled program (allocator counters; the module is compiled)')
    >>> program_note("compiled", "tracker")
    'of the eager program, not the compiled one (the tracker runs its steps eager; compiled)'
    """
    if not compiled:
        return ""
    if probe == "cuda":
        return f"of the compiled program (allocator counters; {compiled})"
    return ("of the eager program, not the compiled one (the tracker runs its steps eager; "
            f"{compiled})")


def compiled_module(reason: str, probe: str, every_n_steps: int) -> Advice:
    """Said once at the start of a run whose module is compiled: what is measured, of which program.

    >>> compiled_module("x", "tracker", 10).text.split(". ")[1][:60]
    'The live-tensor tracker is a TorchDispatchMode, and torch.co'
    """
    if probe == "cuda":
        text = (f"seqmem: {reason}. Steps are measured by the CUDA allocator's counters, which "
                "leave compilation alone, so measurements and forecasts are of the compiled "
                "program; no step is traced for the timeline replay (its dispatch mode would run "
                "that step eager), so forecasts come from the quadratic fit of the measured steps.")
    else:
        text = (f"seqmem: {reason}. The live-tensor tracker is a TorchDispatchMode, and "
                "torch.compile runs a step eager while one is active, so the tracker is on only "
                "for warm-up steps, the first steps at each new length, batch size or setting, and "
                f"one step in {every_n_steps} (measure_every_n_steps raised to {every_n_steps}): "
                "those steps run eager, every other step runs compiled. Measurements and forecasts "
                "are of the eager program, not the compiled one; to measure the compiled program, "
                "train on CUDA (allocator counters).")
    return Advice("compiled_module", "compiled-module", text, UserWarning)


def dry_run_unavailable(reason: str, seq_len: Optional[int] = None,
                        batch_size: Optional[int] = None) -> Advice:
    """The dry run refused: said once per reason (the key holds the reason without its numbers)."""
    where = "" if seq_len is None else f" at seq_len={seq_len} (batch {batch_size})"
    scope = ("" if seq_len is None else
             " there and at larger shapes; shorter lengths keep their dry runs")
    return Advice("dry_run_unavailable", "dry-run-unavailable-" + re.sub(r"\d+", "#", reason)[:120],
                  f"seqmem: the dry run cannot simulate this training step{where} ({reason}); "
                  "forecasts come from the timeline replay and the quadratic fit of measured steps "
                  f"instead{scope}.", UserWarning)


def replay_disagrees(seq_len: int, batch_size: int, replay: int, dry: int, error: float,
                     traced: Sequence[int]) -> Advice:
    return Advice("replay_disagrees", f"replay-{seq_len}-{batch_size}",
                  f"seqmem: the timeline replay of steps traced at seq_len {list(traced)} predicts "
                  f"{format_bytes(replay)} at seq_len={seq_len} (batch {batch_size}), the dry run "
                  f"of that step {format_bytes(dry)} ({error:+.1%}). The measured steps tell which "
                  "one is right: each predictor is checked against every measured step, and one "
                  "that misses them is not trusted for decisions.", ForecastMismatchWarning)


def predictor_wrong(seq_len: int, batch_size: int, measured: int,
                    misses: Sequence[tuple[str, int, float]], tolerance: float,
                    trusted: Sequence[str]) -> Advice:
    """Predictors that missed a measured step beyond the tolerance (``misses``: ``(method,
    predicted bytes, relative error)``): not trusted for decisions until right again."""
    who = "; ".join(f"{NAMES.get(m, m)} predicted {format_bytes(p)} ({e:+.1%})"
                    for m, p, e in misses)
    now = (" and ".join(NAMES.get(m, m) for m in trusted)
           + ", within the tolerance on the measured steps"
           if trusted else "the other forecasts and the measured steps")
    return Advice("predictor_wrong", "predictor-wrong-" + "-".join(m for m, _, _ in misses),
                  f"seqmem: the step at seq_len={seq_len} (batch {batch_size}) measured "
                  f"{format_bytes(measured)}: {who}, beyond the {tolerance:.0%} tolerance. "
                  f"{'They are' if len(misses) > 1 else 'It is'} not trusted for decisions until "
                  f"right again; decisions use {now}.", ForecastMismatchWarning)


def outside_fit(stage: str) -> Advice:
    """``trainer.validate()``, ``test()``, ``predict()`` (``stage``): the callback sees none."""
    return Advice("outside_fit", f"outside-fit-{stage}", (
        f"seqmem: trainer.{stage}() runs outside a fit: its batches are neither measured nor "
        "judged against the memory budget (the callback watches trainer.fit(); forecast(seq_len) "
        "or `seqmem plan` bound a length's training step, which a no-gradient step stays under)."))


def kind_of_key(key: str) -> str:
    """The kind of a warning key in a checkpoint written before warnings had kinds.

    >>> kind_of_key("oom-batch-512-4"), kind_of_key("mismatch-64-2"), kind_of_key("zzz")
    ('batch_over_budget', 'forecast_mismatch', 'other')
    """
    prefixes = (("oom-batch-", "batch_over_budget"), ("oom-", "stage_over_budget"),
                ("mismatch-", "forecast_mismatch"), ("budget-first-step", "first_step_over_budget"),
                ("mitigation-failed-", "mitigation_failed"),
                ("mitigations-dropped", "mitigation_dropped"),
                ("attention-still-quadratic", "attention_still_quadratic"),
                ("precision", "precision"), ("diagnosis-", "diagnosis"), ("failure", "failure"),
                ("failed-", "output_failed"), ("curriculum-", "curriculum_not_applied"),
                ("compiled-module", "compiled_module"), ("length-limit", "length_limit"),
                ("predictor-wrong-", "predictor_wrong"))
    return next((kind for prefix, kind in prefixes if key.startswith(prefix)), "other")


__all__ = ["KINDS", "Advice", "kind_of_key", "outside_fit"]
