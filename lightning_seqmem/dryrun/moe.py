"""Mixture-of-Experts in a dry run: a fake grouped matmul, and the routers' choices as values.

* **``aten._grouped_mm``**: PyTorch's meta kernel takes bfloat16 only, the real op float32 and
  float16 too: :class:`DryRunFakeMode` runs :func:`grouped_mm_fake` (backward: two more grouped
  matmuls). transformers' ``"deepgemm"`` and ``"sonicmoe"`` experts (CUDA kernels) are not modelled.
* **Data-dependent routing**: a router picks each token's top-k experts from activations fake
  tensors lack, and an eager experts loop sizes each expert's tensors by its tokens. Inside an MoE
  block (:func:`is_moe_block`) every ``topk`` on an activation gets known indices
  (:class:`RoutedValues`): :func:`routing_assignment`, the *heaviest* routing.

The routing assumed: every expert runs; experts ``0 .. k-1`` take every token but one token each of
experts ``k .. E-1`` takes instead of expert ``k-1``. Every routing sends ``T·k`` token-expert pairs
(the same saved bytes); an eager loop runs experts in ascending order, the heavy ones first in the
forward and last in the backward, when every other expert's full-size gradient buffers exist and the
heavy ones' saved tensors are alive. No routing measured (``tests/test_moe_dry_run.py``) peaks
higher. So the dry run is **exact** where no size depends on the routing (grouped or batched
matmuls), an **upper bound** where sizes do (an eager loop; on CUDA another routing's 512-byte
rounding adds at most 511 bytes per small tensor), as ``detail`` says (:func:`routing_note`). Beyond
:func:`.values.value_max_bytes` (an eager loop's ``one_hot`` is ``T·k·(E+1)`` int64) it refuses.

>>> import torch
>>> with DryRunFakeMode():
...     x = torch.empty(10, 16)
...     w = torch.empty(3, 6, 16).transpose(-2, -1)  # 3 experts, 16 -> 6
...     y = torch._grouped_mm(x, w, offs=torch.tensor([3, 5, 10], dtype=torch.int32))
>>> tuple(y.shape), y.stride(), y.dtype  # the last dimension padded to 16 bytes
((10, 6), (8, 1), torch.float32)
>>> routing_assignment(tokens=4, k=2, experts=4).tolist()  # 0, 1 heavy; 2, 3 one token each
[[0, 2], [0, 3], [0, 1], [0, 1]]
"""

from __future__ import annotations

import contextlib
import re
import threading
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from lightning_seqmem.dryrun.values import BatchValues

__all__ = ["FAKE_KERNELS", "DryRunFakeMode", "RoutedValues", "RoutingScope", "grouped_mm_fake",
           "is_moe_block", "routing_assignment", "routing_note", "routing_scope"]

aten = torch.ops.aten
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_strides(mat: torch.Tensor) -> None:
    """``check_valid_strides_and_return_transposed``: row- or column-major in the last two
    dimensions, the leading stride a multiple of 16 bytes (the data 16-byte aligned off the CPU)."""
    stride, size, end = mat.stride(), mat.shape, mat.dim() - 1
    alignment = 16 // mat.element_size()
    if mat.device.type != "cpu" and (mat.storage_offset() * mat.element_size()) % 16:
        raise RuntimeError("expected data_ptr to be aligned to 16 bytes")
    if stride[end - 1] == 1 and stride[end] >= max(1, size[end - 1]):
        leading = stride[end]
    elif stride[end] == 1 and stride[end - 1] >= max(1, size[end]):
        leading = stride[end - 1]
    else:
        raise RuntimeError(f"Invalid strides/sizes, got {list(stride)} for strides and "
                           f"{list(size)} for sizes")
    if leading % alignment:
        raise RuntimeError("strides should be multiple of 16 bytes")


def _grouped_mm_out_shape(mat_a: torch.Tensor, mat_b: torch.Tensor,
                          offs: Optional[torch.Tensor]) -> list[int]:
    """``create_grouped_gemm_output_tensor``'s sizes."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        return [offs.shape[0], mat_a.shape[0], mat_b.shape[1]]
    if mat_a.dim() == 2:
        if offs.shape[0] != mat_b.shape[0]:
            raise RuntimeError("matrix batch sizes have to match")
        return [mat_a.shape[0], mat_b.shape[-1]]
    if mat_b.dim() == 2:
        if offs.shape[0] != mat_a.shape[0]:
            raise RuntimeError("matrix batch sizes have to match")
        return [mat_a.shape[1], mat_b.shape[1]]
    if mat_a.shape[0] != mat_b.shape[0]:
        raise RuntimeError("batched dimension has to match")
    return [mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1]]


def grouped_mm_fake(mode: FakeTensorMode, mat_a: torch.Tensor, mat_b: torch.Tensor,
                    offs: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                    out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``aten._grouped_mm`` on fake tensors, checked and allocated as by the real op
    (``ATen/native/GroupedMMUtils.h``): operands of one dtype, float32, bfloat16 or float16, the
    output too, its last stride padded to 16 bytes (on CPU and CUDA; not on ROCm).

    >>> mode = DryRunFakeMode()
    >>> with mode:
    ...     a = torch.empty(8, 16, dtype=torch.bfloat16)
    ...     b = torch.empty(16, 8, dtype=torch.bfloat16)
    ...     offs = torch.tensor([4, 8], dtype=torch.int32)
    >>> out = grouped_mm_fake(mode, a.t(), b, offs)  # 2d x 2d: a weight gradient per group
    >>> tuple(out.shape), out.dtype
    ((2, 16, 8), torch.bfloat16)
    >>> grouped_mm_fake(mode, a.double(), b.double(), offs)
    Traceback (most recent call last):
    ...
    RuntimeError: Expected mat_a to be Float32, BFloat16 or Float16 matrix, got torch.float64
    """
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        if mat.dtype not in _GROUPED_MM_DTYPES:
            raise RuntimeError(f"Expected {name} to be Float32, BFloat16 or Float16 matrix, "
                               f"got {mat.dtype}")
        if mat.dim() not in (2, 3):
            raise RuntimeError(f"{name} has to be 2 or 3d")
    if (mat_a.dim() == 3 or mat_b.dim() == 3) and mat_a.shape[-1] != mat_b.shape[-2]:
        raise RuntimeError("contraction dimension of mat_a and mat_b must match")
    _check_strides(mat_a)
    _check_strides(mat_b)
    if (offs is not None) != (mat_a.dim() == 2 or mat_b.dim() == 2):
        raise RuntimeError("Have to provide offsets if there is a 2d matrix, or no offset if both "
                           "matrices are 3d")
    if offs is not None and (offs.dim() != 1 or offs.dtype != torch.int32):
        raise RuntimeError("offs has to be 1D" if offs.dim() != 1 else "Offsets have to be int32")
    if bias is not None:
        raise RuntimeError("Bias not supported yet")
    dtype = mat_a.dtype if out_dtype is None else out_dtype
    if dtype != mat_a.dtype:
        raise RuntimeError("Grouped gemm output dtype must match `mat_a` dtype")
    if mat_b.dtype != mat_a.dtype:
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {mat_a.dtype} != "
                           f"{mat_b.dtype}")
    size = _grouped_mm_out_shape(mat_a, mat_b, offs)
    alignment = 16 // dtype.itemsize
    padded = -(-size[-1] // alignment) * alignment
    stride = [padded, 1] if len(size) == 2 else [size[1] * padded, padded, 1]
    if torch.version.hip:
        stride = list(torch.empty(size, device="meta").stride())
    with mode:
        return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)


FAKE_KERNELS: dict[Any, Callable[..., Any]] = {aten._grouped_mm.default: grouped_mm_fake}
"""op -> fake kernel ``(mode, *args, **kwargs)``, in place of PyTorch's meta kernel in a dry run."""


class DryRunFakeMode(FakeTensorMode):
    """``FakeTensorMode`` with :data:`FAKE_KERNELS` for mismatched meta kernels (this mode only)."""

    def dispatch(self, func, types, args=(), kwargs=None):  # noqa: D102 - FakeTensorMode's own
        kernel = FAKE_KERNELS.get(func)
        if kernel is not None:
            return kernel(self, *args, **(kwargs or {}))
        return super().dispatch(func, types, args, kwargs)


def routing_assignment(tokens: int, k: int, experts: int) -> torch.Tensor:
    """The ``[tokens, k]`` expert indices a dry run gives a router's top-k: the heaviest routing.

    >>> routing_assignment(tokens=5, k=2, experts=4).tolist()
    [[0, 2], [0, 3], [0, 1], [0, 1], [0, 1]]
    >>> routing_assignment(tokens=3, k=1, experts=2).tolist()
    [[1], [0], [0]]
    """
    out = torch.arange(k, dtype=torch.long).repeat(tokens, 1)
    light = min(experts - k, tokens)
    out[:light, k - 1] = torch.arange(k, k + light)
    return out


_MOE_NAME = re.compile(r"moe|mixture|expert|sparsemlp", re.IGNORECASE)


def is_moe_block(module: nn.Module) -> bool:
    """A Mixture-of-Experts block: it holds an ``experts`` submodule (transformers' MoE models), or
    a ``router`` or ``gate`` one and its class is named so (``...MoE``, ``...SparseMLP``).

    >>> class Block(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.gate, self.experts = nn.Linear(4, 2), nn.ModuleList([nn.Linear(4, 4)] * 2)
    >>> is_moe_block(Block()), is_moe_block(nn.Linear(2, 2))
    (True, False)
    """
    children = module._modules
    if isinstance(children.get("experts"), nn.Module):
        return True
    has_router = any(isinstance(children.get(name), nn.Module) for name in ("router", "gate"))
    return has_router and bool(_MOE_NAME.search(type(module).__name__))


def _reads_values(func: Any, args: tuple) -> bool:
    """Whether ``func``'s output (its shape, or a Python value) depends on its inputs' values."""
    tags = getattr(func, "tags", ())
    if torch.Tag.data_dependent_output in tags:
        return True
    if torch.Tag.dynamic_output_shape not in tags:
        return False
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        indices = (args[1] if len(args) > 1 else None) or ()  # integer indices: the shape is theirs
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                   for i in indices)
    return True


class RoutedValues(BatchValues):
    """:class:`.values.BatchValues` giving an MoE block's ``topk`` the routing
    (:func:`routing_scope`); ``value_reads``: ops whose output depends on routed values."""

    def __init__(self, fake_mode: FakeTensorMode, max_bytes: int) -> None:
        super().__init__(fake_mode, max_bytes)
        self._depth: dict[int, int] = {}  # thread id -> MoE blocks running on it now (nested)
        self.routed_topk = 0  # topk calls given the routing
        self.blocks: dict[str, set[int]] = {}  # "class (implementation)" -> ids of the blocks run
        self.value_reads: set[str] = set()
        self._routed: dict[int, weakref.ref] = {}  # id(fake) -> ref to it: derived from the routing

    def enter_block(self, module: nn.Module) -> None:
        """An MoE block starts on this thread (the autograd engine's own, for a recomputation)."""
        thread = threading.get_ident()
        self._depth[thread] = self._depth.get(thread, 0) + 1
        experts = module._modules.get("experts")
        impl = getattr(getattr(experts, "config", None), "_experts_implementation", None)
        name = type(module).__name__ + (f" ({impl} experts)" if impl else "")
        self.blocks.setdefault(name, set()).add(id(module))

    def leave_block(self) -> None:
        thread = threading.get_ident()
        depth = self._depth.get(thread, 0) - 1
        if depth > 0:
            self._depth[thread] = depth
        else:
            self._depth.pop(thread, None)

    def in_block(self) -> bool:
        return bool(self._depth) and threading.get_ident() in self._depth

    def known(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s values are known (a real twin, or a real tensor)."""
        return self._value(t) is not None

    def _is_routed(self, t: torch.Tensor) -> bool:
        ref = self._routed.get(id(t))
        return ref is not None and ref() is t

    def _mark(self, t: torch.Tensor) -> None:
        key = id(t)
        self._routed[key] = weakref.ref(t, lambda _, k=key: self._routed.pop(k, None))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        routed = bool(self._routed) and any(isinstance(t, torch.Tensor) and self._is_routed(t)
                                            for t in tree_flatten((args, kwargs))[0])
        if routed and _reads_values(func, args):
            self.value_reads.add(str(func.overloadpacket.__name__))
        if routed and func is aten.histc.default and not args[0].is_floating_point():
            return self._histc_of_integers(func, args, kwargs)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func is aten.topk.default and self.in_block() and self._value(args[0]) is None:
            self._route(out[1], args[0], *args[1:])
        elif routed:
            for t in tree_flatten(out)[0]:
                if isinstance(t, FakeTensor) and self._value(t) is not None:
                    self._mark(t)
        return out

    def _route(self, indices: torch.Tensor, scores: torch.Tensor, k: int, dim: int = -1,
               *_: Any) -> None:
        experts = scores.shape[dim]
        moved = indices.movedim(dim, -1)
        with _disable_current_modes():
            value = routing_assignment(moved.numel() // max(k, 1), k, experts)
            value = value.view(moved.shape).movedim(-1, dim)
        self.give(indices, value.contiguous())
        if self._value(indices) is not None:
            self._mark(indices)
            self.routed_topk += 1

    def _histc_of_integers(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``histc`` of integer expert ids (CUDA has it, the host not): the twin on a float copy."""
        out = func(*args, **kwargs)
        value = self._value(args[0])
        if value is not None:
            with _disable_current_modes():
                real = func(value.cpu().double(), *args[1:], **kwargs).to(out.dtype)
            self.give(out, real)
            self._mark(out)
        return out


class RoutingScope:
    """Counts MoE blocks in the watched :class:`RoutedValues`, held weakly (freeable while open)."""

    def __init__(self) -> None:
        self._values: Callable[[], Optional[RoutedValues]] = lambda: None

    def watch(self, session: Any) -> Any:
        """``session`` (``(fake_mode, values)``) returned as given, its values watched."""
        values = session[1]
        if isinstance(values, RoutedValues):
            self._values = weakref.ref(values)
        return session

    def values(self) -> Optional[RoutedValues]:
        return self._values()


@contextlib.contextmanager
def routing_scope() -> Iterator[RoutingScope]:
    """While held, every MoE block (:func:`is_moe_block`) that runs counts in the values watched
    (per thread: a recomputation runs on the autograd engine's), so its router's top-k choices are
    the routing assumed. Process-wide module hooks; the values act only on the dry run's threads.

    >>> mode = DryRunFakeMode()
    >>> with routing_scope() as scope:
    ...     fake_mode, values = scope.watch((mode, RoutedValues(mode, 2**20)))
    ...     with fake_mode, values:
    ...         scores = torch.empty(6, 4)
    ...         values.forget(scores)  # as an activation's: values unknown
    ...         _, outside = scores.topk(2)
    ...         block = nn.Module()
    ...         block.experts = nn.Identity()
    ...         block.forward = lambda x: x.topk(2)[1]
    ...         inside = block(scores)
    >>> values.known(outside), values.known(inside), list(values.blocks)
    (False, True, ['Module'])
    """
    scope = RoutingScope()

    def enter(module: nn.Module, inputs: Any) -> None:
        values = scope.values()
        if values is not None and is_moe_block(module):
            values.enter_block(module)

    def leave(module: nn.Module, inputs: Any, output: Any) -> None:
        values = scope.values()
        if values is not None and is_moe_block(module):
            values.leave_block()

    pre = nn.modules.module.register_module_forward_pre_hook(enter)
    post = nn.modules.module.register_module_forward_hook(leave, always_call=True)
    try:
        yield scope
    finally:
        pre.remove()
        post.remove()


def routing_note(values: Any) -> Optional[str]:
    """What the dry run assumed of the routing, for the result's ``detail`` (None: no MoE ran).

    >>> print(routing_note(None))
    None
    """
    if not isinstance(values, RoutedValues) or not values.blocks:
        return None
    blocks = ", ".join(f"{len(ids)} {name}" for name, ids in values.blocks.items())
    if values.routed_topk:
        assumed = ("each router's top-k fixed to the heaviest routing (every expert runs; experts "
                   f"0..k-1 take every token, each other expert one) in MoE blocks ({blocks})")
    else:
        assumed = f"MoE blocks ({blocks}) run without the routing's values (beyond the size kept)"
    if values.value_reads:
        reads = ", ".join(sorted(values.value_reads))
        verdict = (f"sizes depended on it ({reads}): an upper bound for a loop over experts in "
                   "ascending order (transformers' eager experts)")
    else:
        verdict = "no size depended on it: exact for any routing"
    return f"routing modelled: {assumed}; {verdict}"
