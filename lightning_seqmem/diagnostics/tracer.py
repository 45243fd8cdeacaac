"""Trace one training step and attribute its peak to modules and kinds: the :class:`Breakdown`.

:func:`trace_breakdown` runs one training step under a ``LiveTensorTracker`` that also records,
for every storage it sees allocated, the innermost module running (forward, or backward through
autograd-node labels: :class:`~.scope.ModuleScope`), the op, shape and dtype, and whether autograd
saved it for backward (a ``saved_tensors_hooks`` pack hook). At the step's peak the live storages
are grouped by *category* (a friendly module name, :data:`~.categories.CATEGORIES`) and *kind*
(:data:`~.categories.KINDS`):

* ``parameters``, ``gradients``, ``optimizer_state``: from the tensors alive before the step, the
  gradient hooks and the optimizer's state after it; ``inputs``: the other tensors passed as
  ``existing`` (the batch);
* ``activations``: allocated during the forward and still alive when the backward starts;
* ``temporaries``: everything else (forward temporaries, activation gradients, recomputation,
  optimizer scratch).

Tensors with two dimensions equal to the sequence length are *quadratic* and counted as
``attention_scores`` whatever module made them (choose lengths that differ from every model width).
Tracing is measurement only: the theory (:func:`~.korthikanti.calibrate`) is the caller's to add.

Example:
    >>> import torch
    >>> lin = torch.nn.Linear(8, 8)
    >>> opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    >>> x = torch.ones(4, 8)
    >>> def step():
    ...     opt.zero_grad(); lin(x).square().sum().backward(); opt.step()
    >>> b = trace_breakdown(step, lin, opt, [x], seq_len=3, batch_size=4)
    >>> b.peak_by_kind["parameters"], b.peak_phase, b.calibration is None
    (288, 'backward', True)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import numpy as np
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_flatten

from lightning_seqmem.core.checks import check_int
from lightning_seqmem.diagnostics.categories import (ATTENTION_CATEGORIES, CATEGORIES, KINDS,
                                                     block_paths_of, is_inside, module_category,
                                                     module_infos)
from lightning_seqmem.diagnostics.growth import is_quadratic_shape
from lightning_seqmem.diagnostics.scope import ModuleScope, in_backward
from lightning_seqmem.measure.tracker import LiveTensorTracker, tensor_storages
from lightning_seqmem.mitigations.attention.attention import current_attention_backend
from lightning_seqmem.mitigations.checkpointing.checkpointing import is_checkpointed

if TYPE_CHECKING:
    from lightning_seqmem.diagnostics.korthikanti import Calibration

__all__ = ["AllocationRecord", "Breakdown", "trace_breakdown"]


@dataclass
class AllocationRecord:
    """One storage seen by the tracer (bytes; ``module`` is the innermost module's clean path)."""

    index: int
    nbytes: int
    op: str
    shape: tuple[int, ...]
    dtype: str
    module: str  # "" the root, "<global>" outside any module, "<ClassName>" one outside the model
    category: str
    phase: str  # "existing", "forward", "backward" or "optimizer"
    kind: str = "temporaries"
    saved_for_backward: bool = False
    quadratic: bool = False
    recompute: bool = False  # made in the backward by a forward run again (checkpointing)


class _BreakdownTracker(LiveTensorTracker):
    """A :class:`LiveTensorTracker` that describes every allocation (module, op, shape, phase)."""

    def __init__(self, device_type: str, seq_len: int, scope: ModuleScope) -> None:
        super().__init__(device_type, record_events=True)
        self.seq_len = seq_len
        self.scope = scope
        self.records: list[Optional[AllocationRecord]] = []
        self.saved: set[int] = set()

    def _grow(self) -> None:
        self.records.extend([None] * (len(self._finalizers) - len(self.records)))

    def track_tensor(self, tensor: torch.Tensor, kind: str, module: str, category: str) -> None:
        before = len(self._finalizers)
        self.track_existing([tensor], kind)
        self._grow()
        for i in range(before, len(self._finalizers)):
            self.records[i] = AllocationRecord(
                i, self.events.sizes[i], f"<{kind}>", tuple(tensor.shape),
                str(tensor.dtype).replace("torch.", ""), module, category, "existing", kind,
                quadratic=is_quadratic_shape(tuple(tensor.shape), self.seq_len))

    def index_of(self, tensor: torch.Tensor) -> list[int]:
        return [self._ids[st._cdata] for st in tensor_storages(tensor) if st._cdata in self._ids]

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, torch.Tensor) and tensor.device.type == self.device_type:
            self.saved.update(self.index_of(tensor))
        return tensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.phase == "forward" and in_backward():
            self.mark_phase("backward")
        before = len(self._finalizers)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self._finalizers) > before:
            self._describe(out, before, func.name())
        return out

    def _describe(self, out: Any, before: int, op: str) -> None:
        self._grow()
        scope = self.scope
        current = scope.current()
        if current is not None:
            path, chain = current
            category = module_category(chain)
        else:
            path = "<global>"
            late = scope.root_forward_ran or self.phase == "backward"
            category = "loss_logits" if late and self.phase != "optimizer" else "other"
        # a module's forward running inside the autograd engine: a checkpointed forward recomputed
        recompute = (self.phase == "backward" and current is not None and bool(scope.stack)
                     and in_backward())
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            for st in tensor_storages(t):
                i = self._ids.get(st._cdata)
                if i is None or i < before or self.records[i] is not None:
                    continue
                shape = tuple(t.shape)
                quadratic = is_quadratic_shape(shape, self.seq_len)
                self.records[i] = AllocationRecord(
                    i, self.events.sizes[i], op, shape, str(t.dtype).replace("torch.", ""), path,
                    "attention_scores" if quadratic else category, self.phase or "forward",
                    quadratic=quadratic, recompute=recompute)
        for i in range(before, len(self.records)):
            if self.records[i] is None:  # an output we could not match (should not happen)
                self.records[i] = AllocationRecord(i, self.events.sizes[i], op, (), "", path,
                                                   category, self.phase or "forward")


# ---------------------------------------------------------------------------------------------
# Results


@dataclass
class Breakdown:
    """Where the memory of one traced step went (bytes). See the module docstring for kinds."""

    seq_len: int
    batch_size: int
    peak_bytes: int  # the tracker's peak: sum of everything below at the peak moment
    peak_phase: str
    peak_op: str  # the op whose allocation reached the peak
    start_bytes: int  # alive before the step (parameters, gradients, optimizer state, inputs)
    peak_by_part: dict[str, dict[str, int]]  # category → kind → bytes live at the peak
    peak_by_module: dict[str, int]  # innermost module path → bytes live at the peak
    activation_by_category: dict[str, int]  # activations (alive when backward starts) by category
    layer_activation_bytes: list[int]  # activations made inside each repeated block
    autocast_dtype: Optional[str]  # seen in a module's forward, or None
    attention_backend: Optional[str]
    checkpointed: bool
    tensors: list[AllocationRecord] = field(repr=False)  # every allocation, by index
    alive_at_peak: list[int] = field(repr=False)  # indices into tensors
    calibration: Optional[Calibration] = None
    peak_index: int = -1  # index into tensors of the allocation reaching the peak (-1: none)

    @property
    def autocast(self) -> bool:
        return self.autocast_dtype is not None

    @property
    def peak_by_kind(self) -> dict[str, int]:
        out = {k: 0 for k in KINDS}
        for kinds in self.peak_by_part.values():
            for kind, n in kinds.items():
                out[kind] += n
        return {k: v for k, v in out.items() if v}

    @property
    def peak_by_category(self) -> dict[str, int]:
        return {c: sum(k.values()) for c, k in self.peak_by_part.items()}

    @property
    def activation_bytes(self) -> int:
        return sum(self.activation_by_category.values())

    @property
    def attention_activation_bytes(self) -> int:
        return sum(self.activation_by_category.get(c, 0) for c in ATTENTION_CATEGORIES)

    @property
    def attention_share(self) -> float:
        """Attention's share of activation memory (:data:`ATTENTION_CATEGORIES`)."""
        total = self.activation_bytes
        return self.attention_activation_bytes / total if total else 0.0

    def quadratic_tensors(self) -> list[dict[str, Any]]:
        """Tensors with two dimensions equal to L, grouped by op, shape, dtype, phase and saving."""
        alive = set(self.alive_at_peak)
        groups: dict[tuple, dict[str, Any]] = {}
        for r in self.tensors:
            if not r.quadratic:
                continue
            key = (r.op, r.shape, r.dtype, r.phase, r.saved_for_backward)
            g = groups.setdefault(key, {
                "op": r.op, "shape": list(r.shape), "dtype": r.dtype, "phase": r.phase,
                "saved_for_backward": r.saved_for_backward, "count": 0, "bytes": 0,
                "alive_at_peak": 0, "modules": [],
            })
            g["count"] += 1
            g["bytes"] += r.nbytes
            g["alive_at_peak"] += r.index in alive
            if r.module not in g["modules"] and len(g["modules"]) < 4:
                g["modules"].append(r.module)
        return sorted(groups.values(), key=lambda g: -g["bytes"])

    def top_tensors(self, n: int = 10) -> list[AllocationRecord]:
        """The ``n`` largest storages alive at the peak."""
        return sorted((self.tensors[i] for i in self.alive_at_peak), key=lambda r: -r.nbytes)[:n]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values for the report (no per-tensor list; quadratic tensors grouped)."""
        top_modules = sorted(self.peak_by_module.items(), key=lambda kv: -kv[1])[:20]
        return {
            "seq_len": self.seq_len, "batch_size": self.batch_size, "peak_bytes": self.peak_bytes,
            "peak_phase": self.peak_phase, "peak_op": self.peak_op, "start_bytes": self.start_bytes,
            "peak_by_kind": self.peak_by_kind, "peak_by_category": self.peak_by_category,
            "peak_by_part": {c: dict(k) for c, k in self.peak_by_part.items()},
            "peak_by_module": dict(top_modules),
            "activation_bytes": self.activation_bytes,
            "activation_by_category": dict(self.activation_by_category),
            "attention_activation_bytes": self.attention_activation_bytes,
            "attention_share": self.attention_share,
            "layer_activation_bytes": list(self.layer_activation_bytes),
            "quadratic_tensors": self.quadratic_tensors(),
            "top_tensors": [
                {"op": r.op, "shape": list(r.shape), "dtype": r.dtype, "module": r.module,
                 "kind": r.kind, "category": r.category, "bytes": r.nbytes,
                 "saved_for_backward": r.saved_for_backward}
                for r in self.top_tensors()],
            "autocast_dtype": self.autocast_dtype, "attention_backend": self.attention_backend,
            "checkpointed": self.checkpointed,
            "calibration": self.calibration.to_dict() if self.calibration else None,
        }


def _alive(sequence: np.ndarray, n: int, upto: int) -> np.ndarray:
    part = sequence[:upto]
    alive = np.zeros(n, dtype=bool)
    alive[part[part >= 0]] = True
    alive[~part[part < 0]] = False
    return alive


# ---------------------------------------------------------------------------------------------
# Tracing, in steps
# ---------------------------------------------------------------------------------------------
Owners = dict[int, tuple[str, str]]  # id(parameter) → (module path, category)


def _state_tensors(opt: torch.optim.Optimizer) -> Iterable[tuple[torch.Tensor, Any]]:
    """(state tensor, its parameter) for every tensor in the optimizer's state."""
    for p, state in opt.state.items():
        for t in state.values():
            if isinstance(t, torch.Tensor):
                yield t, p


def _parameter_owners(model: nn.Module, infos: dict[int, tuple[str, tuple]]) -> Owners:
    owner: Owners = {}
    for mod in model.modules():
        path, chain = infos[id(mod)]
        for p in mod.parameters(recurse=False):
            owner.setdefault(id(p), (path, module_category(chain)))
    return owner


def _track_existing(tracker: _BreakdownTracker, params: list[nn.Parameter],
                    optimizers: list[torch.optim.Optimizer], existing: Iterable[torch.Tensor],
                    owner: Owners) -> int:
    """Track what is alive before the step (parameters, gradients, optimizer state, inputs);
    returns their count."""
    for p in params:
        tracker.track_tensor(p, "parameters", *owner.get(id(p), ("", "other")))
    for p in params:
        if p.grad is not None:
            tracker.track_tensor(p.grad, "gradients", *owner.get(id(p), ("", "other")))
    for opt in optimizers:
        for t, p in _state_tensors(opt):
            tracker.track_tensor(t, "optimizer_state", *owner.get(id(p), ("", "other")))
    for t in existing:
        if isinstance(t, torch.Tensor):
            tracker.track_tensor(t, "inputs", "<global>", "other")
    return len(tracker.records)


def _run_step(step_fn: Callable[[], Any], tracker: _BreakdownTracker, scope: ModuleScope,
              params: list[nn.Parameter],
              optimizers: list[torch.optim.Optimizer]) -> dict[int, nn.Parameter]:
    """Run ``step_fn`` under the tracker and the hooks; the allocations that became a ``.grad``.
    An optimizer stepped inside ``step_fn`` that is not in ``optimizers`` is added to it."""
    grad_of: dict[int, nn.Parameter] = {}  # allocation index → parameter whose .grad it is

    def on_grad(p: torch.Tensor) -> None:
        if p.grad is not None:
            for i in tracker.index_of(p.grad):
                grad_of[i] = p

    def on_optimizer_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if tracker.phase != "optimizer":
            tracker.mark_phase("optimizer")
        if all(o is not opt for o in optimizers):
            optimizers.append(opt)

    handles = [p.register_post_accumulate_grad_hook(on_grad) for p in params if p.requires_grad]
    try:
        scope.install()
        handles.append(register_optimizer_step_pre_hook(on_optimizer_step))
        with saved_tensors_hooks(tracker.pack, lambda t: t):
            with tracker:
                tracker.mark_phase("forward")
                step_fn()
    finally:
        for handle in handles:
            handle.remove()
        scope.remove()
        tracker.stop()
    return grad_of


def _assign_kinds(tracker: _BreakdownTracker, optimizers: list[torch.optim.Optimizer],
                  grad_of: dict[int, nn.Parameter], owner: Owners,
                  num_existing: int) -> list[AllocationRecord]:
    """Every allocation's record with its kind: gradient, optimizer state, activation, temporary."""
    records: list[AllocationRecord] = [r for r in tracker.records if r is not None]
    assert len(records) == len(tracker.events.sizes), "every allocation is described"
    sequence = np.asarray(tracker.events.sequence, dtype=np.int64)
    alive_fwd_end = _alive(sequence, len(records),
                           tracker.events.phase_starts.get("backward", len(sequence)))
    state_of: dict[int, Any] = {}
    for opt in optimizers:
        for t, p in _state_tensors(opt):
            for i in tracker.index_of(t):
                state_of[i] = p
    for r in records:
        r.saved_for_backward = r.index in tracker.saved
        if r.index < num_existing:
            continue
        if r.index in grad_of or r.index in state_of:
            p = grad_of.get(r.index, state_of.get(r.index))
            r.kind = "gradients" if r.index in grad_of else "optimizer_state"
            r.module, r.category = owner.get(id(p), (r.module, r.category))
        elif r.phase == "forward" and alive_fwd_end[r.index]:
            r.kind = "activations"
        else:
            r.kind = "temporaries"
    return records


def _peak_moment(tracker: _BreakdownTracker, n: int) -> tuple[list[int], str, int]:
    """(indices alive at the peak, the peak's phase, the index of the allocation reaching it)."""
    sequence = np.asarray(tracker.events.sequence, dtype=np.int64)
    sizes = np.asarray(tracker.events.sizes, dtype=np.int64)
    deltas = np.where(sequence >= 0, sizes[np.where(sequence >= 0, sequence, 0)],
                      -sizes[np.where(sequence < 0, ~sequence, 0)])
    live = np.cumsum(deltas) if len(deltas) else np.zeros(1, dtype=np.int64)
    peak_pos = int(np.argmax(live))
    peak_phase = "existing"
    for phase, start in sorted(tracker.events.phase_starts.items(), key=lambda kv: kv[1]):
        if start <= peak_pos:
            peak_phase = phase
    alive_at_peak = [int(i) for i in np.flatnonzero(_alive(sequence, n, peak_pos + 1))]
    return alive_at_peak, peak_phase, int(sequence[peak_pos]) if len(sequence) else 0


def _sums(records: list[AllocationRecord], alive_at_peak: list[int]) -> tuple[dict, dict, dict]:
    """(category → kind → bytes at the peak, module → bytes at the peak, activations by
    category)."""
    by_part: dict[str, dict[str, int]] = {}
    by_module: dict[str, int] = {}
    for i in alive_at_peak:
        r = records[i]
        by_part.setdefault(r.category, {}).setdefault(r.kind, 0)
        by_part[r.category][r.kind] += r.nbytes
        by_module[r.module] = by_module.get(r.module, 0) + r.nbytes
    activations: dict[str, int] = {}
    for r in records:
        if r.kind == "activations":
            activations[r.category] = activations.get(r.category, 0) + r.nbytes
    return ({c: by_part[c] for c in CATEGORIES if c in by_part}, by_module,
            {c: activations[c] for c in CATEGORIES if c in activations})


def trace_breakdown(step_fn: Callable[[], Any], model: nn.Module,
                    optimizer: Optional[torch.optim.Optimizer] = None,
                    existing: Iterable[torch.Tensor] = (), *, seq_len: int, batch_size: int,
                    device_type: Optional[str] = None) -> Breakdown:
    """Trace one training step and attribute its peak to modules and kinds.

    Args:
        step_fn: runs one training step (forward, backward, optimizer step) when called with no
            arguments. Run a warm-up step first (the first step has no optimizer state).
        model: the model the step trains; its parameters, their gradients and (with ``optimizer``)
            the optimizer state alive before the step are counted.
        optimizer: its state tensors are counted as ``optimizer_state``; an optimizer stepped inside
            ``step_fn`` is also recognised without it (global step hook).
        existing: other tensors alive before the step (the batch): kind ``inputs``.
        seq_len: the step's sequence length (tensors with two dimensions equal to it: quadratic).
        batch_size: the step's batch size (recorded; used by the calibration).
        device_type: the device whose memory is traced; default: the parameters' device.

    The forward ends at the first op run by the autograd engine; the optimizer phase starts at the
    first ``Optimizer.step``. Several micro-batches in one ``step_fn`` read as one forward (the
    first). The result has no ``calibration`` (:func:`~.korthikanti.calibrate` adds it).
    """
    if not callable(step_fn):
        raise ValueError(f"`step_fn` must be callable with no arguments, got {step_fn!r}")
    check_int("seq_len", seq_len)
    check_int("batch_size", batch_size)
    params = list(dict.fromkeys(model.parameters()))
    if device_type is None:
        device_type = params[0].device.type if params else "cpu"
    infos = module_infos(model)
    scope = ModuleScope(infos, model, device_type)
    tracker = _BreakdownTracker(device_type, seq_len, scope)
    owner = _parameter_owners(model, infos)
    optimizers: list[torch.optim.Optimizer] = [optimizer] if optimizer is not None else []
    num_existing = _track_existing(tracker, params, optimizers, existing, owner)
    grad_of = _run_step(step_fn, tracker, scope, params, optimizers)
    records = _assign_kinds(tracker, optimizers, grad_of, owner, num_existing)
    alive_at_peak, peak_phase, peak_index = _peak_moment(tracker, len(records))
    by_part, by_module, activations = _sums(records, alive_at_peak)
    layer_bytes = [sum(r.nbytes for r in records
                       if r.kind == "activations" and is_inside(r.module, bp))
                   for bp in block_paths_of(model)]
    return Breakdown(
        seq_len=seq_len, batch_size=batch_size, peak_bytes=int(tracker.peak_bytes),
        peak_phase=peak_phase,
        peak_op=records[peak_index].op if peak_index >= 0 and records else "",
        start_bytes=int(sum(r.nbytes for r in records[:num_existing])),
        peak_by_part=by_part, peak_by_module=by_module, activation_by_category=activations,
        layer_activation_bytes=layer_bytes,
        autocast_dtype=(str(scope.autocast_dtype).replace("torch.", "")
                        if scope.autocast_dtype else None),
        attention_backend=current_attention_backend(model), checkpointed=is_checkpointed(model),
        tensors=records, alive_at_peak=alive_at_peak, peak_index=peak_index if records else -1)
