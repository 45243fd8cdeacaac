"""Dry runs of a deep stack of identical blocks, answered from dry runs of a few shallow copies.

A fake step costs time per op, and ``seqmem plan --longest`` asks hundreds of questions.
:func:`depth_dry_run_step`, :func:`depth_sharded_dry_run_step` and
:func:`depth_sequence_parallel_dry_run_step` take the arguments of the dry run each names, raise as
it does and give its figures from dry runs of shallow copies (:mod:`.stack`):

* **Proof, once per setting** (:mod:`.repetition`): copies of 1, 2 and 3 blocks (2, 3, 4 under
  FSDP2, whose next-to-last block prefetches the last) whose allocation sequences (:mod:`.pumping`)
  differ by *insertions* alone, the deepest being the base's with those insertions twice; a
  host-side trace pumps alike, every other figure is affine in the block count. A ``"<rung>:k/N"``
  rung is fitted in two counts (leveled, plain) from copies at ``"<rung>:c/(c+p)"``.
* **Each question**: one shallow dry run at the length asked, each block's chunk repeated to full
  depth and the peaks replayed (:func:`.step.replay_peaks`), following a peak that moves phase.
  Where a length lays allocations out anew (a tiled MLP), a one-kind family is reproved
  (:func:`.repetition.reprove`), others in full.

Assumed: blocks past the deepest copy behave as the copied ones (attributes, parameters, hooks and
an HF config's per-layer lists are compared). Else the full dry run answers, the reason in
``detail`` (``"; full depth: ..."``), as it does when no single repeated stack is found, the proof
fails or a copy cannot be dry-run; fewer than 4 blocks (5 with ``k/N``) are dry-run whole. Cached
per model state, batch and arguments (:func:`clear_depth_cache`); models and optimizers held weakly.

Example:
    >>> import torch
    >>> from lightning_seqmem.reference.demo import LitGPT
    >>> from lightning_seqmem.dryrun.step import dry_run_step
    >>> model = LitGPT(n_layer=6, d_model=32, n_head=2, attention="sdpa")
    >>> tokens = torch.zeros(2, 16, dtype=torch.long)
    >>> batch = {"input_ids": tokens, "labels": tokens}
    >>> deep = depth_dry_run_step(model, None, batch, 256)
    >>> full = dry_run_step(model, None, batch, 256)
    >>> (deep.peak_bytes, deep.phase_peak_bytes) == (full.peak_bytes, full.phase_peak_bytes)
    True
    >>> deep.detail.split(" (")[0]
    'depth-extrapolated: 6 blocks from a dry run of a copy of 2'
"""

from __future__ import annotations

import dataclasses
import inspect
import time
import weakref
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
from torch import nn

from lightning_seqmem.core.checks import check_int
from lightning_seqmem.core.peak import PeakSite
from lightning_seqmem.dryrun.repetition import (Family, Proof, extrapolate, plus, prove, reprove,
                                                words)
from lightning_seqmem.dryrun.result import DryRunResult, DryRunUnsupported, reason_of
from lightning_seqmem.dryrun.stack import (blocks_differ, find_stack, shallow_copy,
                                           shallow_optimizer, state_key)
from lightning_seqmem.dryrun.cuda import allocator_block_bytes
from lightning_seqmem.dryrun.fake import check_module
from lightning_seqmem.dryrun.step import checked_rungs, dry_run_step, simulated_device_for

__all__ = ["clear_depth_cache", "depth_dry_run_step", "depth_sequence_parallel_dry_run_step",
           "depth_sharded_dry_run_step"]

_RUNS_KEPT = 160  # shallow dry runs kept per context (a plan makes about 100)
_CONTEXTS_KEPT = 6  # contexts kept (model states, batches, argument sets), the latest used
_PLAIN = (type(None), bool, int, float, str, torch.device, torch.dtype)
_VARYING = ("seq_len", "mitigations", "site")  # what differs between the questions of a context
_COPY_FAILED = "a shallow copy's dry run failed: "


@dataclasses.dataclass
class _Call:
    """One question: the runner, its arguments (the model under ``module_arg``), its rounding."""

    runner: Callable[..., DryRunResult]
    module_arg: str
    args: dict[str, Any]
    block_bytes: int  # the allocator's rounding, as the runner replays its trace
    optimizer_arg: Optional[str] = None

    @property
    def module(self) -> nn.Module:
        return self.args[self.module_arg]

    def shallow(self, stack: nn.ModuleList, depth: int, names: tuple[str, ...], seq_len: int,
                site: Any) -> DryRunResult:
        """The dry run of a copy of the first ``depth`` blocks with ``names`` at ``seq_len``."""
        clone = shallow_copy(self.module, stack, depth)
        args = {**self.args, self.module_arg: clone, "mitigations": names, "seq_len": seq_len}
        if self.optimizer_arg is not None:
            args[self.optimizer_arg] = shallow_optimizer(self.args[self.optimizer_arg], clone)
        if "site" in args:
            args["site"] = site
        return self.runner(**args)

    def full(self, why: str = "") -> DryRunResult:
        """The full dry run, ``why`` it answers added to its detail."""
        result = self.runner(**self.args)
        if not why:
            return result
        return dataclasses.replace(result, detail=f"{result.detail}; full depth: {why}")


def _held(value: Any) -> Any:
    """How a context holds an argument: plain values and bound methods (fetched anew each time)
    as values, modules and optimizers weakly, others as given."""
    values = value if isinstance(value, tuple) else (value,)
    if all(isinstance(v, _PLAIN) for v in values) or inspect.ismethod(value):
        return ("value", value)
    if isinstance(value, (nn.Module, torch.optim.Optimizer)) or hasattr(value, "_optimizer"):
        return ("weak", weakref.ref(value))
    return ("same", value)


def _holds(held: Any, value: Any) -> bool:
    how, kept = held
    if how == "value":
        return type(kept) is type(value) and kept == value
    return (kept() if how == "weak" else kept) is value


class _Context:
    """The shallow dry runs, proofs and block check of one model state, batch and argument set."""

    def __init__(self, call: _Call, stack: nn.ModuleList, state: tuple,
                 differ: Optional[str]) -> None:
        self.runner, self.state, self.differ = call.runner, state, differ
        self.held = {k: _held(v) for k, v in call.args.items() if k not in _VARYING}
        self.blocks = len(stack)
        self.runs: dict[tuple, DryRunResult] = {}
        self.proofs: dict[tuple, Any] = {}  # family names -> Proof, or why none holds

    def matches(self, call: _Call, state: tuple) -> bool:
        return (self.runner is call.runner and self.state == state
                and set(self.held) == set(call.args) - set(_VARYING)
                and all(_holds(h, call.args[k]) for k, h in self.held.items()))

    def run(self, call: _Call, stack: nn.ModuleList, family: Family, seq_len: int,
            site: Any = None) -> Callable[[tuple], DryRunResult]:
        """``vector -> the dry run of a copy of that many blocks at seq_len`` (cached)."""
        def one(vector: tuple) -> DryRunResult:
            names = family.names_at(vector)
            key = (names, sum(vector), seq_len, site)
            if key not in self.runs:
                if len(self.runs) >= _RUNS_KEPT:
                    self.runs.pop(next(iter(self.runs)))
                self.runs[key] = call.shallow(stack, sum(vector), names, seq_len, site)
            if self.runs[key].events is None:
                raise DryRunUnsupported("the shallow copy's dry run kept no trace of its step")
            return self.runs[key]
        return one


_CONTEXTS: list[_Context] = []


def clear_depth_cache() -> None:
    """Forget every cached shallow dry run and proof."""
    _CONTEXTS.clear()


def _context(call: _Call, stack: nn.ModuleList) -> _Context:
    state = state_key(call.module, stack)
    for i, context in enumerate(_CONTEXTS):
        if context.matches(call, state):
            _CONTEXTS.append(_CONTEXTS.pop(i))
            return context
    context = _Context(call, stack, state, blocks_differ(stack, call.module))
    _CONTEXTS.append(context)
    del _CONTEXTS[:-_CONTEXTS_KEPT]
    return context


def _site(run: Callable[[tuple], DryRunResult], proof: Proof, target: tuple,
          result: DryRunResult) -> Optional[PeakSite]:
    """``peak_site`` at depth: each kind's bytes extrapolated from traced copies (the question's,
    one more block per kind) if phase and op agree and the kinds sum to the peak; else None."""
    first = plus(proof.base, *range(len(proof.base)))
    traced = [run(v) for v in [first, *(plus(first, k) for k in range(len(first)))]]
    sites = [r.peak_site for r in traced]
    if any(s is None for s in sites) or len({(s.phase, s.op) for s in sites}) != 1:
        return None
    kinds = [dict(s.top_kinds) for s in sites]
    deep = {kind: kinds[0].get(kind, 0) + sum((n - f) * (k.get(kind, 0) - kinds[0].get(kind, 0))
                                              for n, f, k in zip(target, first, kinds[1:]))
            for kind in set().union(*kinds)}
    gaps = {s.peak_bytes - r.peak_bytes for s, r in zip(sites, traced)}
    if min(deep.values(), default=0) < 0 or len(gaps) != 1:
        return None
    if sum(deep.values()) - result.peak_bytes not in gaps:
        return None
    return PeakSite.of(sites[0].phase, deep, sites[0].op)


def _extrapolated(call: _Call, context: _Context, stack: nn.ModuleList, family: Family,
                  target: tuple) -> tuple[Any, Optional[DryRunResult]]:
    """``(proof or why none holds, result at depth or None)``, reproved as :func:`_proved` says."""
    seq_len, block = call.args["seq_len"], call.block_bytes
    run = context.run(call, stack, family, seq_len)
    for again in (False, True):
        if again or family.names not in context.proofs:
            before = context.proofs.get(family.names) if again else None
            context.proofs[family.names] = _proved(run, family, seq_len, block, before)
        proof = context.proofs[family.names]
        if not isinstance(proof, Proof):
            return proof, None
        result = extrapolate(run, proof, target, block)
        if result is not None:
            return proof, result
    return "the layout of the allocations changed with the length", None


def _proved(run: Callable[[tuple], DryRunResult], family: Family, seq_len: int, block: int,
            before: Any) -> Any:
    """The proof at ``seq_len`` (``before`` reproved if at another length), or why none holds."""
    try:
        if isinstance(before, Proof) and before.seq_len != seq_len:
            again = reprove(run, before, seq_len, block)
            if isinstance(again, Proof):
                return again
        return prove(run, family, seq_len, block)
    except Exception as exc:  # noqa: BLE001 - kept: the family's questions go to the full run
        return _COPY_FAILED + reason_of(exc)


def _answer(call: _Call) -> DryRunResult:
    """The call answered from shallow copies where the repetition is proved, else in full."""
    started = time.perf_counter()
    check_int("seq_len", call.args["seq_len"])
    names = checked_rungs(call.args["mitigations"])
    check_module(call.module)
    stack, why = find_stack(call.module)
    if stack is None:
        return call.full(f"not depth-extrapolated: {why}")
    family = Family.of(names)
    try:
        target = family.counts(names, len(stack))
    except ValueError as exc:
        return call.full(f"not depth-extrapolated: {exc}")
    if min(target) < 1 or sum(target) < 3 + len(target):
        return call.full()  # a stack this shallow costs no more than its copies
    context = _context(call, stack)
    if context.differ:
        return call.full(f"not depth-extrapolated: {context.differ}")
    seq_len, site = call.args["seq_len"], call.args.get("site")
    try:
        proof, result = _extrapolated(call, context, stack, family, target)
        if result is None:
            return call.full(f"not depth-extrapolated: {proof}")
        traced = None if site is None else context.run(call, stack, family, seq_len, site)
        peak_site = None if traced is None else _site(traced, proof, target, result)
    except Exception as exc:  # noqa: BLE001 - the full dry run answers (or raises) as it would
        return call.full(f"not depth-extrapolated: {_COPY_FAILED}{reason_of(exc)}")
    runs = proof.runs()
    copy = context.run(call, stack, family, seq_len)(runs[-1])
    copies = (f"a dry run of a copy of {words(runs[0])}" if len(runs) == 1 else
              f"dry runs of copies of {', '.join(words(v) for v in runs)}")
    detail = (f"depth-extrapolated: {len(stack)} blocks from {copies}"
              + f" (each block's allocations repeated, the repetition checked on {proof.says()}"
              + ("; the peak site extrapolated from traced copies" if peak_site is not None else "")
              + f"); the copy of {words(runs[-1])}: {copy.detail}")
    return dataclasses.replace(result, mitigations=names, seconds=time.perf_counter() - started,
                               detail=detail, peak_site=peak_site)


# -- the public doors -----------------------------------------------------------------------------
def depth_dry_run_step(
    pl_module: nn.Module, optimizer: Optional[Any], batch: Any, seq_len: int,
    batch_size: Optional[int] = None, mitigations: Sequence[str] = (),
    autocast: Optional[Callable[[], ContextManager[Any]]] = None,
    device: Optional[torch.device | str] = None, site: Optional[Callable[..., Any]] = None,
    **kwargs: Any,
) -> DryRunResult:
    """:func:`.step.dry_run_step` answered from shallow copies where the blocks repeat; ``detail``
    says how, ``seconds`` what this call took; ``peak_site`` extrapolated, or None."""
    args = dict(pl_module=pl_module, optimizer=optimizer, batch=batch, seq_len=seq_len,
                batch_size=batch_size, mitigations=mitigations, autocast=autocast, device=device,
                site=site, **kwargs)
    first = next(iter(pl_module.parameters()), None) if isinstance(pl_module, nn.Module) else None
    simulated = simulated_device_for(device, torch.device("cpu") if first is None else first.device)
    block = allocator_block_bytes(simulated)
    return _answer(_Call(dry_run_step, "pl_module", args, block, "optimizer"))


def depth_sharded_dry_run_step(
    template: nn.Module, batch: Any, seq_len: int, world_size: int,
    batch_size: Optional[int] = None, mitigations: Sequence[str] = (), strategy: str = "fsdp2",
    autocast: Optional[Callable[[], ContextManager[Any]]] = None,
    device: Optional[torch.device | str] = None, first_split_check: Optional[bool] = None,
    **kwargs: Any,
) -> DryRunResult:
    """:func:`.sharded.sharded_dry_run_step` answered from shallow copies; ``detail`` says how."""
    from lightning_seqmem.dryrun.sharded import sharded_dry_run_step

    args = dict(template=template, batch=batch, seq_len=seq_len, world_size=world_size,
                batch_size=batch_size, mitigations=mitigations, strategy=strategy,
                autocast=autocast, device=device, first_split_check=first_split_check, **kwargs)
    block = allocator_block_bytes(torch.device("cpu" if device is None else device))
    return _answer(_Call(sharded_dry_run_step, "template", args, block))


def depth_sequence_parallel_dry_run_step(
    template: nn.Module, batch: Any, seq_len: int, world_size: int, degree: int, kind: str,
    batch_size: Optional[int] = None, mitigations: Sequence[str] = (),
    autocast: Optional[Callable[[], ContextManager[Any]]] = None, device: Any = None,
    **kwargs: Any,
) -> DryRunResult:
    """:func:`.sequence_parallel.sequence_parallel_dry_run_step` answered from shallow copies."""
    from lightning_seqmem.dryrun.sequence_parallel import sequence_parallel_dry_run_step

    args = dict(template=template, batch=batch, seq_len=seq_len, world_size=world_size,
                degree=degree, kind=kind, batch_size=batch_size, mitigations=mitigations,
                autocast=autocast, device=device, **kwargs)
    block = allocator_block_bytes(torch.device("cpu" if device is None else device))
    return _answer(_Call(sequence_parallel_dry_run_step, "template", args, block))
