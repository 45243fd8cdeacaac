"""Where the peak of a training step sits: its phase and the kinds of tensor alive there.

A :class:`PeakSite` says *why* a step peaks where it does, so a user sees why a lever helps or not:
checkpointing when saved activations make the peak, a fused loss when the logits do, an efficient
attention kernel when the scores do, none when parameters, gradients and optimizer state fill the
device. Computed by :func:`lightning_seqmem.diagnostics.peak_trace.peak_site`; here only the value.

Phases (:data:`PEAK_PHASES`): ``forward`` (its end: saved activations), ``loss`` (the forward's
peak reached in the logits and loss), ``backward``, ``recompute`` (the backward's peak reached while
a checkpointed forward is recomputed), ``optimizer``, ``existing`` (nothing the step made rose
above what was alive before it).

Kinds (:data:`PEAK_KINDS`): ``parameters``, ``gradients``, ``optimizer_state``,
``saved_activations`` (made in the forward, alive when the backward starts), ``attention_scores``
(two dimensions equal to the sequence length), ``logits`` (the output layer and the loss, and their
gradients), ``recompute``, ``other`` (the batch, activation gradients, temporaries).

Example:
    >>> site = PeakSite("backward", (("attention_scores", 600), ("saved_activations", 300),
    ...                              ("parameters", 100)))
    >>> site.peak_bytes, site.top_kind
    (1000, 'attention_scores')
    >>> site.describe()
    'backward: attention scores 60%, saved activations 30%, parameters 10%'
    >>> PeakSite.from_dict(site.to_dict()) == site
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from lightning_seqmem.core.checks import check_choice

__all__ = ["PEAK_KINDS", "PEAK_PHASES", "PeakSite"]

PEAK_PHASES = ("existing", "forward", "loss", "backward", "recompute", "optimizer")
"""Where a step's peak can sit (see the module docstring)."""

PEAK_KINDS = ("parameters", "gradients", "optimizer_state", "saved_activations", "attention_scores",
              "logits", "recompute", "other")
"""What the bytes alive at the peak are for (see the module docstring), in display order."""


@dataclass(frozen=True)
class PeakSite:
    """The phase holding a step's peak and the kinds of tensor alive there: ``top_kinds`` holds
    ``(kind, bytes)`` for every kind with bytes at the peak, largest first (their sum is the peak).
    ``op`` is the op whose allocation reached the peak ("" when unknown)."""

    phase: str
    top_kinds: tuple[tuple[str, int], ...]
    op: str = ""

    def __post_init__(self) -> None:
        check_choice("phase", self.phase, PEAK_PHASES)
        unknown = [k for k, _ in self.top_kinds if k not in PEAK_KINDS]
        if unknown:
            raise ValueError(f"`top_kinds` holds unknown kinds {unknown}; accepted: {PEAK_KINDS}")

    @classmethod
    def of(cls, phase: str, bytes_by_kind: Mapping[str, int], op: str = "") -> "PeakSite":
        """From ``kind -> bytes``: kinds without bytes left out, the largest first.

        >>> kinds = {"parameters": 10, "optimizer_state": 20, "logits": 0}
        >>> PeakSite.of("optimizer", kinds).top_kinds
        (('optimizer_state', 20), ('parameters', 10))
        """
        kinds = sorted(((k, int(v)) for k, v in bytes_by_kind.items() if v > 0),
                       key=lambda kv: (-kv[1], PEAK_KINDS.index(kv[0])))
        return cls(phase, tuple(kinds), op)

    @property
    def peak_bytes(self) -> int:
        return sum(b for _, b in self.top_kinds)

    @property
    def top_kind(self) -> Optional[str]:
        """The kind holding the most bytes at the peak (None: nothing alive)."""
        return self.top_kinds[0][0] if self.top_kinds else None

    def share(self, kind: str) -> float:
        """``kind``'s share of the peak (0 when absent).

        >>> PeakSite("forward", (("logits", 3), ("other", 1))).share("logits")
        0.75
        """
        total = self.peak_bytes
        return dict(self.top_kinds).get(kind, 0) / total if total else 0.0

    def describe(self, n: int = 3) -> str:
        """One line: the phase, then the ``n`` largest kinds with their share of the peak."""
        total = self.peak_bytes
        parts = ([f"{k.replace('_', ' ')} {b / total:.0%}" for k, b in self.top_kinds[:n]]
                 if total else [])
        return f"{self.phase}: {', '.join(parts)}" if parts else self.phase

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (``top_kinds`` as ``[kind, bytes]`` pairs)."""
        return {"phase": self.phase, "top_kinds": [[k, b] for k, b in self.top_kinds],
                "op": self.op, "peak_bytes": self.peak_bytes, "describe": self.describe()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PeakSite":
        return cls(str(d["phase"]), tuple((str(k), int(b)) for k, b in d["top_kinds"]),
                   str(d.get("op", "")))
