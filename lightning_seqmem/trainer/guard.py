"""The callback's guard: an internal failure in a hook becomes one warning, never a failed run.

:func:`guarded` wraps a hook of :class:`~lightning_seqmem.SeqMemCallback` (or a function taking the
callback first): once the callback has failed it does nothing, and an exception from the body goes
to the callback's ``_fail`` (one :class:`~lightning_seqmem.core.records.SeqMemFailureWarning`; the
callback stops measuring) instead of up into the Trainer.

Example:
    >>> class Hooks:
    ...     _failed = False
    ...     def _fail(self, where, exc):
    ...         self._failed = True
    ...         print(f"failed in {where}: {exc}")
    ...     @guarded
    ...     def on_step(self, n):
    ...         return 1 / n
    >>> hooks = Hooks()
    >>> hooks.on_step(2)
    0.5
    >>> hooks.on_step(0)
    failed in on_step: division by zero
    >>> hooks.on_step(2) is None  # stopped for the rest of the run
    True
"""

from __future__ import annotations

import functools
from typing import Any, Callable


def guarded(hook: Callable) -> Callable:
    """Run a hook body; an internal failure becomes one warning and the callback stops measuring."""

    @functools.wraps(hook)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._failed:
            return None
        try:
            return hook(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the callback must never be the reason a run dies
            self._fail(hook.__name__, exc)
            return None

    return wrapper
