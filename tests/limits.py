"""Wall-clock limits for the processes tests start: a guard against a hang, never part of a verdict.

Every limit is :func:`limit_s` of a base in seconds (what the run takes, generously, on an idle
2-core machine): three times the base, times the load per core when the machine is busier than one
task per core, times ``SEQMEM_TEST_TIMEOUT_SCALE`` (default 1; e.g. 4 on a slow CI machine). A test
never asserts on time; a run past its limit fails that one test with the output it had so far.

:func:`shared_fixture` makes a module's one expensive run (a DDP launch, a CLI session) fail one
test, not every test that reads it: the module's other tests that use it are skipped, saying why.
"""

from __future__ import annotations

import functools
import os
import subprocess
from typing import Any, Callable, Sequence

import pytest

SCALE_ENV = "SEQMEM_TEST_TIMEOUT_SCALE"
GENEROUS = 3.0  # a limit is this many times the base


def limit_s(base_s: float) -> float:
    """The limit for a run that takes about ``base_s`` seconds on an idle 2-core machine."""
    try:
        scale = float(os.environ.get(SCALE_ENV) or 1)
    except ValueError:
        raise ValueError(f"{SCALE_ENV} must be a number (a factor on every test limit), got "
                         f"{os.environ[SCALE_ENV]!r}") from None
    try:
        load = os.getloadavg()[0] / max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        load = 1.0
    return base_s * GENEROUS * max(1.0, load) * max(scale, 0.01)


def run(cmd: Sequence[str], base_s: float, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` under :func:`limit_s` of ``base_s``;
    past it, this test fails (not errors) with the command, the limit and the last output."""
    limit = limit_s(base_s)
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=limit, **kwargs)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-2000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        pytest.fail(f"{' '.join(map(str, cmd))[:300]} ran past its hang guard of {limit:.0f} s "
                    f"({base_s} s x {GENEROUS:g} x load; set {SCALE_ENV} to raise it); "
                    f"stderr so far:\n{tail}", pytrace=False)


def shared_fixture(fn: Callable) -> Any:
    """A fixture made once per module (like ``scope="module"``) whose failure is one failed test:
    the module's later tests that use it are skipped, naming the failure."""
    outcome: dict[str, Any] = {}

    @pytest.fixture(name=fn.__name__)
    @functools.wraps(fn)
    def fixture(*args: Any, **kwargs: Any) -> Any:
        if not outcome:
            try:
                outcome["value"] = fn(*args, **kwargs)
            except BaseException as exc:
                if isinstance(exc, KeyboardInterrupt):
                    raise
                outcome["error"] = (f"{type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0] if str(exc) else ''}")
                raise
        if "error" in outcome:
            pytest.skip(f"the module's shared run {fn.__name__!r} failed in an earlier "
                        f"test: {outcome['error'][:300]}")
        return outcome["value"]

    return fixture
