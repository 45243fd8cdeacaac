"""``PlannerSettings``: the planner's configuration, a read-only view shared by its parts (a write
raises ``AttributeError``) over the frozen :class:`~lightning_seqmem.core.config.SeqMemConfig` (the
arguments, checked once) and :class:`RunFacts` (bound at set-up, replaced whole by ``bind_run``).

Example:
    >>> s = PlannerSettings(budget_bytes=1000, safety_margin=0.1)
    >>> s.usable_budget_bytes, s.within_limit(10**9), s.budget
    (900, True, Budget(total_bytes=1000, safety_margin=0.1, compare_reserved=False, block_bytes=1))
    >>> s.bind_run(compare_reserved=True, block_bytes=512, device_type="cuda")
    >>> s.compare_reserved, s.block_bytes, s.device_type
    (True, 512, 'cuda')
    >>> s.bind_run(blocks=1)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    TypeError: `bind_run` got `blocks`: pass only budget_bytes, compare_reserved, block_bytes,
    precision, device_type, dry_runner, measure_every_n_steps, length_limit, length_limit_reason,
    checkpoint_records, memory_records, rung_specs
    >>> s.block_bytes = 1  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    AttributeError: `PlannerSettings.block_bytes` is read-only: bind what the run decides with
    `bind_run(block_bytes=...)`
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Mapping, Optional

from lightning_seqmem.core.config import SeqMemConfig
from lightning_seqmem.core.rung_spec import RungSpec
from lightning_seqmem.core.rungs import rung_specs, spec
from lightning_seqmem.plan.checkpoint import CHECKPOINT_LAST_RECORDS, MEMORY_RECORDS

__all__ = ["SETTING_NAMES", "setting_write_error", "Budget", "PlannerSettings", "RunFacts",
           "planner_config"]


@dataclass(frozen=True)
class RunFacts:
    """What the run binds at set-up (:meth:`PlannerSettings.bind_run`); defaults: a CPU run's."""

    budget_bytes: Optional[int] = None  # the budget given, else the device's memory (CUDA)
    compare_reserved: bool = False  # judge against reserved memory (the CUDA caching allocator)
    block_bytes: int = 1  # allocation granularity of traced steps (512 for CUDA)
    precision: str = "32-true"
    device_type: str = "cpu"  # for advice that fits the machine
    # (seq_len, batch_size, mitigations) -> (peak, phase peaks), or raises
    dry_runner: Optional[Callable[..., Any]] = None
    measure_every_n_steps: int = 1  # the configured one, raised for a compiled module
    length_limit: Optional[int] = None  # the model's longest sequence (positions); None: no limit
    length_limit_reason: str = ""  # e.g. "config.max_position_embeddings=2048"
    checkpoint_records: int = CHECKPOINT_LAST_RECORDS  # see checkpoint.compact_records
    memory_records: int = MEMORY_RECORDS  # past this many, `records` is compacted
    rung_specs: Mapping[str, RungSpec] = field(default_factory=rung_specs, repr=False)

    @classmethod
    def of(cls, config: SeqMemConfig, **facts: Any) -> "RunFacts":
        """The facts before set-up binds any: the configured budget and rate, and ``facts``."""
        return cls(**{"budget_bytes": config.memory_budget_bytes,
                      "measure_every_n_steps": config.measure_every_n_steps, **facts})


_RUN_FIELDS = tuple(f.name for f in fields(RunFacts))
_CONFIG_FIELDS = tuple(f.name for f in fields(SeqMemConfig) if f.init)


@dataclass(frozen=True)
class Budget:
    """A step's budget: ``total_bytes`` (None: none), the fraction kept free, how memory counts.

    >>> Budget(10_000, 0.1).usable_bytes, Budget(None, 0.1).usable_bytes
    (9000, None)
    """

    total_bytes: Optional[int]
    safety_margin: float
    compare_reserved: bool = False
    block_bytes: int = 1

    @property
    def usable_bytes(self) -> Optional[int]:
        """``total × (1 − safety_margin)``, or None without a budget."""
        return (None if self.total_bytes is None
                else int(self.total_bytes * (1 - self.safety_margin)))


def _read(part: str, name: str) -> property:
    """``settings.name`` reads ``settings.part.name``."""
    return property(lambda self: getattr(getattr(self, part), name), doc=f"``{part}.{name}``")


class PlannerSettings:
    """Reads ``config`` and ``run_facts`` by name; built from both, or their fields (unchecked)."""

    warmup_steps = _read("config", "warmup_steps")
    tolerance = _read("config", "tolerance")
    safety_margin = _read("config", "safety_margin")
    curriculum = _read("config", "curriculum")
    warmup_steps_after_change = _read("config", "warmup_steps_after_change")
    trace_lengths = _read("config", "trace_lengths")
    budget_bytes = _read("run_facts", "budget_bytes")
    compare_reserved = _read("run_facts", "compare_reserved")
    block_bytes = _read("run_facts", "block_bytes")
    precision = _read("run_facts", "precision")
    device_type = _read("run_facts", "device_type")
    dry_runner = _read("run_facts", "dry_runner")
    measure_every_n_steps = _read("run_facts", "measure_every_n_steps")
    length_limit = _read("run_facts", "length_limit")
    length_limit_reason = _read("run_facts", "length_limit_reason")
    checkpoint_records = _read("run_facts", "checkpoint_records")
    memory_records = _read("run_facts", "memory_records")
    rung_specs = _read("run_facts", "rung_specs")

    def __init__(self, config: Optional[SeqMemConfig] = None, run_facts: Optional[RunFacts] = None,
                 **values: Any) -> None:
        unknown = sorted(set(values) - set(_RUN_FIELDS) - set(_CONFIG_FIELDS))
        if unknown or (values and (config is not None or run_facts is not None)):
            raise TypeError("`PlannerSettings` got "
                            f"{', '.join(unknown) or 'fields besides config/run_facts'}: pass "
                            "a SeqMemConfig and RunFacts, or fields of theirs by keyword")
        if "dry_run" in values and not isinstance(values["dry_run"], bool):
            raise TypeError("`dry_run` is the callback's bool (start a dry run or not), got "
                            f"{values['dry_run']!r}: pass the dry run itself as `dry_runner`")
        if config is None:  # `budget_bytes` is the budget given
            given = {k: v for k, v in values.items() if k in _CONFIG_FIELDS}
            config = SeqMemConfig(**given, **({"memory_budget": values["budget_bytes"]}
                                              if "budget_bytes" in values else {}), checked=False)
        if run_facts is None:
            bound = {k: v for k, v in values.items()
                     if k in _RUN_FIELDS and k != "measure_every_n_steps"}
            run_facts = RunFacts.of(config, **bound)
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "run_facts", run_facts)

    def __setattr__(self, name: str, value: Any) -> None:
        raise setting_write_error("PlannerSettings", name)

    def __repr__(self) -> str:
        return f"PlannerSettings({self.config!r}, {self.run_facts!r})"

    @property
    def budget(self) -> Budget:
        """The budget this run judges by (the one given, else the device's) and how it counts."""
        return Budget(self.budget_bytes, self.safety_margin, self.compare_reserved,
                      self.block_bytes)

    @property
    def usable_budget_bytes(self) -> Optional[int]:
        """``budget × (1 − safety_margin)``, or None without a budget."""
        return self.budget.usable_bytes

    def bound_of(self, fc: Any) -> int:
        """The bound of forecast ``fc`` compared with the budget: reserved on CUDA, else upper."""
        return fc.reserved_upper_bytes if self.compare_reserved else fc.upper_bytes

    def spec(self, name: str) -> RungSpec:
        """The spec of rung (or variant) ``name`` among those bound to this run (``rung_specs``).

        >>> from dataclasses import replace
        >>> s = PlannerSettings()
        >>> s.spec("checkpointing:selective").step_time_prior
        0.15
        >>> ck = replace(s.spec("checkpointing"), step_time_prior=0.1)
        >>> s.bind_run(rung_specs={**s.rung_specs, "checkpointing": ck})
        >>> s.spec("checkpointing").step_time_prior
        0.1
        """
        return spec(name, self.rung_specs)

    def within_limit(self, seq_len: int) -> bool:
        """Whether the model can take ``seq_len`` tokens at all (``length_limit``: positions)."""
        return self.length_limit is None or int(seq_len) <= self.length_limit

    def clip_to_limit(self, seq_len: int) -> int:
        """``seq_len``, or the model's ``length_limit`` where that is shorter."""
        return seq_len if self.length_limit is None else min(seq_len, self.length_limit)

    def bind_run(self, **changes: Any) -> None:
        """Bind :class:`RunFacts` fields at set-up, replacing the facts whole for every part."""
        for name in changes:
            if name not in _RUN_FIELDS:
                raise TypeError(f"`bind_run` got `{name}`: pass only {', '.join(_RUN_FIELDS)}")
        object.__setattr__(self, "run_facts", replace(self.run_facts, **changes))


SETTING_NAMES = (frozenset(_RUN_FIELDS) | frozenset(_CONFIG_FIELDS)
                 | {"budget", "usable_budget_bytes"})
"""The names a :class:`PlannerSettings` reads (a part holding the settings refuses their writes)."""


def setting_write_error(owner: str, name: str) -> AttributeError:
    """The error for a write of setting ``name`` on ``owner``, naming what to do instead.

    >>> print(setting_write_error("SeqMemPlanner", "block_bytes"))  # doctest: +NORMALIZE_WHITESPACE
    `SeqMemPlanner.block_bytes` is read-only (read it as `settings.block_bytes`): bind what the run
    decides with `bind_run(block_bytes=...)`
    """
    where = "" if owner == "PlannerSettings" else f" (read it as `settings.{name}`)"
    if name in _RUN_FIELDS:
        return AttributeError(f"`{owner}.{name}` is read-only{where}: bind what the run decides "
                              f"with `bind_run({name}=...)`")
    return AttributeError(f"`{owner}.{name}` is read-only{where}: the arguments are a frozen "
                          "SeqMemConfig, and what the run decides goes through `bind_run` "
                          f"({', '.join(_RUN_FIELDS)})")


def planner_config(config: Optional[SeqMemConfig], **keywords: Any) -> SeqMemConfig:
    """``config``, else one of the planner's ``keywords`` (unchecked); a keyword
    away from its default next to a ``config`` is a ``TypeError`` (the config holds it).

    >>> planner_config(None, warmup_steps=0, memory_budget=4096).warmup_steps
    0
    >>> planner_config(SeqMemConfig(), warmup_steps=3)
    Traceback (most recent call last):
    ...
    TypeError: `SeqMemPlanner` got `config` and `warmup_steps=3`: set it in the SeqMemConfig
    """
    if config is None:
        return SeqMemConfig(**keywords, checked=False)
    defaults = SeqMemConfig.defaults()
    for name, value in keywords.items():
        if value != defaults[name]:
            shown = "memory_budget_bytes" if name == "memory_budget" else name
            raise TypeError(f"`SeqMemPlanner` got `config` and `{shown}={value!r}`: "
                            "set it in the SeqMemConfig")
    return config
