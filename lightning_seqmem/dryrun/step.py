"""Dry run: the peak memory of one training step at any length, without allocating it.

:func:`dry_run_step` runs the module's own ``training_step``, backward and optimizer step on a
*fake* copy of module and optimizer (``FakeTensorMode``: shapes, dtypes, devices and storages, no
data): a step at 32k tokens costs about as much as at 64 and runs the real program at that length
(kernels chosen by length, masks built in the model), nothing extrapolated.
:class:`~lightning_seqmem.measure.probes.LiveTensorTracker` counts the storages through
:func:`.steps.training_step_memory` (Lightning's phases), as in a real run's step after its first: a
step's gradients and optimizer state (:func:`state_after_a_step`), parameters, buffers and the batch
exist; each phase's peak is the live bytes' maximum within it. On CUDA allocations round to 512-byte
blocks (:func:`allocator_block_bytes`), kernels' own buffers come through the tracker's ``scratch``
hook (:func:`cuda_kernel_scratch_bytes`) and the simulated device's kernels are modelled from their
sources (:mod:`.kernels`); not modelled: fragmentation, cuBLAS/cuDNN workspaces, CUDA context.

Mitigations (rung names) go on the copy only (their ``apply_to_copy``); micro-batching runs the step
as :mod:`.microbatch.microbatch` does (every micro-batch but the last backpropagated in the
``forward`` phase). Values a step reads from its batch alone are known (:class:`BatchValues`); one
reading an activation's values (``loss.item()``) or shapes depending on them raises
:class:`DryRunUnsupported`. The real module, optimizer and RNGs are untouched; the copy keeps each
submodule's train/eval mode. transformers' fake-tensor check is off process-wide
(:func:`transformers_without_fake_detection`): no dry run beside a thread tracing an HF model.

The step API of every dry run (:mod:`.sharded` too): :func:`check_module`,
:func:`configured_optimizer`, :func:`state_after_a_step`, :func:`unsupported_reason`,
:func:`transformers_without_fake_detection` and :func:`.step_functions.step_functions`.

Example:
    >>> import torch
    >>> import torch.nn.functional as F
    >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
    >>> class LM(torch.nn.Module):  # a LightningModule in practice; training_step is what runs
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.gpt = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, attention="eager"))
    ...     def training_step(self, batch, batch_idx):
    ...         logits = self.gpt(batch["input_ids"])
    ...         return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    >>> model = LM()
    >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    >>> batch = {"input_ids": torch.randint(0, 256, (2, 16)),
    ...          "labels": torch.randint(0, 256, (2, 16))}
    >>> eager = dry_run_step(model, optimizer, batch, seq_len=4096)  # 16 tokens tiled to 4096
    >>> sdpa = dry_run_step(model, optimizer, batch, seq_len=4096, mitigations=["attention"])
    >>> eager.peak_bytes > 8 * sdpa.peak_bytes  # the 4096 x 4096 attention scores
    True
    >>> phases = eager.phase_peak_bytes
    >>> [p for p in phases], eager.peak_bytes == max(phases.values())
    (['forward', 'backward', 'optimizer'], True)
    >>> untouched = all(p.grad is None for p in model.parameters())
    >>> model.gpt.attention_backend, untouched, len(optimizer.state)
    ('eager', True, 0)
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
from collections import OrderedDict
import traceback
from typing import Any, Callable, ContextManager, NamedTuple, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                           DynamicOutputShapeException, FakeTensor, FakeTensorMode,
                                           UnsupportedOperatorException)

from lightning_seqmem.measure.batch_shape import infer_batch_shape
from lightning_seqmem.core.checks import check_int
from lightning_seqmem.mitigations import ladder
from lightning_seqmem.mitigations.base import CopyPlan
from lightning_seqmem.mitigations.activation_offload.activation_offload import (
    offloaded_bytes, reset_offloaded_bytes)
from lightning_seqmem.core.rungs import check_mitigations
from lightning_seqmem.measure.steps import training_step_memory, validation_step_memory
from lightning_seqmem.core.records import PHASES, TrackedEvents
from lightning_seqmem.measure.probes import existing_tensors, make_probe, optimizer_held_tensors

__all__ = ["checked_rungs", "dry_run_step", "held_state", "host_peaks", "replay_peaks",
           "simulated_device_for", "state_after_a_step", "state_as_held", "unsupported_reason"]

from lightning_seqmem.dryrun.cuda import (allocator_block_bytes, cuda_kernel_scratch_bytes,
                                          resident_bytes, warm_cuda_workspaces)
from lightning_seqmem.dryrun.fake import (check_module, configured_optimizer, fake_copy,
                                          rebuild_optimizer, resolve_foreach, unwrap_optimizer)
from lightning_seqmem.dryrun.result import DryRunResult, DryRunUnsupported
from lightning_seqmem.dryrun.accelerator import (contained_unpack_failures, simulated_device,
                                                 stands_for)
from lightning_seqmem.dryrun.host import host_detail, host_events, with_host_probe
from lightning_seqmem.dryrun.kernels_scratch import CUDA_TARGET, recording
from lightning_seqmem.dryrun.values import BatchValues, transformers_without_fake_detection
from lightning_seqmem.dryrun.session import fake_batch, fake_session
from lightning_seqmem.dryrun.moe import routing_note
from lightning_seqmem.dryrun.step_functions import step_functions


def replay_peaks(events: TrackedEvents, block_bytes: int = 1) -> tuple[int, dict[str, int]]:
    """``(peak, phase -> peak)`` of a traced step, allocations rounded up to ``block_bytes`` (1: as
    the tracker counted; 512: as CUDA's caching allocator reports, 1 byte -> 512, 513 -> 1024).

    Example:
        >>> ev = TrackedEvents(sizes=[1000, 1, 513], sequence=[0, 1, ~1, 2],
        ...                    phase_starts={"forward": 1, "backward": 3})
        >>> replay_peaks(ev)
        (1513, {'forward': 1001, 'backward': 1513})
        >>> replay_peaks(ev, block_bytes=512)
        (2048, {'forward': 1536, 'backward': 2048})
    """
    check_int("block_bytes", block_bytes)
    sizes = [-(-n // block_bytes) * block_bytes for n in events.sizes]
    starts: dict[int, list[str]] = {}
    for name, position in sorted(events.phase_starts.items(), key=lambda kv: kv[1]):
        starts.setdefault(position, []).append(name)  # phases with no event between them share one
    live = peak = 0
    phase: Optional[str] = None
    phase_peaks: dict[str, int] = {}

    def begin(position: int) -> Optional[str]:
        current = phase
        for name in starts.get(position, ()):
            phase_peaks[name] = max(phase_peaks.get(name, 0), live)
            current = name
        return current

    for position, entry in enumerate(events.sequence):
        phase = begin(position)
        live += sizes[entry] if entry >= 0 else -sizes[~entry]
        peak = max(peak, live)
        if phase is not None and live > phase_peaks[phase]:
            phase_peaks[phase] = live
    for position in starts:  # phases that began after the last event
        if position >= len(events.sequence):
            begin(position)
    return peak, phase_peaks


def host_peaks(memory: Any, pinned_blocks: bool = True) -> tuple[int, dict[str, int]]:
    """``(peak, phase -> peak)`` of the host side of a dry run's step (its ``StepMemory``, events
    recorded; :mod:`.host`): each pinned block rounded up to a power of two (``pinned_blocks``);
    0 and ``{}`` without a host side (a dry run of the CPU).

    Example:
        >>> host_peaks(None)
        (0, {})
    """
    events = host_events(memory, pinned_blocks)
    if events is None:
        return 0, {}
    peak, phases = replay_peaks(events)
    return peak, {p: phases[p] for p in PHASES if p in phases}


# -- the step -------------------------------------------------------------------------------------
def _user_frame(tb: Any) -> str:
    """``file:line in function`` of the innermost frame outside torch and this package, or ''."""
    skip = ("/torch/", "/lightning_seqmem/dryrun/", "/lightning_seqmem/measure/",
            "/lightning_seqmem/mitigations/")
    frames = [f for f in traceback.extract_tb(tb)
              if not any(s in f.filename.replace("\\", "/") for s in skip)]
    if not frames:
        return ""
    f = frames[-1]
    return f" (at {f.filename}:{f.lineno} in {f.name}: `{(f.line or '').strip()}`)"


def unsupported_reason(exc: BaseException) -> str:
    """Why a fake step failed (the user's line where known), as a :class:`DryRunUnsupported` reason.

    Example:
        >>> unsupported_reason(ValueError("no such head"))
        'the fake step failed: ValueError: no such head'
    """
    where = _user_frame(exc.__traceback__)
    if isinstance(exc, DataDependentOutputException):
        return (
            f"an op reads tensor values ({exc.func}; e.g. `.item()`, `.tolist()` or `if tensor:` "
            f"on a value computed in the step), which fake tensors do not have{where}"
        )
    if isinstance(exc, DynamicOutputShapeException):
        return (
            f"an op's output shape depends on tensor values ({exc.func}; e.g. `nonzero`, "
            f"boolean-mask indexing, `unique`), which fake tensors do not have{where}"
        )
    if isinstance(exc, UnsupportedOperatorException):
        return f"op {exc.func} has no fake (meta) kernel{where}"
    return f"the fake step failed: {type(exc).__name__}: {exc}{where}"


def _device_of(module: nn.Module) -> torch.device:
    first = next(iter(module.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def _fake_module_and_optimizer(
    pl_module: nn.Module, optimizer: Any, names: tuple[str, ...], device: torch.device,
    fake_mode: FakeTensorMode, values: "BatchValues",
) -> tuple[nn.Module, torch.optim.Optimizer, CopyPlan]:
    """The fake copy on ``device`` with the asked rungs, its optimizer, and what its step is."""
    notes: list[str] = []
    model = fake_copy(pl_module, fake_mode, values, device)  # every tensor on the simulated device
    if device != _device_of(pl_module) and _device_of(pl_module).type != "meta":
        notes.append(f"moved {_device_of(pl_module)} -> {device}")
    with fake_mode:
        twins = {id(real): fake for real, fake in zip(pl_module.parameters(), model.parameters())}
        fake_optimizer = (configured_optimizer(model) if optimizer is None
                          else rebuild_optimizer(optimizer, twins))
        resolve_foreach(fake_optimizer, device, pl_module.parameters())
        values.let_step_read(fake_optimizer)
        plan = ladder.apply_to_copy(names, model)  # after the optimizer: rungs keep the parameters
    plan.notes[:0] = notes
    return model, fake_optimizer, plan


def state_after_a_step(model: nn.Module, optimizer: Any) -> None:
    """Gradients and optimizer state as a first step leaves them: a zero gradient per trainable
    parameter, then one optimizer step; half a warm-up step's cost, the same storages alive.

    Example:
        >>> lin = nn.Linear(2, 2)
        >>> optimizer = torch.optim.AdamW(lin.parameters())
        >>> state_after_a_step(lin, optimizer)
        >>> lin.weight.grad.abs().sum().item(), sorted(optimizer.state[lin.weight])
        (0.0, ['exp_avg', 'exp_avg_sq', 'step'])
    """
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    key = _state_key(optimizer)
    layout = _STATE_LAYOUTS.get(key) if key is not None else None
    if layout is not None:  # the state this step made last time, made again without the step
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for p, entries in zip(params, layout):
            if entries:
                optimizer.state[p] = {k: torch.empty_strided(v[1], v[2], dtype=v[3], device=v[4])
                                      if v[0] else copy.deepcopy(v[1]) for k, v in entries.items()}
        return
    groups = {id(g): (g, g["foreach"]) for g in optimizer.param_groups
              if "foreach" in g and not g["foreach"] and not g.get("fused")}
    for group, _ in groups.values():  # only its state counts: foreach makes it in fewer ops
        group["foreach"] = True
    try:
        optimizer.step()
    except Exception:  # noqa: BLE001 - an optimizer without foreach kernels: its own loop
        if not groups:
            raise
        optimizer.state.clear()
        for group, _ in groups.values():
            group["foreach"] = False
        optimizer.step()
    for group, given in groups.values():  # None stays None: a sharded (DTensor) step resolves it
        group["foreach"] = given
    if key is not None and key == _state_key(optimizer):
        with contextlib.suppress(Exception):  # a state it cannot record: it steps each time
            _STATE_LAYOUTS[key] = _state_layout(optimizer)
        while len(_STATE_LAYOUTS) > 64:
            _STATE_LAYOUTS.popitem(last=False)


_STATE_LAYOUTS: "OrderedDict[tuple, Optional[list]]" = OrderedDict()
"""(optimizer class, groups, parameter specs) -> each parameter's state as a first step left it:
``{key: (True, shape, stride, dtype, device) or (False, value)}``; None where it must step."""


def _state_key(optimizer: Any) -> Optional[tuple]:
    """What a first step's state depends on; None for parameters not plain fakes (DTensor)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not all(type(p) is FakeTensor for p in params):
        return None
    with contextlib.suppress(Exception):  # options without a repr: no layout, a step each time
        groups = tuple(repr(sorted((k, v) for k, v in g.items() if k != "params"))
                       + f"/{len(g['params'])}" for g in optimizer.param_groups)
        return (type(optimizer), groups, tuple((tuple(p.shape), p.stride(), p.dtype, p.device,
                                                p.requires_grad) for p in params))
    return None


def _state_layout(optimizer: Any) -> Optional[list]:
    """:data:`_STATE_LAYOUTS`' entry of ``optimizer`` after its first step: None where a state
    tensor shares or overruns its storage, or the optimizer holds tensors outside its state."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    known, storages, out = {id(p) for p in params}, {p.untyped_storage()._cdata for p in params}, []
    for p in params:
        entries = {}
        for k, v in optimizer.state.get(p, {}).items():
            if not isinstance(v, torch.Tensor):
                entries[k] = (False, copy.deepcopy(v))
                continue
            st = v.untyped_storage()
            if (type(v) is not FakeTensor or v.requires_grad or v.storage_offset()
                    or st.nbytes() != v.numel() * v.element_size() or st._cdata in storages):
                return None
            known.add(id(v))
            storages.add(st._cdata)
            entries[k] = (True, tuple(v.shape), v.stride(), v.dtype, v.device)
        out.append(entries)
    if any(id(t) not in known for t in optimizer_held_tensors(optimizer)):
        return None
    return out


def held_state(pl_module: nn.Module, optimizer: Any) -> tuple[bool, bool]:
    """``(gradients alive, optimizer state made)`` on ``pl_module`` now: what a validation step
    runs beside. A fit zeroes the gradients before validation (but inside an accumulation window)
    and the sanity check runs before any step; without ``optimizer``, a fit's after a step.

    >>> lin = nn.Linear(2, 2)
    >>> held_state(lin, torch.optim.AdamW(lin.parameters())), held_state(lin, None)
    ((False, False), (False, True))
    """
    real = None if optimizer is None else unwrap_optimizer(optimizer)
    return (any(p.grad is not None for p in pl_module.parameters()),
            real is None or bool(real.state))


def state_as_held(model: nn.Module, optimizer: Any, held: Optional[tuple[bool, bool]]) -> None:
    """Gradients and optimizer state on ``model`` as ``held`` (:func:`held_state`) says; None: a
    training step's (:func:`state_after_a_step`)."""
    grads, stepped = held or (True, True)
    if stepped:
        state_after_a_step(model, optimizer)
    for p in model.parameters() if held else ():  # (first window: no step yet)
        p.grad = (None if not grads else p.grad if p.grad is not None or not p.requires_grad
                  else torch.zeros_like(p))


SiteTracer = Callable[..., Any]
"""``(step_fn, model, optimizer, existing, *, seq_len, batch_size, device_type) -> PeakSite``:
traces the step ``step_fn`` runs (:func:`.peak_trace.trace_peak_site`)."""


def _measured_step(model: nn.Module, optimizer: Any, step_optimizer: Any, batch: Any, loss_fn: Any,
                   probe: Any, autocast: Any, site: Optional[SiteTracer], seq_len: int,
                   batch_size: int, device: torch.device,
                   evaluate: bool = False) -> tuple[Any, Any]:
    """``(StepMemory, PeakSite or None)`` of the measured fake step (``evaluate``:
    ``validation_step``), traced by ``site`` if given (its probe counts the same storages)."""
    def step() -> Any:
        if evaluate:
            return validation_step_memory(model, optimizer, batch, probe, autocast)
        return training_step_memory(model, step_optimizer, batch, loss_fn, probe,
                                    record_events=True, context=autocast)

    if site is None:
        return step(), None
    box: list[Any] = []
    existing = list(model.buffers()) + [t for t in tree_flatten(batch)[0]
                                        if isinstance(t, torch.Tensor)]
    try:
        found = site(lambda: box.append(step()), model, optimizer, existing, seq_len=seq_len,
                     batch_size=batch_size, device_type=device.type)
    except Exception:  # noqa: BLE001 - the site is an extra: the step's peak stands without it
        if not box:
            raise
        found = None
    return box[0], found


def dry_run_step(
    pl_module: nn.Module, optimizer: Optional[Any], batch: Any, seq_len: int,
    batch_size: Optional[int] = None, mitigations: Sequence[str] = (),
    autocast: Optional[Callable[[], ContextManager[Any]]] = None,
    device: Optional[torch.device | str] = None, site: Optional[SiteTracer] = None,
    evaluate: bool = False,
) -> DryRunResult:
    """Peak memory of one training step of ``pl_module`` at ``(seq_len, batch_size)``.

    Args:
        pl_module: its ``training_step(batch, batch_idx)`` returns a loss or ``{"loss": ...}``.
        optimizer: the optimizer training it (or Lightning's wrapper); a fresh one of the same
            class and param-group hyperparameters is built over the copy. ``None``: the copy's
            own ``configure_optimizers()`` (its first optimizer).
        batch: a training batch, cut or tiled to ``(batch_size, seq_len)`` (:func:`shape_batch`);
            any length will do, values do not matter.
        seq_len: tokens per sample of the step to simulate.
        batch_size: samples in the step; ``None``: the batch's own.
        mitigations: rung names or variants (``"checkpointing:3/8"``) applied to the copy.
            ``"activation_offload"``: ``host_bytes`` modelled on the CPU; on an accelerator
            ``save_on_cpu`` runs and its host copies are in ``host_peak_bytes``. A module already
            micro-batched is simulated with its micro-batch size.
        autocast: a zero-argument factory of the forward's context (the precision plugin's).
        device: the device to simulate; default that of the module's first parameter.
        site: a tracer of where the peak sits (:func:`.peak_trace.trace_peak_site`, handed in
            from above this wing): the result's ``peak_site``. A tracer that fails leaves it None.
        evaluate: the step is ``validation_step`` as a fit's validation loop runs it (eval mode, no
            gradients, one ``forward`` phase) beside the state held now (:func:`held_state`).

    Returns:
        a :class:`DryRunResult` of the measured step, after a first step's state (see the module).

    Raises:
        DryRunUnsupported: the module cannot run on fake tensors (the reason names the op and the
            user's line when known), is compiled, or uses manual optimization.
        ValueError, TypeError: bad arguments.
    """
    started = time.perf_counter()
    seq_len = check_int("seq_len", seq_len)
    names = checked_rungs(mitigations)
    check_module(pl_module)
    source_rows, _ = infer_batch_shape(batch)
    batch_size = source_rows if batch_size is None else check_int("batch_size", batch_size)
    module_device = _device_of(pl_module)
    device = simulated_device_for(device, module_device)
    step = _fake_step(pl_module, optimizer, batch, seq_len, batch_size, names, autocast, device,
                      site, evaluate)
    block = allocator_block_bytes(device)
    peak, phase_peaks = replay_peaks(step.memory.events, block)
    resident = _resident_bytes(pl_module, optimizer, batch, device, module_device)
    peak += resident
    phase_peaks = {p: phase_peaks[p] + resident for p in PHASES if p in phase_peaks}
    host, notes, modelled = step.host_bytes, step.notes, step.modelled_kernels
    host_peak, host_phase_peaks = host_peaks(step.host_memory)
    when = "beside the state held now" if evaluate else "after a zero-gradient optimizer step"
    detail = (
        f"a fake {'validation_step' if evaluate else 'step'} of {type(pl_module).__name__} on "
        f"{device} ({when}) with {step.optimizer_name}, batch {step.source_shape} -> "
        f"({batch_size}, {seq_len})"
        + (f"; {'; '.join(notes)}" if notes else "")
        + ("; live storages counted by LiveTensorTracker"
           f"{', 512-byte blocks' if block > 1 else ''}")
        + (f"; plus {resident} bytes the allocator holds outside the step's tensors"
           if resident else "")
        + (f"; {host} bytes of saved activations moved to host memory ("
           + ('modelled' if step.host_memory is None
              else 'save_on_cpu run, its host copies counted') + ")"
           if host else "")
        + f"; {host_detail(device, step.host_memory, host_peak)}"
        + (f"; kernels modelled for {CUDA_TARGET.name}: {', '.join(modelled)}"
           if modelled else "")
    )
    return DryRunResult(
        seq_len=seq_len, batch_size=batch_size, mitigations=names, peak_bytes=peak,
        phase_peak_bytes=phase_peaks, seconds=time.perf_counter() - started, detail=detail,
        resident_bytes=resident, host_bytes=host, peak_site=step.peak_site,
        host_peak_bytes=host_peak, host_phase_peak_bytes=host_phase_peaks,
        modelled_kernels=tuple(modelled), events=step.memory.events,
        host_events=host_events(step.host_memory),
    )


def checked_rungs(mitigations: Sequence[str]) -> tuple[str, ...]:
    """``mitigations`` checked as a dry run takes them: distinct rung names or variants, each a
    level its rung has (the rung's ValueError, before any work).

    Example:
        >>> checked_rungs(["attention", "checkpointing:1/2"])
        ('attention', 'checkpointing:1/2')
        >>> checked_rungs(["attention:2"])
        Traceback (most recent call last):
        ...
        ValueError: rung 'attention' has no levels, got level '2'
    """
    names = check_mitigations(list(mitigations), variants=True)
    for name in names:
        ladder.rung(name)  # a level the rung does not have: its ValueError, before any work
    return names


def simulated_device_for(device: Optional[torch.device | str],
                         module_device: torch.device) -> torch.device:
    """The device a dry run's fake step runs on: ``device``, default the module's (the CPU for a
    module on ``meta``); a bare ``cuda`` is the module's CUDA device (else ``cuda:0``); CUDA on a
    build without it is the simulated accelerator (:mod:`.accelerator`).

    Example:
        >>> cpu = torch.device("cpu")
        >>> simulated_device_for(None, torch.device("meta")), simulated_device_for("cpu", cpu)
        (device(type='cpu'), device(type='cpu'))
    """
    device = module_device if device is None else torch.device(device)
    if device.type == "meta":
        device = torch.device("cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        try:
            return simulated_device()
        except RuntimeError as exc:
            raise DryRunUnsupported("cannot simulate CUDA on this torch build without it: "
                                    f"{exc}") from None
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", module_device.index if module_device.type == "cuda" else 0)
    return device


class _FakeStep(NamedTuple):
    """What :func:`_fake_step` measured, for :func:`dry_run_step`'s result."""

    memory: Any  # the measured step's StepMemory, its events recorded
    peak_site: Any  # PeakSite, or None (not asked, or the tracer failed)
    host_bytes: int  # saved activations the step moved to host memory (modelled)
    notes: list[str]  # what the rungs did to the copy and the step
    optimizer_name: str  # the fake optimizer's class name
    source_shape: Any  # the batch's own (batch_size, seq_len)
    modelled_kernels: list[str]  # CUDA kernels modelled in the measured step (dryrun.kernels)
    host_memory: Any = None  # the host side's StepMemory (events recorded), where the host is apart


def _fake_step(pl_module: nn.Module, optimizer: Optional[Any], batch: Any, seq_len: int,
               batch_size: int, names: tuple[str, ...],
               autocast: Optional[Callable[[], ContextManager[Any]]], device: torch.device,
               site: Optional[SiteTracer], evaluate: bool = False) -> _FakeStep:
    """The measured fake step of :func:`dry_run_step` (its arguments checked); every failure of it
    raised as :class:`DryRunUnsupported` with the reason, the fake world freed first."""
    with fake_session(seq_len, device) as (fake_mode, values):
        try:
            model, fake_optimizer, plan = _fake_module_and_optimizer(pl_module, optimizer, names,
                                                                      device, fake_mode, values)
            notes = plan.notes
            step_batch, source_shape = fake_batch(batch, seq_len, batch_size, device, fake_mode,
                                                  values)
            loss_fn, step_optimizer = step_functions(pl_module, fake_optimizer, plan, batch_size)
            device_probe = make_probe("tracker", device)
            if stands_for(device) == "cuda":  # CUDA and the simulated device that stands for it
                device_probe.scratch = cuda_kernel_scratch_bytes
            probe = with_host_probe(device_probe, device)
            with fake_mode, values, transformers_without_fake_detection():
                state_as_held(model, fake_optimizer,
                              held_state(pl_module, optimizer) if evaluate else None)
                reset_offloaded_bytes(model)
                with recording() as modelled, contained_unpack_failures(device) as failures:
                    memory, peak_site = _measured_step(model, fake_optimizer, step_optimizer,
                                                       step_batch, loss_fn, probe, autocast, site,
                                                       seq_len, batch_size, device, evaluate)
                if failures:
                    raise failures[0]
            host = offloaded_bytes(model)
            notes += [note for note in [routing_note(values)] if note]  # what an MoE step assumed
        except DryRunUnsupported:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure of the fake run is a reason
            failure = unsupported_reason(exc)
            traceback.clear_frames(exc.__traceback__)  # its frames held the half-built fake world
            del exc
            model = fake_optimizer = step_batch = loss_fn = step_optimizer = probe = None
            device_probe = values = fake_mode = None
            gc.collect()  # its cycles (fake tensors, their mode, the tracker) freed now
            raise DryRunUnsupported(failure) from None
    assert memory is not None and memory.events is not None
    return _FakeStep(memory, peak_site, host, notes, type(fake_optimizer).__name__, source_shape,
                     modelled, getattr(probe, "host_memory", None))


def _resident_bytes(pl_module: nn.Module, optimizer: Optional[Any], batch: Any,
                    device: torch.device, module_device: torch.device) -> int:
    """Bytes the CUDA allocator holds outside the step's tensors (its workspaces warmed first),
    where the dry run simulates the CUDA device the module lives on; 0 elsewhere."""
    if not (device.type == "cuda" and module_device == device and torch.cuda.is_available()):
        return 0
    warm_cuda_workspaces(device)
    real_optimizer = None if optimizer is None else unwrap_optimizer(optimizer)
    return resident_bytes(device, existing_tensors(
        pl_module, [real_optimizer] if real_optimizer else [], batch))
