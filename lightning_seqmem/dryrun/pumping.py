"""The allocation sequence of a step through a stack of identical blocks, as a base and a chunk
per block: found by comparing the traced sequences of two depths, repeated ("pumped") to any depth.

A traced step (:class:`~lightning_seqmem.core.records.TrackedEvents`) becomes *tokens*, one per
event: ``(+1, op, bytes)`` for an allocation, ``(-1, "", bytes)`` for a free (bytes alone: the op
that made a freed tensor may depend on the block before) and ``(0, phase, 0)`` where a phase begins.
One more block inserts the same tokens at the same places: :func:`insertions` finds them between two
depths, :func:`pumped` repeats each chunk, :func:`cut` reads base and chunks back out of a sequence
so laid out (:func:`shape`); the peaks are :func:`.step.replay_peaks` of :func:`events_of`.

>>> base = [(1, "embed", 8), (0, "backward", 0), (-1, "", 8)]
>>> one = [(1, "embed", 8), (1, "mm", 4), (0, "backward", 0), (-1, "", 4), (-1, "", 8)]
>>> found = insertions(base, one)
>>> found
[(1, [(1, 'mm', 4)]), (2, [(-1, '', 4)])]
>>> three = pumped(base, [(p, "block", c) for p, c in found], {"block": 3})
>>> [t[1] or t[2] for t in three]
['embed', 'mm', 'mm', 'mm', 'backward', 4, 4, 4, 8]
>>> from lightning_seqmem.dryrun.step import replay_peaks
>>> replay_peaks(events_of(three))
(20, {'backward': 20})
"""

from __future__ import annotations

import difflib
from typing import Optional, Sequence

from lightning_seqmem.core.records import TrackedEvents

__all__ = ["Insert", "Token", "cut", "events_of", "insertions", "pumped", "shape", "tokens_of"]

Token = tuple  # (sign, op, bytes): +1 allocation, -1 free, 0 a phase's start (op: the phase)
Insert = tuple  # (position in the base, kind, chunk): the chunk goes before base[position]


def tokens_of(events: TrackedEvents) -> list[Token]:
    """The tokens of a traced step, phase starts included.

    >>> ev = TrackedEvents(sizes=[10, 3], ops=["<existing>", "mm"], sequence=[0, 1, ~1],
    ...                    phase_starts={"forward": 1})
    >>> tokens_of(ev)
    [(1, '<existing>', 10), (0, 'forward', 0), (1, 'mm', 3), (-1, '', 3)]
    """
    starts: dict[int, list[str]] = {}
    for name, position in events.phase_starts.items():
        starts.setdefault(position, []).append(name)
    ops = events.ops if len(events.ops) == len(events.sizes) else [""] * len(events.sizes)
    out: list[Token] = []
    for position, entry in enumerate(events.sequence):
        out += [(0, name, 0) for name in starts.get(position, ())]
        if entry >= 0:
            out.append((1, ops[entry], events.sizes[entry]))
        else:
            out.append((-1, "", events.sizes[~entry]))
    for position in sorted(p for p in starts if p >= len(events.sequence)):
        out += [(0, name, 0) for name in starts[position]]
    return out


def events_of(tokens: Sequence[Token]) -> TrackedEvents:
    """Events that replay as ``tokens`` do (each free its own entry: the replay reads its bytes).

    >>> events_of([(1, "mm", 3), (0, "backward", 0), (-1, "mm", 3)]).sequence
    [0, -2]
    """
    events = TrackedEvents()
    for sign, op, nbytes in tokens:
        if sign == 0:
            events.phase_starts[op] = len(events.sequence)
            continue
        events.sequence.append(len(events.sizes) if sign > 0 else ~len(events.sizes))
        events.sizes.append(nbytes)
        events.ops.append(op)
    return events


def shape(tokens: Sequence[Token]) -> list[tuple[int, str]]:
    """The tokens without their bytes: what must stay the same from one length to another.

    >>> shape([(1, "mm", 3), (0, "backward", 0)])
    [(1, 'mm'), (0, 'backward')]
    """
    return [(sign, op) for sign, op, _ in tokens]


def _segment_insertions(a: Sequence[Token], b: Sequence[Token],
                        offset: int) -> Optional[list[tuple[int, list]]]:
    """Insertions turning ``a`` into ``b`` (positions in ``a``, plus ``offset``), or None."""
    n, m = len(a), len(b)
    head = 0
    while head < n and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < n - head and a[n - 1 - tail] == b[m - 1 - tail]:
        tail += 1
    if head + tail == n:
        return [(offset + head, list(b[head:m - tail]))] if m > n else []
    out = []
    matcher = difflib.SequenceMatcher(None, a[head:n - tail], b[head:m - tail], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "insert":
            out.append((offset + head + i1, list(b[head + j1:head + j2])))
        elif tag != "equal":
            return None
    return out


def _leftmost(base: Sequence[Token], found: list[tuple[int, list]]) -> list[tuple[int, list]]:
    """Each insertion moved as far left as the tokens allow (the chunk rotated: the same
    sequence), no further than the one before; insertions that meet are one."""
    out: list[tuple[int, list]] = []
    for position, chunk in found:
        floor = out[-1][0] if out else 0
        while position > floor and base[position - 1] == chunk[-1]:
            chunk = [base[position - 1], *chunk[:-1]]
            position -= 1
        if out and out[-1][0] == position:
            out[-1] = (position, out[-1][1] + chunk)
        else:
            out.append((position, chunk))
    return out


def insertions(base: Sequence[Token], longer: Sequence[Token]) -> Optional[list[tuple[int, list]]]:
    """``[(position in base, inserted tokens)]`` turning ``base`` into ``longer`` by insertions
    alone (within each phase; the phases must match), each as far left as it can go, or None.

    >>> insertions([(1, "a", 1), (1, "c", 1)], [(1, "a", 1), (1, "b", 2), (1, "c", 1)])
    [(1, [(1, 'b', 2)])]
    >>> insertions([(1, "a", 1)], [(1, "a", 2)]) is None  # a size changed: not an insertion
    True
    """
    marks_a = [i for i, t in enumerate(base) if t[0] == 0]
    marks_b = [i for i, t in enumerate(longer) if t[0] == 0]
    if [base[i] for i in marks_a] != [longer[i] for i in marks_b]:
        return None
    found: list[tuple[int, list]] = []
    for (a0, a1), (b0, b1) in zip(zip([-1, *marks_a], [*marks_a, len(base)]),
                                  zip([-1, *marks_b], [*marks_b, len(longer)])):
        part = _segment_insertions(base[a0 + 1:a1], longer[b0 + 1:b1], a0 + 1)
        if part is None:
            return None
        found += part
    return _leftmost(base, found)


def pumped(base: Sequence[Token], inserts: Sequence[Insert], counts: dict) -> list[Token]:
    """``base`` with each insert's chunk repeated ``counts[kind]`` times at its position (inserts
    in order of position; at one position, in the order given).

    >>> [t[1] for t in pumped([(1, "e", 1)], [(0, "c", [(1, "x", 1)]), (0, "p", [(1, "y", 1)])],
    ...                       {"c": 2, "p": 1})]
    ['x', 'x', 'y', 'e']
    """
    out: list[Token] = []
    previous = 0
    for position, kind, chunk in inserts:
        out += base[previous:position]
        out += list(chunk) * counts[kind]
        previous = position
    out += base[previous:]
    return out


def cut(tokens: Sequence[Token], base_shape: Sequence[tuple[int, str]], inserts: Sequence[Insert],
        counts: dict) -> Optional[tuple[list[Token], list[list[Token]]]]:
    """``(base, chunk of each insert)`` read out of ``tokens`` laid out as :func:`pumped` lays them
    (``inserts`` carry chunk *shapes*), or None where a shape or a repeated chunk differs.

    >>> tokens = [(1, "e", 8), (1, "x", 3), (1, "x", 3), (-1, "e", 8)]
    >>> cut(tokens, [(1, "e"), (-1, "e")], [(1, "block", [(1, "x")])], {"block": 2})
    ([(1, 'e', 8), (-1, 'e', 8)], [[(1, 'x', 3)]])
    """
    base: list[Token] = []
    chunks: list[list[Token]] = []
    at = previous = 0

    def take(expected: Sequence[tuple[int, str]]) -> Optional[list[Token]]:
        nonlocal at
        part = list(tokens[at:at + len(expected)])
        if shape(part) != list(expected):
            return None
        at += len(expected)
        return part

    for position, kind, chunk_shape in inserts:
        segment = take(base_shape[previous:position])
        if segment is None:
            return None
        base += segment
        previous = position
        first = take(chunk_shape) if counts[kind] else []
        if first is None:
            return None
        for _ in range(counts[kind] - 1):
            if take(chunk_shape) != first:
                return None
        chunks.append(first)
    segment = take(base_shape[previous:])
    return None if segment is None or at != len(tokens) else (base + segment, chunks)
