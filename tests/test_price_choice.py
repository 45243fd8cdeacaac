"""The choice of a setting by price: the fastest setting that fits (plan/choose.py,
plan/pricing.py).

Millisecond planner twins (as tests/test_planner_twins.py: a synthetic step peak per setting and a
dry run that answers it exactly), two toy rungs with different priors registered as in
tests/test_rung_protocol.py's fifth-rung fixture, and one Trainer run on the reference GPT where the
cheaper rung is chosen over a dearer one that also fits, with real measurement.
"""

from __future__ import annotations

import itertools
import re
import warnings

import pytest

from conftest import planner_batches
from lightning_seqmem.core.curriculum import Curriculum
from lightning_seqmem.core.records import StepMemory, StepRecord
from lightning_seqmem.core.rung_spec import RungSpec
from lightning_seqmem.core.rungs import base_name, level_of, register_spec, unregister_spec
from lightning_seqmem.plan import choose as C
from lightning_seqmem.plan.decisions import Decider
from lightning_seqmem.plan.planner import SeqMemPlanner
from lightning_seqmem.plan.pricing import predict_step, prior_factor

STATIC = 1_000_000
# bytes per sample per token of each rung's part of the step (a rung removes its part): the plain
# step holds all three; "dear" (prior 0.4) removes the most, "cheap" (prior 0.05) a little less
PARTS = {"dear": 2600, "cheap": 2000, "rest": 1000}


@pytest.fixture
def toy_rungs():
    register_spec(RungSpec("dear", "switch the dear rung on", 0.4))
    register_spec(RungSpec("cheap", "switch the cheap rung on", 0.05))
    yield
    unregister_spec("dear")
    unregister_spec("cheap")


def toy_peak(L, B, setting):
    kept = sum(v for k, v in PARTS.items() if k not in {base_name(n) for n in setting})
    return STATIC + B * L * kept


def twin(budget, mitigations, peak_fn, curriculum=None):
    def dry_run(L, B, setting):
        value = peak_fn(L, B, setting)
        return value, {"forward": value}
    return SeqMemPlanner(memory_budget_bytes=budget, safety_margin=0.0, curriculum=curriculum,
                         warmup_steps=1, mitigations=mitigations, dry_runner=dry_run)


def run(p, shape, n, applicable, peak_fn, seconds_fn=lambda L, B, s: None):
    """``n`` batches as the callback runs them: decide, commit, switch on every rung of the
    decision."""
    def switch_on(p, d, L, B):
        for name in d.rungs:
            p.on_rung("on", name, "applied", L, B)

    return planner_batches(p, shape, n, applicable, peak_fn, STATIC, switch_on, seconds_fn)


def test_the_cheaper_rung_that_fits_is_chosen_not_the_first_in_ladder_order(toy_rungs):
    L, B = 256, 2
    # cheap alone fits (dear alone too), with the dry run's 2% margin
    budget = int(toy_peak(L, B, ("cheap",)) * 1.03)
    assert toy_peak(L, B, ("dear",)) <= budget < toy_peak(L, B, ())
    p = twin(budget, ("dear", "cheap"), toy_peak)  # the old prefix order would take "dear" first
    ok = {"dear": (True, ""), "cheap": (True, "")}
    out = run(p, (B, L), 4, ok, toy_peak)
    assert p.ladder.applied == ("cheap",) and out[0][0].rungs == ("cheap",)
    assert max(r.peak_bytes for _, r in out) <= budget
    words = [a.text for a in p.advice.take_advice() if a.kind == "batch_over_budget"]
    assert len(words) == 1 and "Chosen as the fastest setting that fits: cheap: fits" in words[0]
    assert "+5% step time" in words[0] and "dear would cost +40%" in words[0]


def test_the_planner_prices_with_the_rung_specs_bound_to_it_not_the_registry(toy_rungs):
    """The rungs' specs are the planner's data (``bind_run(rung_specs=...)``): priors bound to it (a
    machine's own measured priors) change its choice; the registry changed after it was built does
    not."""
    from dataclasses import replace

    from lightning_seqmem.core.rungs import rung_specs

    L, B = 256, 2
    budget = int(toy_peak(L, B, ("cheap",)) * 1.03)  # cheap alone fits, dear alone too
    ok = {"dear": (True, ""), "cheap": (True, "")}
    own = twin(budget, ("dear", "cheap"), toy_peak)
    specs = rung_specs()
    own.bind_run(rung_specs={**specs, "cheap": replace(specs["cheap"], step_time_prior=0.9)})
    registry_later = twin(budget, ("dear", "cheap"), toy_peak)
    # after it was built: not its data
    register_spec(RungSpec("cheap", "switch the cheap rung on", 0.9))
    try:
        run(own, (B, L), 3, ok, toy_peak)
        run(registry_later, (B, L), 3, ok, toy_peak)
    finally:
        register_spec(RungSpec("cheap", "switch the cheap rung on", 0.05))
    assert own.ladder.applied == ("dear",)  # dear (+40%) is now the cheaper of the two that fit
    assert registry_later.ladder.applied == ("cheap",)  # the specs it was handed: cheap at +5%
    assert prior_factor(("cheap",)) == prior_factor(
        ("cheap",), specs=registry_later.settings.rung_specs) == 1.05


def test_without_a_cheap_fit_the_dear_rung_is_chosen(toy_rungs):
    L, B = 256, 2
    budget = int(toy_peak(L, B, ("dear",)) * 1.03)  # only dear (or both) fits: cheap alone is over
    assert toy_peak(L, B, ("cheap",)) > budget
    p = twin(budget, ("cheap", "dear"), toy_peak)
    out = run(p, (B, L), 3, {"dear": (True, ""), "cheap": (True, "")}, toy_peak)
    assert p.ladder.applied == ("dear",) and max(r.peak_bytes for _, r in out) <= budget


def _brute_force(on, allowed, applicable, fits, price):
    fitting = [s for s in C.candidates(on, allowed, applicable) if fits(s)]
    return min((price(s) for s in fitting), default=None)


@pytest.mark.parametrize("budget_tokens", [900, 1500, 2100, 2700, 3300, 3900, 5000])
def test_the_choice_is_the_least_cost_fitting_setting_and_dominated_settings_are_never_judged(
    budget_tokens, toy_rungs):
    """Every setting of three rungs with levels, against an exhaustive search."""
    register_spec(RungSpec("lvl", "switch lvl on", 0.3))
    try:
        # per token; "lvl:k/4" saves k/4 of its part
        saves = {"dear": 1600, "cheap": 700, "lvl": 2400}

        def saved(name):
            level = level_of(name)
            return saves[base_name(name)] * (int(level.split("/")[0]) / 4 if level else 1)

        mem = lambda s: 6000 - sum(saved(n) for n in s)  # noqa: E731
        judged = []

        def judge(s):
            judged.append(s)
            return "fits" if mem(s) <= budget_tokens else "over"

        applicable = {"dear": (True, ""), "cheap": (True, ""), "lvl": (True, ""),
                      **{f"lvl:{k}/4": (True, "") for k in (1, 2, 3)}}
        allowed = ("lvl", "dear", "cheap")
        choice = C.choose((), allowed, applicable, judge, prior_factor, max_judgements=100)
        best = _brute_force((), allowed, applicable, lambda s: mem(s) <= budget_tokens,
                            prior_factor)
        if best is None:
            assert choice is not None and not choice.fits
        else:
            assert choice.fits and abs(prior_factor(choice.setting) - best) < 1e-12
            assert mem(choice.setting) <= budget_tokens
        overs = [s for s in judged if mem(s) > budget_tokens]
        # nothing judged after a setting judged over that dominates it
        for i, s in enumerate(judged):
            assert not any(C.dominated(s, o) for o in overs if judged.index(o) < i), (s, judged)
        assert len(judged) == len(set(judged))
    finally:
        unregister_spec("lvl")


def test_the_judgement_cap_falls_back_to_the_ladder_order_and_says_so(toy_rungs):
    judged = []

    def judge(s):
        judged.append(s)
        return "fits" if set(s) == {"dear", "cheap"} else "over"

    choice = C.choose((), ("dear", "cheap"), {"dear": (True, ""), "cheap": (True, "")}, judge,
                      prior_factor, max_judgements=1)
    assert choice.fell_back and choice.fits and choice.setting == ("dear", "cheap")
    assert judged[0] == ("cheap",) and "the ladder order chose" in choice.why


def test_an_upgrade_replaces_the_entry_of_its_rung():
    """Checkpointing k of 4 blocks removes k/4 of the checkpointable part: the curriculum switches
    on the least that fits each stage, and a longer stage upgrades the entry (never a second
    one)."""
    part = 2400

    def peak_fn(L, B, setting):
        level = next((level_of(n) or "4/4" for n in setting if base_name(n) == "checkpointing"),
                     "0/4")
        k = int(level.split("/")[0])
        return STATIC + B * L * (600 + part * (4 - k) / 4)

    # at 512 tokens: 3 of 4 blocks (1200) fits, 2 of 4 (1800) does not
    budget = STATIC + 2 * 512 * 1500
    applicable = {"checkpointing": (True, ""),
                  **{f"checkpointing:{k}/4": (True, "") for k in (1, 2, 3)}}
    p = twin(budget, ("checkpointing",), peak_fn,
             Curriculum(start=128, target=512, steps_per_stage=2, multiple_of=16))
    out = run(p, (2, 512), 10, applicable, peak_fn)
    switched = [n for d, _ in out for n in d.rungs]
    lengths = [r.seq_len for _, r in out]
    assert lengths[-1] == 512 and lengths == sorted(lengths)
    assert max(r.peak_bytes for _, r in out) <= budget
    # upgraded at least once
    assert len(switched) >= 2 and all(base_name(n) == "checkpointing" for n in switched)
    # one entry: the least level that fits the target
    assert p.ladder.applied == ("checkpointing:3/4",)
    levels = [int(level_of(n).split("/")[0]) for n in switched]
    assert levels == sorted(levels) and len(set(levels)) == len(levels)  # upgrades only go up


def test_pricing_prefers_measured_step_times_over_priors():
    def rec(i, setting, seconds, L=128, B=2):
        return StepRecord(i, i, 0, L, B, False, False, 1, None, None, None, 0, mitigations=setting,
                          step_seconds=seconds)

    records = [rec(0, (), 0.2), rec(1, (), 0.2), rec(2, ("checkpointing",), 0.5)]
    measured = predict_step(records, ("checkpointing",), 256, 2)
    # 0.5 s at half the tokens
    assert measured.method == "measured" and measured.seconds == pytest.approx(1.0)
    # not run: the plain setting scaled by its prior (0)
    scaled = predict_step(records, ("attention",), 128, 2)
    assert (scaled.method == "nearest setting" and scaled.basis == ()
            and scaled.seconds == pytest.approx(0.2))
    # nearest: checkpointing, ×1.43/1.33
    both = predict_step(records, ("checkpointing", "microbatch"), 128, 2)
    assert both.basis == ("checkpointing",) and both.seconds == pytest.approx(0.5 * 1.43 / 1.33)
    warm = [StepRecord(0, 0, 0, 128, 2, True, False, 1, None, None, None, 0, step_seconds=9.0)]
    assert predict_step(warm, (), 128, 2).method == "priors"  # warm-ups are not priced


def test_measured_step_times_change_the_choice(toy_rungs):
    """Priors say cheap (+5%) before dear (+40%); measured steps that say cheap is slow reverse
    it."""
    L, B = 256, 2
    budget = int(toy_peak(L, B, ("cheap",)) * 1.03)
    p = twin(budget, ("dear", "cheap"), toy_peak)
    for i, (setting, seconds) in enumerate([((), 0.1), ((), 0.1), (("cheap",), 0.3)]):
        p.evidence.measured.records.append(StepRecord(i, i, 0, 128, B, False, False,
                                                      toy_peak(128, B, setting), None, None, None,
                                    STATIC, mitigations=setting, step_seconds=seconds))
    # 0.3 measured vs 0.1 × 1.4
    assert p.evidence.price(("cheap",), L, B).seconds > p.evidence.price(("dear",), L, B).seconds
    choice = Decider(p.settings, p.evidence, p.ladder,
                     p.course).choose_setting(L, B, {"dear": (True, ""), "cheap": (True, "")})
    assert choice is not None and choice.setting == ("dear",) and choice.fits


def test_step_seconds_survive_a_checkpoint_and_old_records_load_without_them():
    p = SeqMemPlanner(warmup_steps=0)
    s = p.begin_step(64, 2, True)
    p.observe(s, StepMemory(100, {"forward": 100}, 10, 10), step_seconds=0.25)
    p.course.end_batch()
    q = SeqMemPlanner(warmup_steps=0)
    q.load_state_dict(p.state_dict())
    assert q.evidence.measured.records[0].step_seconds == 0.25
    old = p.state_dict()
    for r in old["records"]:
        r.pop("step_seconds")
    q.load_state_dict(old)
    assert q.evidence.measured.records[0].step_seconds is None


def test_a_variant_setting_survives_a_checkpoint():
    p = SeqMemPlanner()
    p.on_rung("on", "checkpointing:2/4", "applied", 64, 2)
    p.on_rung("on", "checkpointing", "upgraded", 128, 2)
    assert p.ladder.applied == ("checkpointing",)
    p.ladder.applied = ("attention", "checkpointing:2/4")
    q = SeqMemPlanner()
    q.load_state_dict(p.state_dict())
    assert q.ladder.applied == ("attention", "checkpointing:2/4")


def test_candidates_hold_one_entry_per_rung_and_only_upgrades():
    applicable = {"checkpointing": (True, ""), "checkpointing:1/4": (True, ""),
                  "checkpointing:3/4": (True, ""),
                  "checkpointing:selective": (True, ""), "microbatch": (True, "")}
    sets = C.candidates(("checkpointing:1/4",), ("checkpointing", "microbatch"), applicable)
    assert all(len({base_name(n) for n in s}) == len(s) for s in sets)
    # not comparable with 1/4: not an upgrade
    assert not any("checkpointing:selective" in s for s in sets)
    assert {s[0] for s in sets} == {"checkpointing:1/4", "checkpointing:3/4", "checkpointing"}
    assert len(sets) == len(set(sets)) == 5 and ("checkpointing:1/4",) not in sets
    assert all(s for s in itertools.chain(sets))


# -- one Trainer run on the reference GPT: the cheaper rung is chosen over a dearer one that also
# fits --
GPT = dict(n_layer=2, d_model=64, n_head=4, vocab_size=64, attention="eager")
LENGTH, BATCH = 256, 4


def _measured(names):
    """The measured peak and seconds per token of real steps at (LENGTH, BATCH) with ``names``
    on."""
    import lightning.pytorch as pl
    import torch

    from conftest import make_trainer
    from lightning_seqmem import SeqMemCallback
    from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
    from lightning_seqmem.mitigations import ladder

    class SwitchOn(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            for name in names:
                assert ladder.apply(name, trainer, pl_module).applied

    cb = SeqMemCallback(warmup_steps=1, mitigations=(), dry_run=False, summary=False)
    torch.manual_seed(0)
    make_trainer([SwitchOn(), cb], max_steps=2).fit(
        LitGPT(**GPT),
        SyntheticTokenDataModule(batch_size=BATCH, seq_len=LENGTH, num_samples=16, vocab_size=64))
    fitted = [r for r in cb.records if not r.warmup]
    return (max(r.peak_bytes for r in cb.records),
            min(r.step_seconds for r in fitted) / (LENGTH * BATCH))


def test_a_real_run_switches_on_the_cheaper_of_two_rungs_that_fit():
    """Checkpointing (prior +33%) comes first in the ladder, the attention switch (eager -> SDPA,
    +0%) second; at a budget both fit under (each measured), the old prefix order took
    checkpointing; the fastest that fits is the attention switch, on before the first step, no
    measured step over budget."""
    import torch

    from conftest import make_trainer
    from lightning_seqmem import PredictedOOMWarning, SeqMemCallback
    from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
    from lightning_seqmem.mitigations.checkpointing.checkpointing import is_checkpointed

    ckpt, _ = _measured(("checkpointing",))
    sdpa, _ = _measured(("attention",))
    budget = int(max(ckpt, sdpa) * 1.06)  # both fit with the dry run's margin
    cb = SeqMemCallback(warmup_steps=1, memory_budget=budget, safety_margin=0.0, summary=False,
                        mitigations=("checkpointing", "attention"))
    torch.manual_seed(0)
    module = LitGPT(**GPT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([cb], max_steps=3).fit(
            module, SyntheticTokenDataModule(batch_size=BATCH, seq_len=LENGTH, num_samples=16,
                                             vocab_size=64))
    assert cb.mitigation_events[0]["before_bytes"] > budget  # the plain step (dry run) does not fit
    assert cb.applied_mitigations == ("attention",) and module.attention_backend == "sdpa"
    assert not is_checkpointed(module)
    assert all(r.mitigations == ("attention",) for r in cb.records)  # on before the first step
    assert max(r.peak_bytes for r in cb.records) <= budget
    assert all(r.step_seconds and r.step_seconds > 0 for r in cb.records if not r.warmup)
    words = " ".join(str(w.message) for w in caught if issubclass(w.category, PredictedOOMWarning))
    assert ("Chosen as the fastest setting that fits: attention: fits" in words
            and "+0% step time" in words)
    # the dearer rung that also fits
    assert re.search(r"checkpointing[^;]* would cost \+\d+%", words), words


def test_a_rung_priced_per_device_type_is_chosen_where_it_is_cheap():
    """The fused loss runs an eager tiled fallback on CPU (+60% measured,
    benchmarks/longest_length.py) but a fused kernel on CUDA (+5%): with both it and checkpointing
    fitting, the choice on CPU is checkpointing, on CUDA the fused loss."""
    from lightning_seqmem.plan.pricing import predict_step

    import lightning_seqmem.mitigations.ladder  # noqa: F401 - registers the built-in rungs' specs

    fits = lambda s: "fits" if s else "over"  # noqa: E731 - either rung alone fits
    applicable = {"checkpointing": (True, ""), "fused_loss": (True, "")}
    chosen = {}
    for device_type in ("cpu", "cuda"):
        c = C.choose((), ("checkpointing", "fused_loss"), applicable, fits,
                     lambda s, d=device_type: predict_step([], s, 256, 2, d).key)
        chosen[device_type] = c.setting
    assert chosen == {"cpu": ("checkpointing",), "cuda": ("fused_loss",)}
