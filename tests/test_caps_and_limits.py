"""Caps and the words about them come from the judgement that found a stage over (the dry run where
it answers), in multiples of the curriculum's ``multiple_of``; a model's own length limit (its
positions) bounds every dry run and search; the OOM diagnosis names the forecast that was used.

Real runs on the CPU tracker: a sliding-window Mistral whose replay under-predicts past the window,
an SDPA GPT whose every length is over the budget with only micro-batching allowed, a BERT with 256
positions under a curriculum that reaches 1024.
"""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch

from conftest import make_trainer
from lightning_seqmem import Curriculum, MemoryBudgetError, SeqMemCallback
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule

FITS = re.compile(r"The largest length forecast to fit is (\d+)\.")


def _fit(cb, module, max_steps, seq_len, batch_size=2, **trainer):
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([cb], max_steps=max_steps, **trainer).fit(
            module, SyntheticTokenDataModule(batch_size=batch_size, seq_len=seq_len,
                                             num_samples=64))
    return [str(w.message) for w in caught if str(w.message).startswith("seqmem:")]


def test_a_sliding_window_cap_is_the_dry_runs_and_every_step_stays_in_budget():
    pytest.importorskip("transformers")
    from lightning_seqmem.reference.hf import HFCausalLM

    # traced at 64 and 256, inside the 512-token window: the replay under-predicts past it (before:
    # the cap came from it, and steps ran at 704 and 640 tokens over the usable budget)
    config = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
              "sliding_window": 512, "max_position_embeddings": 4096}
    m = 64
    cb = SeqMemCallback(warmup_steps=1, memory_budget=24_500_000, mitigations=(),
                        curriculum=Curriculum(start=64, target=1024, growth=4, steps_per_stage=2,
                                              multiple_of=m))
    messages = _fit(cb, HFCausalLM(model_type="mistral", config=config, attn_implementation="sdpa"),
                    9, 1024)
    # the scenario: the replay under-predicts
    assert cb.planner.evidence.measured.replay_checks[()]["relative_error"] < -cb.config.tolerance
    usable = cb.usable_budget_bytes
    assert len(cb.records) == 9  # every step measured, warm-ups included
    over = [(r.step, r.seq_len, r.peak_bytes) for r in cb.records if r.peak_bytes > usable]
    assert over == [], over
    assert all(r.seq_len % m == 0 for r in cb.records), [r.seq_len for r in cb.records]
    (said,) = [w for w in messages if "over the usable budget" in w]
    cap = int(re.search(r"stays at seq_len=(\d+)", said).group(1))
    assert (FITS.search(said)
            and int(FITS.search(said).group(1)) == cap == cb.planner.course.capped_at)
    # the length named was checked...
    assert cap % m == 0 and cb.planner.evidence.judge(cap, 2).kind == "fits"
    assert cb.planner.evidence.judge(cap + m, 2).kind == "over"  # ...and is the largest that fits
    # by the predictor that judged the stage
    assert cb.planner.evidence.forecast(cap + m, 2).method == "dry_run"
    assert "switch attention" not in said  # attention is on SDPA already


def test_nothing_fits_with_only_micro_batching_on_sdpa_is_said_so():
    # every length is over the budget, even micro-batched: one clear error stops the run, its words
    # true (not "the largest length forecast to fit is 64", nor SDPA advice on an SDPA model)
    cb = SeqMemCallback(warmup_steps=1, memory_budget=600_000, safety_margin=0.0,
                        mitigations=("microbatch",),
                        curriculum=Curriculum(start=64, target=256, steps_per_stage=2,
                                              multiple_of=64))
    with pytest.raises(MemoryBudgetError) as err:
        _fit(cb, LitGPT(n_layer=1, d_model=32, n_head=2, attention="sdpa"), 5, 256, batch_size=4)
    words = str(err.value)
    # the scenario: 64 tokens do not fit, micro-batched
    assert cb.planner.evidence.judge(64, 4).kind == "over"
    assert ("no length from 64 tokens up is forecast to fit" in words
            and not FITS.search(words)), words
    assert "'microbatch' on" in words and "attention" not in words, words
    assert not cb.records  # stopped before the first step: no step ran, none over the budget


def test_a_model_s_position_limit_bounds_every_dry_run_and_the_dry_run_stays_on(tmp_path):
    pytest.importorskip("transformers")
    from lightning_seqmem.reference.hf import HFCausalLM

    limit = 256
    bert = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": limit, "is_decoder": True}
    cb = SeqMemCallback(warmup_steps=1, memory_budget=5_000_000, mitigations=(),
                        curriculum=Curriculum(start=64, target=1024, steps_per_stage=2,
                                              multiple_of=64))
    messages = _fit(cb, HFCausalLM(model_type="bert", config=bert, attn_implementation="sdpa"), 7,
                    limit, default_root_dir=tmp_path)
    dry = cb.planner.settings.dry_runner
    # before: a dry run at 4096 turned it off for the run
    assert dry is not None and dry.unsupported is None
    assert not [w for w in messages if "cannot simulate" in w]
    asked = sorted({key[0] for key in cb.planner.evidence.dry.answers})
    assert asked and max(asked) <= limit, asked  # no length past the limit was dry-run
    assert max(cb.planner.course.stages) <= limit and max(r.seq_len for r in cb.records) <= limit
    assert [w for w in messages
            if "past this model's limit of 256 tokens (config.max_position_embeddings=256)" in w]
    # the budget bound: a cap within the limit
    assert any("over the usable budget" in w for w in messages)
    assert cb.forecast(limit).method == "dry_run"
    assert cb.max_seq_len() <= limit
    forecasts = json.loads((tmp_path / "seqmem_report.json").read_text())["forecasts"]
    assert forecasts["error"] is None and max(row["seq_len"] for row in forecasts["at"]) <= limit
    # the report and figure too
    assert not [w for w in messages if "could not write" in w or "failed" in w]
    with pytest.raises(ValueError, match=r"`seq_len`=512 is past this model's limit of 256 tokens"):
        cb.forecast(512)


class _OOMAtStep(LitGPT):
    def __init__(self, fail_at, **kwargs):
        super().__init__(**kwargs)
        self.fail_at = fail_at

    def training_step(self, batch, batch_idx):
        if self.global_step == self.fail_at:
            raise torch.cuda.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 20.00 GiB (injected)")
        return super().training_step(batch, batch_idx)


def test_the_oom_diagnosis_names_the_dry_run_it_used(tmp_path):
    # at step 2 one length is measured (no fit yet) but dry runs judged every batch: before, the
    # diagnosis said "no forecast existed" and gave no forecast for the failing batch
    cb = SeqMemCallback(warmup_steps=1, memory_budget="1GiB", curriculum=Curriculum(
        start=16, target=64, steps_per_stage=2, multiple_of=16))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _fit(cb, _OOMAtStep(2, n_layer=1, d_model=32, n_head=2), 6, 64, default_root_dir=tmp_path)
    diagnosis = json.loads((tmp_path / "seqmem_oom_diagnosis.json").read_text())
    assert diagnosis["failing_batch"] == {"seq_len": 32, "batch_size": 2}
    assert (diagnosis["forecast_used"] == "dry run"
            and diagnosis["forecast_for_failing_batch"]["method"] == "dry_run")
    assert "no forecast existed" not in diagnosis["would_have_done"], diagnosis["would_have_done"]


def test_planner_caps_at_what_its_dry_run_says_fits_past_a_window():
    """The unit twin of the sliding-window run (milliseconds): a synthetic step whose memory jumps
    past a 512-token window, the dry run exact, no rung; every step within the usable budget."""
    from lightning_seqmem.plan.planner import SeqMemPlanner
    from lightning_seqmem.core.records import StepMemory
    from lightning_seqmem.core.rungs import MITIGATIONS

    def peak(L, B):  # a mask materialised past the window: the short lengths cannot show it
        return 1_000_000 + B * (3000 * L + (40 * L * L if L > 512 else 0))

    p = SeqMemPlanner(curriculum=Curriculum(start=64, target=1024, growth=4, steps_per_stage=2,
                                            multiple_of=64),
                      memory_budget_bytes=11_000_000, warmup_steps=1, mitigations=(),
                      dry_runner=lambda L, B, m: (peak(L, B), {"forward": peak(L, B)}))
    p.bind_run(length_limit=900, length_limit_reason="config.n_positions=900")
    no_rung = {name: (False, "not allowed") for name in MITIGATIONS}
    for step in range(10):
        d = p.decide((2, 1024), no_rung)
        p.commit(d)
        s = p.begin_step(d.seq_len, 2, optimizer_steps=True, global_step=step)
        _ = p.observe(s, StepMemory(peak(s.seq_len, 2), {"forward": peak(s.seq_len, 2)}, 1_000_000,
                                    1_000_000))
        p.course.end_batch()
    assert max(r.peak_bytes for r in p.evidence.measured.records) <= p.settings.usable_budget_bytes
    assert all(r.seq_len % 64 == 0 and r.seq_len <= 900 for r in p.evidence.measured.records)
    assert all(key[0] <= 900 for key in p.evidence.dry.answers)  # never dry-run past the limit
    (words,) = [a.text for a in p.advice.take_advice() if a.kind == "stage_over_budget"]
    cap = p.course.capped_at
    assert (f"The largest length forecast to fit is {cap}." in words
            and f"stays at seq_len={cap}" in words)
    assert p.evidence.judge(cap, 2).kind == "fits" and p.evidence.judge(cap + 64, 2).kind == "over"
