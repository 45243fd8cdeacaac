"""The world one fake step runs in, shared by the one-rank and the sharded dry run.

:func:`fake_session`: the torch RNGs saved and restored (:func:`.fake.preserved_rng`), the warnings
of a fake copy without a Trainer silenced, a fresh ``FakeTensorMode`` and the batch's value twins
(:class:`.values.BatchValues`). :func:`fake_batch`: the batch cut or tiled to
``(batch_size, seq_len)`` on fake tensors, then moved to the device as Lightning moves it.

Example:
    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensor
    >>> batch = {"input_ids": torch.zeros(2, 16, dtype=torch.long)}
    >>> with fake_session(64) as (fake_mode, values):
    ...     step_batch, shape = fake_batch(batch, 64, 3, torch.device("cpu"), fake_mode, values)
    >>> ids = step_batch["input_ids"]
    >>> shape, tuple(ids.shape), isinstance(ids, FakeTensor)
    ((2, 16), (3, 64), True)
"""

from __future__ import annotations

import contextlib
import re
import warnings
import weakref
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_seqmem.dryrun.accelerator import simulating
from lightning_seqmem.dryrun.fake import QUIET_WARNINGS, preserved_rng
from lightning_seqmem.dryrun.moe import DryRunFakeMode, RoutedValues, routing_scope
from lightning_seqmem.dryrun.values import (BatchValues, shape_batch, batch_to_device,
                                            value_max_bytes)

__all__ = ["fake_batch", "fake_session"]


def _fresh(seq_len: int, kept: list[weakref.ref]) -> tuple[FakeTensorMode, BatchValues]:
    fake_mode = DryRunFakeMode(allow_non_fake_inputs=True)  # with the fake kernels of dryrun.moe
    values = RoutedValues(fake_mode, value_max_bytes(seq_len))  # and the routing of MoE blocks
    kept.append(weakref.ref(values))
    return fake_mode, values


@contextlib.contextmanager
def fake_session(seq_len: int,
                 device: Any = "cpu") -> Iterator[tuple[FakeTensorMode, BatchValues]]:
    """``(fake_mode, values)`` of a fake step at ``seq_len`` on ``device`` (a simulated CUDA device
    available meanwhile, :func:`.accelerator.simulating`); random state and warnings restored after.

    The session holds no reference to the mode or the twins: a caller that drops them frees the fake
    world while it is open. On close, every twin still held is cleared
    (:meth:`.values.BatchValues.clear`), freeing real memory before the cycles are collected."""
    with preserved_rng(), warnings.catch_warnings(), simulating(device):
        for message in QUIET_WARNINGS:
            warnings.filterwarnings("ignore", message=".*" + re.escape(message))
        kept: list[weakref.ref] = []
        with routing_scope() as scope:  # the MoE blocks' routing (it holds the values weakly)
            try:
                yield scope.watch(_fresh(seq_len, kept))  # the twins held weakly, not in this frame
            finally:
                held = kept[0]() if kept else None
                if held is not None:
                    held.clear()


def fake_batch(batch: Any, seq_len: int, batch_size: int, device: torch.device,
               fake_mode: FakeTensorMode, values: BatchValues) -> tuple[Any, Any]:
    """``(step batch, the batch's own shape)``: ``batch`` shaped to ``(batch_size, seq_len)`` on
    fake tensors (:func:`.values.shape_batch`), on ``device``."""
    step_batch, source_shape = shape_batch(batch, seq_len, batch_size, fake_mode, values)
    with fake_mode, values:  # as Lightning moves the batch to the module's device
        step_batch = batch_to_device(step_batch, device)
    return step_batch, source_shape
