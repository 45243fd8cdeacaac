"""``SeqMemConfig``: every argument of :class:`~lightning_seqmem.SeqMemCallback`, checked, frozen.

The callback builds one (``cb.config``, plain values) for its planner; nothing writes it after: what
the run decides at set-up (budget, allocator, dry run, length limit) is the planner's
:class:`~lightning_seqmem.plan.settings.RunFacts`. Every check raises ``ValueError`` naming the
argument, its value and what is accepted.

Example:
    >>> c = SeqMemConfig(memory_budget="1GiB", safety_margin=0.25, mitigations=["checkpointing"])
    >>> c.memory_budget_bytes, c.safety_margin, c.mitigations, c.host_memory_budget_bytes
    (1073741824, 0.25, ('checkpointing',), None)
    >>> SeqMemConfig(host_memory_budget="64GiB").host_memory_budget_bytes
    68719476736
    >>> c.warmup_steps = 5
    Traceback (most recent call last):
    ...
    dataclasses.FrozenInstanceError: cannot assign to field 'warmup_steps'
    >>> SeqMemConfig(probe="nvml")
    Traceback (most recent call last):
    ...
    ValueError: `probe` must be one of ('auto', 'cuda', 'tracker'), got 'nvml'
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field, fields
from typing import Any, Callable, Optional, Sequence, Union

from lightning_seqmem.core.checks import check_choice, check_fraction, check_int
from lightning_seqmem.core.curriculum import Curriculum
from lightning_seqmem.core.rungs import MITIGATIONS, check_mitigations
from lightning_seqmem.core.units import parse_bytes

__all__ = ["PROBE_NAMES", "SeqMemConfig", "check_seq_len_fn"]

PROBE_NAMES = ("auto", "cuda", "tracker")
"""Accepted values of ``SeqMemCallback(probe=...)``."""

SeqLenFn = Callable[[Any], "tuple[int, int]"]


def check_seq_len_fn(value: Any) -> None:
    """``ValueError`` unless ``value`` (``seq_len_fn``) is None or a callable."""
    if value is not None and not callable(value):
        raise ValueError("`seq_len_fn` must be a callable batch -> (batch_size, seq_len) or None, "
                         f"got {value!r}")


@dataclass(frozen=True)
class SeqMemConfig:
    """The callback's arguments (see :class:`~lightning_seqmem.SeqMemCallback` for each), checked in
    ``__post_init__``; ``memory_budget_bytes`` is ``memory_budget`` parsed (None: no budget),
    ``host_memory_budget_bytes`` is ``host_memory_budget`` parsed (None: the machine's RAM), what
    host memory offload may use. ``checked=False`` skips all checks but the mitigations' (a planner
    driven by hand: ``warmup_steps=0`` fits from the first step).

    Example:
        >>> SeqMemConfig(warmup_steps=0)
        Traceback (most recent call last):
        ...
        ValueError: `warmup_steps` must be an int ≥ 1 (the first step has no optimizer state), got 0
        >>> SeqMemConfig(warmup_steps=0, memory_budget=4096, checked=False).memory_budget_bytes
        4096
    """

    warmup_steps: int = 2
    tolerance: float = 0.15
    probe: str = "auto"
    memory_budget: Optional[Union[int, str]] = None
    safety_margin: float = 0.1
    curriculum: Optional[Curriculum] = None
    warmup_steps_after_change: int = 1
    trace_lengths: int = 3
    measure_every_n_steps: int = 1
    seq_len_fn: Optional[SeqLenFn] = None
    mitigations: Sequence[str] = MITIGATIONS
    breakdown: bool = False
    dry_run: bool = True
    name: Optional[str] = None
    summary: bool = True
    host_memory_budget: Optional[Union[int, str]] = None
    memory_budget_bytes: Optional[int] = field(init=False)
    host_memory_budget_bytes: Optional[int] = field(init=False)  # None: the RAM, read at set-up
    checked: InitVar[bool] = True

    def __post_init__(self, checked: bool) -> None:
        if checked:
            self._check()
        mitigations, budget, host = (check_mitigations(self.mitigations), self.memory_budget,
                                     self.host_memory_budget)
        if checked and budget is not None:
            budget = parse_bytes(budget, "memory_budget")
        if checked and host is not None:
            host = parse_bytes(host, "host_memory_budget")
        self._set(mitigations=mitigations, memory_budget_bytes=budget,
                  host_memory_budget_bytes=host, tolerance=float(self.tolerance),
                  safety_margin=float(self.safety_margin))

    def _set(self, **values: Any) -> None:
        for name, value in values.items():  # (frozen: only here, while it is built)
            object.__setattr__(self, name, value)

    def _check(self) -> None:
        """Every argument but the budget and the mitigations, in the callback's order."""
        check_int("warmup_steps", self.warmup_steps, 1,
                  accepted="an int ≥ 1 (the first step has no optimizer state)")
        check_int("warmup_steps_after_change", self.warmup_steps_after_change, 0,
                  accepted="an int ≥ 0")
        check_int("trace_lengths", self.trace_lengths, 2, 8)
        check_int("measure_every_n_steps", self.measure_every_n_steps, 1, accepted="an int ≥ 1")
        check_fraction("tolerance", self.tolerance, 0, 1)
        check_fraction("safety_margin", self.safety_margin, 0, 1, closed_low=True)
        check_choice("probe", self.probe, PROBE_NAMES)
        if self.curriculum is not None and not isinstance(self.curriculum, Curriculum):
            raise ValueError("`curriculum` must be a lightning_seqmem.Curriculum or None, got "
                             f"{type(self.curriculum).__name__}")
        check_seq_len_fn(self.seq_len_fn)
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ValueError(f"`name` must be a non-empty string or None, got {self.name!r}")
        for name in ("breakdown", "dry_run", "summary"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Each argument's default, by name.

        >>> d = SeqMemConfig.defaults()
        >>> d["warmup_steps"], "memory_budget_bytes" in d, list(d)[-1]
        (2, False, 'host_memory_budget')
        """
        return {f.name: f.default for f in fields(cls) if f.init}
