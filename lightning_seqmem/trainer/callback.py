"""``SeqMemCallback``: the Lightning edge of lightning-seqmem.

Each hook is a line or two into the :class:`~.fit_cycle.FitCycle` (set-up, checks before the first
step, a resume or a second fit, the outputs at the end) or the :class:`~.batch_cycle.BatchCycle`
(before each batch: decision, rungs, length, measured step begun; after it: gathered, recorded,
logged). Decisions are the torch-free :class:`~lightning_seqmem.plan.planner.SeqMemPlanner`'s;
outputs go through :mod:`.outputs`; a fit's run state is one :class:`~.run_state.EdgeState`
(``cb.edge``, fresh for each fit), which both write; they warn through the :class:`~.guard.Guard`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_seqmem.trainer import outputs
from lightning_seqmem.trainer.batch_cycle import BatchCycle
from lightning_seqmem.trainer.fit_cycle import FitCycle, adopt_legacy_state
from lightning_seqmem.core import advice as A
from lightning_seqmem.core.config import SeqLenFn, SeqMemConfig
from lightning_seqmem.core.curriculum import Curriculum
from lightning_seqmem.core.forecast import Forecast, MemoryForecaster
from lightning_seqmem.trainer.guard import Guard, guarded as _guarded
from lightning_seqmem.trainer.run_state import EdgeState
from lightning_seqmem.trainer.validation_check import ValidationCheck
from lightning_seqmem.trainer.oom import is_oom
from lightning_seqmem.plan.planner import SeqMemPlanner
from lightning_seqmem.core.units import parse_bytes
from lightning_seqmem.plan.view import PlanView
from lightning_seqmem.core.rungs import MITIGATIONS, check_mitigations
from lightning_seqmem.measure.batch_shape import shapes_read_by


_ARGUMENTS = frozenset(f.name for f in dataclasses.fields(SeqMemConfig)) | {"probe_name"}


class SeqMemCallback(Callback):
    """Measure every training step's memory, predict it at any sequence length, stay in budget.

    After ``warmup_steps`` batches, every batch's peak is measured by phase (forward, backward,
    optimizer step) into :attr:`records`; a timeline replay of traced steps and the article's
    quadratic ``M(L, B) = C + B·(a·L + b·L²)`` are fitted, and :meth:`forecast` /
    :meth:`max_seq_len` answer for any length. Before every batch the planner
    (:mod:`lightning_seqmem.plan.planner`) judges the usable budget: a curriculum stage is entered
    only on a forecast that fits, a batch judged over switches the next mitigation on, and with
    none left the curriculum is capped (one :class:`PredictedOOMWarning`). A budget nothing can
    meet raises :class:`~lightning_seqmem.MemoryBudgetError` before the batch where it is first
    known. Under DDP rank zero decides from every rank's shape; all ranks apply it together.

    A ``torch.compile``'d module keeps compiling; one warning says what is measured. On CUDA the
    allocator counters measure the compiled program (no step is traced: it would run eager). Under
    the CPU tracker (a ``TorchDispatchMode``) a tracked step runs eager
    (``torch.compiler.set_stance("force_eager")``) and, with a compiled module, only warm-ups, the
    first steps at a new shape and one step in ``max(measure_every_n_steps, 10)`` are tracked; the
    forecasts say they are of the eager program. The dry run refuses compiled modules.

    A curriculum stage counts only the steps that ran at its length: where the data is shorter or a
    batch cannot be cut, the record says the length that ran, one warning says so, and the
    curriculum holds. A batch only the dataset can shorten (a tuple or a bare tensor, through
    ``set_seq_len``) with ``DataLoader(num_workers > 0)`` is refused before the first step (the
    workers' copies of the dataset would never see the length).

    Args:
        warmup_steps: batches measured but not fitted at the start (≥ 1: the first step has no
            optimizer state and the previous step's grads are alive).
        tolerance: accepted relative forecast error in (0, 1); a larger miss warns once and widens
            later bounds (the article uses 15%).
        probe: ``"auto"`` (CUDA allocator counters on CUDA, else the live-tensor tracker),
            ``"cuda"`` or ``"tracker"``.
        memory_budget: bytes or a string with a unit (``"12GiB"``); default the CUDA device's
            memory, none on CPU (forecasts are then informational).
        safety_margin: fraction of the budget kept free, in [0, 1).
        curriculum: a :class:`~lightning_seqmem.Curriculum` (batches are cut, or reshaped with
            ``truncate=False``, to the stage's length); ``None`` measures the data's lengths.
        warmup_steps_after_change: occurrences of a new (length, batch size, rungs) not fitted.
        trace_lengths: lengths traced for the replay (2–8).
        measure_every_n_steps: measure one batch in ``n`` once a length has been measured.
        seq_len_fn: ``batch -> (batch_size, seq_len)``; default reads the first 2-D integer tensor
            (``input_ids`` first in a mapping).
        mitigations: the ladder, in the order tried: by default ``"attention"`` (eager → SDPA →
            flash-attn), ``"checkpointing"``, ``"microbatch"``; opt in to ``"fused_loss"``,
            ``"tiled_mlp"``, ``"activation_offload"``; ``()`` warns and caps instead.
        breakdown: after fit, attribute the memory to modules and kinds (:mod:`.fit_breakdown`) on a
            copy of the model: :attr:`breakdown_report`, the report's section, TensorBoard text.
        dry_run: judge every new length, batch size and set of rungs by a dry run of the training
            step on a fake copy of the module (:mod:`.dryrun`; rank zero, about a second each)
            before extrapolating from measured steps; ``False``: the replay and quadratic fit only.
        summary: print a few lines on rank zero at the end of fit (longest length, peak against
            the budget, rungs on, warnings, the logger's ``version_N/`` folder of the outputs).
        name: tells this callback's checkpoint state apart from another ``SeqMemCallback``'s in the
            same Trainer; found by this name only, a resume may change ``memory_budget``,
            ``mitigations`` or ``curriculum`` (:func:`.checkpoint.reconcile`, one warning).
        host_memory_budget: host (CPU) memory a setting may use, bytes or a string with a unit
            (``"256GiB"``; default the machine's RAM), held against what offload keeps there
            (:func:`lightning_seqmem.plan.budgets.fits_budgets`).

    Logged scalars (through every logger of the trainer, at each measured batch; GiB = 2³⁰ bytes;
    the table is :data:`lightning_seqmem.core.tags.TAGS`):

    ==================================  ============================================================
    tag                                 meaning
    ==================================  ============================================================
    ``seqmem/seq_len``                  sequence length of the batch (tokens)
    ``seqmem/batch_size``               samples in the batch
    ``seqmem/peak_allocated_gib``       peak allocated (CUDA) or live-tensor (tracker) memory
    ``seqmem/peak_forward_gib``         peak during forward (batch start → before backward)
    ``seqmem/peak_backward_gib``        peak during backward
    ``seqmem/peak_optimizer_gib``       peak during the optimizer step (absent while accumulating)
    ``seqmem/reserved_gib``             peak reserved by the CUDA caching allocator (CUDA only)
    ``seqmem/fragmentation_gib``        reserved minus allocated at the peak (CUDA only)
    ``seqmem/fragmentation_fraction``   fragmentation over reserved (CUDA only)
    ``seqmem/inactive_split_gib``       inactive split blocks (CUDA only)
    ``seqmem/alloc_retries``            cudaMalloc retries after a failure, cumulative (CUDA only)
    ``seqmem/num_ooms``                 allocator OOMs, cumulative (CUDA only)
    ``seqmem/warmup``                   1 for a warm-up batch (measured, not fitted)
    ``seqmem/verification_error``       latest (forecast − measured) / measured at a new length
    ``seqmem/stage``                    curriculum stage index (with a curriculum)
    ``seqmem/mitigations_applied``      number of mitigations switched on so far
    ``seqmem/forecast_next_gib``        forecast upper bound for the next stage (or this length)
    ``seqmem/max_seq_len``              largest length that fits the usable budget (with a budget)
    ``seqmem/budget_gib``               usable budget: budget × (1 − safety_margin)
    ``seqmem/headroom_gib``             usable budget − forecast_next
    ``seqmem/headroom_fraction``        headroom over the usable budget
    ``seqmem/validation_peak_gib``      measured peak of a validation batch of a new shape
    ``seqmem/validation_seq_len``       length of that validation batch (tokens)
    ==================================  ============================================================

    Example:
        >>> import lightning.pytorch as pl
        >>> from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
        >>> cb = SeqMemCallback(curriculum=Curriculum(start=16, target=64, steps_per_stage=3))
        >>> trainer = pl.Trainer(max_steps=9, accelerator="cpu", callbacks=[cb], logger=False,
        ...                      enable_checkpointing=False, enable_progress_bar=False,
        ...                      enable_model_summary=False)
        >>> trainer.fit(LitGPT(n_layer=1, d_model=32),  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
        ...             SyntheticTokenDataModule(batch_size=2, seq_len=64))
        seqmem: longest length 64 tokens (batch 2); peak ...; no memory budget; rungs on: none;
        0 warnings.
        seqmem: report in ...
        >>> [r.seq_len for r in cb.records]
        [16, 16, 16, 32, 32, 32, 64, 64, 64]
        >>> cb.forecast(256).method  # a dry run of this model's step at 256 tokens
        'dry_run'
    """

    def __init__(
        self,
        warmup_steps: int = 2,
        tolerance: float = 0.15,
        probe: str = "auto",
        memory_budget: Optional[int | str] = None,
        safety_margin: float = 0.1,
        curriculum: Optional[Curriculum] = None,
        warmup_steps_after_change: int = 1,
        trace_lengths: int = 3,
        measure_every_n_steps: int = 1,
        seq_len_fn: Optional[SeqLenFn] = None,
        mitigations: Sequence[str] = MITIGATIONS,
        breakdown: bool = False,
        dry_run: bool = True,
        name: Optional[str] = None,
        summary: bool = True,
        host_memory_budget: Optional[int | str] = None,
    ) -> None:
        self.config = SeqMemConfig(
            warmup_steps=warmup_steps, tolerance=tolerance, probe=probe,
            memory_budget=memory_budget, safety_margin=safety_margin, curriculum=curriculum,
            warmup_steps_after_change=warmup_steps_after_change, trace_lengths=trace_lengths,
            measure_every_n_steps=measure_every_n_steps, seq_len_fn=seq_len_fn,
            mitigations=mitigations, breakdown=breakdown, dry_run=dry_run, name=name,
            summary=summary, host_memory_budget=host_memory_budget)
        self.planner = SeqMemPlanner(config=self.config)
        self._bind(EdgeState())

    def _bind(self, state: EdgeState) -> None:
        """Take ``state`` as the edge's run state (fresh for each fit; the planner's is in
        ``self.planner``), with the objects that write it: guard, batch cycle, fit cycle."""
        self.edge = state
        self.guard = Guard(state, self.planner)
        self._batches = BatchCycle(self.config, self.planner, state, self.guard)
        # seq_len_fn reads every shape in a batch's window (a rung's split of the batch too)
        self._shapes = contextlib.ExitStack()
        self._fit = FitCycle(self.config, self.planner, state, self.guard)
        self._validation = ValidationCheck(self.config, self.planner, state, self.guard,
                                           self._batches.switch_on)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _ARGUMENTS:  # the arguments are `config`, frozen: a change is a new callback
            raise AttributeError(f"`SeqMemCallback.{name}` is an argument, read-only: read it as "
                                 f"`cb.config.{name}`, or make a new SeqMemCallback to change it")
        super().__setattr__(name, value)

    # -- Public API (the planner's state, read-only) -----------------------------------------------
    @property
    def state_key(self) -> str:
        """``"SeqMemCallback"`` (``"SeqMemCallback{'name': ...}"`` with a ``name``): not the budget,
        ladder or curriculum, so a resume that changes them finds the state and reconciles it."""
        return (type(self).__qualname__ if self.config.name is None
                else self._generate_state_key(name=self.config.name))

    records = property(lambda self: self.planner.evidence.measured.records,
                       doc="Every measured batch, as :class:`StepRecord` (past "
                           "``state.MEMORY_RECORDS``, a summary and the latest).")
    applied_mitigations = property(lambda self: self.planner.ladder.applied,
                                   doc="Rungs switched on, in order.")
    mitigation_events = property(lambda self: self.planner.ladder.events,
                                 doc="Each switch, with peaks before/after.")
    mitigations = property(lambda self: self.planner.ladder.allowed,
                           doc="The rungs this run may still use.")
    usable_budget_bytes = property(lambda self: self.planner.settings.usable_budget_bytes,
                                   doc="budget × (1 − safety_margin).")
    seq_len = property(lambda self: self.planner.course.seq_len,
                       doc="The curriculum's current length (None without one).")
    breakdowns = property(lambda self: self.edge.breakdowns,
                          doc="The traced breakdowns (``breakdown=True``, after fit).")
    breakdown_table = property(lambda self: self.edge.breakdown_table,
                               doc="Their table across lengths, or None.")
    breakdown_report = property(lambda self: self.edge.breakdown_report,
                                doc="The report's breakdown section, or None.")

    @property
    def forecaster(self) -> MemoryForecaster:
        """The forecaster of the mitigations applied now (each setting has its own fit)."""
        return self.planner.evidence.forecaster

    @property
    def configured_mitigations(self) -> tuple[str, ...]:
        """The ladder this callback was configured with (``mitigations=``), in the order tried
        (:attr:`mitigations` less what this run cannot take or lost on the way)."""
        return self.config.mitigations

    def forecast(self, seq_len: int, batch_size: Optional[int] = None,
                 mitigations: Optional[Sequence[str]] = None,
                 world_size: Optional[int] = None) -> Forecast:
        """Predicted peak of a training step at ``(seq_len, batch_size)`` with ``mitigations``
        (defaults: the last measured batch size, the mitigations on now); see
        :meth:`~lightning_seqmem.plan.evidence.Evidence.forecast`. With ``world_size``: the per-rank
        peak at that many ranks (FSDP2 for a sharded run, else DDP), by a dry run in a fake process
        group (:func:`lightning_seqmem.dryrun.sharded.world_forecast`; rank zero)."""
        if world_size is not None:
            from lightning_seqmem.dryrun.sharded import world_forecast

            key = (self.planner.ladder.applied if mitigations is None
                   else check_mitigations(mitigations))
            fc = world_forecast(self.edge.dry_runner, seq_len,
                                self.planner.evidence.measured.batch_size_or_last(batch_size), key,
                                world_size)
        else:
            fc = self.planner.evidence.forecast(seq_len, batch_size, mitigations)
            self.guard.warn_advice()  # says a dry run refused or found wrong at first check
        note = self._fit.program_note()[1]
        return dataclasses.replace(fc, detail=f"{fc.detail}; {note}") if note else fc

    def max_seq_len(self, budget_bytes: Optional[int | str] = None,
                    batch_size: Optional[int] = None) -> int:
        """Largest sequence length whose forecast bound fits ``budget_bytes`` (default: the usable
        budget); on CUDA the bound includes the fragmentation measured so far."""
        budget = None if budget_bytes is None else parse_bytes(budget_bytes, "budget_bytes")
        return self.planner.evidence.max_seq_len(budget, batch_size)

    # -- Set-up ------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":  # no hook of the callback's runs there: said once
            self.guard.warn_once(A.outside_fit(getattr(stage, "value", stage)))
            return
        if self.planner.evidence.measured.records or self.planner.course.step:
            self._bind(self._fit.next_fit(trainer, pl_module))
        self._fit.setup(trainer, pl_module)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Refuse a budget below the parameters; write the TensorBoard panel layout; after a resume,
        switch the mitigations on again (:meth:`.fit_cycle.FitCycle.fit_start`)."""
        self._fit.fit_start(trainer, pl_module)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """With a curriculum and batches only the dataset can shorten: the first batch's length,
        set ahead through its ``set_seq_len`` (:meth:`.batch_cycle.BatchCycle.set_first_length`)."""
        self._batches.set_first_length(trainer)

    # -- Each batch: agree, decide, apply, cut, measure; gather, record, log -----------------------
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._shapes.close()
        if self.config.seq_len_fn is not None:
            self._shapes.enter_context(shapes_read_by(self.config.seq_len_fn))
        self._batches.before_batch(trainer, pl_module, batch)

    @_guarded
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           loss: torch.Tensor) -> None:
        self._mark_phase("backward")

    @_guarded
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Any) -> None:
        self._mark_phase("optimizer")

    def _mark_phase(self, phase: str) -> None:
        """The measured step running now, if one is, enters ``phase``."""
        if self.edge.probe is not None and self.edge.probe.running:
            self.edge.probe.mark_phase(phase)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs_: Any,
                           batch: Any, batch_idx: int) -> None:
        self._batches.after_batch(trainer, pl_module, batch)
        self._shapes.close()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.guard.safely("the validation batches' check", lambda: self._validation.start(trainer))

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                  batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Inside a fit, a new validation batch shape is dry-run (over the budget, rungs go on
        before it runs, or it is said) and measured (:class:`.validation_check.ValidationCheck`)."""
        self.guard.safely("the validation batch's check",  # one warning; training measured on
                          lambda: self._validation.before_batch(trainer, pl_module, batch))

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                outputs_: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        self.guard.safely("the validation batch's measurement",
                          lambda: self._validation.after_batch(trainer))

    # -- End of fit, reports, failures -------------------------------------------------------------
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The memory breakdown (``breakdown=True``), the memory figure to TensorBoard, and the
        JSON / Markdown report next to the logs (:meth:`.fit_cycle.FitCycle.train_end`)."""
        self._fit.train_end(trainer, pl_module)

    def run_breakdown(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """Trace the memory breakdown now (:func:`.fit_breakdown.run_breakdown`): sets
        :attr:`breakdowns`, :attr:`breakdown_table`, :attr:`breakdown_report`, warns each diagnosis
        once, logs the tables as TensorBoard text and returns the section."""
        return self._fit.run_breakdown(trainer, pl_module)

    def write_report(self, trainer: pl.Trainer, directory: Optional[str] = None) -> Any:
        """Write ``seqmem_report.json``, ``seqmem_report.md`` and the figure; return their paths.
        ``directory`` defaults to the logger's ``log_dir`` (``default_root_dir`` without one)."""
        return self._fit.write_report(trainer, directory)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        """Leave the dispatch mode; for a real out-of-memory error, write a diagnosis (Lightning
        then re-raises the error unchanged)."""
        self._shapes.close()
        self.edge.abort_probe()
        if is_oom(exception) and trainer.global_rank == 0:
            outputs.report_oom(PlanView.of(self.planner), trainer, exception, self.edge.pending)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._shapes.close()  # a batch whose end never ran (the module's on_train_batch_start -1)
        self.edge.abort_probe()

    # -- Checkpointing -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**self.planner.state_dict(),
                "uses_datamodule_length": self.edge.uses_datamodule_length,
                "validation": [dict(row) for row in self.edge.validation],
                "config": self._fit.run_config()}

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """Adopt an earlier version's state (:func:`.fit_cycle.adopt_legacy_state`)."""
        adopt_legacy_state(checkpoint, self.state_key)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from a checkpoint, checked field by field (:func:`.checkpoint.validate_state`)
        and reconciled with this callback's configuration (:func:`.checkpoint.reconcile`). A state
        this version cannot read or trust gives one warning naming the field and a fresh start,
        never a failed resume (:meth:`.fit_cycle.FitCycle.load_state`)."""
        self._fit.load_state(state_dict)


__all__ = ["SeqMemCallback"]
