"""Activation checkpointing covers every stack of repeated blocks (issue 21): on an encoder-decoder
(Lightning's demo ``Transformer``: ``nn.Transformer`` inside) the decoder's layers are wrapped too,
not only the first ``ModuleList`` found on a tie of sizes."""

from __future__ import annotations

import torch
from lightning.pytorch.demos import Transformer

from lightning_seqmem.mitigations.checkpointing.checkpointing import ActivationCheckpointing
from lightning_seqmem.measure.steps import training_step_memory
from lightning_seqmem.measure.probes import make_probe


def _step_peak(block_class_names=None, checkpoint=True) -> tuple[int, str]:
    torch.manual_seed(0)
    model = Transformer(vocab_size=64, ninp=32, nhead=2, nhid=64, nlayers=2, dropout=0.0)
    detail = ""
    if checkpoint:
        result = ActivationCheckpointing(block_class_names).apply(model)
        assert result.applied, result.detail
        detail = result.detail
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 64, (2, 128))

    def loss_fn(m, batch):
        out = m(batch[:, :-1], batch[:, 1:])
        return torch.nn.functional.nll_loss(out.view(-1, out.size(-1)), batch[:, 1:].reshape(-1))

    training_step_memory(model, optimizer, tokens, loss_fn)
    memory = training_step_memory(model, optimizer, tokens, loss_fn,
                                  make_probe("tracker", torch.device("cpu")))
    return memory.peak_bytes, detail


def test_checkpointing_wraps_the_encoder_and_the_decoder():
    plain, _ = _step_peak(checkpoint=False)
    # what the first-found tie chose before
    encoder_only, _ = _step_peak(["TransformerEncoderLayer"])
    both, detail = _step_peak()
    assert "2 x TransformerEncoderLayer + 2 x TransformerDecoderLayer" in detail, detail
    assert both < encoder_only < plain, (plain, encoder_only, both)
