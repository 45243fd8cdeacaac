"""Timeline replay against real measurements of the same model at longer lengths."""

from __future__ import annotations

import pytest
import torch

from lightning_seqmem import MemoryForecaster, TimelineModel, Trace
from lightning_seqmem.mitigations.checkpointing.checkpointing import ActivationCheckpointing
from lightning_seqmem.reference.nn import GPT, GPTConfig
from lightning_seqmem.measure.probes import TrackerProbe
from test_probes import VARIANTS, _step


def _traced_model(attention, checkpointing, n_layer=2, d_model=64):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=n_layer, d_model=d_model, n_head=4, attention=attention))
    if checkpointing:
        ActivationCheckpointing().apply(model)
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        _step(model, optimizer, torch.randint(0, 256, (2, 16)))

    def measure(seq_len, batch_size=2):
        m = _step(model, optimizer, torch.randint(0, 256, (batch_size, seq_len)),
                  TrackerProbe("cpu"))
        return Trace(seq_len, batch_size, m.events, measured_peak_bytes=m.peak_bytes), m

    return measure


@pytest.mark.parametrize("attention,checkpointing", VARIANTS)
def test_replay_of_three_short_lengths_predicts_8x_and_16x(attention, checkpointing):
    measure = _traced_model(attention, checkpointing)
    traces = [measure(L)[0] for L in (16, 32, 64)]
    model, reason = TimelineModel.from_traces(traces)
    assert model is not None, reason
    for seq_len in (128, 256):
        _, measured = measure(seq_len)
        predicted = model.predict(seq_len)
        assert abs(predicted.peak_bytes - measured.peak_bytes) <= 0.01 * measured.peak_bytes
        for phase, nbytes in measured.phase_peak_bytes.items():
            assert abs(predicted.phase_peak_bytes[phase] - nbytes) <= 0.01 * nbytes


def test_replay_with_two_lengths_finds_exponents():
    measure = _traced_model("eager", False)
    model, _ = TimelineModel.from_traces([measure(16)[0], measure(32)[0]])
    _, measured = measure(128)
    assert abs(model.predict(128).peak_bytes - measured.peak_bytes) <= 0.01 * measured.peak_bytes


def test_replay_scales_batch_size_from_a_second_batch_trace():
    measure = _traced_model("eager", False)
    traces = [measure(L)[0] for L in (16, 32, 64)] + [measure(32, batch_size=4)[0]]
    model, _ = TimelineModel.from_traces(traces)
    assert any("measured from batch sizes" in n for n in model.notes)
    _, measured = measure(128, batch_size=4)
    assert abs(model.predict(128, 4).peak_bytes - measured.peak_bytes) <= 0.01 * measured.peak_bytes


def test_replay_batch_heuristic_is_conservative():
    measure = _traced_model("eager", False)
    model, _ = TimelineModel.from_traces([measure(L)[0] for L in (16, 32, 64)])
    _, measured = measure(128, batch_size=4)
    predicted = model.predict(128, 4).peak_bytes
    assert measured.peak_bytes <= predicted <= 1.15 * measured.peak_bytes


def test_max_seq_len_is_the_integer_boundary():
    measure = _traced_model("eager", False)
    model, _ = TimelineModel.from_traces([measure(L)[0] for L in (16, 32, 64)])
    budget = model.predict(200).peak_bytes + 1
    fit = model.max_seq_len(budget)
    assert model.predict(fit).peak_bytes <= budget < model.predict(fit + 1).peak_bytes
    assert model.max_seq_len(1) == 0


class _LengthDependentModel(torch.nn.Module):
    """A model whose op sequence changes with L (as a kernel choice or packing might)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        if x.shape[1] > 32:
            y = y.exp().log()
        return y


def test_mismatched_sequences_fall_back_to_the_quadratic_model():
    model = _LengthDependentModel()
    forecaster = MemoryForecaster()
    for seq_len in (16, 32, 64):
        probe = TrackerProbe("cpu")
        x = torch.randn(2, seq_len, 8)
        probe.start_step(list(model.parameters()) + [x], record_events=True)
        probe.mark_phase("forward")
        loss = model(x).sum()
        probe.mark_phase("backward")
        loss.backward()
        m = probe.end_step()
        model.zero_grad(set_to_none=True)
        forecaster.add_measurement(seq_len, 2, m.phase_peak_bytes)
        forecaster.add_trace(Trace(seq_len, 2, m.events, measured_peak_bytes=m.peak_bytes))
    assert forecaster.timeline is None
    assert "differs" in forecaster.timeline_unavailable_reason
    fc = forecaster.forecast(128, 2)
    assert fc.method == "quadratic" and "replay unavailable" in fc.detail
