"""Dry run: the peak memory of one training step at any length, without allocating it.

:func:`dry_run_step` answers "what is the peak memory of one training step of this module at
``(seq_len, batch_size, mitigations)``?" by running the module's own ``training_step``, its
backward and its optimizer step on a *fake* copy of the module and optimizer under
:class:`torch._subclasses.fake_tensor.FakeTensorMode`. Fake tensors carry shapes, dtypes, devices
and storages but no data, so a step at 32k tokens costs about as much as one at 64 (well under a
second on the tiny models of this package), and the program that runs is the real one at that
length: kernels chosen by length, sliding windows, masks built in the model. Nothing is
extrapolated. The storages are counted by the same
:class:`~lightning_seqmem.measure.probes.LiveTensorTracker` that measures real steps, through
:func:`lightning_seqmem.measure.steps.training_step_memory` (Lightning's order: forward, ``zero_grad``,
backward, optimizer step).

What is counted, as in a real Lightning run after the first step:

* one un-measured fake step runs first, so the measured (second) step starts with the optimizer
  state allocated and the previous step's gradients alive during the forward (they are released
  by ``zero_grad(set_to_none=True)``, which Lightning calls after ``training_step``);
* parameters, buffers, gradients, optimizer state and the batch are counted as existing; the peak
  of each phase (``forward``, ``backward``, ``optimizer``) is the live bytes' maximum within it;
* on CUDA every allocation is rounded up to the caching allocator's 512-byte block, as
  ``torch.cuda.max_memory_allocated`` counts it (:func:`allocator_block_bytes`), and the buffers
  kernels hold for themselves are counted through the tracker's ``scratch`` hook
  (:func:`cuda_kernel_scratch_bytes`). Not modelled: allocator fragmentation / reserved memory,
  cuBLAS/cuDNN workspaces, CUDA context;
* on the simulated CUDA device of a CPU-only build, the CUDA kernels the run uses (SDPA's backends,
  flash-attn, Cut Cross-Entropy, Liger) are modelled from their sources (:mod:`.kernels`); the
  result's ``modelled_kernels`` and ``detail`` name those that ran.

Candidate mitigations (rung names, :func:`lightning_seqmem.mitigations.rung_names`) are
applied to the copy only, each by its rung's ``apply_to_copy``
(:class:`~lightning_seqmem.mitigations.base.Rung`): the attention switch and activation
checkpointing change the copy; micro-batching changes the step (micro-batches of one sample, each loss weighted by its share of what the loss
averages over and backpropagated on its own, one optimizer step, as
:mod:`lightning_seqmem.mitigations.microbatch.microbatch` runs it: the gradients are zeroed before the first
micro-batch, every micro-batch but the last is backpropagated inside the ``forward`` phase, the
last one in ``backward``; the wrapper's one-time check of its first split batch is not included).

Fake tensors have no values, but the values a step reads from its batch alone are known: small
tensors computed only from the batch and constants (padding masks, label counts, positions,
``nonzero`` of token ids) carry real twins (:class:`BatchValues`), so ``.item()`` and
data-dependent shapes on them work. A step that cannot run on fake tensors raises
:class:`DryRunUnsupported` with the reason and the line of user code: an op that reads values of
an activation (``loss.item()``, ``if hidden.abs().max() > 1:``), an output shape that depends on
them (``hidden[hidden > 0]``), an op without a fake kernel, a compiled module, manual
optimization. The real module, its parameters, gradients and optimizer state, and the torch random
number generators are left as they were.

The copy keeps the train/eval mode of every submodule, as Lightning's ``fit`` does. While the
step runs, transformers' fake-tensor check is switched off process-wide (see
:func:`transformers_without_fake_detection`): do not run a dry run beside another thread that
traces a Hugging Face model.

The step API, what every dry run builds its fake step from (the sharded one,
:mod:`lightning_seqmem.dryrun.sharded`, included): :func:`check_module` (refuse before any work),
:func:`configured_optimizer` (the copy's own optimizer), :func:`state_after_a_step` (gradients and
optimizer state as a first step leaves them), :func:`transformers_without_fake_detection` (around the
step), :func:`~lightning_seqmem.dryrun.step_functions.step_functions` (what the step runs, micro-batched
or not) and :func:`unsupported_reason` (a failure in words).

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
    >>> batch = {"input_ids": torch.randint(0, 256, (2, 16)), "labels": torch.randint(0, 256, (2, 16))}
    >>> eager = dry_run_step(model, optimizer, batch, seq_len=4096)  # 16 tokens tiled to 4096
    >>> sdpa = dry_run_step(model, optimizer, batch, seq_len=4096, mitigations=["attention"])
    >>> eager.peak_bytes > 8 * sdpa.peak_bytes  # the 4096 x 4096 attention scores
    True
    >>> [p for p in eager.phase_peak_bytes], eager.peak_bytes == max(eager.phase_peak_bytes.values())
    (['forward', 'backward', 'optimizer'], True)
    >>> model.gpt.attention_backend, all(p.grad is None for p in model.parameters()), len(optimizer.state)
    ('eager', True, 0)
"""

from __future__ import annotations

import gc
import time
import traceback
from typing import Any, Callable, ContextManager, NamedTuple, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)


from lightning_seqmem.measure.batch_shape import infer_batch_shape
from lightning_seqmem.core.checks import check_int
from lightning_seqmem.mitigations import ladder
from lightning_seqmem.mitigations.base import CopyPlan
from lightning_seqmem.mitigations.activation_offload.activation_offload import offloaded_bytes, reset_offloaded_bytes
from lightning_seqmem.core.rungs import check_mitigations
from lightning_seqmem.measure.steps import training_step_memory
from lightning_seqmem.core.records import PHASES, TrackedEvents
from lightning_seqmem.measure.probes import existing_tensors, make_probe

__all__ = ["checked_rungs", "dry_run_step", "host_peaks", "replay_peaks", "simulated_device_for", "state_after_a_step", "unsupported_reason"]

from lightning_seqmem.dryrun.cuda import (  # re-exported
    allocator_block_bytes,
    cuda_kernel_scratch_bytes,
    resident_bytes,
    warm_cuda_workspaces,
)
from lightning_seqmem.dryrun.fake import (  # check_module, compiled_reason, configured_optimizer: re-exported
    check_module,
    configured_optimizer,
    fake_copy,
    rebuild_optimizer,
    unwrap_optimizer,
)
from lightning_seqmem.dryrun.result import DryRunResult, DryRunUnsupported
from lightning_seqmem.dryrun.accelerator import contained_unpack_failures, simulated_device, stands_for
from lightning_seqmem.dryrun.host import host_detail, host_events, with_host_probe
from lightning_seqmem.dryrun.kernels_scratch import CUDA_TARGET, recording
from lightning_seqmem.dryrun.values import BatchValues, transformers_without_fake_detection  # the latter re-exported
from lightning_seqmem.dryrun.session import fake_batch, fake_session
from lightning_seqmem.dryrun.moe import routing_note
from lightning_seqmem.dryrun.step_functions import step_functions


def replay_peaks(events: TrackedEvents, block_bytes: int = 1) -> tuple[int, dict[str, int]]:
    """``(peak, phase -> peak)`` of a traced step, every allocation rounded up to ``block_bytes``.

    With ``block_bytes=1`` this is what the tracker itself counted; with 512 it is what the CUDA
    caching allocator would report (each block rounded up: 1 byte -> 512, 513 -> 1024).

    Example:
        >>> ev = TrackedEvents(sizes=[1000, 1, 513], sequence=[0, 1, ~1, 2], phase_starts={"forward": 1, "backward": 3})
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
    """``(peak, phase -> peak)`` of the host side of a dry run's step (its ``StepMemory``, events recorded;
    :mod:`lightning_seqmem.dryrun.host`): each pinned block rounded up to a power of two (``pinned_blocks``),
    as the host holds it; 0 and ``{}`` without a host side (a dry run of the CPU).

    Example:
        >>> host_peaks(None)
        (0, {})
    """
    events = host_events(memory, pinned_blocks)
    if events is None:
        return 0, {}
    peak, phases = replay_peaks(events)
    return peak, {p: phases[p] for p in PHASES if p in phases}


# -- the step ----------------------------------------------------------------------------------------
def _user_frame(tb: Any) -> str:
    """``file:line in function`` of the innermost frame outside torch and this package, or ''."""
    skip = ("/torch/", "/lightning_seqmem/dryrun/", "/lightning_seqmem/measure/", "/lightning_seqmem/mitigations/")
    frames = [f for f in traceback.extract_tb(tb) if not any(s in f.filename.replace("\\", "/") for s in skip)]
    if not frames:
        return ""
    f = frames[-1]
    return f" (at {f.filename}:{f.lineno} in {f.name}: `{(f.line or '').strip()}`)"


def unsupported_reason(exc: BaseException) -> str:
    """Why a fake step failed, in words, with the line of user code where it did (when known): the
    reason of the :class:`DryRunUnsupported` it becomes.

    Example:
        >>> unsupported_reason(ValueError("no such head"))
        'the fake step failed: ValueError: no such head'
    """
    where = _user_frame(exc.__traceback__)
    if isinstance(exc, DataDependentOutputException):
        return (
            f"an op reads tensor values ({exc.func}; e.g. `.item()`, `.tolist()` or `if tensor:` on a value computed "
            f"in the step), which fake tensors do not have{where}"
        )
    if isinstance(exc, DynamicOutputShapeException):
        return (
            f"an op's output shape depends on tensor values ({exc.func}; e.g. `nonzero`, boolean-mask indexing, "
            f"`unique`), which fake tensors do not have{where}"
        )
    if isinstance(exc, UnsupportedOperatorException):
        return f"op {exc.func} has no fake (meta) kernel{where}"
    return f"the fake step failed: {type(exc).__name__}: {exc}{where}"


def _device_of(module: nn.Module) -> torch.device:
    first = next(iter(module.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def _fake_module_and_optimizer(
    pl_module: nn.Module, optimizer: Any, names: tuple[str, ...], device: torch.device, fake_mode: FakeTensorMode,
    values: Optional["BatchValues"] = None,
) -> tuple[nn.Module, torch.optim.Optimizer, CopyPlan]:
    """The fake copy on ``device`` with the asked rungs, its optimizer, and what its step becomes."""
    notes: list[str] = []
    model = fake_copy(pl_module, fake_mode, values, device)  # every tensor made on the device simulated
    if device != _device_of(pl_module) and _device_of(pl_module).type != "meta":
        notes.append(f"moved {_device_of(pl_module)} -> {device}")
    with fake_mode:
        twins = {id(real): fake for real, fake in zip(pl_module.parameters(), model.parameters())}
        fake_optimizer = configured_optimizer(model) if optimizer is None else rebuild_optimizer(optimizer, twins)
        plan = ladder.apply_to_copy(names, model)  # after the optimizer: the rungs keep parameter identity
    plan.notes[:0] = notes
    return model, fake_optimizer, plan


def state_after_a_step(model: nn.Module, optimizer: Any) -> None:
    """Gradients and optimizer state as a first real step leaves them, without running it: a zero
    gradient for every trainable parameter, then one optimizer step (creating its state). Half the
    cost of a warm-up forward and backward, and the same storages alive when the measured step starts.

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
    optimizer.step()


SiteTracer = Callable[..., Any]
"""``(step_fn, model, optimizer, existing, *, seq_len, batch_size, device_type) -> PeakSite``: traces the
step ``step_fn`` runs (:func:`lightning_seqmem.diagnostics.peak_trace.trace_peak_site`)."""


def _measured_step(model: nn.Module, optimizer: Any, step_optimizer: Any, batch: Any, loss_fn: Any, probe: Any,
                   autocast: Any, site: Optional[SiteTracer], seq_len: int, batch_size: int,
                   device: torch.device) -> tuple[Any, Any]:
    """``(StepMemory, PeakSite or None)`` of the measured fake step; with ``site``, traced by it as well
    (the probe inside counts the same storages as without it: the peak does not change)."""
    def step() -> Any:
        return training_step_memory(model, step_optimizer, batch, loss_fn, probe, record_events=True, context=autocast)

    if site is None:
        return step(), None
    box: list[Any] = []
    existing = list(model.buffers()) + [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    try:
        found = site(lambda: box.append(step()), model, optimizer, existing, seq_len=seq_len, batch_size=batch_size,
                     device_type=device.type)
    except Exception:  # noqa: BLE001 - the site is an extra: the step's peak stands without it
        if not box:
            raise
        found = None
    return box[0], found


def dry_run_step(
    pl_module: nn.Module,
    optimizer: Optional[Any],
    batch: Any,
    seq_len: int,
    batch_size: Optional[int] = None,
    mitigations: Sequence[str] = (),
    autocast: Optional[Callable[[], ContextManager[Any]]] = None,
    device: Optional[torch.device | str] = None,
    site: Optional[SiteTracer] = None,
) -> DryRunResult:
    """Peak memory of one training step of ``pl_module`` at ``(seq_len, batch_size)``, on fake tensors.

    Args:
        pl_module: a ``LightningModule`` (any ``nn.Module`` with ``training_step(batch, batch_idx)``
            returning a loss tensor or a dict with ``"loss"``). Left untouched, with its optimizer
            and the torch random number generators.
        optimizer: the optimizer training it (a ``torch.optim.Optimizer`` or Lightning's wrapper);
            a fresh one of the same class, defaults and param-group hyperparameters is built over
            the copy. ``None``: the copy's own ``configure_optimizers()`` (its first optimizer).
        batch: a training batch (a tensor of token ids, or a mapping / list / tuple holding one;
            see :func:`~lightning_seqmem.measure.batch.infer_batch_shape`). Its rows are cut or repeated
            to ``batch_size``, its sequence tensors cut or tiled to ``seq_len`` (see
            :func:`shape_batch`); any length will do, values do not matter.
        seq_len: tokens per sample of the step to simulate.
        batch_size: samples in the step; ``None``: the batch's own.
        mitigations: names from :data:`~lightning_seqmem.mitigations.MITIGATIONS`, applied
            to the copy: ``"attention"``, ``"checkpointing"``, ``"microbatch"`` (micro-batches of 1),
            ``"activation_offload"`` (``host_bytes`` of the result: modelled on the CPU; on an
            accelerator ``save_on_cpu`` runs and its host copies are in ``host_peak_bytes``).
            Or a rung's variant (``"checkpointing:3/8"``, ``"checkpointing:selective"``).
            A module already micro-batched by :class:`~lightning_seqmem.mitigations.microbatch.microbatch.MicroBatching`
            is simulated with its micro-batch size.
        autocast: a zero-argument factory of the context the forward runs in (the precision
            plugin's ``forward_context``, e.g. ``lambda: torch.autocast("cpu", dtype=torch.bfloat16)``).
        device: the device to simulate; default that of the module's first parameter. A device
            other than the module's must be one this torch build supports.
        site: where the peak sits, asked of a tracer that watches the same fake step
            (:func:`lightning_seqmem.diagnostics.peak_trace.trace_peak_site`; the diagnostics wing sits above
            this one, so the caller hands it in): the result's ``peak_site``. None: not asked. A
            tracer that fails leaves ``peak_site`` None, the peak unchanged.

    Returns:
        a :class:`DryRunResult` of the second of two fake steps (the first creates gradients
        and optimizer state, as the warm-up steps of a real run do).

    Raises:
        DryRunUnsupported: the module cannot run on fake tensors (the reason names the op and the
            line of user code when known), is compiled, or uses manual optimization.
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
    step = _fake_step(pl_module, optimizer, batch, seq_len, batch_size, names, autocast, device, site)
    block = allocator_block_bytes(device)
    peak, phase_peaks = replay_peaks(step.memory.events, block)
    resident = _resident_bytes(pl_module, optimizer, batch, device, module_device)
    peak += resident
    phase_peaks = {p: phase_peaks[p] + resident for p in PHASES if p in phase_peaks}
    host, notes, modelled = step.host_bytes, step.notes, step.modelled_kernels
    host_peak, host_phase_peaks = host_peaks(step.host_memory)
    detail = (
        f"a fake step of {type(pl_module).__name__} on {device} (after a zero-gradient optimizer step) with {step.optimizer_name}, "
        f"batch {step.source_shape} -> ({batch_size}, {seq_len})"
        + (f"; {'; '.join(notes)}" if notes else "")
        + f"; live storages counted by LiveTensorTracker{', 512-byte blocks' if block > 1 else ''}"
        + (f"; plus {resident} bytes the allocator holds outside the step's tensors" if resident else "")
        + (f"; {host} bytes of saved activations moved to host memory "
           f"({'modelled' if step.host_memory is None else 'save_on_cpu run, its host copies counted'})"
           if host else "")
        + f"; {host_detail(device, step.host_memory, host_peak)}"
        + (f"; kernels modelled for {CUDA_TARGET.name}: {', '.join(modelled)}" if modelled else "")
    )
    return DryRunResult(
        seq_len=seq_len,
        batch_size=batch_size,
        mitigations=names,
        peak_bytes=peak,
        phase_peak_bytes=phase_peaks,
        seconds=time.perf_counter() - started,
        detail=detail,
        resident_bytes=resident,
        host_bytes=host,
        peak_site=step.peak_site,
        host_peak_bytes=host_peak,
        host_phase_peak_bytes=host_phase_peaks,
        modelled_kernels=tuple(modelled),
        events=step.memory.events,
        host_events=host_events(step.host_memory),
    )


def checked_rungs(mitigations: Sequence[str]) -> tuple[str, ...]:
    """``mitigations`` checked as a dry run takes them: distinct rung names or variants, each one a level
    its rung has (the rung's ValueError, before any work).

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


def simulated_device_for(device: Optional[torch.device | str], module_device: torch.device) -> torch.device:
    """The device a dry run's fake step runs on: ``device``, default the module's (the CPU for a module on
    ``meta``); a bare ``cuda`` is the module's CUDA device (else ``cuda:0``); CUDA on a build of torch
    without it is the simulated accelerator (:mod:`lightning_seqmem.dryrun.accelerator`).

    Example:
        >>> simulated_device_for(None, torch.device("meta")), simulated_device_for("cpu", torch.device("cpu"))
        (device(type='cpu'), device(type='cpu'))
    """
    device = module_device if device is None else torch.device(device)
    if device.type == "meta":
        device = torch.device("cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        try:
            return simulated_device()
        except RuntimeError as exc:
            raise DryRunUnsupported(f"cannot simulate CUDA on this torch build without it: {exc}") from None
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
    modelled_kernels: list[str]  # the CUDA kernels modelled in the measured step (dryrun.kernels)
    host_memory: Any = None  # the host side's StepMemory (events recorded), where the host is apart


def _fake_step(pl_module: nn.Module, optimizer: Optional[Any], batch: Any, seq_len: int, batch_size: int,
               names: tuple[str, ...], autocast: Optional[Callable[[], ContextManager[Any]]], device: torch.device,
               site: Optional[SiteTracer]) -> _FakeStep:
    """The measured fake step of :func:`dry_run_step` (its arguments checked); every failure of it
    raised as :class:`DryRunUnsupported` with the reason, the fake world freed first."""
    with fake_session(seq_len, device) as (fake_mode, values):
        try:
            model, fake_optimizer, plan = _fake_module_and_optimizer(pl_module, optimizer, names, device, fake_mode,
                                                                      values)
            notes = plan.notes
            step_batch, source_shape = fake_batch(batch, seq_len, batch_size, device, fake_mode, values)
            loss_fn, step_optimizer = step_functions(pl_module, fake_optimizer, plan, batch_size)
            device_probe = make_probe("tracker", device)
            if stands_for(device) == "cuda":  # CUDA and the simulated device that stands for it
                device_probe.scratch = cuda_kernel_scratch_bytes
            probe = with_host_probe(device_probe, device)
            with fake_mode, values, transformers_without_fake_detection():
                state_after_a_step(model, fake_optimizer)
                reset_offloaded_bytes(model)
                with recording() as modelled, contained_unpack_failures(device) as failures:
                    memory, peak_site = _measured_step(model, fake_optimizer, step_optimizer,
                                                       step_batch, loss_fn, probe, autocast, site,
                                                       seq_len, batch_size, device)
                if failures:
                    raise failures[0]
            host = offloaded_bytes(model)
            notes += [note for note in [routing_note(values)] if note]  # what an MoE step assumed
        except DryRunUnsupported:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure of the fake run is a reason
            failure = unsupported_reason(exc)
            traceback.clear_frames(exc.__traceback__)  # the step's frames held the half-built fake world
            del exc
            model = fake_optimizer = step_batch = loss_fn = step_optimizer = probe = device_probe = None
            values = fake_mode = None
            gc.collect()  # its cycles (fake tensors, their mode, the tracker) freed now, not in a later collection
            raise DryRunUnsupported(failure) from None
    assert memory is not None and memory.events is not None
    return _FakeStep(memory, peak_site, host, notes, type(fake_optimizer).__name__, source_shape,
                     modelled, getattr(probe, "host_memory", None))


def _resident_bytes(pl_module: nn.Module, optimizer: Optional[Any], batch: Any, device: torch.device,
                    module_device: torch.device) -> int:
    """Bytes the CUDA allocator holds outside the step's tensors (its workspaces warmed first), where the
    dry run simulates the CUDA device the module lives on; 0 elsewhere."""
    if not (device.type == "cuda" and module_device == device and torch.cuda.is_available()):
        return 0
    warm_cuda_workspaces(device)
    real_optimizer = None if optimizer is None else unwrap_optimizer(optimizer)
    return resident_bytes(device, existing_tensors(pl_module, [real_optimizer] if real_optimizer else [], batch))
