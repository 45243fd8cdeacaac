"""``AdviceQueue``: the advice the planner gave, each key once per run (what the callback warns).

Example:
    >>> from lightning_seqmem.core import advice as A
    >>> q = AdviceQueue()
    >>> q.advise(A.mitigation_failed("attention", "no SDPA")); q.advise(A.mitigation_failed("attention", "no SDPA"))
    >>> [a.kind for a in q.take_advice()], q.take_advice(), list(q.warned.values())
    (['mitigation_failed'], [], ['mitigation_failed'])
"""

from __future__ import annotations

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
