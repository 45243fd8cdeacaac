"""An independent judge of the budget in tests: the memory of every step window, from the first
callback's ``on_train_batch_start`` to the last callback's ``on_train_batch_end``, counted by
``torch.profiler``'s allocator events (which see every CPU allocation, those a dispatch mode
cannot: a dry run's real value twins computed with every mode off, a kept batch copy, a probe's
own tensors).

:meth:`StepWindows.around` puts two callbacks around the ones given: the first starts a profiler for
the whole fit (from its ``setup``) and opens each window, the last closes it. After the fit,
:meth:`StepWindows.peaks` gives each window's peak: the bytes of what the step starts from (the
module's parameters, buffers and attribute tensors, the gradients, the optimizer state and the
batch: what the callback's own probe counts as existing) plus every allocation made since the
profiler started (at ``setup``: a strategy's own buffers, DDP's gradient buckets, are made after it)
before the first window or inside any window, still alive, at its highest within the window. What
the data pipeline allocates between windows (the next batch, fetched ahead) is not counted, as on
a GPU it is host memory.

Example (in a test)::

    windows = StepWindows()
    make_trainer(windows.around(cb), max_steps=8).fit(model, data)
    assert windows.over(cb.usable_budget_bytes) == []
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from lightning_seqmem.measure.probes import existing_tensors
from lightning_seqmem.measure.tracker import tensor_storages


class StepWindows:
    """Every step window's peak bytes on the CPU, by the profiler's allocator events."""

    def __init__(self) -> None:
        self.profiler: Optional[profile] = None
        self.windows: list[dict[str, Any]] = []  # per batch: the existing storages, its tokens
        self._range: Any = None
        self._peaks: Optional[list[int]] = None

    def around(self, *callbacks: pl.Callback) -> list[pl.Callback]:
        """``[opener, *callbacks, closer]``: the window of every batch around every callback's hooks
        (the profiler runs from the opener's ``setup`` to its ``on_train_end``)."""
        return [_Opener(self), *callbacks, _Closer(self)]

    # -- during the fit ----------------------------------------------------------------------------
    def start(self) -> None:
        self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.profiler.__enter__()

    def open(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        storages = {}
        for t in existing_tensors(pl_module, trainer.optimizers, batch):
            if t.device.type == "cpu":
                for st in tensor_storages(t):
                    storages[st.data_ptr()] = st.nbytes()
        self.windows.append({"existing": storages, "tokens": _tokens(batch)})
        self._range = record_function(f"seqmem_window_{len(self.windows) - 1}")
        self._range.__enter__()

    def close(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def stop(self) -> None:
        self.close()
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)

    # -- after it --------------------------------------------------------------------------------
    def peaks(self) -> list[int]:
        """Each window's peak bytes, in order."""
        if self._peaks is None:
            self._peaks = self._count()
        return self._peaks

    def over(self, usable_bytes: int) -> list[tuple[int, int, int]]:
        """``(window, tokens, peak bytes)`` of every window over ``usable_bytes``."""
        peaks = enumerate(self.peaks())
        return [(i, self.windows[i]["tokens"], p) for i, p in peaks if p > usable_bytes]

    def _count(self) -> list[int]:
        from torch._C._profiler import _EventType

        assert self.profiler is not None, "the fit did not start the profiler"
        ranges: dict[int, tuple[int, int]] = {}
        allocations: list[tuple[int, int, int]] = []  # (time ns, ptr, bytes: negative for a free)
        stack = list(self.profiler.profiler.kineto_results.experimental_event_tree())
        while stack:
            event = stack.pop()
            stack.extend(event.children)
            if event.tag == _EventType.Allocation:
                fields = event.extra_fields
                if fields.device.type == torch.device("cpu").type:
                    allocations.append((event.start_time_ns, int(fields.ptr),
                                        int(fields.alloc_size)))
            elif event.name.startswith("seqmem_window_"):
                ranges[int(event.name.rsplit("_", 1)[1])] = (event.start_time_ns, event.end_time_ns)
        allocations.sort()
        inside: dict[int, int] = {}  # ptr -> bytes of what a window allocated, alive
        peaks: list[int] = []
        position = 0
        for index, window in enumerate(self.windows):
            begin, end = ranges.get(index, (None, None))
            if begin is None:
                break
            # before the first window, and between windows
            while position < len(allocations) and allocations[position][0] < begin:
                _, ptr, size = allocations[position]
                if size < 0:
                    inside.pop(ptr, None)
                elif index == 0:  # the set-up's (a strategy's buffers)
                    inside[ptr] = size
                position += 1
            existing = dict(window["existing"])
            live = sum(existing.values()) + sum(v for k, v in inside.items() if k not in existing)
            peak = live
            while position < len(allocations) and allocations[position][0] <= end:
                _, ptr, size = allocations[position]
                if size > 0:
                    # an address allocated again: what held it was freed where the profiler does
                    # not record (gloo's worker thread releasing a collective's buffer)
                    stale = inside.pop(ptr, None) or existing.pop(ptr, None)
                    live += size - (stale or 0)
                    inside[ptr] = size
                else:
                    known = existing.pop(ptr, None)
                    if known is None:
                        known = inside.get(ptr)
                    else:
                        inside.pop(ptr, None)
                    if known is not None:
                        inside.pop(ptr, None)
                        live -= known
                peak = max(peak, live)
                position += 1
            peaks.append(peak)
        return peaks


def _tokens(batch: Any) -> Optional[int]:
    from lightning_seqmem.measure.batch_shape import infer_batch_shape

    try:
        return int(infer_batch_shape(batch)[1])
    except (TypeError, ValueError):
        return None


class _Opener(pl.Callback):
    def __init__(self, windows: StepWindows) -> None:
        self.windows = windows

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.windows.start()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.windows.open(trainer, pl_module, batch)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.windows.stop()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self.windows.stop()


class _Closer(pl.Callback):
    def __init__(self, windows: StepWindows) -> None:
        self.windows = windows

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self.windows.close()
