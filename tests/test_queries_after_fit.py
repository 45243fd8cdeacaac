"""Queries after fit answer from what is known (issue 21): a rung that went on at the last steps,
with one length measured after it, left ``max_seq_len()`` raising ``NotEnoughMeasurements``."""

from __future__ import annotations

from test_planner import ALL, peak, planner, step


def test_max_seq_len_answers_after_a_rung_at_the_last_steps():
    budget = peak(300, 4)
    p = planner(budget, mitigations=("attention",))
    for L in (64, 64, 128, 128, 192, 192):
        step(p, (4, L), ALL)
    d, r = step(p, (4, 512), ALL)  # forecast over: attention goes on, one length measured after it
    assert r.mitigations == ("attention",) and not p.evidence.forecaster.ready
    answer = p.evidence.max_seq_len()  # raised NotEnoughMeasurements
    # the setting before the rung bounds this one (a mitigation never adds memory)
    assert answer == p.evidence.measured.forecasters[()].max_seq_len(
        p.settings.usable_budget_bytes, 4) > 0
    assert peak(answer, 4) <= budget


def test_a_step_is_verified_against_the_forecast_for_the_shape_that_ran():
    """Data shorter than the stage (40 tokens under a 64 stage): a step that ran at 40 was verified
    against the forecast made for 64 (a large "miss"). Now each verification is of its own shape."""
    import warnings

    import torch

    from conftest import make_trainer
    from lightning_seqmem import Curriculum, SeqMemCallback
    from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule

    cb = SeqMemCallback(warmup_steps=1, curriculum=Curriculum(start=16, target=128,
                                                              steps_per_stage=2, multiple_of=16))
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([cb], max_steps=8).fit(
            LitGPT(n_layer=1, d_model=32, n_head=2),
            SyntheticTokenDataModule(batch_size=2, seq_len=40, num_samples=64))
    assert 40 in [r.seq_len for r in cb.records]
    verified = [r for r in cb.records if r.forecast_error is not None]
    assert verified and all(abs(r.forecast_error) <= cb.config.tolerance for r in verified), \
        [(r.seq_len, r.forecast_error) for r in verified]
    assert not [w for w in caught if "not trusted" in str(w.message)
                or "forecast for" in str(w.message)]
