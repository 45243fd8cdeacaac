"""Argument checks: one message shape, naming the argument, its value and what is accepted."""

from __future__ import annotations

import numbers
from typing import Any, Optional


def check_int(name: str, value: Any, minimum: int = 1, maximum: Optional[int] = None,
              accepted: Optional[str] = None) -> int:
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


def check_fraction(name: str, value: Any, low: float, high: float,
                   closed_low: bool = False) -> float:
    """``value`` as a float in ``(low, high)`` (``[low, high)`` with ``closed_low``), else
    ``ValueError``.

    Example:
        >>> check_fraction("safety_margin", 0.1, 0, 1, closed_low=True)
        0.1
        >>> check_fraction("tolerance", 1.5, 0, 1)
        Traceback (most recent call last):
        ...
        ValueError: `tolerance` must be a float in (0, 1), got 1.5
    """
    ok_low = (lambda v: v >= low) if closed_low else (lambda v: v > low)
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not (ok_low(value) and value < high)):
        raise ValueError(f"`{name}` must be a float in {'[' if closed_low else '('}{low:g}, "
                         f"{high:g}), got {value!r}")
    return float(value)


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> Any:
    """``value`` if it is one of ``choices``, else ``ValueError`` naming them (``SeqMemConfig``'s
    doc shows one)."""
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {choices}, got {value!r}")
    return value


def is_a(obj: Any, *class_names: str) -> bool:
    """Whether ``obj``'s class or a base is named one of ``class_names``: an ``isinstance`` for
    other libraries' classes (Lightning's strategies) that imports nothing.

    Example:
        >>> class SingleDeviceStrategy: ...
        >>> class MyStrategy(SingleDeviceStrategy): ...
        >>> is_a(MyStrategy(), "DDPStrategy", "SingleDeviceStrategy"), is_a(None, "DDPStrategy")
        (True, False)
    """
    return any(cls.__name__ in class_names for cls in type(obj).__mro__)
