"""A simulated accelerator: fake tensors on a device this torch build does not have.

Fake CUDA tensors cannot run a backward on a CPU build of torch (autograd asks the CUDA runtime for
a device guard), and fake CPU tensors cannot tell device from host memory (``CPUOffloadPolicy``,
activation offload). So ``device="cuda"`` without CUDA steps on a *simulated device*: torch's
``PrivateUse1`` key registered as the Python backend :data:`SIMULATED`, with fake tensors only.
Autograd, optimizers and FSDP2 run on it as on any accelerator (``cpu`` stays the host); allocations
round to CUDA's 512-byte blocks (:func:`.cuda.allocator_block_bytes`), autocast follows CUDA's op
lists (``ATen/autocast_mode.h``) and cast cache, attention kernels are modelled by :mod:`.kernels`.
Registered per process; none where a real backend owns ``PrivateUse1`` (:func:`simulation_refusal`).

>>> from torch._subclasses.fake_tensor import FakeTensorMode
>>> device = simulated_device()
>>> device.type == SIMULATED, stands_for(device), stands_for(torch.device("cpu"))
(True, 'cuda', 'cpu')
>>> with FakeTensorMode():
...     w = torch.nn.Parameter(torch.empty(8, 8, device=device))
...     with autocast(device, torch.bfloat16):
...         y = torch.empty(4, 8, device=device) @ w
...     y.float().sum().backward()
>>> y.dtype, w.grad.dtype, w.grad.device.type == SIMULATED
(torch.bfloat16, torch.float32, True)
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils._pytree import tree_map

__all__ = ["SIMULATED", "autocast", "contained_unpack_failures", "host_of", "is_simulated",
           "on_registered", "register_early", "simulated_device", "simulating",
           "simulation_refusal", "stands_for", "step_context", "to_host_device"]

SIMULATED = "seqmem"
"""The device type of the simulated accelerator (``torch.device("seqmem", 0)``): a modelled CUDA."""

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"registered": False, "refusal": None, "library": None}
_HOOKS: list[Callable[[], None]] = []  # run once the device is registered (on_registered)
_ACTIVE = [0]  # dry runs on the simulated device now running (see simulating)


class _Backend:
    """The device module (``torch.seqmem``): one bf16-able device, *available only while a dry run
    runs on it* (:func:`simulating`), so ``torch.accelerator``, ``pin_memory``, distributed
    checkpointing and ``fork_rng`` otherwise see none."""

    def is_initialized(self) -> bool:
        return True

    def is_available(self) -> bool:
        return _ACTIVE[0] > 0

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1 if _ACTIVE[0] > 0 else 0

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        return None

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        return True

    def synchronize(self, device: Any = None) -> None:
        return None

    # -- streams and events for FSDP2 and DeviceMesh: no kernel runs; references keep tensors alive
    def set_device(self, device: Any) -> None:
        return None

    def current_stream(self, device: Any = None) -> "_Stream":
        return _DEFAULT_STREAM

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext(stream)

    @property
    def Stream(self) -> type:  # noqa: N802 - the name torch.cuda.Stream has
        return _Stream

    @property
    def Event(self) -> type:  # noqa: N802 - the name torch.cuda.Event has
        return _Event


class _Event:
    """A ``torch.cuda.Event`` of the simulated device: every call returns at once.

    >>> _Event().record(), _Event().query()
    (None, True)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class _Stream:
    """A ``torch.cuda.Stream`` of the simulated device: waits return at once, ``record_event``
    returns an event (as FSDP2 expects of any device but the CPU).

    >>> isinstance(_Stream(priority=-1).record_event(), _Event)
    True
    """

    def __init__(self, *args: Any, priority: int = 0, **kwargs: Any) -> None:
        self.priority = priority

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Optional[_Event] = None) -> _Event:
        return event if event is not None else _Event()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


_DEFAULT_STREAM = _Stream()


def simulation_refusal() -> Optional[str]:
    """Why no simulated device can be used in this process (None: it can be, or is)."""
    if _STATE["registered"]:
        return _STATE["refusal"]
    name = torch._C._get_privateuse1_backend_name()
    if name not in ("privateuseone", SIMULATED):
        return (f"the PrivateUse1 device key already belongs to the {name!r} backend, so no "
                "simulated device can be registered in this process; dry-run on the device itself")
    return None


def _register() -> None:
    from torch.utils import backend_registration

    reason = simulation_refusal()
    if reason is not None:
        raise RuntimeError(reason)
    if torch._C._get_privateuse1_backend_name() != SIMULATED:
        backend_registration._setup_privateuseone_for_python_backend(
            rename=SIMULATED, backend_module=_Backend(), hook=_Hooks())
    _STATE["library"] = _register_autocast()
    for hook in _HOOKS:
        hook()
    _STATE["registered"] = True
    _STATE["refusal"] = _backward_refusal()


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    """The C++ side's view of the device (``torch.accelerator``): available while a dry run runs."""

    def is_available(self) -> bool:
        return _ACTIVE[0] > 0

    def has_primary_context(self, dev_id: int) -> bool:
        return True

    def is_built(self) -> bool:
        return True


@contextlib.contextmanager
def simulating(device: Any = None) -> Iterator[None]:
    """While it lasts the simulated device reports itself available (FSDP2's device mesh and the
    optimizers ask); a no-op for any other ``device`` (None: the simulated one)."""
    if device is not None and not is_simulated(device):
        yield
        return
    _ACTIVE[0] += 1
    try:
        yield
    finally:
        _ACTIVE[0] -= 1
def on_registered(hook: Callable[[], None]) -> None:
    """Run ``hook()`` when the simulated device is registered (at once if it is already), before
    its first use: how :mod:`.kernels` puts CUDA's kernels on it."""
    with _LOCK:
        if _STATE["registered"]:
            hook()
        else:
            _HOOKS.append(hook)


def _backward_refusal() -> Optional[str]:
    """Why a backward cannot run on the simulated device (registered too late), or None."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with simulating(), FakeTensorMode():
            x = torch.empty(2, device=torch.device(SIMULATED, 0), requires_grad=True)
            (x * 2).sum().backward()
    except RuntimeError as exc:
        if "device_ready_queues_" not in str(exc):
            raise
        return ("the simulated CUDA device was registered after this process ran its first "
                "backward (the autograd engine sizes its device queues then); import "
                "lightning_seqmem.dryrun before training, or plan with `seqmem plan`")
    return None


def register_early() -> None:
    """Register the simulated device now where this build has no CUDA and ``PrivateUse1`` is free
    (``dryrun`` does so on import, before any backward); never raises."""
    if torch.cuda.is_available() or simulation_refusal() is not None:
        return
    with contextlib.suppress(Exception):  # a dry run that asks for it says why
        simulated_device()


def simulated_device() -> torch.device:
    """The simulated accelerator (registered on first use); raises ``RuntimeError`` where this
    process cannot have one (:func:`simulation_refusal` says why)."""
    with _LOCK:
        if not _STATE["registered"]:
            _register()
    if _STATE["refusal"] is not None:
        raise RuntimeError(_STATE["refusal"])
    return torch.device(SIMULATED, 0)


def is_simulated(device: Any) -> bool:
    """Whether ``device`` (a device, a string, or None) is the simulated accelerator.

    >>> is_simulated("cpu"), is_simulated(None)
    (False, False)
    """
    return device is not None and torch.device(device).type == SIMULATED


def stands_for(device: Any) -> str:
    """The device type a dry run on ``device`` answers for: ``"cuda"`` if simulated, else its own.

    >>> stands_for("cpu"), stands_for("meta")
    ('cpu', 'meta')
    """
    return "cuda" if is_simulated(device) else torch.device(device).type


def host_of(device: Any) -> Optional[str]:
    """The device type of host memory apart from ``device`` (``"cpu"``; None for the CPU).

    >>> host_of("cpu") is None, host_of("cuda:0")
    (True, 'cpu')
    """
    return None if torch.device(device).type in ("cpu", "meta") else "cpu"


def to_host_device(obj: Any) -> Any:
    """``obj`` with every accelerator device (a ``torch.device``, or a CUDA or simulated one's
    name) replaced by ``cpu``: an op rerun for real on a dry run's values runs in host memory.

    >>> to_host_device({"device": torch.device("cuda", 1), "n": 3, "to": "cuda:0",
    ...                 "mode": "floor"})
    {'device': device(type='cpu'), 'n': 3, 'to': 'cpu', 'mode': 'floor'}
    """
    def swap(x: Any) -> Any:
        if isinstance(x, torch.device) and x.type not in ("cpu", "meta"):
            return torch.device("cpu")
        if isinstance(x, str) and x.split(":")[0] in ("cuda", SIMULATED):
            return "cpu"
        return x

    return tree_map(swap, obj)


# -- autocast on the simulated device: CUDA's op lists (ATen/autocast_mode.h) ---------------------
# AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_PROMOTE
_LOWER = (
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
    "chain_matmul", "linalg_multi_dot", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)
_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "rms_norm",
    "group_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
)
_FP32_SET_DTYPE = ("prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
                   "linalg_matrix_norm", "sum")
_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
            "index_put", "tensordot", "scatter_add")
_CAST_CACHE: dict[int, tuple[Any, torch.Tensor]] = {}  # id(fp32 leaf) -> (weakref, its cast)
# open caching autocast() regions. Not torch.is_autocast_cache_enabled(): it is per thread and on in
# autograd's device thread, where a recompute would cache casts kept alive into the optimizer step
_CACHING = [0]


def _eligible(x: Any) -> bool:
    return (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64
            and x.device.type == SIMULATED)


def _cast(dtype: torch.dtype, cache: bool) -> Callable[[Any], Any]:
    import weakref

    def cast(x: Any) -> Any:
        if not _eligible(x) or x.dtype == dtype:
            return x
        if cache and dtype != torch.float32 and x.is_leaf and x.requires_grad and _CACHING[0] > 0:
            entry = _CAST_CACHE.get(id(x))
            if entry is not None and entry[0]() is x:
                return entry[1]
            out = x.to(dtype)
            _CAST_CACHE[id(x)] = (weakref.ref(x), out)
            return out
        return x.to(dtype)

    return cast


def _without_autocast() -> Any:
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)
    return torch._C._ExcludeDispatchKeyGuard(keys)


def _cast_kernel(op: Any, dtype: Optional[torch.dtype] = None) -> Callable[..., Any]:
    """``op`` on its arguments cast to ``dtype`` (None: the autocast dtype, with the cast cache)."""
    def kernel(*args: Any, **kwargs: Any) -> Any:
        to = torch.get_autocast_dtype(SIMULATED) if dtype is None else dtype
        with _without_autocast():
            args, kwargs = tree_map(_cast(to, dtype is None), (args, kwargs))
            return op(*args, **kwargs)

    return kernel


def _set_dtype_kernel(op: Any) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with _without_autocast():
            lower = any(_eligible(x) and x.dtype in (torch.float16, torch.bfloat16)
                        for x in torch.utils._pytree.tree_flatten((args, kwargs))[0])
            names = [a.name for a in op._schema.arguments]
            if lower and "dtype" in names:
                at = names.index("dtype")
                if at < len(args):  # given by position (softmax(x, -1, None))
                    if args[at] is None:
                        args = (*args[:at], torch.float32, *args[at + 1:])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)

    return kernel


def _promote_kernel(op: Any) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with _without_autocast():
            floats = [x.dtype for x in torch.utils._pytree.tree_flatten((args, kwargs))[0]
                      if _eligible(x)]
            widest = floats[0] if floats else None
            for d in floats[1:]:
                widest = torch.promote_types(widest, d)
            if widest is not None:
                args, kwargs = tree_map(_cast(widest, False), (args, kwargs))
            return op(*args, **kwargs)

    return kernel


def _register_autocast() -> Any:
    lib = torch.library.Library("aten", "IMPL")
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    for names, make in ((_LOWER, _cast_kernel),
                        (_FP32, lambda op: _cast_kernel(op, torch.float32)),
                        (_FP32_SET_DTYPE, _set_dtype_kernel), (_PROMOTE, _promote_kernel)):
        for name in names:
            packet = getattr(torch.ops.aten, name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                op = getattr(packet, overload)
                if not any(a.alias_info is not None and a.alias_info.is_write
                           for a in op._schema.arguments):  # out= and in-place ones run as they are
                    lib.impl(op, make(op), "AutocastPrivateUse1")
    return (lib, fallback)


@contextlib.contextmanager
def autocast(device: Any, dtype: torch.dtype, enabled: bool = True,
             cache_enabled: bool = True) -> Iterator[None]:
    """``torch.autocast`` on ``device``; on the simulated device with CUDA's op lists and, with
    ``cache_enabled``, its cache of weight casts (each fp32 leaf cast once per outermost region)."""
    device = torch.device(device)
    caching = int(device.type == SIMULATED and enabled and cache_enabled)
    _CACHING[0] += caching
    try:
        with torch.autocast(device.type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled):
            yield
    finally:
        _CACHING[0] -= caching
        if device.type == SIMULATED and _CACHING[0] == 0:
            _CAST_CACHE.clear()


def step_context(precision_plugin: Any, device: Any) -> Callable[[], Any]:
    """The zero-argument factory of a step's context for a dry run on ``device``: the precision
    plugin's ``train_step_context``, but on the simulated device a mixed-precision plugin's autocast
    becomes CUDA's, with its dtype and no cast cache (as Lightning's ``MixedPrecision``).

    >>> from types import SimpleNamespace
    >>> plain = SimpleNamespace(precision="32-true", train_step_context=contextlib.nullcontext)
    >>> step_context(plain, simulated_device()) is contextlib.nullcontext
    True
    """
    precision = str(getattr(precision_plugin, "precision", ""))
    if not is_simulated(device) or precision not in ("bf16-mixed", "16-mixed"):
        return precision_plugin.train_step_context
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    return lambda: autocast(device, dtype, cache_enabled=False)


@contextlib.contextmanager
def contained_unpack_failures(device: Any) -> Iterator[list[BaseException]]:
    """On the simulated device, keep a failure in a saved-tensor unpack hook (a checkpoint's
    recompute, ``save_on_cpu``'s copy back) from the autograd engine, which would abort (its device
    thread cannot call the Python device guard with an error pending): it goes to the yielded list
    for the caller to raise after the backward, and a fake tensor of the saved shape stands in.

    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> def unpack(_):
    ...     raise RuntimeError("boom")
    >>> device = simulated_device()
    >>> with contained_unpack_failures(device) as failures, simulating(), FakeTensorMode():
    ...     x = torch.empty(4, device=device, requires_grad=True)
    ...     with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
    ...         y = (x * x).sum()
    ...     y.backward()
    >>> [str(e) for e in failures]  # x * x saved x twice: two unpacks
    ['boom', 'boom']
    """
    failures: list[BaseException] = []
    if not is_simulated(device):
        yield failures
        return
    hooks = torch.autograd.graph.saved_tensors_hooks
    original = hooks.__enter__

    def enter(self: Any) -> None:
        pack, unpack = self.pack_hook, self.unpack_hook

        def safe_pack(t: torch.Tensor) -> Any:
            return pack(t), (tuple(t.shape), tuple(t.stride()), t.dtype, t.device)

        def safe_unpack(packed: Any) -> torch.Tensor:
            inner, (shape, stride, dtype, where) = packed
            try:
                return unpack(inner)
            except BaseException as exc:  # noqa: BLE001 - raised by the caller, after the backward
                failures.append(exc)
                return torch.empty_strided(shape, stride, dtype=dtype, device=where)

        torch._C._autograd._push_saved_tensors_default_hooks(safe_pack, safe_unpack)

    hooks.__enter__ = enter  # type: ignore[method-assign]
    try:
        yield failures
    finally:
        hooks.__enter__ = original  # type: ignore[method-assign]
