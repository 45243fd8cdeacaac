"""Validation batches inside a fit, judged before they run: the training batches' budget holds
there too.

``on_validation_batch_start`` (the sanity check's batches too): on rank zero, each new batch shape
with the rungs on now is dry-run once as the validation loop runs it (``validation_step``, eval
mode, no gradients: :meth:`~lightning_seqmem.dryrun.run.TrainingRunDryRun.validation_peak`). A
bound over the usable budget: on one process, the fastest setting whose validation dry run fits
(:func:`~lightning_seqmem.plan.choose.choose`, priced as training steps; rungs ``training_only``
are not tried) is switched on before the batch runs, as before a training batch; with several
ranks, or where nothing fits, it is said once (``validation_over_budget``) with what to change. A
validation batch is never cut. A dry run that cannot run is said once, and the batches go on
unjudged.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from lightning.pytorch.trainer.states import TrainerFn

from lightning_seqmem.core import advice as A
from lightning_seqmem.core.config import SeqMemConfig
from lightning_seqmem.core.units import format_bytes
from lightning_seqmem.dryrun.result import DryRunUnsupported
from lightning_seqmem.dryrun.step import held_state
from lightning_seqmem.measure.batch_shape import read_batch_shape
from lightning_seqmem.measure.probes import existing_tensors
from lightning_seqmem.mitigations import ladder
from lightning_seqmem.plan.choose import Choice, choose, describe, switched_on
from lightning_seqmem.plan.judging import Verdict, dry_run_bound
from lightning_seqmem.plan.protocol import Planner
from lightning_seqmem.trainer.guard import Guard
from lightning_seqmem.trainer.own_memory import own_tensors
from lightning_seqmem.trainer.run_state import EdgeState

__all__ = ["ValidationCheck"]

Setting = tuple[str, ...]


class ValidationCheck:
    """Judges the validation batches of one fit (module doc); ``judged`` maps ``(seq_len,
    batch_size, rungs on, held)`` to the dry run's peak (bytes), None where it could not (``held``:
    :func:`~lightning_seqmem.dryrun.step.held_state`, which the dry run mirrors). A shape no
    larger than one that fits with the same rungs is not dry-run; after the warning, none is.
    ``switch_on(trainer, module, batch, name, shape) -> bool`` switches a rung on (the batch
    cycle's)."""

    def __init__(self, config: SeqMemConfig, planner: Planner, state: EdgeState, guard: Guard,
                 switch_on: Callable[..., bool]) -> None:
        self.config, self.planner, self.edge, self.guard = config, planner, state, guard
        self.switch_on = switch_on
        self.judged: dict[tuple[int, int, Setting, tuple[bool, bool]], Any] = {}
        self.held = (True, True)  # (gradients alive, optimizer state made) beside this batch

    def before_batch(self, trainer: Any, pl_module: Any, batch: Any) -> None:
        """``on_validation_batch_start``: judge this batch's shape if it is new, and measure it."""
        runner, settings = self.edge.dry_runner, self.planner.settings
        if (runner is None or self.edge.failed or settings.usable_budget_bytes is None
                or trainer.state.fn != TrainerFn.FITTING):
            return
        try:
            batch_size, seq_len = (int(x) for x in read_batch_shape(batch, self.config.seq_len_fn))
        except (TypeError, ValueError):
            return  # a batch the callback cannot read: the validation loop's own business
        usable, applied = settings.usable_budget_bytes, self.planner.ladder.applied
        # what runs beside the step (no gradients, no optimizer state in the sanity check)
        self.held = held_state(pl_module, (trainer.optimizers or [None])[0])
        if "validation" in self.planner.advice.warned or any(  # said, or bounded by one that fits
                L >= seq_len and B >= batch_size and (on, held) == (applied, self.held)
                and peak is not None and dry_run_bound(peak) <= usable
                for (L, B, on, held), peak in self.judged.items()):
            return
        peak = self._peak(runner, batch, seq_len, batch_size, applied)
        if peak is not None and dry_run_bound(peak) > usable:
            self._over(trainer, pl_module, runner, batch, seq_len, batch_size, peak)
        self._start(trainer, pl_module, batch, seq_len, batch_size)

    def _start(self, trainer: Any, pl_module: Any, batch: Any, seq_len: int,
               batch_size: int) -> None:
        """Measure this batch (its shape was dry-run, with the rungs on now): a row in
        ``edge.validation`` at its end."""
        probe, applied = self.edge.probe, self.planner.ladder.applied
        if probe is None or probe.running:
            return
        probe.start_step([*existing_tensors(pl_module, trainer.optimizers, batch),
                          *own_tensors(self.edge)])  # as the dry run's answers count them
        probe.mark_phase("forward")
        self.edge.validation.append({
            "global_step": trainer.global_step, "seq_len": seq_len, "batch_size": batch_size,
            "mitigations": list(applied), "peak_bytes": None,
            "dry_run_peak_bytes": self.judged.get((seq_len, batch_size, applied, self.held))})

    def after_batch(self) -> None:
        """``on_validation_batch_end``: the measured peak of a batch :meth:`before_batch` began
        measuring; one warning where it ran over the usable budget."""
        probe, usable = self.edge.probe, self.planner.settings.usable_budget_bytes
        if probe is None or not probe.running or not self.edge.validation or self.edge.failed:
            return
        row = self.edge.validation[-1]
        try:
            row["peak_bytes"] = peak = probe.end_step().peak_bytes
        except Exception:  # a broken measurement: the probe left, the training steps' own
            probe.abort()
            raise
        if usable is not None and peak > usable and "validation" not in self.planner.advice.warned:
            self.guard.warn_once(A.Advice(  # (a prediction over the budget said it before)
                "validation_over_budget", "validation-measured",
                f"seqmem: a validation batch of seq_len={row['seq_len']}, batch "
                f"{row['batch_size']} peaked at {format_bytes(peak)}, over the usable budget "
                f"{format_bytes(usable)} (measured; rungs on: "
                f"{', '.join(row['mitigations']) or 'none'}).", A.PredictedOOMWarning))

    def _over(self, trainer: Any, pl_module: Any, runner: Any, batch: Any, seq_len: int,
              batch_size: int, peak: int) -> None:
        """Over the budget: the rungs that make it fit go on (one process), or it is said."""
        usable, applied = self.planner.settings.usable_budget_bytes, self.planner.ladder.applied
        settings = self.planner.settings
        choice = (self._choose(trainer, pl_module, runner, batch, seq_len, batch_size)
                  if trainer.world_size == 1 else None)
        if choice is not None and choice.fits:
            names = switched_on(applied, choice.setting)
            if all(self.switch_on(trainer, pl_module, batch, name, (batch_size, seq_len))
                   for name in names):
                self.guard.warn_once(A.Advice(
                    "validation_over_budget", f"validation-rungs-{'+'.join(names)}",
                    f"seqmem: a validation batch of seq_len={seq_len}, batch {batch_size} is "
                    f"predicted to peak at {format_bytes(peak)} (dry run of validation_step), over "
                    f"the usable budget {format_bytes(usable)}; switched on "
                    f"{describe(names)} before it runs: {choice.why}.", A.PredictedOOMWarning))
                return
        self.guard.warn_once(A.validation_over_budget(
            seq_len, batch_size, peak, dry_run_bound(peak), usable, settings.budget_bytes,
            settings.safety_margin, applied, several_ranks=trainer.world_size > 1))

    def _peak(self, runner: Any, batch: Any, seq_len: int, batch_size: int,
              setting: Setting) -> Optional[int]:
        """The validation dry run's peak with ``setting`` (kept in ``judged``), None where the dry
        run cannot answer (said once)."""
        key = (seq_len, batch_size, setting, self.held)
        if key not in self.judged:
            self.judged[key] = None
            try:
                self.judged[key] = runner.validation_peak(batch, seq_len, setting)
            except DryRunUnsupported as exc:
                self.guard.warn_once(A.Advice(
                    "dry_run_unavailable", "dry-run-unavailable-validation",
                    "seqmem: validation batches are not judged against the budget: the dry run "
                    f"cannot simulate validation_step ({exc.reason})."))
            except Exception as exc:  # noqa: BLE001 - the callback must never be why a run dies
                self.guard.warn_once(A.output_failed("the validation batch's dry run",
                                                     f"{type(exc).__name__}: {exc}"))
        return self.judged[key]

    def _choose(self, trainer: Any, pl_module: Any, runner: Any, batch: Any, seq_len: int,
                batch_size: int) -> Optional[Choice]:
        """The fastest setting of the rungs left whose validation dry run fits, or None."""
        on, usable = self.planner.ladder.applied, self.planner.settings.usable_budget_bytes
        allowed = [m for m in self.planner.ladder.allowed  # none lowers a no-gradient step
                   if not self.planner.settings.spec(m).training_only]
        checks = ladder.applicability([m for m in allowed if m not in on], trainer, pl_module,
                                      batch)

        def judge(setting: Setting) -> Verdict:
            peak = self._peak(runner, batch, seq_len, batch_size, setting)
            return (Verdict("unknown") if peak is None
                    else Verdict.of((dry_run_bound(peak), peak), usable, "dry_run"))

        return choose(on, allowed, checks, judge,
                      lambda s: self.planner.evidence.price(s, seq_len, batch_size).key,
                      fmt=format_bytes, usable=usable)
