"""What a dry run returns, and why it could not answer (plain values shared by the dry-run wing)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from lightning_seqmem.core.peak import PeakSite
from lightning_seqmem.core.records import TrackedEvents

__all__ = ['DryRunResult', 'DryRunUnsupported', 'reason_of']

@dataclass(frozen=True)
class DryRunResult:
    """The peak of one fake training step (bytes).

    ``phase_peak_bytes`` maps ``forward``, ``backward`` and ``optimizer`` to the peak live bytes
    within each phase (each starts from the bytes live when it begins); ``peak_bytes`` is their
    maximum. ``seconds``: wall time of the whole dry run (copy, two fake steps). ``detail``: what
    ran. ``peak_site``: where the peak sits, when asked (``site=trace_peak_site``).
    ``host_*``: the same of host memory where the simulated device is not the CPU
    (:mod:`lightning_seqmem.dryrun.host`: pinned blocks rounded up to powers of two); 0 and ``{}``
    on the CPU. ``modelled_kernels``: CUDA kernels modelled rather than run, in first-run order.
    ``events``/``host_events``: the allocation sequences the peaks were replayed from (None where
    not replayed from one trace, e.g. depth-extrapolated, or without a host side)."""

    seq_len: int  # tokens per sample of the simulated step
    batch_size: int  # samples in the simulated batch
    mitigations: tuple[str, ...]  # mitigations applied to the copy, in the order given
    peak_bytes: int  # peak live tensor bytes of the step (allocator blocks on CUDA)
    phase_peak_bytes: dict[str, int]  # phase -> peak live bytes within it
    seconds: float  # wall time of the dry run
    detail: str  # what ran, for logs and reports
    resident_bytes: int = 0  # device memory held outside the step's tensors, included (CUDA)
    host_bytes: int = 0  # saved activations copied to host (activation offload; its own count)
    peak_site: Optional[PeakSite] = None  # where the peak sits (phase, kinds), when asked
    host_peak_bytes: int = 0  # peak live host-memory bytes of the step (0: the device is the CPU)
    host_phase_peak_bytes: dict[str, int] = field(default_factory=dict)  # phase -> host peak
    modelled_kernels: tuple[str, ...] = ()  # CUDA kernels modelled (on the simulated device)
    events: Optional[TrackedEvents] = field(default=None, repr=False, compare=False)  # step trace
    host_events: Optional[TrackedEvents] = field(default=None, repr=False, compare=False)  # host's


class DryRunUnsupported(RuntimeError):
    """The step cannot run on fake tensors; ``reason`` says why (and where, when known).

    Example:
        >>> err = DryRunUnsupported("the module is compiled")
        >>> err.reason, str(err)
        ('the module is compiled', 'dry run unsupported: the module is compiled')
    """

    def __init__(self, reason: str) -> None:
        super().__init__(f"dry run unsupported: {reason}")
        self.reason = reason


def reason_of(exc: BaseException) -> str:
    """Why ``exc`` stopped a dry run: a refusal's ``reason``, else ``"<type>: <message>"``."""
    return getattr(exc, "reason", None) or f"{type(exc).__name__}: {exc}"
