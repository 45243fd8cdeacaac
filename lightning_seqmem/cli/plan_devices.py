"""The devices ``seqmem plan`` answers for: one budget or several (``--budget 80GB h200``).

A budget is bytes (``80GiB``) or a GPU's name (:data:`DEVICE_MEMORY`, as ``nvidia-smi`` reports
it). Without one, a CUDA config planned without CUDA answers for an 80 GB H100 and a 141 GB H200;
a CUDA device present gives its own total. Usable: ``budget × (1 − safety margin)``, the margin for
what no dry run counts (the CUDA context, ~0.5 GiB outside the allocator; NCCL; fragmentation).

Example:
    >>> [b.name for b in device_budgets(["h100", "100GiB"], 0.1, None, None)]
    ['h100 (79.6 GiB)', '100.0 GiB']
    >>> b = device_budgets(["h200"], 0.1, None, None)[0]
    >>> b.budget_bytes == 143771 * 2**20, b.usable_bytes == int(b.budget_bytes * 0.9)
    (True, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

__all__ = ["DEFAULT_GPUS", "DEVICE_MEMORY", "DeviceBudget", "device_budgets", "parse_budget"]

DEVICE_MEMORY: dict[str, int] = {
    "h100": 81559 * 2**20,  # H100 SXM/PCIe 80GB: 81559 MiB (79.6 GiB) as nvidia-smi reports it
    "a100-80gb": 81920 * 2**20,  # A100 80GB: 81920 MiB
    "h200": 143771 * 2**20,  # H200 141GB: 143771 MiB (140.4 GiB)
    "b200": 183359 * 2**20,  # B200 180GB: 183359 MiB
}
"""GPUs a budget may name, with the device memory each reports (bytes)."""

DEFAULT_GPUS = ("h100", "h200")
"""What a CUDA config planned without a GPU and without a budget answers for."""


@dataclass(frozen=True)
class DeviceBudget:
    """One device a plan answers for: name in the output, memory and usable part (bytes)."""

    name: str
    budget_bytes: int
    usable_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "budget_bytes": self.budget_bytes,
                "usable_budget_bytes": self.usable_bytes}


def parse_budget(text: str, option: str = "--budget") -> tuple[str, int]:
    """``(name, bytes)`` of one budget: a GPU of :data:`DEVICE_MEMORY` or a size (``parse_bytes``).

    >>> parse_budget("H200")[1] == DEVICE_MEMORY["h200"], parse_budget("1GiB")
    (True, ('1.0 GiB', 1073741824))
    >>> parse_budget("h300")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: `--budget` must be a size (80GiB, 141GB, 900MB) or a GPU among
    ('h100', 'a100-80gb', 'h200', 'b200'), got 'h300'
    """
    from lightning_seqmem.core.units import format_bytes, parse_bytes

    key = str(text).strip().lower()
    if key in DEVICE_MEMORY:
        return f"{key} ({format_bytes(DEVICE_MEMORY[key])})", DEVICE_MEMORY[key]
    try:
        size = parse_bytes(text, option)
    except ValueError:
        raise ValueError(f"`{option}` must be a size (80GiB, 141GB, 900MB) or a GPU among "
                         f"{tuple(DEVICE_MEMORY)}, got {text!r}") from None
    return format_bytes(size), size


def device_budgets(budgets: Optional[Sequence[Any]], margin: float, seqmem: Any,
                   device: Any) -> list[DeviceBudget]:
    """The devices a plan answers for, the single-budget output's first: ``budgets`` (texts or
    bytes), else the config's SeqMemCallback ``memory_budget``, else a CUDA device's total, else
    (a CUDA config simulated here) :data:`DEFAULT_GPUS`; empty for a CPU plan without a budget."""
    from lightning_seqmem.core.units import format_bytes

    out: list[tuple[str, int]] = []
    for b in budgets or ():
        out.append((format_bytes(b), int(b)) if isinstance(b, int) else parse_budget(b))
    if not out and seqmem is not None and seqmem.config.memory_budget_bytes is not None:
        out.append((format_bytes(seqmem.config.memory_budget_bytes),
                    int(seqmem.config.memory_budget_bytes)))
    if not out and device is not None:
        import torch

        from lightning_seqmem.dryrun.accelerator import is_simulated

        if torch.device(device).type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            out.append((f"{torch.device(device)} ({format_bytes(total)})", total))
        elif is_simulated(device):
            out.extend(parse_budget(name) for name in DEFAULT_GPUS)
    return [DeviceBudget(name, size, int(size * (1 - margin))) for name, size in out]
