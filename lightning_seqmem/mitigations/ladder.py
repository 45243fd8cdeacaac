"""The mitigation ladder: every rung behind one name, cheapest first, and the rung registry.

Built-in rungs, in the default order (``SeqMemCallback(mitigations=...)`` may reorder or drop them):

- ``"attention"`` (:class:`AttentionRung`): eager → SDPA (→ flash-attn where installed, on CUDA,
  fp16/bf16); prior cost: none (no L² matrix, no extra compute).
- ``"checkpointing"`` (:class:`CheckpointingRung`): recompute each transformer block in backward,
  ~25-35% more compute; ``"checkpointing:k/N"``: the first k of N blocks (k/N of that);
  ``"checkpointing:selective"``: pointwise ops only (~15%).
- ``"microbatch"`` (:class:`MicroBatchRung`): split each batch into micro-batches of one sample
  inside the step; prior cost: throughput (smaller kernels).

Opt-in (:data:`~lightning_seqmem.core.rungs.EXTRA_RUNGS`; name one in ``mitigations`` to allow it):

- ``"fused_loss"`` (:class:`FusedLossRung`): fused linear cross-entropy, no ``[tokens, vocab]``
  logits; prior cost: a Python loop over token shards (~5%).
- ``"tiled_mlp"`` (:class:`TiledMLPRung`): each block's MLP on sequence tiles, recomputed in
  backward (DeepSpeed's ``TiledMLP``, the ``tiled`` extra); prior cost: one more MLP forward (~20%).
- ``"activation_offload"`` (:class:`ActivationOffloadRung`, CUDA only): what each block saves for
  backward goes to pinned host memory and back; prior cost: the host-device copies (~15%, a guess).

Each rung follows :class:`.base.Rung`. A new rung is one folder (``<rung>.py`` with ``RUNG``, its
spec, its card) and one line: its name in ``core.rungs.RUNG_FOLDERS`` (a built-in) or
:func:`register_folder` (a user's). The functions below return a rung's failure, never raise it.

Example:
    >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
    >>> model = GPT(GPTConfig(n_layer=2, d_model=32, n_head=2))
    >>> applicability(["attention", "checkpointing"], None, model)["checkpointing"][0]
    True
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Optional, Sequence

from lightning_seqmem.core.rungs import (
    BUILTIN_RUNGS,
    RUNG_FOLDERS,
    base_name,
    register_spec,
    rung_names,
    unregister_spec,
)
from lightning_seqmem.mitigations.base import CopyPlan, MitigationResult, Rung, RungContext


def _folder_rung(path: str) -> Rung:
    """The rung of the folder (package) ``path``: its ``<leaf>.py`` module's ``RUNG()``."""
    module = importlib.import_module(f"{path}.{path.rsplit('.', 1)[-1]}")
    return module.RUNG()


_RUNGS: dict[str, Rung] = {r.name: r for r in (
    _folder_rung(f"lightning_seqmem.mitigations.{folder}") for folder in RUNG_FOLDERS)}


def register(rung: Rung) -> Rung:
    """Add ``rung`` to the ladder (or replace the rung of that name); its spec goes to the planner.
    ValueError where ``rung`` is not a :class:`.base.Rung` with a spec."""
    if not isinstance(rung, Rung) or getattr(rung, "spec", None) is None:
        raise ValueError("`rung` must be a Rung (lightning_seqmem.mitigations.base) with a `spec`, "
                         f"got {rung!r}")
    register_spec(rung.spec)
    _RUNGS[rung.name] = rung
    return rung


def register_folder(path: str) -> Rung:
    """Add the rung of package ``path`` (``"my_rungs.no_dropout"``: ``no_dropout.py`` with ``RUNG``,
    and its spec if apart); ValueError where it has no rung module or no ``RUNG`` with a spec."""
    try:
        rung = _folder_rung(path)
    except (ImportError, AttributeError) as exc:
        raise ValueError("`path` must name a rung folder (a package with <leaf>.py defining "
                         f"RUNG), got {path!r}: {type(exc).__name__}: {exc}") from exc
    return register(rung)


def unregister(name: str) -> None:
    """Take a registered rung off the ladder (the built-ins stay)."""
    if name not in BUILTIN_RUNGS:
        _RUNGS.pop(name, None)
        unregister_spec(name)


def rung(name: str) -> Rung:
    """The rung registered as ``name``, or its variant (``"checkpointing:3/8"``: at that level);
    ValueError for an unknown name (naming :func:`rung_names`) or a level it does not have."""
    base = base_name(name)
    if base not in _RUNGS:
        raise ValueError(f"no rung named {base!r}; known rungs: {rung_names()}")
    return _RUNGS[base] if base == name else _RUNGS[base].at(name[len(base) + 1:])


def is_applicable(name: str, trainer: Any, pl_module: Any, batch: Any = None,
                  batch_size: Optional[int] = None) -> tuple[bool, str]:
    """Whether rung ``name`` would change this model and run, with the reason."""
    return rung(name).is_applicable(RungContext(pl_module, trainer, batch, batch_size))


def apply(name: str, trainer: Any, pl_module: Any, batch: Any = None,
          noop_ok: bool = False) -> MitigationResult:
    """Switch rung ``name`` on (in place, between training steps); ``noop_ok``: even where it
    changes nothing on this batch (:meth:`.base.Rung.noop`: another rank's batch needs it)."""
    return rung(name).apply(RungContext(pl_module, trainer, batch, noop_ok=noop_ok))


def noop(name: str, trainer: Any, pl_module: Any, batch: Any = None) -> Optional[str]:
    """Why rung ``name`` would change nothing on this batch, or None (also if its check raises)."""
    try:
        return rung(name).noop(RungContext(pl_module, trainer, batch))
    except Exception:  # noqa: BLE001 - an unusual model: as if it changed something
        return None


def remove(name: str, trainer: Any, pl_module: Any) -> Optional[MitigationResult]:
    """Switch rung ``name`` off where it can, else None (a rung changing only rounding may stay)."""
    return rung(name).remove(RungContext(pl_module, trainer))


def is_on(name: str, pl_module: Any) -> bool:
    """Whether rung ``name`` is on in ``pl_module`` now (attention: any backend but eager)."""
    return rung(name).is_on(pl_module)


def applicability(names: Sequence[str], trainer: Any, pl_module: Any, batch: Any = None,
                  batch_size: Optional[int] = None) -> dict[str, tuple[bool, str]]:
    """``name -> (applies, reason)`` for each rung in ``names``, and for each variant of a rung
    with levels (``"checkpointing:3/8"``) where it applies; a check that raises says so."""
    out = {}
    for name in names:
        try:
            out[name] = is_applicable(name, trainer, pl_module, batch, batch_size)
            if out[name][0]:
                ctx = RungContext(pl_module, trainer, batch, batch_size)
                for variant in rung(name).variants(ctx):
                    if variant != name:
                        out[variant] = is_applicable(variant, trainer, pl_module, batch, batch_size)
        except Exception as exc:  # noqa: BLE001 - an unusual model must not end the run here
            out[name] = (False, f"its check failed ({type(exc).__name__}: {exc})")
    return out


def copy_refusal(name: str, trainer: Any, pl_module: Any,
                 batch_size: Optional[int] = None) -> Optional[str]:
    """Rung ``name``'s :meth:`.base.Rung.copy_refusal`, or None; a check that raises says so."""
    try:
        return rung(name).copy_refusal(RungContext(pl_module, trainer, None, batch_size))
    except Exception as exc:  # noqa: BLE001 - an unusual model: said, never raised
        return f"its check failed ({type(exc).__name__}: {exc})"


def try_apply(name: str, trainer: Any, pl_module: Any, batch: Any = None,
              noop_ok: bool = False) -> tuple[bool, str]:
    """Switch rung ``name`` on: ``(applied, what was done or why not)``; a failure is returned."""
    try:
        result = apply(name, trainer, pl_module, batch, noop_ok)
        return bool(result.applied), result.detail
    except Exception as exc:  # noqa: BLE001 - a failed mitigation must not kill the run
        return False, f"{type(exc).__name__}: {exc}"


def setup_refusals(trainer: Any, pl_module: Any, names: Sequence[str]) -> dict[str, str]:
    """``name -> why`` for the rungs of ``names`` this strategy or module cannot take at all."""
    return {name: why for name in names if (why := rung(name).setup_refusal(trainer, pl_module))}


def apply_to_copy(names: Sequence[str], copy: Any, *,
                  after_sharding: Optional[bool] = None) -> CopyPlan:
    """Put the rungs ``names`` on a dry run's fake copy, in order; ``after_sharding``: only those
    that go on before (False) or after (True) ``fully_shard`` (None: all); returns the plan."""
    plan = CopyPlan()
    for name in names:
        r = rung(name)
        if after_sharding is None or r.after_sharding == after_sharding:
            r.apply_to_copy(copy, plan)
    return plan


def check_pending(names: Sequence[str], pl_module: Any, batch: Any = None) -> bool:
    """Whether a rung of ``names`` (those on) runs its one-time check at the next step."""
    def pending(r: Rung) -> bool:  # (a rung written before ``batch`` was asked takes the module)
        takes_batch = len(inspect.signature(r.check_pending).parameters) > 1
        return r.check_pending(pl_module, batch) if takes_batch else r.check_pending(pl_module)

    return any(pending(rung(n)) for n in names if base_name(n) in _RUNGS)


def refused(names: Sequence[str], pl_module: Any) -> Optional[tuple[str, str]]:
    """``(name, why)`` of the first rung of ``names`` (those on) whose own check refused it."""
    for name in names:
        why = rung(name).refusal(pl_module) if base_name(name) in _RUNGS else None
        if why is not None:
            return name, why
    return None


__all__ = ["apply", "apply_to_copy", "applicability", "check_pending", "copy_refusal", "noop",
           "is_applicable", "is_on", "refused", "register", "register_folder", "remove", "rung",
           "setup_refusals", "try_apply", "unregister"]
