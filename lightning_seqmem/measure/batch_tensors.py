"""Cutting one tensor of a batch: which tensors are sequences (at ``seq_dim``, square ``[L, L]``
masks, sequences of another length), and the cuts (rows, diagonal blocks, broadcast rows, restarting
position ids). Used by ``cut_batch``; :mod:`lightning_seqmem.measure.batch` states the rules.

Example:
    >>> import torch
    >>> x = torch.arange(8).view(1, 8)
    >>> split_rows(x, 4, 1).tolist(), split_positions(x, 4, 1, 2, 2).tolist()
    ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 1, 2, 3]])
    >>> broadcast_rows(split_rows(x, 4, 1), x, batch_size=2, chunks=2).shape  # tiled to 2 samples
    torch.Size([4, 4])
    >>> diagonal_blocks(torch.arange(16).view(1, 4, 4), 2).tolist()
    [[[0, 1], [4, 5]], [[10, 11], [14, 15]]]
    >>> is_square(torch.ones(2, 1, 8, 8), 2, 8), is_square(torch.ones(2, 8, 8), 2, 8)  # embeddings
    (True, False)
"""

from __future__ import annotations

from typing import Any, Optional

import torch


__all__ = ["broadcast_rows", "diagonal_blocks", "is_sequence", "is_square", "scaled_length",
           "split_positions", "split_rows"]


def is_sequence(x: torch.Tensor, key_set: Optional[frozenset[str]], top_key: Any, batch: Any,
                batch_size: int, length: int, seq_dim: int) -> bool:
    """True for a tensor cut at ``seq_dim`` (rules in the module docstring)."""
    if key_set is not None:
        return top_key in key_set  # keyed values are tensors, so this is batch[top_key]
    if isinstance(batch, torch.Tensor):
        return True
    return x.dim() > seq_dim and x.shape[0] in (batch_size, 1) and x.shape[seq_dim] == length


def scaled_length(x: torch.Tensor, batch_size: int, length: int, seq_len: int,
                  seq_dim: int = 1) -> Optional[int]:
    """The length at ``seq_dim`` of a sequence of *another* length when the batch goes from
    ``length`` to ``seq_len`` tokens (its ratio kept, at least 1); None for other tensors.

    Such a tensor is 2-D integer or bool with ``B`` rows (or 1) and a length other than ``L``: the
    decoder ``labels`` ``[B, L/2]`` of an encoder-decoder (T5, BART), a second segment's ids. The
    curriculum cuts it and the dry run tiles it: ``[B, r·L] -> [B, r·seq_len]``.

    >>> import torch
    >>> labels = torch.zeros(2, 128, dtype=torch.long)
    >>> scaled_length(labels, 2, 256, 64), scaled_length(labels, 2, 256, 1024)
    (32, 512)
    >>> scaled_length(torch.zeros(2, 256, dtype=torch.long), 2, 256, 64) is None  # the length L
    True
    >>> scaled_length(torch.zeros(2, 128), 2, 256, 64) is None  # float: features, not a sequence
    True
    """
    if (x.dim() != 2 or seq_dim != 1 or x.shape[0] not in (batch_size, 1)
            or x.shape[1] in (length, 0)):
        return None
    if x.dtype.is_floating_point or x.dtype.is_complex:
        return None
    return max(1, round(int(x.shape[1]) * seq_len / length))


def is_square(x: torch.Tensor, batch_size: int, length: int) -> bool:
    """True for a ``[B or 1, ..., L, L]`` attention mask or bias, cut on both last dims: 4-D or
    more, or 3-D and not float (a float ``[B, L, D]`` with ``D == L`` is embeddings)."""
    if (x.dim() < 3 or x.shape[0] not in (batch_size, 1)
            or not x.shape[-1] == x.shape[-2] == length):
        return False
    return x.dim() >= 4 or not (x.dtype.is_floating_point or x.dtype.is_complex)


def split_rows(x: torch.Tensor, seq_len: int, seq_dim: int) -> torch.Tensor:
    """Split dim ``seq_dim`` of ``x`` into chunks of ``seq_len`` and move the chunks into dim 0."""
    shape = list(x.shape)
    chunks = shape[seq_dim] // seq_len
    x = x.reshape(*shape[:seq_dim], chunks, seq_len, *shape[seq_dim + 1 :])
    x = x.movedim(seq_dim, 1)
    return x.reshape(shape[0] * chunks, *shape[1:seq_dim], seq_len, *shape[seq_dim + 1 :])


def diagonal_blocks(x: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[R, ..., L, L]`` -> ``[R * chunks, ..., seq_len, seq_len]``: row ``r * chunks + j`` is
    the ``j``-th diagonal block ``x[r, ..., j*s:(j+1)*s, j*s:(j+1)*s]``."""
    *lead, length, _ = x.shape
    chunks = length // seq_len
    blocks = x.reshape(*lead, chunks, seq_len, chunks, seq_len)
    blocks = torch.diagonal(blocks, dim1=-4, dim2=-2)  # [*lead, s, s, chunks]
    blocks = blocks.movedim(-1, 1)  # [R, chunks, *middle, s, s]
    return blocks.reshape(lead[0] * chunks, *lead[1:], seq_len, seq_len)


def broadcast_rows(rows: torch.Tensor, x: torch.Tensor, batch_size: int,
                   chunks: int) -> torch.Tensor:
    """Split rows of a broadcast ``[1, ...]`` tensor (``chunks`` rows) tiled to every sample."""
    if x.shape[0] != 1 or batch_size == 1:
        return rows.contiguous()
    return rows.unsqueeze(0).expand(batch_size, *rows.shape).reshape(batch_size * chunks,
                                                                      *rows.shape[1:])


def split_positions(x: torch.Tensor, seq_len: int, seq_dim: int, batch_size: int,
                    chunks: int) -> torch.Tensor:
    """``arange(seq_len)`` at ``seq_dim`` in the split rows' shape (``[1, ...]`` if broadcast)."""
    rows = split_rows(x, seq_len, seq_dim)
    if x.shape[0] == 1 and batch_size > 1:
        rows = rows[:1]
    shape = [1] * rows.dim()
    shape[seq_dim] = seq_len
    positions = torch.arange(seq_len, dtype=rows.dtype, device=rows.device)
    return positions.view(shape).expand(rows.shape).contiguous()
