"""Memory breakdown and diagnostics: which module, which tensor, and why.

:func:`trace_breakdown` runs one training step under a :class:`~lightning_seqmem.measure.probes.LiveTensorTracker`
that also records, for every storage it sees allocated, the innermost module running at that moment
(forward, or backward through gradient hooks), the op, shape and dtype, and whether autograd saved it
for backward (a ``saved_tensors_hooks`` pack hook). At the step's peak moment the live storages are
grouped by *category* (a friendly module name, :data:`CATEGORIES`) and *kind* (:data:`KINDS`):

* ``parameters``, ``gradients``, ``optimizer_state``: from the tensors alive before the step, the
  gradient hooks and the optimizer's state after it; ``inputs``: the other tensors passed as
  ``existing`` (the batch);
* ``activations``: allocated during the forward and still alive when the backward starts;
* ``temporaries``: everything else (forward temporaries, activation gradients, recomputation,
  optimizer scratch).

Tensors with two dimensions equal to the sequence length are *quadratic* and counted as
``attention_scores`` whatever module made them (choose lengths that differ from every model width).
:func:`compare_breakdowns` fits each part as a polynomial in L across lengths (constant, linear or
quadratic), reports the attention share of activation memory at each length and the length beyond
which attention activations outweigh the rest. :func:`diagnose` turns quadratic tensors into the
article's FAQ answers (:class:`MemoryDiagnosisWarning`), :func:`attention_ablation` reruns a step with
attention replaced by identity, and :class:`Calibration` sets the measured per-layer activations
beside Korthikanti et al. 2022.

Pure maths (:func:`fit_growth`, :func:`classify_growth`, :func:`crossover_length`,
:func:`korthikanti_activation_bytes`, :func:`module_category`) needs no tracing.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_flatten

from lightning_seqmem.mitigations import current_attention_backend, find_repeated_blocks, is_checkpointed
from lightning_seqmem.core.checks import check_int
from lightning_seqmem.measure.probes import LiveTensorTracker, _storages
from lightning_seqmem.core.units import format_bytes

__all__ = [
    "ATTENTION_CATEGORIES",
    "AllocationRecord",
    "AttentionAblation",
    "Breakdown",
    "BreakdownTable",
    "CATEGORIES",
    "Calibration",
    "KINDS",
    "MemoryDiagnosisWarning",
    "PartGrowth",
    "attention_ablation",
    "calibrate",
    "classify_growth",
    "compare_breakdowns",
    "crossover_length",
    "diagnose",
    "find_attention_modules",
    "fit_growth",
    "is_quadratic_shape",
    "korthikanti_activation_bytes",
    "module_category",
    "trace_breakdown",
]

CATEGORIES = (
    "embedding",
    "qkv_projection",
    "attention_scores",  # any tensor with two dimensions equal to L (scores, weights, masks, their grads)
    "attention_other",  # made inside an attention module by no projection: q/k/v copies, context
    "output_projection",
    "ffn",
    "norms_dropout",
    "loss_logits",
    "other",  # residual adds, position encodings, optimizer scratch, anything unrecognised
)
"""Friendly module categories, in display order."""

ATTENTION_CATEGORIES = ("qkv_projection", "attention_scores", "attention_other", "output_projection")
"""The categories counted as "attention" in the attention share and the crossover length."""

KINDS = ("parameters", "gradients", "optimizer_state", "inputs", "activations", "temporaries")
"""What a byte is for, in display order."""

GROWTHS = ("constant", "linear", "quadratic")

_MATMUL_OPS = ("aten::bmm", "aten::mm", "aten::matmul", "aten::baddbmm", "aten::addmm", "aten::addbmm")
_WRAPPER_NAMES = {"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module", "module"}


class MemoryDiagnosisWarning(UserWarning):
    """A memory problem found in a traced step, with its fix (see :func:`diagnose`)."""


# ---------------------------------------------------------------------------------------------
# Pure maths
# ---------------------------------------------------------------------------------------------
def is_quadratic_shape(shape: Sequence[int], seq_len: int) -> bool:
    """Whether a tensor of ``shape`` has two or more dimensions equal to ``seq_len``.

    Example:
        >>> is_quadratic_shape((2, 4, 48, 48), 48), is_quadratic_shape((2, 48, 64), 48)
        (True, False)
    """
    return sum(1 for d in shape if d == seq_len) >= 2


def fit_growth(seq_lens: Sequence[float], sizes: Sequence[float]) -> tuple[float, float, float]:
    """Coefficients ``(c0, c1, c2)`` of ``size ≈ c0 + c1·L + c2·L²`` through measured sizes.

    Three or more lengths: least squares. Two lengths: a single term ``c_p·L^p`` (p = 0, 1 or 2)
    when it goes through both points (within 0.1%), else the two terms that bracket the observed
    growth exponent (constant + linear below 1, linear + quadratic above).

    Example:
        >>> fit_growth([64, 128], [100 * 64**2, 100 * 128**2])
        (0.0, 0.0, 100.0)
        >>> [round(c, 6) for c in fit_growth([10, 20, 40], [7 + 3 * L + 0.5 * L * L for L in (10, 20, 40)])]
        [7.0, 3.0, 0.5]
    """
    L = np.asarray(seq_lens, dtype=np.float64)
    s = np.asarray(sizes, dtype=np.float64)
    if L.shape != s.shape or L.ndim != 1:
        raise ValueError(f"`seq_lens` and `sizes` must be 1-D of one length, got {L.shape} and {s.shape}")
    unique = np.unique(L)
    if len(unique) < 2 or np.any(L <= 0):
        raise ValueError(f"`seq_lens` must hold two or more distinct positive lengths, got {list(seq_lens)}")
    if not np.any(s):
        return (0.0, 0.0, 0.0)
    if len(unique) >= 3:
        scale = L.max()
        x = L / scale
        vander = np.stack([np.ones_like(x), x, x * x], axis=1)
        sol, *_ = np.linalg.lstsq(vander, s, rcond=None)
        return (float(sol[0]), float(sol[1] / scale), float(sol[2] / scale**2))
    s = np.array([s[L == u].mean() for u in unique])
    (L1, L2), (s1, s2) = unique, s
    for p in (0, 1, 2):
        a, b = s1 / L1**p, s2 / L2**p
        if abs(a - b) <= 1e-3 * max(abs(a), abs(b)):
            coeffs = [0.0, 0.0, 0.0]
            coeffs[p] = float((a + b) / 2)
            return tuple(coeffs)  # type: ignore[return-value]
    if s1 > 0 and s2 > 0 and math.log(s2 / s1) / math.log(L2 / L1) > 1:
        # c1·L + c2·L² through both points
        c2 = (s2 / L2 - s1 / L1) / (L2 - L1)
        return (0.0, float(s1 / L1 - c2 * L1), float(c2))
    c1 = (s2 - s1) / (L2 - L1)
    return (float(s1 - c1 * L1), float(c1), 0.0)


def classify_growth(seq_lens: Sequence[float], sizes: Sequence[float], rel_tol: float = 0.02) -> str:
    """``"constant"``, ``"linear"`` or ``"quadratic"``: how a part grows with L.

    The class is the highest-degree term present, assuming sizes have non-negative terms. Two
    lengths: ``constant`` if the size changes by at most ``rel_tol``, ``quadratic`` if it grows faster
    than L (ratio above ``(L2/L1)·(1 + rel_tol)``), else ``linear``. Three or more: the highest-degree
    term of :func:`fit_growth` that contributes at least ``rel_tol`` of the largest size at the
    longest length (falling back to the two-length rule on the two longest lengths when the fit
    misses a point by more than 5%).

    Example:
        >>> classify_growth([64, 128], [5, 5]), classify_growth([64, 128], [100 + 64, 100 + 128])
        ('constant', 'linear')
        >>> classify_growth([64, 128, 256], [1000 + L * L for L in (64, 128, 256)])
        'quadratic'
    """
    L = np.asarray(seq_lens, dtype=np.float64)
    s = np.asarray(sizes, dtype=np.float64)
    order = np.argsort(L)
    L, s = L[order], s[order]
    c = fit_growth(L, s)
    if not np.any(s):
        return "constant"
    big = float(np.abs(s).max())
    fitted = c[0] + c[1] * L + c[2] * L * L
    if len(np.unique(L)) >= 3 and np.abs(fitted - s).max() <= 0.05 * big:
        Lmax = L[-1]
        terms = [abs(c[0]), abs(c[1]) * Lmax, abs(c[2]) * Lmax**2]
        for p in (2, 1):
            if terms[p] >= rel_tol * big:
                return GROWTHS[p]
        return "constant"
    (L1, s1), (L2, s2) = (L[-2], s[-2]), (L[-1], s[-1])
    if L1 == L2:
        L1, s1 = L[0], s[0]
    if s1 <= 0 or s2 <= 0:  # appears or vanishes between lengths: judge by the fitted terms
        Lmax = L[-1]
        terms = [abs(c[0]), abs(c[1]) * Lmax, abs(c[2]) * Lmax**2]
        return GROWTHS[int(np.argmax(terms))]
    ratio = s2 / s1
    if abs(ratio - 1) <= rel_tol:
        return "constant"
    return "quadratic" if ratio > (L2 / L1) * (1 + rel_tol) else "linear"


def crossover_length(
    attention: Sequence[float], rest: Sequence[float]
) -> Optional[float]:
    """The length beyond which ``attention(L) > rest(L)`` for every larger L.

    Both arguments are ``(c0, c1, c2)`` coefficients (bytes = c0 + c1·L + c2·L²). Returns ``0.0``
    when attention already dominates at every positive length, ``None`` when it never comes to
    dominate (its leading term is not larger).

    Example:
        >>> crossover_length((0, 10, 1), (0, 100, 0))   # 10L + L² = 100L at L = 90
        90.0
        >>> crossover_length((0, 10, 0), (0, 100, 0)) is None
        True
    """
    a = np.asarray(attention, dtype=np.float64)
    r = np.asarray(rest, dtype=np.float64)
    if a.shape != (3,) or r.shape != (3,):
        raise ValueError(f"coefficients must be (c0, c1, c2), got {tuple(attention)!r} and {tuple(rest)!r}")
    d0, d1, d2 = a - r
    if abs(d2) <= 1e-12 * (abs(a[2]) + abs(r[2])):
        d2 = 0.0
    if abs(d1) <= 1e-12 * (abs(a[1]) + abs(r[1])):
        d1 = 0.0
    if d2 < 0 or (d2 == 0 and d1 < 0) or (d2 == 0 and d1 == 0 and d0 <= 0):
        return None
    if d2 == 0 and d1 == 0:
        return 0.0
    roots = np.roots([d2, d1, d0]) if d2 else np.array([-d0 / d1])
    real = [float(x.real) for x in np.atleast_1d(roots) if abs(x.imag) <= 1e-9 * max(1.0, abs(x.real))]
    return max([0.0] + real)


def _korthikanti_parts(
    seq_len: int,
    batch_size: int,
    hidden: int,
    heads: int,
    bytes_per_element: float,
    dropout: bool,
    recompute: bool,
    ffn_hidden: Optional[int],
) -> tuple[float, float]:
    """(linear, quadratic) activation bytes per layer (see :func:`korthikanti_activation_bytes`)."""
    s, b, h, a, e = seq_len, batch_size, hidden, heads, bytes_per_element
    f = 4 * h if ffn_hidden is None else ffn_hidden
    if recompute:
        return e * s * b * h, 0.0
    # elements kept (Korthikanti et al. 2022, §4.1): LN1 in, QKV in, Q, K, V, out-proj in, LN2 in,
    # MLP in (8·s·b·h) + GeLU in and out (2·s·b·f); softmax output a·s²·b
    linear = e * (8 * s * b * h + 2 * s * b * f)
    quadratic = e * a * s * s * b
    if dropout:  # 1-byte masks: attention-output and MLP dropout (2·s·b·h), softmax dropout (a·s²·b);
        linear += 2 * s * b * h  # plus the softmax-dropout output kept for the matmul with V
        quadratic += a * s * s * b + e * a * s * s * b
    return float(linear), float(quadratic)


def korthikanti_activation_bytes(
    seq_len: int,
    batch_size: int,
    hidden: int,
    heads: int,
    bytes_per_element: float = 2,
    dropout: bool = True,
    recompute: bool = False,
    ffn_hidden: Optional[int] = None,
) -> int:
    """Activation bytes one GPT layer keeps for backward (Korthikanti et al. 2022, eq. 1 and §5).

    With 16-bit activations and dropout this is the paper's ``s·b·h·(34 + 5·a·s/h)``. Adjustments,
    exactly: every non-mask term is scaled by ``bytes_per_element / 2`` (×2 for fp32); without
    dropout the three dropout terms go (the 1-byte masks after attention output and MLP, ``2·s·b·h``,
    the 1-byte softmax-dropout mask ``a·s²·b`` and the dropout output ``e·a·s²·b``), leaving
    ``e·(16·s·b·h + a·s²·b)``; ``ffn_hidden`` (default ``4·h``) replaces the paper's ``4h`` in the
    GeLU terms (``2·e·s·b·ffn_hidden``). ``recompute=True`` is the paper's full recomputation: only
    the layer input is kept, ``2·s·b·h`` (``e·s·b·h``).

    Example:
        >>> s, b, h, a = 2048, 1, 4096, 32
        >>> korthikanti_activation_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s // h)
        True
        >>> korthikanti_activation_bytes(s, b, h, a, recompute=True) == 2 * s * b * h
        True
        >>> korthikanti_activation_bytes(64, 2, 128, 4, bytes_per_element=4, dropout=False)
        1179648
    """
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("hidden", hidden), ("heads", heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    if not bytes_per_element > 0:
        raise ValueError(f"`bytes_per_element` must be positive, got {bytes_per_element!r}")
    linear, quadratic = _korthikanti_parts(
        seq_len, batch_size, hidden, heads, bytes_per_element, dropout, recompute, ffn_hidden
    )
    return int(round(linear + quadratic))


_EMB_NAMES = re.compile(r"(^|_)(wte|wpe|emb|embed|embeds|embedding|embeddings|embed_tokens|embed_positions)($|_)|emb$")
_NORM_NAMES = re.compile(r"^(ln|norm|layernorm|layer_norm|rmsnorm)|norm$|^drop|dropout")
_QKV_NAMES = {
    "qkv", "q_proj", "k_proj", "v_proj", "qkv_proj", "query", "key", "value", "c_attn", "in_proj",
    "wqkv", "query_key_value", "wq", "wk", "wv", "to_q", "to_k", "to_v", "to_qkv", "q", "k", "v",
}
_OUT_NAMES = {"proj", "o_proj", "out_proj", "c_proj", "dense", "wo", "to_out", "out", "o"}
_FFN_NAMES = {
    "mlp", "ffn", "feed_forward", "feedforward", "fc", "fc1", "fc2", "c_fc", "up_proj", "down_proj",
    "gate_proj", "gate_up_proj", "w1", "w2", "w3", "dense_h_to_4h", "dense_4h_to_h", "act", "act_fn",
    "intermediate",
}
_LOSS_NAMES = {"lm_head", "head", "loss", "logits", "classifier", "output_layer", "loss_fn", "criterion"}


def _is_attention(name: str, type_name: str) -> bool:
    lname = name.lower()
    return "attn" in lname or "attention" in lname or "Attention" in type_name


def module_category(chain: Sequence[tuple[str, str]]) -> str:
    """The friendly category (:data:`CATEGORIES`) of a module from its path.

    ``chain`` is ``(attribute name, class name)`` for each module from the root to the innermost
    (the root's name is ``""``). Levels are matched innermost first; the first that matches wins:
    Embedding → ``embedding``; norms and dropout → ``norms_dropout``; a QKV-named layer → ``qkv_projection``;
    an output-projection name inside an attention module → ``output_projection``; MLP/FFN names →
    ``ffn``; ``lm_head``/loss → ``loss_logits``; an attention module itself → ``attention_other``.

    Example:
        >>> module_category([("", "GPT"), ("blocks", "ModuleList"), ("0", "Block"), ("attn", "CausalSelfAttention"), ("proj", "Linear")])
        'output_projection'
        >>> module_category([("", "GPT2"), ("h", "ModuleList"), ("0", "Block"), ("mlp", "MLP"), ("c_proj", "Conv1D")])
        'ffn'
    """
    chain = [(n, t) for n, t in chain if n not in _WRAPPER_NAMES]
    for i in range(len(chain) - 1, -1, -1):
        name, type_name = chain[i]
        lname = name.lower()
        inside_attention = any(_is_attention(n, t) for n, t in chain[:i])
        if "Embedding" in type_name or _EMB_NAMES.search(lname):
            return "embedding"
        if "Norm" in type_name or "Dropout" in type_name or _NORM_NAMES.search(lname):
            return "norms_dropout"
        if lname in _QKV_NAMES and (inside_attention or "Linear" in type_name or "Conv1D" in type_name):
            return "qkv_projection"
        if lname in _OUT_NAMES and inside_attention:
            return "output_projection"
        if lname in _FFN_NAMES or any(k in type_name for k in ("MLP", "FeedForward", "FFN", "Mlp")):
            return "ffn"
        if lname in _LOSS_NAMES or "Loss" in type_name:
            return "loss_logits"
        if _is_attention(name, type_name):
            return "attention_other"
    return "other"


# ---------------------------------------------------------------------------------------------
# Tracing
# ---------------------------------------------------------------------------------------------
@dataclass
class AllocationRecord:
    """One storage seen by the tracer (bytes; ``module`` is the innermost module's clean path)."""

    index: int
    nbytes: int
    op: str
    shape: tuple[int, ...]
    dtype: str
    module: str  # "" for the root, "<global>" outside any module, "<ClassName>" for a module outside the model
    category: str
    phase: str  # "existing", "forward", "backward" or "optimizer"
    kind: str = "temporaries"
    saved_for_backward: bool = False
    quadratic: bool = False


def _clean(path: str) -> str:
    return ".".join(p for p in path.split(".") if p and p not in _WRAPPER_NAMES)


def _module_infos(model: nn.Module) -> dict[int, tuple[str, tuple[tuple[str, str], ...]]]:
    """id(module) → (clean path, chain of (name, class name) from the root)."""
    infos: dict[int, tuple[str, tuple[tuple[str, str], ...]]] = {}

    def visit(module: nn.Module, path: str, chain: tuple[tuple[str, str], ...]) -> None:
        if id(module) in infos:
            return
        infos[id(module)] = (_clean(path), chain)
        for name, child in module.named_children():
            visit(child, f"{path}.{name}" if path else name, chain + ((name, type(child).__name__),))

    visit(model, "", (("", type(model).__name__),))
    return infos


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1  # as torch.utils.module_tracker.ModuleTracker.is_bw


_NODE_KEY = "lightning_seqmem.module"  # key in autograd Node.metadata: (path, chain) of the module that made it


class _ModuleScope:
    """Which module is running, in forward and in backward.

    Forward: a stack kept by global module hooks. Backward: when a module's forward returns, the
    autograd nodes it created (from its outputs back to its inputs' nodes, not yet claimed by an
    inner module) are labelled with it in ``Node.metadata``; during backward the node being run
    (``torch._C._current_autograd_node()``) names the module. Recomputation under activation
    checkpointing runs forward hooks again inside the backward, and the stack wins.
    """

    def __init__(self, infos: dict[int, tuple[str, tuple]], root: nn.Module, device_type: str) -> None:
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
        if _in_backward():
            node = torch._C._current_autograd_node()
            if node is not None:
                return node.metadata.get(_NODE_KEY)
        return None

    def _pre(self, module: nn.Module, args: Any) -> None:
        if self.autocast_dtype is None and torch.is_autocast_enabled(self.device_type):
            self.autocast_dtype = torch.get_autocast_dtype(self.device_type)
        boundary = {id(t.grad_fn) for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        self.stack.append((module, boundary))

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        boundary: set[int] = set()
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] is module:
                boundary = self.stack[i][1]
                del self.stack[i:]
                break
        if module is self.root:
            self.root_forward_ran = True
        label = self.info(module)
        todo = [t.grad_fn for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        visited = set(boundary)
        while todo:  # walk back to the inputs; nodes of inner modules are crossed, not relabelled
            node = todo.pop()
            if id(node) in visited or type(node).__name__ == "AccumulateGrad":
                continue
            visited.add(id(node))
            node.metadata.setdefault(_NODE_KEY, label)
            todo.extend(fn for fn, _ in node.next_functions if fn is not None)

    def install(self) -> None:
        self._handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post, always_call=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.stack.clear()


class _BreakdownTracker(LiveTensorTracker):
    """A :class:`LiveTensorTracker` that describes every allocation (module, op, shape, phase)."""

    def __init__(self, device_type: str, seq_len: int, scope: _ModuleScope) -> None:
        super().__init__(device_type, record_events=True)
        self.seq_len = seq_len
        self.scope = scope
        self.records: list[Optional[AllocationRecord]] = []
        self.saved: set[int] = set()

    def _grow(self) -> None:
        self.records.extend([None] * (len(self._finalizers) - len(self.records)))

    def track_tensor(self, tensor: torch.Tensor, kind: str, module: str, category: str) -> None:
        before = len(self._finalizers)
        self.track_existing([tensor], kind)
        self._grow()
        for i in range(before, len(self._finalizers)):
            self.records[i] = AllocationRecord(
                i, self.events.sizes[i], f"<{kind}>", tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""),
                module, category, "existing", kind,
                quadratic=is_quadratic_shape(tuple(tensor.shape), self.seq_len),
            )

    def index_of(self, tensor: torch.Tensor) -> list[int]:
        return [self._ids[st._cdata] for st in _storages(tensor) if st._cdata in self._ids]

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, torch.Tensor) and tensor.device.type == self.device_type:
            self.saved.update(self.index_of(tensor))
        return tensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.phase == "forward" and _in_backward():
            self.mark_phase("backward")
        before = len(self._finalizers)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self._finalizers) > before:
            self._describe(out, before, func.name())
        return out

    def _describe(self, out: Any, before: int, op: str) -> None:
        self._grow()
        scope = self.scope
        current = scope.current()
        if current is not None:
            path, chain = current
            category = module_category(chain)
        else:
            path = "<global>"
            late = scope.root_forward_ran or self.phase == "backward"
            category = "loss_logits" if late and self.phase != "optimizer" else "other"
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            for st in _storages(t):
                i = self._ids.get(st._cdata)
                if i is None or i < before or self.records[i] is not None:
                    continue
                shape = tuple(t.shape)
                quadratic = is_quadratic_shape(shape, self.seq_len)
                self.records[i] = AllocationRecord(
                    i, self.events.sizes[i], op, shape, str(t.dtype).replace("torch.", ""), path,
                    "attention_scores" if quadratic else category, self.phase or "forward", quadratic=quadratic,
                )
        for i in range(before, len(self.records)):
            if self.records[i] is None:  # an output we could not match (should not happen)
                self.records[i] = AllocationRecord(i, self.events.sizes[i], op, (), "", path, category, self.phase or "forward")


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------
@dataclass
class Calibration:
    """Measured activation bytes per layer beside Korthikanti et al. 2022 (bytes, per layer)."""

    seq_len: int
    batch_size: int
    hidden: int
    heads: int
    ffn_hidden: int
    num_layers: int
    bytes_per_element: int  # of the theory's non-mask terms: the autocast dtype, else the parameters'
    dropout: bool
    recompute: bool  # activation checkpointing on: the paper's full-recompute variant
    measured_bytes: int  # mean over blocks of activations made inside the block
    measured_quadratic_bytes: int  # the part in tensors with two dimensions equal to L
    theory_bytes: int  # korthikanti_activation_bytes(...) with the fields above
    theory_quadratic_bytes: int
    paper_16bit_bytes: int  # s·b·h·(34 + 5·a·s/h), the paper's headline (16-bit, dropout)
    explanation: str

    @property
    def ratio(self) -> float:
        """Measured over theory."""
        return self.measured_bytes / self.theory_bytes if self.theory_bytes else float("nan")

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["ratio"] = self.ratio
        return out


@dataclass
class Breakdown:
    """Where the memory of one traced step went (bytes). See the module docstring for kinds."""

    seq_len: int
    batch_size: int
    peak_bytes: int  # the tracker's peak: sum of everything below at the peak moment
    peak_phase: str
    peak_op: str  # the op whose allocation reached the peak
    start_bytes: int  # alive before the step (parameters, gradients, optimizer state, inputs)
    peak_by_part: dict[str, dict[str, int]]  # category → kind → bytes live at the peak
    peak_by_module: dict[str, int]  # innermost module path → bytes live at the peak
    activation_by_category: dict[str, int]  # activations (alive when backward starts) by category
    layer_activation_bytes: list[int]  # activations made inside each repeated block
    autocast_dtype: Optional[str]  # seen in a module's forward, or None
    attention_backend: Optional[str]
    checkpointed: bool
    tensors: list[AllocationRecord] = field(repr=False)  # every allocation, by index
    alive_at_peak: list[int] = field(repr=False)  # indices into tensors
    calibration: Optional[Calibration] = None

    @property
    def autocast(self) -> bool:
        return self.autocast_dtype is not None

    @property
    def peak_by_kind(self) -> dict[str, int]:
        out = {k: 0 for k in KINDS}
        for kinds in self.peak_by_part.values():
            for kind, n in kinds.items():
                out[kind] += n
        return {k: v for k, v in out.items() if v}

    @property
    def peak_by_category(self) -> dict[str, int]:
        return {c: sum(k.values()) for c, k in self.peak_by_part.items()}

    @property
    def activation_bytes(self) -> int:
        return sum(self.activation_by_category.values())

    @property
    def attention_activation_bytes(self) -> int:
        return sum(self.activation_by_category.get(c, 0) for c in ATTENTION_CATEGORIES)

    @property
    def attention_share(self) -> float:
        """Attention's share of activation memory (:data:`ATTENTION_CATEGORIES`)."""
        total = self.activation_bytes
        return self.attention_activation_bytes / total if total else 0.0

    def quadratic_tensors(self) -> list[dict[str, Any]]:
        """Tensors with two dimensions equal to L, grouped by op, shape, dtype, phase and saving."""
        alive = set(self.alive_at_peak)
        groups: dict[tuple, dict[str, Any]] = {}
        for r in self.tensors:
            if not r.quadratic:
                continue
            key = (r.op, r.shape, r.dtype, r.phase, r.saved_for_backward)
            g = groups.setdefault(key, {
                "op": r.op, "shape": list(r.shape), "dtype": r.dtype, "phase": r.phase,
                "saved_for_backward": r.saved_for_backward, "count": 0, "bytes": 0,
                "alive_at_peak": 0, "modules": [],
            })
            g["count"] += 1
            g["bytes"] += r.nbytes
            g["alive_at_peak"] += r.index in alive
            if r.module not in g["modules"] and len(g["modules"]) < 4:
                g["modules"].append(r.module)
        return sorted(groups.values(), key=lambda g: -g["bytes"])

    def top_tensors(self, n: int = 10) -> list[AllocationRecord]:
        """The ``n`` largest storages alive at the peak."""
        return sorted((self.tensors[i] for i in self.alive_at_peak), key=lambda r: -r.nbytes)[:n]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values for the report (no per-tensor list; quadratic tensors grouped)."""
        top_modules = sorted(self.peak_by_module.items(), key=lambda kv: -kv[1])[:20]
        return {
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "peak_bytes": self.peak_bytes,
            "peak_phase": self.peak_phase,
            "peak_op": self.peak_op,
            "start_bytes": self.start_bytes,
            "peak_by_kind": self.peak_by_kind,
            "peak_by_category": self.peak_by_category,
            "peak_by_part": {c: dict(k) for c, k in self.peak_by_part.items()},
            "peak_by_module": dict(top_modules),
            "activation_bytes": self.activation_bytes,
            "activation_by_category": dict(self.activation_by_category),
            "attention_activation_bytes": self.attention_activation_bytes,
            "attention_share": self.attention_share,
            "layer_activation_bytes": list(self.layer_activation_bytes),
            "quadratic_tensors": self.quadratic_tensors(),
            "top_tensors": [
                {"op": r.op, "shape": list(r.shape), "dtype": r.dtype, "module": r.module, "kind": r.kind,
                 "category": r.category, "bytes": r.nbytes, "saved_for_backward": r.saved_for_backward}
                for r in self.top_tensors()
            ],
            "autocast_dtype": self.autocast_dtype,
            "attention_backend": self.attention_backend,
            "checkpointed": self.checkpointed,
            "calibration": self.calibration.to_dict() if self.calibration else None,
        }


def _alive(sequence: np.ndarray, n: int, upto: int) -> np.ndarray:
    part = sequence[:upto]
    alive = np.zeros(n, dtype=bool)
    alive[part[part >= 0]] = True
    alive[~part[part < 0]] = False
    return alive


def trace_breakdown(
    step_fn: Callable[[], Any],
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    existing: Iterable[torch.Tensor] = (),
    *,
    seq_len: int,
    batch_size: int,
    device_type: Optional[str] = None,
) -> Breakdown:
    """Trace one training step and attribute its peak to modules and kinds.

    Args:
        step_fn: runs one training step (forward, backward, optimizer step) when called with no
            arguments. Run a warm-up step first (the first step has no optimizer state).
        model: the model the step trains; its parameters, their gradients and (with ``optimizer``)
            the optimizer state alive before the step are counted.
        optimizer: its state tensors are counted as ``optimizer_state``; an optimizer stepped inside
            ``step_fn`` is also recognised without it (global step hook).
        existing: other tensors alive before the step (the batch): kind ``inputs``.
        seq_len: the step's sequence length: tensors with two dimensions equal to it are quadratic.
        batch_size: the step's batch size (recorded; used by the calibration).
        device_type: the device whose memory is traced; default: the parameters' device.

    The forward ends at the first op run by the autograd engine; the optimizer phase starts at the
    first ``Optimizer.step``. Several micro-batches in one ``step_fn`` read as one forward (the first).
    """
    if not callable(step_fn):
        raise ValueError(f"`step_fn` must be callable with no arguments, got {step_fn!r}")
    check_int("seq_len", seq_len)
    check_int("batch_size", batch_size)
    params = list(dict.fromkeys(model.parameters()))
    if device_type is None:
        device_type = params[0].device.type if params else "cpu"
    infos = _module_infos(model)
    scope = _ModuleScope(infos, model, device_type)
    tracker = _BreakdownTracker(device_type, seq_len, scope)

    owner: dict[int, tuple[str, str]] = {}  # id(param) → (module path, category)
    for mod in model.modules():
        path, chain = infos[id(mod)]
        for p in mod.parameters(recurse=False):
            owner.setdefault(id(p), (path, module_category(chain)))
    for p in params:
        tracker.track_tensor(p, "parameters", *owner.get(id(p), ("", "other")))
    for p in params:
        if p.grad is not None:
            tracker.track_tensor(p.grad, "gradients", *owner.get(id(p), ("", "other")))
    optimizers: list[torch.optim.Optimizer] = [optimizer] if optimizer is not None else []

    def state_tensors(opt: torch.optim.Optimizer) -> Iterable[tuple[torch.Tensor, Any]]:
        for p, state in opt.state.items():
            for t in state.values():
                if isinstance(t, torch.Tensor):
                    yield t, p

    for opt in optimizers:
        for t, p in state_tensors(opt):
            tracker.track_tensor(t, "optimizer_state", *owner.get(id(p), ("", "other")))
    for t in existing:
        if isinstance(t, torch.Tensor):
            tracker.track_tensor(t, "inputs", "<global>", "other")
    num_existing = len(tracker.records)

    grad_of: dict[int, nn.Parameter] = {}  # allocation index → parameter whose .grad it is

    def on_grad(p: torch.Tensor) -> None:
        if p.grad is not None:
            for i in tracker.index_of(p.grad):
                grad_of[i] = p

    def on_optimizer_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if tracker.phase != "optimizer":
            tracker.mark_phase("optimizer")
        if all(o is not opt for o in optimizers):
            optimizers.append(opt)

    handles = [p.register_post_accumulate_grad_hook(on_grad) for p in params if p.requires_grad]
    try:
        scope.install()
        handles.append(register_optimizer_step_pre_hook(on_optimizer_step))
        with saved_tensors_hooks(tracker.pack, lambda t: t):
            with tracker:
                tracker.mark_phase("forward")
                step_fn()
    finally:
        for handle in handles:
            handle.remove()
        scope.remove()
        tracker.stop()

    records: list[AllocationRecord] = [r for r in tracker.records if r is not None]
    assert len(records) == len(tracker.events.sizes), "every allocation is described"
    sequence = np.asarray(tracker.events.sequence, dtype=np.int64)
    sizes = np.asarray(tracker.events.sizes, dtype=np.int64)
    n = len(records)
    fwd_end = tracker.events.phase_starts.get("backward", len(sequence))
    alive_fwd_end = _alive(sequence, n, fwd_end)
    state_of: dict[int, Any] = {}
    for opt in optimizers:
        for t, p in state_tensors(opt):
            for i in tracker.index_of(t):
                state_of[i] = p
    for r in records:
        r.saved_for_backward = r.index in tracker.saved
        if r.index < num_existing:
            continue
        if r.index in grad_of or r.index in state_of:
            p = grad_of.get(r.index, state_of.get(r.index))
            r.kind = "gradients" if r.index in grad_of else "optimizer_state"
            r.module, r.category = owner.get(id(p), (r.module, r.category))
        elif r.phase == "forward" and alive_fwd_end[r.index]:
            r.kind = "activations"
        else:
            r.kind = "temporaries"

    deltas = np.where(sequence >= 0, sizes[np.where(sequence >= 0, sequence, 0)], -sizes[np.where(sequence < 0, ~sequence, 0)])
    live = np.cumsum(deltas) if len(deltas) else np.zeros(1, dtype=np.int64)
    peak_pos = int(np.argmax(live))
    alive_peak = _alive(sequence, n, peak_pos + 1)
    peak_phase = "existing"
    for phase, start in sorted(tracker.events.phase_starts.items(), key=lambda kv: kv[1]):
        if start <= peak_pos:
            peak_phase = phase
    by_part: dict[str, dict[str, int]] = {}
    by_module: dict[str, int] = {}
    alive_at_peak = [int(i) for i in np.flatnonzero(alive_peak)]
    for i in alive_at_peak:
        r = records[i]
        by_part.setdefault(r.category, {}).setdefault(r.kind, 0)
        by_part[r.category][r.kind] += r.nbytes
        by_module[r.module] = by_module.get(r.module, 0) + r.nbytes
    activation_by_category: dict[str, int] = {}
    for r in records:
        if r.kind == "activations":
            activation_by_category[r.category] = activation_by_category.get(r.category, 0) + r.nbytes
    blocks = [b for b in find_repeated_blocks(model) if b is not model]
    block_paths = [infos[id(b)][0] for b in blocks if id(b) in infos]
    layer_bytes = [
        sum(r.nbytes for r in records if r.kind == "activations" and (r.module == bp or r.module.startswith(bp + ".")))
        for bp in block_paths
    ]
    peak_index = int(sequence[peak_pos]) if len(sequence) else 0
    breakdown = Breakdown(
        seq_len=seq_len,
        batch_size=batch_size,
        peak_bytes=int(tracker.peak_bytes),
        peak_phase=peak_phase,
        peak_op=records[peak_index].op if peak_index >= 0 and records else "",
        start_bytes=int(sum(r.nbytes for r in records[:num_existing])),
        peak_by_part={c: by_part[c] for c in CATEGORIES if c in by_part},
        peak_by_module=by_module,
        activation_by_category={c: activation_by_category[c] for c in CATEGORIES if c in activation_by_category},
        layer_activation_bytes=layer_bytes,
        autocast_dtype=str(scope.autocast_dtype).replace("torch.", "") if scope.autocast_dtype else None,
        attention_backend=current_attention_backend(model),
        checkpointed=is_checkpointed(model),
        tensors=records,
        alive_at_peak=alive_at_peak,
    )
    breakdown.calibration = calibrate(breakdown, model, block_paths=block_paths)
    return breakdown


# ---------------------------------------------------------------------------------------------
# Calibration against Korthikanti et al. 2022
# ---------------------------------------------------------------------------------------------
def _model_dims(model: nn.Module) -> Optional[tuple[int, int, int]]:
    """(hidden, heads, ffn_hidden) from a GPTConfig-like or Hugging Face config inside ``model``."""
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is None:
            continue
        for h_key, a_key, f_key in (("d_model", "n_head", "d_ff"), ("hidden_size", "num_attention_heads", "intermediate_size"),
                                    ("n_embd", "n_head", "n_inner")):
            h, a = getattr(cfg, h_key, None), getattr(cfg, a_key, None)
            if isinstance(h, int) and isinstance(a, int):
                f = getattr(cfg, f_key, None)
                return h, a, f if isinstance(f, int) else 4 * h
    return None


def _has_dropout(model: nn.Module) -> bool:
    for m in model.modules():
        if isinstance(m, nn.Dropout) and m.p > 0:
            return True
        p = getattr(m, "attention_dropout", None)
        if isinstance(p, float) and p > 0:
            return True
    return False


def calibrate(
    breakdown: Breakdown,
    model: nn.Module,
    *,
    block_paths: Optional[Sequence[str]] = None,
    hidden: Optional[int] = None,
    heads: Optional[int] = None,
    ffn_hidden: Optional[int] = None,
    bytes_per_element: Optional[int] = None,
    dropout: Optional[bool] = None,
) -> Optional[Calibration]:
    """Measured per-layer activations vs :func:`korthikanti_activation_bytes`, or ``None``.

    Shape fields not given are read from the model's config (``d_model``/``n_head``/``d_ff`` or
    Hugging Face ``hidden_size``/``num_attention_heads``/``intermediate_size``); ``None`` when there
    is no config or no repeated blocks. ``bytes_per_element``: the autocast dtype's size if autocast
    was on, else the parameters'; ``dropout``: any ``nn.Dropout`` with ``p > 0`` or a positive
    ``attention_dropout`` attribute; ``recompute``: the model is checkpointed.
    """
    dims = _model_dims(model)
    if block_paths is None:
        infos = _module_infos(model)
        block_paths = [infos[id(b)][0] for b in find_repeated_blocks(model) if b is not model]
    if not block_paths or (dims is None and (hidden is None or heads is None)):
        return None
    h = hidden or dims[0]  # type: ignore[index]
    a = heads or dims[1]  # type: ignore[index]
    f = ffn_hidden or (dims[2] if dims else 4 * h)
    if bytes_per_element is None:
        if breakdown.autocast_dtype is not None:
            bytes_per_element = getattr(torch, breakdown.autocast_dtype).itemsize
        else:
            first = next(model.parameters(), None)
            bytes_per_element = first.element_size() if first is not None else 4
    dropout = _has_dropout(model) if dropout is None else dropout
    recompute = breakdown.checkpointed
    s, b, e = breakdown.seq_len, breakdown.batch_size, bytes_per_element
    layers = [
        [r for r in breakdown.tensors if r.kind == "activations" and (r.module == bp or r.module.startswith(bp + "."))]
        for bp in block_paths
    ]
    measured = int(round(sum(sum(r.nbytes for r in rs) for rs in layers) / len(layers)))
    measured_q = int(round(sum(sum(r.nbytes for r in rs if r.quadratic) for rs in layers) / len(layers)))
    lin_t, quad_t = _korthikanti_parts(s, b, h, a, e, dropout, recompute, f)
    theory = int(round(lin_t + quad_t))
    paper = korthikanti_activation_bytes(s, b, h, a)
    sbh = s * b * h
    lines = [
        f"Theory: Korthikanti et al. 2022 per-layer activations, s={s}, b={b}, h={h}, a={a}, ffn={f}, "
        f"{e}-byte elements, dropout {'on' if dropout else 'off'}"
        + (", full recomputation (only the layer input kept: e·s·b·h)" if recompute else
           ": e·(8·s·b·h + 2·s·b·ffn) + e·a·s²·b" + (" + 2·s·b·h + a·s²·b (1-byte masks) + e·a·s²·b (dropout output)" if dropout else ""))
        + f" = {theory} B (the paper's 16-bit-with-dropout s·b·h·(34 + 5·a·s/h) would be {paper} B).",
        f"Measured: {measured} B per layer (mean over {len(layers)} blocks of the tensors made inside a block "
        f"and alive when backward starts), {measured / theory:.2f}x theory." if theory else f"Measured: {measured} B.",
    ]
    param_shapes = {tuple(p.shape) for p in model.parameters()}
    weight_copies = int(round(sum(
        r.nbytes for rs in layers for r in rs
        if r.op == "aten::_to_copy" and r.shape in param_shapes and s not in r.shape
    ) / len(layers)))
    if not recompute:
        lin_m = measured - measured_q
        lines.append(
            f"Linear part: measured {lin_m / sbh:.2f}·s·b·h B vs theory {lin_t / sbh:.2f}·s·b·h B "
            f"({lin_m - lin_t:+.0f} B). A block's output is counted in the block that made it (the paper counts "
            "it as the next layer's LayerNorm input): equal on average over layers. LayerNorm also keeps its mean "
            "and rstd (2·s·b fp32 per norm) and copies made for a matmul (contiguous q/k/v) appear here."
        )
        if any(name.split(".")[-1] in ("gate_proj", "w3", "gate_up_proj") for name, _ in model.named_modules()):
            lines.append(
                "The MLP is gated (SwiGLU-style): it keeps more ffn-wide tensors than the paper's GeLU MLP "
                "(2·s·b·ffn elements), so the linear part runs above theory."
            )
        if weight_copies:
            lines.append(
                f"Of the measured bytes, {weight_copies} B per layer are autocast's {breakdown.autocast_dtype} copies "
                "of the block's weights, kept for backward (constant in L; not activations in the paper's sense); "
                "under CPU autocast LayerNorm and the residual stream also stay float32."
            )
        quad_unit = a * s * s * b
        if measured_q == 0 and quad_t > 0:
            lines.append(
                "Quadratic part: none kept. The attention kernel (SDPA/flash) recomputes the scores in backward, "
                f"so the paper's a·s²·b terms ({quad_t:.0f} B here) do not apply."
            )
        else:
            kept: dict[tuple[str, str, bool], int] = {}
            for rs in layers:
                for r in rs:
                    if r.quadratic:
                        batchless = r.shape.count(s) == len(r.shape)  # e.g. a [L, L] causal mask
                        kept[(r.op, r.dtype, batchless)] = kept.get((r.op, r.dtype, batchless), 0) + r.nbytes
            what = ", ".join(
                f"{op} {dtype}{' (batch-independent mask)' if bl else ''} {n / len(layers) / quad_unit:.2f}·a·s²·b B"
                for (op, dtype, bl), n in sorted(kept.items(), key=lambda kv: -kv[1])
            )
            lines.append(
                f"Quadratic part: measured {measured_q / quad_unit:.2f}·a·s²·b B vs theory {quad_t / quad_unit:.2f}·a·s²·b B "
                f"({measured_q - quad_t:+.0f} B); kept L×L tensors per layer: {what}."
            )
    else:
        lines.append(
            f"Measured {measured / sbh:.2f}·s·b·h B per layer vs e·s·b·h = {e}·s·b·h: the checkpointed block keeps "
            "its output (the next block's input); anything more means the checkpoint does not cover the block."
        )
    return Calibration(
        seq_len=s, batch_size=b, hidden=h, heads=a, ffn_hidden=f, num_layers=len(layers), bytes_per_element=e,
        dropout=dropout, recompute=recompute, measured_bytes=measured, measured_quadratic_bytes=measured_q,
        theory_bytes=theory, theory_quadratic_bytes=int(round(quad_t)), paper_16bit_bytes=paper,
        explanation=" ".join(lines),
    )


# ---------------------------------------------------------------------------------------------
# Comparison across lengths
# ---------------------------------------------------------------------------------------------
@dataclass
class PartGrowth:
    """One part's bytes at each traced length, its growth class and polynomial."""

    category: str
    kind: str
    bytes: list[int]
    growth: str
    coefficients: tuple[float, float, float]

    def to_dict(self) -> dict[str, Any]:
        return {"category": self.category, "kind": self.kind, "bytes": list(self.bytes),
                "growth": self.growth, "coefficients": list(self.coefficients)}


@dataclass
class BreakdownTable:
    """Breakdowns at several lengths side by side (one batch size)."""

    seq_lens: list[int]
    batch_size: int
    peak_bytes: list[int]
    peak_parts: list[PartGrowth]  # (category, kind) live at the peak
    peak_kinds: list[PartGrowth]  # kind totals at the peak (category "all")
    activation_parts: list[PartGrowth]  # activations by category (kind "activations")
    attention_share: list[float]  # of activation memory, at each length
    attention_coefficients: tuple[float, float, float]  # sum of the attention categories' fits
    rest_coefficients: tuple[float, float, float]
    crossover_seq_len: Optional[float]  # beyond it attention activations exceed the rest; None: never

    def attention_share_at(self, seq_len: float) -> float:
        """Attention share of activations at any length, from the per-part polynomials."""
        a = sum(c * seq_len**p for p, c in enumerate(self.attention_coefficients))
        r = sum(c * seq_len**p for p, c in enumerate(self.rest_coefficients))
        return a / (a + r) if a + r > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq_lens": list(self.seq_lens),
            "batch_size": self.batch_size,
            "peak_bytes": list(self.peak_bytes),
            "peak_parts": [p.to_dict() for p in self.peak_parts],
            "peak_kinds": [p.to_dict() for p in self.peak_kinds],
            "activation_parts": [p.to_dict() for p in self.activation_parts],
            "attention_share": list(self.attention_share),
            "attention_coefficients": list(self.attention_coefficients),
            "rest_coefficients": list(self.rest_coefficients),
            "crossover_seq_len": self.crossover_seq_len,
        }

    def to_markdown(self) -> str:
        """Three tables (peak by part, activations by category, attention share) and the crossover."""
        lens = [f"L={L}" for L in self.seq_lens]

        def table(title: str, first: list[str], rows: list[list[str]]) -> list[str]:
            headers = first + lens + ["growth"]
            out = [f"**{title}**", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            out += ["| " + " | ".join(r) + " |" for r in rows]
            return out + [""]

        md: list[str] = []
        rows = [[p.kind, *(format_bytes(b) for b in p.bytes), p.growth] for p in self.peak_kinds]
        rows.append(["**peak**", *(f"**{format_bytes(b)}**" for b in self.peak_bytes), ""])
        md += table(f"Peak memory by kind (batch {self.batch_size})", ["kind"], rows)
        rows = [[p.category, p.kind, *(format_bytes(b) for b in p.bytes), p.growth] for p in self.peak_parts]
        md += table("Peak memory by module and kind", ["module", "kind"], rows)
        rows = [[p.category, *(format_bytes(b) for b in p.bytes), p.growth] for p in self.activation_parts]
        rows.append(["attention share", *(f"{s:.1%}" for s in self.attention_share), ""])
        md += table("Activations (alive when backward starts) by module", ["module"], rows)
        if self.crossover_seq_len is None:
            md.append("Attention activations never exceed the rest at any length (no quadratic attention term).")
        else:
            md.append(
                f"Attention activations exceed the rest beyond L ≈ {math.ceil(self.crossover_seq_len)} "
                f"(extrapolated from per-part polynomials; share at 4x the longest traced length: "
                f"{self.attention_share_at(4 * self.seq_lens[-1]):.1%})."
            )
        return "\n".join(md) + "\n"


def compare_breakdowns(breakdowns: Sequence[Breakdown]) -> BreakdownTable:
    """Classify every part as constant/linear/quadratic across lengths and find the crossover.

    Needs breakdowns at two or more distinct lengths and one batch size. Attention and the rest are
    extrapolated by summing each activation category's own polynomial (:func:`fit_growth`), which is
    exact for pure linear and pure quadratic parts even from two lengths.
    """
    if len({b.batch_size for b in breakdowns}) > 1:
        raise ValueError(
            f"`breakdowns` must share one batch size, got {sorted({b.batch_size for b in breakdowns})}"
        )
    by_len: dict[int, Breakdown] = {}
    for b in breakdowns:
        by_len.setdefault(b.seq_len, b)
    if len(by_len) < 2:
        raise ValueError(f"`breakdowns` must cover two or more sequence lengths, got {sorted(by_len)}")
    items = [by_len[L] for L in sorted(by_len)]
    lens = [b.seq_len for b in items]

    def part(category: str, kind: str, values: list[int]) -> PartGrowth:
        return PartGrowth(category, kind, values, classify_growth(lens, values), fit_growth(lens, values))

    keys = []
    for b in items:
        for c, kinds in b.peak_by_part.items():
            for k in kinds:
                if (c, k) not in keys:
                    keys.append((c, k))
    keys.sort(key=lambda ck: (CATEGORIES.index(ck[0]) if ck[0] in CATEGORIES else 99, KINDS.index(ck[1])))
    peak_parts = [part(c, k, [b.peak_by_part.get(c, {}).get(k, 0) for b in items]) for c, k in keys]
    peak_kinds = [part("all", k, [b.peak_by_kind.get(k, 0) for b in items]) for k in KINDS
                  if any(b.peak_by_kind.get(k, 0) for b in items)]
    categories = [c for c in CATEGORIES if any(b.activation_by_category.get(c, 0) for b in items)]
    activation_parts = [part(c, "activations", [b.activation_by_category.get(c, 0) for b in items]) for c in categories]
    attn = np.zeros(3)
    rest = np.zeros(3)
    for p in activation_parts:
        if p.category in ATTENTION_CATEGORIES:
            attn += p.coefficients
        else:
            rest += p.coefficients
    return BreakdownTable(
        seq_lens=lens,
        batch_size=items[0].batch_size,
        peak_bytes=[b.peak_bytes for b in items],
        peak_parts=peak_parts,
        peak_kinds=peak_kinds,
        activation_parts=activation_parts,
        attention_share=[b.attention_share for b in items],
        attention_coefficients=tuple(float(x) for x in attn),
        rest_coefficients=tuple(float(x) for x in rest),
        crossover_seq_len=crossover_length(attn, rest),
    )


# ---------------------------------------------------------------------------------------------
# Diagnoses
# ---------------------------------------------------------------------------------------------
def _example(records: list[AllocationRecord]) -> str:
    r = max(records, key=lambda x: x.nbytes)
    return f"{r.op} -> {list(r.shape)} {r.dtype} in `{r.module}`"


def diagnose(breakdown: Breakdown, model: nn.Module, autocast: Optional[bool] = None) -> list[str]:
    """The article's FAQ applied to a traced step; each finding is returned and warned once.

    Findings (each at most once per call, as a :class:`MemoryDiagnosisWarning`):

    * attention scores in fp32 under mixed precision (``autocast`` and a float32 L×L tensor);
    * a hand-written ``bmm``/``matmul`` materialising the L×L matrix (where SDPA would not);
    * activation checkpointing configured but L×L tensors still saved for backward in the forward.

    Args:
        autocast: whether the step ran under autocast; ``None`` uses what the trace saw.
    """
    autocast = breakdown.autocast if autocast is None else autocast
    quads = [r for r in breakdown.tensors if r.quadratic]
    found: list[str] = []
    fp32 = [r for r in quads if r.dtype == "float32"]
    if autocast and fp32:
        found.append(
            f"Attention scores in float32 under mixed precision: {len(fp32)} L×L float32 tensors "
            f"({format_bytes(sum(r.nbytes for r in fp32))} in total), e.g. {_example(fp32)}. Memory of the score "
            "matrix doubles versus 16-bit. Fix: keep scores in the autocast dtype (softmax with dtype=float32 "
            "returns fp32: cast back at once, or don't upcast), or better use scaled_dot_product_attention "
            "(AttentionSwitch('sdpa')), which never materialises them."
        )
    mm = [r for r in quads if r.op.split(".")[0] in _MATMUL_OPS]
    if mm:
        found.append(
            f"A hand-written matmul materialises the full L×L score matrix: {len(mm)} tensors from "
            f"{sorted({r.op for r in mm})} ({format_bytes(sum(r.nbytes for r in mm))}), e.g. {_example(mm)}. "
            "scaled_dot_product_attention (or flash-attn) computes the same result blockwise without it. "
            "Fix: replace `q @ k.transpose(-2, -1)`/softmax/`@ v` with F.scaled_dot_product_attention "
            "(AttentionSwitch('sdpa') for models that support it)."
        )
    saved = [r for r in quads if r.saved_for_backward and r.phase == "forward"]
    if saved and is_checkpointed(model):
        modules = sorted({r.module for r in saved})
        found.append(
            f"Activation checkpointing is configured but not taking effect: {len(saved)} L×L tensors "
            f"({format_bytes(sum(r.nbytes for r in saved))}) are still saved for backward in the forward, from "
            f"{len(modules)} module(s) such as {modules[:3]}. Fix: make sure the blocks that contain attention are "
            "the ones wrapped (ActivationCheckpointing(block_class_names=[...])), that a Hugging Face model is in "
            "train() mode, and that the forward calls the wrapped modules."
        )
    for message in found:
        warnings.warn(message, MemoryDiagnosisWarning, stacklevel=2)
    return found


# ---------------------------------------------------------------------------------------------
# Attention ablation
# ---------------------------------------------------------------------------------------------
def find_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Outermost attention modules: those of a class named ``...Attention`` (the reference GPT's
    ``CausalSelfAttention``, Hugging Face ``LlamaAttention``, ``GPT2Attention``, ...).

    Example:
        >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
        >>> [n for n, _ in find_attention_modules(GPT(GPTConfig(n_layer=2, d_model=32, n_head=2)))]
        ['blocks.0.attn', 'blocks.1.attn']
    """
    infos = _module_infos(model)
    found: list[tuple[str, nn.Module]] = []

    def visit(module: nn.Module) -> None:
        if type(module).__name__.endswith("Attention"):
            found.append((infos[id(module)][0], module))
            return
        for child in module.children():
            visit(child)

    visit(model)
    return found


def _identity_forward(module: nn.Module) -> Callable[..., Any]:
    if type(module).__module__.startswith("transformers"):
        return lambda hidden_states, *args, **kwargs: (hidden_states, None)  # (attn_output, attn_weights)
    return lambda x, *args, **kwargs: x


@dataclass
class AttentionAblation:
    """One step traced with attention, one with every attention module replaced by identity."""

    with_attention: Breakdown
    without_attention: Breakdown
    replaced: list[str]  # module paths

    @property
    def attention_peak_bytes(self) -> int:
        """How much of the peak attention accounts for (peak with minus peak without)."""
        return self.with_attention.peak_bytes - self.without_attention.peak_bytes

    @property
    def attention_peak_share(self) -> float:
        peak = self.with_attention.peak_bytes
        return self.attention_peak_bytes / peak if peak else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq_len": self.with_attention.seq_len,
            "batch_size": self.with_attention.batch_size,
            "peak_bytes_with_attention": self.with_attention.peak_bytes,
            "peak_bytes_without_attention": self.without_attention.peak_bytes,
            "attention_peak_bytes": self.attention_peak_bytes,
            "attention_peak_share": self.attention_peak_share,
            "replaced": list(self.replaced),
        }


def attention_ablation(
    step_fn: Callable[[], Any],
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    existing: Iterable[torch.Tensor] = (),
    *,
    seq_len: int,
    batch_size: int,
    attention_modules: Optional[Sequence[nn.Module]] = None,
    baseline: Optional[Breakdown] = None,
) -> AttentionAblation:
    """Trace a step with attention (unless ``baseline`` is given), then one with attention as identity.

    Each attention module's ``forward`` is replaced on the instance for that one step (Hugging Face
    attention returns ``(hidden_states, None)``) and restored in ``finally``. The ablated step is a
    real training step: the optimizer updates the other parameters, and the attention parameters get
    no gradient in it. The difference in peaks is what attention costs, its parameters' gradients
    and optimizer scratch included.
    """
    existing = list(existing)
    if attention_modules is None:
        named = find_attention_modules(model)
    else:
        infos = _module_infos(model)
        named = [(infos.get(id(m), (type(m).__name__, ()))[0], m) for m in attention_modules]
    if not named:
        raise ValueError("`model` has no attention module to ablate; pass `attention_modules`")
    if baseline is None:
        baseline = trace_breakdown(step_fn, model, optimizer, existing, seq_len=seq_len, batch_size=batch_size)
    saved: list[tuple[nn.Module, Any]] = []
    try:
        for _, module in named:
            saved.append((module, module.__dict__.get("forward", _MISSING)))
            module.forward = _identity_forward(module)
        ablated = trace_breakdown(step_fn, model, optimizer, existing, seq_len=seq_len, batch_size=batch_size)
    finally:
        for module, previous in saved:
            if previous is _MISSING:
                del module.forward
            else:
                module.forward = previous
    return AttentionAblation(baseline, ablated, [name for name, _ in named])


_MISSING = object()
