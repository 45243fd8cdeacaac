"""``SeqMemCallback``: the Lightning edge of lightning-seqmem.

The hooks, in the order a fit runs them, each calling the part that does the work: the checks
before the first step (:mod:`.fit_setup`), a resume or a second fit (:mod:`.resume`), the decision
before each batch and its rungs on every rank (:mod:`.batch_decision`), the curriculum's length on the
batch (:mod:`.lengths`), the measured step around the probe (:mod:`.measured_step`) and the outputs
at the end of fit (:mod:`.fit_end`). Every decision is the torch-free
:class:`~lightning_seqmem.plan.planner.SeqMemPlanner`'s; everything written goes through
:mod:`~lightning_seqmem.trainer.outputs`. The callback's own run state for a fit is one
:class:`~lightning_seqmem.trainer.run_state.EdgeState` (``cb.edge``, fresh for each fit), which the
parts read and write; they warn and stop measuring through :mod:`.guard`.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Any, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_seqmem.core import advice as A
from lightning_seqmem.trainer import access as edge
from lightning_seqmem.trainer import batch_decision, fit_end, fit_setup, lengths, measured_step, outputs, resume
from lightning_seqmem.measure.batch import read_batch_shape
from lightning_seqmem.core.config import SeqMemConfig
from lightning_seqmem.core.config import SeqLenFn
from lightning_seqmem.core.curriculum import Curriculum
from lightning_seqmem.core.forecast import Forecast, MemoryForecaster
from lightning_seqmem.mitigations import ladder
from lightning_seqmem.trainer.fit_setup import COMPILED_MEASURE_EVERY_N_STEPS  # noqa: F401 - importable here too
from lightning_seqmem.trainer.guard import guarded as _guarded
from lightning_seqmem.trainer.guard import safely, warn_advice
from lightning_seqmem.trainer.run_state import EdgeState
from lightning_seqmem.trainer.oom import is_oom
from lightning_seqmem.plan.planner import SeqMemPlanner
from lightning_seqmem.measure.probes import make_probe
from lightning_seqmem.core.records import MemoryBudgetError, SeqMemFailureWarning, StepRecord  # noqa: F401 - as before
from lightning_seqmem.core.units import parse_bytes



_ARGUMENTS = frozenset(f.name for f in dataclasses.fields(SeqMemConfig)) | {"probe_name"}


class SeqMemCallback(Callback):
    r"""Measure every training step's memory, predict it at any sequence length, stay in budget.

    After ``warmup_steps`` batches, every batch's peak memory is measured phase by phase (forward,
    backward, optimizer step) and kept in :attr:`records`. From the measured lengths two predictors
    are fitted — a timeline replay of traced steps and the article's quadratic model
    ``M(L, B) = C + B·(a·L + b·L²)`` — and :meth:`forecast` / :meth:`max_seq_len` answer for any
    length. Before every batch the planner judges whether it fits the usable budget (see
    :mod:`lightning_seqmem.plan.planner`): a curriculum stage is entered only on a forecast that fits,
    a batch judged over switches the next mitigation on first, and with nothing left to switch on
    the curriculum is capped with one :class:`PredictedOOMWarning`. A budget nothing can meet (the
    parameters alone, or the shortest length with every rung) raises
    :class:`~lightning_seqmem.MemoryBudgetError` before training, or before the batch where it is
    first known, rather than training over it. Under DDP the decision is
    taken once, on rank zero, from every rank's shape, and applied on all ranks at the same step.

    A ``torch.compile``'d module (compiled in ``__init__`` or ``configure_model``) keeps compiling,
    and one warning says what is measured. On CUDA the allocator counters leave compilation alone:
    measurements and forecasts are of the compiled program, and no step is traced for the replay (a
    traced step would run eager). The live-tensor tracker (CPU) is a ``TorchDispatchMode``, under
    which ``torch.compile`` cannot run: a tracked step runs eager (``torch.compiler.set_stance(
    "force_eager")``, so dynamo does not give up on the code), and with a compiled module only
    warm-ups, the first steps at a new shape and one step in ``max(measure_every_n_steps, 10)`` are
    tracked; every other step runs compiled. Those measurements and forecasts are of the eager
    program, and say so (:meth:`forecast`'s ``detail``, the report's probe line). The dry run
    refuses compiled modules (one warning); the fit of measured steps answers instead.

    A curriculum stage counts only the steps that ran at its length: where the data is shorter
    than the stage, or a batch cannot be cut, the record says the length that ran, one warning says
    so, and the curriculum holds instead of advancing. A batch that only the dataset can shorten
    (a tuple or a bare tensor, through ``set_seq_len``) with ``DataLoader(num_workers > 0)`` is
    refused before the first step: the workers' copies of the dataset would never see the length.

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
        curriculum: a :class:`~lightning_seqmem.Curriculum` (batches are cut, or with
            ``truncate=False`` reshaped, to the stage's length); ``None`` measures the data's lengths.
        warmup_steps_after_change: occurrences of a new (length, batch size, mitigations) not fitted.
        trace_lengths: lengths traced for the replay (2–8).
        measure_every_n_steps: measure one batch in ``n`` once a length has been measured.
        seq_len_fn: ``batch -> (batch_size, seq_len)``; default reads the first 2-D integer tensor
            (``input_ids`` first in a mapping).
        mitigations: the ladder, in the order tried: ``"attention"`` (eager → SDPA → flash-attn),
            ``"checkpointing"`` (activation checkpointing of the repeated blocks), ``"microbatch"``
            (micro-batches of one sample inside the step); ``()`` warns and caps instead.
        breakdown: after fit, attribute the memory to modules and kinds (:mod:`.fit_breakdown`) on a
            copy of the model: :attr:`breakdown_report`, the report's section, TensorBoard text.
        dry_run: judge every new length, batch size and set of rungs by a dry run of the training
            step on a fake copy of the module (:mod:`.dryrun`; rank zero, about a second each)
            before extrapolating from measured steps; ``False`` uses the replay and quadratic fit only.
        summary: at the end of fit, print a few lines on rank zero (longest length, peak against
            the budget, rungs on, warnings, and the folder holding the report, figure and
            TensorBoard panels: the logger's ``version_N/``); ``False`` prints nothing.
        name: tells this callback's checkpoint state apart from another ``SeqMemCallback``'s in the
            same Trainer (each needs its own name there). The state is found by this name only, so
            a resume may change ``memory_budget``, ``mitigations`` or ``curriculum``: the change is
            reconciled and said in one warning (:func:`lightning_seqmem.plan.checkpoint.reconcile`).
        host_memory_budget: host (CPU) memory a setting may use, bytes or a string with a unit
            (``"256GiB"``); default the machine's RAM. What offload (FSDP2 ``CPUOffloadPolicy``,
            activation offload) keeps there is held against it by the planners
            (:func:`lightning_seqmem.plan.budgets.fits_budgets`).

    Logged scalars (through every logger of the trainer, at each measured batch; GiB = 2³⁰ bytes;
    the table is :data:`lightning_seqmem.core.tags.TAGS`):

    ==================================  ================================================================
    tag                                 meaning
    ==================================  ================================================================
    ``seqmem/seq_len``                  sequence length of the batch (tokens)
    ``seqmem/batch_size``               samples in the batch
    ``seqmem/peak_allocated_gib``       peak allocated (CUDA) or live tensor (tracker) memory of the step
    ``seqmem/peak_forward_gib``         peak during forward (batch start → before backward)
    ``seqmem/peak_backward_gib``        peak during backward
    ``seqmem/peak_optimizer_gib``       peak during the optimizer step (absent while accumulating)
    ``seqmem/reserved_gib``             peak reserved by the CUDA caching allocator (CUDA only)
    ``seqmem/fragmentation_gib``        reserved minus allocated at the peak (CUDA only)
    ``seqmem/fragmentation_fraction``   fragmentation over reserved (CUDA only)
    ``seqmem/inactive_split_gib``       inactive split blocks (CUDA only)
    ``seqmem/alloc_retries``            allocator retries after a failed cudaMalloc, cumulative (CUDA only)
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
    ==================================  ================================================================

    Example:
        >>> import lightning.pytorch as pl
        >>> from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
        >>> cb = SeqMemCallback(curriculum=Curriculum(start=16, target=64, steps_per_stage=3))
        >>> trainer = pl.Trainer(max_steps=9, accelerator="cpu", callbacks=[cb], logger=False,
        ...                      enable_checkpointing=False, enable_progress_bar=False,
        ...                      enable_model_summary=False)
        >>> trainer.fit(LitGPT(n_layer=1, d_model=32), SyntheticTokenDataModule(batch_size=2, seq_len=64))  # doctest: +ELLIPSIS
        seqmem: longest length 64 tokens (batch 2); peak ...; no memory budget; rungs on: none; 0 warnings.
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
        mitigations: Sequence[str] = ladder.MITIGATIONS,
        breakdown: bool = False,
        dry_run: bool = True,
        name: Optional[str] = None,
        summary: bool = True,
        host_memory_budget: Optional[int | str] = None,
    ) -> None:
        self.config = SeqMemConfig(
            warmup_steps=warmup_steps, tolerance=tolerance, probe=probe, memory_budget=memory_budget,
            safety_margin=safety_margin, curriculum=curriculum, warmup_steps_after_change=warmup_steps_after_change,
            trace_lengths=trace_lengths, measure_every_n_steps=measure_every_n_steps, seq_len_fn=seq_len_fn,
            mitigations=mitigations, breakdown=breakdown, dry_run=dry_run, name=name, summary=summary,
            host_memory_budget=host_memory_budget)
        self.planner = SeqMemPlanner(config=self.config)
        self.edge = EdgeState()  # the edge's own run state, fresh for each fit (the planner's is in self.planner)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _ARGUMENTS:  # the arguments are `config`, frozen: a change is a new callback
            raise AttributeError(f"`SeqMemCallback.{name}` is an argument, read-only: read it as "
                                 f"`cb.config.{name}`, or make a new SeqMemCallback to change it")
        super().__setattr__(name, value)

    # -- Public API (the planner's state, read-only) -------------------------------------------------
    @property
    def state_key(self) -> str:
        """``"SeqMemCallback"`` (``"SeqMemCallback{'name': ...}"`` with a ``name``): not the budget,
        ladder or curriculum, so a resume that changes them finds the state and reconciles it."""
        return type(self).__qualname__ if self.config.name is None else self._generate_state_key(name=self.config.name)

    records = property(lambda self: self.planner.evidence.records, doc="Every measured batch, as :class:`StepRecord` (past ``state.MEMORY_RECORDS``, a summary and the latest).")
    applied_mitigations = property(lambda self: self.planner.ladder.applied, doc="Rungs switched on, in order.")
    mitigation_events = property(lambda self: self.planner.ladder.events, doc="Each switch, with peaks before/after.")
    mitigations = property(lambda self: self.planner.ladder.allowed, doc="The rungs this run may still use.")
    usable_budget_bytes = property(lambda self: self.planner.settings.usable_budget_bytes, doc="budget × (1 − safety_margin).")
    seq_len = property(lambda self: self.planner.course.seq_len, doc="The curriculum's current length (None without one).")

    @property
    def forecaster(self) -> MemoryForecaster:
        """The forecaster of the mitigations applied now (each setting has its own fit)."""
        return self.planner.evidence.forecaster

    @property
    def configured_mitigations(self) -> tuple[str, ...]:
        """The ladder this callback was configured with (``mitigations=``), in the order tried
        (:attr:`mitigations` less what this run cannot take or lost on the way)."""
        return self.config.mitigations

    def forecast(self, seq_len: int, batch_size: Optional[int] = None, mitigations: Optional[Sequence[str]] = None,
                 world_size: Optional[int] = None) -> Forecast:
        """Predicted peak of a training step at ``(seq_len, batch_size)`` with ``mitigations``
        (defaults: the last measured batch size, the mitigations on now); see
        :meth:`SeqMemPlanner.forecast <lightning_seqmem.plan.planner.SeqMemPlanner.forecast>`. With
        ``world_size``: the per-rank peak at that many ranks (FSDP2 for a sharded run, else DDP), by a
        dry run in a fake process group (:func:`lightning_seqmem.dryrun.sharded.world_forecast`; rank zero)."""
        if world_size is not None:
            from lightning_seqmem.dryrun.sharded import world_forecast

            key = self.planner.ladder.applied if mitigations is None else ladder.check_mitigations(mitigations)
            fc = world_forecast(self.edge.dry_runner, seq_len, self.planner.evidence.batch_size_or_last(batch_size), key, world_size)
        else:
            fc = self.planner.evidence.forecast(seq_len, batch_size, mitigations)
            warn_advice(self)  # a dry run found wrong at its first check, or refused, is said here too
        probe = self.edge.probe
        note = A.program_note(self.edge.compiled_reason, probe.name if probe is not None else self.config.probe)
        return dataclasses.replace(fc, detail=f"{fc.detail}; {note}") if note else fc

    def max_seq_len(self, budget_bytes: Optional[int | str] = None, batch_size: Optional[int] = None) -> int:
        """Largest sequence length whose forecast bound fits ``budget_bytes`` (default: the usable
        budget); on CUDA the bound includes the fragmentation measured so far."""
        budget = None if budget_bytes is None else parse_bytes(budget_bytes, "budget_bytes")
        return self.planner.evidence.max_seq_len(budget, batch_size)

    # -- Set-up --------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.planner.evidence.records or self.planner.course.step:
            resume.next_fit(self, trainer, pl_module)
        self.edge.fit_refs = (weakref.ref(trainer), weakref.ref(pl_module))
        device = self.edge.device = trainer.strategy.root_device
        self.edge.probe = make_probe(self.config.probe, device)
        on_cuda = device.type == "cuda"
        if self.config.memory_budget_bytes is None and on_cuda:
            self.planner.bind_run(budget_bytes=torch.cuda.get_device_properties(device).total_memory)
        self.planner.bind_run(compare_reserved=on_cuda, block_bytes=512 if on_cuda else 1,
                              precision=str(trainer.precision), device_type=device.type)
        self.edge.sharding_template = edge.sharding_template(trainer, pl_module)  # before configure_model() shards it
        self._check_strategy_and_module(trainer, pl_module)
        warn_advice(self)

    def _check_strategy_and_module(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Drop the rungs this run cannot take, saying why, before training starts."""
        self.planner.on_rung("dropped", *edge.unsupported_rungs(trainer, pl_module, self.planner.ladder.allowed))
        warn_advice(self)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Refuse a budget below the parameters; write the TensorBoard panel layout; after a resume,
        switch the mitigations on again."""
        fit_setup.check_parameters_fit(self.planner, pl_module, self.edge.device)
        fit_setup.check_compiled(self, pl_module)
        safely(self, "the model's length limit", lambda: self.planner.bind_run(**dict(zip(("length_limit", "length_limit_reason"), edge.model_length_limit(pl_module) or (None, "")))))
        if trainer.is_global_zero:
            safely(self, "the TensorBoard layout", lambda: outputs.write_layout(trainer))
            if self.config.dry_run:
                self.edge.dry_runner = fit_setup.start_dry_run(self, trainer, pl_module)
                self.planner.bind_run(dry_run=self.edge.dry_runner)
        resume.resume_rungs(self, trainer, pl_module)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """With a curriculum and batches only the dataset can shorten: the first batch's length,
        set ahead through its ``set_seq_len`` (:func:`.lengths.set_first_length`)."""
        lengths.set_first_length(self, trainer)

    # -- Before a batch: agree, decide, apply, cut, start measuring ----------------------------------
    def _read_shape(self, batch: Any) -> tuple[int, int]:
        return read_batch_shape(batch, self.config.seq_len_fn)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.edge.window_batch = batch  # the step window opens: a dry run leaves room beside it
        if self.edge.stopped:  # every rank stopped together: hold the curriculum where it is, no collectives
            safely(self, "the curriculum", lambda: lengths.cut(self, trainer, batch, self.planner.course.seq_len))
            return
        failed, shape, applicable = batch_decision.local_inputs(self, trainer, pl_module, batch)
        if self.edge.dry_runner is not None and not failed:
            safely(self, "the dry run's batch", lambda: self.edge.dry_runner.keep(batch))
        agreed = batch_decision.agree_and_apply(self, trainer, pl_module, batch, failed, shape, applicable)
        if agreed is None:
            return  # a rank stopped measuring, so every rank did
        decision, shape = agreed
        if decision.rungs or decision.action in ("cap", "probe"):  # a lighter setting or a shorter batch
            safely(self, "releasing cached memory", lambda: edge.release_cached_memory(pl_module))
        if decision.action != "run" and self.config.curriculum is not None and trainer.is_global_zero and self.records:
            safely(self, "the memory figure", lambda: outputs.log_figure(trainer, self.planner))  # as the stage ends
        lengths.cut_for_step(self, trainer, batch, decision.seq_len)
        check = batch_decision.check_pending(self, trainer, pl_module, batch)  # (a collective)
        measured_step.start_measurement(self, trainer, pl_module, batch, decision, shape, check)
        warn_advice(self)
        self.edge.step_started_s = time.perf_counter()  # the step itself from here: the decision and its dry runs are done

    @_guarded
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self.edge.probe is not None and self.edge.probe.running:
            self.edge.probe.mark_phase("backward")

    @_guarded
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.edge.probe is not None and self.edge.probe.running:
            self.edge.probe.mark_phase("optimizer")

    # -- After a batch: gather, record, log ----------------------------------------------------------
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs_: Any, batch: Any, batch_idx: int) -> None:
        try:
            self._batch_end(trainer, pl_module, batch)
        finally:
            self.edge.window_batch = None  # the step window closes

    def _batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        if self.edge.stopped:
            return
        pending, self.edge.pending = self.edge.pending, None
        started, self.edge.step_started_s = self.edge.step_started_s, None
        seconds = measured_step.step_seconds(started, pending, pl_module)
        memory = measured_step.stop_probe(self, pending)
        refusal = batch_decision.refusal(self, pl_module)
        gathered = measured_step.gather(self, trainer, memory, refusal is not None)
        if gathered is None:
            return  # a rank stopped measuring, so every rank did
        any_refused, row = gathered
        if any_refused:  # e.g. the loss is not a mean: micro-batching is off on every rank, and this step ran whole
            batch_decision.undo_refused(self, trainer, pl_module, refusal, pending)
        measured_step.record_step(self, trainer, pending, row, memory, seconds)
        if self.edge.uses_datamodule_length:  # the next batch is fetched before its batch start (every rank: a collective)
            safely(self, "setting the next batch's length", lambda: batch_decision.set_next_length(self, trainer, pl_module, batch))
        if self.config.breakdown and not self.edge.failed and trainer.is_global_zero:
            safely(self, "the memory breakdown", lambda: setattr(self.edge, "breakdown_batch", edge.longest_batch(
                self.edge.breakdown_batch, batch, self._read_shape(batch)[1])))
        warn_advice(self)

    # -- End of fit, reports, failures ---------------------------------------------------------------
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The memory breakdown (``breakdown=True``), the memory figure to TensorBoard, and the
        JSON / Markdown report next to the logs (:func:`.fit_end.train_end`)."""
        fit_end.train_end(self, trainer, pl_module)

    def run_breakdown(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """Trace the memory breakdown now (see :func:`lightning_seqmem.trainer.fit_breakdown.run_breakdown`);
        sets :attr:`breakdowns`, :attr:`breakdown_table`, :attr:`breakdown_report`, warns each
        diagnosis once, logs the tables as TensorBoard text and returns the section."""
        return fit_end.run_breakdown(self, trainer, pl_module)

    def write_report(self, trainer: pl.Trainer, directory: Optional[str] = None) -> Any:
        """Write ``seqmem_report.json``, ``seqmem_report.md`` and the figure; return their paths.

        ``directory`` defaults to the logger's ``log_dir`` (``default_root_dir`` without a logger).
        """
        return fit_end.write_report(self, trainer, directory)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Leave the dispatch mode; for a real out-of-memory error, write a diagnosis. Lightning then
        re-raises the error unchanged."""
        if self.edge.probe is not None:
            self.edge.probe.abort()
        if is_oom(exception) and trainer.global_rank == 0:
            outputs.report_oom(self.planner, trainer, exception, self.edge.pending)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.edge.probe is not None:
            self.edge.probe.abort()

    # -- Checkpointing -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**self.planner.state_dict(), "uses_datamodule_length": self.edge.uses_datamodule_length,
                "config": resume.run_config(self)}

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        """A checkpoint of an earlier version keyed the state by the configuration: found under that
        key (when it is the only such state), with the configuration it names, for reconciliation."""
        resume.adopt_legacy_state(checkpoint, self.state_key)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from a checkpoint, checked field by field (:func:`~lightning_seqmem.plan.checkpoint.validate_state`)
        and reconciled with this callback's configuration (:func:`~lightning_seqmem.plan.checkpoint.reconcile`).
        A state this version cannot read or trust gives one warning naming the field and a fresh
        start (measurement resumes from scratch), never a failed resume (:func:`.resume.load_state`)."""
        resume.load_state(self, state_dict)


__all__ = ["SeqMemCallback", "StepRecord"]
