"""Continuing a run with the same callback: a resume from a checkpoint, or a second ``fit``.

The callback's hooks call these:

* ``setup``: :func:`next_fit`, whether a second fit continues the state or starts afresh (a fresh
  :class:`~lightning_seqmem.trainer.run_state.EdgeState` either way);
* ``on_load_checkpoint``: :func:`adopt_legacy_state`, an earlier version's state found under its key;
* ``state_dict``: :func:`run_config`, the configuration saved beside the state;
* ``load_state_dict``: :func:`load_state`, the state restored, checked and reconciled with this
  callback's configuration (a state that cannot be trusted: one warning and a fresh start);
* ``on_fit_start``: :func:`resume_rungs`, the rungs switched on again and those no longer allowed
  taken off, said in one warning.

Example:
    >>> old_key = "SeqMemCallback{'probe': 'auto', 'curriculum': None, 'memory_budget': 100, 'mitigations': ()}"
    >>> checkpoint = {"callbacks": {old_key: {"step": 3}}}
    >>> adopt_legacy_state(checkpoint, "SeqMemCallback")  # an earlier version's key: found, config and all
    >>> state = checkpoint["callbacks"]["SeqMemCallback"]
    >>> state["step"], state["config"]["memory_budget_bytes"]
    (3, 100)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_seqmem.core.records import SeqMemFailureWarning
from lightning_seqmem.mitigations import ladder
from lightning_seqmem.plan import checkpoint as S

if TYPE_CHECKING:
    from lightning_seqmem.trainer.callback import SeqMemCallback


def next_fit(cb: "SeqMemCallback", trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """A fit after another one with this callback. On the same Trainer and module it continues the
    state (rungs on, records, fits, curriculum position); otherwise it starts afresh, said in one
    line, and reports the rungs of the last fit still on this module as on (they are)."""
    last = cb.edge.fit_refs
    same_trainer = last is not None and last[0]() is trainer
    same_module = last is not None and last[1]() is pl_module
    cb.edge = cb.edge.next_fit(continues=same_trainer and same_module)  # the breakdowns kept where it continues
    if same_trainer and same_module:
        on = ", ".join(cb.planner.ladder.applied) or "none"
        rank_zero_info(f"seqmem: a new fit on the same Trainer and module continues from step {cb.planner.course.step} "
                       f"(rungs on: {on}; {len(cb.planner.evidence.records)} records; curriculum stage "
                       f"{cb.planner.course.seq_len}).")
        return
    still_on = tuple(n for n in cb.planner.ladder.applied if ladder.is_on(n, pl_module))
    cb.planner.restart(cb.configured_mitigations, still_on)  # what the module runs with: never reported as off
    if getattr(trainer, "ckpt_path", None):
        return  # the checkpoint's state replaces this one (load_state_dict says how it resumed)
    why = "a new Trainer" if not same_trainer else "a new module"
    rungs = f"; still on this module: {', '.join(still_on)}" if still_on else ""
    rank_zero_warn(f"seqmem: this fit starts afresh ({why}): records, fits and the curriculum restart{rungs}.")


def run_config(cb: "SeqMemCallback") -> dict[str, Any]:
    """The configuration a checkpoint saves beside the state, for :func:`load_state` to reconcile
    (:func:`~lightning_seqmem.plan.checkpoint.run_config`)."""
    return S.run_config(cb.config.memory_budget_bytes, cb.config.safety_margin, cb.configured_mitigations, cb.config.curriculum)


def adopt_legacy_state(checkpoint: dict[str, Any], state_key: str) -> None:
    """A checkpoint of an earlier version keyed the state by the configuration: found under that
    key (when it is the only such state), with the configuration it names, for reconciliation."""
    states = checkpoint.get("callbacks")
    if not isinstance(states, dict) or state_key in states:
        return
    found = S.find_legacy_state(states)
    if found is not None and isinstance(states[found[0]], dict):
        states[state_key] = {"config": found[1], **states[found[0]]}


def load_state(cb: "SeqMemCallback", state_dict: dict[str, Any]) -> None:
    """Restore from a checkpoint, checked field by field (:func:`~lightning_seqmem.plan.checkpoint.validate_state`)
    and reconciled with this callback's configuration (:func:`~lightning_seqmem.plan.checkpoint.reconcile`).
    A state this version cannot read or trust gives one warning naming the field and a fresh
    start (measurement resumes from scratch), never a failed resume."""
    allowed = cb.planner.ladder.allowed  # the ladder less the rungs this run cannot take (setup)
    try:
        S.validate_state(state_dict)
        cb.edge.resume_phrases, cb.edge.resume_removed = cb.planner.load_state_dict(state_dict, run_config(cb))
    except Exception as exc:  # noqa: BLE001
        cb.planner.restart(allowed)
        cb.edge.resume_phrases, cb.edge.resume_removed = [], ()
        what = str(exc) if isinstance(exc, S.InvalidState) else f"{type(exc).__name__}: {exc}"
        rank_zero_warn(f"seqmem: could not restore the callback state from the checkpoint ({what}); measuring "
                       "and fitting start afresh.", category=SeqMemFailureWarning)
        return
    cb.edge.uses_datamodule_length = bool(state_dict.get("uses_datamodule_length", False))
    cb.edge.reapply_on_fit_start = bool(cb.planner.ladder.applied)


def resume_rungs(cb: "SeqMemCallback", trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """After a resume: switch the rungs of the checkpoint on again, then (:func:`say_resume`) take
    off those no longer allowed and say what a changed configuration changed."""
    if cb.edge.reapply_on_fit_start:
        cb.edge.reapply_on_fit_start = False
        for name in cb.planner.ladder.applied:
            ok, detail = ladder.try_apply(name, trainer, pl_module)
            rank_zero_info(f"seqmem: resumed with {name} on ({detail})")
    say_resume(cb, trainer, pl_module)


def say_resume(cb: "SeqMemCallback", trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """After a resume under a changed configuration: take the rungs no longer allowed off the
    module where they are on and can be, and say everything in one warning."""
    phrases, removed = cb.edge.resume_phrases, cb.edge.resume_removed
    cb.edge.resume_phrases, cb.edge.resume_removed = [], ()
    for name in removed:
        outcome = "off"
        if ladder.is_on(name, pl_module):
            result = ladder.remove(name, trainer, pl_module)
            outcome = ("taken off this module" if result is not None and result.applied else
                       "it stays on this module (it cannot be undone; a freshly built module trains without it)")
        phrases.append(f"rung {name!r} no longer allowed: {outcome}")
    if phrases:
        rank_zero_warn(f"seqmem: resumed with {'; '.join(phrases)}.")
