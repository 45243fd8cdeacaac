"""A plan's table rows (each an independent dry run) in several processes (``--workers N``).

:func:`start_workers` starts ``workers - 1`` processes (:func:`worker_command`; not forked: the
``dryrun`` wing runs a backward on import, after which a forked process cannot run autograd).
:func:`collect_rows` hands out whole :func:`families` (a setting's depth proof made once),
costliest first, merging the rows sent back (length-prefixed pickles over pipes) into the plan's
cache; :func:`device_plans` answers the first device here, the others in the workers. Only
``seconds``, the order and a few duplicate dry runs differ. Nothing here may fail a plan: a worker
that cannot start, fails, dies or answers late (:data:`WAIT_FACTOR`) is killed and its rows are
dry-run here. One worker, or no ``select`` on pipes (not POSIX): this process alone.

Example:
    >>> [len(f) for f in families([(64, ("a",), None, False), (128, ("a",), None, False),
    ...                            (64, ("a", "b"), None, True)])]
    [1, 2]
"""

from __future__ import annotations

import os
import pickle
import select
import subprocess
import sys
import time
from typing import Any, Callable, Optional

__all__ = ["WAIT_FACTOR", "WAIT_FLOOR_S", "Workers", "collect_rows", "default_workers",
           "device_plans", "families", "serve", "start_workers", "worker_command"]

WAIT_FACTOR = 4.0
"""A worker's answer is waited for up to this many times this process's own share of the rows."""
WAIT_FLOOR_S = 120.0
"""... and at least this long (seconds)."""

Key = tuple  # a PlanRun cache key: (seq_len, mitigations, world, offload)


def default_workers() -> int:
    """Processes a plan uses by default: ``SEQMEM_PLAN_WORKERS`` where set (a positive integer, else
    ValueError), else the usable cores, at most 2 (each process holds its own fake steps).

    Example:
        >>> 1 <= default_workers() <= 2
        True
    """
    value = os.environ.get("SEQMEM_PLAN_WORKERS", "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"SEQMEM_PLAN_WORKERS must be a positive integer, got {value!r}")
        return int(value)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(2, cores))


def families(keys: list[Key]) -> list[list[Key]]:
    """``keys`` grouped in *families* (one setting, offload and world, at every length, in order),
    likely costliest first: offload first (host tracker, FSDP2 copies), then more rungs first.

    Example:
        >>> [f[0][1:] for f in families([(64, (), None, False), (64, ("a", "b"), None, False),
        ...                               (128, (), None, False), (64, ("a",), None, True)])]
        [(('a',), None, True), (('a', 'b'), None, False), ((), None, False)]
    """
    grouped: dict[tuple, list[Key]] = {}
    for key in keys:
        grouped.setdefault((key[1], key[2], key[3]), []).append(key)
    return sorted(grouped.values(), key=lambda f: (not f[0][3], -len(f[0][1])))


class Workers:
    """The worker processes of one plan (:func:`start_workers`)."""

    def __init__(self, children: list[subprocess.Popen]) -> None:
        self.children = children

    def stop(self) -> None:
        """Kill every worker still running (the plan's end, or a plan that failed)."""
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
    """A worker's command line: :func:`serve` via :func:`lightning_seqmem.cli.plan.serve_worker`.

    >>> worker_command()[1:]
    ['-c', 'from lightning_seqmem.cli.plan import serve_worker; serve_worker()']
    """
    return [sys.executable, "-c",
            "from lightning_seqmem.cli.plan import serve_worker; serve_worker()"]


def start_workers(args: Any, workers: int) -> Workers:
    """Start ``workers - 1`` workers, each sent ``args`` (the parsed command line, pickled) and
    ``sys.path``; none with one worker, or where ``args`` cannot be pickled."""
    if workers < 2 or os.name != "posix":  # the answers are read with select()
        return Workers([])
    try:
        pickle.dumps(args)
    except Exception:  # noqa: BLE001 - an argument that does not pickle: this process alone
        return Workers([])
    children = []
    for _ in range(workers - 1):
        try:
            child = subprocess.Popen(worker_command(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        except OSError:
            continue
        if _send(child, (list(sys.path), args)):
            children.append(child)
        else:
            _stop(child)
    return Workers(children)


def _send(child: subprocess.Popen, message: Any) -> bool:
    """Write ``message`` to a worker (:func:`_write`); False if it is gone."""
    try:
        _write(child.stdin, message)
        return True
    except (OSError, ValueError):
        return False


def _read(fd: int, size: int, deadline: float) -> Optional[bytes]:
    """``size`` bytes a worker writes to ``fd``, or None past ``deadline`` or where it closed it."""
    chunks, got = [], 0
    while got < size:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, min(size - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _receive(child: subprocess.Popen, deadline: float) -> Optional[tuple]:
    """A worker's next ``("ok", ...)`` answer, else None (late, gone, garbled or ``"failed"``)."""
    fd = child.stdout.fileno()
    head = _read(fd, 8, deadline)
    data = None if head is None else _read(fd, int.from_bytes(head, "big"), deadline)
    try:
        answer = None if data is None else pickle.loads(data)
    except Exception:  # noqa: BLE001 - garbled: as good as none
        return None
    return answer if isinstance(answer, tuple) and answer and answer[0] == "ok" else None


def _merge(run: Any, rows: dict, runs: int, seconds: float) -> None:
    for key, row in rows.items():
        run.cache.setdefault(key, row)
    run.dry_runs += runs
    run.dry_seconds += seconds


def _deadline(started: float) -> float:
    """Deadline: now + max(:data:`WAIT_FLOOR_S`, :data:`WAIT_FACTOR` × time since ``started``)."""
    return time.monotonic() + max(WAIT_FLOOR_S, WAIT_FACTOR * (time.monotonic() - started))


def _ready(child: subprocess.Popen) -> bool:
    """Whether a worker has begun to answer (its pipe is readable now)."""
    return bool(select.select([child.stdout.fileno()], [], [], 0)[0])


def collect_rows(run: Any, lengths: list[int], workers: Workers) -> int:
    """Dry-run the rows at ``lengths`` here and in the workers (a failed, dead or late one's here)
    into ``run.cache`` and the run's counters; returns how many processes answered, this one too."""
    todo = families(run.table_keys(lengths))
    busy: dict[subprocess.Popen, list[Key]] = {}
    answered: list[subprocess.Popen] = []

    def give(child: subprocess.Popen) -> None:
        if todo and _send(child, ("rows", todo[0])):
            busy[child] = todo.pop(0)

    def take(child: subprocess.Popen, deadline: float) -> None:
        family = busy.pop(child)
        answer = _receive(child, deadline)
        if answer is None:
            _stop(child)
            if child in answered:
                answered.remove(child)
            todo.append(family)  # dry-run here
            return
        _merge(run, *answer[1:])
        if child not in answered:
            answered.append(child)

    for child in workers.children:
        give(child)
    started = time.monotonic()
    while todo:
        for key in todo.pop(0):
            run.dry(*key)
        for child in [c for c in busy if _ready(c)]:
            take(child, time.monotonic() + WAIT_FLOOR_S)
            if child in answered:
                give(child)
    deadline = _deadline(started)
    for child in list(busy):
        take(child, deadline)
    for child in workers.children:
        if child not in answered:
            _stop(child)
    workers.children = answered
    return len(answered) + 1


def device_plans(run: Any, workers: Workers, budgets: list[Any], lengths: list[int],
                 local: Callable[[Any, int], dict]) -> list[dict]:
    """Each device's answer (``local(budget, index)``) in ``budgets`` order, with ``"process"``:
    0 for the first and any whose worker fails or is late (answered here), ``i`` for the ``i``-th
    worker left by :func:`collect_rows` (its new rows join ``run.cache``)."""
    jobs: dict[int, subprocess.Popen] = {}
    snapshot = dict(run.cache)
    for i, child in zip(range(1, len(budgets)), workers.children):  # one job each: no second write
        if _send(child, ("device", snapshot, budgets[i], lengths)):  # while it writes its answer
            jobs[i] = child
    started = time.monotonic()
    out = [{**local(budgets[0], 0), "process": 0}]
    deadline = _deadline(started)
    for i in range(1, len(budgets)):
        child = jobs.get(i)
        answer = (None if child is None or child not in workers.children
                  else _receive(child, deadline))
        if answer is None:
            if child is not None and child in workers.children:
                _stop(child)
                workers.children.remove(child)
            out.append({**local(budgets[i], i), "process": 0})
            continue
        _, result, rows, runs, seconds = answer
        _merge(run, rows, runs, seconds)
        out.append({**result, "process": 1 + workers.children.index(child)})
    return out


def _write(out: Any, message: Any) -> None:
    """Write ``message`` to the pipe ``out``: 8 bytes of length, then the pickle."""
    data = pickle.dumps(message)
    out.write(len(data).to_bytes(8, "big") + data)
    out.flush()


def _job(run: Any, args: Any, job: tuple, device_plan: Callable[..., dict]) -> tuple:
    """``("rows", keys)`` -> ``("ok", rows, dry runs, seconds)``; ``("device", rows, budget,
    lengths)`` -> ``("ok", device_plan(...), new rows, dry runs, seconds)``."""
    before, seconds = run.dry_runs, run.dry_seconds
    if job[0] == "rows":
        rows = {tuple(key): run.dry(*key) for key in job[1]}
        return ("ok", rows, run.dry_runs - before, run.dry_seconds - seconds)
    _, snapshot, budget, lengths = job
    for key, row in snapshot.items():
        run.cache.setdefault(key, row)
    result = device_plan(run, lengths, budget, args)
    rows = {k: v for k, v in run.cache.items() if k not in snapshot}
    return ("ok", result, rows, run.dry_runs - before, run.dry_seconds - seconds)


def serve(set_up: Callable[[Any], Any], device_plan: Callable[..., dict]) -> None:
    """A worker's loop: read ``(sys.path, args)`` from stdin, ``set_up(args)``, then answer each
    job (:func:`_job`) until stdin closes; a job that fails answers ``("failed", why)``."""
    out, stdin = sys.stdout.buffer, sys.stdin.buffer
    sys.stdout = sys.stderr  # nothing but the answers on stdout
    run = args = None
    while True:
        head = stdin.read(8)
        if len(head) < 8:
            return
        message = pickle.loads(stdin.read(int.from_bytes(head, "big")))
        try:
            if run is None:
                path, args = message
                sys.path[:] = path
                run = set_up(args)
                continue
            _write(out, _job(run, args, message, device_plan))
        except BaseException as exc:  # noqa: BLE001 - the parent does the job itself
            _write(out, ("failed", f"{type(exc).__name__}: {exc}"))
            if run is None:
                return
