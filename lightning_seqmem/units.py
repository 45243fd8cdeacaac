"""Byte quantities: parse what users write ("12GiB", "900MB"), show what we measured.

Bytes are the only unit inside the package; these helpers are the display and input edge.
"""

from __future__ import annotations

import re
from typing import Union

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Union[int, str], name: str = "memory_budget") -> int:
    """Bytes from an int or a string with a unit (B, KB/MB/GB/TB = 1000ⁿ, KiB/MiB/GiB/TiB = 1024ⁿ).

    Example:
        >>> parse_bytes("12GiB"), parse_bytes("900MB"), parse_bytes("1.5 KiB"), parse_bytes(4096)
        (12884901888, 900000000, 1536, 4096)
        >>> parse_bytes("12 parsecs")
        Traceback (most recent call last):
        ...
        ValueError: `memory_budget` must be a positive number of bytes (int) or a string like '12GiB' or '900MB' (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), got '12 parsecs'
    """
    accepted = (
        f"`{name}` must be a positive number of bytes (int) or a string like '12GiB' or '900MB' "
        "(units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
    )
    if isinstance(value, bool):
        raise ValueError(f"{accepted}, got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{accepted}, got {value!r}")
        return value
    if isinstance(value, str):
        match = _PATTERN.match(value)
        if match and match.group(2).lower() in _UNITS or (match and match.group(2) == ""):
            number, unit = float(match.group(1)), (match.group(2).lower() or "b")
            nbytes = int(number * _UNITS[unit])
            if nbytes > 0:
                return nbytes
    raise ValueError(f"{accepted}, got {value!r}")


def to_gib(nbytes: float) -> float:
    """Bytes → GiB (display only).

    Example:
        >>> to_gib(3 * 2**30)
        3.0
    """
    return nbytes / 2**30


def format_bytes(nbytes: float | None) -> str:
    """A short human-readable size, binary units.

    Example:
        >>> format_bytes(1536), format_bytes(5 * 2**20), format_bytes(None)
        ('1.5 KiB', '5.0 MiB', '-')
    """
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def display_unit(max_bytes: float) -> tuple[str, float]:
    """The unit to show sizes up to ``max_bytes`` in: GiB from 1 GiB up, MiB below (display only).

    Example:
        >>> display_unit(3 * 2**30), display_unit(300 * 2**20)
        (('GiB', 1073741824.0), ('MiB', 1048576.0))
    """
    return ("GiB", 2.0**30) if max_bytes >= 2**30 else ("MiB", 2.0**20)
