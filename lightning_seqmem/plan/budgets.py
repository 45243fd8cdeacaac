"""Device and host budgets: whether a dry run's answer fits both (no torch).

An offloading setting trades device for host memory: it fits where its device peak fits the usable
budget *and* its host peak the host budget (``host_memory_budget``; default the machine's RAM).

Example:
    >>> GiB = 2**30
    >>> fit = fits_budgets(peak_bytes=70 * GiB, host_peak_bytes=140 * GiB, usable_bytes=72 * GiB,
    ...                    host_budget_bytes=128 * GiB)
    >>> fit.fits, fit.device_fits, fit.host_fits
    (False, True, False)
    >>> print(fit.reason)
    host peak 140.0 GiB over the host budget 128.0 GiB
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from lightning_seqmem.core.units import format_bytes, parse_bytes

__all__ = ["BudgetFit", "fits_budgets", "host_budget_bytes", "machine_memory_bytes"]


def machine_memory_bytes() -> Optional[int]:
    """This machine's physical memory in bytes, None where the system does not say (Windows).

    >>> machine_memory_bytes() is None or machine_memory_bytes() > 0
    True
    """
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def host_budget_bytes(host_memory_budget: Optional[int | str] = None) -> Optional[int]:
    """The host budget in bytes: ``host_memory_budget`` (bytes or a string with a unit) parsed, or
    where None the machine's RAM (None where it cannot be read). Raises ``ValueError`` on a budget
    that is not a positive number of bytes.

    >>> host_budget_bytes("2GiB"), host_budget_bytes(None) == machine_memory_bytes()
    (2147483648, True)
    """
    if host_memory_budget is None:
        return machine_memory_bytes()
    return parse_bytes(host_memory_budget, "host_memory_budget")


@dataclass(frozen=True)
class BudgetFit:
    """Whether one answer fits: the device side, the host side, both; ``reason`` says what does not
    fit (or that both do). A side without a budget (None) fits."""

    device_fits: bool
    host_fits: bool
    reason: str

    @property
    def fits(self) -> bool:
        return self.device_fits and self.host_fits


def fits_budgets(peak_bytes: int, host_peak_bytes: int, usable_bytes: Optional[int],
                 host_budget_bytes: Optional[int], bound_bytes: Optional[int] = None) -> BudgetFit:
    """Whether a dry run's device peak fits ``usable_bytes`` (the device budget less its margin) and
    its host peak fits ``host_budget_bytes`` (None: that side is not judged). ``bound_bytes``: what
    the device side compares (default the peak; ``seqmem plan`` passes
    :func:`~lightning_seqmem.plan.judging.dry_run_bound`).

    >>> fits_budgets(100, 0, 200, None).reason
    'fits: device peak 100 B of 200 B usable, host peak 0 B (no host budget)'
    >>> fits_budgets(300, 10, 200, 5).reason
    'device peak 300 B over 200 B usable; host peak 10 B over the host budget 5 B'
    >>> fits_budgets(196, 0, 200, None, bound_bytes=199).fits, fits_budgets(
    ...     198, 0, 200, None, bound_bytes=201).reason
    (True, 'device peak 198 B (bound 201 B) over 200 B usable')
    """
    bound = peak_bytes if bound_bytes is None else bound_bytes
    device_fits = usable_bytes is None or bound <= usable_bytes
    host_fits = host_budget_bytes is None or host_peak_bytes <= host_budget_bytes
    device, host = format_bytes(peak_bytes), format_bytes(host_peak_bytes)
    if bound != peak_bytes and not device_fits:
        device += f" (bound {format_bytes(bound)})"
    over = []
    if not device_fits:
        over.append(f"device peak {device} over {format_bytes(usable_bytes)} usable")
    if not host_fits:
        over.append(f"host peak {host} over the host budget {format_bytes(host_budget_bytes)}")
    if over:
        return BudgetFit(device_fits, host_fits, "; ".join(over))
    device += (f" of {format_bytes(usable_bytes)} usable" if usable_bytes is not None
               else " (no device budget)")
    host += (f" of {format_bytes(host_budget_bytes)}" if host_budget_bytes is not None
             else " (no host budget)")
    return BudgetFit(True, True, f"fits: device peak {device}, host peak {host}")
