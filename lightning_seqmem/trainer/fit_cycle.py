"""The fit lifecycle: what the callback does once per fit, in one object.

* set-up (:meth:`FitCycle.setup`): the probe, the budget and the device's facts bound to the
  planner; the rungs this strategy and module cannot take dropped (said once);
* fit start (:meth:`FitCycle.fit_start`): a budget below the parameters refused, a compiled module
  measured without preventing compilation, the model's length limit, the TensorBoard layout, the
  dry run (rank zero), and after a resume the checkpoint's rungs switched on again;
* continuing: a second ``fit`` (:meth:`~FitCycle.next_fit`), a checkpoint's state restored and
  reconciled (:meth:`~FitCycle.load_state`), an earlier version's state found under its key
  (:func:`adopt_legacy_state`);
* the end of fit (:meth:`~FitCycle.train_end`), each output guarded on its own.

It writes the per-fit fields of the edge state (:mod:`.run_state`).

Example:
    >>> old_key = ("SeqMemCallback{'probe': 'auto', 'curriculum': None, 'memory_budget': 100, "
    ...            "'mitigations': ()}")
    >>> checkpoint = {"callbacks": {old_key: {"step": 3}}}
    >>> adopt_legacy_state(checkpoint, "SeqMemCallback")  # found, with its config
    >>> state = checkpoint["callbacks"]["SeqMemCallback"]
    >>> state["step"], state["config"]["memory_budget_bytes"]
    (3, 100)
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_seqmem.core import advice as A
from lightning_seqmem.core.config import SeqMemConfig
from lightning_seqmem.core.records import MemoryBudgetError, SeqMemFailureWarning
from lightning_seqmem.core.rungs import rung_specs
from lightning_seqmem.measure.batch_shape import read_batch_shape
from lightning_seqmem.measure.probes import make_probe
from lightning_seqmem.mitigations import ladder
from lightning_seqmem.plan import checkpoint as S
from lightning_seqmem.plan.protocol import Planner
from lightning_seqmem.trainer import access as edge
from lightning_seqmem.trainer import outputs
from lightning_seqmem.trainer.guard import Guard
from lightning_seqmem.trainer.run_state import EdgeState
from lightning_seqmem.plan.view import PlanView

__all__ = ["COMPILED_MEASURE_EVERY_N_STEPS", "FitCycle", "adopt_legacy_state"]

COMPILED_MEASURE_EVERY_N_STEPS = 10
"""With a ``torch.compile``'d module and the tracker, at most one step in this many (besides
warm-ups and the first steps at a new shape) is measured: a measured step runs eager."""


def adopt_legacy_state(checkpoint: dict[str, Any], state_key: str) -> None:
    """Adopt the state of a checkpoint that keyed it by the configuration (when it is the only
    such state), with the configuration it names, for reconciliation."""
    states = checkpoint.get("callbacks")
    if not isinstance(states, dict) or state_key in states:
        return
    found = S.find_legacy_state(states)
    if found is not None and isinstance(states[found[0]], dict):
        states[state_key] = {"config": found[1], **states[found[0]]}


class FitCycle:
    """Once-per-fit work (module doc) over the callback's arguments, planner, edge state, guard."""

    def __init__(self, config: SeqMemConfig, planner: Planner, state: EdgeState,
                 guard: Guard) -> None:
        self.config, self.planner, self.edge, self.guard = config, planner, state, guard

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``setup("fit")``: the probe, the device's facts, the rungs this run cannot take."""
        self.edge.fit_refs = (weakref.ref(trainer), weakref.ref(pl_module))
        device = self.edge.device = trainer.strategy.root_device
        self.edge.probe = make_probe(self.config.probe, device)
        on_cuda = device.type == "cuda"
        if self.config.memory_budget_bytes is None and on_cuda:
            self.planner.bind_run(
                budget_bytes=torch.cuda.get_device_properties(device).total_memory)
        # the rungs' specs, as data: those registered by now (also after the callback was built)
        self.planner.bind_run(compare_reserved=on_cuda, block_bytes=512 if on_cuda else 1,
                              precision=str(trainer.precision), device_type=device.type,
                              rung_specs=rung_specs())
        # before configure_model() shards it
        self.edge.sharding_template = edge.sharding_template(trainer, pl_module)
        self.drop_unsupported(trainer, pl_module)  # (and warns what the set-up found)

    def drop_unsupported(self, trainer: Any, pl_module: pl.LightningModule) -> None:
        """Drop the rungs this strategy and module cannot take, saying why, before training."""
        self.planner.on_rung("dropped", *edge.unsupported_rungs(trainer, pl_module,
                                                                self.planner.ladder.allowed))
        self.guard.warn_advice()

    def fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``on_fit_start``: refuse a budget below the parameters; write the TensorBoard panel
        layout; start the dry run; after a resume, switch the mitigations on again."""
        self.check_parameters_fit(pl_module, self.edge.device)
        self.check_compiled(pl_module)
        self.guard.safely("the model's length limit", lambda: self._bind_length_limit(pl_module))
        if trainer.is_global_zero:
            self.guard.safely("the TensorBoard layout", lambda: outputs.write_layout(trainer))
            if self.config.dry_run:
                self.edge.dry_runner = self.start_dry_run(trainer, pl_module)
                self.planner.bind_run(dry_runner=self.edge.dry_runner)
        self.resume_rungs(trainer, pl_module)

    def _bind_length_limit(self, pl_module: pl.LightningModule) -> None:
        limit, reason = edge.model_length_limit(pl_module) or (None, "")
        self.planner.bind_run(length_limit=limit, length_limit_reason=reason)

    def check_parameters_fit(self, pl_module: torch.nn.Module,
                             device: Optional[torch.device]) -> None:
        """:class:`MemoryBudgetError` where this rank's parameters and buffers on the training
        device (local shards under FSDP2) alone exceed the usable budget: no step could fit."""
        usable = self.planner.settings.usable_budget_bytes
        if usable is None or device is None:
            return
        held = 0
        for tensor in (*pl_module.parameters(), *pl_module.buffers()):
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # DTensor: shard
            if local.device.type == device.type:
                held += local.nbytes
        if held > usable:
            assert self.planner.settings.budget_bytes is not None
            raise MemoryBudgetError(A.parameters_over_budget(
                held, usable, self.planner.settings.budget_bytes,
                self.planner.settings.safety_margin))

    def next_fit(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> EdgeState:
        """A fit after another one with this callback: on the same Trainer and module it continues
        (rungs on, records, fits, curriculum position); otherwise it starts afresh, said in one
        line, the last fit's rungs still on this module reported as on. Returns the new fit's edge
        state (fresh; the breakdown results kept where it continues)."""
        last = self.edge.fit_refs
        same_trainer = last is not None and last[0]() is trainer
        same_module = last is not None and last[1]() is pl_module
        state = self.edge.next_fit(continues=same_trainer and same_module)
        if same_trainer and same_module:
            on = ", ".join(self.planner.ladder.applied) or "none"
            rank_zero_info(f"seqmem: a new fit on the same Trainer and module continues from step "
                           f"{self.planner.course.step} (rungs on: {on}; "
                           f"{len(self.planner.evidence.measured.records)} records; curriculum "
                           f"stage {self.planner.course.seq_len}).")
            return state
        still_on = tuple(n for n in self.planner.ladder.applied if ladder.is_on(n, pl_module))
        # what the module runs with: never reported as off
        self.planner.restart(self.config.mitigations, still_on)
        if getattr(trainer, "ckpt_path", None):
            return state  # the checkpoint's state replaces this one (load_state_dict says how)
        why = "a new Trainer" if not same_trainer else "a new module"
        rungs = f"; still on this module: {', '.join(still_on)}" if still_on else ""
        rank_zero_warn(f"seqmem: this fit starts afresh ({why}): records, fits and the curriculum "
                       f"restart{rungs}.")
        return state

    def run_config(self) -> dict[str, Any]:
        """The configuration a checkpoint saves beside the state, for :func:`load_state` to
        reconcile (:func:`~lightning_seqmem.plan.checkpoint.run_config`)."""
        return S.run_config(self.config.memory_budget_bytes, self.config.safety_margin,
                            self.config.mitigations, self.config.curriculum)

    def load_state(self, state_dict: dict[str, Any]) -> None:
        """Restore from a checkpoint, checked field by field (:func:`.checkpoint.validate_state`)
        and reconciled with this callback's configuration (:func:`.checkpoint.reconcile`); a state
        this version cannot read or trust gives one warning naming the field and a fresh start."""
        allowed = self.planner.ladder.allowed  # the ladder less the rungs this run cannot take
        try:
            S.validate_state(state_dict)
            self.edge.resume_phrases, self.edge.resume_removed = self.planner.load_state_dict(
                state_dict, self.run_config())
        except Exception as exc:  # noqa: BLE001
            self.planner.restart(allowed)
            self.edge.resume_phrases, self.edge.resume_removed = [], ()
            what = str(exc) if isinstance(exc, S.InvalidState) else f"{type(exc).__name__}: {exc}"
            rank_zero_warn(f"seqmem: could not restore the callback state from the checkpoint "
                           f"({what}); measuring and fitting start afresh.",
                           category=SeqMemFailureWarning)
            return
        self.edge.uses_datamodule_length = bool(state_dict.get("uses_datamodule_length", False))
        self.edge.validation = [dict(row) for row in state_dict.get("validation", [])]
        self.edge.reapply_on_fit_start = bool(self.planner.ladder.applied)

    def resume_rungs(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After a resume: switch the checkpoint's rungs on again, then (:func:`say_resume`) take
        off those no longer allowed and say what a changed configuration changed."""
        if self.edge.reapply_on_fit_start:
            self.edge.reapply_on_fit_start = False
            for name in self.planner.ladder.applied:
                ok, detail = ladder.try_apply(name, trainer, pl_module)
                rank_zero_info(f"seqmem: resumed with {name} on ({detail})")
        self.say_resume(trainer, pl_module)

    def say_resume(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After a resume under a changed configuration: take the rungs no longer allowed off the
        module where they are on and can be, and say everything in one warning."""
        phrases, removed = self.edge.resume_phrases, self.edge.resume_removed
        self.edge.resume_phrases, self.edge.resume_removed = [], ()
        for name in removed:
            outcome = "off"
            if ladder.is_on(name, pl_module):
                result = ladder.remove(name, trainer, pl_module)
                outcome = ("taken off this module" if result is not None and result.applied else
                           "it stays on this module (it cannot be undone; a freshly built module "
                           "trains without it)")
            phrases.append(f"rung {name!r} no longer allowed: {outcome}")
        if phrases:
            rank_zero_warn(f"seqmem: resumed with {'; '.join(phrases)}.")

    def train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The precision advice, the memory breakdown (``breakdown=True``), the memory figure to
        TensorBoard, the JSON / Markdown report beside the logs, the summary (``summary=True``)."""
        if not trainer.is_global_zero or not self.planner.evidence.measured.records:
            return
        if not self.edge.failed:
            self.guard.safely("the precision advice", lambda: self.advice_at_end(trainer))
        if self.config.breakdown and not self.edge.failed:
            self.guard.safely("the memory breakdown",
                              lambda: self.run_breakdown(trainer, pl_module))
        self.guard.safely("the memory figure",
                          lambda: outputs.log_figure(trainer, PlanView.of(self.planner)))
        paths: list[Any] = []
        self.guard.safely("the report", lambda: paths.extend(self.write_report(trainer) or ()))
        if self.config.summary:
            self.guard.safely("the summary", lambda: print(
                outputs.fit_summary(PlanView.of(self.planner), trainer, paths), flush=True))

    def advice_at_end(self, trainer: pl.Trainer) -> None:
        """Advice from the forecast as it stands now (:mod:`lightning_seqmem.dryrun.advice_now`):
        bf16 only where a dry run says it lowers the peak."""
        from lightning_seqmem.dryrun.advice_now import precision_advice

        item = precision_advice(self.edge.dry_runner, PlanView.of(self.planner),
                                str(trainer.precision), self.edge.device)
        if item is not None:
            self.planner.advice.advise(item)
        self.guard.warn_advice()

    def run_breakdown(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """Trace the memory breakdown now (:func:`.fit_breakdown.run_breakdown`): sets the edge's
        ``breakdowns``, ``breakdown_table``, ``breakdown_report``, warns each diagnosis once, logs
        the tables as TensorBoard text and returns the section."""
        from lightning_seqmem.trainer.fit_breakdown import run_breakdown as trace_breakdown

        section, self.edge.breakdowns, self.edge.breakdown_table = trace_breakdown(
            PlanView.of(self.planner), self.edge.breakdown_batch,
            lambda batch: read_batch_shape(batch, self.config.seq_len_fn), self.edge.device,
            trainer, pl_module)
        self.edge.breakdown_report = section
        self.guard.warn_advice()  # one warning per diagnosis
        outputs.log_breakdown(trainer, section)
        return section

    def write_report(self, trainer: pl.Trainer, directory: Optional[str] = None) -> Any:
        """Write ``seqmem_report.json``, ``seqmem_report.md`` and the figure; return their paths
        (``directory`` defaults to the logger's ``log_dir``, ``default_root_dir`` without one)."""
        probe, note = self.program_note()
        probe = f"{probe}: measurements and forecasts {note}" if note else probe
        return outputs.write_report(PlanView.of(self.planner), trainer, directory,
                                    device=self.edge.device, probe=probe,
                                    breakdown=self.edge.breakdown_report,
                                    validation=self.edge.validation)

    def program_note(self) -> tuple[str, str]:
        """(the probe's name, which program it measures: :func:`.advice.program_note`, or "")."""
        probe = self.edge.probe.name if self.edge.probe is not None else self.config.probe
        return probe, A.program_note(self.edge.compiled_reason, probe)

    def check_compiled(self, pl_module: pl.LightningModule) -> None:
        """A ``torch.compile``'d module: measure without preventing compilation, and say so once
        (the callback's docstring). Runs after ``configure_model``, where modules often compile."""
        from lightning_seqmem.dryrun.fake import compiled_reason

        compiled = self.edge.compiled_reason = compiled_reason(pl_module)
        probe = self.edge.probe
        tracked_compiled = compiled is not None and probe is not None and probe.name == "tracker"
        every = (max(self.config.measure_every_n_steps, COMPILED_MEASURE_EVERY_N_STEPS)
                 if tracked_compiled else self.config.measure_every_n_steps)
        self.planner.bind_run(measure_every_n_steps=every)
        if compiled is None or probe is None:
            return
        self.planner.advice.advise(A.compiled_module(compiled, probe.name,
                                                     self.planner.settings.measure_every_n_steps))
        self.guard.warn_advice()

    def start_dry_run(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
        """The :class:`~lightning_seqmem.dryrun.run.TrainingRunDryRun` of this module's training
        step (rank zero) that the planner judges each new setting by, with the rungs on now."""
        from lightning_seqmem.diagnostics.peak_trace import trace_peak_site
        from lightning_seqmem.dryrun.run import TrainingRunDryRun
        from lightning_seqmem.trainer.own_memory import resident_bytes, value_room_bytes

        return TrainingRunDryRun(
            trainer, pl_module, lambda: self.planner.ladder.applied,
            lambda why, *shape: self.planner.advice.advise(A.dry_run_unavailable(why, *shape)),
            template=self.edge.sharding_template, site=trace_peak_site,
            room=lambda: value_room_bytes(self.edge, self.planner.settings.usable_budget_bytes),
            resident=lambda evaluate=False: resident_bytes(self.edge, evaluate),
            seq_len_fn=self.config.seq_len_fn)
