"""Tests for lightning_seqmem.core.units: parsing what users write, refusing what is not a memory
size."""

import numpy as np
import pytest

from lightning_seqmem.core.units import MAX_BYTES, parse_bytes

ACCEPTED = ("must be a positive number of bytes up to 2\\*\\*63 - 1 \\(an int\\) or a string "
            "like '12GiB'")


@pytest.mark.parametrize(
    "value, nbytes",
    [
        ("12GiB", 12 * 2**30),
        ("900MB", 900 * 10**6),
        ("1.5 KiB", 1536),
        (" 12 gib ", 12 * 2**30),
        (".5KiB", 512),
        ("5.", 5),
        ("1", 1),
        ("0.3MB", 300_000),  # exact: 0.3 * 1e6 in floats is 299999.99999999994
        ("1.0000000001B", 1),  # rounded down to whole bytes
        ("8388607.999TiB", 8388607999 * 2**40 // 1000),  # just under 8 EiB
        (4096, 4096),
        (np.int64(4096), 4096),
        (MAX_BYTES, MAX_BYTES),
    ],
)
def test_parse_bytes_accepts(value, nbytes):
    out = parse_bytes(value)
    assert out == nbytes and type(out) is int


@pytest.mark.parametrize(
    "value",
    [
        "9" * 400,
        "9" * 400 + "GiB",
        # past Python's int-string limit: still our ValueError, not int()'s
        pytest.param("9" * 5000, id="9*5000"),
        "9" * 30 + "GiB",
        "8388608TiB",  # 2**63 bytes exactly
        "1e400GiB",
        "1e3",
        "inf",
        "infGiB",
        "nan",
        "-5GiB",
        "-1",
        "0",
        "0GiB",
        "0.0",
        "0.1B",  # rounds down to 0 bytes
        "",
        "GiB",
        "12 parsecs",
        "12 GiB extra",
        0,
        -3,
        2**63,
        10**400,
        pytest.param(10**5000, id="10**5000"),
        True,
        1.5,
        float("inf"),
        float("nan"),
        None,
        [1],
    ],
)
def test_parse_bytes_refuses_with_value_error(value):
    with pytest.raises(ValueError, match=f"^`memory_budget` {ACCEPTED}.*, got ") as err:
        parse_bytes(value)
    assert not isinstance(err.value, OverflowError)


def test_error_names_the_argument_and_the_value():
    with pytest.raises(ValueError, match=r"^`--budget` .*got '12 parsecs'$"):
        parse_bytes("12 parsecs", "--budget")
    with pytest.raises(ValueError, match=r"got '0.1B' \(less than one byte\)$"):
        parse_bytes("0.1B")
    with pytest.raises(ValueError, match=r"got 9223372036854775808 \(over 2\*\*63 - 1 bytes\)$"):
        parse_bytes(2**63)
    with pytest.raises(ValueError, match=r"got '9{30}GiB' \(over 2\*\*63 - 1 bytes\)$"):
        parse_bytes("9" * 30 + "GiB")


def test_long_values_are_shortened_in_the_message():
    with pytest.raises(ValueError) as err:
        parse_bytes("9" * 400)
    message = str(err.value)
    assert "... (400 characters) (longer than 64 characters)" in message
    assert len(message) < 400
    with pytest.raises(ValueError, match=r"got an int of 1329 bits \(over 2\*\*63 - 1 bytes\)$"):
        parse_bytes(10**400)
