"""One frozen, checked ``SeqMemConfig``: the callback's arguments, read by the callback and its
planner from the same value; what the run binds at set-up is a second frozen value (``RunFacts``)
replaced whole by ``bind_run`` and seen by every part of the planner. Milliseconds, no Trainer."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from lightning_seqmem import Curriculum, SeqMemCallback
from lightning_seqmem.core.config import SeqMemConfig
from lightning_seqmem.plan.planner import SeqMemPlanner
from lightning_seqmem.plan.settings import Budget, PlannerSettings, RunFacts


def test_the_config_is_frozen_and_so_are_the_callbacks_arguments():
    config = SeqMemConfig(memory_budget="2KiB")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.warmup_steps = 5
    cb = SeqMemCallback(memory_budget="2KiB")
    for name in ("warmup_steps", "memory_budget_bytes", "curriculum", "dry_run", "probe_name",
                 "name"):
        with pytest.raises(AttributeError):
            setattr(cb, name, None)
    assert (cb.config == config and cb.config.warmup_steps == 2
            and cb.config.memory_budget_bytes == 2048)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(warmup_steps=0),
         "`warmup_steps` must be an int ≥ 1 (the first step has no optimizer state), got 0"),
        (dict(warmup_steps_after_change=-1),
         "`warmup_steps_after_change` must be an int ≥ 0, got -1"),
        (dict(trace_lengths=9), "`trace_lengths` must be an int in [2, 8], got 9"),
        (dict(measure_every_n_steps=0), "`measure_every_n_steps` must be an int ≥ 1, got 0"),
        (dict(tolerance="15%"), "`tolerance` must be a float in (0, 1), got '15%'"),
        (dict(safety_margin=1.0), "`safety_margin` must be a float in [0, 1), got 1.0"),
        (dict(probe="nvml"), "`probe` must be one of ('auto', 'cuda', 'tracker'), got 'nvml'"),
        (dict(curriculum={"start": 64}),
         "`curriculum` must be a lightning_seqmem.Curriculum or None, got dict"),
        (dict(seq_len_fn="input_ids"),
         "`seq_len_fn` must be a callable batch -> (batch_size, seq_len) or None, got 'input_ids'"),
        (dict(name=""), "`name` must be a non-empty string or None, got ''"),
        (dict(breakdown=1), "`breakdown` must be a bool, got 1"),
        (dict(dry_run="yes"), "`dry_run` must be a bool, got 'yes'"),
        (dict(summary=None), "`summary` must be a bool, got None"),
        (dict(mitigations=["nap"]), "`mitigations` must be a sequence of distinct names from ("),
        (dict(memory_budget="12 parsecs"), "`memory_budget` must be a positive number of bytes"),
        (dict(host_memory_budget="12 parsecs"),
         "`host_memory_budget` must be a positive number of bytes"),
    ],
)
def test_each_check_names_the_argument_the_value_and_what_is_accepted(kwargs, message):
    for build in (SeqMemConfig, SeqMemCallback):  # the callback's checks are the config's
        with pytest.raises(ValueError) as info:
            build(**kwargs)
        assert str(info.value).startswith(message)
        # the value itself, or for a curriculum that is not one, its type
        (value,) = kwargs.values()
        assert (repr(value) in str(info.value)
                or str(info.value).endswith(f"got {type(value).__name__}"))


def test_the_callbacks_signature_is_the_configs():
    """LightningCLI / jsonargparse read the callback's ``__init__``: the same names and defaults."""
    params = list(inspect.signature(SeqMemCallback.__init__).parameters.values())[1:]
    assert [(p.name, p.default) for p in params] == list(SeqMemConfig.defaults().items())


def test_the_callbacks_attributes_and_its_planner_read_its_config():
    curriculum = Curriculum(start=16, target=64)
    cb = SeqMemCallback(warmup_steps=3, tolerance=0.2, probe="tracker", memory_budget="1MiB",
                        safety_margin=0.25, curriculum=curriculum, trace_lengths=4,
                        measure_every_n_steps=2, mitigations=["checkpointing"], breakdown=True,
                        dry_run=False, name="a", summary=False)
    c = cb.config
    assert (cb.config.warmup_steps, cb.config.tolerance, cb.config.probe,
            cb.config.memory_budget_bytes, cb.config.safety_margin, cb.config.curriculum,
            cb.config.trace_lengths, cb.config.measure_every_n_steps, cb.configured_mitigations,
            cb.config.breakdown, cb.config.dry_run, cb.config.name, cb.config.summary) == (
        c.warmup_steps, c.tolerance, c.probe, c.memory_budget_bytes, c.safety_margin, c.curriculum,
        c.trace_lengths, c.measure_every_n_steps, c.mitigations, c.breakdown, c.dry_run, c.name,
        c.summary)
    assert c.memory_budget_bytes == 2**20 and c.mitigations == ("checkpointing",)
    p = cb.planner
    assert p.settings.config is c and p.settings.config is c  # one copy
    assert (p.settings.warmup_steps, p.settings.tolerance, p.settings.budget_bytes,
            p.settings.usable_budget_bytes, p.settings.curriculum, p.ladder.allowed) == (
        3, 0.2, 2**20, int(2**20 * 0.75), curriculum, ("checkpointing",))
    assert p.settings.dry_runner is None and cb.state_key == "SeqMemCallback{'name': 'a'}"


def test_bind_run_replaces_the_facts_and_every_part_sees_them():
    p = SeqMemPlanner(safety_margin=0.1)
    before = p.settings.run_facts
    assert (p.evidence.settings.usable_budget_bytes is None
            and p.settings.budget == Budget(None, 0.1))
    p.bind_run(budget_bytes=10_000, compare_reserved=True, block_bytes=512)
    # replaced, not patched
    assert before.budget_bytes is None and p.settings.run_facts is not before
    assert p.evidence.settings is p.settings  # shared by reference
    assert p.evidence.settings.usable_budget_bytes == p.settings.usable_budget_bytes == 9000
    assert (p.evidence.settings.compare_reserved
            and p.settings.budget == Budget(10_000, 0.1, True, 512))
    p.bind_run(length_limit=300, length_limit_reason="config.n_positions=300")
    assert p.settings.run_facts.length_limit == 300 and not p.evidence.settings.within_limit(301)
    with pytest.raises(TypeError, match="`bind_run` got `safety_margin`: pass only budget_bytes, "):
        p.bind_run(safety_margin=0.5)
    assert p.settings.safety_margin == 0.1


def test_writes_through_the_planner_raise_or_bind():
    # the planner's keywords: unchecked, as before
    p = SeqMemPlanner(warmup_steps=0, memory_budget_bytes=1000)
    for part in (p, p.settings, p.evidence):
        with pytest.raises(AttributeError, match="bind_run"):
            part.tolerance = 0.5
    with pytest.raises(AttributeError, match=r"bind_run\(block_bytes=...\)"):
        p.settings.block_bytes = 512
    assert p.settings.tolerance == 0.15 and p.settings.block_bytes == 1
    # a run fact: a bind
    p.bind_run(dry_runner=(fake := lambda L, B, m: (L * B, {"forward": L * B})))
    assert p.settings.run_facts.dry_runner is fake and p.evidence.settings.dry_runner is fake


def test_a_planner_takes_a_config_or_its_keywords_not_both():
    config = SeqMemConfig(memory_budget=4096, warmup_steps=3)
    p = SeqMemPlanner(config=config, compare_reserved=True)
    assert (p.settings.config is config and (p.settings.budget_bytes, p.settings.warmup_steps,
                                             p.settings.compare_reserved) == (4096, 3, True))
    with pytest.raises(TypeError,
                       match="`SeqMemPlanner` got `config` and `memory_budget_bytes=10`"):
        SeqMemPlanner(config=config, memory_budget_bytes=10)
    s = PlannerSettings(budget_bytes=1000, dry_runner=None, trace_lengths=4)
    assert (s.config.memory_budget_bytes, s.budget_bytes, s.trace_lengths) == (1000, 1000, 4)
    assert s.run_facts == RunFacts.of(s.config)


def test_a_compiled_module_under_the_tracker_binds_a_slower_measurement_rate_not_a_new_config():
    import torch

    from lightning_seqmem.measure.probes import make_probe
    from lightning_seqmem.trainer.fit_cycle import COMPILED_MEASURE_EVERY_N_STEPS

    cb = SeqMemCallback(measure_every_n_steps=3)
    config, cb.edge.probe = cb.config, make_probe("tracker", torch.device("cpu"))
    with pytest.warns(UserWarning, match="torch.compile"):
        cb._fit.check_compiled(torch.nn.Sequential(torch.compile(torch.nn.Linear(2, 2))))
    assert (cb.planner.settings.measure_every_n_steps
            == cb.planner.settings.run_facts.measure_every_n_steps
            == COMPILED_MEASURE_EVERY_N_STEPS)
    # the argument stays what was given
    assert cb.config is config and cb.config.measure_every_n_steps == 3
    # the next fit, of an eager module: the rate given
    cb._fit.check_compiled(torch.nn.Linear(2, 2))
    assert cb.planner.settings.measure_every_n_steps == 3


def test_the_dry_run_callable_is_dry_runner_and_a_callable_dry_run_says_so():
    def fake(L, B, m):
        return L * B, {"forward": L * B}

    with pytest.raises(TypeError, match=r"`dry_run` is the callback's bool .* pass the dry run "
                       r"itself as `dry_runner`"):
        PlannerSettings(dry_run=fake)
    with pytest.raises(TypeError, match="dry_run"):
        SeqMemPlanner(dry_run=fake)
    settings = PlannerSettings(dry_runner=fake, dry_run=False)
    assert settings.dry_runner is fake and settings.config.dry_run is False
