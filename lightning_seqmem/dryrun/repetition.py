"""That a step's allocations repeat per block, proved on shallow copies, and the step at any depth.

For :mod:`.depth`: ``run(vector)`` dry-runs a copy of ``vector`` blocks per kind (:class:`Family`).
:func:`prove` checks on a few copies that one more block inserts the same allocations at the same
places and nothing else (:mod:`.pumping`), and that every other integer figure is affine in the
counts; :func:`extrapolate` answers at any counts from a :class:`Proof`'s copies.

>>> Family.of(("attention", "checkpointing:3/8")).names_at((2, 1))
('attention', 'checkpointing:2/3')
>>> Family.of(("attention",)).counts(("attention",), 8), plus((1, 0), 0, 1)
((8,), (2, 1))
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Optional, Union

from lightning_seqmem.core.rung_spec import LEVEL_SEP
from lightning_seqmem.core.rungs import base_name, level_of
from lightning_seqmem.dryrun.pumping import cut, events_of, insertions, pumped, shape, tokens_of
from lightning_seqmem.dryrun.result import DryRunResult
from lightning_seqmem.dryrun.step import replay_peaks

__all__ = ["Family", "Proof", "extrapolate", "plus", "prove", "reprove", "words"]

Vector = tuple  # blocks of each kind in a copy: (blocks,) or (leveled, plain)
Run = Callable[[Vector], DryRunResult]  # the dry run of a shallow copy of that many blocks
_HOST_PEAKS = ("host_peak_bytes", "host_phase_peak_bytes")  # replayed where the host is traced
_NOT_FIELDS = ("seq_len", "batch_size", "seconds", "events", "mitigations", "detail", "peak_site",
               "peak_bytes", "phase_peak_bytes")


def plus(vector: Vector, *kinds: int) -> Vector:
    """``vector`` with one more block of each kind listed (a kind twice: two)."""
    return tuple(v + kinds.count(i) for i, v in enumerate(vector))


def words(vector: Vector) -> str:
    """``"3"``, or ``"3 (2 + 1)"`` for two kinds.

    >>> words((3,)), words((2, 1))
    ('3', '3 (2 + 1)')
    """
    return str(vector[0]) if len(vector) == 1 else f"{sum(vector)} ({vector[0]} + {vector[1]})"


@dataclasses.dataclass(frozen=True)
class Family:
    """Settings whose shallow copies are the same, and which blocks of a copy are of which kind: a
    rung at a level ``"k/N"`` (first ``k`` blocks at its full level, the rest plain; ``partial`` is
    its index) makes two kinds; ``names`` then hold ``"<rung>:k/N"``, so all ``k`` share copies."""

    names: tuple[str, ...]
    partial: Optional[int]

    @classmethod
    def of(cls, names: tuple[str, ...]) -> "Family":
        for i, name in enumerate(names):
            k, sep, n = (level_of(name) or "").partition("/")
            if sep and k.isdigit() and n.isdigit():
                return cls(names[:i] + (f"{base_name(name)}{LEVEL_SEP}k/N",) + names[i + 1:], i)
        return cls(tuple(names), None)

    def counts(self, names: tuple[str, ...], blocks: int) -> Vector:
        """The blocks of each kind of setting ``names`` on a stack of ``blocks``; raises
        ``ValueError`` for a level ``k/N`` of another ``N``."""
        if self.partial is None:
            return (blocks,)
        k, _, n = str(level_of(names[self.partial])).partition("/")
        if int(n) != blocks:
            raise ValueError(f"level {names[self.partial]!r} is for {n} blocks; the model has "
                             f"{blocks}")
        return int(k), blocks - int(k)

    def names_at(self, vector: Vector) -> tuple[str, ...]:
        """The setting of a copy of ``vector`` blocks."""
        if self.partial is None:
            return self.names
        i, (c, p) = self.partial, vector
        rung = base_name(self.names[i])
        entry = () if c == 0 else ((rung,) if p == 0 else (f"{rung}{LEVEL_SEP}{c}/{c + p}",))
        return self.names[:i] + entry + self.names[i + 1:]

    def bases(self) -> list[Vector]:
        """The base copies a proof tries, cheapest first: one block (the first takes the embedding's
        output), then two (under FSDP2 the next-to-last prefetches the last one's parameters)."""
        return [(1,), (2,)] if self.partial is None else [(1, 0), (1, 1), (2, 0), (2, 1)]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer_fields(result: DryRunResult) -> dict[str, Any]:
    """The integer fields and integer dicts of ``result`` but its size and its replayed peaks."""
    out = {}
    for field in dataclasses.fields(result):
        value = getattr(result, field.name)
        if field.name in _NOT_FIELDS:
            continue
        if _is_int(value) or (isinstance(value, dict) and all(map(_is_int, value.values()))):
            out[field.name] = value
    return out


def _fields(result: DryRunResult, block_bytes: int, host_traced: bool = False) -> dict[str, int]:
    """Every integer figure of ``result`` but the trace's own peaks: what a runner adds to the
    replayed peaks (``peak_bytes``, ``phase_peak_bytes/<phase>``; with ``host_traced``, the host's
    too) and the other integer fields and dicts (``host_bytes``, ...)."""
    peak, phases = replay_peaks(result.events, block_bytes)
    out = {"peak_bytes": result.peak_bytes - peak}
    out.update({f"phase_peak_bytes/{p}": v - phases.get(p, 0)
                for p, v in result.phase_peak_bytes.items()})
    if host_traced:
        host, host_phases = replay_peaks(result.host_events)
        out["host_peak_bytes"] = result.host_peak_bytes - host
        out.update({f"host_phase_peak_bytes/{p}": v - host_phases.get(p, 0)
                    for p, v in result.host_phase_peak_bytes.items()})
    for name, value in _integer_fields(result).items():
        if host_traced and name in _HOST_PEAKS:
            continue
        if isinstance(value, dict):
            out.update({f"{name}/{k}": v for k, v in value.items()})
        else:
            out[name] = value
    return out


def _with_fields(result: DryRunResult, values: dict[str, int], peaks: tuple[int, dict[str, int]],
                 host: Optional[tuple[int, dict[str, int]]] = None) -> DryRunResult:
    """``result`` with the replayed ``peaks`` (and ``host``'s) plus offsets, and every other
    integer figure, set from ``values``."""
    peak, phases = peaks
    changes: dict[str, Any] = {
        "peak_bytes": peak + values["peak_bytes"],
        "phase_peak_bytes": {p: phases.get(p, 0) + values[f"phase_peak_bytes/{p}"]
                             for p in result.phase_peak_bytes},
        "events": None, "host_events": None, "peak_site": None}
    if host is not None:
        changes["host_peak_bytes"] = host[0] + values["host_peak_bytes"]
        changes["host_phase_peak_bytes"] = {
            p: host[1].get(p, 0) + values[f"host_phase_peak_bytes/{p}"]
            for p in result.host_phase_peak_bytes}
    for name, value in _integer_fields(result).items():
        if host is not None and name in _HOST_PEAKS:
            continue
        changes[name] = ({k: values[f"{name}/{k}"] for k in value} if isinstance(value, dict)
                         else values[name])
    return dataclasses.replace(result, **changes)


def _affine(at: dict[Vector, dict[str, int]], base: Vector) -> Optional[dict[str, Vector]]:
    """Each figure's slope per kind from the base and its unit copies, where every copy in ``at``
    agrees to the byte (the second differences are 0); else None."""
    if any(set(values) != set(at[base]) for values in at.values()):
        return None
    units = [plus(base, k) for k in range(len(base))]
    slopes = {f: tuple(at[u][f] - at[base][f] for u in units) for f in at[base]}
    for vector, values in at.items():
        if values != _along(at[base], slopes, vector, base):
            return None
    return slopes


def _along(values: dict[str, int], slopes: dict[str, Vector], to: Vector,
           at: Vector) -> dict[str, int]:
    """Each figure moved from copy ``at`` to ``to`` along its slope per kind."""
    return {f: v + sum((n - b) * s for n, b, s in zip(to, at, slopes[f]))
            for f, v in values.items()}


@dataclasses.dataclass
class Proof:
    """A family's repetition, checked at ``seq_len`` on copies of ``checked`` blocks: the base
    copy's layout (:func:`.pumping.shape`), each block's chunk (``inserts``: position in the base,
    kind, chunk shape), each other figure's slope per kind; ``host``: the host trace's, if any."""

    base: Vector
    base_shape: list
    inserts: list
    slopes: dict[str, Vector]
    seq_len: int
    checked: list
    host: Optional[tuple[list, list]] = None
    first: Optional[tuple[int, list]] = None  # a re-proof's (seq_len, checked) of the full proof

    def says(self) -> str:
        """Where the repetition was checked: ``"copies of 1, 2, 3 blocks at seq_len 128"`` (a
        re-proof's: and of its copies at its own length)."""
        def at(seq_len: int, checked: list) -> str:
            return ", ".join(words(v) for v in checked) + f" blocks at seq_len {seq_len}"
        if self.first is None:
            return f"copies of {at(self.seq_len, self.checked)}"
        return f"copies of {at(*self.first)}, and of {at(self.seq_len, self.checked)}"

    def runs(self) -> list[Vector]:
        """The copies a question runs: one with a block of each kind beyond the base (its chunks
        read out of it); the base and one per kind where a figure beside the trace grows."""
        if not any(any(s) for s in self.slopes.values()):
            return [plus(self.base, *range(len(self.base)))]
        return [self.base, *(plus(self.base, k) for k in range(len(self.base)))]


def _ordered(base: list, found: list, target: list) -> Optional[list]:
    """The insertions of every kind merged in position order, their order where two meet chosen so
    that one block of each kind gives ``target``; None where no order does."""
    merged = sorted((pos, k, chunk) for k, inserts in enumerate(found) for pos, chunk in inserts)
    positions = [pos for pos, _, _ in merged]
    meeting = sorted({pos for pos in positions if positions.count(pos) > 1})
    ones = dict.fromkeys(range(len(found)), 1)
    for flips in itertools.product((False, True), repeat=len(meeting)):
        flipped = {pos for pos, flip in zip(meeting, flips) if flip}
        order = sorted(merged, key=lambda t: (t[0], -t[1] if t[0] in flipped else t[1]))
        if pumped(base, order, ones) == target:
            return order
    return None


def _layout(tokens: dict[Vector, list], base: Vector, checks: list[Vector],
            none_added: bool) -> Union[list, str]:
    """The inserts (position, kind, chunk shape) that turn the base copy's tokens into every other
    copy's in ``tokens``, or why none do; ``none_added``: a block may add nothing (a host side)."""
    found = []
    for unit in (plus(base, k) for k in range(len(base))):
        inserts = insertions(tokens[base], tokens[unit])
        if inserts is None or (not inserts and not none_added):
            return f"one more block is not an insertion of allocations (at {words(unit)} blocks)"
        found.append(inserts)
    order = [(pos, 0, chunk) for pos, chunk in found[0]] if len(base) == 1 else \
        _ordered(tokens[base], found, tokens[checks[0]])
    if order is None:
        return "the chunks of the two kinds of block do not combine"
    for v in checks:
        if pumped(tokens[base], order, {k: v[k] - base[k] for k in range(len(base))}) != tokens[v]:
            return f"the allocations of {words(v)} blocks are not the chunks repeated"
    return [(pos, k, shape(chunk)) for pos, k, chunk in order]


def _host_layout(run: Run, copies: dict, base: Vector, checks: list) -> Union[tuple, str]:
    """The host side's (base shape, inserts) over ``copies``, or why it does not repeat."""
    tokens = {v: tokens_of(run(v).host_events) for v in copies}
    order = _layout(tokens, base, checks, none_added=True)
    if isinstance(order, str):
        return f"host memory: {order}"
    return shape(tokens[base]), order


def _prove_from(run: Run, base: Vector, seq_len: int, block_bytes: int) -> Union[Proof, str]:
    units = [plus(base, k) for k in range(len(base))]
    if len(base) == 1:
        checks = [plus(base, 0, 0)]
    else:
        checks = [plus(base, 0, 1), plus(base, 0, 0, 1), plus(base, 0, 1, 1)]
    tokens = {v: tokens_of(run(v).events) for v in [base, *units]}  # fail before the checks run
    for v in units:
        if insertions(tokens[base], tokens[v]) is None:
            return f"one more block is not an insertion of allocations (at {words(v)} blocks)"
    tokens.update({v: tokens_of(run(v).events) for v in checks})
    order = _layout(tokens, base, checks, none_added=False)
    if isinstance(order, str):
        return order
    host_traced = all(run(v).host_events is not None for v in tokens)
    host = _host_layout(run, tokens, base, checks) if host_traced else None
    if isinstance(host, str):
        return host
    slopes = _affine({v: _fields(run(v), block_bytes, host_traced) for v in tokens}, base)
    if slopes is None:
        return "a figure beside the traced step is not affine in the block count"
    checked = sorted(tokens, key=lambda v: (sum(v), v))
    return Proof(base, shape(tokens[base]), order, slopes, seq_len, checked, host)


def prove(run: Run, family: Family, seq_len: int, block_bytes: int) -> Union[Proof, str]:
    """The :class:`Proof` of ``family``'s repetition at ``seq_len`` from the first base that holds
    (:meth:`Family.bases`; ``block_bytes``: the allocator's rounding), or why none does. Runs the
    base and one and two more blocks of each kind (and one more of both); a failing run raises."""
    reasons = []
    for base in family.bases():
        proof = _prove_from(run, base, seq_len, block_bytes)
        if isinstance(proof, Proof):
            return proof
        reasons.append(f"from {words(base)} blocks: {proof}")
    return "the allocations do not repeat per block (" + "; ".join(reasons) + ")"


def _pumped_at(results: dict[Vector, DryRunResult], trace: Callable[[DryRunResult], Any],
               layout: tuple[list, list], base: Vector, target: Vector) -> Optional[list]:
    """The tokens of one trace (``trace(result)``: device or host events) at ``target`` blocks, read
    out of the copies in ``results`` laid out as ``layout`` (base and chunk shapes), else None."""
    base_shape, inserts = layout
    kinds = range(len(base))
    chunks: list = [None] * len(inserts)
    base_tokens = None
    for v, result in results.items():
        counts = {k: v[k] - base[k] for k in kinds}
        read = cut(tokens_of(trace(result)), base_shape, inserts, counts)
        if read is None or (base_tokens is not None and read[0] != base_tokens):
            return None
        base_tokens = read[0]
        for i, (_, k, _) in enumerate(inserts):
            if v[k] > base[k]:
                chunks[i] = read[1][i]
    filled = [(p, k, chunk) for (p, k, _), chunk in zip(inserts, chunks)]
    return pumped(base_tokens, filled, {k: target[k] - base[k] for k in kinds})


def reprove(run: Run, proof: Proof, seq_len: int, block_bytes: int) -> Union[Proof, str]:
    """``proof`` (one kind of block) made again at ``seq_len``, where its copies' layout changed
    with the length (a tiled MLP's tile count): from its base and one more block alone (a further
    block was checked where ``proof`` was made); else why not (the caller then proves in full)."""
    if len(proof.base) != 1:
        return "two kinds of block are proved in full"
    base, unit = proof.base, plus(proof.base, 0)
    tokens = {v: tokens_of(run(v).events) for v in (base, unit)}
    order = _layout(tokens, base, [], none_added=False)
    if isinstance(order, str):
        return order
    host_traced = all(run(v).host_events is not None for v in tokens)
    if (proof.host is not None) != host_traced:
        return "the host side is traced at one length and not at the other"
    host = _host_layout(run, tokens, base, []) if host_traced else None
    if isinstance(host, str):
        return host
    slopes = _affine({v: _fields(run(v), block_bytes, host_traced) for v in tokens}, base)
    if slopes is None or {f for f, s in slopes.items() if any(s)} - \
            {f for f, s in proof.slopes.items() if any(s)}:
        return "a figure beside the traced step grows with the blocks here and not where proved"
    first = proof.first or (proof.seq_len, proof.checked)
    return Proof(base, shape(tokens[base]), order, slopes, seq_len, [base, unit], host, first)


def extrapolate(run: Run, proof: Proof, target: Vector, block_bytes: int) -> Optional[DryRunResult]:
    """The result at ``target`` blocks of each kind from the copies ``proof.runs()`` names (run at
    the length asked), or None where one of them has another layout than the proof's."""
    results = {v: run(v) for v in proof.runs()}
    deep = _pumped_at(results, lambda r: r.events, (proof.base_shape, proof.inserts), proof.base,
                      target)
    host_deep = None
    if proof.host is not None:
        if any(r.host_events is None for r in results.values()):
            return None
        host_deep = _pumped_at(results, lambda r: r.host_events, proof.host, proof.base, target)
        if host_deep is None:
            return None
    if deep is None:
        return None
    first, *units = proof.runs()
    traced = proof.host is not None
    values = _fields(results[first], block_bytes, traced)
    if units:  # each figure's slope at this length
        at = [_fields(results[u], block_bytes, traced) for u in units]
        slopes = {f: tuple(u[f] - values[f] for u in at) for f in values}
    else:
        slopes = proof.slopes
    values = _along(values, slopes, target, first)
    host = None if host_deep is None else replay_peaks(events_of(host_deep))
    return _with_fields(results[first], values, replay_peaks(events_of(deep), block_bytes), host)
