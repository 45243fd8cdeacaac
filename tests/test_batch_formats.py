"""Every batch format users give, read and cut: lightning_seqmem.measure.batch beyond test_batch.

Formats: a bare 2-D tensor, dict, list, tuple, namedtuple, Hugging Face ``BatchEncoding``, read-only
mapping, dataclasses (mutable and frozen); tensors with a broadcast ``[1, L]`` first dimension and
``[B, 1, L, L]`` masks; left and right padding; data shorter than the asked length; ``seq_len_fn``.
"""

from __future__ import annotations

import dataclasses
import types
from collections import namedtuple

import numpy as np
import pytest
import torch

from lightning_seqmem.measure.batch import BatchCut, cut_batch, set_batch_sequence_length
from lightning_seqmem.measure.batch_tree import can_cut_in_place
from lightning_seqmem.measure.batch_shape import infer_batch_shape, padding_side, read_batch_shape

B, L, S = 3, 8, 4


def ids(batch_size=B, length=L):
    return torch.arange(batch_size * length).reshape(batch_size, length)


def same(a, b):
    return a.shape == b.shape and torch.equal(a, b)


@dataclasses.dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    index: torch.Tensor


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    note: str = "x"


@dataclasses.dataclass
class BatchWithDerived:
    input_ids: torch.Tensor
    lengths: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self):
        self.lengths = torch.full((self.input_ids.shape[0],), self.input_ids.shape[1])


Pair = namedtuple("Pair", "input_ids labels")


# infer_batch_shape: which tensor is the batch -----------------------------------------------------


def test_infer_list_skips_a_broadcast_position_tensor():
    positions = torch.arange(L).view(1, L)
    assert infer_batch_shape([positions, ids()]) == (B, L)
    assert infer_batch_shape((positions, ids(), torch.zeros(B, dtype=torch.long))) == (B, L)
    assert infer_batch_shape([positions, {"input_ids": ids()}]) == (B, L)


def test_infer_broadcast_rule_takes_most_rows_among_same_length_first_of_equals():
    positions = torch.arange(L).view(1, L)
    small, large, other_len = ids(2), ids(5), ids(9, L + 1)
    assert infer_batch_shape([positions, other_len, small, large]) == (5, L)
    first, second = ids(5), ids(5) + 100
    batch = [positions, first, second]
    assert _reference(batch) is first


def _reference(batch):
    from lightning_seqmem.measure.batch_tree import find_reference

    return find_reference(batch)


def test_infer_true_batch_of_one_stays_one():
    assert (infer_batch_shape([torch.arange(L).view(1, L), torch.zeros(1, L, dtype=torch.long)])
            == (1, L))
    assert infer_batch_shape([torch.arange(L).view(1, L), ids(B, L + 1)]) == (1, L)  # other length
    assert infer_batch_shape(torch.zeros(1, L, dtype=torch.long)) == (1, L)


def test_infer_input_ids_wins_even_with_one_row():
    batch = {"position_ids": torch.arange(L).view(1, L), "input_ids": ids(1), "labels": ids(B)}
    assert infer_batch_shape(batch) == (1, L)


def test_infer_dict_with_position_ids_first_and_no_input_ids():
    batch = {"position_ids": torch.arange(L).view(1, L), "tokens": ids()}
    assert infer_batch_shape(batch) == (B, L)


def test_infer_batch_encoding_and_dataclasses():
    transformers = pytest.importorskip("transformers")
    enc = transformers.BatchEncoding({"input_ids": ids(),
                                      "attention_mask": torch.ones(B, L, dtype=torch.long)})
    assert infer_batch_shape(enc) == (B, L)
    assert infer_batch_shape(Batch(ids(), ids(), torch.arange(B))) == (B, L)
    assert infer_batch_shape(FrozenBatch(ids(), ids())) == (B, L)
    assert infer_batch_shape(Pair(ids(), ids())) == (B, L)


def test_infer_error_lists_dataclass_fields():
    @dataclasses.dataclass
    class Embeds:
        x: torch.Tensor

    with pytest.raises(ValueError, match=r"batch\.x: Tensor\(float32, \[3, 8\]\)"):
        infer_batch_shape(Embeds(torch.zeros(B, L)))


# can_cut_in_place --------------------------------------------------------------------------------


def test_can_cut_in_place():
    transformers = pytest.importorskip("transformers")
    assert can_cut_in_place({"input_ids": ids()})
    assert can_cut_in_place([ids()])
    assert can_cut_in_place(transformers.BatchEncoding({"input_ids": ids()}))
    assert can_cut_in_place(Batch(ids(), ids(), torch.arange(B)))
    assert not can_cut_in_place(ids())
    assert not can_cut_in_place((ids(),))
    assert not can_cut_in_place(Pair(ids(), ids()))
    assert not can_cut_in_place(types.MappingProxyType({"input_ids": ids()}))
    assert not can_cut_in_place(FrozenBatch(ids(), ids()))
    assert not can_cut_in_place("text") and not can_cut_in_place(None)
    assert not can_cut_in_place(Batch)  # the class, not an instance


@pytest.mark.parametrize(
    "make",
    [lambda: (ids(), ids()), lambda: Pair(ids(), ids()),
     lambda: types.MappingProxyType({"input_ids": ids()}), lambda: FrozenBatch(ids(), ids())],
    ids=["tuple", "namedtuple", "mappingproxy", "frozen-dataclass"],
)
def test_in_place_refused_exactly_where_can_cut_in_place_is_false(make):
    batch = make()
    assert not can_cut_in_place(batch)
    with pytest.raises(TypeError, match="cut_batch"):
        set_batch_sequence_length(batch, S)
    with pytest.raises(TypeError, match="in place"):
        cut_batch(batch, S, in_place=True)
    out = cut_batch(batch, S)  # the functional form cuts a copy
    assert out.seq_len == S and not out.in_place and type(out.batch) is type(batch)
    assert infer_batch_shape(out.batch) == (B, S)
    assert infer_batch_shape(batch) == (B, L)  # the argument is untouched


# cut_batch on each format ------------------------------------------------------------------------


def test_cut_bare_tensor():
    x = ids()
    out = cut_batch(x, S)
    assert isinstance(out, BatchCut)
    assert same(out.batch, x[:, :S]) and x.shape == (B, L)
    assert (out.batch_size, out.seq_len, out.source_seq_len, out.asked_seq_len) == (B, S, L, S)
    assert out.cut and not out.in_place and out.kept == "first"
    assert out.padding_side is None and out.empty_rows is None
    assert out.batch.is_contiguous() and out.batch.untyped_storage().nbytes() == B * S * 8
    assert same(set_batch_sequence_length(x, S), x[:, :S])  # the in-place form returns a new tensor


def test_cut_dict_functional_leaves_argument_untouched():
    inner = {"input_ids": ids(), "mask": torch.ones(B, L, dtype=torch.long)}
    batch = {"model": inner, "extra": [torch.zeros(B, L, 2)], "pair": (ids(), "a"), "name": "b"}
    out = cut_batch(batch, S)
    assert out.batch is not batch and out.batch["model"] is not inner
    assert inner["input_ids"].shape == (B, L) and batch["extra"][0].shape == (B, L, 2)
    assert out.batch["model"]["input_ids"].shape == (B, S)
    assert out.batch["model"]["mask"].shape == (B, S)
    assert out.batch["extra"][0].shape == (B, S, 2)
    assert out.batch["pair"][0].shape == (B, S) and out.batch["pair"][1] == "a"
    assert out.batch["name"] == "b"


def test_cut_dict_in_place_reports_in_place():
    batch = {"input_ids": ids(), "labels": ids()}
    out = cut_batch(batch, S, in_place=True)
    assert out.batch is batch and out.in_place
    assert batch["input_ids"].shape == (B, S)


def test_cut_list_both_ways():
    batch = [ids(), torch.ones(B, L), torch.arange(B)]
    out = cut_batch(batch, S)
    assert out.batch is not batch and batch[0].shape == (B, L)
    assert [t.shape for t in out.batch] == [(B, S), (B, S), (B,)]
    assert set_batch_sequence_length(batch, S) is batch and batch[0].shape == (B, S)


def test_cut_tuple_and_namedtuple_keep_their_type():
    positions = torch.arange(L).view(1, L)
    out = cut_batch((positions, ids(), torch.arange(B)), S)
    assert type(out.batch) is tuple
    assert (out.batch[0].shape == (1, S) and out.batch[1].shape == (B, S)
            and out.batch[2].shape == (B,))
    assert (out.batch_size, out.seq_len) == (B, S)
    pair = cut_batch(Pair(ids(), ids() + 1), S).batch
    assert isinstance(pair, Pair) and pair.labels.shape == (B, S)


def test_cut_batch_encoding_in_place_and_functional():
    transformers = pytest.importorskip("transformers")
    data = {"input_ids": ids(), "attention_mask": torch.ones(B, L, dtype=torch.long),
            "labels": ids()}
    enc = transformers.BatchEncoding(dict(data))
    out = cut_batch(enc, S)
    assert isinstance(out.batch, transformers.BatchEncoding) and out.batch is not enc
    assert enc["input_ids"].shape == (B, L)
    assert all(out.batch[k].shape == (B, S) for k in data)
    assert out.batch.input_ids.shape == (B, S)  # attribute access still works
    assert set_batch_sequence_length(enc, S) is enc
    assert all(enc[k].shape == (B, S) for k in data)


def test_copies_of_a_batch_encoding_leave_it_whole():
    # torch's tree_map takes a BatchEncoding for a leaf: the copy at a length cut the user's batch
    # in place, and the kept copies (the dry run's, the breakdown's) were the batch itself
    transformers = pytest.importorskip("transformers")
    from lightning_seqmem.measure.steps import batch_copy_at
    from lightning_seqmem.trainer.access import longest_batch

    enc = transformers.BatchEncoding({"input_ids": ids(), "labels": ids()})
    out = batch_copy_at(enc, S, torch.device("cpu"))
    assert isinstance(out, transformers.BatchEncoding) and out["input_ids"].shape == (B, S)
    kept = longest_batch(None, enc, L)[1]
    assert kept["labels"] is not enc["labels"] and same(kept["labels"], enc["labels"])
    assert enc["input_ids"].shape == (B, L)


def test_cut_batch_encoding_from_a_real_tokenizer_left_padded():
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[PAD]": 0, "a": 1, "b": 2, "c": 3}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[PAD]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]",
                                                     padding_side="left")
    enc = tokenizer(["a b c a b c", "a b"], padding=True, return_tensors="pt")
    assert enc["input_ids"].tolist() == [[1, 2, 3, 1, 2, 3], [0, 0, 0, 0, 1, 2]]
    assert padding_side(enc) == "left"
    out = cut_batch(enc, 3)
    assert out.kept == "last" and out.empty_rows == 0
    assert out.batch["input_ids"].tolist() == [[1, 2, 3], [0, 1, 2]]
    assert out.batch["attention_mask"].tolist() == [[1, 1, 1], [0, 1, 1]]


def test_cut_mutable_dataclass_in_place_and_functional():
    batch = Batch(ids(), ids() + 1, torch.arange(B))
    out = cut_batch(batch, S)
    assert out.batch is not batch and batch.input_ids.shape == (B, L)
    assert out.batch.input_ids.shape == (B, S) and out.batch.index.shape == (B,)
    assert set_batch_sequence_length(batch, S) is batch
    assert batch.input_ids.shape == (B, S) and batch.labels.shape == (B, S)


def test_cut_frozen_dataclass_and_init_false_fields():
    out = cut_batch(FrozenBatch(ids(), ids(), note="y"), S).batch
    assert isinstance(out, FrozenBatch) and out.input_ids.shape == (B, S) and out.note == "y"
    derived = BatchWithDerived(ids())
    out = cut_batch(derived, S).batch
    assert out.input_ids.shape == (B, S) and derived.input_ids.shape == (B, L)


def test_frozen_dataclass_nested_in_a_dict_is_rebuilt_in_place():
    batch = {"inputs": FrozenBatch(ids(), ids())}
    set_batch_sequence_length(batch, S)
    assert isinstance(batch["inputs"], FrozenBatch) and batch["inputs"].input_ids.shape == (B, S)


# which tensors are cut ---------------------------------------------------------------------------


def test_broadcast_and_batch_tensors_cut_together():
    batch = {
        "input_ids": ids(),
        "attention_mask": torch.ones(B, L, dtype=torch.long),
        "labels": ids() + 1,
        "position_ids": torch.arange(L).view(1, L),
        "bias": torch.randn(1, L, 2),
        "index": torch.arange(B),
        "other_rows": torch.zeros(B + 1, L),
    }
    full = dict(batch)
    set_batch_sequence_length(batch, S)
    assert same(batch["position_ids"], torch.arange(S).view(1, S))
    assert same(batch["bias"], full["bias"][:, :S])
    for key in ("input_ids", "attention_mask", "labels"):
        assert same(batch[key], full[key][:, :S])
    assert batch["index"] is full["index"] and batch["other_rows"] is full["other_rows"]


@pytest.mark.parametrize("lead", [B, 1])
def test_square_masks_cut_on_both_last_dims(lead):
    mask4 = torch.arange(lead * L * L).reshape(lead, 1, L, L)
    heads = torch.randn(lead, 2, L, L)
    batch = {"input_ids": ids(), "mask4": mask4, "heads": heads, "mask3": mask4[:, 0].bool()}
    out = cut_batch(batch, S).batch
    assert same(out["mask4"], mask4[..., :S, :S])
    assert same(out["heads"], heads[..., :S, :S])
    assert same(out["mask3"], mask4[:, 0, :S, :S].bool())


def test_float_embeddings_with_width_equal_to_length_are_not_taken_for_a_mask():
    embeds = torch.randn(B, L, L)  # d_model == L
    out = cut_batch({"input_ids": ids(), "embeds": embeds}, S).batch
    assert same(out["embeds"], embeds[:, :S])


def test_square_masks_keep_diagonal_blocks_when_tokens_are_kept():
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    mask = causal.expand(B, 1, L, L).clone()
    mask[1] = False  # make samples distinguishable
    out = cut_batch({"input_ids": ids(), "mask": mask, "shared": causal.view(1, 1, L, L)}, S,
                    truncate=False)
    chunks = L // S
    assert out.batch_size == B * chunks and out.seq_len == S
    assert out.batch["mask"].shape == (B * chunks, 1, S, S)
    for row in range(B * chunks):
        b, j = divmod(row, chunks)
        assert same(out.batch["mask"][row], mask[b, :, j * S:(j + 1) * S, j * S:(j + 1) * S])
        assert same(out.batch["shared"][row, 0], torch.tril(torch.ones(S, S, dtype=torch.bool)))


def test_token_preserving_with_broadcast_tensors():
    positions = torch.arange(L).view(1, L)
    weights = torch.arange(L, dtype=torch.float).view(1, L)
    batch = {"input_ids": ids(), "position_ids": positions, "weights": weights}
    out = cut_batch(batch, S, truncate=False)
    rows = B * L // S
    assert out.batch["input_ids"].shape == (rows, S)
    assert same(out.batch["position_ids"], torch.arange(S).view(1, S))  # still broadcast
    assert out.batch["weights"].shape == (rows, S)
    for row in range(rows):  # row b*chunks + j holds chunk j of every sample's weights
        j = row % (L // S)
        assert same(out.batch["weights"][row], weights[0, j * S:(j + 1) * S])


def test_keys_accept_a_broadcast_tensor():
    batch = {"inputs_embeds": torch.zeros(B, L, 2), "position_ids": torch.arange(L).view(1, L)}
    out = cut_batch(batch, S, keys=["inputs_embeds", "position_ids"])
    assert (out.batch_size, out.seq_len) == (B, S)
    assert (out.batch["position_ids"].shape == (1, S)
            and out.batch["inputs_embeds"].shape == (B, S, 2))
    with pytest.raises(ValueError, match="disagree"):
        cut_batch({"a": torch.zeros(2, L), "b": torch.zeros(3, L)}, S, keys=["a", "b"])


def test_truncated_broadcast_tensor_does_not_keep_the_full_storage():
    positions = torch.arange(L).view(1, L)
    out = cut_batch({"input_ids": ids(), "position_ids": positions}, S).batch
    assert out["position_ids"].untyped_storage().nbytes() == S * 8


# padding -----------------------------------------------------------------------------------------


def left_padded():
    mask = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1],
                         [0, 0, 1, 1, 1, 1, 1, 1]])
    return {"input_ids": ids() * mask, "attention_mask": mask,
            "labels": torch.where(mask.bool(), ids(), -100)}


def right_padded():
    batch = left_padded()
    return {k: v.flip(1) for k, v in batch.items()}


def test_padding_side():
    assert padding_side(left_padded()) == "left"
    assert padding_side(right_padded()) == "right"
    assert padding_side({"input_ids": ids(), "attention_mask": torch.ones(B, L)}) is None
    assert padding_side({"input_ids": ids()}) is None  # no mask
    assert padding_side(ids()) is None
    both = left_padded()["attention_mask"].clone()
    both[1, -1] = 0  # one row right-padded, others left-padded
    assert padding_side({"attention_mask": both}) is None
    assert padding_side({"attention_mask": torch.tensor([[True, False], [True, True]])}) == "right"
    assert padding_side({"attention_mask": torch.tensor([[0.0, 1.0], [1.0, 1.0]])}) == "left"
    assert padding_side({"attention_mask": torch.zeros(2, 0)}) is None
    assert padding_side({"attention_mask": torch.ones(2, 4, 4)}) is None  # not 2-D
    assert padding_side([ids(), {"attention_mask": torch.tensor([[0, 1], [1, 1]])}]) == "left"
    assert padding_side({"attention_mask": torch.tensor([[0, 1]], device="meta")}) is None


def test_left_padding_keeps_the_real_tokens():
    batch = left_padded()
    original = dict(batch)
    out = cut_batch(batch, S)
    assert out.kept == "last" and out.padding_side == "left" and out.empty_rows == 0
    for key in batch:
        assert same(out.batch[key], original[key][:, -S:])
    assert out.batch["attention_mask"].sum(1).tolist() == [3, 4, 4]
    set_batch_sequence_length(batch, S)  # the in-place form does the same
    assert same(batch["input_ids"], original["input_ids"][:, -S:])


def test_left_padding_with_keep_first_reports_empty_rows():
    out = cut_batch(left_padded(), S, keep="first")
    assert out.kept == "first" and out.padding_side == "left"
    assert out.empty_rows == 1  # row 0 holds only padding in its first S positions
    assert out.batch["attention_mask"][0].sum() == 0


def test_right_padding_keeps_the_first_tokens():
    batch = right_padded()
    out = cut_batch(batch, S)
    assert out.kept == "first" and out.padding_side == "right" and out.empty_rows == 0
    assert same(out.batch["input_ids"], batch["input_ids"][:, :S])
    out = cut_batch(batch, S, keep="last")
    assert out.kept == "last" and out.empty_rows == 1


def test_left_padded_square_mask_keeps_the_last_block():
    batch = left_padded()
    square = torch.arange(B * L * L).reshape(B, 1, L, L)
    batch["mask4"] = square
    out = cut_batch(batch, S).batch
    assert same(out["mask4"], square[..., -S:, -S:])


def test_token_preserving_counts_chunks_of_padding():
    out = cut_batch(left_padded(), S, truncate=False)
    assert out.kept is None and out.padding_side == "left"
    assert out.empty_rows == 1  # the first chunk of row 0
    assert out.batch_size == B * 2


def test_padding_of_a_tuple_batch_is_unknown():
    mask = left_padded()["attention_mask"]
    out = cut_batch((ids(), mask), S)  # no names: a tuple's mask cannot be told from tokens
    assert out.padding_side is None and out.kept == "first" and out.empty_rows is None


def test_fake_tensors_are_cut_without_reading_the_mask():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        batch = {"input_ids": torch.zeros(B, L, dtype=torch.long),
                 "attention_mask": torch.ones(B, L, dtype=torch.long)}
        out = cut_batch(batch, S)
    assert (out.batch["input_ids"].shape == (B, S) and out.padding_side is None
            and out.empty_rows is None)


@pytest.mark.parametrize("keep", ["middle", None, True])
def test_bad_keep(keep):
    with pytest.raises(ValueError, match=r"`keep` must be one of \['auto', 'first', 'last'\], got"):
        cut_batch(left_padded(), S, keep=keep)


# data shorter than the asked length ---------------------------------------------------------------


@pytest.mark.parametrize("truncate", [True, False])
def test_data_shorter_than_asked_reports_the_data_length(truncate):
    batch = {"input_ids": ids(B, 6), "attention_mask": torch.ones(B, 6)}
    out = cut_batch(batch, 16, truncate=truncate)
    assert out.batch is batch and not out.cut and out.shorter_than_asked
    assert (out.batch_size, out.seq_len, out.source_seq_len, out.asked_seq_len) == (B, 6, 6, 16)
    assert infer_batch_shape(out.batch) == (out.batch_size, out.seq_len)
    equal = cut_batch(batch, 6)
    assert not equal.cut and not equal.shorter_than_asked and equal.seq_len == 6


@pytest.mark.parametrize(
    "make",
    [lambda: ids(), lambda: {"input_ids": ids()}, lambda: [torch.arange(L).view(1, L), ids()],
     lambda: (ids(), ids()), lambda: Batch(ids(), ids(), torch.arange(B))],
    ids=["tensor", "dict", "list", "tuple", "dataclass"],
)
@pytest.mark.parametrize("seq_len", [1, S, L - 1, L, 2 * L])
def test_reported_shape_is_the_shape_of_the_result(make, seq_len):
    out = cut_batch(make(), seq_len)
    assert infer_batch_shape(out.batch) == (out.batch_size, out.seq_len) == (B, min(seq_len, L))


def test_numpy_int_seq_len_accepted():
    assert cut_batch(ids(), np.int64(S)).seq_len == S


# read_batch_shape ---------------------------------------------------------------------------------


def test_read_batch_shape_without_fn_is_infer():
    assert read_batch_shape([torch.arange(L).view(1, L), ids()]) == (B, L)


@pytest.mark.parametrize(
    "value",
    [(B, L), [B, L], torch.Size([B, L]), (np.int64(B), np.int32(L)),
     (torch.tensor(B), torch.tensor(L)), (torch.tensor(B, dtype=torch.int32), np.array(L))],
    ids=["tuple", "list", "Size", "numpy", "tensors", "mixed"],
)
def test_read_batch_shape_accepts_and_converts(value):
    shape = read_batch_shape({"x": torch.zeros(B, L)}, lambda batch: value)
    assert shape == (B, L) and all(type(n) is int for n in shape)
    assert type(shape) is tuple


@pytest.mark.parametrize(
    "value",
    [None, (B,), (B, L, 1), "38", 3, (0, L), (B, -1), (True, L), (B, False), (np.bool_(True), L),
     (B, 8.0), (B, np.float64(8)), (torch.tensor(B), torch.tensor(8.0)), (torch.tensor([B]), L),
     (torch.tensor(True), L), (B, "8"), (B, None), {"batch_size": B, "seq_len": L},
     torch.tensor([B, L])],
    ids=lambda v: repr(v)[:30],
)
def test_read_batch_shape_refuses(value):
    with pytest.raises(ValueError, match=r"^`seq_len_fn` must return a pair \(batch_size, "
                       r"seq_len\) of ints >= 1") as err:
        read_batch_shape({"x": torch.zeros(B, L)}, lambda batch: value)
    assert "got " in str(err.value)
    if value is None:
        assert "forget to `return`" in str(err.value)


def test_read_batch_shape_names_the_value():
    with pytest.raises(ValueError, match=r"got \(3, 8\.0\)$"):
        read_batch_shape(None, lambda batch: (3, 8.0))


def test_read_batch_shape_errors_of_the_fn_propagate():
    def broken(batch):
        raise KeyError("tokens")

    with pytest.raises(KeyError):
        read_batch_shape({}, broken)
    with pytest.raises(ValueError, match="`seq_len_fn` must be a callable"):
        read_batch_shape({}, "tokens")


@pytest.mark.parametrize("name, value", [("truncate", "no"), ("truncate", 1), ("truncate", None),
                                         ("in_place", "yes")])
def test_bad_flags(name, value):
    with pytest.raises(ValueError, match=rf"^`{name}` must be True or False, got {value!r}\.$"):
        cut_batch(ids(), S, **{name: value})


@pytest.mark.gpu
def test_cut_on_cuda_reads_the_mask_on_the_device():
    batch = {k: v.cuda() for k, v in left_padded().items()}
    batch["position_ids"] = torch.arange(L, device="cuda").view(1, L)
    out = cut_batch(batch, S)
    assert out.kept == "last" and out.padding_side == "left" and out.empty_rows == 0
    assert all(v.is_cuda for v in out.batch.values())
    assert out.batch["position_ids"].tolist() == [list(range(L - S, L))]
    assert infer_batch_shape(out.batch) == (B, S)
