"""``CurriculumState``: where the run stands (checkpointed). What to do before a batch under a
curriculum is decided by :class:`~lightning_seqmem.plan.decisions.Decider`.

Example:
    >>> from lightning_seqmem.core.curriculum import Curriculum
    >>> state = CurriculumState(Curriculum(start=64, target=256, steps_per_stage=2, multiple_of=16))
    >>> state.stages, state.seq_len, state.batch_at(4, 512, 256)
    ((64, 128, 256), 64, 4)
    >>> state.drop_past(200), state.stages
    ([256], (64, 128, 192))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional

from lightning_seqmem.core.curriculum import Curriculum

if TYPE_CHECKING:  # pragma: no cover
    from lightning_seqmem.plan.decisions import Decision

__all__ = ["CurriculumState"]


class CurriculumState:
    """``stages`` (its lengths, the last the cap once capped; none without a curriculum), ``stage``
    (the index running), ``stage_steps`` (its optimizer steps), ``capped_at``, ``refit_queue``
    (lengths before the next decision), ``decide_now`` (judge the next stage at the next batch)."""

    def __init__(self, curriculum: Optional[Curriculum]) -> None:
        self.curriculum = curriculum
        self.stages: tuple[int, ...] = curriculum.stages if curriculum else ()
        self.stage = 0
        self.stage_steps = 0
        self.capped_at: Optional[int] = None
        self.refit_queue: list[int] = []
        self.decide_now = False
        self.step = 0  # batches run this fit

    @property
    def seq_len(self) -> Optional[int]:
        """The curriculum's current stage length (None without a curriculum)."""
        return self.stages[self.stage] if self.stages else None

    @property
    def next_stage(self) -> Optional[int]:
        """The next stage's length (None at the last stage, or without a curriculum)."""
        return self.stages[self.stage + 1] if self.stage + 1 < len(self.stages) else None

    def batch_at(self, batch_size: int, source_len: int, seq_len: int) -> int:
        """Samples per batch at ``seq_len`` (``truncate=False`` reshapes rows, keeping tokens)."""
        assert self.curriculum is not None
        if not self.curriculum.truncate and source_len > 0:
            return max(1, batch_size * source_len // seq_len)
        return batch_size

    def commit(self, decision: "Decision") -> None:
        """Take the curriculum fields of ``decision``."""
        self.stages, self.stage = tuple(decision.stages), decision.stage
        self.refit_queue, self.decide_now = list(decision.refit_queue), decision.decide_now
        if decision.reset_stage_steps:
            self.stage_steps = 0
        if decision.action == "cap":
            self.capped_at = self.stages[-1]

    def resume_at(self, stages: tuple[int, ...], stage: int, capped_at: Optional[int], *,
                  restart_stage: bool = False, decide_now: bool = False) -> None:
        """Resume under a changed configuration (:func:`.checkpoint.reconcile`).
        ``restart_stage``: the length changed, so its step count and re-measurement queue start
        again; ``decide_now``: judge the next stage at the next batch (a cap lifted)."""
        self.stages, self.stage, self.capped_at = tuple(stages), int(stage), capped_at
        if restart_stage:
            self.stage_steps, self.refit_queue = 0, []
        self.decide_now = self.decide_now or decide_now

    def without_curriculum(self) -> None:
        """The curriculum was removed on resume: the data's own lengths run."""
        self.stages, self.stage, self.capped_at, self.refit_queue = (), 0, None, []

    def replan(self) -> None:
        """The rungs changed: no queued re-measurement, and the next batch decides."""
        self.refit_queue, self.decide_now = [], True

    def drop_past(self, limit: int) -> list[int]:
        """Drop the stages past ``limit`` tokens (the last becomes ``limit`` rounded down to
        ``multiple_of``); returns the stages dropped (none: nothing changed)."""
        if not self.stages or self.stages[-1] <= limit:
            return []
        assert self.curriculum is not None
        stop = max(self.curriculum.round_down(limit), self.curriculum.multiple_of)
        dropped = [s for s in self.stages if s > limit]
        kept = tuple(s for s in self.stages if s <= stop)
        self.stages = kept + ((stop,) if not kept or kept[-1] < stop else ())
        self.stage = min(self.stage, len(self.stages) - 1)
        self.refit_queue = [L for L in self.refit_queue if L <= limit]
        return dropped

    def end_batch(self, at_stage_length: bool = True) -> None:
        """A batch finished: one more step, and one more at the stage if it counts there."""
        self.step += 1
        self.stage_steps += 1 if at_stage_length else 0

    def state_dict(self) -> dict[str, Any]:
        """The step count and where the curriculum stands."""
        return {"step": self.step, "refit_queue": list(self.refit_queue),
                "decide_now": self.decide_now, "stages": list(self.stages), "stage": self.stage,
                "stage_steps": self.stage_steps, "capped_at": self.capped_at}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (raises on a stage outside the stages)."""
        self.step = int(state.get("step", 0))
        self.refit_queue = [int(L) for L in state.get("refit_queue", [])]
        self.decide_now = bool(state.get("decide_now", False))
        self.stages = tuple(int(s) for s in state.get("stages", self.stages))
        self.stage = int(state.get("stage", 0))
        if self.stages and not 0 <= self.stage < len(self.stages):
            raise ValueError(f"stage {self.stage} is outside the {len(self.stages)} stages "
                             f"{list(self.stages)}")
        self.stage_steps = int(state.get("stage_steps", 0))
        self.capped_at = state.get("capped_at")
