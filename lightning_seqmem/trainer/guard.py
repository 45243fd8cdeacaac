"""The callback's guard: an internal failure in a hook becomes one warning, never a failed run.

The surface the parts of the edge use on the callback (``cb``: a
:class:`~lightning_seqmem.SeqMemCallback`, or anything with its ``planner`` and ``edge``, an
:class:`~lightning_seqmem.trainer.run_state.EdgeState`):

* :func:`guarded` wraps a hook (or a function taking the callback first): once the callback has
  failed it does nothing, and an exception from the body goes to :func:`fail` instead of up into
  the Trainer;
* :func:`fail`: this rank stops measuring (``cb.edge.failed``), said in one
  :class:`~lightning_seqmem.core.records.SeqMemFailureWarning`;
* :func:`safely`: run an output (a log, a figure, a report), a failure said in one warning and the
  run going on, still measured;
* :func:`warn_once` and :func:`warn_advice`: the planner's advice, each item warned once.

Example:
    >>> import warnings
    >>> from types import SimpleNamespace as NS
    >>> from lightning_seqmem.plan.planner import SeqMemPlanner
    >>> from lightning_seqmem.trainer.run_state import EdgeState
    >>> @guarded
    ... def on_step(cb, n):
    ...     return 1 / n
    >>> cb = NS(planner=SeqMemPlanner(), edge=EdgeState())
    >>> on_step(cb, 2)
    0.5
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     on_step(cb, 0)
    >>> cb.edge.failed, [str(w.message).split(";")[0] for w in caught]
    (True, ['seqmem: internal failure in on_step (ZeroDivisionError: division by zero)'])
    >>> on_step(cb, 2) is None  # stopped for the rest of the run
    True
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from lightning.pytorch.utilities import rank_zero_warn

from lightning_seqmem.core import advice as A


def guarded(hook: Callable) -> Callable:
    """Run a hook body; an internal failure becomes one warning and the callback stops measuring."""

    @functools.wraps(hook)
    def wrapper(cb: Any, *args: Any, **kwargs: Any) -> Any:
        if cb.edge.failed:
            return None
        try:
            return hook(cb, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the callback must never be the reason a run dies
            fail(cb, hook.__name__, exc)
            return None

    return wrapper


def safely(cb: Any, what: str, fn: Callable[[], Any]) -> None:
    """Run ``fn`` (an output: ``what`` names it); an exception is said in one warning, never raised."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reporting must never end a run
        warn_once(cb, A.output_failed(what, f"{type(exc).__name__}: {exc}"))


def fail(cb: Any, where: str, exc: BaseException) -> None:
    """This rank stops measuring (the probe left), said in one warning naming ``where`` and ``exc``."""
    cb.edge.failed = True
    if cb.edge.probe is not None:
        cb.edge.probe.abort()
    warn_once(cb, A.failure(where, f"{type(exc).__name__}: {exc}"))


def warn_once(cb: Any, item: A.Advice) -> None:
    """Give the planner ``item`` (it keeps each once) and warn what is new."""
    cb.planner._advice.advise(item)
    warn_advice(cb)


def warn_advice(cb: Any) -> None:
    """Warn (on rank zero) every item of advice the planner holds that was not said yet."""
    for item in cb.planner.take_advice():
        rank_zero_warn(item.text, category=item.category)
