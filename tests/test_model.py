"""Tests of the pure quadratic memory model (no torch)."""

import json
import math

import numpy as np
import pytest

from lightning_seqmem.core.quadratic import (
    UNBOUNDED_SEQ_LEN,
    QuadraticCoefficients,
    QuadraticForecast,
    QuadraticMemoryModel,
)

MiB = 2**20
C, A, B_QUAD = 1e6, 3e3, 40.0


def memory_bytes(seq_len, batch_size, const=C, a=A, b=B_QUAD):
    return const + batch_size * (a * seq_len + b * seq_len**2)


def synthetic_points(lengths=(64, 128, 256, 512, 1024), batches=(1, 2, 4), **kw):
    return [(L, B, int(round(memory_bytes(L, B, **kw)))) for L in lengths for B in batches]


def test_exact_recovery_of_known_coefficients():
    model = QuadraticMemoryModel().fit(synthetic_points())
    assert model.is_fitted and model.phases == ("step",)
    coef = model.coefficients["step"]
    assert coef.const_bytes == pytest.approx(C, rel=1e-6)
    assert coef.linear_bytes_per_token == pytest.approx(A, rel=1e-9)
    assert coef.quadratic_bytes_per_token2 == pytest.approx(B_QUAD, rel=1e-9)
    assert coef.num_points == 15
    assert coef.residual_std_bytes < 1.0
    forecast = model.predict(4096, batch_size=8)
    assert isinstance(forecast, QuadraticForecast) and forecast.method == "quadratic"
    assert forecast.peak_bytes == pytest.approx(memory_bytes(4096, 8), abs=2)
    assert forecast.phase_peak_bytes == {"step": forecast.peak_bytes}


def test_recovery_is_well_conditioned_at_large_values():
    # Bytes near 1e11 and L² near 1e10: unnormalised normal equations would lose the linear term.
    kw = dict(const=8e10, a=1e5, b=2e3)
    model = QuadraticMemoryModel().fit(
        synthetic_points((8192, 16384, 32768, 65536, 100_000), (1, 2), **kw))
    coef = model.coefficients["step"]
    assert coef.const_bytes == pytest.approx(8e10, rel=1e-6)
    assert coef.linear_bytes_per_token == pytest.approx(1e5, rel=1e-5)
    assert coef.quadratic_bytes_per_token2 == pytest.approx(2e3, rel=1e-9)


def test_negative_linear_term_is_clamped_to_zero():
    model = QuadraticMemoryModel().fit(synthetic_points(a=-2_000.0))
    coef = model.coefficients["step"]
    assert coef.linear_bytes_per_token == 0.0
    assert coef.quadratic_bytes_per_token2 > 0


def test_negative_quadratic_term_is_clamped_to_zero():
    model = QuadraticMemoryModel().fit(
        synthetic_points(lengths=(64, 128, 256, 512), a=5e4, b=-20.0))
    coef = model.coefficients["step"]
    assert coef.quadratic_bytes_per_token2 == 0.0
    assert coef.linear_bytes_per_token > 0


def test_decreasing_data_gives_constant_model_and_unbounded_length():
    points = [(64, 1, 3_000), (128, 1, 2_000), (256, 1, 1_000)]
    model = QuadraticMemoryModel().fit(points)
    coef = model.coefficients["step"]
    assert (coef.linear_bytes_per_token, coef.quadratic_bytes_per_token2) == (0.0, 0.0)
    assert coef.const_bytes == pytest.approx(2_000)
    assert model.max_seq_len(10**6, conservative=False) == UNBOUNDED_SEQ_LEN
    assert model.max_seq_len(1_000, conservative=False) == 0


def test_two_point_article_fit_has_no_linear_term():
    points = [(128, 1, 2_000_000 + 50 * 128**2), (256, 1, 2_000_000 + 50 * 256**2)]
    coef = QuadraticMemoryModel().fit(points).coefficients["step"]
    assert coef.linear_bytes_per_token == 0.0
    assert coef.quadratic_bytes_per_token2 == pytest.approx(50.0)
    assert coef.const_bytes == pytest.approx(2_000_000)
    assert coef.residual_std_bytes == 0.0


def test_two_point_fit_duplicates_average_and_give_residuals():
    points = [(128, 1, 1_000), (128, 1, 1_200), (256, 1, 4_100), (256, 1, 4_300)]
    model = QuadraticMemoryModel(min_relative_uncertainty=0.0).fit(points)
    coef = model.coefficients["step"]
    assert coef.predict_bytes(128, 1) == pytest.approx(1_100)
    assert coef.predict_bytes(256, 1) == pytest.approx(4_200)
    assert coef.residual_std_bytes == pytest.approx(math.sqrt(4 * 100**2 / 2))
    assert model.predict(1024).uncertainty_bytes > 0


def test_two_point_fit_falls_back_to_linear_when_quadratic_would_be_negative():
    # B·L is 4 then 8 but B·L² is 16 then 8: memory grows with B·L, falls with B·L².
    coef = QuadraticMemoryModel().fit([(4, 1, 100), (1, 8, 200)]).coefficients["step"]
    assert coef.quadratic_bytes_per_token2 == 0.0
    assert coef.linear_bytes_per_token == pytest.approx(25.0)


def multi_phase_points(lengths=(64, 128, 256, 512)):
    # forward: small constant, large attention term; optimizer: large constant, flat in L.
    return [
        (L, 2,
         {"forward": int(memory_bytes(L, 2, const=1e6, a=1e3, b=100.0)), "optimizer": 5 * 10**7})
        for L in lengths
    ]


def test_multi_phase_peak_is_max_over_phases():
    model = QuadraticMemoryModel().fit(multi_phase_points())
    assert model.phases == ("forward", "optimizer")
    short, long = model.predict(128, 2), model.predict(1024, 2)
    assert short.peak_phase == "optimizer" and long.peak_phase == "forward"
    for forecast in (short, long):
        assert forecast.peak_bytes == max(forecast.phase_peak_bytes.values())
        assert forecast.peak_bytes == forecast.phase_peak_bytes[forecast.peak_phase]
    fwd = model.coefficients["forward"]
    fwd_upper = fwd.predict_bytes(1024, 2) + 0.15 * fwd.dynamic_bytes(1024, 2)
    assert long.upper_bytes == pytest.approx(fwd_upper, abs=1)


def test_upper_is_max_of_phase_uppers_not_of_peak_phase():
    # "a" peaks by a hair at L=256 but "b" has a much larger dynamic part, hence a larger upper.
    points = [(L, 1, {"a": 10**6 + 10, "b": 10 * L * L}) for L in (128, 256)]
    points.append((64, 1, {"a": 10**6 + 10, "b": None}))
    model = QuadraticMemoryModel(min_relative_uncertainty=0.5).fit(points)
    forecast = model.predict(316)
    assert forecast.peak_phase == "a"
    assert forecast.upper_bytes == pytest.approx(1.5 * 10 * 316**2, abs=1)


def test_none_values_are_skipped_per_phase():
    points = [(L, 1, {"forward": memory_bytes(L, 1), "backward": None}) for L in (64, 128, 256)]
    points += [(L, 1, {"forward": None, "backward": 2 * memory_bytes(L, 1)}) for L in (512, 1024)]
    model = QuadraticMemoryModel().fit(points)
    assert model.coefficients["forward"].num_points == 3
    assert model.coefficients["backward"].num_points == 2
    assert model.predict(2048).peak_phase == "backward"


@pytest.mark.parametrize("conservative", [True, False])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_max_seq_len_is_exact_at_integer_boundary(conservative, batch_size):
    rng = np.random.default_rng(0)
    points = [(L, B, int(memory_bytes(L, B) * (1 + 0.01 * rng.standard_normal())))
              for L in (128, 256, 512) for B in (1, 2) for _ in range(2)]
    model = QuadraticMemoryModel().fit(points)
    key = "upper_bytes" if conservative else "peak_bytes"
    for budget in (2 * 10**6, 10**8, 3 * 10**9, 8 * 10**10, 123_456_789):
        seq_len = model.max_seq_len(budget, batch_size, conservative=conservative)
        assert seq_len >= 1
        assert getattr(model.predict(seq_len, batch_size), key) <= budget
        assert getattr(model.predict(seq_len + 1, batch_size), key) > budget


def test_max_seq_len_conservative_is_shorter_and_zero_when_nothing_fits():
    model = QuadraticMemoryModel().fit(synthetic_points())
    assert model.max_seq_len(2**30) < model.max_seq_len(2**30, conservative=False)
    assert model.max_seq_len(10**6) == 0  # C alone is 1e6 bytes
    # The true peak is 1_003_040 bytes at L=1 and 1_006_160 at L=2. A least-squares fit recovers it
    # only to rounding (its last bit differs between NumPy/BLAS builds, and `predict` rounds up), so
    # budgets against the true peaks sit at least a byte away from them...
    at_1, at_2 = int(memory_bytes(1, 1)), int(memory_bytes(2, 1))
    assert model.max_seq_len(at_1 - 1, conservative=False) == 0
    assert model.max_seq_len(at_1 + 1, conservative=False) == 1
    assert model.max_seq_len(at_2 - 1, conservative=False) == 1
    # ...and at the fitted boundary itself, exact integer arithmetic on the model's own rounded
    # forecast: the budget it needs for L=1 fits L=1, one byte less fits nothing.
    needed = model.predict(1).peak_bytes
    assert needed in (at_1, at_1 + 1)
    assert model.max_seq_len(needed, conservative=False) == 1
    assert model.max_seq_len(needed - 1, conservative=False) == 0


def test_uncertainty_floor_applies_to_exact_fit():
    model = QuadraticMemoryModel(min_relative_uncertainty=0.15).fit(synthetic_points())
    forecast = model.predict(8192, 4)
    dynamic = model.coefficients["step"].dynamic_bytes(8192, 4)
    assert forecast.uncertainty_bytes == pytest.approx(0.15 * dynamic, abs=2)
    assert forecast.upper_bytes == forecast.peak_bytes + forecast.uncertainty_bytes
    no_floor = QuadraticMemoryModel(min_relative_uncertainty=0.0).fit(synthetic_points())
    assert no_floor.predict(8192, 4).uncertainty_bytes <= 0.5 * 1e-6 * forecast.peak_bytes


def test_residual_uncertainty_grows_with_noise():
    rng = np.random.default_rng(1)
    clean = synthetic_points()

    def uncertainty(noise_rel):
        noisy = [(L, B, max(0, int(p * (1 + noise_rel * rng.standard_normal()))))
                 for L, B, p in clean]
        model = QuadraticMemoryModel(min_relative_uncertainty=0.0).fit(noisy)
        return (model.coefficients["step"].residual_std_bytes,
                model.predict(8192, 4).uncertainty_bytes)

    std0, unc0 = uncertainty(0.0)
    std1, unc1 = uncertainty(0.01)
    std2, unc2 = uncertainty(0.05)
    assert std0 < std1 < std2
    assert unc0 < unc1 < unc2


def test_to_dict_from_dict_round_trip():
    rng = np.random.default_rng(2)
    points = [(L, B, {k: v * (1 + 0.02 * rng.standard_normal()) for k, v in p.items()})
              for L, B, p in multi_phase_points() + multi_phase_points((96, 384))]
    model = QuadraticMemoryModel(min_relative_uncertainty=0.1, confidence_z=3.0).fit(points)
    restored = QuadraticMemoryModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert restored.phases == model.phases
    assert (restored.min_relative_uncertainty, restored.confidence_z) == (0.1, 3.0)
    assert restored.coefficients == model.coefficients
    for L, B in [(1, 1), (300, 2), (4096, 8), (65536, 1)]:
        assert restored.predict(L, B) == model.predict(L, B)
    assert restored.max_seq_len(10**9, 2) == model.max_seq_len(10**9, 2)
    assert not QuadraticMemoryModel.from_dict(QuadraticMemoryModel().to_dict()).is_fitted


def test_measured_cpu_eager_figures_extrapolate_within_15_percent():
    # DESIGN.md: eager attention, 2-layer d=128 4-head GPT, batch 4, dynamic peak in MiB.
    measured_mib = {64: 5.5, 128: 12.1, 256: 28.2, 512: 87.2, 1024: 302.8}
    points = [(L, 4, int(measured_mib[L] * MiB)) for L in (128, 256, 512)]
    forecast = QuadraticMemoryModel().fit(points).predict(1024, batch_size=4)
    assert forecast.peak_bytes / MiB == pytest.approx(measured_mib[1024], rel=0.15)
    assert forecast.upper_bytes / MiB >= measured_mib[1024]


def test_accepts_numpy_ints():
    points = [(np.int64(L), np.int32(B), np.int64(p)) for L, B, p in synthetic_points()]
    model = QuadraticMemoryModel().fit(points)
    assert model.predict(np.int64(100), np.int64(2)).seq_len == 100


def test_unfitted_model_raises_runtime_error():
    model = QuadraticMemoryModel()
    assert not model.is_fitted and model.phases == () and model.coefficients == {}
    with pytest.raises(RuntimeError, match="call `fit"):
        model.predict(128)
    with pytest.raises(RuntimeError, match="call `fit"):
        model.max_seq_len(10**9)


@pytest.mark.parametrize(
    "points, match",
    [
        ([], r"need at least 2 distinct \(seq_len, batch_size\) points, got 0"),
        ([(128, 1, 10), (128, 1, 20)], r"need at least 2 distinct .* got 1"),
        ([(0, 1, 10), (128, 1, 20)], r"`seq_len` must be a positive int, got 0"),
        ([(1.5, 1, 10), (128, 1, 20)], r"`seq_len` must be a positive int, got 1.5"),
        ([(True, 1, 10), (128, 1, 20)], r"`seq_len` must be a positive int, got True"),
        ([(64, -2, 10), (128, 1, 20)], r"`batch_size` must be a positive int, got -2"),
        ([(64, 1, -10), (128, 1, 20)], r"`peak` must be a non-negative finite number, got -10"),
        ([(64, 1, float("nan")), (128, 1, 20)],
         r"`peak` must be a non-negative finite number, got nan"),
        ([(64, 1, "10"), (128, 1, 20)], r"`peak` must be a non-negative finite number, got '10'"),
        ([(64, 1, {"fwd": -1}), (128, 1, {"fwd": 2})], r"`peak\['fwd'\]` must be a non-negative"),
        ([(64, 1, {"fwd": 1}), (128, 1, {"bwd": 2})],
         r"every point must have the phases \['fwd'\]"),
        ([(64, 1, {1: 1}), (128, 1, {1: 2})], r"phase names must be str, got 1"),
        (
            [(64, 1, {"f": 1, "b": None}), (128, 1, {"f": 2, "b": 5}),
             (256, 1, {"f": 3, "b": None})],
            r"phase 'b': need at least 2 distinct .* got 1",
        ),
    ],
)
def test_fit_value_errors(points, match):
    with pytest.raises(ValueError, match=match):
        QuadraticMemoryModel().fit(points)


def test_predict_and_max_seq_len_value_errors():
    model = QuadraticMemoryModel().fit(synthetic_points())
    with pytest.raises(ValueError, match=r"`seq_len` must be a positive int, got 0"):
        model.predict(0)
    with pytest.raises(ValueError, match=r"`batch_size` must be a positive int, got 2.0"):
        model.predict(128, 2.0)
    with pytest.raises(ValueError, match=r"^`budget_bytes` must be a positive int, got -3$"):
        model.max_seq_len(-3)
    with pytest.raises(ValueError, match=r"`batch_size` must be a positive int, got 0"):
        model.max_seq_len(10**9, batch_size=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(min_relative_uncertainty=-0.1), r"`min_relative_uncertainty` must be .* got -0.1"),
        (dict(confidence_z=float("inf")),
         r"`confidence_z` must be a non-negative finite number, got inf"),
    ],
)
def test_init_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuadraticMemoryModel(**kwargs)


def test_coefficients_methods():
    coef = QuadraticCoefficients(10.0, 2.0, 0.5, residual_std_bytes=0.0, num_points=2)
    assert coef.dynamic_bytes(4, 3) == 3 * (2 * 4 + 0.5 * 16)
    assert coef.predict_bytes(4, 3) == 10 + 48
    assert coef.prediction_std_bytes(4, 3) == 0.0
