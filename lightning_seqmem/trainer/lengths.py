"""The curriculum's length on each batch: cut in place, or set ahead through the dataset.

A batch the callback can cut (a mapping, a list, a dataclass) is cut in place at its batch start
(:func:`cut`, :func:`cut_for_step`); one only the dataset can shorten (a tuple, a bare tensor) gets
its length through the datamodule's or train dataset's ``set_seq_len`` before Lightning fetches it:
:func:`set_first_length` at the epoch start, then each batch end sets the next one's
(:func:`lightning_seqmem.trainer.batch_decision.set_next_length`). Without a curriculum nothing is cut.

Example:
    >>> from types import SimpleNamespace as NS
    >>> import torch
    >>> from lightning_seqmem.core.curriculum import Curriculum
    >>> batch = {"input_ids": torch.zeros(2, 64, dtype=torch.long)}
    >>> from lightning_seqmem.trainer.run_state import EdgeState
    >>> cut(NS(config=NS(curriculum=None), edge=EdgeState()), NS(), batch, 16)  # no curriculum: as it came
    >>> batch["input_ids"].shape
    torch.Size([2, 64])
    >>> cb = NS(config=NS(curriculum=Curriculum(start=16, target=64)), edge=EdgeState())
    >>> cut(cb, NS(), batch, 16)  # a mapping: cut in place, no setter used
    >>> batch["input_ids"].shape, cb.edge.uses_datamodule_length
    (torch.Size([2, 16]), False)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import lightning.pytorch as pl

from lightning_seqmem.trainer import access as edge
from lightning_seqmem.trainer.guard import fail, safely

if TYPE_CHECKING:
    from lightning_seqmem.trainer.callback import SeqMemCallback


def cut(cb: "SeqMemCallback", trainer: pl.Trainer, batch: Any, seq_len: Optional[int]) -> None:
    """Cut ``batch`` to the curriculum's ``seq_len`` (:func:`~lightning_seqmem.trainer.access.cut_to_length`)."""
    if cb.config.curriculum is not None and seq_len is not None:
        cb.edge.uses_datamodule_length = edge.cut_to_length(trainer, batch, seq_len, cb.config.curriculum.truncate,
                                                            cb.edge.uses_datamodule_length)


def cut_for_step(cb: "SeqMemCallback", trainer: pl.Trainer, batch: Any, seq_len: Optional[int]) -> None:
    """:func:`cut` the batch about to run; a batch format the curriculum cannot cut raises before
    any step ran (a configuration problem), and later stops the callback measuring instead."""
    try:
        cut(cb, trainer, batch, seq_len)
    except (TypeError, ValueError):
        if cb.planner.course.step == 0 and trainer.world_size == 1:
            raise  # a batch format the curriculum cannot cut, found before any step ran: say so
        fail(cb, "cutting the batch to the curriculum's length", RuntimeError("the batch could not be cut"))


def set_first_length(cb: "SeqMemCallback", trainer: pl.Trainer) -> None:
    """With a curriculum, batches that cannot be cut in place (a tuple, a bare tensor: their
    length is the dataset's; :func:`~lightning_seqmem.trainer.access.batches_need_setter`) and a
    ``set_seq_len`` on the datamodule or train dataset, set the length of the first batch before
    Lightning fetches it: the stage's length, or the next re-measurement's (the planner's state,
    the same on every rank: no collective). From then on each batch end sets the next one's."""
    if cb.config.curriculum is None or cb.edge.stopped or cb.edge.uses_datamodule_length:
        return  # (once a batch went through the setter, each batch end sets the next one's length)
    length = cb.planner.course.refit_queue[0] if cb.planner.course.refit_queue else cb.planner.course.seq_len  # same on every rank
    if length is not None and edge.length_setter(trainer) is not None and edge.batches_need_setter(trainer):
        safely(cb, "setting the next batch's length", lambda: edge.set_length_ahead(trainer, length))
