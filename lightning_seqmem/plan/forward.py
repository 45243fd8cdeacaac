"""``Forward``: an attribute of a façade that is the attribute of the same name on one of its parts.

The planner is a façade over parts that each own one state (:mod:`.evidence`, :mod:`.ladder_state`,
:mod:`.curriculum_state`, :mod:`.settings`); the names callers read and write on it stay, each one line.

Example:
    >>> class Part:
    ...     def __init__(self):
    ...         self.count = 0
    ...     def double(self):
    ...         return 2 * self.count
    >>> class Facade:
    ...     count = Forward("part")
    ...     twice = Forward("part", "double", method=True)
    ...     def __init__(self):
    ...         self.part = Part()
    >>> f = Facade()
    >>> f.count = 3
    >>> f.part.count, f.twice()
    (3, 6)
    >>> f.twice = lambda: "wrapped"
    >>> f.twice(), f.part.double()
    ('wrapped', 6)
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["Forward"]


class Forward:
    """Reads (and, unless ``method``, writes) ``getattr(obj.<part>, <attr>)``; ``attr`` defaults to the
    name it is assigned to. A ``method`` forward is read-only, so an instance may still shadow it (a
    test that wraps ``planner.observe`` does)."""

    def __init__(self, part: str, attr: Optional[str] = None, method: bool = False) -> None:
        self.part, self.attr, self.method = part, attr, method

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.attr = name, self.attr or name
        self.__doc__ = f"``self.{self.part}.{self.attr}``"

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        if obj is None:
            return self
        if self.method and self.name in obj.__dict__:  # an instance's own (a wrapped method)
            return obj.__dict__[self.name]
        return getattr(getattr(obj, self.part), self.attr)

    def __set__(self, obj: Any, value: Any) -> None:
        if self.method:  # shadowed on the instance, as a plain method would be
            obj.__dict__[self.name] = value
            return
        setattr(getattr(obj, self.part), self.attr, value)
