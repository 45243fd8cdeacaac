"""The decision before each batch, the same on every rank, and the rungs it switches on or off.

Every rank reads its batch (:func:`local_inputs`: its shape, and which rungs apply here), the ranks
agree on the inputs, rank zero asks the planner and broadcasts the decision, and every rank commits
it and switches its rungs on (:func:`agree_and_apply`; a rung that failed on any rank is off on
all, :func:`switch_on`, and the decision is taken again without it). After the step, a rung refused
by its own one-time check on some rank is taken off on every rank (:func:`refusal`,
:func:`undo_refused`). With lengths set through the dataset, the decision for the next batch is
taken one batch ahead (:func:`set_next_length`). The collectives are :mod:`~lightning_seqmem.trainer.ranks`';
a rank that failed still joins each of them, so no rank waits alone.

Example:
    >>> from types import SimpleNamespace as NS
    >>> from lightning_seqmem.plan.planner import SeqMemPlanner
    >>> from lightning_seqmem.trainer.run_state import EdgeState
    >>> cb = NS(planner=SeqMemPlanner(), edge=EdgeState())
    >>> applicability(cb, None, None, None, (2, 64))  # no budget: no rung is ever needed
    {}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from lightning_seqmem.core.records import MemoryBudgetError
from lightning_seqmem.core.rungs import rung_names, spec
from lightning_seqmem.measure.batch import read_batch_shape
from lightning_seqmem.mitigations import ladder
from lightning_seqmem.plan.planner import Decision, PendingStep
from lightning_seqmem.trainer import access as edge
from lightning_seqmem.trainer import lengths
from lightning_seqmem.trainer import ranks as distributed
from lightning_seqmem.trainer.guard import fail, safely

if TYPE_CHECKING:
    from lightning_seqmem.trainer.callback import SeqMemCallback

Shape = tuple[int, int]  # (batch size, length)
Applicable = dict[str, tuple[bool, str]]  # rung -> (applies here, why not)


def local_inputs(cb: "SeqMemCallback", trainer: pl.Trainer, pl_module: pl.LightningModule,
                 batch: Any) -> tuple[bool, Optional[Shape], Applicable]:
    """(this rank failed, its batch's shape, which rungs apply here) before the agreement. A batch
    that cannot be read raises before any step ran on one process, and later stops measuring."""
    failed, shape, applicable = cb.edge.failed, None, {}
    if not failed:
        try:
            shape = tuple(int(x) for x in read_batch_shape(batch, cb.config.seq_len_fn))
            applicable = applicability(cb, trainer, pl_module, batch, shape)
        except (TypeError, ValueError):
            if cb.planner.course.step == 0 and trainer.world_size == 1:
                raise  # a configuration problem, found before any step ran: say so
            fail(cb, "on_train_batch_start", RuntimeError("the batch could not be read"))
            failed = True
        except Exception as exc:  # noqa: BLE001
            fail(cb, "on_train_batch_start", exc)
            failed = True
    return failed, shape, applicable


def agree_and_apply(cb: "SeqMemCallback", trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                    failed: bool, shape: Optional[Shape], applicable: Applicable) -> Optional[tuple[Decision, Shape]]:
    """The decision for this batch and the shape agreed on, with its rungs on every rank; None
    where a rank stopped measuring (then every rank stops: no more collectives). A decision to
    stop (nothing can meet the budget) raises :class:`MemoryBudgetError` on every rank."""
    for _ in range(len(rung_names()) + 1):  # again only after a rung failed to apply
        try:
            any_failed, shape, applicable = distributed.agree_inputs(
                trainer, failed, shape, applicable, cb.edge.noop_rungs)
            decision = _decide(cb, shape, applicable) if trainer.is_global_zero and not any_failed else None
            decision = distributed.broadcast(trainer, decision)
        except Exception as exc:  # noqa: BLE001 - a broken collective: stop on this rank
            fail(cb, "the agreement across ranks", exc)
            cb.edge.stopped = True
            return None
        if any_failed or decision is None or shape is None:
            fail(cb, "another rank" if not failed else "on_train_batch_start",
                     RuntimeError("a rank stopped measuring, so every rank does"))
            cb.edge.stopped = True
            safely(cb, "the curriculum", lambda: lengths.cut(cb, trainer, batch, cb.planner.course.seq_len))
            return None
        if decision.action == "stop":  # every rank: nothing can meet the budget, so no step runs over it
            raise MemoryBudgetError(decision.advice[0].text)
        cb.planner.commit(decision)
        if all(switch_on(cb, trainer, pl_module, batch, name, shape) for name in decision.rungs):
            break
        applicable = {k: v for k, v in applicable.items() if k in cb.planner.ladder.allowed}
    return decision, shape


def _decide(cb: "SeqMemCallback", shape: Optional[Shape], applicable: Applicable) -> Optional[Decision]:
    try:
        return None if shape is None else cb.planner.decide(shape, applicable)
    except Exception as exc:  # noqa: BLE001 - sent to every rank as "stop"
        fail(cb, "the decision before this batch", exc)
        return None


def applicability(cb: "SeqMemCallback", trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                  shape: Shape) -> Applicable:
    """Whether each rung left applies here (only with a budget; cached per setting and batch size)."""
    # every rung not on: those this run may not take are checked too, for the words only (a
    # warning never advises attention already on SDPA, even where the ladder leaves it out)
    left = tuple(m for m in rung_names() if m not in cb.planner.ladder.applied)
    if cb.planner.settings.usable_budget_bytes is None or not left:
        return {}
    key = (cb.planner.ladder.applied, left, shape[0])
    if key not in cb.edge.applicable_cache:
        found = ladder.applicability(left, trainer, pl_module, batch)
        # with several ranks, a rung that changes nothing on this rank's batch (micro-batching one
        # sample) is neither refused nor taken here: the ranks agree on it (ranks.agree_inputs)
        noop = tuple(m for m, (ok, _) in found.items() if not ok and trainer.world_size > 1
                     and ladder.noop(m, trainer, pl_module, batch) is not None)
        cb.edge.applicable_cache, cb.edge.noop_rungs = {key: found}, noop
        cb.planner.ladder.note_not_applicable({m: v for m, v in found.items() if m not in noop})
    return cb.edge.applicable_cache[key]


def switch_on(cb: "SeqMemCallback", trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, name: str,
              shape: Shape) -> bool:
    """Apply rung ``name`` on every rank; if it failed on any, it is off on all and skipped."""
    seq_len = cb.planner.course.seq_len or shape[1]  # where it was decided
    batch_size = cb.planner.course.batch_at(shape[0], shape[1], seq_len) if cb.config.curriculum else shape[0]
    if trainer.is_global_zero:
        safely(cb, "the dry runs before a rung", lambda: cb.planner.on_rung("before", name, seq_len=seq_len, batch_size=batch_size))
    ok, detail = ladder.try_apply(name, trainer, pl_module, batch, noop_ok=trainer.world_size > 1)
    everywhere = distributed.all_ok(trainer, ok)
    if ok and not everywhere:
        detail = "it failed on another rank"
        safely(cb, "undoing a rung", lambda: ladder.remove(name, trainer, pl_module))
    cb.planner.on_rung("on" if everywhere else "failed", name, detail, seq_len, batch_size)
    if everywhere:
        rank_zero_info(f"seqmem: switched on {name} at step {cb.planner.course.step} ({detail}).")
    return everywhere


def check_pending(cb: "SeqMemCallback", trainer: pl.Trainer, pl_module: pl.LightningModule,
                  batch: Any) -> bool:
    """Whether the step about to run runs a rung's one-time check on some rank (every rank calls
    it: a collective): then every rank's step is a warm-up, so the ranks' records stay the same."""
    try:
        on = cb.planner.ladder.applied
        here = not cb.edge.failed and ladder.check_pending(on, pl_module, batch)
    except Exception:  # noqa: BLE001 - a check that cannot tell: as if it runs (one fit point less)
        here = True
    return distributed.any_rank(trainer, here)


def refusal(cb: "SeqMemCallback", pl_module: pl.LightningModule) -> Optional[tuple[str, str]]:
    """``(rung, why)`` where a rung on this rank was refused by its own one-time check, else None."""
    try:
        return ladder.refused(cb.planner.ladder.applied, pl_module)
    except Exception as exc:  # noqa: BLE001
        fail(cb, "a rung's own check", exc)
        return None


def undo_refused(cb: "SeqMemCallback", trainer: pl.Trainer, pl_module: pl.LightningModule,
                 refusal: Optional[tuple[str, str]], pending: Optional[PendingStep]) -> None:
    """A rung's one-time check refused it on some rank: off on every rank (this step ran without
    it). Only a rung switched on at the step before runs such a check, so a rank that did not
    see the refusal itself takes the last rung switched on that has one."""
    if refusal is None:
        checked = [m for m in cb.planner.ladder.applied if spec(m).first_step_check]
        if not checked:
            return
        refusal = (checked[-1], "another rank refused it")
    name, reason = refusal
    safely(cb, f"undoing {name}", lambda: ladder.remove(name, trainer, pl_module))
    cb.planner.on_rung("off", name, f"its first-step check refused it: {reason}", pending=pending)


def set_next_length(cb: "SeqMemCallback", trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
    """One batch ahead: the planner's decision for the next batch (pure; taken again at its
    ``on_train_batch_start``) gives the length the dataset must produce, on every rank."""
    length, error = None, None
    if trainer.is_global_zero:
        try:
            length = cb.planner.course.refit_queue[0] if cb.planner.course.refit_queue else cb.planner.course.seq_len
            if not cb.edge.failed and cb.edge.shape is not None:
                applicable = applicability(cb, trainer, pl_module, batch, cb.edge.shape)
                length = cb.planner.decide(cb.edge.shape, applicable).seq_len
        except Exception as exc:  # noqa: BLE001 - said below, after every rank heard
            length, error = None, exc
    length = distributed.broadcast(trainer, length)
    if error is not None:
        raise error
    if length is not None:
        edge.set_length_ahead(trainer, length)
