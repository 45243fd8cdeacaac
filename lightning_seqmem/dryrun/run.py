"""The dry run of a training run's own step, wired to its trainer (what the callback hands the
planner): :func:`.step.dry_run_step` for a module on one device (or under DDP),
:func:`.sharded.sharded_dry_run_step` for an FSDP2 module; apart, so neither imports the other."""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

from torch import nn

from lightning_seqmem.core.rungs import RungNotApplicable, at_most
from lightning_seqmem.core.units import format_bytes
from lightning_seqmem.dryrun import sharded
from lightning_seqmem.dryrun.result import DryRunUnsupported, reason_of
from lightning_seqmem.dryrun.step import dry_run_step, held_state
from lightning_seqmem.dryrun.step_functions import loop_of, trainer_loop
from lightning_seqmem.dryrun.values import ValueRoom, value_room
from lightning_seqmem.measure.batch_shape import shapes_read_by
from lightning_seqmem.measure.batch_tree import map_tensors
from lightning_seqmem.mitigations import ladder


class TrainingRunDryRun:
    """The dry run of a training run's own step, as the planner asks it: ``(seq_len, batch_size,
    mitigations) -> (peak_bytes, phase_peak_bytes, peak_site)`` (``peak_site``: a
    :class:`~lightning_seqmem.core.peak.PeakSite` when ``site`` is given, else None).

    Holds the module, its first optimizer, the precision plugin's context and a CPU copy of the
    first batch (:meth:`keep`), its shape read by ``seq_len_fn`` where the callback has one
    (:func:`~lightning_seqmem.measure.batch_shape.shapes_read_by`). ``applied()``: the rungs on
    the real module now; the copy starts from them and adds the others (a copy cannot undo a rung,
    so a set without one raises).

    A refusal (any failure) is kept with its ``(seq_len, batch_size, mitigations)``: a later call
    at a shape at least as large with the same mitigations raises it at once; smaller shapes keep
    their dry runs. Each reason (up to its numbers) goes to ``on_unsupported(reason, seq_len,
    batch_size)`` once.
    """

    def __init__(self, trainer: Any, pl_module: nn.Module, applied: Callable[[], tuple[str, ...]],
                 on_unsupported: Callable[[str], None], template: Optional[nn.Module] = None,
                 site: Optional[Callable[..., Any]] = None,
                 room: Optional[Callable[[], Optional[int]]] = None,
                 resident: Optional[Callable[..., int]] = None,
                 seq_len_fn: Optional[Callable[[Any], Any]] = None) -> None:
        self.trainer, self.pl_module, self.applied, self.on_unsupported = (
            trainer, pl_module, applied, on_unsupported)
        self.site = site  # dry_run_step's site tracer (peak_trace.trace_peak_site)
        self.template = template  # unsharded copy taken before configure_model() (FSDP2 runs)
        # bytes the dry run's real values may take now (None: any; on a CPU run, what the usable
        # budget leaves beside the run's tensors: :func:`.values.value_room`)
        self.room = room
        # bytes held on the training device beside the step (the caller's copies, what earlier
        # steps left alive): in every answer; called with evaluate=True for a validation batch
        self.resident = resident
        self.seq_len_fn = seq_len_fn  # the callback's: how each batch's shape is read
        self.batch: Any = None
        self.unsupported: Optional[str] = None  # the first refusal's reason (any shape)
        # (seq_len, batch_size, mitigations, reason)
        self.refusals: list[tuple[int, int, tuple[str, ...], str]] = []
        self._said: set[str] = set()

    def keep(self, batch: Any) -> None:
        """Keep a CPU copy of ``batch`` (the first one only): each dry run reshapes it."""
        if self.batch is None:
            # every container rebuilt (a BatchEncoding too): the step's in-place cut leaves it
            self.batch = map_tensors(batch, lambda x, *_: x.detach().to("cpu", copy=True), False)

    def __call__(self, seq_len: int, batch_size: int,
                 mitigations: tuple[str, ...]) -> tuple[Any, ...]:
        applied = tuple(self.applied())
        if self.batch is None or not all(any(at_most(m, n) for n in mitigations) for m in applied):
            raise DryRunUnsupported("no batch kept yet, or a rung on now cannot be undone "
                                    "on a copy")
        for name in mitigations:  # a setting this model cannot take is never dry-run as another
            if name in applied:
                continue
            why = ladder.copy_refusal(name, self.trainer, self.pl_module, batch_size)
            if why is not None:
                raise RungNotApplicable(name, why)
        for L, B, names, reason in self.refusals:
            if names == tuple(mitigations) and seq_len >= L and batch_size >= B:
                err = DryRunUnsupported(f"{reason} (refused at seq_len={L}, batch {B}; so at this "
                                        "larger shape too)")
                err.fails_at_length = fails_at_length(err)  # type: ignore[attr-defined]
                raise err
        limit = self.room() if self.room is not None else None
        with (value_room(limit) as room, trainer_loop(loop_of(self.trainer)),
              shapes_read_by(self.seq_len_fn)):
            try:
                peak, phases, site = self._step(seq_len, batch_size, mitigations, applied)
            except Exception as exc:  # noqa: BLE001 - said once per reason; others answer
                self._refused(exc, seq_len, batch_size, mitigations, room)
                raise
        resident = int(self.resident()) if self.resident is not None else 0
        return peak + resident, {p: v + resident for p, v in phases.items()}, site

    def _step(self, seq_len: int, batch_size: int, mitigations: tuple[str, ...],
              applied: tuple[str, ...]) -> tuple[int, dict[str, int], Any]:
        """``(peak, phase peaks, peak site)`` of the fake step: the sharded dry run for an FSDP2
        module, else the one-rank one."""
        optimizers = getattr(self.trainer, "optimizers", None) or [None]
        refusal = sharded.dry_run_refusal(self.trainer)
        if refusal is not None:
            raise DryRunUnsupported(refusal)
        if sharded.is_fsdp2(self.pl_module):  # not copied: a copy of the template sharded
            if self.template is None:
                raise DryRunUnsupported("the module was sharded with fully_shard before "
                                        "SeqMemCallback.setup could keep an unsharded template")
            # a rung switched on by this dry run, or on with its one-time check still to run
            check = ladder.check_pending(applied, self.pl_module) or any(
                ladder.rung(m).spec.first_step_check for m in mitigations if m not in applied)
            ranks = sharded.data_parallel_size(self.trainer, self.pl_module)
            result = sharded.sharded_dry_run_step(
                self.template, self.batch, seq_len, ranks, batch_size, mitigations,
                autocast=self.trainer.precision_plugin.train_step_context,
                device=self.trainer.strategy.root_device, first_split_check=check)
            return result.peak_bytes, dict(result.phase_peak_bytes), None
        result = dry_run_step(self.pl_module, optimizers[0], self.batch, seq_len, batch_size,
                              tuple(m for m in mitigations if m not in applied),
                              autocast=self.trainer.precision_plugin.train_step_context,
                              device=self.trainer.strategy.root_device, site=self.site)
        return result.peak_bytes, dict(result.phase_peak_bytes), result.peak_site

    def validation_peak(self, batch: Any, seq_len: int, mitigations: tuple[str, ...] = (),
                        batch_size: Optional[int] = None) -> int:
        """Peak bytes of ``validation_step`` on ``batch`` cut or tiled to ``(batch_size, seq_len)``
        (``batch_size`` None: its own), the rungs on now and ``mitigations`` added, as a fit's
        validation loop runs it (:func:`.step.dry_run_step`, ``evaluate=True``; FSDP2: the sharded
        one of the template, ``held``)."""
        refusal = sharded.dry_run_refusal(self.trainer)
        if refusal is not None:
            raise DryRunUnsupported(refusal)
        optimizer = (getattr(self.trainer, "optimizers", None) or [None])[0]
        context = self.trainer.precision_plugin.val_step_context
        device = self.trainer.strategy.root_device
        with (value_room(self.room() if self.room is not None else None),
              shapes_read_by(self.seq_len_fn)):
            if sharded.is_fsdp2(self.pl_module):  # the template takes every rung on
                if self.template is None:
                    raise DryRunUnsupported("no unsharded template of the FSDP2 module was kept")
                result = sharded.sharded_dry_run_step(
                    self.template, batch, seq_len, sharded.data_parallel_size(
                        self.trainer, self.pl_module), batch_size, mitigations, autocast=context,
                    device=device, held=held_state(self.pl_module, optimizer))
            else:
                result = dry_run_step(self.pl_module, optimizer, batch, seq_len, batch_size,
                                      tuple(m for m in mitigations if m not in self.applied()),
                                      autocast=context, device=device, evaluate=True)
        return result.peak_bytes + (int(self.resident(evaluate=True))
                                    if self.resident is not None else 0)

    def _refused(self, exc: BaseException, seq_len: int, batch_size: int,
                 mitigations: tuple[str, ...], room: Optional[ValueRoom]) -> None:
        """Keep the refusal for this shape (and every larger one), and say its reason once."""
        reason = reason_of(exc)
        if room is not None and room.withheld_bytes:
            withheld, room_bytes = format_bytes(room.withheld_bytes), format_bytes(room.limit_bytes)
            reason += (f"; its real values (a {withheld} tensor computed from the batch) did not "
                       f"fit the {room_bytes} the usable budget leaves beside the run's tensors, "
                       "on a device whose memory is the host's")
            if isinstance(exc, DryRunUnsupported):
                exc.reason = reason
        if fails_at_length(exc):
            exc.fails_at_length = True  # type: ignore[attr-defined]
        self.unsupported = self.unsupported or reason
        self.refusals.append((int(seq_len), int(batch_size), tuple(mitigations), reason))
        gist = re.sub(r"\d+", "#", reason)
        if gist not in self._said:
            self._said.add(gist)
            self.on_unsupported(reason, int(seq_len), int(batch_size))


def fails_at_length(exc: BaseException) -> bool:
    """Whether a dry run's failure is the model's own at that shape, which its real step would
    raise too: an index past a tensor's end (e.g. a positional table shorter than the length), or
    tensors whose sizes do not match.

    Example:
        >>> failed = "the fake step failed: IndexError: index 8192 is out of bounds for dimension 1"
        >>> fails_at_length(DryRunUnsupported(failed))
        True
        >>> fails_at_length(DryRunUnsupported("an op reads tensor values (aten.item)"))
        False
    """
    reason = getattr(exc, "reason", None) or str(exc)
    model_errors = r"(IndexError|RuntimeError: The size of tensor a \(\d+\) must match)"
    return bool(re.match(r"the fake step failed: " + model_errors, reason))
