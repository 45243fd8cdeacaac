"""``SeqMemCallback``: the Lightning hook glue around the probes, the forecaster and the curriculum.

The algorithms live elsewhere (:mod:`.probes`, :mod:`.timeline`, :mod:`.model`, :mod:`.forecast`,
:mod:`.curriculum`, :mod:`.batch`); this file only adapts Lightning's hooks to them.
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, Callable, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from .batch import infer_batch_shape, set_batch_sequence_length
from .checks import check_int
from .curriculum import Curriculum
from .mitigations import ladder
from .oom import is_oom, write_oom_diagnosis
from .forecast import Forecast, MemoryForecaster, NotEnoughMeasurements
from .probes import PHASES, PROBE_NAMES, MemoryProbe, StepMemory, existing_tensors, make_probe
from .records import ForecastMismatchWarning, PredictedOOMWarning, SeqMemFailureWarning, StepRecord
from .timeline import Trace
from .units import format_bytes, parse_bytes, to_gib

SeqLenFn = Callable[[Any], "tuple[int, int]"]

# StepMemory fields reduced with max across ranks, followed by the phase peaks and a failure flag
_REDUCED_FIELDS = (
    "peak_bytes", "start_bytes", "end_bytes", "reserved_bytes", "fragmentation_bytes",
    "inactive_split_bytes", "alloc_retries", "num_ooms",
)
_NUM_REDUCED = len(_REDUCED_FIELDS) + 3  # + forward, backward, optimizer


def _guarded(hook: Callable) -> Callable:
    """Run a hook body; an internal failure becomes one warning and the callback stops measuring."""

    @functools.wraps(hook)
    def wrapper(self: "SeqMemCallback", *args: Any, **kwargs: Any) -> Any:
        if self._disabled:
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
    length. Every newly measured length verifies the forecast made for it beforehand. With a
    :class:`~lightning_seqmem.Curriculum`, the sequence length grows stage by stage; each stage is
    forecast before it starts and a stage predicted not to fit the budget is never entered: one
    :class:`PredictedOOMWarning` is issued and the curriculum is capped at the largest length that
    fits.

    Args:
        warmup_steps: batches at the start of training that are measured but not fitted (≥ 1:
            the first step has no optimizer state and the previous step's grads are alive).
        tolerance: accepted relative error of a forecast against the measurement, in (0, 1);
            a larger miss gives one :class:`ForecastMismatchWarning`. The article uses 15%.
        probe: ``"auto"`` (CUDA allocator counters on CUDA, the live-tensor tracker elsewhere),
            ``"cuda"`` or ``"tracker"``.
        memory_budget: bytes (int) or a string with a unit (``"12GiB"``, ``"900MB"``). Default:
            the CUDA device's total memory; none on CPU (forecasts are then informational).
        safety_margin: fraction of the budget kept free, in [0, 1).
        curriculum: a :class:`~lightning_seqmem.Curriculum`; the callback cuts (or, with
            ``truncate=False``, reshapes) each batch to the stage's length. ``None`` measures the
            lengths the data has (fixed, or dynamic padding).
        warmup_steps_after_change: occurrences of a new (sequence length, batch size,
            mitigations) that are measured but not fitted (≥ 0): the first step at a new shape can
            carry kernel autotuning workspace.
        trace_lengths: distinct lengths whose allocation timeline is traced for the replay
            predictor (2–8). On CUDA tracing costs one slow step per length; later steps use only
            the allocator counters.
        measure_every_n_steps: measure one batch in ``n`` once a length has been measured (≥ 1).
            The CPU tracker slows traced steps; on CUDA leave it at 1.
        seq_len_fn: ``batch -> (batch_size, seq_len)``; default reads the first 2-D integer tensor
            (``input_ids`` first in a mapping).
        mitigations: the ladder, tried in this order when the next stage is forecast not to fit:
            ``"attention"`` (eager → SDPA → flash-attn), ``"checkpointing"`` (activation
            checkpointing of the repeated blocks), ``"microbatch"`` (micro-batches of one sample
            inside the step). After each, the memory is re-measured at shorter lengths and the
            forecast redone. ``()`` warns and caps the curriculum instead.
        breakdown: after fit, attribute the memory to modules and kinds (:mod:`.breakdown`): on
            rank zero, one training step is traced at up to 3 measured lengths on a copy of the
            model and of the first optimizer (nothing the run holds is changed), from the longest
            batch seen (kept as a CPU copy during training). Lengths equal to a model width are
            replaced by a near one (L×L detection). The result is :attr:`breakdowns`,
            :attr:`breakdown_table`, :attr:`breakdown_report`, the report's ``breakdown`` section,
            a :class:`~lightning_seqmem.breakdown.MemoryDiagnosisWarning` per diagnosis, and the
            TensorBoard text tagged seqmem/breakdown (tab TEXT; not a scalar). Costs two training
            steps per length, once, at the end.

    Logged scalars (through every logger of the trainer, at each measured batch; GiB = 2³⁰ bytes):

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
    ``seqmem/alloc_retries``            allocator retries after a failed cudaMalloc, cumulative (CUDA)
    ``seqmem/num_ooms``                 allocator OOMs, cumulative (CUDA only)
    ``seqmem/warmup``                   1 for a warm-up batch (measured, not fitted)
    ``seqmem/verification_error``       latest (forecast − measured) / measured at a new length
    ``seqmem/stage``                    curriculum stage index (with a curriculum)
    ``seqmem/mitigations_applied``      number of mitigations switched on so far
    ``seqmem/forecast_next_gib``        forecast upper bound for the next stage (or this length)
    ``seqmem/max_seq_len``              largest length that fits the usable budget (with a budget)
    ``seqmem/budget_gib``               usable budget: budget × (1 − safety_margin)
    ``seqmem/headroom_gib``             usable budget − forecast_next
    ``seqmem/headroom_fraction``        headroom over usable budget
    ==================================  ================================================================

    Example:
        >>> import lightning.pytorch as pl
        >>> from lightning_seqmem.demo import LitGPT, SyntheticTokenDataModule
        >>> cb = SeqMemCallback(curriculum=Curriculum(start=16, target=64, steps_per_stage=3))
        >>> trainer = pl.Trainer(max_steps=9, accelerator="cpu", callbacks=[cb], logger=False,
        ...                      enable_checkpointing=False, enable_progress_bar=False,
        ...                      enable_model_summary=False)
        >>> trainer.fit(LitGPT(n_layer=1, d_model=32), SyntheticTokenDataModule(batch_size=2, seq_len=64))
        >>> [r.seq_len for r in cb.records]
        [16, 16, 16, 32, 32, 32, 64, 64, 64]
        >>> cb.forecast(256).method
        'replay'
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
    ) -> None:
        check_int("warmup_steps", warmup_steps, 1, accepted="an int ≥ 1 (the first step has no optimizer state)")
        check_int("warmup_steps_after_change", warmup_steps_after_change, 0, accepted="an int ≥ 0")
        check_int("trace_lengths", trace_lengths, 2, 8)
        check_int("measure_every_n_steps", measure_every_n_steps, 1, accepted="an int ≥ 1")
        if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real) or not 0 < tolerance < 1:
            raise ValueError(f"`tolerance` must be a float in (0, 1), got {tolerance!r}")
        if isinstance(safety_margin, bool) or not isinstance(safety_margin, numbers.Real) or not 0 <= safety_margin < 1:
            raise ValueError(f"`safety_margin` must be a float in [0, 1), got {safety_margin!r}")
        if probe not in PROBE_NAMES:
            raise ValueError(f"`probe` must be one of {PROBE_NAMES}, got {probe!r}")
        if curriculum is not None and not isinstance(curriculum, Curriculum):
            raise ValueError(f"`curriculum` must be a lightning_seqmem.Curriculum or None, got {type(curriculum).__name__}")
        if seq_len_fn is not None and not callable(seq_len_fn):
            raise ValueError(f"`seq_len_fn` must be a callable batch -> (batch_size, seq_len) or None, got {seq_len_fn!r}")
        if not isinstance(breakdown, bool):
            raise ValueError(f"`breakdown` must be a bool, got {breakdown!r}")
        self.mitigations = ladder.check_mitigations(mitigations)  # the rungs left to this run
        self._mitigations_arg = self.mitigations  # as given (the state key must not change)
        self.memory_budget_bytes = None if memory_budget is None else parse_bytes(memory_budget, "memory_budget")
        self.warmup_steps = warmup_steps
        self.tolerance = float(tolerance)
        self.probe_name = probe
        self.safety_margin = float(safety_margin)
        self.curriculum = curriculum
        self.warmup_steps_after_change = warmup_steps_after_change
        self.trace_lengths = trace_lengths
        self.measure_every_n_steps = measure_every_n_steps
        self.seq_len_fn = seq_len_fn
        self.breakdown = breakdown

        self._probe: Optional[MemoryProbe] = None
        self._device: Optional[torch.device] = None
        self._budget_bytes: Optional[int] = self.memory_budget_bytes
        self._reset_state()

    def _reset_state(self) -> None:
        """Everything a run accumulates (what ``state_dict`` saves), as before the first step."""
        self.records: list[StepRecord] = []
        self.breakdowns: list[Any] = []  # breakdown.Breakdown per traced length, after fit (breakdown=True)
        self.breakdown_table: Optional[Any] = None  # breakdown.BreakdownTable of them
        self.breakdown_report: Optional[dict[str, Any]] = None  # the report's "breakdown" section
        self._breakdown_batch: Optional[tuple[int, Any]] = None  # (seq_len, CPU copy) of the longest batch
        self.applied_mitigations: tuple[str, ...] = ()
        self.mitigation_events: list[dict[str, Any]] = []
        self._forecasters: dict[tuple[str, ...], MemoryForecaster] = {(): MemoryForecaster(tolerance=self.tolerance)}
        self._pending_events: list[str] = []
        self._refit_queue: list[int] = []
        self._decide_now = False
        self._step = 0
        self._key_counts: dict[tuple, int] = {}
        self._pending: dict[tuple[int, int], Forecast] = {}
        self._warned: set[str] = set()
        self._disabled = False
        self._current: Optional[dict[str, Any]] = None
        self._last_batch_size: Optional[int] = None
        self._last_verification_error: Optional[float] = None
        self._cache: dict[str, Any] = {}
        # curriculum state
        self._stages: tuple[int, ...] = self.curriculum.stages if self.curriculum else ()
        self._stage = 0
        self._stage_steps = 0
        self._capped_at: Optional[int] = None
        self._uses_datamodule_length = False
        self._resume_warmup = 0  # steps after a resume that are not fitted (gradients were not saved)
        self._reapply_on_fit_start = False

    # ------------------------------------------------------------------------------------------
    # Public API
    # ------------------------------------------------------------------------------------------
    @property
    def state_key(self) -> str:
        return self._generate_state_key(
            probe=self.probe_name,
            curriculum=None if self.curriculum is None else self.curriculum.stages,
            memory_budget=self.memory_budget_bytes,
            mitigations=self._mitigations_arg,
        )

    @property
    def forecaster(self) -> MemoryForecaster:
        """The forecaster of the mitigations applied now (each setting has its own fit)."""
        return self._forecasters[self.applied_mitigations]

    @property
    def usable_budget_bytes(self) -> Optional[int]:
        """``memory_budget × (1 − safety_margin)``, or None without a budget."""
        if self._budget_bytes is None:
            return None
        return int(self._budget_bytes * (1 - self.safety_margin))

    @property
    def seq_len(self) -> Optional[int]:
        """The curriculum's current length (None without a curriculum)."""
        return self._stages[self._stage] if self._stages else None

    def forecast(self, seq_len: int, batch_size: Optional[int] = None) -> Forecast:
        """Predicted peak of a training step at ``(seq_len, batch_size)``.

        ``batch_size`` defaults to the last measured batch's. Raises
        :class:`~lightning_seqmem.forecast.NotEnoughMeasurements` before two lengths are measured.
        """
        check_int("seq_len", seq_len)
        batch_size = self._default_batch_size(batch_size)
        return self.forecaster.forecast(seq_len, batch_size)

    def max_seq_len(self, budget_bytes: Optional[int | str] = None, batch_size: Optional[int] = None) -> int:
        """Largest sequence length whose forecast upper bound fits ``budget_bytes``.

        ``budget_bytes`` defaults to the usable budget; on CUDA the bound includes the
        fragmentation measured so far (an OOM happens at the reserved level).
        """
        if budget_bytes is None:
            budget = self.usable_budget_bytes
            if budget is None:
                raise ValueError("no memory budget: pass `budget_bytes` or set SeqMemCallback(memory_budget=...)")
        else:
            budget = parse_bytes(budget_bytes, "budget_bytes")
        batch_size = self._default_batch_size(batch_size)
        return self.forecaster.max_seq_len(budget, batch_size, reserved=self._on_cuda)

    # ------------------------------------------------------------------------------------------
    # Hooks
    # ------------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._device = trainer.strategy.root_device
        self._probe = make_probe(self.probe_name, self._device)
        self._check_strategy_and_module(trainer, pl_module)
        if self._budget_bytes is None and self._device.type == "cuda":
            self._budget_bytes = torch.cuda.get_device_properties(self._device).total_memory

    def _check_strategy_and_module(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Drop the rungs this run cannot take, saying why, before training starts."""
        from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

        dropped = []
        if not isinstance(trainer.strategy, (SingleDeviceStrategy, DDPStrategy)):
            dropped = [m for m in self.mitigations if m in ("checkpointing", "microbatch")]
            why = (
                f"{type(trainer.strategy).__name__} shards or wraps the model itself; only single-device "
                "and DDP runs are supported for these (measurement and forecasts still work; for FSDP "
                "use its own activation checkpointing, for DeepSpeed its config)"
            )
        elif not pl_module.automatic_optimization and "microbatch" in self.mitigations:
            dropped, why = ["microbatch"], "manual optimization runs its own backward, which cannot be split"
        if dropped:
            self.mitigations = tuple(m for m in self.mitigations if m not in dropped)
            rank_zero_warn(f"seqmem: mitigations {dropped} are off for this run: {why}.", category=UserWarning)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write the TensorBoard panel layout; after a resume, switch the mitigations on again."""
        if trainer.is_global_zero:
            self._safely("the TensorBoard layout", lambda: panels().write_layout(trainer))
        if not self._reapply_on_fit_start:
            return
        self._reapply_on_fit_start = False
        for name in self.applied_mitigations:
            try:
                result = ladder.apply(name, trainer, pl_module)
                detail = result.detail
            except Exception as exc:  # noqa: BLE001
                detail = f"failed: {type(exc).__name__}: {exc}"
            rank_zero_info(f"seqmem: resumed with {name} on ({detail})")

    @property
    def _on_cuda(self) -> bool:
        return self._device is not None and self._device.type == "cuda"

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        # The curriculum runs even after a measurement failure: every rank must keep cutting
        # batches the same way and entering the same collectives.
        try:
            self._apply_curriculum(trainer, pl_module, batch)
            shape = None if self._disabled else (self.seq_len_fn(batch) if self.seq_len_fn else infer_batch_shape(batch))
        except (TypeError, ValueError):
            if self._step == 0:  # a configuration problem, found before any step ran: say so
                raise
            self._fail("on_train_batch_start", RuntimeError("the batch could not be read or cut"))
            return
        except Exception as exc:  # noqa: BLE001
            self._fail("on_train_batch_start", exc)
            return
        if self.curriculum is None and self.usable_budget_bytes is not None:
            self._guard_batch(trainer, pl_module, batch, shape)
        if shape is not None:
            self._start_measurement(trainer, pl_module, batch, int(shape[0]), int(shape[1]))

    def _guard_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, shape: Optional[tuple[int, int]]) -> None:
        """Without a curriculum (fixed length, dynamic padding): if this batch is forecast over the
        budget, switch on the next rung of the ladder before it runs. Under DDP every rank enters
        the one reduction here whenever a rung is left, so all take the decision at the same step."""
        if not [m for m in self.mitigations if m not in self.applied_mitigations]:
            return
        need, fc = 0, None
        # Until the setting now on has two measured lengths, judge by the last setting that has:
        # a mitigation never adds memory, so that forecast is an upper bound.
        forecaster = next(
            (f for n in range(len(self.applied_mitigations), -1, -1)
             if (f := self._forecasters.get(self.applied_mitigations[:n])) is not None and f.ready),
            None,
        )
        if shape is not None and not self._disabled and forecaster is not None:
            try:
                fc = forecaster.forecast(int(shape[1]), int(shape[0]))
                need = int((fc.reserved_upper_bytes if self._on_cuda else fc.upper_bytes) > self.usable_budget_bytes)
            except Exception as exc:  # noqa: BLE001
                self._fail("the forecast of this batch", exc)
        if trainer.world_size > 1:
            need = int(trainer.strategy.reduce(torch.tensor(need, device=pl_module.device), reduce_op="max").item())
        if not need:
            return
        rung, skipped = ladder.next_rung(self.mitigations, self.applied_mitigations, trainer, pl_module, batch)
        if rung is None:  # nothing applies here: say what would help
            if fc is not None:
                self._safely("the over-budget warning", lambda: self._warn_batch_over_budget(fc))
            return
        seq_len = int(shape[1]) if shape is not None else 0
        self._warn_once(
            f"oom-batch-{seq_len}-{'+'.join(self.applied_mitigations) or 'none'}",
            f"seqmem: this batch (seq_len={seq_len}) is forecast over the usable budget "
            f"{format_bytes(self.usable_budget_bytes)}; switching on the next mitigation, {rung!r}"
            + (f" (skipped: {'; '.join(skipped)})" if skipped else "") + ", before it runs.",
            PredictedOOMWarning,
        )
        self._switch_on(trainer, pl_module, batch, rung, seq_len)

    @_guarded
    def _start_measurement(self, trainer, pl_module, batch, batch_size: int, seq_len: int) -> None:
        key = (seq_len, batch_size, self.applied_mitigations)
        count = self._key_counts.get(key, 0)
        self._key_counts[key] = count + 1
        warmup = (
            self._step < self.warmup_steps
            or trainer.global_step < self.warmup_steps  # with accumulation: until the optimizer has stepped
            or count < self.warmup_steps_after_change
            or self._resume_warmup > 0
        )
        self._resume_warmup = max(0, self._resume_warmup - 1)
        if count == 0:
            self._forecast_new_length(seq_len, batch_size)
        measure = warmup or count == self.warmup_steps_after_change or self._step % self.measure_every_n_steps == 0
        self._current = {
            "step": self._step,
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "seq_len": seq_len,
            "batch_size": batch_size,
            "warmup": warmup,
            "measure": measure,
            "traced": False,
            "events": self._pending_events,
        }
        self._pending_events = []
        if not measure:
            return
        # only steps that end in an optimizer step are traced: with gradient accumulation the others
        # run a different program (no optimizer phase), and never peak higher
        traced = not warmup and _steps_optimizer(trainer) and self.forecaster.wants_trace(seq_len, batch_size, self.trace_lengths)
        self._current["traced"] = traced
        assert self._probe is not None, "setup() was not called"
        self._probe.start_step(existing_tensors(pl_module, trainer.optimizers, batch), record_events=traced)
        self._probe.mark_phase("forward")

    @_guarded
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._probe is not None and self._probe.running:
            self._probe.mark_phase("backward")

    @_guarded
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._probe is not None and self._probe.running:
            self._probe.mark_phase("optimizer")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._step += 1
        self._stage_steps += 1
        current, self._current = self._current, None
        measured = self._stop_probe(current)
        if trainer.world_size > 1:
            measured = self._reduce_across_ranks(trainer, pl_module, measured)
        if measured is not None and current is not None:
            self._record(trainer, current, measured)
        if self.breakdown and not self._disabled and trainer.is_global_zero:
            self._safely("the memory breakdown", lambda: self._keep_batch(batch))

    def _keep_batch(self, batch: Any) -> None:
        """A CPU copy of the longest batch so far (the latest of equals), for the breakdown at the end."""
        from torch.utils._pytree import tree_map

        _, seq_len = self.seq_len_fn(batch) if self.seq_len_fn else infer_batch_shape(batch)
        if self._breakdown_batch is None or seq_len >= self._breakdown_batch[0]:
            copy = tree_map(lambda x: x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x, batch)
            self._breakdown_batch = (int(seq_len), copy)

    @_guarded
    def _stop_probe(self, current: Optional[dict[str, Any]]) -> Optional[StepMemory]:
        if current is None or not current["measure"] or self._probe is None or not self._probe.running:
            return None
        return self._probe.end_step()

    def _reduce_across_ranks(self, trainer: pl.Trainer, pl_module: pl.LightningModule, m: Optional[StepMemory]) -> Optional[StepMemory]:
        """Max of every rank's measurement; called by every rank at every batch end, so no rank
        ever enters the collective alone. A rank that failed sends a flag and all ranks stop."""
        values = [-1] * _NUM_REDUCED
        if m is not None:
            values = [-1 if getattr(m, f) is None else int(getattr(m, f)) for f in _REDUCED_FIELDS]
            values += [m.phase_peak_bytes.get(p, -1) for p in PHASES]
        values.append(int(self._disabled))
        try:
            reduced = trainer.strategy.reduce(
                torch.tensor(values, dtype=torch.int64, device=pl_module.device), reduce_op="max"
            ).tolist()
        except Exception as exc:  # noqa: BLE001
            self._fail("the reduction of peaks across ranks", exc)
            return None
        if reduced[-1] and not self._disabled:
            self._fail("another rank", RuntimeError("a rank stopped measuring, so every rank does"))
        if self._disabled or m is None or reduced[0] < 0:
            return None
        fields = {f: (None if v < 0 else int(v)) for f, v in zip(_REDUCED_FIELDS, reduced)}
        phases = {p: int(v) for p, v in zip(PHASES, reduced[len(_REDUCED_FIELDS) : -1]) if v >= 0}
        return StepMemory(phase_peak_bytes=phases, fragmentation_fraction=m.fragmentation_fraction, events=m.events, **fields)

    @_guarded
    def _record(self, trainer: pl.Trainer, current: dict[str, Any], m: StepMemory) -> None:
        phases = {p: m.phase_peak_bytes.get(p) for p in PHASES}
        record = StepRecord(
            step=current["step"],
            global_step=current["global_step"],
            epoch=current["epoch"],
            seq_len=current["seq_len"],
            batch_size=current["batch_size"],
            warmup=current["warmup"],
            traced=current["traced"],
            peak_bytes=m.peak_bytes,
            forward_peak_bytes=phases["forward"],
            backward_peak_bytes=phases["backward"],
            optimizer_peak_bytes=phases["optimizer"],
            start_bytes=m.start_bytes,
            reserved_bytes=m.reserved_bytes,
            fragmentation_bytes=m.fragmentation_bytes,
            fragmentation_fraction=m.fragmentation_fraction,
            inactive_split_bytes=m.inactive_split_bytes,
            alloc_retries=m.alloc_retries,
            num_ooms=m.num_ooms,
            stage=self._stage if self._stages else None,
            mitigations=self.applied_mitigations,
            events=current.get("events", []),
        )
        L, B = record.seq_len, record.batch_size
        if record.step == 0:
            self._check_budget_against_first_step(m.start_bytes, m.peak_bytes)
        if not record.warmup:
            self._last_batch_size = B
            self.forecaster.add_measurement(L, B, {p: v for p, v in phases.items() if v is not None}, m.reserved_bytes)
            if m.events is not None:
                block = 512 if self._on_cuda else 1
                self.forecaster.add_trace(Trace(L, B, m.events, block_bytes=block, measured_peak_bytes=m.peak_bytes))
            pending = self._pending.pop((L, B), None)
            if pending is not None:
                self._verify(record, pending)
            self._after_mitigation(record)
            self._precision_advice(trainer, B)
        self.records.append(record)
        self._log(trainer, record)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The memory breakdown (``breakdown=True``), the memory figure to TensorBoard, and the
        JSON / Markdown report next to the logs."""
        if not trainer.is_global_zero or not self.records:
            return
        if self.breakdown and not self._disabled:
            self._safely("the memory breakdown", lambda: self.run_breakdown(trainer, pl_module))
        self._safely("the memory figure", lambda: panels().log_figure(trainer, self))
        self._safely("the report", lambda: self.write_report(trainer))

    def run_breakdown(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """Trace the memory breakdown now (called at the end of fit with ``breakdown=True``).

        One warm-up and one traced training step at each of up to 3 lengths (the longest measured
        under the mitigations now on, none equal to a model width), on a copy of ``pl_module`` and
        of the first optimizer, from the longest batch kept during training, with the precision
        plugin's autocast and the micro-batching now on. The RNG state is restored afterwards.
        Sets :attr:`breakdowns`, :attr:`breakdown_table` and :attr:`breakdown_report`, warns each
        diagnosis once, logs the Markdown tables as TensorBoard text (seqmem/breakdown), and
        returns the section.
        """
        from .breakdown_steps import run_breakdown

        return run_breakdown(self, trainer, pl_module)

    def write_report(self, trainer: pl.Trainer, directory: Optional[str] = None) -> Any:
        """Write ``seqmem_report.json``, ``seqmem_report.md`` and the figure; return their paths.

        ``directory`` defaults to the logger's ``log_dir`` (``default_root_dir`` without a logger).
        Called at the end of fit; call it yourself for a report on demand.
        """
        from .report import write_report

        return write_report(self, trainer, directory)

    def _safely(self, what: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reporting must never end a run
            self._warn_once(f"failed-{what}", f"seqmem: could not write {what} ({type(exc).__name__}: {exc})", SeqMemFailureWarning)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Leave the dispatch mode; for an out-of-memory error, write a diagnosis. Lightning then
        re-raises the error unchanged."""
        if self._probe is not None:
            self._probe.abort()
        if not is_oom(exception) or trainer.global_rank != 0:
            return
        try:
            path = write_oom_diagnosis(self, trainer, exception)
            rank_zero_warn(f"seqmem: out of memory; diagnosis written to {path}", category=PredictedOOMWarning)
        except Exception as exc:  # noqa: BLE001 - never mask the real error
            rank_zero_warn(f"seqmem: could not write the OOM diagnosis ({exc!r})", category=SeqMemFailureWarning)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._probe is not None:
            self._probe.abort()

    # ------------------------------------------------------------------------------------------
    # Curriculum
    # ------------------------------------------------------------------------------------------
    def _apply_curriculum(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        if self.curriculum is None:
            return
        last_stage = self._stage + 1 >= len(self._stages)
        if not self._refit_queue and (self._decide_now or self._stage_steps >= self.curriculum.steps_per_stage) and not last_stage:
            self._decide_now = False
            self._advance_stage(trainer, pl_module, batch)
        if self._refit_queue:  # re-measuring after a mitigation, at shorter lengths first
            seq_len = self._refit_queue.pop(0)
            self._decide_now = not self._refit_queue
        else:
            seq_len = self._stages[self._stage]
        if isinstance(batch, tuple) or self._uses_datamodule_length:
            setter = _length_setter(trainer)
            if setter is None:  # let set_batch_sequence_length raise its message about tuples
                set_batch_sequence_length(batch, seq_len, truncate=self.curriculum.truncate)
            self._uses_datamodule_length = True
            setter(seq_len)
            return
        set_batch_sequence_length(batch, seq_len, truncate=self.curriculum.truncate)

    def _advance_stage(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        """Enter the next stage, switch on a mitigation and re-measure, or cap the curriculum."""
        self._stage_steps = 0
        current, nxt = self._stages[self._stage], self._stages[self._stage + 1]
        decision = self._stage_decision(trainer, pl_module, batch, current, nxt)
        if trainer.world_size > 1:  # every rank takes rank zero's decision at the same step
            decision = trainer.strategy.broadcast(decision, src=0)
        action, value = decision
        if trainer.is_global_zero and self.records:  # the figure as it stood at the end of the stage
            self._safely("the memory figure", lambda: panels().log_figure(trainer, self))
        if action == "go":
            self._stage += 1
        elif action == "mitigate":
            self._switch_on(trainer, pl_module, batch, value, current)
        else:  # "cap"
            capped = tuple(self._stages[: self._stage + 1])
            if value > current:
                capped = capped + (value,)
            self._stages, self._capped_at = capped, capped[-1]
            self._stage = len(capped) - 1

    def _stage_decision(self, trainer, pl_module, batch: Any, current: int, nxt: int) -> tuple[str, Any]:
        """("go", nxt), ("mitigate", name) or ("cap", length): what to do instead of growing blindly."""
        budget = self.usable_budget_bytes
        if budget is None or self._disabled:
            return ("go", nxt)
        measured_here = [
            r.peak_bytes for r in self.records if r.seq_len == current and r.mitigations == self.applied_mitigations
        ]
        over_now = bool(measured_here) and max(measured_here) > budget
        fc = bound = None
        fit = 0
        if not over_now:
            if not self.forecaster.ready:
                return ("go", nxt)
            try:
                batch_size = self._stage_batch_size(batch, nxt)
                fc = self.forecaster.forecast(nxt, batch_size)
                bound = fc.reserved_upper_bytes if self._on_cuda else fc.upper_bytes
                if bound <= budget:
                    return ("go", nxt)
                fit = self.forecaster.max_seq_len(budget, batch_size, reserved=self._on_cuda)
            except Exception as exc:  # noqa: BLE001
                self._fail("forecast of the next stage", exc)
                return ("go", nxt)
        if over_now:
            why = f"seq_len={current} already peaked at {format_bytes(max(measured_here))}"
        else:
            why = (
                f"the next curriculum stage, seq_len={nxt}, is predicted to peak at "
                f"{format_bytes(fc.peak_bytes)} (upper bound {format_bytes(bound)}, {fc.method})"
            )
        why += (
            f", over the usable budget {format_bytes(budget)} (budget {format_bytes(self._budget_bytes)} "
            f"minus safety_margin={self.safety_margin})"
        )
        rung, skipped = ladder.next_rung(self.mitigations, self.applied_mitigations, trainer, pl_module, batch)
        skipped_text = f" (skipped: {'; '.join(skipped)})" if skipped else ""
        if rung is not None:
            self._warn_once(
                f"oom-{nxt}-{'+'.join(self.applied_mitigations) or 'none'}",
                f"seqmem: {why}. The largest length that fits now is {fit}. Switching on the next "
                f"mitigation, {rung!r}{skipped_text}, then re-measuring before growing.",
                PredictedOOMWarning,
            )
            return ("mitigate", rung)
        assert self.curriculum is not None
        cap = current if over_now or fit < self.curriculum.multiple_of else self.curriculum.round_down(fit)
        cap = max(min(cap, nxt - 1), current)
        self._warn_once(
            f"oom-{nxt}-{'+'.join(self.applied_mitigations) or 'none'}",
            f"seqmem: {why}. The largest length that fits is {fit}. The curriculum stays at "
            f"seq_len={cap}{skipped_text}. To go further: "
            f"{ladder.remaining_advice(self.mitigations, self.applied_mitigations)}.",
            PredictedOOMWarning,
        )
        return ("cap", cap)

    def _switch_on(self, trainer, pl_module, batch: Any, name: str, seq_len: int) -> None:
        """Apply one rung, start a fresh forecaster for the new settings and queue the re-fit."""
        before = max((r.peak_bytes for r in self.records if r.seq_len == seq_len and r.mitigations == self.applied_mitigations), default=None)
        try:
            result = ladder.apply(name, trainer, pl_module, batch)
        except Exception as exc:  # noqa: BLE001 - a failed mitigation must not kill the run
            result = None
            detail = f"{type(exc).__name__}: {exc}"
        else:
            detail = result.detail
        if result is None or not result.applied:
            self._warn_once(f"mitigation-failed-{name}", f"seqmem: could not switch on {name!r} ({detail}); skipping it.", SeqMemFailureWarning)
            self.mitigations = tuple(m for m in self.mitigations if m != name)
            self._decide_now = True
            return
        self.applied_mitigations = self.applied_mitigations + (name,)
        self._forecasters.setdefault(self.applied_mitigations, MemoryForecaster(tolerance=self.tolerance))
        self.mitigation_events.append(
            {"name": name, "step": self._step, "seq_len": seq_len, "detail": detail, "before_bytes": before, "after_bytes": None}
        )
        self._pending_events.append(f"mitigation:{name}")
        if self.curriculum is None:  # the data sets the lengths: the next batches measure the new setting
            rank_zero_info(f"seqmem: switched on {name} at step {self._step} ({detail}).")
            return
        steps = max(1, self.warmup_steps_after_change) + 1  # warm-up, then one measured step per length
        multiple_of = self.curriculum.multiple_of
        lengths = sorted({self.curriculum.round_down(max(seq_len // d, multiple_of)) for d in (4, 2, 1)})
        self._refit_queue = [L for L in lengths for _ in range(steps)]
        rank_zero_info(
            f"seqmem: switched on {name} at step {self._step} ({detail}); re-measuring at seq_len "
            f"{lengths} before growing past {seq_len}."
        )

    def _stage_batch_size(self, batch: Any, seq_len: int) -> int:
        batch_size, source_len = self.seq_len_fn(batch) if self.seq_len_fn else infer_batch_shape(batch)
        if self.curriculum is not None and not self.curriculum.truncate:
            return max(1, batch_size * source_len // seq_len)
        return batch_size

    # ------------------------------------------------------------------------------------------
    # Forecast bookkeeping
    # ------------------------------------------------------------------------------------------
    def _forecast_new_length(self, seq_len: int, batch_size: int) -> None:
        """Before a new (L, B) runs: keep the forecast for verification; warn if over budget."""
        if not self.forecaster.ready:
            return
        fc = self.forecaster.forecast(seq_len, batch_size)
        self._pending[(seq_len, batch_size)] = fc
        budget = self.usable_budget_bytes
        bound = fc.reserved_upper_bytes if self._on_cuda else fc.upper_bytes
        left = [m for m in self.mitigations if m not in self.applied_mitigations]
        if self.curriculum is None and budget is not None and bound > budget and not left:
            self._warn_batch_over_budget(fc)

    def _warn_batch_over_budget(self, fc: Forecast) -> None:
        """No rung left to switch on for a batch forecast over the budget: say what would help."""
        budget = self.usable_budget_bytes
        assert budget is not None
        bound = fc.reserved_upper_bytes if self._on_cuda else fc.upper_bytes
        fit = self.forecaster.max_seq_len(budget, fc.batch_size, reserved=self._on_cuda)
        self._warn_once(
            f"oom-batch-{fc.seq_len}-{fc.batch_size}",
            f"seqmem: this batch (seq_len={fc.seq_len}, batch {fc.batch_size}) is predicted to peak at "
            f"{format_bytes(fc.peak_bytes)} (upper bound {format_bytes(bound)}, {fc.method}), over the "
            f"usable budget {format_bytes(budget)}; the largest length that fits is {fit}. Cap the padded "
            f"length of your collate function, lower the batch size, or "
            f"{ladder.remaining_advice(self.mitigations, self.applied_mitigations)}.",
            PredictedOOMWarning,
        )

    def _verify(self, record: StepRecord, forecast: Forecast) -> None:
        v = self.forecaster.verify(forecast, record.peak_bytes)
        record.forecast_peak_bytes = forecast.peak_bytes
        record.forecast_upper_bytes = forecast.upper_bytes
        record.forecast_method = forecast.method
        record.forecast_error = v.relative_error
        self._last_verification_error = v.relative_error
        if abs(v.relative_error) > self.tolerance:
            if v.relative_error < 0:
                why = (
                    "Likely causes: dynamic padding or sequence packing (the batch's real length "
                    "differs from its shape), a kernel whose choice depends on the length, or memory "
                    "held outside the step. Later forecasts widen their bounds by this miss, and this "
                    "length is traced again."
                )
            else:  # over-predicted: safe, but say why it is off
                why = (
                    "An over-prediction is safe. "
                    + ("A quadratic fit of so few lengths puts all growth in the L² term; it tightens as "
                       "more lengths are measured." if forecast.method == "quadratic" else
                       "The traced program may differ at this length (a kernel choice that depends on "
                       "the length); this length is traced again.")
                )
            self._warn_once(
                f"mismatch-{record.seq_len}-{record.batch_size}",
                f"seqmem: the {forecast.method} forecast for seq_len={record.seq_len} (batch "
                f"{record.batch_size}) was {format_bytes(forecast.peak_bytes)}, measured "
                f"{format_bytes(record.peak_bytes)} ({v.relative_error:+.1%}, tolerance "
                f"{self.tolerance:.0%}). {why}",
                ForecastMismatchWarning,
            )

    def _after_mitigation(self, record: StepRecord) -> None:
        """Fill the measured effect of the last mitigation; warn if attention stayed quadratic."""
        if not self.mitigation_events:
            return
        event = self.mitigation_events[-1]
        if event["after_bytes"] is None and record.seq_len == event["seq_len"] and record.mitigations == self.applied_mitigations:
            event["after_bytes"] = record.peak_bytes
            before = event["before_bytes"]
            change = "" if not before else f" ({record.peak_bytes / before - 1:+.0%})"
            rank_zero_info(
                f"seqmem: with {event['name']} on, seq_len={record.seq_len} peaks at "
                f"{format_bytes(record.peak_bytes)}, was {format_bytes(before)}{change}"
            )
        if event["name"] != "attention" or event.get("checked") or not self.forecaster.ready:
            return
        terms = _quadratic_terms(self._forecasters.get(self.applied_mitigations[:-1]), self.forecaster)
        if terms is None:
            return
        old_b, new_b = terms
        event["checked"] = True
        if new_b > 0.5 * old_b:
            self._warn_once(
                "attention-still-quadratic",
                f"seqmem: after switching attention ({event['detail']}), memory still grows "
                f"quadratically with the length ({new_b:.0f} B/token², was {old_b:.0f}): "
                "the kernel likely fell back to a path that materialises the scores — an explicit "
                "attention mask, attention dropout, or a dtype the fused kernel does not support.",
                PredictedOOMWarning,
            )

    def _precision_advice(self, trainer: pl.Trainer, batch_size: int) -> None:
        """In 32-bit, if the L² term dominates at the target length, recommend bf16-mixed once."""
        if "precision" in self._warned or not str(trainer.precision).startswith("32"):
            return
        model = self.forecaster.quadratic
        if model is None:
            return
        target = self.curriculum.target if self.curriculum else max((r.seq_len for r in self.records), default=1)
        fc = model.predict(target, batch_size)
        quadratic = max(batch_size * c.quadratic_bytes_per_token2 * target**2 for c in model.coefficients.values())
        if quadratic > 0.5 * fc.peak_bytes:
            self._warn_once(
                "precision",
                f"seqmem: this run is in 32-bit precision and at the target length {target} the "
                f"attention scores are forecast to be {quadratic / fc.peak_bytes:.0%} of the "
                f"{format_bytes(fc.peak_bytes)} peak. Precision cannot change mid-run: restart with "
                f"Trainer(precision='bf16-mixed') to roughly halve activations (about "
                f"{format_bytes(quadratic / 2)} saved on the scores alone).",
                UserWarning,
            )

    def _check_budget_against_first_step(self, start_bytes: int, peak_bytes: int) -> None:
        budget = self.usable_budget_bytes
        if budget is not None and peak_bytes > budget:
            self._warn_once(
                "budget-first-step",
                f"seqmem: the first step already used {format_bytes(peak_bytes)} at its peak "
                f"({format_bytes(start_bytes)} before it began), more than the usable budget "
                f"{format_bytes(budget)}. Raise `memory_budget` (now {format_bytes(self._budget_bytes)}), "
                f"lower `safety_margin` (now {self.safety_margin}), or start the curriculum shorter.",
                PredictedOOMWarning,
            )

    def _default_batch_size(self, batch_size: Optional[int]) -> int:
        if batch_size is None:
            if self._last_batch_size is None:
                raise NotEnoughMeasurements("no batch measured yet: pass `batch_size`")
            return self._last_batch_size
        check_int("batch_size", batch_size)
        return batch_size

    # ------------------------------------------------------------------------------------------
    # Logging, warnings, failures
    # ------------------------------------------------------------------------------------------
    def _budget_view(self, batch_size: int) -> dict[str, float]:
        """Forecast for the next stage, largest length that fits, headroom (cached per fit)."""
        key = (self.applied_mitigations, self.forecaster.version, self._stage, batch_size)
        if self._cache.get("key") == key:
            return self._cache["value"]
        out: dict[str, float] = {}
        if self.forecaster.ready:
            target = self._stages[self._stage + 1] if self._stage + 1 < len(self._stages) else None
            target = target or (self.records[-1].seq_len if self.records else None)
            if target:
                fc = self.forecaster.forecast(target, batch_size)
                bound = fc.reserved_upper_bytes if self._on_cuda else fc.upper_bytes
                out["forecast_next_gib"] = to_gib(bound)
                budget = self.usable_budget_bytes
                if budget is not None:
                    out["budget_gib"] = to_gib(budget)
                    out["max_seq_len"] = float(self.forecaster.max_seq_len(budget, batch_size, reserved=self._on_cuda))
                    out["headroom_gib"] = to_gib(budget - bound)
                    out["headroom_fraction"] = (budget - bound) / budget
        self._cache = {"key": key, "value": out}
        return out

    def _log(self, trainer: pl.Trainer, record: StepRecord) -> None:
        if not trainer.loggers:
            return
        metrics: dict[str, float] = {
            "seq_len": record.seq_len,
            "batch_size": record.batch_size,
            "warmup": float(record.warmup),
            "peak_allocated_gib": to_gib(record.peak_bytes),
        }
        for phase in PHASES:
            value = getattr(record, f"{phase}_peak_bytes")
            if value is not None:
                metrics[f"peak_{phase}_gib"] = to_gib(value)
        if record.reserved_bytes is not None:
            metrics["reserved_gib"] = to_gib(record.reserved_bytes)
            metrics["fragmentation_gib"] = to_gib(record.fragmentation_bytes or 0)
            metrics["fragmentation_fraction"] = record.fragmentation_fraction or 0.0
            metrics["inactive_split_gib"] = to_gib(record.inactive_split_bytes or 0)
            metrics["alloc_retries"] = record.alloc_retries or 0
            metrics["num_ooms"] = record.num_ooms or 0
        if self._last_verification_error is not None:
            metrics["verification_error"] = self._last_verification_error
        if record.stage is not None:
            metrics["stage"] = record.stage
        metrics["mitigations_applied"] = len(record.mitigations)
        try:
            metrics.update(self._budget_view(record.batch_size))
        except Exception as exc:  # noqa: BLE001 - a forecast failure must not stop the logging
            self._warn_once("budget-view", f"seqmem: forecast for logging failed ({exc!r}); skipping it.", SeqMemFailureWarning)
        metrics = {f"seqmem/{k}": float(v) for k, v in metrics.items()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=record.global_step)

    def _warn_once(self, key: str, message: str, category: type[Warning]) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        rank_zero_warn(message, category=category)

    def _fail(self, where: str, exc: BaseException) -> None:
        self._disabled = True
        if self._probe is not None:
            self._probe.abort()
        self._warn_once(
            "failure",
            f"seqmem: internal failure in {where} ({type(exc).__name__}: {exc}); the callback stops "
            "measuring and predicting for the rest of this run. Training goes on unaffected.",
            SeqMemFailureWarning,
        )

    # ------------------------------------------------------------------------------------------
    # Checkpointing
    # ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self._step,
            "records": [r.to_dict() for r in self.records],
            "forecasters": {"|".join(k): f.state_dict() for k, f in self._forecasters.items()},
            "key_counts": [[k[0], k[1], list(k[2]), v] for k, v in self._key_counts.items()],
            "warned": sorted(self._warned),
            "applied_mitigations": list(self.applied_mitigations),
            "mitigation_events": [dict(e) for e in self.mitigation_events],
            "refit_queue": list(self._refit_queue),
            "decide_now": self._decide_now,
            "stages": list(self._stages),
            "stage": self._stage,
            "stage_steps": self._stage_steps,
            "capped_at": self._capped_at,
            "last_batch_size": self._last_batch_size,
            "last_verification_error": self._last_verification_error,
            "pending": {f"{k[0]}x{k[1]}": vars(v) for k, v in self._pending.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from a checkpoint; a state this version cannot read gives one warning and a fresh
        start (measurement resumes from scratch), never a failed resume."""
        try:
            self._load_state(state_dict)
        except Exception as exc:  # noqa: BLE001
            self._reset_state()
            rank_zero_warn(
                f"seqmem: could not restore the callback state from the checkpoint ({type(exc).__name__}: "
                f"{exc}); measuring and fitting start afresh.",
                category=SeqMemFailureWarning,
            )

    def _load_state(self, state_dict: dict[str, Any]) -> None:
        self._step = int(state_dict.get("step", 0))
        self.records = [StepRecord.from_dict(r) for r in state_dict.get("records", [])]
        self._forecasters = {}
        for key, state in state_dict.get("forecasters", {"": state_dict.get("forecaster", {})}).items():
            forecaster = MemoryForecaster(tolerance=self.tolerance)
            forecaster.load_state_dict(state)
            self._forecasters[tuple(key.split("|")) if key else ()] = forecaster
        self._key_counts = {(k0, k1, tuple(k2)): v for k0, k1, k2, v in state_dict.get("key_counts", [])}
        self._warned = set(state_dict.get("warned", []))
        self.applied_mitigations = tuple(state_dict.get("applied_mitigations", ()))
        self._forecasters.setdefault(self.applied_mitigations, MemoryForecaster(tolerance=self.tolerance))
        self.mitigation_events = [dict(e) for e in state_dict.get("mitigation_events", [])]
        self._refit_queue = list(state_dict.get("refit_queue", []))
        self._decide_now = bool(state_dict.get("decide_now", False))
        self._reapply_on_fit_start = bool(self.applied_mitigations)
        self._stages = tuple(state_dict.get("stages", self._stages))
        self._stage = int(state_dict.get("stage", 0))
        self._stage_steps = int(state_dict.get("stage_steps", 0))
        self._capped_at = state_dict.get("capped_at")
        self._last_batch_size = state_dict.get("last_batch_size")
        self._last_verification_error = state_dict.get("last_verification_error")
        self._resume_warmup = max(1, self.warmup_steps_after_change)
        self._pending = {}
        for key, fc in state_dict.get("pending", {}).items():
            L, B = (int(x) for x in key.split("x"))
            self._pending[(L, B)] = Forecast(**fc)


def _steps_optimizer(trainer: pl.Trainer) -> bool:
    """Whether the batch about to run ends with an optimizer step (not a gradient accumulation)."""
    if trainer.accumulate_grad_batches == 1:
        return True
    try:
        return not trainer.fit_loop.epoch_loop._should_accumulate()
    except Exception:  # noqa: BLE001 - Lightning internals moved: assume it steps
        return True


def panels() -> Any:
    """The panels module, imported on first use (it is the only one importing tensorboard/matplotlib)."""
    from . import panels as module

    return module


def _quadratic_terms(old: Optional[MemoryForecaster], new: MemoryForecaster) -> Optional[tuple[float, float]]:
    """Bytes per token² (per sample) before and after a change, measured the same way, or None.

    From the timeline replay when both settings have one (the L² coefficients of every allocation,
    exact from two traced lengths); else from quadratic fits of three or more lengths (a two-point
    fit is C + b·L² by construction and says nothing about the shape).
    """
    if old is None:
        return None
    if old.timeline is not None and new.timeline is not None:
        return tuple(float(f.timeline.coefficients[2].clip(min=0).sum()) for f in (old, new))  # type: ignore[return-value]
    fits = [f.quadratic for f in (old, new)]
    if any(q is None for q in fits) or any(len({L for L, _ in f.points}) < 3 for f in (old, new)):
        return None
    return tuple(max(c.quadratic_bytes_per_token2 for c in q.coefficients.values()) for q in fits)  # type: ignore[union-attr,return-value]


def _length_setter(trainer: pl.Trainer) -> Optional[Callable[[int], None]]:
    """A datamodule's or train dataset's ``set_seq_len`` method, if it has one."""
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None and callable(getattr(datamodule, "set_seq_len", None)):
        return datamodule.set_seq_len
    loader = getattr(trainer, "train_dataloader", None)
    dataset = getattr(loader, "dataset", None)
    if dataset is not None and callable(getattr(dataset, "set_seq_len", None)):
        return dataset.set_seq_len
    return None


__all__ = ["SeqMemCallback"]
