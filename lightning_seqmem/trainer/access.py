"""The callback's Lightning edge: trainer reads (internals guarded), batch cuts, rung refusals."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch

from lightning_seqmem.measure.batch_tree import can_cut_in_place, map_tensors
from lightning_seqmem.measure.batch import set_batch_sequence_length
from lightning_seqmem.measure.batch_shape import read_batch_shape
from lightning_seqmem.mitigations import ladder


def steps_optimizer(trainer: Any) -> bool:
    """Whether the batch about to run ends with an optimizer step (not a gradient accumulation)."""
    if trainer.accumulate_grad_batches == 1:
        return True
    try:
        return not trainer.fit_loop.epoch_loop._should_accumulate()
    except Exception:  # noqa: BLE001 - Lightning internals moved: assume it steps
        return True


def length_setter(trainer: Any) -> Optional[Callable[[int], None]]:
    """A datamodule's or train dataset's ``set_seq_len`` method, if it has one."""
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None and callable(getattr(datamodule, "set_seq_len", None)):
        return datamodule.set_seq_len
    loader = getattr(trainer, "train_dataloader", None)
    dataset = getattr(loader, "dataset", None)
    if dataset is not None and callable(getattr(dataset, "set_seq_len", None)):
        return dataset.set_seq_len
    return None


def train_loader_workers(trainer: Any) -> int:
    """The most worker processes of the trainer's train dataloader(s) (0: loaded in this process).

    >>> from types import SimpleNamespace as NS
    >>> [train_loader_workers(NS(train_dataloader=x)) for x in (NS(num_workers=2), None)]
    [2, 0]
    """
    loader = getattr(trainer, "train_dataloader", None)
    loaders = (list(loader.values()) if isinstance(loader, dict)
               else list(loader) if isinstance(loader, (list, tuple)) else [loader])
    return max([int(getattr(x, "num_workers", 0) or 0) for x in loaders] + [0])


# the start and the end of both errors of check_setter_reaches_data
_SETTER_ONLY = ("the curriculum can set this batch's length only through the dataset's "
                "`set_seq_len` (the batch is a tuple or a bare tensor, which cannot be cut in "
                "place), but the train DataLoader has ")
_OR_CUT_HERE = (", or return batches as a dict (or a list, or a dataclass) that the callback cuts "
                "itself, or drop the `curriculum`.")


def check_setter_reaches_data(trainer: Any) -> None:
    """ValueError where a length given to ``set_seq_len`` here would not reach the batches in time.

    >>> from types import SimpleNamespace as NS
    >>> check_setter_reaches_data(NS(train_dataloader=NS(num_workers=0)))
    >>> check_setter_reaches_data(  # doctest: +NORMALIZE_WHITESPACE
    ...     NS(train_dataloader=NS(num_workers=2)))
    Traceback (most recent call last):
    ...
    ValueError: the curriculum can set this batch's length only through the dataset's `set_seq_len`
    (the batch is a tuple or a bare tensor, which cannot be cut in place), but the train DataLoader
    has num_workers=2: each worker process holds its own copy of the dataset, so a length set in the
    main process never reaches the batches. Use DataLoader(num_workers=0), or return batches as a
    dict (or a list, or a dataclass) that the callback cuts itself, or drop the `curriculum`.
    """
    fetcher = getattr(getattr(trainer, "fit_loop", None), "_data_fetcher", None)
    if getattr(fetcher, "prefetch_batches", 0) > 0 and getattr(fetcher, "length", 0) is None:
        raise ValueError(
            f"{_SETTER_ONLY}no length, so Lightning fetches each batch one ahead of the step: "
            "every stage's first batch would arrive at the previous stage's length, the first at "
            "the data's own. Give the dataset a `__len__` (Lightning then fetches each batch just "
            f"before its step){_OR_CUT_HERE}")
    workers = train_loader_workers(trainer)
    if workers > 0:
        raise ValueError(
            f"{_SETTER_ONLY}num_workers={workers}: each worker process holds its own copy of the "
            "dataset, so a length set in the main process never reaches the batches. Use "
            f"DataLoader(num_workers=0){_OR_CUT_HERE}")


def batches_need_setter(trainer: Any) -> bool:
    """Whether the train loader's batches cannot be cut in place (a tuple, a bare tensor), told by
    collating one sample (random state restored); False where it cannot tell (an iterable dataset).

    >>> from types import SimpleNamespace as NS
    >>> from torch.utils.data import DataLoader
    >>> rows = [(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long))]
    >>> tuples, lists = DataLoader(rows, collate_fn=lambda b: tuple(b[0])), DataLoader(rows)
    >>> [batches_need_setter(NS(train_dataloader=x)) for x in (tuples, lists)]
    [True, False]
    """
    import random

    loader = getattr(trainer, "train_dataloader", None)
    dataset, collate = getattr(loader, "dataset", None), getattr(loader, "collate_fn", None)
    if (dataset is None or collate is None or not hasattr(type(dataset), "__getitem__")
            or not hasattr(dataset, "__len__")):
        return False
    state = random.getstate()
    try:
        with torch.random.fork_rng(devices=[]):
            batch = collate([dataset[0]])
    except Exception:  # noqa: BLE001 - cannot tell: the first batch says
        return False
    finally:
        random.setstate(state)
    return not can_cut_in_place(batch)


def set_length_ahead(trainer: Any, seq_len: int) -> bool:
    """Pass the next batch's length (a sized loader fetches it just before its step) to the
    ``set_seq_len`` of the datamodule or train dataset, so a batch only the dataset can shorten
    arrives at its stage's length; returns whether there was one.

    >>> from types import SimpleNamespace as NS
    >>> seen = []
    >>> set_length_ahead(NS(datamodule=NS(set_seq_len=seen.append)), 128), seen
    (True, [128])
    """
    setter = length_setter(trainer)
    if setter is None:
        return False
    setter(int(seq_len))
    return True


def cut_to_length(trainer: Any, batch: Any, seq_len: int, truncate: bool,
                  through_setter: bool, seq_len_fn: Optional[Callable[[Any], Any]] = None) -> bool:
    """Cut (``truncate=False``: reshape) ``batch`` to ``seq_len`` in place; a tuple or bare tensor
    goes through ``set_seq_len`` (ValueError: :func:`check_setter_reaches_data`), or with no setter
    stays as it is (the caller records what ran and warns). Returns whether the setter was used.
    A mapping without token ids (embeddings) is cut, with ``seq_len_fn``, on the tensors whose
    first two dimensions are the ``(batch_size, seq_len)`` it reads."""
    if not can_cut_in_place(batch) or through_setter:
        setter = length_setter(trainer)
        if setter is None:
            return False
        check_setter_reaches_data(trainer)
        setter(seq_len)
        return True
    try:
        set_batch_sequence_length(batch, seq_len, truncate=truncate)
    except ValueError:
        if seq_len_fn is None or not isinstance(batch, Mapping):
            raise
        shape = read_batch_shape(batch, seq_len_fn)
        keys = [k for k, v in batch.items()
                if isinstance(v, torch.Tensor) and v.dim() >= 2 and tuple(v.shape[:2]) == shape]
        set_batch_sequence_length(batch, seq_len, truncate=truncate, keys=keys)
    return False


def unsupported_rungs(trainer: Any, pl_module: Any,
                      rungs: tuple[str, ...]) -> tuple[list[str], str]:
    """The rungs this strategy or module cannot take, and why (before training starts)."""
    refusals = ladder.setup_refusals(trainer, pl_module, rungs)
    return list(refusals), "; ".join(dict.fromkeys(refusals.values()))


def release_cached_memory(pl_module: Any) -> None:
    """Empty the CUDA cache after a rung or shorter length (the budget counts reserved memory)."""
    first = next(iter(pl_module.parameters()), None)
    if first is not None and first.device.type == "cuda":
        torch.cuda.empty_cache()


def sharding_template(trainer: Any, pl_module: Any) -> Optional[Any]:
    """:func:`~lightning_seqmem.dryrun.sharded.template_for`: an unsharded ``meta`` copy of a module
    the strategy shards in ``configure_model()``; None elsewhere or where it cannot be copied."""
    from lightning_seqmem.dryrun.sharded import template_for

    try:
        return template_for(trainer, pl_module)
    except Exception:  # noqa: BLE001 - the dry run reports the missing template when asked
        return None


LENGTH_LIMIT_FIELDS = ("max_position_embeddings", "n_positions", "n_ctx", "block_size",
                       "max_seq_len")
"""Config fields giving a model's longest sequence in tokens (Hugging Face, GPT-2, nanoGPT)."""


def model_length_limit(module: Any) -> Optional[tuple[int, str]]:
    """The longest sequence ``module`` can take, from its configuration (position embeddings):
    ``(tokens, where it comes from)``, the smallest over its sub-modules' ``config``, or None.

    >>> from types import SimpleNamespace as NS
    >>> m = torch.nn.Module(); m.config = NS(max_position_embeddings=2048)
    >>> model_length_limit(m), model_length_limit(torch.nn.Linear(2, 2))
    ((2048, 'config.max_position_embeddings=2048'), None)
    """
    found: list[tuple[int, str]] = []
    for sub in module.modules() if isinstance(module, torch.nn.Module) else ():
        config = getattr(sub, "config", None)
        for name in LENGTH_LIMIT_FIELDS:
            value = (getattr(config, name, None)
                     if config is not None and not isinstance(config, dict) else None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                found.append((value, f"config.{name}={value}"))
    return min(found) if found else None


def longest_batch(kept: Optional[tuple[int, Any]], batch: Any, seq_len: int) -> tuple[int, Any]:
    """``kept``, or a CPU copy of ``batch`` if it is at least as long (for the final breakdown)."""
    if kept is not None and seq_len < kept[0]:
        return kept
    return int(seq_len), map_tensors(batch, lambda x, *_: x.detach().to("cpu", copy=True), False)


__all__ = ["batches_need_setter", "check_setter_reaches_data", "cut_to_length", "length_setter",
           "longest_batch", "model_length_limit", "release_cached_memory", "set_length_ahead",
           "sharding_template", "steps_optimizer", "train_loader_workers", "unsupported_rungs"]
