"""Tests for lightning_seqmem.measure.batch: reading and setting a batch's sequence length."""

from collections import namedtuple

import pytest
import torch

from lightning_seqmem.measure.batch_shape import infer_batch_shape
from lightning_seqmem.measure.batch import set_batch_sequence_length

B, L = 3, 8


def make_batch():
    ids = torch.arange(B * L).reshape(B, L)
    return {
        "input_ids": ids,
        "labels": ids + 1000,
        "attention_mask": torch.ones(B, L, dtype=torch.bool),
        "position_ids": torch.arange(L).expand(B, L).clone(),
        "index": torch.tensor([10, 11, 12]),
        "name": "batch",
    }


# infer_batch_shape -------------------------------------------------------------------------------


def test_infer_bare_tensor():
    assert infer_batch_shape(torch.zeros(B, L, dtype=torch.long)) == (B, L)


def test_infer_input_ids_first():
    batch = {"other": torch.zeros(5, 2, dtype=torch.long), "input_ids": torch.zeros(B, L).long()}
    assert infer_batch_shape(batch) == (B, L)


def test_infer_first_integer_in_insertion_order():
    batch = {"tokens": torch.zeros(B, L, dtype=torch.int32), "other": torch.zeros(5, 2).long()}
    assert infer_batch_shape(batch) == (B, L)


def test_infer_input_ids_not_2d_falls_back():
    batch = {"input_ids": torch.zeros(B, dtype=torch.long), "ids": torch.zeros(B, L).long()}
    assert infer_batch_shape(batch) == (B, L)


def test_infer_ignores_float_bool_and_1d():
    batch = {
        "embeds": torch.zeros(7, 7),
        "mask": torch.zeros(6, 6, dtype=torch.bool),
        "index": torch.zeros(9, dtype=torch.long),
        "cube": torch.zeros(2, 2, 2, dtype=torch.long),
        "ids": torch.zeros(B, L, dtype=torch.long),
    }
    assert infer_batch_shape(batch) == (B, L)


def test_infer_list_and_nested():
    batch = [torch.zeros(4), ["text", {"x": torch.zeros(2, 2), "y": torch.zeros(B, L).long()}]]
    assert infer_batch_shape(batch) == (B, L)
    assert infer_batch_shape((torch.zeros(B, L).long(), torch.zeros(B).long())) == (B, L)


def test_infer_returns_python_ints():
    shape = infer_batch_shape(torch.zeros(B, L, dtype=torch.long))
    assert all(type(n) is int for n in shape)


def test_infer_no_tokens_lists_what_was_found():
    batch = {"x": torch.zeros(B, L), "y": "text", "z": [torch.zeros(B, dtype=torch.long)]}
    with pytest.raises(ValueError) as err:
        infer_batch_shape(batch)
    message = str(err.value)
    assert "batch['x']: Tensor(float32, [3, 8])" in message
    assert "batch['y']: str" in message
    assert "batch['z'][0]: Tensor(int64, [3])" in message
    assert "seq_len_fn" in message


# set_batch_sequence_length: truncate --------------------------------------------------------------


def test_truncate_mapping_in_place():
    batch = make_batch()
    original = {k: v for k, v in batch.items()}
    out = set_batch_sequence_length(batch, 4)
    assert out is batch
    for key in ("input_ids", "labels", "attention_mask", "position_ids"):
        assert out[key].shape == (B, 4)
        assert torch.equal(out[key], original[key][:, :4])
    assert out["index"] is original["index"]
    assert out["name"] == "batch"


def test_truncate_list_in_place():
    ids = torch.arange(B * L).reshape(B, L)
    batch = [ids, torch.ones(B, L), torch.tensor([1, 2, 3])]
    out = set_batch_sequence_length(batch, 5)
    assert out is batch
    assert torch.equal(out[0], ids[:, :5])
    assert out[1].shape == (B, 5)  # a float tensor of the same shape is a sequence tensor too
    assert out[2].shape == (B,)


def test_truncate_nested():
    ids = torch.arange(B * L).reshape(B, L)
    inner = {"input_ids": ids, "mask": torch.ones(B, L, dtype=torch.long)}
    batch = {"model": inner, "extra": [torch.zeros(B, L, 4)], "pair": (ids, "a")}
    set_batch_sequence_length(batch, 2)
    assert batch["model"] is inner and inner["input_ids"].shape == (B, 2)
    assert inner["mask"].shape == (B, 2)
    assert batch["extra"][0].shape == (B, 2, 4)
    assert batch["pair"][0].shape == (B, 2) and batch["pair"][1] == "a"


def test_truncate_bare_tensor_returns_new():
    ids = torch.arange(B * L).reshape(B, L)
    out = set_batch_sequence_length(ids, 3)
    assert out.shape == (B, 3) and ids.shape == (B, L)
    assert torch.equal(out, ids[:, :3])


def test_seq_len_not_below_length_is_unchanged():
    for truncate in (True, False):
        batch = make_batch()
        original = dict(batch)
        for seq_len in (L, L + 1, 10 * L):
            out = set_batch_sequence_length(batch, seq_len, truncate=truncate)
            assert out is batch
            assert all(out[k] is original[k] for k in original)
    ids = torch.zeros(B, L, dtype=torch.long)
    assert set_batch_sequence_length(ids, L + 5) is ids


def test_other_dimensions_not_matching_are_left_alone():
    batch = {
        "input_ids": torch.zeros(B, L, dtype=torch.long),
        "other_batch": torch.zeros(B + 1, L, dtype=torch.long),
        "other_len": torch.zeros(B, L + 1, dtype=torch.long),
        "features": torch.zeros(B, L + 1),  # float: not a sequence
    }
    set_batch_sequence_length(batch, 4)
    assert batch["other_batch"].shape == (B + 1, L)
    # a 2-D integer tensor of another length is a sequence of its own (an encoder-decoder's labels):
    # it keeps its ratio to the leading length (issue 21)
    assert batch["other_len"].shape == (B, round((L + 1) * 4 / L))
    assert batch["features"].shape == (B, L + 1)


def test_seq_dim():
    batch = {"input_ids": torch.zeros(B, L, dtype=torch.long), "x": torch.zeros(B, 2, L)}
    set_batch_sequence_length(batch, 4, seq_dim=2)
    assert batch["x"].shape == (B, 2, 4)
    assert batch["input_ids"].shape == (B, L)  # no dim 2


# set_batch_sequence_length: token-preserving ------------------------------------------------------


def test_token_preserving_keeps_all_tokens_and_alignment():
    batch = make_batch()
    ids = batch["input_ids"].clone()
    out = set_batch_sequence_length(batch, 2, truncate=False)
    assert out is batch
    rows = B * L // 2
    assert out["input_ids"].shape == (rows, 2)
    assert torch.equal(out["input_ids"].flatten(), ids.flatten())  # every token, in order
    assert torch.equal(out["labels"], out["input_ids"] + 1000)  # rows still aligned
    assert out["attention_mask"].shape == (rows, 2)
    assert out["index"].tolist() == [10] * 4 + [11] * 4 + [12] * 4
    for row in range(rows):  # row r holds a chunk of sample index[r]
        assert int(out["input_ids"][row, 0]) // L == out["index"][row] - 10
    assert torch.equal(out["position_ids"], torch.arange(2).expand(rows, 2))


def test_token_preserving_trailing_dims_and_other_seq_dim():
    batch = {"input_ids": torch.arange(B * L).reshape(B, L), "emb": torch.randn(B, L, 5)}
    emb = batch["emb"].clone()
    set_batch_sequence_length(batch, 4, truncate=False)
    assert batch["emb"].shape == (B * 2, 4, 5)
    assert torch.equal(batch["emb"].reshape(-1, 5), emb.reshape(-1, 5))

    x = torch.arange(B * 2 * L).reshape(B, 2, L)
    out = set_batch_sequence_length(x, 4, truncate=False, seq_dim=2)
    assert out.shape == (B * 2, 2, 4)
    assert torch.equal(out[1], x[0, :, 4:])  # row 1 is the second chunk of sample 0


def test_token_preserving_requires_divisor():
    with pytest.raises(ValueError, match=r"must divide 8.*\[1, 2, 4\]"):
        set_batch_sequence_length(make_batch(), 3, truncate=False)


# set_batch_sequence_length: keys, errors ---------------------------------------------------------


def test_custom_keys():
    batch = {
        "input_ids": torch.zeros(B, L, dtype=torch.long),
        "inputs_embeds": torch.zeros(B, L, 4),
        "index": torch.arange(B),
    }
    set_batch_sequence_length(batch, 4, keys=["inputs_embeds"])
    assert batch["inputs_embeds"].shape == (B, 4, 4)
    assert batch["input_ids"].shape == (B, L)  # not named, not touched

    embeds_only = {"inputs_embeds": torch.zeros(B, L, 4), "index": torch.arange(B)}
    set_batch_sequence_length(embeds_only, 2, keys=("inputs_embeds",), truncate=False)
    assert embeds_only["inputs_embeds"].shape == (B * 4, 2, 4)
    assert embeds_only["index"].tolist() == [0] * 4 + [1] * 4 + [2] * 4


def test_custom_keys_errors():
    with pytest.raises(ValueError, match="not in the batch"):
        set_batch_sequence_length(make_batch(), 2, keys=["missing"])
    with pytest.raises(ValueError, match="batch\\['name'\\] is str"):
        set_batch_sequence_length(make_batch(), 2, keys=["name"])
    with pytest.raises(ValueError, match="disagree"):
        batch = {"a": torch.zeros(B, L), "b": torch.zeros(B, L + 1)}
        set_batch_sequence_length(batch, 2, keys=["a", "b"])
    with pytest.raises(ValueError, match="mapping batch"):
        set_batch_sequence_length([torch.zeros(B, L)], 2, keys=["a"])


@pytest.mark.parametrize("batch_type", ["tuple", "namedtuple"])
def test_tuple_batch_is_refused(batch_type):
    ids = torch.zeros(B, L, dtype=torch.long)
    batch = (ids, ids) if batch_type == "tuple" else namedtuple("Batch", "ids labels")(ids, ids)
    with pytest.raises(TypeError) as err:
        set_batch_sequence_length(batch, 4)
    message = str(err.value)
    assert "on_train_batch_start" in message
    assert "dict or a list" in message and "collate_fn" in message
    assert "set_seq_len" in message


def test_batch_without_sequence_raises():
    with pytest.raises(ValueError, match="seq_len_fn.*keys"):
        set_batch_sequence_length({"x": torch.zeros(B, L)}, 4)


@pytest.mark.parametrize("seq_len", [0, -1, 2.0, True, "4", None])
def test_bad_seq_len(seq_len):
    with pytest.raises(ValueError, match="`seq_len` must be an int >= 1"):
        set_batch_sequence_length(make_batch(), seq_len)


@pytest.mark.parametrize("seq_dim", [0, -1, True])
def test_bad_seq_dim(seq_dim):
    with pytest.raises(ValueError, match="`seq_dim`"):
        set_batch_sequence_length(make_batch(), 2, seq_dim=seq_dim)
