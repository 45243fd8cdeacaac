"""Validation batches inside a fit, judged before they run (the sanity check's too): each new
shape with the rungs on now is dry-run once on rank zero as the validation loop runs it
(:meth:`~lightning_seqmem.dryrun.run.TrainingRunDryRun.validation_peak`). Over the usable budget,
the fastest setting whose validation dry run fits (:func:`~lightning_seqmem.plan.choose.choose`;
rungs ``training_only`` not tried) goes on before the batch runs; where none fits it is said once
(``validation_over_budget``). A validation batch is never cut. Ranks drawing through Lightning's
distributed sampler agree on each batch as on a training batch (rank zero judges the largest shape
on any rank, all switch the same rungs on); ranks drawing otherwise are said once (a collective per
batch could hang), and only rank zero's batches are judged, only said.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DistributedSampler

from lightning_seqmem.core import advice as A
from lightning_seqmem.core.config import SeqMemConfig
from lightning_seqmem.core.units import format_bytes, to_gib
from lightning_seqmem.dryrun.result import DryRunUnsupported
from lightning_seqmem.dryrun.step import held_state
from lightning_seqmem.measure.batch_shape import read_batch_shape
from lightning_seqmem.mitigations import ladder
from lightning_seqmem.plan.choose import Choice, choose, describe, switched_on
from lightning_seqmem.plan.judging import Verdict, dry_run_bound
from lightning_seqmem.plan.protocol import Planner
from lightning_seqmem.trainer import outputs, ranks as distributed
from lightning_seqmem.trainer.guard import Guard
from lightning_seqmem.trainer.own_memory import start_probe
from lightning_seqmem.trainer.run_state import EdgeState

__all__ = ["ValidationCheck"]

Setting = tuple[str, ...]
Shape = tuple[int, int]  # (batch_size, seq_len)


def _distributed(loader: Any) -> bool:
    """Whether ``loader`` draws from a distributed sampler (Lightning's)."""
    batches = getattr(loader, "batch_sampler", None)
    return any(isinstance(sampler, DistributedSampler) for sampler in (
        getattr(loader, "sampler", None), getattr(batches, "sampler", None)))


class ValidationCheck:
    """Judges the validation batches of one fit (module doc); ``judged`` maps ``(seq_len,
    batch_size, rungs on, held)`` to the dry run's peak (bytes), None where it could not (``held``:
    :func:`~lightning_seqmem.dryrun.step.held_state`, which the dry run mirrors). A shape no
    larger than one that fits with the same rungs is not dry-run; after the warning, none is.
    ``together``: every rank agrees on each batch. ``switch_on(trainer, module, batch, name,
    shape) -> bool``: the batch cycle's (every rank)."""

    def __init__(self, config: SeqMemConfig, planner: Planner, state: EdgeState, guard: Guard,
                 switch_on: Callable[..., bool]) -> None:
        self.config, self.planner, self.edge, self.guard = config, planner, state, guard
        self.switch_on = switch_on
        self.judged: dict[tuple[int, int, Setting, tuple[bool, bool]], Any] = {}
        self.held = (True, True)  # (gradients alive, optimizer state made) beside this batch
        self.together, self.over_peak = False, 0  # the last dry run over the budget (bytes)
        self.measuring: Optional[Shape] = None  # this rank's batch to measure (every rank)
        self.started = False  # and its probe started here

    def _judging(self, trainer: Any) -> bool:  # the same on every rank
        return (self.config.dry_run and self.planner.settings.usable_budget_bytes is not None
                and trainer.state.fn == TrainerFn.FITTING and not self.edge.stopped)

    def start(self, trainer: Any) -> None:
        """``on_validation_start`` (every rank; with several a collective where each draws through
        a distributed sampler, which pads: every rank has a batch): set ``together``."""
        self.together = trainer.world_size == 1 and self._judging(trainer)
        if self.together or not self._judging(trainer):
            return
        loop, count = trainer.fit_loop.epoch_loop.val_loop, -2
        try:
            if all(_distributed(loader) for loader in loop._combined_loader.flattened):
                count = -1 if self.edge.failed else sum(loop.max_batches)
        except Exception:  # noqa: BLE001 - loaders the callback cannot read: apart
            pass
        if count != -2:
            count = int(count) if math.isfinite(count) else -1
            self.together = distributed.same_on_every_rank(trainer, count) and count >= 0
        if not self.together and count != -1:
            self.guard.warn_once(A.Advice(
                "validation_over_budget", "validation-ranks-apart",
                "seqmem: the ranks' validation batches are not drawn by Lightning's distributed "
                "sampler, or are counted differently, so the ranks cannot agree on rungs before "
                "each: only rank zero's validation batches are judged, and only said. "
                "Trainer(use_distributed_sampler=True) and one validation batch size agree."))

    def before_batch(self, trainer: Any, pl_module: Any, batch: Any) -> None:
        """``on_validation_batch_start``: judge this batch's shape (together, the largest on any
        rank) if it is new, switch rungs on where that makes it fit, and measure it."""
        if not self.together and not (trainer.is_global_zero and self._judging(trainer)
                                      and not self.edge.failed):
            return
        failed, own = self.edge.failed, None
        try:
            own = tuple(int(x) for x in read_batch_shape(batch, self.config.seq_len_fn))
        except Exception:  # noqa: BLE001 - a batch the callback cannot read: not judged
            failed = True
        shape = own
        if self.together:  # every rank, whatever happened here
            failed, shape, _ = distributed.agree_inputs(trainer, failed, own, {})
        if failed or shape is None:
            return
        names, why = (), None  # rungs to switch on and why; why None: not dry-run, not measured
        if trainer.is_global_zero:
            try:  # never raised: the other ranks wait for the answer
                names, why = self._decide(trainer, pl_module, batch, shape)
            except Exception as exc:  # noqa: BLE001
                self.guard.warn_once(A.output_failed("the validation batch's check",
                                                     f"{type(exc).__name__}: {exc}"))
        if self.together:
            names, why = distributed.broadcast(trainer, (names, why))
        if names and all(self.switch_on(trainer, pl_module, batch, name, shape) for name in names):
            self.guard.warn_once(A.Advice("validation_over_budget",
                                          f"validation-rungs-{'+'.join(names)}", why,
                                          A.PredictedOOMWarning))
        elif names and trainer.is_global_zero:  # a rung failed: off on every rank
            self._said_over(shape)
        if own is not None and why is not None:  # every rank together: measured, gathered
            self.measuring = own
            self._start(trainer, pl_module, batch, *own[::-1])

    def _decide(self, trainer: Any, pl_module: Any, batch: Any,
                shape: Shape) -> tuple[Setting, Optional[str]]:
        runner, (batch_size, seq_len) = self.edge.dry_runner, shape
        usable, applied = self.planner.settings.usable_budget_bytes, self.planner.ladder.applied
        # what runs beside the step (no gradients, no optimizer state in the sanity check)
        self.held = held_state(pl_module, (trainer.optimizers or [None])[0])
        if runner is None or "validation" in self.planner.advice.warned or any(
                L >= seq_len and B >= batch_size and (on, held) == (applied, self.held)
                and peak is not None and dry_run_bound(peak) <= usable
                for (L, B, on, held), peak in self.judged.items()):
            return (), None  # said, or bounded by one that fits
        peak = self._peak(runner, batch, seq_len, batch_size, applied)
        if peak is None or dry_run_bound(peak) <= usable:
            return (), ""
        self.over_peak = peak
        choice = (self._choose(trainer, pl_module, runner, batch, seq_len, batch_size)
                  if self.together else None)
        if choice is None or not choice.fits:
            self._said_over(shape)
            return (), ""
        names = switched_on(applied, choice.setting)
        return names, (f"seqmem: a validation batch of seq_len={seq_len}, batch {batch_size} is "
                       f"predicted to peak at {format_bytes(peak)} (dry run of validation_step), "
                       f"over the usable budget {format_bytes(usable)}; switched on "
                       f"{describe(names)} before it runs: {choice.why}.")

    def _said_over(self, shape: Shape) -> None:  # over the budget (over_peak), no rung switched
        settings, (batch_size, seq_len), peak = self.planner.settings, shape, self.over_peak
        self.guard.warn_once(A.validation_over_budget(
            seq_len, batch_size, peak, dry_run_bound(peak), settings.usable_budget_bytes,
            settings.budget_bytes, settings.safety_margin, self.planner.ladder.applied,
            ranks_apart=not self.together))

    def _start(self, trainer: Any, pl_module: Any, batch: Any, seq_len: int,
               batch_size: int) -> None:
        """Measure this batch (its shape was dry-run, with the rungs on now): a row in
        ``edge.validation`` at its end."""
        probe, applied = self.edge.probe, self.planner.ladder.applied
        if probe is None or probe.running:
            return
        start_probe(self.edge, trainer, pl_module, batch)  # as the dry run's answers count
        self.started = True
        self.edge.validation.append({
            "global_step": trainer.global_step, "rank": trainer.global_rank, "seq_len": seq_len,
            "batch_size": batch_size, "mitigations": list(applied), "peak_bytes": None,
            "dry_run_peak_bytes": self.judged.get((seq_len, batch_size, applied, self.held))})

    def after_batch(self, trainer: Any) -> None:
        """``on_validation_batch_end``: the measured peak of a batch :meth:`before_batch` began
        measuring (together, the highest on any rank, with its shape and rank); one warning where
        it ran over the usable budget."""
        probe, usable = self.edge.probe, self.planner.settings.usable_budget_bytes
        measuring, started = self.measuring, self.started
        self.measuring, self.started = None, False
        if measuring is None:
            return
        memory, error = None, None
        if started and probe is not None and probe.running and not self.edge.failed:
            try:
                memory = probe.end_step()
                self.edge.validation[-1]["peak_bytes"] = memory.peak_bytes  # this rank's
            except Exception as exc:  # a broken measurement: the probe left, the steps' own
                probe.abort()
                error = exc
        best = (0, memory, *measuring[::-1]) if memory is not None else None
        if self.together and trainer.world_size > 1:  # every rank that began, whatever happened
            best = distributed.gather_measurement(trainer, memory is None, memory, measuring)[2]
        if error is not None:
            raise error
        if best is None or not trainer.is_global_zero:
            return
        row, (rank, memory, seq_len, batch_size) = self.edge.validation[-1], best
        row.update(rank=rank, seq_len=seq_len, batch_size=batch_size, peak_bytes=memory.peak_bytes,
                   dry_run_peak_bytes=self.judged.get((seq_len, batch_size,
                                                       tuple(row["mitigations"]), self.held)))
        peak = memory.peak_bytes
        outputs.log_metrics(trainer, {"validation_peak_gib": to_gib(peak),
                                      "validation_seq_len": seq_len}, step=trainer.global_step)
        if usable is not None and peak > usable and "validation" not in self.planner.advice.warned:
            self.guard.warn_once(A.Advice(  # (a prediction over the budget said it before)
                "validation_over_budget", "validation-measured",
                f"seqmem: a validation batch of seq_len={seq_len}, batch {batch_size} peaked at "
                f"{format_bytes(peak)}, over the usable budget {format_bytes(usable)} (measured; "
                f"rungs on: {', '.join(row['mitigations']) or 'none'}).", A.PredictedOOMWarning))

    def _peak(self, runner: Any, batch: Any, seq_len: int, batch_size: int,
              setting: Setting) -> Optional[int]:
        """The validation dry run's peak with ``setting`` (kept in ``judged``), None where the dry
        run cannot answer (said once)."""
        key = (seq_len, batch_size, setting, self.held)
        if key not in self.judged:
            self.judged[key] = None
            try:
                self.judged[key] = runner.validation_peak(batch, seq_len, setting, batch_size)
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
