"""``AdviceQueue``: the advice the planner gave, each key once per run (what the callback warns).

Example:
    >>> q = AdviceQueue()
    >>> item = A.mitigation_failed("attention", "no SDPA")
    >>> q.advise(item); q.advise(A.mitigation_failed("attention", "no SDPA"))
    >>> [a.kind for a in q.take_advice()], q.take_advice(), list(q.warned.values())
    (['mitigation_failed'], [], ['mitigation_failed'])
"""

from __future__ import annotations

from typing import Any, Mapping

from lightning_seqmem.core import advice as A

__all__ = ["AdviceQueue"]


class AdviceQueue:
    """``warned`` (advice key -> kind, checkpointed) and the advice not taken yet."""

    def __init__(self) -> None:
        self.warned: dict[str, str] = {}  # advice key -> kind
        self._advice: list[A.Advice] = []

    def advise(self, item: A.Advice) -> None:
        """Queue ``item`` unless its key was given already."""
        if item.key not in self.warned:
            self.warned[item.key] = item.kind
            self._advice.append(item)

    def forget(self, kinds: "set[str] | frozenset[str]") -> None:
        """Advice of ``kinds`` may be given again (a resume under a changed budget)."""
        self.warned = {key: kind for key, kind in self.warned.items() if kind not in kinds}

    def take_advice(self) -> list[A.Advice]:
        """The advice given since the last call (the callback warns each once)."""
        out, self._advice = self._advice, []
        return out

    def state_dict(self) -> dict[str, Any]:
        """``warned`` (the keys given) and ``warned_kinds`` (key -> kind)."""
        return {"warned": sorted(self.warned), "warned_kinds": dict(self.warned)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (a key saved without its kind gets the kind its name says)."""
        kinds = state.get("warned_kinds") or {}
        self.warned = {str(k): str(kinds.get(k, A.kind_of_key(k))) for k in state.get("warned", [])}
