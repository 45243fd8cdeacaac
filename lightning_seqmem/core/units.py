"""Byte quantities: parse what users write ("12GiB", "900MB"), show what we measured. Bytes are the
only unit inside the package; these helpers are its input and display edge."""

from __future__ import annotations

import numbers
import re
from fractions import Fraction
from typing import Union

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")
MAX_BYTES = 2**63 - 1  # the largest count an int64 memory counter (torch, CUDA) holds: 8 EiB
_MAX_CHARS = 64  # a longer string is not a memory size; refused before any arithmetic on it
_SHOWN_CHARS = 40  # characters of an over-long value repeated in the error message


def parse_bytes(value: Union[int, str], name: str = "memory_budget") -> int:
    """Bytes from an int or a string with a unit (B, KB/MB/GB/TB = 1000ⁿ, KiB/MiB/GiB/TiB = 1024ⁿ).

    The number in a string is a plain decimal (``12``, ``1.5``, ``.5``; no sign, exponent, ``inf``
    or ``nan``), converted exactly and rounded down to whole bytes. Any accepted value is in
    ``[1, MAX_BYTES]``; anything else raises ``ValueError`` (never ``OverflowError``) naming
    ``name``. Ints may be any ``numbers.Integral`` (NumPy ints too); bools and floats are refused.

    Example:
        >>> parse_bytes("12GiB"), parse_bytes("900MB"), parse_bytes("1.5 KiB"), parse_bytes(4096)
        (12884901888, 900000000, 1536, 4096)
        >>> parse_bytes("0.3MB")  # exact decimal arithmetic: a float product would give 299999
        300000
        >>> parse_bytes("12 parsecs")  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        ValueError: `memory_budget` must be a positive number of bytes up to 2**63 - 1 (an int) or
        a string like '12GiB' or '900MB' (a plain decimal number; units: B, KB, MB, GB, TB, KiB,
        MiB, GiB, TiB), got '12 parsecs'
        >>> parse_bytes("9" * 30 + "GiB", "--budget")  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        ValueError: `--budget` must be a positive number of bytes up to 2**63 - 1 (an int) or a
        string like '12GiB' or '900MB' (a plain decimal number; units: B, KB, MB, GB, TB, KiB, MiB,
        GiB, TiB), got '999999999999999999999999999999GiB' (over 2**63 - 1 bytes)
    """
    accepted = (
        f"`{name}` must be a positive number of bytes up to 2**63 - 1 (an int) or a string like"
        " '12GiB' or '900MB' (a plain decimal number; units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
    )

    def refuse(why: str = "") -> ValueError:
        return ValueError(f"{accepted}, got {_short_repr(value)}{why}")

    if isinstance(value, bool):
        raise refuse()
    if isinstance(value, numbers.Integral):
        if value <= 0:
            raise refuse()
        if value > MAX_BYTES:
            raise refuse(" (over 2**63 - 1 bytes)")
        return int(value)
    if not isinstance(value, str):
        raise refuse()
    if len(value) > _MAX_CHARS:
        raise refuse(f" (longer than {_MAX_CHARS} characters)")
    match = _PATTERN.match(value)
    unit = (match.group(2).lower() or "b") if match else None
    if unit not in _UNITS:
        raise refuse()
    nbytes = int(Fraction(match.group(1)) * _UNITS[unit])  # exact; at most 64 digits, so cheap
    if nbytes <= 0:
        raise refuse(" (less than one byte)")
    if nbytes > MAX_BYTES:
        raise refuse(" (over 2**63 - 1 bytes)")
    return nbytes


def _short_repr(value: object) -> str:
    """``repr(value)``, cut to about :data:`_SHOWN_CHARS` characters for an over-long string."""
    if isinstance(value, str) and len(value) > _SHOWN_CHARS:
        return f"{value[:_SHOWN_CHARS]!r}... ({len(value)} characters)"
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and abs(value) > 10**80:
        return f"an int of {int(value).bit_length()} bits"  # repr of a huge int is slow or refused
    text = repr(value)
    return text if len(text) <= 2 * _SHOWN_CHARS else f"{text[: 2 * _SHOWN_CHARS]}..."


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
