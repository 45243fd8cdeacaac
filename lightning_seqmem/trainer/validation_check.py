"""Validation batches inside a fit, judged before they run: the training batches' budget holds
there too, and nothing else would say so.

``on_validation_batch_start`` (the sanity check's batches too): on rank zero, each new batch shape
with the rungs on now is dry-run once as the validation loop runs it (``validation_step``, eval
mode, no gradients: :meth:`~lightning_seqmem.dryrun.run.TrainingRunDryRun.validation_peak`); a
bound over the usable budget is said once, before the batch runs (``validation_over_budget``). A
validation batch is never cut and no rung is switched for it: the warning says what to change. A
dry run that cannot run is said once, and the batches go on unjudged.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.trainer.states import TrainerFn

from lightning_seqmem.core import advice as A
from lightning_seqmem.core.config import SeqMemConfig
from lightning_seqmem.dryrun.result import DryRunUnsupported
from lightning_seqmem.measure.batch_shape import read_batch_shape
from lightning_seqmem.plan.judging import dry_run_bound
from lightning_seqmem.plan.protocol import Planner
from lightning_seqmem.trainer.guard import Guard
from lightning_seqmem.trainer.run_state import EdgeState

__all__ = ["ValidationCheck"]


class ValidationCheck:
    """Judges the validation batches of one fit (module doc); ``judged`` maps ``(seq_len,
    batch_size, rungs on)`` to the dry run's peak (bytes), None where it could not. A shape no
    larger than one that fits with the same rungs is not dry-run; after the warning, none is."""

    def __init__(self, config: SeqMemConfig, planner: Planner, state: EdgeState,
                 guard: Guard) -> None:
        self.config, self.planner, self.edge, self.guard = config, planner, state, guard
        self.judged: dict[tuple[int, int, tuple[str, ...]], Any] = {}

    def before_batch(self, trainer: Any, batch: Any) -> None:
        """``on_validation_batch_start``: judge this batch's shape if it is new (never raises)."""
        runner, settings = self.edge.dry_runner, self.planner.settings
        if (runner is None or self.edge.failed or settings.usable_budget_bytes is None
                or trainer.state.fn != TrainerFn.FITTING):
            return
        try:
            batch_size, seq_len = (int(x) for x in read_batch_shape(batch, self.config.seq_len_fn))
        except (TypeError, ValueError):
            return  # a batch the callback cannot read: the validation loop's own business
        applied = self.planner.ladder.applied
        if "validation" in self.planner.advice.warned or any(  # said, or bounded by one that fits
                L >= seq_len and B >= batch_size and on == applied and peak is not None
                and dry_run_bound(peak) <= settings.usable_budget_bytes
                for (L, B, on), peak in self.judged.items()):
            return
        key = (seq_len, batch_size, applied)
        self.judged[key] = None
        try:
            peak = self.judged[key] = runner.validation_peak(batch, seq_len)
        except DryRunUnsupported as exc:
            self.guard.warn_once(A.Advice(
                "dry_run_unavailable", "dry-run-unavailable-validation",
                "seqmem: validation batches are not judged against the budget: the dry run cannot "
                f"simulate validation_step ({exc.reason})."))
            return
        except Exception as exc:  # noqa: BLE001 - the callback must never be the reason a run dies
            self.guard.warn_once(A.output_failed("the validation batch's dry run",
                                                 f"{type(exc).__name__}: {exc}"))
            return
        bound, usable = dry_run_bound(peak), settings.usable_budget_bytes
        if bound > usable:
            self.guard.warn_once(A.validation_over_budget(
                seq_len, batch_size, peak, bound, usable, settings.budget_bytes,
                settings.safety_margin, applied))
