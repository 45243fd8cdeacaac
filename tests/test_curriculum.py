"""Tests for lightning_seqmem.core.curriculum: the sequence-length schedule."""

import pytest

from lightning_seqmem.core.curriculum import Curriculum, stage_for_step


def test_geometric_stages():
    c = Curriculum(start=64, target=1024)
    assert c.stages == (64, 128, 256, 512, 1024)
    assert c.num_stages == 5


def test_geometric_target_not_a_power_of_growth():
    assert Curriculum(start=64, target=700).stages == (64, 128, 256, 512, 696)
    assert Curriculum(start=64, target=520).stages == (64, 128, 256, 512, 520)


def test_geometric_growth_one_and_a_half():
    # 64 * 1.5**k = 64, 96, 144, 216, 324, 486 -> rounded down to multiples of 8
    assert Curriculum(start=64, target=512, growth=1.5).stages == (64, 96, 144, 216, 320, 480, 512)


def test_rounding_down_never_duplicates():
    c = Curriculum(start=20, target=100, growth=1.2, multiple_of=8)
    assert c.stages == (16, 24, 32, 40, 48, 56, 64, 80, 96)  # 20*1.2**k rounded down
    assert all(a < b for a, b in zip(c.stages, c.stages[1:]))
    assert all(n % 8 == 0 for n in c.stages)
    slow = Curriculum(start=8, target=4096, growth=1.0001, multiple_of=8)
    assert slow.stages == tuple(range(8, 4097, 8))


def test_single_stage():
    assert Curriculum(start=256, target=256).stages == (256,)
    assert Curriculum(start=60, target=62).stages == (56,)


def test_linear_stages():
    c = Curriculum(start=128, target=600, schedule="linear", step_size=128)
    assert c.stages == (128, 256, 384, 512, 600)
    # start and target round down to 96 and 296; the last step may be shorter than step_size
    assert Curriculum(start=100, target=300, schedule="linear", step_size=64).stages == (
        96, 160, 224, 288, 296,
    )  # fmt: skip


def test_stage_index_and_next_length():
    c = Curriculum(start=64, target=1024)
    assert [c.stage_index(n) for n in (64, 100, 128, 1023, 1024, 5000)] == [0, 0, 1, 3, 4, 4]
    assert c.next_length(64) == 128
    assert c.next_length(100) == 128
    assert c.next_length(8) == 64
    assert c.next_length(1024) is None
    assert c.next_length(4096) is None
    with pytest.raises(ValueError, match="seq_len"):
        c.stage_index(32)


def test_capped():
    c = Curriculum(start=64, target=1024)
    assert c.capped(600) == (64, 128, 256, 512, 600)
    assert c.capped(605) == (64, 128, 256, 512, 600)
    assert c.capped(512) == (64, 128, 256, 512)
    assert c.capped(515) == (64, 128, 256, 512)  # rounds down to 512, already there
    assert c.capped(4096) == c.stages  # past the target: nothing appended
    assert c.capped(1024) == c.stages
    assert c.capped(64) == (64,)
    with pytest.raises(ValueError, match="`max_seq_len` must be an int >= 64, got 63"):
        c.capped(63)


def test_round_down():
    c = Curriculum(start=64, target=1024, multiple_of=64)
    assert c.round_down(1000) == 960
    assert c.round_down(64) == 64
    with pytest.raises(ValueError, match="seq_len"):
        c.round_down(63)


def test_stage_for_step():
    c = Curriculum(start=64, target=512, steps_per_stage=5)
    assert [stage_for_step(c, s) for s in (0, 4, 5, 14, 15, 10**6)] == [0, 0, 1, 2, 3, 3]
    with pytest.raises(ValueError, match="step"):
        stage_for_step(c, -1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"growth": 1.5, "steps_per_stage": 3, "multiple_of": 16, "truncate": False},
        {"schedule": "linear", "step_size": 64},
    ],
)
def test_round_trip(kwargs):
    c = Curriculum(start=64, target=1000, **kwargs)
    data = c.to_dict()
    assert all(isinstance(v, (int, float, str, bool, type(None))) for v in data.values())
    again = Curriculum.from_dict(data)
    assert again == c and again.stages == c.stages
    assert eval(repr(c), {"Curriculum": Curriculum}) == c


def test_from_dict_defaults_and_unknown_keys():
    assert Curriculum.from_dict({"start": 64, "target": 128}) == Curriculum(64, 128)
    with pytest.raises(ValueError, match="Unknown Curriculum keys \\['grwoth'\\]"):
        Curriculum.from_dict({"start": 64, "target": 128, "grwoth": 2})


def test_values_are_normalised():
    c = Curriculum(start=64, target=128, growth=2)
    assert isinstance(c.growth, float)
    assert c.to_dict()["growth"] == 2.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"start": 0}, "`start` must be an int >= 1, got 0"),
        ({"start": 4}, "`start` must be >= `multiple_of`=8, got start=4"),
        ({"target": 32}, "`target` must be >= `start`=64, got target=32"),
        ({"growth": 1.0}, "`growth` must be a finite number > 1, got 1.0"),
        ({"growth": 0.5}, "`growth`"),
        ({"growth": float("inf")}, "`growth`"),
        ({"growth": True}, "`growth` must be a number > 1, got True"),
        ({"growth": "2"}, "`growth`"),
        ({"steps_per_stage": 0}, "`steps_per_stage` must be an int >= 1, got 0"),
        ({"steps_per_stage": True}, "`steps_per_stage` must be an int >= 1, got True"),
        ({"start": True}, "`start` must be an int >= 1, got True"),
        ({"target": 128.0}, "`target` must be an int >= 1, got 128.0"),
        ({"multiple_of": 0}, "`multiple_of` must be an int >= 1, got 0"),
        ({"schedule": "cosine"}, "`schedule` must be one of \\('geometric', 'linear'\\)"),
        ({"schedule": "linear"}, "`step_size` is required with schedule='linear'"),
        ({"schedule": "linear", "step_size": 0}, "`step_size` must be an int >= 8, got 0"),
        ({"schedule": "linear", "step_size": 12}, "multiple of `multiple_of`=8, got step_size=12"),
        ({"schedule": "linear", "step_size": False}, "`step_size`"),
        ({"step_size": 64}, "only used by schedule='linear'"),
        ({"truncate": 0}, "`truncate` must be a bool, got 0"),
    ],
)
def test_validation(kwargs, match):
    args = {"start": 64, "target": 1024, **kwargs}
    with pytest.raises(ValueError, match=match):
        Curriculum(**args)


def test_linear_ignores_growth_value():
    c = Curriculum(start=64, target=256, growth=1.0, schedule="linear", step_size=64)
    assert c.stages == (64, 128, 192, 256)
