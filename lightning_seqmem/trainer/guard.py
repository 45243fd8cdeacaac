"""The callback's guard: an internal failure in a hook becomes one warning, never a failed run.

:class:`Guard` holds the planner (whose advice queue keeps each warning once per run) and the edge
state (``failed``, the probe), and is shared by the callback and its edge objects:

* :func:`guarded` wraps a method of an object with a ``guard`` and ``edge``: after a failure it does
  nothing; an exception from the body goes to :meth:`Guard.fail`, not up into the Trainer;
* :meth:`Guard.fail`: this rank stops measuring, said in one :class:`.SeqMemFailureWarning`;
* :meth:`Guard.safely`: run an output (log, figure, report): a failure warns, measuring goes on;
* :meth:`Guard.warn_once`, :meth:`Guard.warn_advice`: the planner's advice, each item warned once.

Example:
    >>> import warnings
    >>> from lightning_seqmem.plan.planner import SeqMemPlanner
    >>> from lightning_seqmem.trainer.run_state import EdgeState
    >>> class Step:
    ...     def __init__(self, guard):
    ...         self.guard, self.edge = guard, guard.edge
    ...     @guarded
    ...     def on_step(self, n):
    ...         return 1 / n
    >>> step = Step(Guard(EdgeState(), SeqMemPlanner()))
    >>> step.on_step(2)
    0.5
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     step.on_step(0)
    >>> step.edge.failed, [str(w.message).split(";")[0] for w in caught]
    (True, ['seqmem: internal failure in on_step (ZeroDivisionError: division by zero)'])
    >>> step.on_step(2) is None  # stopped for the rest of the run
    True
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

from lightning.pytorch.utilities import rank_zero_warn

from lightning_seqmem.core import advice as A

if TYPE_CHECKING:  # pragma: no cover
    from lightning_seqmem.plan.protocol import Planner
    from lightning_seqmem.trainer.run_state import EdgeState

__all__ = ["Guard", "guarded"]


def guarded(method: Callable) -> Callable:
    """Guard a method of an object with a ``guard`` and an ``edge`` (see the module docstring)."""

    @functools.wraps(method)
    def wrapper(owner: Any, *args: Any, **kwargs: Any) -> Any:
        if owner.edge.failed:
            return None
        try:
            return method(owner, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the callback must never be the reason a run dies
            owner.guard.fail(method.__name__, exc)
            return None

    return wrapper


class Guard:
    """Failures and warnings of one fit, kept in ``edge`` and ``planner`` (see the module)."""

    def __init__(self, edge: "EdgeState", planner: "Planner") -> None:
        self.edge, self.planner = edge, planner

    def safely(self, what: str, fn: Callable[[], Any]) -> None:
        """Run ``fn`` (the output ``what``); an exception is said in one warning, never raised."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reporting must never end a run
            self.warn_once(A.output_failed(what, f"{type(exc).__name__}: {exc}"))

    def fail(self, where: str, exc: BaseException) -> None:
        """This rank stops measuring (the probe left), said in one warning (``where``, ``exc``)."""
        self.edge.failed = True
        self.edge.abort_probe()
        self.warn_once(A.failure(where, f"{type(exc).__name__}: {exc}"))

    def warn_once(self, item: A.Advice) -> None:
        """Give the planner ``item`` (it keeps each once) and warn what is new."""
        self.planner.advice.advise(item)
        self.warn_advice()

    def warn_advice(self) -> None:
        """Warn (on rank zero) every item of advice the planner holds that was not said yet."""
        for item in self.planner.advice.take_advice():
            rank_zero_warn(item.text, category=item.category)
