"""The batch cycle: what the callback does around each training batch, in one object.

Before a batch (:meth:`BatchCycle.before_batch`): every rank reads its batch (shape, which rungs
apply here: :meth:`~BatchCycle.local_inputs`), the ranks agree, rank zero asks the planner and
broadcasts the decision, and every rank commits it and switches its rungs on
(:meth:`~BatchCycle.agree_and_apply`; a rung that failed on any rank is off on all and the decision
is taken again without it); the batch is cut to the curriculum's length and the measured step
begins (:meth:`~BatchCycle.start_measurement`: the probe on the tensors alive before the batch,
the callback's own copies among them: :mod:`.own_memory`).

After it (:meth:`BatchCycle.after_batch`): the step is timed, the probe stopped, every rank's
measurement gathered (:meth:`~BatchCycle.gather`: the row with the highest peak, whole), a rung
refused by its own one-time check on some rank taken off on every rank, and the record kept and
logged (:meth:`~BatchCycle.record_step`). With lengths set through the dataset, the next batch's
decision is taken one batch ahead (:meth:`~BatchCycle.set_next_length`). The collectives are
:mod:`.ranks`'; a rank that failed still joins each, so no rank waits alone. It writes the
per-batch fields of the edge state (:mod:`.run_state`).

Example:
    >>> from lightning_seqmem.core.config import SeqMemConfig
    >>> from lightning_seqmem.plan.planner import SeqMemPlanner
    >>> from lightning_seqmem.trainer.guard import Guard
    >>> from lightning_seqmem.trainer.run_state import EdgeState
    >>> planner, state = SeqMemPlanner(), EdgeState()
    >>> cycle = BatchCycle(SeqMemConfig(), planner, state, Guard(state, planner))
    >>> cycle.applicability(None, None, None, (2, 64))  # no budget: no rung is ever needed
    {}
"""

from __future__ import annotations

import time
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_seqmem.core import advice as A
from lightning_seqmem.core.config import SeqMemConfig
from lightning_seqmem.core.records import MemoryBudgetError
from lightning_seqmem.core.rungs import rung_names
from lightning_seqmem.measure.batch_shape import read_batch_shape
from lightning_seqmem.mitigations import ladder
from lightning_seqmem.plan.decisions import Decision
from lightning_seqmem.plan.metrics import metrics as plan_metrics
from lightning_seqmem.plan.protocol import Planner
from lightning_seqmem.plan.schedule import PendingStep
from lightning_seqmem.trainer import access as edge
from lightning_seqmem.trainer import outputs
from lightning_seqmem.trainer import ranks as distributed
from lightning_seqmem.trainer.guard import Guard, guarded
from lightning_seqmem.trainer.own_memory import start_probe
from lightning_seqmem.trainer.run_state import EdgeState
from lightning_seqmem.plan.view import PlanView

__all__ = ["BatchCycle", "step_seconds"]

Shape = tuple[int, int]  # (batch size, length)
Applicable = dict[str, tuple[bool, str]]  # rung -> (applies here, why not)
_NEXT_LENGTH = "setting the next batch's length"  # (a guarded output: named in its warning)


def step_seconds(started: Optional[float], pending: Optional[PendingStep],
                 pl_module: Any) -> Optional[float]:
    """Wall seconds of the measured step that just ran (from the end of this callback's batch
    start, ``started``, to its batch end; on CUDA after a synchronize), or None."""
    if started is None or pending is None or not pending.measure:
        return None
    try:
        device = getattr(pl_module, "device", None)
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001 - an untimed step is priced by the others
        return None
    return time.perf_counter() - started


class BatchCycle:
    """Per-batch work (module doc) over the callback's arguments, planner, edge state and guard."""

    def __init__(self, config: SeqMemConfig, planner: Planner, state: EdgeState,
                 guard: Guard) -> None:
        self.config, self.planner, self.edge, self.guard = config, planner, state, guard

    def before_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        """``on_train_batch_start``: agree, decide, apply, cut, start measuring."""
        self.edge.window_batch = batch  # the step window opens: a dry run leaves room beside it
        if self.edge.stopped:  # every rank stopped together: hold the curriculum, no collectives
            self.hold_length(trainer, batch)
            return
        failed, shape, applicable = self.local_inputs(trainer, pl_module, batch)
        runner = self.edge.dry_runner
        if runner is not None and not failed:
            self.guard.safely("the dry run's batch", lambda: runner.keep(batch))
        agreed = self.agree_and_apply(trainer, pl_module, batch, failed, shape, applicable)
        if agreed is None:
            return  # a rank stopped measuring, so every rank did
        decision, shape = agreed
        if decision.rungs or decision.action in ("cap", "probe"):  # lighter setting, shorter batch
            self.guard.safely("releasing cached memory",
                              lambda: edge.release_cached_memory(pl_module))
        curriculum = self.config.curriculum is not None
        if (decision.action != "run" and curriculum and trainer.is_global_zero
                and self.planner.evidence.measured.records):  # as the stage ends
            self.guard.safely("the memory figure",
                              lambda: outputs.log_figure(trainer, PlanView.of(self.planner)))
        self.cut_for_step(trainer, batch, decision.seq_len)
        check = self.check_pending(trainer, pl_module, batch)  # (a collective)
        self.start_measurement(trainer, pl_module, batch, decision, shape, check)
        self.guard.warn_advice()
        # the step itself from here: the decision and its dry runs are done
        self.edge.step_started_s = time.perf_counter()

    def after_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        """``on_train_batch_end``: gather, record, log; the step window closes."""
        try:
            self._after_batch(trainer, pl_module, batch)
        finally:
            self.edge.window_batch = None

    def _after_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        if self.edge.stopped:
            return
        pending, self.edge.pending = self.edge.pending, None
        started, self.edge.step_started_s = self.edge.step_started_s, None
        seconds = step_seconds(started, pending, pl_module)
        memory = self.stop_probe(pending)
        refusal = self.refusal(pl_module)
        gathered = self.gather(trainer, memory, refusal is not None)
        if gathered is None:
            return  # a rank stopped measuring, so every rank did
        any_refused, row = gathered
        if any_refused:  # e.g. a loss that is not a mean: micro-batching off everywhere, step whole
            self.undo_refused(trainer, pl_module, refusal, pending)
        self.record_step(trainer, pending, row, memory, seconds)
        if self.edge.uses_datamodule_length:  # fetched before its batch start (a collective)
            self.guard.safely(_NEXT_LENGTH, lambda: self.set_next_length(trainer, pl_module, batch))
        if self.config.breakdown and not self.edge.failed and trainer.is_global_zero:
            self.guard.safely("the memory breakdown", lambda: self._keep_longest(batch))
        self.guard.warn_advice()

    def _keep_longest(self, batch: Any) -> None:
        """Keep the longest batch so far for the breakdown at the end of fit."""
        length = read_batch_shape(batch, self.config.seq_len_fn)[1]
        self.edge.breakdown_batch = edge.longest_batch(self.edge.breakdown_batch, batch, length)

    def local_inputs(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     batch: Any) -> tuple[bool, Optional[Shape], Applicable]:
        """(this rank failed, its batch's shape, which rungs apply here) before the agreement. An
        unreadable batch raises before any step ran on one process, and later stops measuring."""
        failed, shape, applicable = self.edge.failed, None, {}
        if not failed:
            try:
                shape = tuple(int(x) for x in read_batch_shape(batch, self.config.seq_len_fn))
                applicable = self.applicability(trainer, pl_module, batch, shape)
            except (TypeError, ValueError):
                if self.planner.course.step == 0 and trainer.world_size == 1:
                    raise  # a configuration problem, found before any step ran: say so
                self.guard.fail("on_train_batch_start", RuntimeError("the batch could not be read"))
                failed = True
            except Exception as exc:  # noqa: BLE001
                self.guard.fail("on_train_batch_start", exc)
                failed = True
        return failed, shape, applicable

    def agree_and_apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                        failed: bool, shape: Optional[Shape],
                        applicable: Applicable) -> Optional[tuple[Decision, Shape]]:
        """The decision for this batch and the shape agreed on, with its rungs on every rank; None
        where a rank stopped measuring (then every rank stops: no more collectives). A decision to
        stop (nothing can meet the budget) raises :class:`MemoryBudgetError` on every rank."""
        for _ in range(len(rung_names()) + 1):  # again only after a rung failed to apply
            try:
                any_failed, shape, applicable = distributed.agree_inputs(
                    trainer, failed, shape, applicable, self.edge.noop_rungs)
                decision = (self._decide(shape, applicable)
                            if trainer.is_global_zero and not any_failed else None)
                decision = distributed.broadcast(trainer, decision)
            except Exception as exc:  # noqa: BLE001 - a broken collective: stop on this rank
                self.stop_everywhere("the agreement across ranks", exc)
                return None
            if any_failed or decision is None or shape is None:
                self.stop_everywhere("another rank" if not failed else "on_train_batch_start")
                self.hold_length(trainer, batch)
                return None
            if decision.action == "stop":  # every rank: nothing can meet the budget, no step runs
                raise MemoryBudgetError(decision.advice[0].text)
            self.planner.commit(decision)
            if all(self.switch_on(trainer, pl_module, batch, name, shape)
                   for name in decision.rungs):
                break
            applicable = {k: v for k, v in applicable.items() if k in self.planner.ladder.allowed}
        return decision, shape

    def _decide(self, shape: Optional[Shape], applicable: Applicable) -> Optional[Decision]:
        try:
            return None if shape is None else self.planner.decide(shape, applicable)
        except Exception as exc:  # noqa: BLE001 - sent to every rank as "stop"
            self.guard.fail("the decision before this batch", exc)
            return None

    def applicability(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                      shape: Shape) -> Applicable:
        """Whether each rung left applies here (with a budget; cached by setting and batch size)."""
        # every rung not on: those this run may not take are checked too, for the words only (a
        # warning never advises attention already on SDPA, even where the ladder leaves it out)
        left = tuple(m for m in rung_names() if m not in self.planner.ladder.applied)
        if self.planner.settings.usable_budget_bytes is None or not left:
            return {}
        key = (self.planner.ladder.applied, left, shape[0])
        if key not in self.edge.applicable_cache:
            found = ladder.applicability(left, trainer, pl_module, batch)
            # with several ranks, a rung that changes nothing on this rank's batch (micro-batching
            # one sample) is neither refused nor taken here: the ranks agree (ranks.agree_inputs)
            noop = tuple(m for m, (ok, _) in found.items() if not ok and trainer.world_size > 1
                         and ladder.noop(m, trainer, pl_module, batch) is not None)
            self.edge.applicable_cache, self.edge.noop_rungs = {key: found}, noop
            self.planner.ladder.note_not_applicable(
                {m: v for m, v in found.items() if m not in noop})
        return self.edge.applicable_cache[key]

    def switch_on(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, name: str,
                  shape: Shape) -> bool:
        """Apply rung ``name`` on every rank; if it failed on any, it is off on all and skipped."""
        seq_len = self.planner.course.seq_len or shape[1]  # where it was decided
        batch_size = (self.planner.course.batch_at(shape[0], shape[1], seq_len)
                      if self.config.curriculum else shape[0])
        if trainer.is_global_zero:
            self.guard.safely("the dry runs before a rung", lambda: self.planner.on_rung(
                "before", name, seq_len=seq_len, batch_size=batch_size))
        ok, detail = ladder.try_apply(name, trainer, pl_module, batch,
                                      noop_ok=trainer.world_size > 1)
        everywhere = distributed.all_ok(trainer, ok)
        if ok and not everywhere:
            detail = "it failed on another rank"
            self.guard.safely("undoing a rung", lambda: ladder.remove(name, trainer, pl_module))
        self.planner.on_rung("on" if everywhere else "failed", name, detail, seq_len, batch_size)
        if everywhere:
            rank_zero_info(
                f"seqmem: switched on {name} at step {self.planner.course.step} ({detail}).")
        return everywhere

    def check_pending(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> bool:
        """Whether the step about to run runs a rung's one-time check on some rank (a collective):
        then every rank's step is a warm-up, so the ranks' records stay the same."""
        try:
            on = self.planner.ladder.applied
            here = not self.edge.failed and ladder.check_pending(on, pl_module, batch)
        except Exception:  # noqa: BLE001 - a check that cannot tell: as if it runs (one point less)
            here = True
        return distributed.any_rank(trainer, here)

    def refusal(self, pl_module: pl.LightningModule) -> Optional[tuple[str, str]]:
        """``(rung, why)`` where its one-time check refused a rung on this rank, else None."""
        try:
            return ladder.refused(self.planner.ladder.applied, pl_module)
        except Exception as exc:  # noqa: BLE001
            self.guard.fail("a rung's own check", exc)
            return None

    def undo_refused(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     refusal: Optional[tuple[str, str]], pending: Optional[PendingStep]) -> None:
        """A rung's one-time check refused it on some rank: off on every rank (this step ran without
        it). Only a rung switched on at the step before runs such a check, so a rank that did not
        see the refusal takes the last rung switched on that has one."""
        if refusal is None:
            checked = [m for m in self.planner.ladder.applied
                       if self.planner.settings.spec(m).first_step_check]
            if not checked:
                return
            refusal = (checked[-1], "another rank refused it")
        name, reason = refusal
        self.guard.safely(f"undoing {name}", lambda: ladder.remove(name, trainer, pl_module))
        self.planner.on_rung("off", name, f"its first-step check refused it: {reason}",
                             pending=pending)

    def set_next_length(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                        batch: Any) -> None:
        """One batch ahead: the planner's decision for the next batch (pure; taken again at its
        ``on_train_batch_start``) gives the length the dataset must produce, on every rank."""
        length, error = None, None
        if trainer.is_global_zero:
            try:
                length = self.queued_length()
                if not self.edge.failed and self.edge.shape is not None:
                    applicable = self.applicability(trainer, pl_module, batch, self.edge.shape)
                    length = self.planner.decide(self.edge.shape, applicable).seq_len
            except Exception as exc:  # noqa: BLE001 - said below, after every rank heard
                length, error = None, exc
        length = distributed.broadcast(trainer, length)
        if error is not None:
            raise error
        if length is not None:
            edge.set_length_ahead(trainer, length)

    @guarded
    def start_measurement(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                          decision: Decision, shape: tuple[int, int], check: bool = False) -> None:
        """Begin the step the planner decided on (``shape``: the one agreed across ranks) and, for a
        measured one, start the probe in its forward phase; ``check``: a rung's one-time check runs
        in this step on some rank (:meth:`check_pending`): a warm-up."""
        # what this rank really runs
        self.edge.shape = tuple(int(x) for x in read_batch_shape(batch, self.config.seq_len_fn))
        planned = shape if decision.seq_len is None else (
            self.planner.course.batch_at(shape[0], shape[1], decision.seq_len), decision.seq_len)
        pending = self.edge.pending = self.planner.begin_step(
            planned[1], planned[0], edge.steps_optimizer(trainer), trainer.global_step,
            trainer.current_epoch)
        probe = self.edge.probe
        if check:
            pending.warmup, pending.traced = True, False  # a rung's one-time check adds to the peak
        if self.edge.compiled_reason is not None and probe is not None and probe.name == "cuda":
            pending.traced = False  # a traced step runs a dispatch mode, hence eager: stay compiled
        if pending.measure:
            assert probe is not None, "setup() was not called"
            start_probe(self.edge, trainer, pl_module, batch, record_events=pending.traced)

    @guarded
    def stop_probe(self, pending: Optional[PendingStep]) -> Any:
        """This rank's measurement of the step that just ran, or None where it was not measured."""
        probe = self.edge.probe
        if pending is None or not pending.measure or probe is None or not probe.running:
            return None
        return probe.end_step()

    def gather(self, trainer: pl.Trainer, memory: Any,
               refused_here: bool) -> Optional[tuple[bool, Any]]:
        """(a rung was refused on some rank, the row kept) from every rank's measurement
        (:func:`.ranks.gather_measurement`); None where a rank stopped measuring, and then every
        rank stops (no more collectives)."""
        try:
            any_failed, any_refused, row = distributed.gather_measurement(
                trainer, self.edge.failed, memory, self.edge.shape, refused_here)
        except Exception as exc:  # noqa: BLE001
            self.stop_everywhere("the gathering of peaks across ranks", exc)
            return None
        if any_failed:
            self.stop_everywhere("another rank")
            return None
        return any_refused, row

    @guarded
    def record_step(self, trainer: pl.Trainer, pending: Optional[PendingStep], row: Any,
                    memory: Any, seconds: Optional[float] = None) -> None:
        """End the batch in the planner (a stage counts its optimizer steps at its length), keep
        the gathered row as a :class:`~lightning_seqmem.core.records.StepRecord` and log it."""
        shape = self.edge.shape
        ran = shape[1] if shape else None  # this rank's batch as it ran
        held = (self.config.curriculum is not None and pending is not None and ran is not None
                and ran != pending.seq_len)
        self.planner.course.end_batch(not held and (pending is None or pending.optimizer_steps))
        if held:
            self.planner.advice.advise(A.curriculum_not_applied(pending.seq_len, ran))
        if pending is None or row is None:
            return
        rank, reduced, seq_len, batch_size = row
        trace = (shape[1], shape[0], memory) if memory is not None and shape else None
        # a training_step that returned None (a manual step may call loss.backward(), unseen)
        skipped = (trainer.lightning_module.automatic_optimization and "optimizer" in
                   reduced.phase_peak_bytes and "backward" not in reduced.phase_peak_bytes)
        record = self.planner.observe(pending, reduced, seq_len, batch_size, trace=trace,
                                      rank=rank if trainer.world_size > 1 else None,
                                      step_seconds=seconds, trained=not skipped)
        try:
            metrics = plan_metrics(record, self.planner.evidence, self.planner.course)
        except Exception as exc:  # noqa: BLE001 - a forecast failure must not stop the logging
            self.guard.warn_once(A.output_failed("the forecast for logging", repr(exc)))
            metrics = {}
        outputs.log_metrics(trainer, metrics, step=record.global_step)

    def stop_everywhere(self, where: str, exc: Optional[BaseException] = None) -> None:
        """:meth:`.Guard.fail` (``exc`` None: another rank stopped) and join no more collectives."""
        if exc is None:
            exc = RuntimeError("a rank stopped measuring, so every rank does")
        self.guard.fail(where, exc)
        self.edge.stopped = True

    def hold_length(self, trainer: pl.Trainer, batch: Any) -> None:
        """Measuring stopped: :meth:`cut` ``batch`` to the curriculum's length all the same."""
        self.guard.safely("the curriculum",
                          lambda: self.cut(trainer, batch, self.planner.course.seq_len))

    def queued_length(self) -> Optional[int]:
        """The next batch's length by the planner: the next re-measurement's, else the stage's."""
        course = self.planner.course
        return course.refit_queue[0] if course.refit_queue else course.seq_len

    def cut(self, trainer: pl.Trainer, batch: Any, seq_len: Optional[int]) -> None:
        """Cut ``batch`` to the curriculum's ``seq_len`` (:func:`.access.cut_to_length`)."""
        if self.config.curriculum is not None and seq_len is not None:
            self.edge.uses_datamodule_length = edge.cut_to_length(
                trainer, batch, seq_len, self.config.curriculum.truncate,
                self.edge.uses_datamodule_length, self.config.seq_len_fn)

    def cut_for_step(self, trainer: pl.Trainer, batch: Any, seq_len: Optional[int]) -> None:
        """:meth:`cut` the batch about to run; a batch format the curriculum cannot cut raises
        before any step ran (a configuration problem), and later stops the callback measuring."""
        try:
            self.cut(trainer, batch, seq_len)
        except (TypeError, ValueError):
            if self.planner.course.step == 0 and trainer.world_size == 1:
                raise  # a batch format the curriculum cannot cut, found before any step ran: say so
            self.guard.fail("cutting the batch to the curriculum's length",
                            RuntimeError("the batch could not be cut"))

    def set_first_length(self, trainer: pl.Trainer) -> None:
        """With a curriculum, batches that cannot be cut in place
        (:func:`.access.batches_need_setter`) and a ``set_seq_len`` on the datamodule or dataset:
        set the first batch's length before Lightning fetches it (the stage's, or the next
        re-measurement's: the planner's state, the same on every rank, no collective). From then
        on each batch end sets the next one's."""
        if self.config.curriculum is None or self.edge.stopped or self.edge.uses_datamodule_length:
            return  # (once a batch went through the setter, each batch end sets the next one's)
        length = self.queued_length()  # same on every rank
        if (length is not None and edge.length_setter(trainer) is not None
                and edge.batches_need_setter(trainer)):
            self.guard.safely(_NEXT_LENGTH, lambda: edge.set_length_ahead(trainer, length))
