"""``LadderState``: which rungs are on, which may still go on, which do not apply here, and one
:class:`~lightning_seqmem.core.events.MitigationEvent` per rung switched on (changed only here, each
change a new value). Bookkeeping only: what to switch on is decided in :mod:`.decisions`.

Example:
    >>> ladder = LadderState(("attention", "checkpointing"))
    >>> ladder.next_rung({"attention": (False, "already SDPA"), "checkpointing": (True, "")})
    ('checkpointing', ['attention: already SDPA'])
    >>> ladder.switched_on("checkpointing", step=3, seq_len=512, batch_size=4, detail="4 blocks",
    ...                    before_bytes=10_000, before_method="measured")
    >>> ladder.applied, ladder.events[-1]["mitigations_before"], ladder.take_pending_events()
    (('checkpointing',), [], ['mitigation:checkpointing'])
    >>> ladder.measured_after(-1, 6_000)
    >>> ladder.removed("checkpointing", "it broke the step")
    >>> ladder.applied, ladder.allowed, ladder.events[-1].after_bytes, ladder.events[-1]["removed"]
    ((), ('attention',), 6000, 'it broke the step')
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

from lightning_seqmem.core.events import MitigationEvent
from lightning_seqmem.core.rungs import base_name, check_mitigations, check_setting
from lightning_seqmem.plan import choose

__all__ = ["LadderState"]


class LadderState:
    """``allowed`` (the rungs left to this run, in ladder order), ``applied`` (on now, in order),
    ``not_applicable`` (rung -> why, last checked; never advised), ``events`` (one per rung
    switched on: frozen values read as dicts; a copy; assigning events or dicts replaces them)."""

    def __init__(self, allowed: Sequence[str]) -> None:
        self.allowed: tuple[str, ...] = tuple(allowed)
        self.applied: tuple[str, ...] = ()
        self._events: list[MitigationEvent] = []
        self.not_applicable: dict[str, str] = {}
        self.pending_events: list[str] = []  # said in the next step's record

    @property
    def events(self) -> list[MitigationEvent]:
        """The events, in the order the rungs went on (a copy: change them through the methods)."""
        return list(self._events)

    @events.setter
    def events(self, events: Iterable[Mapping[str, Any]]) -> None:
        self._events = [MitigationEvent.from_dict(e) for e in events]

    def next_rung(self, applicable: choose.Applicability) -> tuple[Optional[str], list[str]]:
        """The first allowed rung not on that applies, and why each one before it does not."""
        skipped = []
        on = {base_name(n) for n in self.applied}
        for name in self.allowed:
            if name in on:
                continue
            ok, reason = applicable.get(name, (False, "its applicability was not checked"))
            if ok:
                return name, skipped
            skipped.append(f"{name}: {reason}")
        return None, skipped

    def switched_on(self, name: str, step: int, seq_len: Optional[int],
                    batch_size: Optional[int], detail: str, before_bytes: Optional[int],
                    before_method: Optional[str]) -> None:
        """``name`` went on (an upgrade replaces its entry), recorded as an event."""
        setting_before = self.applied
        self.applied = choose.combine(self.applied, (name,))
        self._events.append(MitigationEvent(name, step, seq_len, batch_size, detail, before_bytes,
                                            before_method, mitigations_before=setting_before))
        self.pending_events.append(f"mitigation:{name}")

    def measured_after(self, index: int, after_bytes: int) -> None:
        """Event ``index`` (-1: the last) with the peak measured after its rung went on."""
        self._events[index] = self._events[index].with_after(after_bytes)

    def mark_checked(self, index: int) -> None:
        """Event ``index`` (-1: the last) with the attention check after it done."""
        self._events[index] = self._events[index].with_checked()

    def failed(self, name: str) -> None:
        """``name`` could not go on: not tried again this run."""
        self.allowed = tuple(m for m in self.allowed if m != base_name(name))

    def removed(self, name: str, why: str) -> None:
        """``name`` was on and is off again: not tried again this run; its events say ``why``."""
        self.applied = tuple(m for m in self.applied if m != name)
        self.allowed = tuple(m for m in self.allowed if m != name)
        self.mark_removed((name,), why)

    def mark_removed(self, names: Sequence[str], why: str) -> None:
        """The events of ``names`` not marked yet say they were taken off, and ``why``."""
        self._events = [e.with_removed(why) if e.name in names and "removed" not in e else e
                        for e in self._events]

    def drop(self, names: Sequence[str]) -> None:
        """Rungs this run cannot take (set-up)."""
        self.allowed = tuple(m for m in self.allowed if m not in names)

    def allow(self, names: Sequence[str]) -> None:
        """The rungs this run may use from now on, in ladder order (a new fit, a resume)."""
        self.allowed = tuple(names)

    def keep_on(self, names: Sequence[str]) -> None:
        """The rungs on now, as found on the module (a new fit) or kept on resume; no event."""
        self.applied = tuple(names)

    def note_not_applicable(self, applicability: choose.Applicability) -> None:
        """Why each rung that does not apply here does not (the last check; never advised)."""
        self.not_applicable = {name: why for name, (ok, why) in applicability.items() if not ok}

    def take_pending_events(self) -> list[str]:
        """The events since the last step (``mitigation:<name>``), for the next step's record."""
        events, self.pending_events = self.pending_events, []
        return events

    def state_dict(self) -> dict[str, Any]:
        """The rungs on, those left, and their events."""
        return {"applied_mitigations": list(self.applied), "mitigations_left": list(self.allowed),
                "mitigation_events": [e.to_dict() for e in self._events]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (raises on a rung name this version does not know); the rungs
        left are those this run allows that were left then or are on."""
        self.applied = check_setting(list(state.get("applied_mitigations", ())),
                                     "applied_mitigations")
        if "mitigations_left" in state:
            left = set(check_mitigations(list(state["mitigations_left"])))
            self.allowed = tuple(m for m in self.allowed if m in left or m in self.applied)
        self.events = state.get("mitigation_events", [])
