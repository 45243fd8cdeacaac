"""Enter a ``TorchDispatchMode`` under the user modes held now, and leave it wherever it is on the
stack, never popping another's.

``TorchDispatchMode.__exit__`` pops the *top* of the stack, whichever mode it is. Two callbacks each
holding a mode over the step (ours, and a user's ``FlopCounterMode``) enter and leave in callback
order, not in reverse: the first to leave pops the other's mode. :func:`exit_own_mode` leaves only
its mode: on top, the ordinary ``__exit__``; under other modes, those are lifted off and put back;
already popped by a mode below it that left first, that mode (which believes it has left) is taken
off now (:func:`modes_below`, called on entering, tells this case from a mode still held).
:func:`enter_below_user_modes` enters under the user modes already held.

>>> import torch
>>> from torch.utils._python_dispatch import TorchDispatchMode
>>> class Mode(TorchDispatchMode):
...     def __torch_dispatch__(self, func, types, args=(), kwargs=None):
...         return func(*args, **(kwargs or {}))
>>> ours, theirs = Mode(), Mode()
>>> ours.__enter__() is ours and theirs.__enter__() is theirs   # theirs entered after ours
True
>>> exit_own_mode(ours, lambda: ours.__exit__(None, None, None), [])  # ours leaves first
>>> stack() == [theirs]
True
>>> theirs.__exit__(None, None, None); stack()
[]
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.utils._python_dispatch as _dispatch

__all__ = ["enter_below_user_modes", "exit_own_mode", "modes_below", "stack"]


def stack() -> list[Any]:
    """The dispatch modes now entered, bottom first (infra modes such as FakeTensorMode below)."""
    return [torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())]


def _entries(mode: Any) -> int:
    return len(getattr(mode, "old_dispatch_mode_flags", ()) or ())


def modes_below() -> list[tuple[Any, int]]:
    """The modes on the stack now, each with how many times it is entered (call before entering)."""
    return [(m, _entries(m)) for m in stack()]


@contextmanager
def _lifted(until: Callable[[Any], bool]) -> Iterator[None]:
    """The modes on top lifted off, down to the first for which ``until`` holds (or all); put back
    after, and the flags synced."""
    above = []
    while torch._C._len_torch_dispatch_stack() and not until(stack()[-1]):
        above.append(torch._C._pop_torch_dispatch_stack(None))
    try:
        yield
    finally:
        for m in reversed(above):
            torch._C._push_on_torch_dispatch_stack(m)
        _sync_flags()


def _remove(mode: Any) -> None:
    """Take ``mode`` off the stack, putting back the modes above it."""
    with _lifted(lambda m: m is mode):
        if torch._C._len_torch_dispatch_stack():
            torch._C._pop_torch_dispatch_stack(None)


def _sync_flags() -> None:
    """The module-level "in a dispatch mode" flags, as the stack now is."""
    modes = stack()
    _dispatch._is_in_torch_dispatch_mode = bool(modes)
    _dispatch._is_in_non_infra_torch_dispatch_mode = any(not m.is_infra_mode() for m in modes)
    without = any(not m.ignore_compile_internals() for m in modes)
    _dispatch._is_in_any_mode_without_ignore_compile_internals = without
    _dispatch.set_is_in_mode_without_ignore_compile_internals(without)


def _is_infra(mode: Any) -> bool:
    return bool(getattr(mode, "is_infra_mode", lambda: False)())


def enter_below_user_modes(mode: Any, enter_fn: Callable[[], Any],
                           stop_at: Callable[[Any], bool] = lambda m: False) -> Any:
    """Enter ``mode`` under the user modes already entered (above infra modes such as
    FakeTensorMode): each still sees every op first, and leaving one (in any order) pops itself,
    not ``mode``. ``enter_fn`` is the mode's ordinary ``__enter__``; returns what it returns. The
    lifting stops at the first mode (from the top) for which ``stop_at`` holds."""
    with _lifted(lambda m: _is_infra(m) or stop_at(m)):
        return enter_fn()


def exit_own_mode(mode: Any, exit_fn: Callable[[], Any], below: list[tuple[Any, int]]) -> None:
    """Leave ``mode`` only (see the module docstring); ``exit_fn`` is its ordinary ``__exit__``,
    ``below`` what :func:`modes_below` said when it entered."""
    modes = stack()
    if modes and modes[-1] is mode:
        exit_fn()
        return
    if any(m is mode for m in modes):
        with _lifted(lambda m: m is mode):
            exit_fn()  # pops `mode`, now on top, and restores its flags
        return
    # popped already, by the exit of a mode below it: finish that mode's exit, then ours, no pop
    for m, entries in below:
        if any(x is m for x in stack()) and _entries(m) < entries:
            _remove(m)
    for name in ("old_dispatch_mode_flags", "old_non_infra_dispatch_mode_flags",
                 "old_without_ignore_compile_internals_dispatch_mode_flags"):
        flags = getattr(mode, name, None)
        if flags:
            flags.pop()
    _sync_flags()
