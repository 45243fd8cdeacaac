"""Sequence/context parallelism: one rank's shard of a step on fake tensors, in a fake world.

:func:`sequence_parallel_dry_run_step` runs the module's own step as rank 0 of ``world_size`` ranks
(FSDP2 over the world, as :func:`.sharded.sharded_dry_run_step`) on its ``L/degree`` tokens, every
``F.scaled_dot_product_attention`` call replaced by its sequence-parallel form over ``degree`` (a
transformers model's flash-attn or flex attention function likewise, Ulysses only, as ALST does):

- ``"ulysses"``: :func:`ulysses_attention`: q, k, v ``[B, H, L/d, D]`` are all-to-all'ed into
  ``[B, H/d, L, D]``, full-length attention runs on ``H/d`` heads, the output (and gradients) goes
  back alike; also in a real process group (``tests/scripts/sp_run.py``, over 2 CPU processes).
- ``"ring"``: PyTorch's own ring (``_context_parallel``'s ``_templated_ring_attention`` and its
  backward) with the CPU flash kernel: the K/V all-gather or ring buffers, the float32 merge of
  partial outputs, the backward's float32 gradient accumulators and ring. A real ring step needs
  CUDA SDPA kernels, so it is not measured on CPU here (see ``benchmarks/gpu_check.py``).

The collectives' output buffers come from the fake process group and are counted by the tracker:
*measured* by the dry run. Not counted: the backend's own buffers (NCCL's), as in the FSDP2 dry run.

Example:
    >>> from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
    >>> from lightning_seqmem.dryrun.sharded import unsharded_template
    >>> template = unsharded_template(LitGPT(n_layer=2, d_model=64, n_head=4, attention="sdpa"))
    >>> batch = next(iter(SyntheticTokenDataModule(batch_size=1, seq_len=32).train_dataloader()))
    >>> whole = sequence_parallel_dry_run_step(template, batch, 2048, 4, degree=1, kind="none")
    >>> ulysses = sequence_parallel_dry_run_step(template, batch, 2048, 4, degree=4, kind="ulysses")
    >>> ulysses.peak_bytes < whole.peak_bytes
    True
    >>> attention_calls(template, batch).n_heads
    4
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F

from lightning_seqmem.core.checks import check_int
from lightning_seqmem.dryrun.sharded import sharded_dry_run_step
from lightning_seqmem.dryrun.result import DryRunResult, DryRunUnsupported

__all__ = ["AttentionCalls", "attention_calls", "ring_attention", "sequence_parallel_attention",
           "sequence_parallel_dry_run_step", "state_bytes", "ulysses_attention"]

_SDPA = F.scaled_dot_product_attention  # the original, captured at import


# -- Ulysses --------------------------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 with equal splits; its adjoint is the same all-to-all."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _AllToAll.apply(grad, ctx.group), None


def _seq_to_heads(x: torch.Tensor, degree: int, group: Any) -> torch.Tensor:
    """``[B, H, L/d, D]`` (own tokens, all heads) -> ``[B, H/d, L, D]`` (all tokens, own heads)."""
    b, h, lc, d = x.shape
    # [d, B, H/d, Lc, D]: chunk j to rank j
    send = x.reshape(b, degree, h // degree, lc, d).transpose(0, 1)
    recv = _AllToAll.apply(send, group)  # [d, B, H/d, Lc, D]: chunk j = rank j's tokens
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // degree, degree * lc, d)


def _heads_to_seq(y: torch.Tensor, degree: int, group: Any) -> torch.Tensor:
    """``[B, H/d, L, D]`` -> ``[B, H, L/d, D]`` (the inverse of :func:`_seq_to_heads`)."""
    b, hl, length, d = y.shape
    # chunk j: rank j's tokens
    send = y.reshape(b, hl, degree, length // degree, d).permute(2, 0, 1, 3, 4)
    recv = _AllToAll.apply(send, group)  # [d, B, H/d, Lc, D]: chunk j = rank j's heads
    return recv.transpose(0, 1).reshape(b, hl * degree, length // degree, d)


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, degree: int,
                      group: Any = None, **sdpa_kwargs: Any) -> torch.Tensor:
    """DeepSpeed-Ulysses attention (module doc) of this rank's ``[B, H, L/degree, D]`` q, k, v over
    the ``degree`` ranks of ``group``, which hold consecutive chunks in rank order; ``sdpa_kwargs``
    go to SDPA (``attn_mask``: of the full length).

    Example (one rank: the all-to-all is the identity):
        >>> import torch.distributed as dist
        >>> from lightning_seqmem.dryrun.sharded import fake_world
        >>> q = torch.randn(1, 2, 8, 4)
        >>> with fake_world(1):
        ...     y = ulysses_attention(q, q, q, 1, dist.group.WORLD, is_causal=True)
        >>> torch.allclose(y, F.scaled_dot_product_attention(q, q, q, is_causal=True), atol=1e-6)
        True
    """
    q, k, v = (_seq_to_heads(t, degree, group) for t in (query, key, value))
    y = _SDPA(q, k, v, **sdpa_kwargs)
    return _heads_to_seq(y, degree, group)


# -- ring (PyTorch's context_parallel code) -------------------------------------------------------
class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any,
                is_causal: bool, scale: Optional[float]) -> torch.Tensor:
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _templated_ring_attention)

        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        kwargs = {} if scale is None else {"scale": scale}
        out, lse, *_ = _templated_ring_attention(group, 2, op, q, k, v, is_causal=is_causal,
                                                 **kwargs)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.is_causal, ctx.scale = group, is_causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _templated_ring_attention_backward)

        q, k, v, out, lse = ctx.saved_tensors
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        kwargs: dict[str, Any] = ({"dropout_p": 0.0} if ctx.scale is None
                                  else {"dropout_p": 0.0, "scale": ctx.scale})
        dq, dk, dv, *_ = _templated_ring_attention_backward(
            ctx.group, 2, op, grad_out.contiguous(), "grad_out", q, k, v, out, lse, ctx.is_causal,
            **kwargs)
        return dq, dk, dv, None, None, None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Any,
                   is_causal: bool = False, scale: Optional[float] = None) -> torch.Tensor:
    """Ring attention (module doc) of a rank's ``[B, H, L/d, D]`` chunk, load-balanced if causal."""
    return _Ring.apply(query, key, value, group, is_causal, scale)


# -- patching the model's SDPA calls --------------------------------------------------------------
@dataclasses.dataclass
class AttentionCalls:
    """What a step's ``scaled_dot_product_attention`` calls looked like (the first call's heads)."""

    calls: int = 0
    n_heads: Optional[int] = None
    n_kv_heads: Optional[int] = None
    masked: bool = False  # some call passed an explicit attn_mask
    dropout: bool = False
    attention: str = "sdpa"  # or the transformers attention function called (flash_attention_2)


def _note(calls: AttentionCalls, q: torch.Tensor, k: torch.Tensor, attn_mask: Any,
          dropout_p: float) -> None:
    calls.calls += 1
    if calls.n_heads is None and q.dim() == 4:
        calls.n_heads, calls.n_kv_heads = int(q.shape[1]), int(k.shape[1])
    calls.masked |= attn_mask is not None
    calls.dropout |= bool(dropout_p)


@contextlib.contextmanager
def sequence_parallel_attention(kind: str = "none", degree: int = 1,
                                group: Any = None) -> Iterator[AttentionCalls]:
    """Replace ``F.scaled_dot_product_attention`` with its ``kind`` form over ``degree`` ranks of
    ``group`` (None: a new group of ranks ``0..degree-1``, made at the first call, in the current
    process group) for the duration, yielding the calls seen (``"none"``: only records them)."""
    calls = AttentionCalls()
    groups: list[Any] = [group]
    inside = [False]  # within a wrapped transformers function: its own SDPA call is not split again

    def the_group() -> Any:
        if groups[0] is None:
            import torch.distributed as dist

            groups[0] = (dist.group.WORLD if dist.get_world_size() == degree
                         else dist.new_group(list(range(degree))))
        return groups[0]

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             **kwargs):
        if inside[0]:
            return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                         is_causal=is_causal, scale=scale, **kwargs)
        _note(calls, query, key, attn_mask, dropout_p)
        if kind == "none" or degree == 1:
            return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                         is_causal=is_causal, scale=scale, **kwargs)
        if kind == "ulysses":
            return ulysses_attention(query, key, value, degree, the_group(), attn_mask=attn_mask,
                                     dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                     **kwargs)
        if attn_mask is not None:
            raise DryRunUnsupported("ring attention takes is_causal or no mask; the model passes "
                                    "an explicit attn_mask")
        if kwargs.get("enable_gqa") and key.shape[1] != query.shape[1]:
            repeat = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
        return ring_attention(query, key, value, the_group(), is_causal, scale)

    def hf_attention(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        """A transformers attention function (flash-attn, flex: no SDPA call) in ``kind`` form:
        Ulysses as ALST runs it (``UlyssesSPAttentionHF``); out ``[B, L, H, D]``."""
        def attention(module, query, key, value, attention_mask, *args, **kwargs):
            _note(calls, query, key, attention_mask, kwargs.get("dropout", 0.0))
            calls.attention = name
            split = kind != "none" and degree > 1
            if split and (kind == "ring" or attention_mask is not None):
                raise DryRunUnsupported(f"{kind} over {name} with attention_mask="
                                        f"{'set' if attention_mask is not None else 'None'}: "
                                        "not modelled (Ulysses with no padding mask is)")
            if split:
                kwargs.pop("position_ids", None)  # this rank's; after the all-to-all: all of them
                query, key, value = (_seq_to_heads(t, degree, the_group())
                                     for t in (query, key, value))
            inside[0] = True
            try:
                out, weights = fn(module, query, key, value, attention_mask, *args, **kwargs)
            finally:
                inside[0] = False
            if split:
                out = _heads_to_seq(out.transpose(1, 2), degree, the_group()).transpose(1, 2)
            return out, weights

        return attention

    # transformers' AttentionInterface where it dispatches by get_interface (imported by its models)
    interface = getattr(sys.modules.get("transformers.modeling_utils"), "AttentionInterface", None)
    interface = interface if hasattr(interface, "get_interface") else None
    previous = F.scaled_dot_product_attention  # an outer patch, if any, comes back afterwards
    F.scaled_dot_product_attention = sdpa
    if interface is not None:
        get = interface.get_interface

        def get_interface(self, name, default):
            fn = get(self, name, default)
            return fn if name in (None, "sdpa", "eager") else hf_attention(fn, name)

        interface.get_interface = get_interface
    try:
        yield calls
    finally:
        F.scaled_dot_product_attention = previous
        if interface is not None:
            interface.get_interface = get


def attention_calls(template: Any, batch: Any, seq_len: int = 64, batch_size: int = 1,
                    mitigations: Sequence[str] = (),
                    autocast: Optional[Callable[[], ContextManager[Any]]] = None,
                    device: Any = None) -> AttentionCalls:
    """The heads, KV heads and masks of the model's SDPA calls, from a short dry run (``autocast``
    and ``device`` as the plan's: flash-attn refuses float32)."""
    with sequence_parallel_attention("none") as calls:
        sharded_dry_run_step(template, batch, seq_len, 1, batch_size, mitigations, "fsdp2",
                             autocast, device)
    return calls


def sequence_parallel_dry_run_step(
    template: Any, batch: Any, seq_len: int, world_size: int, degree: int, kind: str,
    batch_size: Optional[int] = None, mitigations: Sequence[str] = (),
    autocast: Optional[Callable[[], ContextManager[Any]]] = None, device: Any = None,
    offload: bool = False,
) -> DryRunResult:
    """Rank 0's peak of one training step with the sequence split over ``degree`` ranks (``kind``:
    ``"ulysses"``, ``"ring"``, or ``"none"`` with degree 1) and FSDP2 over ``world_size`` ranks.
    ``offload``: as in :func:`.sharded.sharded_dry_run_step` (FSDP2 ``CPUOffloadPolicy``).

    Raises:
        ValueError: ``degree`` does not divide ``world_size`` or ``seq_len``; an unknown ``kind``.
        DryRunUnsupported: the step cannot run on fake tensors, or makes no SDPA call to shard.
    """
    seq_len, world_size, degree = (check_int(n, v) for n, v in (
        ("seq_len", seq_len), ("world_size", world_size), ("degree", degree)))
    if kind not in ("none", "ulysses", "ring"):
        raise ValueError(f"`kind` must be one of ('none', 'ulysses', 'ring'), got {kind!r}")
    if world_size % degree or seq_len % degree:
        raise ValueError(f"`degree` must divide `world_size` and `seq_len`, got degree={degree}, "
                         f"world_size={world_size}, seq_len={seq_len}")
    if kind == "none" and degree != 1:
        raise ValueError(f"`kind='none'` takes degree 1, got {degree}")
    started = time.perf_counter()
    with sequence_parallel_attention(kind, degree) as calls:
        result = sharded_dry_run_step(template, batch, seq_len // degree, world_size, batch_size,
                                      mitigations, "fsdp2", autocast, device, offload=offload)
    if degree > 1 and not calls.calls:
        raise DryRunUnsupported("the model made no scaled_dot_product_attention call (eager "
                                "attention?): Ulysses and ring shard SDPA calls; plan it with the "
                                "attention rung")
    detail = result.detail + (f"; {kind} sequence parallel over {degree} ranks: "
                              f"{seq_len // degree} of {seq_len} tokens per rank, {calls.calls} "
                              "attention calls sharded" if degree > 1 else "")
    return dataclasses.replace(result, seq_len=seq_len, detail=detail,
                               seconds=time.perf_counter() - started)


def state_bytes(template: Any, world_size: int,
                optimizer_state_per_parameter: Optional[int] = None) -> dict[str, int]:
    """One rank's share of the parameters, gradients and optimizer state under FSDP2 over
    ``world_size`` ranks (each parameter cut in ``world_size`` rows, rank 0 the largest), in bytes.
    ``optimizer_state_per_parameter``: state tensors per parameter (AdamW: 2, fp32); None: 2.

    Example:
        >>> state_bytes(torch.nn.Linear(4, 4, bias=False), 2)
        {'parameter_shard_bytes': 32, 'gradient_shard_bytes': 32, 'optimizer_state_bytes': 64}
    """
    params = grads = state = 0
    per = 2 if optimizer_state_per_parameter is None else int(optimizer_state_per_parameter)
    for p in template.parameters():
        rows = p.shape[0] if p.dim() else 1
        numel = math.ceil(rows / world_size) * (p.numel() // max(rows, 1))
        params += numel * p.element_size()
        if p.requires_grad:
            grads += numel * p.element_size()
            state += per * numel * 4
    return {"parameter_shard_bytes": params, "gradient_shard_bytes": grads,
            "optimizer_state_bytes": state}
