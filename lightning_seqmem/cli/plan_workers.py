"""The rows of a plan's table dry-run in several processes at once (``seqmem plan --workers N``).

Every row of the table (each length, mitigation set and offload choice) is one dry run, independent
of the others, and most of a plan's time on a laptop (2 cores: one busy, one idle). At the start of
the plan :func:`start_workers` starts ``workers - 1`` Python processes (``python -m
lightning_seqmem.cli.plan_workers``; not forked: this package's ``dryrun`` wing runs a backward on
import, and a process forked after one cannot run autograd), each of which imports the package and
sets the plan up as this one does (the same command line, the same ``sys.path``), while this one
does the same. :func:`collect_rows` then splits the table's rows (:func:`split_families`) in whole
*families* (one setting, with or without offload, at every length: its depth proof is made once,
in the process that asks it; :mod:`lightning_seqmem.dryrun.depth`), the costliest first, each to
the least loaded process, sends each worker its share, dry-runs its own and puts the rows the
workers send back (pickled over pipes) into the plan's cache, so that what follows (the plans, the
fastest-setting and longest-length searches) reads them as its own. Same rows, same figures; only
their ``seconds`` (each process's own) and the order in which they were made differ.

Nothing here may fail a plan: a worker that cannot start, fails, dies or answers late
(:data:`WAIT_FACTOR` times this process's own share, at least :data:`WAIT_FLOOR_S`) is ignored
(killed where it still runs), and its rows are dry-run here when they are asked. One worker, one
core, or a system without ``select`` on pipes (not POSIX), dry-runs in this process alone.

Example:
    >>> shares = split_families([(64, ("a",), None, False), (128, ("a",), None, False),
    ...                          (64, ("b", "tiled_mlp"), None, True)], 2)
    >>> [sorted({k[1] for k in share}) for share in shares]
    [[('b', 'tiled_mlp')], [('a',)]]
"""

from __future__ import annotations

import os
import pickle
import select
import subprocess
import sys
import time
from typing import Any, Optional

__all__ = ["WAIT_FACTOR", "WAIT_FLOOR_S", "Workers", "collect_rows", "default_workers", "split_families",
           "start_workers", "worker_command", "worker_main"]

WAIT_FACTOR = 4.0
"""A worker's answer is waited for up to this many times this process's own share of the rows."""
WAIT_FLOOR_S = 120.0
"""... and at least this long (seconds)."""

Key = tuple  # a PlanRun cache key: (seq_len, mitigations, world, offload)


def default_workers() -> int:
    """The processes a plan uses by default: the cores this process may run on, at most 2 (a
    laptop's plan gains little past that, and each process holds its own copy of the fake steps).

    Example:
        >>> 1 <= default_workers() <= 2
        True
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(2, cores))


def _cost(key: Key) -> float:
    """A family's relative cost per row, from the plan's own timings: a tiled MLP runs one set of
    ops per tile (one per 4,096 tokens), offload adds a host tracker and FSDP2's copies."""
    _, names, _, offload = key
    tiled = any(str(n).startswith("tiled_mlp") for n in names)
    return (4.0 if tiled else 1.0) * (1.6 if offload else 1.0)


def split_families(keys: list[Key], workers: int) -> list[list[Key]]:
    """``keys`` in ``workers`` shares of whole families (a setting with or without offload, at
    every length, and world), the costliest family first, each to the least loaded share; the
    first share is this process's.

    Example:
        >>> split_families([(64, (), None, False)], 3)
        [[(64, (), None, False)], [], []]
    """
    families: dict[tuple, list[Key]] = {}
    for key in keys:
        families.setdefault((key[1], key[2], key[3]), []).append(key)
    shares: list[list[Key]] = [[] for _ in range(max(1, workers))]
    loads = [0.0] * len(shares)
    for family in sorted(families.values(), key=lambda f: -sum(map(_cost, f))):
        i = loads.index(min(loads))
        shares[i] += family
        loads[i] += sum(map(_cost, family))
    return shares


class Workers:
    """The worker processes of one plan (:func:`start_workers`) and the count of processes its rows
    are split between (this one included)."""

    def __init__(self, children: list[subprocess.Popen], count: int) -> None:
        self.children, self.count = children, count

    def stop(self) -> None:
        """Kill every worker still running (a plan that failed before :func:`collect_rows`)."""
        for child in self.children:
            _stop(child)
        self.children = []


def _stop(child: subprocess.Popen) -> None:
    for stream in (child.stdin, child.stdout):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass
    try:
        child.kill()
        child.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        pass


def worker_command() -> list[str]:
    """The command line of a worker process.

    >>> worker_command()[1:]
    ['-m', 'lightning_seqmem.cli.plan_workers']
    """
    return [sys.executable, "-m", "lightning_seqmem.cli.plan_workers"]


def start_workers(args: Any, workers: int) -> Workers:
    """Start ``workers - 1`` worker processes, each given ``args`` (the plan's parsed command line,
    pickled) and this process's ``sys.path``: they import and set the plan up while this process
    does; none with one worker, or where ``args`` cannot be pickled."""
    if workers < 2 or os.name != "posix":  # the answers are read with select()
        return Workers([], 1)
    try:
        message = pickle.dumps((list(sys.path), args))
    except Exception:  # noqa: BLE001 - an argument that does not pickle: this process alone
        return Workers([], 1)
    children = []
    for _ in range(workers - 1):
        try:
            child = subprocess.Popen(worker_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL)
            child.stdin.write(message)
            child.stdin.flush()
        except OSError:
            continue
        children.append(child)
    return Workers(children, len(children) + 1)


def _read(fd: int, deadline: float) -> Optional[bytes]:
    """Everything a worker writes to ``fd`` until it closes it, or None past ``deadline``."""
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def collect_rows(run: Any, lengths: list[int], workers: Workers) -> int:
    """Send each worker its share of the table's rows at ``lengths``, dry-run this process's, and
    put every worker's rows into ``run.cache`` (``run.dry_runs`` and ``run.dry_seconds`` count
    every process's); the processes that answered, this one included (1: it ran alone). A worker
    that failed, died or is late is ignored and stopped: its rows are dry-run here when asked."""
    keys = run.table_keys(lengths)
    shares = split_families(keys, workers.count)
    sent = []
    for child, share in zip(workers.children, shares[1:]):
        try:
            child.stdin.write(pickle.dumps(share))
            child.stdin.close()
            sent.append(child)
        except OSError:
            _stop(child)
    started = time.monotonic()
    for key in shares[0]:
        run.dry(*key)
    deadline = time.monotonic() + max(WAIT_FLOOR_S, WAIT_FACTOR * (time.monotonic() - started))
    answered = 1
    for child in sent:
        try:
            data = _read(child.stdout.fileno(), deadline)
        finally:
            _stop(child)
        try:
            answer = pickle.loads(data) if data else ("failed", "no answer")
        except Exception:  # noqa: BLE001 - a garbled answer: dry-run here when asked
            continue
        if answer[0] != "ok":
            continue
        _, rows, runs, seconds = answer
        for key, row in rows.items():
            run.cache.setdefault(key, row)
        run.dry_runs += runs
        run.dry_seconds += seconds
        answered += 1
    workers.children = []
    return answered


def worker_main() -> None:
    """A worker (``python -m lightning_seqmem.cli.plan_workers``): read ``(sys.path, args)`` from
    stdin, set the plan up, read its share of the rows, dry-run them and write ``("ok", rows, dry
    runs, seconds)`` (or ``("failed", why)``) to stdout, pickled."""
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but the answer on stdout
    try:
        path, args = pickle.load(sys.stdin.buffer)
        sys.path[:] = path
        from lightning_seqmem.cli.common import quiet_warnings
        from lightning_seqmem.cli.plan import _set_up

        quiet_warnings()
        run = _set_up(args)
        share = pickle.load(sys.stdin.buffer)
        rows = {tuple(key): run.dry(*key) for key in share}
        data = pickle.dumps(("ok", rows, run.dry_runs, run.dry_seconds))
    except BaseException as exc:  # noqa: BLE001 - the parent dry-runs the share itself
        data = pickle.dumps(("failed", f"{type(exc).__name__}: {exc}"))
    out.write(data)
    out.flush()


if __name__ == "__main__":
    worker_main()
