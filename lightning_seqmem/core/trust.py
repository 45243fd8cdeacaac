"""Every predictor against every measured step it could have predicted (plain values, no torch).

The planner has three predictors of a step's peak: the dry run (``"dry_run"``), the timeline
replay (``"replay"``) and the quadratic fit (``"quadratic"``). Each measured step tests each one
that can answer for its shape (:meth:`PredictorChecks.add`). A predictor whose latest check at some
shape missed by more than the tolerance is *wrong* (:meth:`PredictorChecks.wrong`): not trusted for
decisions until a later check at that shape is within the tolerance. None is trusted on reputation.

>>> checks = PredictorChecks(tolerance=0.15)
>>> checks.add((), Check("dry_run", 64, 4, predicted_bytes=700, measured_bytes=1000))
True
>>> checks.wrong((), "dry_run").relative_error, checks.wrong((), "replay") is None
(-0.3, True)
>>> checks.add((), Check("dry_run", 64, 4, 990, 1000)), checks.wrong((), "dry_run") is None
(False, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

PREDICTORS = ("dry_run", "replay", "quadratic")
NAMES = {"dry_run": "the dry run", "replay": "the timeline replay",
         "quadratic": "the quadratic fit"}


@dataclass(frozen=True)
class Check:
    """What ``method`` predicted for a step at ``(seq_len, batch_size)``, and what it measured."""

    method: str
    seq_len: int
    batch_size: int
    predicted_bytes: int
    measured_bytes: int

    @property
    def relative_error(self) -> float:
        """(predicted − measured) / measured: negative is an under-prediction."""
        return (self.predicted_bytes - self.measured_bytes) / max(self.measured_bytes, 1)

    @property
    def miss(self) -> str:
        """The check in words: "it predicted -30.0% for the step measured at seq_len=64 …"."""
        return (f"it predicted {self.relative_error:+.1%} for the step measured at "
                f"seq_len={self.seq_len} (batch {self.batch_size})")


class PredictorChecks:
    """The latest check of each predictor at each measured shape, per setting (mitigations on)."""

    def __init__(self, tolerance: float = 0.15) -> None:
        self.tolerance = float(tolerance)
        self.latest: dict[tuple, Check] = {}  # (setting, method, seq_len, batch_size) -> check

    def add(self, setting: tuple[str, ...], check: Check) -> bool:
        """Record ``check``; True when it makes ``check.method`` wrong where it was not before."""
        before = self.wrong(setting, check.method) is not None
        self.latest[(tuple(setting), check.method, check.seq_len, check.batch_size)] = check
        return not before and self.wrong(setting, check.method) is not None

    def wrong(self, setting: tuple[str, ...], method: str) -> Optional[Check]:
        """The worst latest miss beyond the tolerance of ``method`` with ``setting``, or None."""
        misses = [c for (s, m, _, _), c in self.latest.items()
                  if s == tuple(setting) and m == method
                  and abs(c.relative_error) > self.tolerance]
        return max(misses, key=lambda c: abs(c.relative_error), default=None)

    def count(self, setting: tuple[str, ...], method: str) -> int:
        """How many measured shapes checked ``method`` with ``setting``."""
        return sum(1 for (s, m, _, _) in self.latest if s == tuple(setting) and m == method)

    def right(self, setting: tuple[str, ...]) -> list[str]:
        """The predictors checked with ``setting`` and within the tolerance everywhere."""
        checked = {m for (s, m, _, _) in self.latest if s == tuple(setting)}
        return [m for m in PREDICTORS if m in checked and self.wrong(setting, m) is None]


__all__ = ["NAMES", "PREDICTORS", "Check", "PredictorChecks"]
