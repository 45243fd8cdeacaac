"""Which module is running, in forward and in backward, while a training step runs.

:class:`ModuleScope` answers "which module made this tensor" for the breakdown tracer
(:mod:`.tracer`), and notes the autocast dtype a module's forward ran under.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_seqmem.diagnostics.categories import module_infos
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    >>> scope, seen = ModuleScope(module_infos(model), model, "cpu"), []
    >>> hook = lambda m, a: seen.append(scope.current()[0])
    >>> model[1].register_forward_pre_hook(hook)  # doctest: +ELLIPSIS
    <...RemovableHandle...>
    >>> scope.install()
    >>> _ = model(torch.ones(1, 2))
    >>> scope.remove()
    >>> seen, scope.root_forward_ran
    (['1'], True)
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.nn.modules.module import (register_module_forward_hook,
                                     register_module_forward_pre_hook)
from torch.utils._pytree import tree_flatten

__all__ = ["ModuleScope", "in_backward"]


def in_backward() -> bool:
    """Whether the autograd engine runs a backward pass now (as ``torch.utils.module_tracker``)."""
    return torch._C._current_graph_task_id() != -1  # as ModuleTracker.is_bw


# key in autograd Node.metadata: (path, chain) of the module that made the node
_NODE_KEY = "lightning_seqmem.module"


class ModuleScope:
    """Which module is running. Forward: a stack kept by global module hooks. Backward: when a
    module's forward returns, the autograd nodes it created (from its outputs back to its inputs'
    nodes, not yet claimed by an inner module) are labelled with it in ``Node.metadata``; during
    backward the node being run (``torch._C._current_autograd_node()``) names the module.
    Recomputation under activation checkpointing runs forward hooks again in the backward, and the
    stack wins."""

    def __init__(self, infos: dict[int, tuple[str, tuple]], root: nn.Module,
                 device_type: str) -> None:
        self.infos = infos
        self.root = root
        self.device_type = device_type
        self.stack: list[tuple[nn.Module, set[int]]] = []  # (module, ids of its inputs' grad_fn)
        self.root_forward_ran = False
        self.autocast_dtype: Optional[torch.dtype] = None
        self._handles: list[Any] = []

    def info(self, module: nn.Module) -> tuple[str, tuple]:
        found = self.infos.get(id(module))
        if found is None:
            name = type(module).__name__
            return f"<{name}>", (("", name),)
        return found

    def current(self) -> Optional[tuple[str, tuple]]:
        """(path, chain) of the innermost running module, or ``None`` outside every module."""
        if self.stack:
            return self.info(self.stack[-1][0])
        if in_backward():
            node = torch._C._current_autograd_node()
            if node is not None:
                return node.metadata.get(_NODE_KEY)
        return None

    def _pre(self, module: nn.Module, args: Any) -> None:
        if self.autocast_dtype is None and torch.is_autocast_enabled(self.device_type):
            self.autocast_dtype = torch.get_autocast_dtype(self.device_type)
        boundary = {id(t.grad_fn) for t in tree_flatten(args)[0]
                    if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        self.stack.append((module, boundary))

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        boundary: set[int] = set()
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] is module:
                boundary = self.stack[i][1]
                del self.stack[i:]
                break
        if module is self.root or (not self.stack and id(module) in self.infos):
            # the model's forward returned: the root's, or (a LightningModule whose training_step
            # calls its model, not itself) an outermost module of the model's
            self.root_forward_ran = True
        label = self.info(module)
        todo = [t.grad_fn for t in tree_flatten(output)[0]
                if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        visited = set(boundary)
        while todo:  # walk back to the inputs; nodes of inner modules are crossed, not relabelled
            node = todo.pop()
            if id(node) in visited or type(node).__name__ == "AccumulateGrad":
                continue
            visited.add(id(node))
            node.metadata.setdefault(_NODE_KEY, label)
            todo.extend(fn for fn, _ in node.next_functions if fn is not None)

    def install(self) -> None:
        self._handles = [register_module_forward_pre_hook(self._pre),
                         register_module_forward_hook(self._post, always_call=True)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.stack.clear()

