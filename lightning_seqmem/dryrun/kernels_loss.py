"""Cut Cross-Entropy and Liger's fused linear cross-entropy on fake tensors: what they allocate.

The ``fused_loss`` rung's triton kernels (Apple's Cut Cross-Entropy ``cce``, Liger-Kernel
``liger``) cannot run on fake tensors; on the simulated CUDA device the rung runs these models,
written from the libraries' sources allocation by allocation, called as the rung calls them
(``reduction="sum"``):

* :func:`cce_loss` (apple/ml-cross-entropy, ``impl="cce"``, ``filter_eps="auto"``): forward keeps
  the int32 indices of counted tokens (bound: every token), ``lse`` fp32 ``[N]`` and ``logit_avg``
  fp32 ``[V]``; backward sorts the vocabulary and allocates ``de``, ``dc`` and lock arrays. No
  ``[N, V]`` block ever exists.
* :func:`liger_loss` (Liger-Kernel ``fused_linear_cross_entropy.py``): forward computes the
  gradients in chunks of logits ``[chunk, V]`` (:func:`liger_chunks`) and saves ``grad_input
  [N, d]`` and ``grad_weight [V, d]``; backward scales them in place.

Example:
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode():
    ...     h = torch.empty(4096, 64, dtype=torch.bfloat16, requires_grad=True)
    ...     w = torch.empty(1000, 64, dtype=torch.bfloat16, requires_grad=True)
    ...     loss = cce_loss(h, w, torch.zeros(4096, dtype=torch.long), -100)
    >>> [tuple(t.shape) for t in loss.grad_fn.saved_tensors]
    [(4096, 64), (1000, 64), (4096,), (4096,), (4096,), (1000,)]
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_seqmem.dryrun.kernels_scratch import note_kernel

__all__ = ["cce_loss", "liger_chunks", "liger_loss"]


class _CCE(torch.autograd.Function):
    """Cut Cross-Entropy's ``LinearCrossEntropyFunction`` (``reduction="sum"``): its allocations."""

    @staticmethod
    def forward(ctx: Any, e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                ignore_index: int) -> torch.Tensor:
        e, targets = e.contiguous(), targets.contiguous()
        n, v = e.shape[0], c.shape[0]
        # _build_flat_valids: (targets != ignore).nonzero().to(int32), bounded: every token counted
        counted = torch.ones(n, dtype=torch.bool, device=e.device)
        wide = torch.empty(n, 1, dtype=torch.int64, device=e.device)
        valids = torch.empty(n, dtype=torch.int32, device=e.device)
        del counted, wide
        lse = torch.empty(n, dtype=torch.float32, device=e.device)  # cce_lse_forward_kernel
        locks = torch.empty(-(-n // 128), dtype=torch.int32, device=e.device)
        # filter_eps="auto" with a gradient to compute: the vocabulary's average logit
        logit_avg = torch.empty(v, dtype=torch.float32, device=e.device)
        del locks
        nll = torch.empty(n, dtype=torch.float32, device=e.device)  # indexed_neg_dot; += lse
        ctx.save_for_backward(e, c, lse, targets, valids, logit_avg)
        ctx.input_grads = ctx.needs_input_grad[:2]
        return nll.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        e, c, lse, targets, valids, logit_avg = ctx.saved_tensors
        order = torch.empty(c.shape[0], dtype=torch.int64, device=c.device)  # argsort(logit_avg)
        ordering = torch.empty(c.shape[0], dtype=torch.int32, device=c.device)
        del order
        de = torch.empty_like(e) if ctx.input_grads[0] else None
        dc = torch.empty_like(c) if ctx.input_grads[1] else None
        d_locks = -(-c.shape[1] // 64)
        de_locks = torch.empty(-(-e.shape[0] // 128), d_locks, dtype=torch.int32, device=e.device)
        dc_locks = torch.empty(-(-c.shape[0] // 128), d_locks, dtype=torch.int32, device=e.device)
        del ordering, de_locks, dc_locks
        return de, dc, None, None


def cce_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
             ignore_index: int) -> torch.Tensor:
    """The summed cross-entropy of ``hidden [N, d] @ weight [V, d].T`` as Cut Cross-Entropy
    computes it, its memory modelled (fake tensors only: no value is computed)."""
    note_kernel("Cut Cross-Entropy linear_cross_entropy (modelled: cce_lse_forward / cce_backward "
                "allocations)")
    return _CCE.apply(hidden, weight, labels, ignore_index)


def liger_chunks(tokens: int, d_model: int, vocab_size: int) -> tuple[int, int]:
    """``(chunk size, chunks)`` of Liger's fused linear cross-entropy: chunks whose logits are
    about the size of the hidden states (``inc_factor = ceil(V / d)``, a power-of-two chunk).

    >>> liger_chunks(131072, 4096, 128256)
    (4096, 32)
    """
    factor = -(-vocab_size // d_model)
    size = 1 << max(0, (-(-tokens // factor) - 1).bit_length())
    return size, -(-tokens // size)


class _Liger(torch.autograd.Function):
    """``LigerFusedLinearCrossEntropyFunction`` (``reduction="sum"``): gradients made in forward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, target: torch.Tensor,
                ignore_index: int) -> torch.Tensor:
        n, d = x.shape
        size, chunks = liger_chunks(n, d, w.shape[0])
        grad_input = torch.zeros_like(x)
        grad_weight = torch.zeros_like(w) if w.requires_grad else None
        loss_1d = torch.zeros(n, dtype=torch.float32, device=x.device)
        counted = target != ignore_index  # its sum read with .item() (a host value)
        del counted
        for i in range(chunks):
            part = x[i * size : (i + 1) * size]
            logits = part @ w.t()  # the kernel writes the logits' gradient over them, in place
            grad_input[i * size : (i + 1) * size] = logits @ w
            if grad_weight is not None:  # not fp32: torch.mm(...).float(), added in place
                grad_weight += torch.mm(logits.t(), part).float()
            del logits
        loss = loss_1d.sum()
        ctx.save_for_backward(grad_input, grad_weight)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad_input, grad_weight = ctx.saved_tensors  # element_mul_kernel scales them in place
        return grad_input, grad_weight, None, None


def liger_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
               ignore_index: int) -> torch.Tensor:
    """The summed cross-entropy as Liger's fused linear cross-entropy computes it, its memory."""
    note_kernel("Liger fused_linear_cross_entropy (modelled: chunked logits, gradients in forward)")
    return _Liger.apply(hidden, weight, labels, ignore_index)
