"""Where the peak sits (phase, kinds of tensor), as the live-tensor tracker finds it: on a dry run's
fake step, on a real step, in the planner's forecasts. Tiny reference GPTs; every figure is
traced."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_seqmem.core.peak import PEAK_KINDS, PeakSite
from lightning_seqmem.diagnostics.peak_trace import trace_peak_site
from lightning_seqmem.dryrun.step import dry_run_step
from lightning_seqmem.measure.steps import training_step_memory
from lightning_seqmem.mitigations.checkpointing.checkpointing import ActivationCheckpointing
from lightning_seqmem.plan.planner import SeqMemPlanner
from lightning_seqmem.reference.nn import GPT, GPTConfig


class LM(torch.nn.Module):
    """A LightningModule in practice: ``training_step`` is what the dry run and the real step
    run."""

    def __init__(self, **config):
        super().__init__()
        torch.manual_seed(0)
        self.gpt = GPT(GPTConfig(**config))

    def training_step(self, batch, batch_idx):
        logits = self.gpt(batch["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())


def _batch(vocab, rows=2, length=16):
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, vocab, (rows, length), generator=g),
            "labels": torch.randint(0, vocab, (rows, length), generator=g)}


def _dry_site(model, batch, seq_len, mitigations=()):
    optimizer = torch.optim.AdamW(model.parameters())
    plain = dry_run_step(model, optimizer, batch, seq_len, mitigations=mitigations)
    result = dry_run_step(model, optimizer, batch, seq_len, mitigations=mitigations,
                          site=trace_peak_site)
    # tracing the site leaves the dry run's peak as it was
    assert result.peak_bytes == plain.peak_bytes
    assert plain.peak_site is None and isinstance(result.peak_site, PeakSite)
    return result


def _real_site(model, batch):
    """Where a real training step's peak sits (after a warm-up step), and the tracker probe's own
    peak."""
    from lightning_seqmem.measure.probes import make_probe

    optimizer = torch.optim.AdamW(model.parameters())

    def loss_fn(m, b):
        return m.training_step(b, 0)

    training_step_memory(model, optimizer, batch, loss_fn)
    box = []
    existing = list(model.buffers()) + list(batch.values())
    site = trace_peak_site(
        lambda: box.append(training_step_memory(model, optimizer, batch, loss_fn,
                                                make_probe("tracker", torch.device("cpu")))),
        model, optimizer, existing, seq_len=batch["input_ids"].shape[1],
        batch_size=batch["input_ids"].shape[0])
    return site, box[0].peak_bytes


EAGER = dict(n_layer=2, d_model=64, n_head=4, attention="eager")  # vocab 256: no width equals 512


def test_eager_attention_at_a_long_length_peaks_on_its_scores_in_the_dry_run_and_in_a_real_step():
    model, L = LM(**EAGER), 512
    dry = _dry_site(model, _batch(256), L)
    site = dry.peak_site
    assert site.top_kind == "attention_scores" and site.share("attention_scores") > 0.5, site
    assert site.phase == "backward" and set(dict(site.top_kinds)) <= set(PEAK_KINDS)
    # the kinds add up to the dry run's peak
    assert site.peak_bytes == pytest.approx(dry.peak_bytes, rel=0.01)
    # the same step, run for real: the same site, and the same bytes per kind within 1%
    real, measured = _real_site(LM(**EAGER), _batch(256, length=L))
    assert real.phase == site.phase and real.top_kind == "attention_scores"
    assert real.peak_bytes == pytest.approx(measured, rel=0.01)
    for kind, nbytes in site.top_kinds:
        assert dict(real.top_kinds).get(kind, 0) == pytest.approx(
            nbytes, rel=0.01, abs=64 * 1024), (kind, site, real)


def test_a_large_vocabulary_at_a_short_length_peaks_on_the_logits():
    config = dict(n_layer=2, d_model=32, n_head=4, attention="sdpa", vocab_size=8192)
    site = _dry_site(LM(**config), _batch(8192, rows=4), 128).peak_site
    assert site.top_kind == "logits" and site.share("logits") > 0.5, site
    assert site.share("attention_scores") < 0.05  # SDPA: no L x L scores (a mask at most)
    # the fewer tokens, the smaller the logits' share: a shorter step is held by the weights instead
    short = _dry_site(LM(**config), _batch(8192, rows=1), 8).peak_site
    assert short.share("logits") < site.share("logits"), (short, site)


def test_checkpointing_moves_the_peak_into_the_backward_recompute():
    model, L = LM(**{**EAGER, "attention": "sdpa"}), 512
    plain = _dry_site(model, _batch(256), L).peak_site
    checkpointed = _dry_site(model, _batch(256), L, ("checkpointing",)).peak_site
    assert (plain.phase == "backward" and plain.top_kind == "saved_activations"
            and plain.share("recompute") == 0), plain
    assert checkpointed.phase == "recompute" and checkpointed.share("recompute") > 0.2, checkpointed
    assert checkpointed.share("saved_activations") < plain.share("saved_activations") / 2
    # a real step with checkpointing on: the tracker marks the recomputed tensors there too
    real_model = LM(**{**EAGER, "attention": "sdpa"})
    assert ActivationCheckpointing().apply(real_model).applied
    real, _ = _real_site(real_model, _batch(256, length=L))
    assert real.phase == "recompute" and real.share("recompute") > 0.2, real


def test_parameters_and_optimizer_state_hold_a_big_model_at_a_tiny_length():
    model = LM(n_layer=4, d_model=256, n_head=4, attention="sdpa")
    site = _dry_site(model, _batch(256), 8).peak_site
    weights = sum(site.share(k) for k in ("parameters", "gradients", "optimizer_state"))
    assert (site.top_kind == "optimizer_state"
            and site.share("parameters") + site.share("optimizer_state") > 0.6), site
    assert weights > 0.9 and site.phase == "optimizer", site
    n = sum(p.numel() for p in model.parameters()) * 4
    # AdamW: 2 moments
    assert (dict(site.top_kinds)["parameters"] >= n
            and dict(site.top_kinds)["optimizer_state"] >= 2 * n)


def test_the_planner_says_where_the_peak_sits_in_a_dry_run_forecast():
    model, batch = LM(**EAGER), _batch(256)
    optimizer = torch.optim.AdamW(model.parameters())

    def dry_run(seq_len, batch_size, mitigations):
        r = dry_run_step(model, optimizer, batch, seq_len, batch_size, mitigations,
                         site=trace_peak_site)
        return r.peak_bytes, r.phase_peak_bytes, r.peak_site

    planner = SeqMemPlanner(dry_runner=dry_run)
    fc = planner.evidence.forecast(512, 2, ())
    site = planner.evidence.dry.site(512, 2, ())
    assert fc.method == "dry_run" and site is not None and site.top_kind == "attention_scores"
    assert fc.detail.endswith(f"; peak at {site.describe()}") and "attention scores" in fc.detail
    # a dry run that does not say (two values) leaves the detail as it was
    quiet = SeqMemPlanner(dry_runner=lambda L, B, m: dry_run(L, B, m)[:2])
    assert ("peak at" not in quiet.evidence.forecast(512, 2, ()).detail
            and quiet.evidence.dry.site(512, 2, ()) is None)


def test_peak_site_rejects_unknown_phases_and_kinds():
    with pytest.raises(ValueError, match="`phase` must be one of"):
        PeakSite("warmup", ())
    with pytest.raises(ValueError, match="unknown kinds \\['weights'\\]"):
        PeakSite("forward", (("weights", 1),))
