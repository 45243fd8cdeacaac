"""``MitigationEvent``: one rung switched on, as a frozen value.

The ladder (:class:`~lightning_seqmem.plan.ladder_state.LadderState`) keeps one per rung switched
on: where it was decided (``step``, ``seq_len``, ``batch_size``), what it did (``detail``), the peak
before (``before_bytes``, by ``before_method``: ``"measured"`` or ``"dry_run"``) and after
(``after_bytes``, None until a step ran), the rungs already on, why it was taken off (``removed``)
and whether the attention check after it ran (``checked``). A change is a new value (``with_*``).

A read-only :class:`~collections.abc.Mapping` (``event["name"]``, ``dict(event)``) over
:meth:`~MitigationEvent.to_dict`: keys in :data:`EVENT_KEYS`'s order (a checkpoint's as they came).

Example:
    >>> e = MitigationEvent("checkpointing", step=3, seq_len=512, batch_size=4, detail="4 blocks",
    ...                     before_bytes=10_000, before_method="measured",
    ...                     mitigations_before=("attention",))
    >>> e["name"], e.get("checked"), e.mitigations_before, e["mitigations_before"]
    ('checkpointing', None, ('attention',), ['attention'])
    >>> later = e.with_after(6_000).with_removed("it broke the step")
    >>> later.to_dict()["after_bytes"], later["removed"], list(later)[-2:], e.after_bytes
    (6000, 'it broke the step', ['mitigations_before', 'removed'], None)
    >>> MitigationEvent.from_dict(later.to_dict()) == later.to_dict() == later
    True
    >>> old = MitigationEvent.from_dict({"name": "attention", "step": 6, "seq_len": 64,
    ...                                  "detail": "sdpa", "before_bytes": 1112800,
    ...                                  "after_bytes": 1044192, "checked": True})
    >>> list(old), old.batch_size, old.checked
    (['name', 'step', 'seq_len', 'detail', 'before_bytes', 'after_bytes', 'checked'], None, True)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Optional

__all__ = ["EVENT_KEYS", "MitigationEvent"]

_BASE_KEYS = ("name", "step", "seq_len", "batch_size", "detail", "before_bytes", "before_method",
              "after_bytes", "mitigations_before")
EVENT_KEYS = _BASE_KEYS + ("removed", "checked")
"""The keys of an event's dict: a rung switched on's, then ``removed`` and ``checked`` once set."""


@dataclass(frozen=True, eq=False, repr=False)
class MitigationEvent(Mapping):
    """One rung switched on (see the module doc); equal to any mapping with the same items."""

    name: str
    step: int = 0
    seq_len: Optional[int] = None
    batch_size: Optional[int] = None
    detail: str = ""
    before_bytes: Optional[int] = None
    before_method: Optional[str] = None
    after_bytes: Optional[int] = None
    mitigations_before: tuple[str, ...] = ()
    removed: Optional[str] = None
    checked: bool = False
    # the keys it has, in order (default: the base keys, then removed/checked where set), and keys
    # of a newer version's event, kept as they came
    keys_present: tuple[str, ...] = field(default=(), compare=False)
    unknown: tuple[tuple[str, Any], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mitigations_before", tuple(self.mitigations_before))
        object.__setattr__(self, "unknown",
                           tuple((str(k), v) for k, v in dict(self.unknown).items()))
        if not self.keys_present:
            set_later = tuple(k for k in ("removed", "checked")
                              if getattr(self, k) not in (None, False))
            object.__setattr__(self, "keys_present",
                               _BASE_KEYS + set_later + tuple(k for k, _ in self.unknown))

    # the Mapping over the dict's keys
    def __getitem__(self, key: str) -> Any:
        if key not in self.keys_present:
            raise KeyError(key)
        if key not in EVENT_KEYS:
            return dict(self.unknown)[key]
        value = getattr(self, key)
        return list(value) if key == "mitigations_before" else value

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys_present)

    def __len__(self) -> int:
        return len(self.keys_present)

    def __repr__(self) -> str:
        return f"MitigationEvent({self.to_dict()!r})"

    def to_dict(self) -> dict[str, Any]:
        """The plain dict (what a checkpoint and a report hold)."""
        return {k: self[k] for k in self.keys_present}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "MitigationEvent":
        """Read :meth:`to_dict` back (keys as they came: older fewer, newer more); needs a ``name``.

        >>> MitigationEvent.from_dict({"step": 1})
        Traceback (most recent call last):
        ...
        ValueError: a mitigation event needs a `name`, got keys ['step']
        """
        if isinstance(data, MitigationEvent):
            return data
        if "name" not in data:
            raise ValueError(f"a mitigation event needs a `name`, got keys {sorted(data)}")
        known = {k: v for k, v in data.items() if k in EVENT_KEYS}
        if "checked" in known:
            known["checked"] = bool(known["checked"])
        unknown = tuple((k, v) for k, v in data.items() if k not in EVENT_KEYS)
        return cls(**known, keys_present=tuple(data), unknown=unknown)

    # changes: a new value, with the key added where it was not there
    def _with(self, key: str, value: Any) -> "MitigationEvent":
        keys = self.keys_present if key in self.keys_present else self.keys_present + (key,)
        return replace(self, **{key: value}, keys_present=keys)

    def with_after(self, after_bytes: int) -> "MitigationEvent":
        """This event with the peak measured after the rung went on."""
        return self._with("after_bytes", int(after_bytes))

    def with_checked(self) -> "MitigationEvent":
        """This event with the attention check after it done."""
        return self._with("checked", True)

    def with_removed(self, why: str) -> "MitigationEvent":
        """This event with its rung taken off again, and ``why``."""
        return self._with("removed", str(why))
