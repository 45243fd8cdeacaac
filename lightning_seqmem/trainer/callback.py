"""``SeqMemCallback``: the Lightning edge of lightning-seqmem.

Hooks, the probe's lifecycle, rank agreement and applying decisions. Every decision is the
torch-free :class:`~lightning_seqmem.plan.planner.SeqMemPlanner`'s; everything written goes through
:mod:`~lightning_seqmem.trainer.outputs`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from typing import Any, Callable, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_seqmem.core import advice as A
from lightning_seqmem.trainer import ranks as distributed
from lightning_seqmem.trainer import access as edge
from lightning_seqmem.trainer import outputs
from lightning_seqmem.plan import checkpoint as S
from lightning_seqmem.measure.batch import read_batch_shape
from lightning_seqmem.core.checks import check_fraction, check_int
from lightning_seqmem.core.curriculum import Curriculum
from lightning_seqmem.core.forecast import Forecast, MemoryForecaster
from lightning_seqmem.mitigations import ladder
from lightning_seqmem.trainer.oom import is_oom
from lightning_seqmem.plan.planner import Decision, PendingStep, SeqMemPlanner
from lightning_seqmem.measure.probes import PROBE_NAMES, MemoryProbe, existing_tensors, make_probe
from lightning_seqmem.core.records import MemoryBudgetError, SeqMemFailureWarning, StepRecord
from lightning_seqmem.core.rungs import rung_names, spec
from lightning_seqmem.core.units import parse_bytes

SeqLenFn = Callable[[Any], "tuple[int, int]"]
COMPILED_MEASURE_EVERY_N_STEPS = 10
"""With a ``torch.compile``'d module and the tracker, at most one step in this many (besides warm-ups
and the first steps at a new shape) is measured: a measured step runs eager."""


def _guarded(hook: Callable) -> Callable:
    """Run a hook body; an internal failure becomes one warning and the callback stops measuring."""

    @functools.wraps(hook)
    def wrapper(self: "SeqMemCallback", *args: Any, **kwargs: Any) -> Any:
        if self._failed:
            return None
        try:
            return hook(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the callback must never be the reason a run dies
            self._fail(hook.__name__, exc)
            return None

    return wrapper


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
        breakdown: after fit, attribute the memory to modules and kinds (:mod:`.breakdown`) on a
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
    ) -> None:
        check_int("warmup_steps", warmup_steps, 1, accepted="an int ≥ 1 (the first step has no optimizer state)")
        check_int("warmup_steps_after_change", warmup_steps_after_change, 0, accepted="an int ≥ 0")
        check_int("trace_lengths", trace_lengths, 2, 8)
        check_int("measure_every_n_steps", measure_every_n_steps, 1, accepted="an int ≥ 1")
        tolerance = check_fraction("tolerance", tolerance, 0, 1)
        safety_margin = check_fraction("safety_margin", safety_margin, 0, 1, closed_low=True)
        if probe not in PROBE_NAMES:
            raise ValueError(f"`probe` must be one of {PROBE_NAMES}, got {probe!r}")
        if curriculum is not None and not isinstance(curriculum, Curriculum):
            raise ValueError(f"`curriculum` must be a lightning_seqmem.Curriculum or None, got {type(curriculum).__name__}")
        if seq_len_fn is not None and not callable(seq_len_fn):
            raise ValueError(f"`seq_len_fn` must be a callable batch -> (batch_size, seq_len) or None, got {seq_len_fn!r}")
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"`name` must be a non-empty string or None, got {name!r}")
        self.name = name  # (before the loop below reuses `name`)
        for name, value in (("breakdown", breakdown), ("dry_run", dry_run), ("summary", summary)):
            if not isinstance(value, bool):
                raise ValueError(f"`{name}` must be a bool, got {value!r}")
        self._mitigations_arg = ladder.check_mitigations(mitigations)
        self.memory_budget_bytes = None if memory_budget is None else parse_bytes(memory_budget, "memory_budget")
        self.warmup_steps, self.tolerance, self.safety_margin = warmup_steps, float(tolerance), float(safety_margin)
        self.warmup_steps_after_change, self.trace_lengths = warmup_steps_after_change, trace_lengths
        self.measure_every_n_steps = measure_every_n_steps
        self.probe_name = probe
        self.curriculum = curriculum
        self.seq_len_fn = seq_len_fn
        self.breakdown, self.dry_run, self.summary = breakdown, dry_run, summary
        self.planner = SeqMemPlanner(
            warmup_steps=warmup_steps, tolerance=float(tolerance), memory_budget_bytes=self.memory_budget_bytes,
            safety_margin=float(safety_margin), curriculum=curriculum,
            warmup_steps_after_change=warmup_steps_after_change, trace_lengths=trace_lengths,
            measure_every_n_steps=measure_every_n_steps, mitigations=self._mitigations_arg,
        )
        self._probe: Optional[MemoryProbe] = None
        self._device: Optional[torch.device] = None
        self._reset_edge()

    def _reset_edge(self) -> None:
        """The edge's own run state (the planner's is in ``self.planner``)."""
        self._failed = False  # this rank stopped measuring
        self._stopped = False  # every rank agreed to stop: no more collectives
        self._pending: Optional[PendingStep] = None
        self._step_started: Optional[float] = None  # perf_counter when the step itself began (after the decision)
        self._shape: Optional[tuple[int, int]] = None  # the batch as cut, on this rank
        self._applicable_cache: dict[tuple, dict[str, tuple[bool, str]]] = {}
        self._reapply_on_fit_start = False
        self._resume_phrases: list[str] = []  # what a resume under a changed configuration changed
        self._resume_removed: tuple[str, ...] = ()  # rungs that were on and are no longer allowed
        self._uses_datamodule_length = False
        self.breakdowns: list[Any] = []
        self.breakdown_table: Optional[Any] = None
        self.breakdown_report: Optional[dict[str, Any]] = None
        self._breakdown_batch: Optional[tuple[int, Any]] = None
        self._dry: Any = None  # training_dry_run.TrainingRunDryRun on rank zero, with dry_run=True
        self._compiled: Optional[str] = None  # why the module counts as torch.compile'd, or None
        self._template: Any = None  # unsharded copy on meta for FSDP2 runs (sharded.template_for)

    # -- Public API (the planner's state, read-only) -------------------------------------------------
    @property
    def state_key(self) -> str:
        """``"SeqMemCallback"`` (``"SeqMemCallback{'name': ...}"`` with a ``name``): not the budget,
        ladder or curriculum, so a resume that changes them finds the state and reconciles it."""
        return type(self).__qualname__ if self.name is None else self._generate_state_key(name=self.name)

    records = property(lambda self: self.planner.records, doc="Every measured batch, as :class:`StepRecord` (past ``state.MEMORY_RECORDS``, a summary and the latest).")
    applied_mitigations = property(lambda self: self.planner.applied_mitigations, doc="Rungs switched on, in order.")
    mitigation_events = property(lambda self: self.planner.mitigation_events, doc="Each switch, with peaks before/after.")
    mitigations = property(lambda self: self.planner.mitigations, doc="The rungs this run may still use.")
    usable_budget_bytes = property(lambda self: self.planner.usable_budget_bytes, doc="budget × (1 − safety_margin).")
    seq_len = property(lambda self: self.planner.seq_len, doc="The curriculum's current length (None without one).")

    @property
    def forecaster(self) -> MemoryForecaster:
        """The forecaster of the mitigations applied now (each setting has its own fit)."""
        return self.planner.forecaster

    @property
    def configured_mitigations(self) -> tuple[str, ...]:
        """The ladder this callback was configured with (``mitigations=``), in the order tried
        (:attr:`mitigations` less what this run cannot take or lost on the way)."""
        return self._mitigations_arg

    def forecast(self, seq_len: int, batch_size: Optional[int] = None, mitigations: Optional[Sequence[str]] = None,
                 world_size: Optional[int] = None) -> Forecast:
        """Predicted peak of a training step at ``(seq_len, batch_size)`` with ``mitigations``
        (defaults: the last measured batch size, the mitigations on now); see
        :meth:`SeqMemPlanner.forecast <lightning_seqmem.plan.planner.SeqMemPlanner.forecast>`. With
        ``world_size``: the per-rank peak at that many ranks (FSDP2 for a sharded run, else DDP), by a
        dry run in a fake process group (:func:`lightning_seqmem.dryrun.sharded.world_forecast`; rank zero)."""
        if world_size is not None:
            from lightning_seqmem.dryrun.sharded import world_forecast

            key = self.planner.applied_mitigations if mitigations is None else ladder.check_mitigations(mitigations)
            fc = world_forecast(self._dry, seq_len, self.planner._batch_size(batch_size), key, world_size)
        else:
            fc = self.planner.forecast(seq_len, batch_size, mitigations)
            self._warn_advice()  # a dry run found wrong at its first check, or refused, is said here too
        note = A.program_note(self._compiled, self._probe.name if self._probe is not None else self.probe_name)
        return dataclasses.replace(fc, detail=f"{fc.detail}; {note}") if note else fc

    def max_seq_len(self, budget_bytes: Optional[int | str] = None, batch_size: Optional[int] = None) -> int:
        """Largest sequence length whose forecast bound fits ``budget_bytes`` (default: the usable
        budget); on CUDA the bound includes the fragmentation measured so far."""
        budget = None if budget_bytes is None else parse_bytes(budget_bytes, "budget_bytes")
        return self.planner.max_seq_len(budget, batch_size)

    # -- Set-up --------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.planner.records or self.planner.step:
            self._next_fit(trainer, pl_module)
        self._last_fit = (weakref.ref(trainer), weakref.ref(pl_module))
        self._device = trainer.strategy.root_device
        self._probe = make_probe(self.probe_name, self._device)
        on_cuda = self._device.type == "cuda"
        if self.memory_budget_bytes is None and on_cuda:
            self.planner.bind_run(budget_bytes=torch.cuda.get_device_properties(self._device).total_memory)
        self.planner.bind_run(compare_reserved=on_cuda, block_bytes=512 if on_cuda else 1,
                              precision=str(trainer.precision), device_type=self._device.type)
        self._template = edge.sharding_template(trainer, pl_module)  # before configure_model() shards it
        self._check_strategy_and_module(trainer, pl_module)
        self._warn_advice()

    def _next_fit(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A fit after another one with this callback. On the same Trainer and module it continues the
        state (rungs on, records, fits, curriculum position); otherwise it starts afresh, said in one
        line, and reports the rungs of the last fit still on this module as on (they are)."""
        last = getattr(self, "_last_fit", None)
        same_trainer = last is not None and last[0]() is trainer
        same_module = last is not None and last[1]() is pl_module
        breakdowns = (self.breakdowns, self.breakdown_table, self.breakdown_report)
        self._reset_edge()
        if same_trainer and same_module:
            self.breakdowns, self.breakdown_table, self.breakdown_report = breakdowns
            on = ", ".join(self.planner.applied_mitigations) or "none"
            rank_zero_info(f"seqmem: a new fit on the same Trainer and module continues from step {self.planner.step} "
                           f"(rungs on: {on}; {len(self.planner.records)} records; curriculum stage "
                           f"{self.planner.seq_len}).")
            return
        still_on = tuple(n for n in self.planner.applied_mitigations if ladder.is_on(n, pl_module))
        self.planner.reset()
        self.planner.mitigations = self._mitigations_arg
        self.planner.applied_mitigations = still_on  # what the module runs with: never reported as off
        self.planner.forecaster  # noqa: B018 - that setting's own (empty) fit
        if getattr(trainer, "ckpt_path", None):
            return  # the checkpoint's state replaces this one (load_state_dict says how it resumed)
        why = "a new Trainer" if not same_trainer else "a new module"
        rungs = f"; still on this module: {', '.join(still_on)}" if still_on else ""
        rank_zero_warn(f"seqmem: this fit starts afresh ({why}): records, fits and the curriculum restart{rungs}.")

    def _check_strategy_and_module(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Drop the rungs this run cannot take, saying why, before training starts."""
        self.planner.drop_mitigations(*edge.unsupported_rungs(trainer, pl_module, self.planner.mitigations))
        self._warn_advice()

    def _check_compiled(self, pl_module: pl.LightningModule) -> None:
        """A ``torch.compile``'d module: measure without preventing compilation, and say so once
        (see the class docstring). Runs after ``configure_model``, where modules are often compiled."""
        from lightning_seqmem.dryrun.step import _compiled_reason

        self.planner.measure_every_n_steps = self.measure_every_n_steps
        self._compiled = _compiled_reason(pl_module)
        if self._compiled is None or self._probe is None:
            return
        if self._probe.name == "tracker":
            self.planner.measure_every_n_steps = max(self.measure_every_n_steps, COMPILED_MEASURE_EVERY_N_STEPS)
        self.planner.advise(A.compiled_module(self._compiled, self._probe.name, self.planner.measure_every_n_steps))
        self._warn_advice()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Refuse a budget below the parameters; write the TensorBoard panel layout; after a resume,
        switch the mitigations on again."""
        self._check_parameters_fit(pl_module)
        self._check_compiled(pl_module)
        self._safely("the model's length limit", lambda: self.planner.set_length_limit(*(edge.model_length_limit(pl_module) or (None, ""))))
        if trainer.is_global_zero:
            self._safely("the TensorBoard layout", lambda: outputs.write_layout(trainer))
            if self.dry_run:
                from lightning_seqmem.diagnostics.peak import trace_peak_site
                from lightning_seqmem.dryrun.run import TrainingRunDryRun

                self._dry = TrainingRunDryRun(trainer, pl_module, lambda: self.planner.applied_mitigations,
                                              lambda why, *shape: self.planner.advise(A.dry_run_unavailable(why, *shape)),
                                              template=self._template, site=trace_peak_site)
                self.planner.bind_run(dry_run=self._dry)
        if self._reapply_on_fit_start:
            self._reapply_on_fit_start = False
            for name in self.planner.applied_mitigations:
                ok, detail = ladder.try_apply(name, trainer, pl_module)
                rank_zero_info(f"seqmem: resumed with {name} on ({detail})")
        self._say_resume(trainer, pl_module)

    def _check_parameters_fit(self, pl_module: pl.LightningModule) -> None:
        """:class:`MemoryBudgetError` where this rank's parameters and buffers on the training device
        (local shards under FSDP2) alone exceed the usable budget: no step could fit."""
        usable = self.planner.usable_budget_bytes
        if usable is None or self._device is None:
            return
        held = 0
        for tensor in (*pl_module.parameters(), *pl_module.buffers()):
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's shard
            if local.device.type == self._device.type:
                held += local.nbytes
        if held > usable:
            assert self.planner.budget_bytes is not None
            raise MemoryBudgetError(A.parameters_over_budget(held, usable, self.planner.budget_bytes,
                                                             self.planner.safety_margin))

    def _say_resume(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After a resume under a changed configuration: take the rungs no longer allowed off the
        module where they are on and can be, and say everything in one warning."""
        phrases, removed = self._resume_phrases, self._resume_removed
        self._resume_phrases, self._resume_removed = [], ()
        for name in removed:
            outcome = "off"
            if ladder.is_on(name, pl_module):
                result = ladder.remove(name, trainer, pl_module)
                outcome = ("taken off this module" if result is not None and result.applied else
                           "it stays on this module (it cannot be undone; a freshly built module trains without it)")
            phrases.append(f"rung {name!r} no longer allowed: {outcome}")
        if phrases:
            rank_zero_warn(f"seqmem: resumed with {'; '.join(phrases)}.")

    # -- Lengths set ahead through the dataset's ``set_seq_len`` -----------------------------------------
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """With a curriculum, batches that cannot be cut in place (a tuple, a bare tensor: their
        length is the dataset's; :func:`~lightning_seqmem.trainer.access.batches_need_setter`) and a
        ``set_seq_len`` on the datamodule or train dataset, set the length of the first batch before
        Lightning fetches it: the stage's length, or the next re-measurement's (the planner's state,
        the same on every rank: no collective). From then on each batch end sets the next one's."""
        if self.curriculum is None or self._stopped or self._uses_datamodule_length:
            return  # (once a batch went through the setter, each batch end sets the next one's length)
        length = self.planner.refit_queue[0] if self.planner.refit_queue else self.planner.seq_len  # same on every rank
        if length is not None and edge.length_setter(trainer) is not None and edge.batches_need_setter(trainer):
            self._safely("setting the next batch's length", lambda: edge.set_length_ahead(trainer, length))

    def _set_next_length(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        """One batch ahead: the planner's decision for the next batch (pure; taken again at its
        ``on_train_batch_start``) gives the length the dataset must produce, on every rank."""
        length, error = None, None
        if trainer.is_global_zero:
            try:
                length = self.planner.refit_queue[0] if self.planner.refit_queue else self.planner.seq_len
                if not self._failed and self._shape is not None:
                    applicable = self._applicability(trainer, pl_module, batch, self._shape)
                    length = self.planner.decide(self._shape, applicable).seq_len
            except Exception as exc:  # noqa: BLE001 - said below, after every rank heard
                length, error = None, exc
        length = distributed.broadcast(trainer, length)
        if error is not None:
            raise error
        if length is not None:
            edge.set_length_ahead(trainer, length)

    # -- Before a batch: agree, decide, apply, cut, start measuring ----------------------------------
    def _read_shape(self, batch: Any) -> tuple[int, int]:
        return read_batch_shape(batch, self.seq_len_fn)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._stopped:  # every rank stopped together: hold the curriculum where it is, no collectives
            self._safely("the curriculum", lambda: self._cut(trainer, batch, self.planner.seq_len))
            return
        failed, shape, applicable = self._failed, None, {}
        if not failed:
            try:
                shape = tuple(int(x) for x in self._read_shape(batch))
                applicable = self._applicability(trainer, pl_module, batch, shape)
            except (TypeError, ValueError):
                if self.planner.step == 0 and trainer.world_size == 1:
                    raise  # a configuration problem, found before any step ran: say so
                self._fail("on_train_batch_start", RuntimeError("the batch could not be read"))
                failed = True
            except Exception as exc:  # noqa: BLE001
                self._fail("on_train_batch_start", exc)
                failed = True
        if self._dry is not None and not failed:
            self._safely("the dry run's batch", lambda: self._dry.keep(batch))
        for _ in range(len(rung_names()) + 1):  # again only after a rung failed to apply
            try:
                any_failed, shape, applicable = distributed.agree_inputs(trainer, failed, shape, applicable)
                decision = self._decide(shape, applicable) if trainer.is_global_zero and not any_failed else None
                decision = distributed.broadcast(trainer, decision)
            except Exception as exc:  # noqa: BLE001 - a broken collective: stop on this rank
                self._fail("the agreement across ranks", exc)
                self._stopped = True
                return
            if any_failed or decision is None or shape is None:
                self._fail("another rank" if not failed else "on_train_batch_start",
                           RuntimeError("a rank stopped measuring, so every rank does"))
                self._stopped = True
                self._safely("the curriculum", lambda: self._cut(trainer, batch, self.planner.seq_len))
                return
            if decision.action == "stop":  # every rank: nothing can meet the budget, so no step runs over it
                raise MemoryBudgetError(decision.advice[0].text)
            self.planner.commit(decision)
            if all(self._switch_on(trainer, pl_module, batch, name, shape) for name in decision.rungs):
                break
            applicable = {k: v for k, v in applicable.items() if k in self.planner.mitigations}
        if decision.rungs or decision.action in ("cap", "probe"):  # a lighter setting or a shorter batch
            self._safely("releasing cached memory", lambda: edge.release_cached_memory(pl_module))
        if decision.action != "run" and self.curriculum is not None and trainer.is_global_zero and self.records:
            self._safely("the memory figure", lambda: outputs.log_figure(trainer, self.planner))  # as the stage ends
        try:
            self._cut(trainer, batch, decision.seq_len)
        except (TypeError, ValueError):
            if self.planner.step == 0 and trainer.world_size == 1:
                raise  # a batch format the curriculum cannot cut, found before any step ran: say so
            self._fail("cutting the batch to the curriculum's length", RuntimeError("the batch could not be cut"))
        self._start_measurement(trainer, pl_module, batch, decision, shape)
        self._warn_advice()
        self._step_started = time.perf_counter()  # the step itself from here: the decision and its dry runs are done

    def _decide(self, shape: Optional[tuple[int, int]], applicable: dict) -> Optional[Decision]:
        try:
            return None if shape is None else self.planner.decide(shape, applicable)
        except Exception as exc:  # noqa: BLE001 - sent to every rank as "stop"
            self._fail("the decision before this batch", exc)
            return None

    def _applicability(self, trainer, pl_module, batch: Any, shape: tuple[int, int]) -> dict[str, tuple[bool, str]]:
        """Whether each rung left applies here (only with a budget; cached per setting and batch size)."""
        # every rung not on: those this run may not take are checked too, for the words only (a
        # warning never advises attention already on SDPA, even where the ladder leaves it out)
        left = tuple(m for m in rung_names() if m not in self.planner.applied_mitigations)
        if self.planner.usable_budget_bytes is None or not left:
            return {}
        key = (self.planner.applied_mitigations, left, shape[0])
        if key not in self._applicable_cache:
            self._applicable_cache = {key: ladder.applicability(left, trainer, pl_module, batch)}
            self.planner.not_applicable = {k: why for k, (ok, why) in self._applicable_cache[key].items() if not ok}
        return self._applicable_cache[key]

    def _switch_on(self, trainer, pl_module, batch: Any, name: str, shape: tuple[int, int]) -> bool:
        """Apply rung ``name`` on every rank; if it failed on any, it is off on all and skipped."""
        seq_len = self.planner.seq_len or shape[1]  # where it was decided
        batch_size = self.planner.batch_at(shape[0], shape[1], seq_len) if self.curriculum else shape[0]
        if trainer.is_global_zero:
            self._safely("the dry runs before a rung", lambda: self.planner.before_rung(name, seq_len, batch_size))
        ok, detail = ladder.try_apply(name, trainer, pl_module, batch)
        everywhere = distributed.all_ok(trainer, ok)
        if ok and not everywhere:
            detail = "it failed on another rank"
            self._safely("undoing a rung", lambda: ladder.remove(name, trainer, pl_module))
        self.planner.rung_applied(name, everywhere, detail, seq_len, batch_size)
        if everywhere:
            rank_zero_info(f"seqmem: switched on {name} at step {self.planner.step} ({detail}).")
        return everywhere

    def _cut(self, trainer: pl.Trainer, batch: Any, seq_len: Optional[int]) -> None:
        if self.curriculum is not None and seq_len is not None:
            self._uses_datamodule_length = edge.cut_to_length(trainer, batch, seq_len, self.curriculum.truncate,
                                                          self._uses_datamodule_length)

    @_guarded
    def _start_measurement(self, trainer, pl_module, batch: Any, decision: Decision, shape: tuple[int, int]) -> None:
        self._shape = tuple(int(x) for x in self._read_shape(batch))  # what this rank really runs
        if decision.seq_len is None:
            planned = shape
        else:
            planned = (self.planner.batch_at(shape[0], shape[1], decision.seq_len), decision.seq_len)
        self._pending = self.planner.begin_step(planned[1], planned[0], edge.steps_optimizer(trainer),
                                                trainer.global_step, trainer.current_epoch)
        if ladder.check_pending(self.planner.applied_mitigations, pl_module):
            self._pending.warmup, self._pending.traced = True, False  # a rung's one-time check adds to this peak
        if self._compiled is not None and self._probe is not None and self._probe.name == "cuda":
            self._pending.traced = False  # a traced step runs a dispatch mode, hence eager: keep it compiled
        if self._pending.measure:
            assert self._probe is not None, "setup() was not called"
            self._probe.start_step(existing_tensors(pl_module, trainer.optimizers, batch), record_events=self._pending.traced)
            self._probe.mark_phase("forward")

    @_guarded
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._probe is not None and self._probe.running:
            self._probe.mark_phase("backward")

    @_guarded
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._probe is not None and self._probe.running:
            self._probe.mark_phase("optimizer")

    # -- After a batch: gather, record, log ----------------------------------------------------------
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs_: Any, batch: Any, batch_idx: int) -> None:
        if self._stopped:
            return
        pending, self._pending = self._pending, None
        seconds = self._step_seconds(pending, pl_module)
        memory = self._stop_probe(pending)
        refusal = self._refusal(pl_module)
        try:
            any_failed, any_refused, row = distributed.gather_measurement(trainer, self._failed, memory, self._shape,
                                                                         refusal is not None)
        except Exception as exc:  # noqa: BLE001
            self._fail("the gathering of peaks across ranks", exc)
            self._stopped = True
            return
        if any_failed:
            self._fail("another rank", RuntimeError("a rank stopped measuring, so every rank does"))
            self._stopped = True
            return
        if any_refused:  # e.g. the loss is not a mean: micro-batching is off on every rank, and this step ran whole
            self._undo_refused(trainer, pl_module, refusal, pending)
        self._record(trainer, pending, row, memory, seconds)
        if self._uses_datamodule_length:  # the next batch is fetched before its batch start (every rank: a collective)
            self._safely("setting the next batch's length", lambda: self._set_next_length(trainer, pl_module, batch))
        if self.breakdown and not self._failed and trainer.is_global_zero:
            self._safely("the memory breakdown", lambda: setattr(
                self, "_breakdown_batch", edge.longest_batch(self._breakdown_batch, batch, self._read_shape(batch)[1])))
        self._warn_advice()

    def _refusal(self, pl_module: pl.LightningModule) -> Optional[tuple[str, str]]:
        """``(rung, why)`` where a rung on this rank was refused by its own one-time check, else None."""
        try:
            return ladder.refused(self.planner.applied_mitigations, pl_module)
        except Exception as exc:  # noqa: BLE001
            self._fail("a rung's own check", exc)
            return None

    def _undo_refused(self, trainer: pl.Trainer, pl_module: pl.LightningModule, refusal: Optional[tuple[str, str]],
                      pending: Optional[PendingStep]) -> None:
        """A rung's one-time check refused it on some rank: off on every rank (this step ran without
        it). Only a rung switched on at the step before runs such a check, so a rank that did not
        see the refusal itself takes the last rung switched on that has one."""
        if refusal is None:
            checked = [m for m in self.planner.applied_mitigations if spec(m).first_step_check]
            if not checked:
                return
            refusal = (checked[-1], "another rank refused it")
        name, reason = refusal
        self._safely(f"undoing {name}", lambda: ladder.remove(name, trainer, pl_module))
        self.planner.rung_removed(name, f"its first-step check refused it: {reason}", pending)

    def _step_seconds(self, pending: Optional[PendingStep], pl_module: pl.LightningModule) -> Optional[float]:
        """Wall seconds of the measured step that just ran (forward, backward, optimizer: from the
        end of this callback's batch start to its batch end; on CUDA after a synchronize), or None."""
        started, self._step_started = self._step_started, None
        if started is None or pending is None or not pending.measure:
            return None
        try:
            device = getattr(pl_module, "device", None)
            if device is not None and device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception:  # noqa: BLE001 - an untimed step is priced by the others
            return None
        return time.perf_counter() - started

    @_guarded
    def _stop_probe(self, pending: Optional[PendingStep]) -> Any:
        if pending is None or not pending.measure or self._probe is None or not self._probe.running:
            return None
        return self._probe.end_step()

    @_guarded
    def _record(self, trainer: pl.Trainer, pending: Optional[PendingStep], row: Any, memory: Any,
                seconds: Optional[float] = None) -> None:
        ran = self._shape[1] if self._shape else None  # this rank's batch as it ran
        held = self.curriculum is not None and pending is not None and ran is not None and ran != pending.seq_len
        self.planner.end_batch(at_stage_length=not held)
        if held:
            self.planner.advise(A.curriculum_not_applied(pending.seq_len, ran))
        if pending is None or row is None:
            return
        rank, reduced, seq_len, batch_size = row
        trace = (self._shape[1], self._shape[0], memory) if memory is not None and self._shape else None
        record = self.planner.observe(pending, reduced, seq_len, batch_size, trace=trace,
                                      rank=rank if trainer.world_size > 1 else None, step_seconds=seconds)
        try:
            metrics = self.planner.metrics(record)
        except Exception as exc:  # noqa: BLE001 - a forecast failure must not stop the logging
            self._warn_once(A.output_failed("the forecast for logging", repr(exc)))
            metrics = {}
        outputs.log_metrics(trainer, metrics, step=record.global_step)

    # -- End of fit, reports, failures ---------------------------------------------------------------
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The memory breakdown (``breakdown=True``), the memory figure to TensorBoard, and the
        JSON / Markdown report next to the logs."""
        if not trainer.is_global_zero or not self.records:
            return
        if not self._failed:
            self._safely("the precision advice", lambda: self._advice_at_end(trainer))
        if self.breakdown and not self._failed:
            self._safely("the memory breakdown", lambda: self.run_breakdown(trainer, pl_module))
        self._safely("the memory figure", lambda: outputs.log_figure(trainer, self.planner))
        paths: list[Any] = []
        self._safely("the report", lambda: paths.extend(self.write_report(trainer) or ()))
        if self.summary:
            self._safely("the summary", lambda: print(outputs.fit_summary(self.planner, trainer, paths), flush=True))

    def _advice_at_end(self, trainer: pl.Trainer) -> None:
        """Advice from the forecast as it stands now (:mod:`.advice_now`): bf16 only where a dry run
        says it lowers the peak."""
        from lightning_seqmem.dryrun.advice import precision_advice

        item = precision_advice(self._dry, self.planner, str(trainer.precision), self._device)
        if item is not None:
            self.planner.advise(item)
        self._warn_advice()

    def run_breakdown(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """Trace the memory breakdown now (see :func:`lightning_seqmem.trainer.breakdown.run_breakdown`);
        sets :attr:`breakdowns`, :attr:`breakdown_table`, :attr:`breakdown_report`, warns each
        diagnosis once, logs the tables as TensorBoard text and returns the section."""
        from lightning_seqmem.trainer.breakdown import run_breakdown

        section, self.breakdowns, self.breakdown_table = run_breakdown(
            self.planner, self._breakdown_batch, self._read_shape, self._device, trainer, pl_module)
        self.breakdown_report = section
        self._warn_advice()  # one warning per diagnosis
        outputs.log_breakdown(trainer, section)
        return section

    def write_report(self, trainer: pl.Trainer, directory: Optional[str] = None) -> Any:
        """Write ``seqmem_report.json``, ``seqmem_report.md`` and the figure; return their paths.

        ``directory`` defaults to the logger's ``log_dir`` (``default_root_dir`` without a logger).
        """
        probe = self._probe.name if self._probe is not None else self.probe_name
        note = A.program_note(self._compiled, probe)
        probe = f"{probe}: measurements and forecasts {note}" if note else probe
        return outputs.write_report(self.planner, trainer, directory, device=self._device, probe=probe,
                                    breakdown=self.breakdown_report)

    def _safely(self, what: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reporting must never end a run
            self._warn_once(A.output_failed(what, f"{type(exc).__name__}: {exc}"))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Leave the dispatch mode; for a real out-of-memory error, write a diagnosis. Lightning then
        re-raises the error unchanged."""
        if self._probe is not None:
            self._probe.abort()
        if is_oom(exception) and trainer.global_rank == 0:
            outputs.report_oom(self.planner, trainer, exception, self._pending)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._probe is not None:
            self._probe.abort()

    def _warn_once(self, item: A.Advice) -> None:
        self.planner.advise(item)
        self._warn_advice()

    def _warn_advice(self) -> None:
        for item in self.planner.take_advice():
            rank_zero_warn(item.text, category=item.category)

    def _fail(self, where: str, exc: BaseException) -> None:
        self._failed = True
        if self._probe is not None:
            self._probe.abort()
        self._warn_once(A.failure(where, f"{type(exc).__name__}: {exc}"))

    # -- Checkpointing -------------------------------------------------------------------------------
    def _config(self) -> dict[str, Any]:
        return S.run_config(self.memory_budget_bytes, self.safety_margin, self._mitigations_arg, self.curriculum)

    def state_dict(self) -> dict[str, Any]:
        return {**self.planner.state_dict(), "uses_datamodule_length": self._uses_datamodule_length,
                "config": self._config()}

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        """A checkpoint of an earlier version keyed the state by the configuration: found under that
        key (when it is the only such state), with the configuration it names, for reconciliation."""
        states = checkpoint.get("callbacks")
        if not isinstance(states, dict) or self.state_key in states:
            return
        found = S.find_legacy_state(states)
        if found is not None and isinstance(states[found[0]], dict):
            states[self.state_key] = {"config": found[1], **states[found[0]]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from a checkpoint, checked field by field (:func:`~lightning_seqmem.plan.checkpoint.validate_state`)
        and reconciled with this callback's configuration (:func:`~lightning_seqmem.plan.checkpoint.reconcile`).
        A state this version cannot read or trust gives one warning naming the field and a fresh
        start (measurement resumes from scratch), never a failed resume."""
        allowed = self.planner.mitigations  # the ladder less the rungs this run cannot take (setup)
        try:
            S.validate_state(state_dict)
            self.planner.load_state_dict(state_dict)
            self._resume_phrases, self._resume_removed = S.reconcile(
                self.planner, state_dict.get("config"), self._config(), allowed, state_dict.get("mitigations_left"))
        except Exception as exc:  # noqa: BLE001
            self.planner.reset()
            self.planner.mitigations = allowed
            self._resume_phrases, self._resume_removed = [], ()
            what = str(exc) if isinstance(exc, S.InvalidState) else f"{type(exc).__name__}: {exc}"
            rank_zero_warn(f"seqmem: could not restore the callback state from the checkpoint ({what}); measuring "
                           "and fitting start afresh.", category=SeqMemFailureWarning)
            return
        self._uses_datamodule_length = bool(state_dict.get("uses_datamodule_length", False))
        self._reapply_on_fit_start = bool(self.planner.applied_mitigations)


__all__ = ["SeqMemCallback", "StepRecord"]
