"""Argument checks shared by every module: one message shape, naming the argument, its value and
what is accepted."""

from __future__ import annotations

import numbers
from typing import Any, Optional


def check_int(name: str, value: Any, minimum: int = 1, maximum: Optional[int] = None, accepted: Optional[str] = None) -> int:
    """``value`` as an int in ``[minimum, maximum]``, else ``ValueError`` naming it (bools refused).

    Example:
        >>> check_int("seq_len", 128)
        128
        >>> check_int("seq_len", 0)
        Traceback (most recent call last):
        ...
        ValueError: `seq_len` must be a positive int, got 0
        >>> check_int("trace_lengths", 9, 2, 8)
        Traceback (most recent call last):
        ...
        ValueError: `trace_lengths` must be an int in [2, 8], got 9
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        if accepted is None:
            if maximum is not None:
                accepted = f"an int in [{minimum}, {maximum}]"
            else:
                accepted = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"`{name}` must be {accepted}, got {value!r}")
    return int(value)
