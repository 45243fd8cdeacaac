"""The curriculum's state and its decisions: ``CurriculumState`` (the stages, the stage, its step
count, the cap, the queue of shorter lengths re-measured before growing) and
:func:`decide_curriculum`, what to do before a batch when a curriculum sets the length.

A stage is entered only on a forecast that fits: while the next stage can be judged only by the
one-point bound, a shorter cut of the batch is measured first (a probe), so the stage gets a real
fit. Over the budget (:func:`over_in_curriculum`): the fastest setting the dry run says fits goes on
before the stage; without a dry run the next applicable rung, and shorter lengths are re-measured
with it before growing; else the curriculum is capped at the longest multiple of ``multiple_of`` that
the judgement says fits (below the current stage if the current stage itself is over).

Example:
    >>> from lightning_seqmem.core.curriculum import Curriculum
    >>> state = CurriculumState(Curriculum(start=64, target=256, steps_per_stage=2, multiple_of=16))
    >>> state.stages, state.seq_len, state.batch_at(4, 512, 256)
    ((64, 128, 256), 64, 4)
    >>> state.drop_past(200), state.stages
    ([256], (64, 128, 192))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Optional

from lightning_seqmem.core import advice as A
from lightning_seqmem.core.curriculum import Curriculum
from lightning_seqmem.plan import decisions as D
from lightning_seqmem.plan.decisions import Decision
from lightning_seqmem.plan.judging import Verdict

if TYPE_CHECKING:  # pragma: no cover
    from lightning_seqmem.plan.planner import SeqMemPlanner

__all__ = ["CurriculumState", "decide_curriculum", "over_in_curriculum", "probe_length"]

Applicability = Mapping[str, "tuple[bool, str]"]


class CurriculumState:
    """Where a curriculum stands (checkpointed): ``stages`` (its lengths, the last one the cap once
    capped), ``stage`` (the index running), ``stage_steps`` (batches run at it), ``capped_at``,
    ``refit_queue`` (lengths to run before the next decision), ``decide_now`` (judge the next stage
    at the next batch). Without a curriculum: no stages."""

    def __init__(self, curriculum: Optional[Curriculum]) -> None:
        self.curriculum = curriculum
        self.stages: tuple[int, ...] = curriculum.stages if curriculum else ()
        self.stage = 0
        self.stage_steps = 0
        self.capped_at: Optional[int] = None
        self.refit_queue: list[int] = []
        self.decide_now = False

    @property
    def seq_len(self) -> Optional[int]:
        """The curriculum's current stage length (None without a curriculum)."""
        return self.stages[self.stage] if self.stages else None

    def batch_at(self, batch_size: int, source_len: int, seq_len: int) -> int:
        """Samples per batch at ``seq_len``: ``truncate=False`` reshapes rows, keeping the tokens."""
        assert self.curriculum is not None
        if not self.curriculum.truncate and source_len > 0:
            return max(1, batch_size * source_len // seq_len)
        return batch_size

    def commit(self, decision: Decision) -> None:
        """Take the curriculum fields of ``decision``."""
        self.stages, self.stage = tuple(decision.stages), decision.stage
        self.refit_queue, self.decide_now = list(decision.refit_queue), decision.decide_now
        if decision.reset_stage_steps:
            self.stage_steps = 0
        if decision.action == "cap":
            self.capped_at = self.stages[-1]

    def resume_at(self, stages: tuple[int, ...], stage: int, capped_at: Optional[int], *, restart_stage: bool = False,
                  decide_now: bool = False) -> None:
        """Resume under a changed configuration (:func:`~lightning_seqmem.plan.checkpoint.reconcile`):
        ``stages`` with ``stage`` running and the cap ``capped_at``; ``restart_stage``: the length
        changed, so its step count and re-measurement queue start again; ``decide_now``: judge the
        next stage at the next batch (a cap lifted)."""
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


def probe_length(p: "SeqMemPlanner", batch_size: int) -> Optional[int]:
    """A length shorter than the current stage not yet fitted with these mitigations, or None."""
    assert p.curriculum is not None
    m = p.curriculum.multiple_of
    fitted = {r.seq_len for r in p.records if not r.warmup and r.mitigations == p.applied_mitigations
              and r.batch_size == batch_size}
    length = p.stages[p.stage] // 2
    while length >= m:
        candidate = p.curriculum.round_down(length)
        if candidate not in fitted and candidate < p.stages[p.stage]:
            return candidate
        length //= 2
    return None


def decide_curriculum(p: "SeqMemPlanner", source_len: int, source_batch: int, applicable: Applicability) -> Decision:
    """What to do before a batch of ``(source_batch, source_len)`` under a curriculum: the queued
    length, the next stage when due, else the current one; judged, and over the budget handed to
    :func:`over_in_curriculum` (or, judged by a one-point bound only, a probe first)."""
    assert p.curriculum is not None
    queue, advance = list(p.refit_queue), False
    if queue:
        seq_len = queue.pop(0)
    elif (p.decide_now or p.stage_steps >= p.curriculum.steps_per_stage) and p.stage + 1 < len(p.stages):
        seq_len, advance = p.stages[p.stage + 1], True
    else:
        seq_len = p.stages[p.stage]
    after_queue = bool(p.refit_queue) and not queue  # the last re-measurement: decide right after
    batch_size = p.batch_at(source_batch, source_len, seq_len)
    verdict = p.judge(seq_len, batch_size)
    go = D.decision(p, action="advance" if advance else "run", seq_len=seq_len, refit_queue=tuple(queue),
                    stage=p.stage + advance, decide_now=after_queue, reset_stage_steps=advance)
    if verdict.kind == "fits":
        return go
    if verdict.kind == "unknown":  # nothing fitted yet with these mitigations: hold the stage
        return go if not advance else D.decision(p, seq_len=p.stages[p.stage], decide_now=True)
    if advance and verdict.method in ("one-point bound", "previous setting") and not p.forecaster.ready:
        probe = probe_length(p, batch_size)
        if probe is not None:  # a real fit of this setting before judging the stage over
            steps = [probe] * (max(1, p.warmup_steps_after_change) + 1)
            return D.decision(p, action="probe", seq_len=probe, refit_queue=tuple(steps[1:]), decide_now=False)
    return over_in_curriculum(p, seq_len, batch_size, verdict, applicable,
                              lambda L: p.batch_at(source_batch, source_len, L))


def over_in_curriculum(p: "SeqMemPlanner", seq_len: int, batch_size: int, verdict: Verdict, applicable: Applicability,
                       batch_of: Optional[Callable[[int], int]] = None) -> Decision:
    """Over the budget at ``seq_len`` (the next stage, or the one running): rungs, or a cap. Every
    cap is the largest multiple of ``multiple_of`` that :func:`~lightning_seqmem.plan.judging.judge` (the dry run where it
    answers: the predictor that judged the stage) says fits, and the words name that length."""
    assert p.curriculum is not None and p.budget_bytes is not None and p.usable_budget_bytes is not None
    m, current = p.curriculum.multiple_of, p.stages[p.stage]
    rung, skipped = p.ladder.next_rung(applicable)
    plan = D.choose_setting(p, seq_len, batch_size, applicable)
    words = dict(seq_len=seq_len, peak=verdict.peak_bytes or 0, bound=verdict.bound_bytes or 0,
                 method=verdict.method, usable=p.usable_budget_bytes, budget=p.budget_bytes,
                 margin=p.safety_margin, fit=0, skipped=skipped, measured=verdict.measured,
                 applied=p.applied_mitigations)
    advance = seq_len > current and seq_len in p.stages
    held = p.evidence.held_bytes()
    if held > p.usable_budget_bytes:  # no rung lowers what a step begins with: stop rather than run over
        return D.decision(p, action="stop", seq_len=None, advice=(A.held_over_budget(
            held, p.usable_budget_bytes, p.budget_bytes, p.safety_margin, p.device_type),))
    low = current if seq_len > current else 1  # the next stage over: stay between the two

    def capped(cap: Optional[int]) -> int:
        words["fit"] = cap or 0  # the length that was checked; 0: "no length is forecast to fit"
        return cap if cap is not None else (current if seq_len > current else m)

    if plan is not None and plan.fits:  # the dry run says which rungs make it fit: on before the stage
        words["fit"] = D.dry_fit(p, 1, seq_len, batch_size, p.applied_mitigations, batch_of) or 0
        action = (f"Switching on {', '.join(map(repr, plan.rungs))} before it runs (dry run: it then fits; "
                  f"chosen as the fastest setting that fits: {plan.why})")
        return D.decision(p, action="mitigate", rungs=plan.rungs, seq_len=seq_len, refit_queue=(), decide_now=False,
                          stage=p.stages.index(seq_len) if advance else p.stage, reset_stage_steps=advance,
                          advice=(A.over_budget_stage(action=action, **words),))
    if plan is not None:  # nothing fits at this length even with every rung: all on, and the longest that fits
        setting = plan.setting
        cap = D.dry_fit(p, low, seq_len, batch_size, setting, batch_of)
        if cap is None and seq_len <= current:  # not even the shortest length fits with every rung
            every = p.judge(seq_len, batch_size, setting)
            return D.stop(p, seq_len, batch_size, every if every.bound_bytes else verdict, setting)
        cap = capped(cap)
        stages = tuple(s for s in p.stages[: p.stage + 1] if s < cap) + (cap,)
        action = (f"Switching on {', '.join(map(repr, plan.rungs))}; the curriculum stays at seq_len={cap}. "
                  f"To go further: {A.remaining_advice(setting, D.inapplicable(applicable), p.device_type)}")
        return D.decision(p, action="cap", rungs=plan.rungs, seq_len=cap, stages=stages, stage=len(stages) - 1,
                          refit_queue=(), decide_now=False, reset_stage_steps=cap != current,
                          advice=(A.over_budget_stage(action=action, **words),))
    if rung is not None:
        words["fit"] = D.dry_fit(p, 1, seq_len, batch_size, p.applied_mitigations, batch_of) or 0
        base = min(current, seq_len)
        lengths = sorted({p.curriculum.round_down(max(base // d, m)) for d in (4, 2, 1)})
        steps = max(1, p.warmup_steps_after_change) + 1  # warm-up, then one fitted step per length
        queue = [L for L in lengths for _ in range(steps)]
        action = (f"Switching on the next mitigation, {rung!r}, then re-measuring at seq_len {lengths} "
                  "before growing")
        return D.decision(p, action="mitigate", rungs=(rung,), seq_len=queue[0], refit_queue=tuple(queue[1:]),
                          decide_now=False, advice=(A.over_budget_stage(action=action, **words),))
    # no rung left: the longest length judged to fit (the next stage over: between the two; the
    # stage running now over: below it)
    found = D.dry_fit(p, low, seq_len, batch_size, p.applied_mitigations, batch_of)
    if found is None and seq_len <= current and (p.forecaster.ready or seq_len <= m):
        return D.stop(p, seq_len, batch_size, verdict, p.applied_mitigations)  # nothing fits: a fit says so,
    cap = capped(found)  # or the shortest ran over; else the shortest is measured first
    stages = tuple(s for s in p.stages[: p.stage + 1] if s < cap) + (cap,)
    action = (f"The curriculum stays at seq_len={cap}. To go further: "
              f"{A.remaining_advice(p.applied_mitigations, D.inapplicable(applicable), p.device_type)}")
    return D.decision(p, action="cap", seq_len=cap, stages=stages, stage=len(stages) - 1, refit_queue=(),
                      decide_now=False, reset_stage_steps=cap != current,
                      advice=(A.over_budget_stage(action=action, **words),))
