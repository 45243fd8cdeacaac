"""A small reference GPT whose attention kernel can be switched at run time.

The three kernels compute the same function with the same parameters and differ only in memory:
``"eager"`` materialises the ``[batch, heads, L, L]`` score matrix (the quadratic term of the
memory model), ``"sdpa"`` calls :func:`torch.nn.functional.scaled_dot_product_attention` (a fused
kernel with no L² buffer on CPU and CUDA, unless dropout or the MATH backend is used), ``"flash"``
calls ``flash_attn`` (CUDA, fp16/bf16, optional extra). The mitigation code switches any module
with a ``set_attention_backend(backend: str)`` method, as :class:`CausalSelfAttention` and
:class:`GPT` have. Torch only (no Lightning).

Example:
    >>> import torch
    >>> model = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2))
    >>> ids = torch.randint(0, 256, (2, 10))
    >>> eager = model(ids)
    >>> model.set_attention_backend("sdpa")
    >>> torch.allclose(eager, model(ids), atol=1e-5)
    True
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from typing import Any, Optional
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["ATTENTION_BACKENDS", "Block", "CausalSelfAttention", "GPT", "GPTConfig",
           "flash_attn_available", "flash_attn_unavailable_reason", "sinusoidal_positions"]

ATTENTION_BACKENDS = ("eager", "sdpa", "flash")
"""Names accepted by ``set_attention_backend`` and by ``GPTConfig.attention``."""

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_attn_unavailable_reason() -> str | None:
    """Why the ``"flash"`` backend cannot run here, or ``None`` if it can.

    Example:
        >>> reason = flash_attn_unavailable_reason()
        >>> reason is None or isinstance(reason, str)
        True
    """
    reasons = []
    if importlib.util.find_spec("flash_attn") is None:
        reasons.append("the `flash_attn` package is not installed")
    if not torch.cuda.is_available():
        reasons.append("CUDA is not available (flash-attn runs on NVIDIA GPUs only)")
    return "; ".join(reasons) if reasons else None


def flash_attn_available() -> bool:
    """Whether ``flash_attn`` is importable and a CUDA device is present.

    Example:
        >>> flash_attn_available() == (flash_attn_unavailable_reason() is None)
        True
    """
    return flash_attn_unavailable_reason() is None


def _check_backend(backend: str) -> None:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"`backend` must be one of {ATTENTION_BACKENDS}, got {backend!r}.")


@dataclass
class GPTConfig:
    """Shape and regularisation of :class:`GPT`.

    Example:
        >>> GPTConfig(d_model=64, n_head=4).d_ff
        256
        >>> GPTConfig(d_model=30, n_head=4)
        Traceback (most recent call last):
        ...
        ValueError: `d_model` must be divisible by `n_head`, got d_model=30, n_head=4.
    """

    vocab_size: int = 256  # number of token ids (embedding rows, logits per position)
    n_layer: int = 2  # number of transformer blocks
    n_head: int = 4  # attention heads per block; head_dim = d_model // n_head
    d_model: int = 128  # residual stream width (features per token)
    d_ff: int | None = None  # MLP hidden width (features per token); None means 4 * d_model
    dropout: float = 0.0  # probability of zeroing an activation (embeddings, attn out, MLP out)
    attention_dropout: float = 0.0  # probability of zeroing an attention weight
    attention: str = "eager"  # attention kernel, one of ATTENTION_BACKENDS
    bias: bool = True  # whether Linear and LayerNorm layers have a bias (lm_head never does)

    def __post_init__(self) -> None:
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        if self.d_model % self.n_head:
            raise ValueError(f"`d_model` must be divisible by `n_head`, got "
                             f"d_model={self.d_model}, n_head={self.n_head}.")
        for name in ("dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"`{name}` must be in [0, 1), got {value!r}.")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(
                f"`attention` must be one of {ATTENTION_BACKENDS}, got {self.attention!r}.")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a switchable kernel.

    Args:
        config: model shape; ``config.attention`` is the initial backend.

    Example:
        >>> import torch
        >>> attn = CausalSelfAttention(GPTConfig(d_model=32, n_head=2))
        >>> x = torch.randn(2, 7, 32)
        >>> attn(x).shape
        torch.Size([2, 7, 32])
        >>> attn.set_attention_backend("sdpa")
        >>> attn.attention_backend
        'sdpa'
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.d_model // config.n_head
        self.attention_dropout = config.attention_dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.attention_backend = "eager"
        self.sdpa_backends: list[SDPBackend] | None = None
        self.set_attention_backend(config.attention)

    def set_attention_backend(self, backend: str,
                              sdpa_backends: SDPBackend | Sequence[SDPBackend] | None = None,
                              ) -> None:
        """Switch the kernel (one of :data:`ATTENTION_BACKENDS`); parameters are untouched.
        ``sdpa_backends``: only with ``"sdpa"``, the ``SDPBackend`` values the call is restricted to
        (:func:`torch.nn.attention.sdpa_kernel`; ``None``: PyTorch chooses). Raises ValueError for
        an unknown backend or ``sdpa_backends`` with another, RuntimeError for ``"flash"`` where
        flash-attn cannot run."""
        _check_backend(backend)
        if sdpa_backends is not None:
            if backend != "sdpa":
                raise ValueError(
                    f"`sdpa_backends` applies only to backend='sdpa', got backend={backend!r} "
                    f"with sdpa_backends={sdpa_backends!r}."
                )
            if isinstance(sdpa_backends, SDPBackend):
                sdpa_backends = [sdpa_backends]
            sdpa_backends = list(sdpa_backends)
            if not sdpa_backends or not all(isinstance(b, SDPBackend) for b in sdpa_backends):
                raise ValueError(
                    f"`sdpa_backends` must be a non-empty list of torch.nn.attention.SDPBackend, "
                    f"got {sdpa_backends!r}."
                )
        if backend == "flash":
            reason = flash_attn_unavailable_reason()
            if reason is not None:
                raise RuntimeError(
                    f"Attention backend 'flash' is unavailable: {reason}. Install the `flash` "
                    "extra (`pip install lightning-seqmem[flash]`) on Linux x86-64 with a CUDA "
                    "GPU, or use backend 'sdpa', which also avoids the L x L score matrix."
                )
        self.attention_backend = backend
        self.sdpa_backends = sdpa_backends

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[B, L, d_model]`` → ``[B, L, d_model]``."""
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.n_head, self.head_dim).unbind(dim=2)
        dropout_p = self.attention_dropout if self.training else 0.0
        if self.attention_backend == "flash":
            y = self._flash(q, k, v, dropout_p)  # [B, L, H, D] in and out
        else:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, L, D]
            if self.attention_backend == "sdpa":
                y = self._sdpa(q, k, v, dropout_p)
            else:
                y = self._eager(q, k, v, dropout_p)
            y = y.transpose(1, 2)
        return self.proj(y.reshape(batch, length, width))

    def _eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               dropout_p: float) -> torch.Tensor:
        length = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # [B, H, L, L]
        future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))
        weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        weights = F.dropout(weights, p=dropout_p, training=dropout_p > 0)
        return weights @ v

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              dropout_p: float) -> torch.Tensor:
        if self.sdpa_backends is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        with sdpa_kernel(self.sdpa_backends):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)

    def _flash(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               dropout_p: float) -> torch.Tensor:
        if q.device.type != "cuda" or q.dtype not in _FLASH_DTYPES:
            raise RuntimeError(
                f"Attention backend 'flash' needs CUDA tensors in float16 or bfloat16, got "
                f"{q.dtype} on {q.device}. Train with mixed precision (e.g. "
                "Trainer(precision='bf16-mixed') or torch.autocast('cuda', dtype=torch.bfloat16)), "
                "or use backend 'sdpa'."
            )
        from flash_attn import flash_attn_func  # lazy: optional extra, CUDA only

        return flash_attn_func(q, k, v, dropout_p=dropout_p, causal=True)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``.

    Example:
        >>> import torch
        >>> Block(GPTConfig(d_model=32, n_head=2))(torch.randn(1, 5, 32)).shape
        torch.Size([1, 5, 32])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.ln2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, config.d_ff, bias=config.bias),
            nn.GELU(),
            nn.Linear(config.d_ff, config.d_model, bias=config.bias),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.resid_dropout(self.attn(self.ln1(x)))
        return x + self.mlp(self.ln2(x))


def sinusoidal_positions(length: int, width: int,
                         device: torch.device | None = None) -> torch.Tensor:
    """Fixed sin/cos position encodings ``[length, width]`` in float32 (Vaswani et al. 2017, §3.5).

    Example:
        >>> sinusoidal_positions(3, 4)[0].tolist()
        [0.0, 1.0, 0.0, 1.0]
    """
    position = torch.arange(length, dtype=torch.float32, device=device).unsqueeze(1)
    inv_freq = torch.exp(torch.arange(0, width, 2, dtype=torch.float32, device=device)
                         * (-math.log(10000.0) / width))
    angles = position * inv_freq  # [L, ceil(width / 2)]
    out = torch.empty(length, width, dtype=torch.float32, device=device)
    out[:, 0::2] = torch.sin(angles)
    out[:, 1::2] = torch.cos(angles[:, : width // 2])
    return out


class GPT(nn.Module):
    """Decoder-only transformer LM with sinusoidal positions (no maximum length).

    Args:
        config: shape and initial attention backend; defaults to ``GPTConfig()``.

    Example:
        >>> import torch
        >>> model = GPT(GPTConfig(vocab_size=50, n_layer=1, d_model=32, n_head=2))
        >>> model(torch.randint(0, 50, (2, 9))).shape
        torch.Size([2, 9, 50])
        >>> model.set_attention_backend("sdpa")
        >>> model.attention_backend
        'sdpa'
    """

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else GPTConfig()
        cfg = self.config
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.fused_loss: Any = None  # set by the "fused_loss" rung (see :meth:`set_fused_loss`)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2 style: N(0, 0.02) weights, zero biases.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids``: LongTensor ``[B, L]`` → the final hidden states ``[B, L, d_model]``
        (after ``ln_f``)."""
        if input_ids.dim() != 2:
            raise ValueError(
                f"`input_ids` must have shape [batch, length], got {tuple(input_ids.shape)}.")
        x = self.tok_emb(input_ids)
        x = x + sinusoidal_positions(input_ids.shape[1], x.shape[-1], x.device).to(x.dtype)
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                ignore_index: int = -100) -> torch.Tensor:
        """``input_ids``: LongTensor ``[B, L]`` → logits ``[B, L, vocab_size]``; with ``labels``
        (the targets aligned with ``input_ids``), the loss instead (:meth:`loss`), through
        ``forward`` so that hooks on the module (FSDP2's ``fully_shard`` all-gathers) run for it."""
        if labels is None:
            return self.lm_head(self.hidden_states(input_ids))
        if self.fused_loss is not None:
            return self.fused_loss(self.hidden_states(input_ids), self.lm_head.weight, labels,
                                   ignore_index=ignore_index)
        logits = self.lm_head(self.hidden_states(input_ids))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=ignore_index)

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor,
             ignore_index: int = -100) -> torch.Tensor:
        """Mean next-token cross entropy over the labels that are not ``ignore_index`` (``labels``:
        the targets aligned with ``input_ids``). With :attr:`fused_loss` set (the protocol of
        :mod:`lightning_seqmem.mitigations.fused_loss.fused_loss`), computed by it from the hidden
        states and ``lm_head.weight``, without the ``[B, L, vocab]`` logits. Calls ``self(...)``."""
        return self(input_ids, labels, ignore_index)

    def set_fused_loss(self, fn: Any) -> None:
        """Compute :meth:`loss` by ``fn(hidden, weight, labels, ignore_index=...)``; None: plain."""
        self.fused_loss = fn

    def set_attention_backend(self, backend: str,
                              sdpa_backends: SDPBackend | Sequence[SDPBackend] | None = None,
                              ) -> None:
        """Switch every :class:`CausalSelfAttention` (see its method for arguments and errors)."""
        for module in self.modules():
            if isinstance(module, CausalSelfAttention):
                module.set_attention_backend(backend, sdpa_backends)  # first one validates
        self.config.attention = backend

    @property
    def attention_backend(self) -> str:
        """The backend all attention modules use, or ``"mixed"`` if they differ."""
        found = {m.attention_backend for m in self.modules() if isinstance(m, CausalSelfAttention)}
        if len(found) == 1:
            return found.pop()
        return "mixed" if found else self.config.attention
