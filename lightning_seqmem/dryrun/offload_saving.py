"""What activation offload would save: two dry runs of one step, without and with the rung.

Activation offload (:mod:`.activation_offload.activation_offload`) is CUDA only, but its effect on
the device's live bytes is modelled on any device: on the fake copy each saved activation is freed
as ``save_on_cpu`` would copy it out, and allocated again in the backward where it is copied back.
:func:`offload_forecast` lets ``seqmem plan`` say what it would save on a GPU from a CPU machine.
The figures are *modelled*: on a CPU module, live tensor bytes as the CPU tracker counts them (no
512-byte blocks, workspaces or copy timing).

Example:
    >>> import torch
    >>> from lightning_seqmem.reference.demo import LitGPT
    >>> module = LitGPT(n_layer=2, d_model=32, n_head=2, vocab_size=64, attention="sdpa")
    >>> ids = torch.zeros(2, 16, dtype=torch.long)
    >>> batch = {"input_ids": ids, "labels": ids.clone()}
    >>> f = offload_forecast(module, None, batch, seq_len=256)
    >>> f.peak_bytes_with < f.peak_bytes_without, f.host_bytes > 0, f.measured
    (True, True, False)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightning_seqmem.dryrun.step import dry_run_step
from lightning_seqmem.mitigations.activation_offload.activation_offload import ActivationOffloadRung

__all__ = ["OffloadForecast", "offload_forecast"]

RUNG = ActivationOffloadRung.spec.name
"""The rung the second dry run adds (the rung's own name)."""


@dataclass(frozen=True)
class OffloadForecast:
    """Device peaks of one step without and with activation offload (on top of ``mitigations``),
    and the bytes it moves to host memory; modelled by dry runs (``measured`` is False)."""

    seq_len: int
    batch_size: int
    mitigations: tuple[str, ...]  # the rungs on in both runs (offload added last in the second)
    device: str  # the device the dry runs simulated
    peak_bytes_without: int
    peak_bytes_with: int
    host_bytes: int  # saved activations copied to host per step (each save once)
    phase_peak_bytes_without: dict[str, int]
    phase_peak_bytes_with: dict[str, int]
    measured: bool = False

    @property
    def saved_bytes(self) -> int:
        """Device peak bytes offload takes off (negative: it would add)."""
        return self.peak_bytes_without - self.peak_bytes_with


def offload_forecast(
    pl_module: torch.nn.Module, optimizer: Optional[Any], batch: Any, seq_len: int, *step: Any,
    without: Optional[Any] = None, **step_keywords: Any,
) -> OffloadForecast:
    """Dry-run one step with ``mitigations`` and with ``mitigations`` + activation offload.

    Args:
        pl_module, optimizer, batch, seq_len, step, step_keywords: the arguments of
            :func:`~lightning_seqmem.dryrun.step.dry_run_step` (``batch_size``, ``mitigations``,
            ``autocast``, ``device``, in its order or by name), checked by it.
        without: a dry-run result already at hand for the first run, reused.

    Raises:
        ValueError: ``mitigations`` already holds the offload rung.
        TypeError: arguments :func:`~lightning_seqmem.dryrun.step.dry_run_step` does not take.
        DryRunUnsupported: the step cannot run on fake tensors.
    """
    bound = inspect.signature(dry_run_step).bind(pl_module, optimizer, batch, seq_len, *step,
                                                 **step_keywords)
    arguments = bound.arguments  # as given, dry_run_step's defaults for the rest
    names = tuple(arguments.pop("mitigations", ()))
    if RUNG in names:
        raise ValueError(f"`mitigations` must not hold {RUNG!r} (it is added for the second run), "
                         f"got {names!r}")
    plain = without or dry_run_step(**arguments, mitigations=names)
    offloaded = dry_run_step(**arguments, mitigations=(*names, RUNG))
    device = arguments.get("device")
    where = device if device is not None else next((str(p.device) for p in pl_module.parameters()),
                                                   "cpu")
    return OffloadForecast(
        seq_len=offloaded.seq_len, batch_size=offloaded.batch_size, mitigations=names,
        device=str(where), peak_bytes_without=plain.peak_bytes,
        peak_bytes_with=offloaded.peak_bytes, host_bytes=offloaded.host_bytes,
        phase_peak_bytes_without=dict(plain.phase_peak_bytes),
        phase_peak_bytes_with=dict(offloaded.phase_peak_bytes))
