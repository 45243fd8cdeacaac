"""Sequence-length curriculum: a validated, serialisable schedule of lengths.

:class:`Curriculum` only says which lengths to train at, in order; the callback decides when to move
on (after ``steps_per_stage`` steps, when the next length is forecast to fit) and
:func:`~lightning_seqmem.measure.batch.set_batch_sequence_length` applies a length to a batch."""

from __future__ import annotations

import math
import numbers

from lightning_seqmem.core.checks import check_int
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Curriculum", "stage_for_step"]

_SCHEDULES = ("geometric", "linear")


@dataclass(frozen=True)
class Curriculum:
    """A strictly increasing schedule of lengths from ``start`` to ``target``, each rounded down to
    a multiple of ``multiple_of`` (never below it); a bad argument raises ``ValueError``.

    >>> Curriculum(start=64, target=1010).stages
    (64, 128, 256, 512, 1008)
    >>> Curriculum(start=64, target=256, growth=1.5).stages
    (64, 96, 144, 216, 256)
    >>> Curriculum(start=128, target=512, schedule="linear", step_size=128).stages
    (128, 256, 384, 512)
    >>> c = Curriculum(start=64, target=1024)
    >>> c.next_length(128), c.next_length(1024), c.capped(600)
    (256, None, (64, 128, 256, 512, 600))
    >>> Curriculum.from_dict(c.to_dict()) == c
    True
    """

    start: int
    """First length, in tokens (>= ``multiple_of``; rounded down to a multiple of it)."""
    target: int
    """Last length, in tokens (>= ``start``; rounded down to a multiple of ``multiple_of``)."""
    growth: float = 2.0
    """Geometric schedule: each length is the previous one times ``growth`` (> 1)."""
    steps_per_stage: int = 20
    """Optimizer steps at each length (>= 1), warm-ups included: accumulation windows kept whole."""
    multiple_of: int = 8
    """Every length is a multiple of this, in tokens (>= 1; 8 or 64 suit tensor cores)."""
    schedule: str = "geometric"
    """``"geometric"`` (multiply by ``growth``) or ``"linear"`` (add ``step_size``)."""
    step_size: int | None = None
    """Linear schedule: tokens added per stage, a positive multiple of ``multiple_of``."""
    truncate: bool = True
    """``True`` cuts rows to the length; ``False`` reshapes rows so no token is dropped."""
    _stages: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen dataclass: normalise the validated values once
        set_(self, "start", check_int("start", self.start, 1, accepted="an int >= 1"))
        set_(self, "target", check_int("target", self.target, 1, accepted="an int >= 1"))
        set_(self, "steps_per_stage", check_int("steps_per_stage", self.steps_per_stage, 1,
                                                accepted="an int >= 1"))
        set_(self, "multiple_of", check_int("multiple_of", self.multiple_of, 1,
                                            accepted="an int >= 1"))
        if self.start < self.multiple_of:
            raise ValueError(f"`start` must be >= `multiple_of`={self.multiple_of}, got "
                             f"start={self.start}.")
        if self.target < self.start:
            raise ValueError(f"`target` must be >= `start`={self.start}, got target={self.target}.")
        if self.schedule not in _SCHEDULES:
            raise ValueError(f"`schedule` must be one of {_SCHEDULES}, got {self.schedule!r}.")
        if not isinstance(self.truncate, bool):
            raise ValueError(f"`truncate` must be a bool, got {self.truncate!r}.")
        growth = self.growth
        if isinstance(growth, bool) or not isinstance(growth, numbers.Real):
            raise ValueError(f"`growth` must be a number > 1, got {growth!r}.")
        set_(self, "growth", float(growth))
        if self.schedule == "geometric":
            if not (1.0 < self.growth < math.inf):
                raise ValueError(f"`growth` must be a finite number > 1, got {growth!r}.")
            if self.step_size is not None:
                raise ValueError("`step_size` is only used by schedule='linear'; got"
                                 f" step_size={self.step_size!r} with schedule='geometric'. Leave"
                                 " it None, or set schedule='linear'.")
            stages = _geometric(self.start, self.target, self.growth, self.multiple_of)
        else:
            if self.step_size is None:
                raise ValueError("`step_size` is required with schedule='linear': a positive "
                                 f"multiple of `multiple_of`={self.multiple_of}, in tokens.")
            set_(self, "step_size", check_int("step_size", self.step_size, self.multiple_of,
                                              accepted=f"an int >= {self.multiple_of}"))
            if self.step_size % self.multiple_of:
                raise ValueError("`step_size` must be a positive multiple of `multiple_of`="
                                 f"{self.multiple_of}, got step_size={self.step_size}.")
            stages = _linear(self.start, self.target, self.step_size, self.multiple_of)
        set_(self, "_stages", stages)

    @property
    def stages(self) -> tuple[int, ...]:
        """The lengths, in tokens, strictly increasing; the last is ``target`` rounded down."""
        return self._stages

    @property
    def num_stages(self) -> int:
        """How many lengths the schedule has."""
        return len(self._stages)

    def round_down(self, seq_len: int) -> int:
        """``seq_len`` rounded down to a multiple of ``multiple_of``; ``ValueError`` below it.

        >>> Curriculum(start=64, target=1024).round_down(1010)
        1008
        """
        seq_len = check_int("seq_len", seq_len, self.multiple_of,
                            accepted=f"an int >= {self.multiple_of}")
        return seq_len - seq_len % self.multiple_of

    def stage_index(self, seq_len: int) -> int:
        """Index of the last stage not longer than ``seq_len`` (a length between two stages, say a
        capped one, belongs to the lower); ``ValueError`` below the first stage.

        >>> Curriculum(start=64, target=1024).stage_index(300)
        2
        """
        seq_len = check_int("seq_len", seq_len, self._stages[0],
                            accepted=f"an int >= {self._stages[0]}")
        return sum(1 for length in self._stages if length <= seq_len) - 1

    def next_length(self, seq_len: int) -> int | None:
        """The first stage longer than ``seq_len``, or ``None`` at (or past) the target."""
        seq_len = check_int("seq_len", seq_len, 1, accepted="an int >= 1")
        return next((length for length in self._stages if length > seq_len), None)

    def capped(self, max_seq_len: int) -> tuple[int, ...]:
        """The stages up to ``max_seq_len``, then ``max_seq_len`` rounded down where it lies between
        the last stage kept and the next (none past the target); ``ValueError`` below ``start``."""
        max_seq_len = check_int("max_seq_len", max_seq_len, self.start,
                                accepted=f"an int >= {self.start}")
        kept = tuple(length for length in self._stages if length <= max_seq_len)
        cap = self.round_down(max_seq_len)
        if len(kept) < len(self._stages) and cap > kept[-1]:
            kept += (cap,)
        return kept

    def to_dict(self) -> dict[str, Any]:
        """The constructor arguments as plain values (for checkpoints and YAML)."""
        return {"start": self.start, "target": self.target, "growth": self.growth,
                "steps_per_stage": self.steps_per_stage, "multiple_of": self.multiple_of,
                "schedule": self.schedule, "step_size": self.step_size, "truncate": self.truncate}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Curriculum:
        """Rebuild from :meth:`to_dict`; missing keys take their defaults, unknown keys raise."""
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise ValueError(f"Unknown Curriculum keys {unknown}; accepted: {list(_FIELDS)}.")
        return cls(**dict(data))


_FIELDS = (
    "start", "target", "growth", "steps_per_stage", "multiple_of", "schedule", "step_size",
    "truncate",
)  # fmt: skip


def stage_for_step(curriculum: Curriculum, step: int) -> int:
    """Stage index at global ``step`` (from 0) if every stage took ``steps_per_stage`` steps.

    >>> c = Curriculum(start=64, target=256, steps_per_stage=10)
    >>> [stage_for_step(c, s) for s in (0, 9, 10, 25, 1000)]
    [0, 0, 1, 2, 2]
    """
    step = check_int("step", step, 0, accepted="an int >= 0")
    return min(step // curriculum.steps_per_stage, curriculum.num_stages - 1)


def _geometric(start: int, target: int, growth: float, multiple_of: int) -> tuple[int, ...]:
    """``start * growth**k`` rounded down, distinct and below the target, then the target."""
    top = target - target % multiple_of
    lengths: list[int] = []
    k = 0
    while True:
        try:
            exact = start * growth**k
        except OverflowError:
            break
        if exact >= top:
            break
        length = max(multiple_of, math.floor(exact + 1e-9) // multiple_of * multiple_of)
        if length >= top:
            break
        if not lengths or length > lengths[-1]:
            lengths.append(length)
        # jump to the first k that can give a new length (with growth near 1 many k round down
        # to the same one); the margin keeps float error from jumping past one
        wanted = math.log((lengths[-1] + multiple_of) / start) / math.log(growth)
        k = max(k + 1, math.ceil(wanted - 1e-9))
    lengths.append(top)
    return tuple(lengths)


def _linear(start: int, target: int, step_size: int, multiple_of: int) -> tuple[int, ...]:
    """``start`` rounded down, then ``+ step_size`` while below the target, then the target."""
    top = target - target % multiple_of
    first = start - start % multiple_of
    return (*range(first, top, step_size), top)
