"""Theory beside measurement: activation bytes per layer after Korthikanti et al. 2022.

:func:`korthikanti_activation_bytes` is the paper's per-layer count (eq. 1 and §5) with exact
adjustments for the element size, dropout, the FFN width and full recomputation (pure maths).
:func:`calibrate` sets the activations a traced step (:class:`~.tracer.Breakdown`) kept inside
each repeated block beside that count, and explains the difference in words (:class:`Calibration`).
:func:`model_dims` reads ``(hidden, heads, ffn_hidden)`` from a model's config.

Example:
    >>> korthikanti_activation_bytes(1024, 1, 1024, 16) == 1024 * 1024 * (34 + 5 * 16)
    True
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from torch import nn

from lightning_seqmem.diagnostics.categories import block_paths_of, is_inside

if TYPE_CHECKING:
    from lightning_seqmem.diagnostics.tracer import AllocationRecord, Breakdown

__all__ = ["Calibration", "calibrate", "korthikanti_activation_bytes", "layer_activations",
           "model_dims"]


def _korthikanti_parts(seq_len: int, batch_size: int, hidden: int, heads: int,
                       bytes_per_element: float, dropout: bool, recompute: bool,
                       ffn_hidden: Optional[int]) -> tuple[float, float]:
    """(linear, quadratic) activation bytes per layer (see :func:`korthikanti_activation_bytes`)."""
    s, b, h, a, e = seq_len, batch_size, hidden, heads, bytes_per_element
    f = 4 * h if ffn_hidden is None else ffn_hidden
    if recompute:
        return e * s * b * h, 0.0
    # elements kept (Korthikanti et al. 2022, §4.1): LN1 in, QKV in, Q, K, V, out-proj in, LN2 in,
    # MLP in (8·s·b·h) + GeLU in and out (2·s·b·f); softmax output a·s²·b
    linear = e * (8 * s * b * h + 2 * s * b * f)
    quadratic = e * a * s * s * b
    if dropout:  # 1-byte masks: attention-output and MLP dropout (2·s·b·h), softmax's (a·s²·b);
        linear += 2 * s * b * h  # plus the softmax-dropout output kept for the matmul with V
        quadratic += a * s * s * b + e * a * s * s * b
    return float(linear), float(quadratic)


def korthikanti_activation_bytes(seq_len: int, batch_size: int, hidden: int, heads: int,
                                 bytes_per_element: float = 2, dropout: bool = True,
                                 recompute: bool = False, ffn_hidden: Optional[int] = None) -> int:
    """Activation bytes one GPT layer keeps for backward (Korthikanti et al. 2022, eq. 1 and §5).

    With 16-bit activations and dropout this is the paper's ``s·b·h·(34 + 5·a·s/h)``. Adjustments,
    exactly: every non-mask term is scaled by ``bytes_per_element / 2`` (×2 for fp32); without
    dropout the three dropout terms go (1-byte masks after attention output and MLP, ``2·s·b·h``,
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
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("hidden", hidden),
                        ("heads", heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    if not bytes_per_element > 0:
        raise ValueError(f"`bytes_per_element` must be positive, got {bytes_per_element!r}")
    linear, quadratic = _korthikanti_parts(seq_len, batch_size, hidden, heads, bytes_per_element,
                                           dropout, recompute, ffn_hidden)
    return int(round(linear + quadratic))


@dataclass
class Calibration:
    """Measured activation bytes per layer beside Korthikanti et al. 2022 (bytes, per layer)."""

    seq_len: int
    batch_size: int
    hidden: int
    heads: int
    ffn_hidden: int
    num_layers: int
    bytes_per_element: int  # of the theory's non-mask terms: the autocast dtype, else the params'
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


def model_dims(model: nn.Module) -> Optional[tuple[int, int, int]]:
    """``(hidden, heads, ffn_hidden)`` from a GPTConfig-like or Hugging Face config inside
    ``model``, or ``None``.

    Example:
        >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
        >>> model_dims(GPT(GPTConfig(n_layer=1, d_model=32, n_head=2)))
        (32, 2, 128)
    """
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is None:
            continue
        for h_key, a_key, f_key in (("d_model", "n_head", "d_ff"),
                                    ("hidden_size", "num_attention_heads", "intermediate_size"),
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


def _element_bytes(breakdown: Breakdown, model: nn.Module) -> int:
    """The autocast dtype's size if the step ran under autocast, else the parameters'."""
    if breakdown.autocast_dtype is not None:
        return getattr(torch, breakdown.autocast_dtype).itemsize
    first = next(model.parameters(), None)
    return first.element_size() if first is not None else 4


def layer_activations(breakdown: Breakdown,
                      block_paths: Sequence[str]) -> list[list[AllocationRecord]]:
    """For each block path, the activations made inside that block (its own path or below)."""
    return [[r for r in breakdown.tensors if r.kind == "activations" and is_inside(r.module, bp)]
            for bp in block_paths]


def calibrate(breakdown: Breakdown, model: nn.Module, *,
              block_paths: Optional[Sequence[str]] = None, hidden: Optional[int] = None,
              heads: Optional[int] = None, ffn_hidden: Optional[int] = None,
              bytes_per_element: Optional[int] = None,
              dropout: Optional[bool] = None) -> Optional[Calibration]:
    """Measured per-layer activations vs :func:`korthikanti_activation_bytes`, or ``None`` (no
    config, no repeated blocks). Shape fields not given are read by :func:`model_dims`;
    ``bytes_per_element``: the autocast dtype's size if autocast was on, else the parameters';
    ``dropout``: any ``nn.Dropout`` with ``p > 0`` or a positive ``attention_dropout`` attribute;
    ``recompute``: the model is checkpointed."""
    dims = model_dims(model)
    if block_paths is None:
        block_paths = block_paths_of(model)
    if not block_paths or (dims is None and (hidden is None or heads is None)):
        return None
    h = hidden or dims[0]  # type: ignore[index]
    a = heads or dims[1]  # type: ignore[index]
    f = ffn_hidden or (dims[2] if dims else 4 * h)
    e = _element_bytes(breakdown, model) if bytes_per_element is None else bytes_per_element
    dropout = _has_dropout(model) if dropout is None else dropout
    recompute = breakdown.checkpointed
    s, b = breakdown.seq_len, breakdown.batch_size
    layers = layer_activations(breakdown, block_paths)
    measured = int(round(sum(sum(r.nbytes for r in rs) for rs in layers) / len(layers)))
    measured_q = int(round(sum(sum(r.nbytes for r in rs if r.quadratic) for rs in layers)
                           / len(layers)))
    lin_t, quad_t = _korthikanti_parts(s, b, h, a, e, dropout, recompute, f)
    calibration = Calibration(
        seq_len=s, batch_size=b, hidden=h, heads=a, ffn_hidden=f, num_layers=len(layers),
        bytes_per_element=e, dropout=dropout, recompute=recompute, measured_bytes=measured,
        measured_quadratic_bytes=measured_q, theory_bytes=int(round(lin_t + quad_t)),
        theory_quadratic_bytes=int(round(quad_t)),
        paper_16bit_bytes=korthikanti_activation_bytes(s, b, h, a), explanation="")
    return replace(calibration, explanation=" ".join(
        _explain(calibration, layers, model, breakdown.autocast_dtype)))


# ---------------------------------------------------------------------------------------------
# The explanation, in words
# ---------------------------------------------------------------------------------------------
def _explain(c: Calibration, layers: list[list[AllocationRecord]], model: nn.Module,
             autocast_dtype: Optional[str]) -> list[str]:
    """The calibration's sentences: theory, measurement, then the linear and quadratic parts."""
    s, b, h, a, f, e = (c.seq_len, c.batch_size, c.hidden, c.heads, c.ffn_hidden,
                        c.bytes_per_element)
    dropout, theory, measured = c.dropout, c.theory_bytes, c.measured_bytes
    lines = [
        f"Theory: Korthikanti et al. 2022 per-layer activations, s={s}, b={b}, h={h}, a={a}, "
        f"ffn={f}, {e}-byte elements, dropout {'on' if dropout else 'off'}"
        + (", full recomputation (only the layer input kept: e·s·b·h)" if c.recompute else
           ": e·(8·s·b·h + 2·s·b·ffn) + e·a·s²·b"
           + (" + 2·s·b·h + a·s²·b (1-byte masks) + e·a·s²·b (dropout output)"
              if dropout else ""))
        + f" = {theory} B (the paper's 16-bit-with-dropout s·b·h·(34 + 5·a·s/h) would be "
          f"{c.paper_16bit_bytes} B).",
        f"Measured: {measured} B per layer (mean over {len(layers)} blocks of the tensors made "
        f"inside a block and alive when backward starts), {measured / theory:.2f}x theory."
        if theory else f"Measured: {measured} B.",
    ]
    if c.recompute:
        return lines + [
            f"Measured {measured / (s * b * h):.2f}·s·b·h B per layer vs e·s·b·h = {e}·s·b·h: the "
            "checkpointed block keeps its output (the next block's input); anything more means the "
            "checkpoint does not cover the block."
        ]
    return lines + _linear_lines(c, layers, model, autocast_dtype) + [_quadratic_line(c, layers)]


def _linear_lines(c: Calibration, layers: list[list[AllocationRecord]], model: nn.Module,
                  autocast_dtype: Optional[str]) -> list[str]:
    sbh = c.seq_len * c.batch_size * c.hidden
    lin_m, lin_t = (c.measured_bytes - c.measured_quadratic_bytes,
                    c.theory_bytes - c.theory_quadratic_bytes)
    lines = [
        f"Linear part: measured {lin_m / sbh:.2f}·s·b·h B vs theory {lin_t / sbh:.2f}·s·b·h B "
        f"({lin_m - lin_t:+.0f} B). A block's output is counted in the block that made it (the "
        "paper counts it as the next layer's LayerNorm input): equal on average over layers. "
        "LayerNorm also keeps its mean and rstd (2·s·b fp32 per norm) and copies made for a matmul "
        "(contiguous q/k/v) appear here."
    ]
    if any(name.split(".")[-1] in ("gate_proj", "w3", "gate_up_proj")
           for name, _ in model.named_modules()):
        lines.append(
            "The MLP is gated (SwiGLU-style): it keeps more ffn-wide tensors than the paper's GeLU "
            "MLP (2·s·b·ffn elements), so the linear part runs above theory."
        )
    param_shapes = {tuple(p.shape) for p in model.parameters()}
    weight_copies = int(round(sum(
        r.nbytes for rs in layers for r in rs
        if r.op == "aten::_to_copy" and r.shape in param_shapes and c.seq_len not in r.shape
    ) / len(layers)))
    if weight_copies:
        lines.append(
            f"Of the measured bytes, {weight_copies} B per layer are autocast's {autocast_dtype} "
            "copies of the block's weights, kept for backward (constant in L; not activations in "
            "the paper's sense); under CPU autocast LayerNorm and the residual stream also stay "
            "float32."
        )
    return lines


def _quadratic_line(c: Calibration, layers: list[list[AllocationRecord]]) -> str:
    s, measured_q, quad_t = c.seq_len, c.measured_quadratic_bytes, c.theory_quadratic_bytes
    quad_unit = c.heads * s * s * c.batch_size
    if measured_q == 0 and quad_t > 0:
        return (
            "Quadratic part: none kept. The attention kernel (SDPA/flash) recomputes the scores in "
            f"backward, so the paper's a·s²·b terms ({quad_t:.0f} B here) do not apply."
        )
    kept: dict[tuple[str, str, bool], int] = {}
    for rs in layers:
        for r in rs:
            if r.quadratic:
                batchless = r.shape.count(s) == len(r.shape)  # e.g. a [L, L] causal mask
                kept[(r.op, r.dtype, batchless)] = (kept.get((r.op, r.dtype, batchless), 0)
                                                    + r.nbytes)
    what = ", ".join(
        f"{op} {dtype}{' (batch-independent mask)' if bl else ''} "
        f"{n / len(layers) / quad_unit:.2f}·a·s²·b B"
        for (op, dtype, bl), n in sorted(kept.items(), key=lambda kv: -kv[1])
    )
    return (
        f"Quadratic part: measured {measured_q / quad_unit:.2f}·a·s²·b B vs theory "
        f"{quad_t / quad_unit:.2f}·a·s²·b B ({measured_q - quad_t:+.0f} B); kept L×L tensors per "
        f"layer: {what}."
    )
