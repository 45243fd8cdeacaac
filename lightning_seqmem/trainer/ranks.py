"""Rank agreement for the callback: what every rank sends before and after each batch.

Every rank calls each function here at the same point of every batch, whatever happened locally
(a rank that failed sends a flag instead of data), so no rank ever enters a collective alone. With
one process they return their input.

* before a batch, :func:`agree_inputs`: the max over ranks of (failure, batch size, length) and,
  per rung, of "does not apply here" and "applies here"; then :func:`any_rank` of "this step runs
  a rung's one-time check" (every rank's step is then a warm-up);
* the decision is taken on rank zero and :func:`broadcast` to all;
* after a batch, :func:`gather_measurement`: every rank's measurement with its own length and batch
  size; the row with the highest peak is kept whole (never a peak with another rank's length)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, NamedTuple, Optional, Sequence

import torch

from lightning_seqmem.core.records import PHASES, StepMemory
from lightning_seqmem.core.rungs import rung_names

_INT_FIELDS = tuple(f.name for f in fields(StepMemory)
                    if f.name not in ("phase_peak_bytes", "fragmentation_fraction", "events"))


def _collective(trainer: Any, values: Sequence[int], op: str) -> list[Any]:
    tensor = torch.tensor(list(values), dtype=torch.int64, device=trainer.strategy.root_device)
    if op == "max":
        return trainer.strategy.reduce(tensor, reduce_op="max").tolist()
    return trainer.strategy.all_gather(tensor).reshape(trainer.world_size, -1).tolist()


def agree_inputs(trainer: Any, failed: bool, shape: Optional[tuple[int, int]],
                 applicable: dict[str, tuple[bool, str]], noop: Sequence[str] = (),
                 ) -> tuple[bool, Optional[tuple[int, int]], dict[str, tuple[bool, str]]]:
    """(any rank failed, max shape, applicability on every rank): a rung applies only where no rank
    refuses it and one applies it. A rung in ``noop`` changes nothing on this rank's batch
    (micro-batching one sample): it neither refuses nor applies here.

    Example (one process: the inputs as they are):
        >>> from types import SimpleNamespace as NS
        >>> agree_inputs(NS(world_size=1), False, (4, 64), {"microbatch": (True, "split")})
        (False, (4, 64), {'microbatch': (True, 'split')})
    """
    if trainer.world_size <= 1:
        return failed, shape, applicable
    b, L = shape if shape is not None else (-1, -1)
    names = rung_names()
    refused = [int(m not in noop and not applicable.get(m, (True, ""))[0]) for m in names]
    applies = [int(m not in noop and applicable.get(m, (False, ""))[0]) for m in names]
    out = _collective(trainer, [int(failed), b, L, *refused, *applies], "max")
    n = len(names)
    agreed = {}
    for m, no, yes in zip(names, out[3:3 + n], out[3 + n:]):
        if m in applicable:
            ok, reason = applicable[m]
            if no:
                other = "it does not apply on another rank"
                agreed[m] = (False, reason if not ok and m not in noop else other)
            elif not yes:
                agreed[m] = (False, reason if m in noop else "it applies on no rank")
            else:
                agreed[m] = (True, reason if ok else f"{reason} here; another rank needs it")
    return bool(out[0]), (None if out[1] < 0 else (int(out[1]), int(out[2]))), agreed


def any_rank(trainer: Any, flag: bool) -> bool:
    """Whether ``flag`` holds on some rank."""
    return flag if trainer.world_size <= 1 else bool(_collective(trainer, [int(flag)], "max")[0])


def all_ok(trainer: Any, ok: bool) -> bool:
    """Whether ``ok`` holds on every rank."""
    return not any_rank(trainer, not ok)


def same_on_every_rank(trainer: Any, value: int) -> bool:
    """Whether ``value`` is the same on every rank."""
    if trainer.world_size <= 1:
        return True
    high, negated_low = _collective(trainer, [value, -value], "max")
    return high == -negated_low


def broadcast(trainer: Any, obj: Any) -> Any:
    """Rank zero's ``obj`` on every rank."""
    return obj if trainer.world_size <= 1 else trainer.strategy.broadcast(obj, src=0)


class MeasuredRow(NamedTuple):
    """One rank's row in :func:`gather_measurement`, read by name (it travels as a flat list of
    ints, -1 for none: :meth:`to_list`, :meth:`from_list`).

    Example:
        >>> memory = StepMemory(900, {"forward": 900, "backward": 700}, 100, 120)
        >>> row = MeasuredRow.of(False, True, memory, (2, 64))
        >>> back = MeasuredRow.from_list(row.to_list())
        >>> back == row, back.peak_bytes, back.seq_len, back.batch_size
        (True, 900, 64, 2)
        >>> back.memory(None).phase_peak_bytes
        {'forward': 900, 'backward': 700}
        >>> MeasuredRow.of(True, False, None, None).peak_bytes  # a rank that failed: no measurement
        -1
    """

    failed: int
    flag: int
    seq_len: int
    batch_size: int
    counters: tuple[int, ...]  # StepMemory's int fields (_INT_FIELDS), -1 for None
    phases: tuple[int, ...]  # the phase peaks (PHASES), -1 where a phase has none

    @classmethod
    def of(cls, failed: bool, flag: bool, memory: Optional[StepMemory],
           shape: Optional[tuple[int, int]]) -> "MeasuredRow":
        """This rank's row: its measurement at ``shape = (batch_size, seq_len)``, or -1s."""
        if memory is None or shape is None or failed:
            return cls(int(failed), int(flag), -1, -1, (-1,) * len(_INT_FIELDS),
                       (-1,) * len(PHASES))
        counters = tuple(-1 if getattr(memory, f) is None else int(getattr(memory, f))
                         for f in _INT_FIELDS)
        return cls(0, int(flag), shape[1], shape[0], counters,
                   tuple(memory.phase_peak_bytes.get(p, -1) for p in PHASES))

    def to_list(self) -> list[int]:
        return [self.failed, self.flag, self.seq_len, self.batch_size, *self.counters, *self.phases]

    @classmethod
    def from_list(cls, values: Sequence[int]) -> "MeasuredRow":
        n = 4 + len(_INT_FIELDS)
        return cls(*(int(v) for v in values[:4]), tuple(int(v) for v in values[4:n]),
                   tuple(int(v) for v in values[n:]))

    @property
    def peak_bytes(self) -> int:
        return self.counters[_INT_FIELDS.index("peak_bytes")]

    def memory(self, events: Any) -> StepMemory:
        """This row's measurement (``events``: the trace, kept only by the rank that measured)."""
        ints = {f: (None if v < 0 else int(v)) for f, v in zip(_INT_FIELDS, self.counters)}
        phases = {p: int(v) for p, v in zip(PHASES, self.phases) if v >= 0}
        reserved, fragmentation = ints.get("reserved_bytes"), ints.get("fragmentation_bytes")
        fraction = fragmentation / reserved if reserved and fragmentation is not None else None
        return StepMemory(phase_peak_bytes=phases, fragmentation_fraction=fraction, events=events,
                          **ints)


def gather_measurement(trainer: Any, failed: bool, memory: Optional[StepMemory],
                       shape: Optional[tuple[int, int]], flag: bool = False,
                       ) -> tuple[bool, bool, Optional[tuple[int, StepMemory, int, int]]]:
    """(any rank failed, ``flag`` on any rank, (rank, measurement, seq_len, batch_size) of the
    highest peak, or None); ``flag``: one more yes/no every rank must hear (a refused rung)."""
    if trainer.world_size <= 1:
        if memory is None or shape is None:
            return failed, flag, None
        return failed, flag, (0, memory, shape[1], shape[0])
    rows = [MeasuredRow.from_list(r) for r in _collective(
        trainer, MeasuredRow.of(failed, flag, memory, shape).to_list(), "gather")]
    any_flag = any(r.flag for r in rows)
    if any(r.failed for r in rows):
        return True, any_flag, None
    measured = [(rank, r) for rank, r in enumerate(rows) if r.peak_bytes >= 0]
    if not measured:
        return False, any_flag, None
    rank, r = max(measured, key=lambda item: item[1].peak_bytes)
    events = memory.events if memory is not None and rank == trainer.global_rank else None
    return False, any_flag, (rank, r.memory(events), r.seq_len, r.batch_size)


__all__ = ["MeasuredRow", "agree_inputs", "all_ok", "any_rank", "broadcast", "gather_measurement",
           "same_on_every_rank"]
