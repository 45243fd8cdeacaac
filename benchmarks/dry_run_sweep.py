"""Is the dry run exact on architectures and optimizers it was not built around? (CPU)

Two sweeps of :func:`~lightning_seqmem.dryrun.step.dry_run_step` against a real step measured
by the CPU tracker (exact live tensor bytes; a warm-up step first, so gradients and optimizer state
exist), each from a batch of 16 tokens to a step at 128 (architectures) or 256 (optimizers):

* every Hugging Face causal LM in ``ARCHITECTURES`` (random config, nothing downloaded; 2 layers,
  hidden 64, 4 heads, 2 key-value heads), with ``sdpa`` and ``eager`` attention, with and without
  an ``attention_mask`` that pads a quarter of the first row; AdamW;
* every ``torch.optim`` optimizer in ``OPTIMIZERS`` (Muon over the matrices) on the demo GPT (2
  blocks, width 64), Adafactor included: its step reads ``param.norm().item()``
  (:meth:`.BatchValues.let_step_read`).

Error is ``(dry - measured) / measured``; the target is within 1% everywhere. A row the dry run
refuses prints its reason (a refusal is never a wrong number).

    python benchmarks/dry_run_sweep.py               # both sweeps (about 40 s on 2 cores)
    python benchmarks/dry_run_sweep.py --quick       # llama, qwen2 and four optimizers
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings

import torch

from lightning_seqmem.dryrun.result import DryRunUnsupported
from lightning_seqmem.dryrun.step import dry_run_step
from lightning_seqmem.measure.probes import make_probe
from lightning_seqmem.measure.steps import training_step_memory
from lightning_seqmem.reference.demo import LitGPT

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dry_run import HFLM, VOCAB_SIZE, _loss  # noqa: E402 - the sibling benchmark's LM, loss

TOLERANCE = 0.01
ARCHITECTURES = {  # model_type -> config fields beside the shared ones
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": dict(head_dim=16), "gemma": dict(head_dim=16),
    "gemma3_text": dict(head_dim=16, sliding_window=32), "olmo2": {}, "cohere": {}, "granite": {},
    "starcoder2": {}, "stablelm": {}, "phi": {}, "helium": dict(head_dim=16), "exaone4": {},
    "apertus": {}, "lfm2": {}, "gpt_neox": {}, "falcon": dict(num_kv_heads=2,
                                                              new_decoder_architecture=True),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=1024),
    "gptj": dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8),
}
optim = torch.optim
OPTIMIZERS = {  # name -> params -> optimizer; a name alone is the class with its defaults
    "SGD": lambda p: optim.SGD(p, lr=1e-2),
    "SGD momentum": lambda p: optim.SGD(p, lr=1e-2, momentum=0.9),
    "Adam fused": lambda p: optim.Adam(p, fused=True),
    "AdamW foreach": lambda p: optim.AdamW(p, foreach=True),
    "AdamW amsgrad": lambda p: optim.AdamW(p, amsgrad=True),
    "Adafactor foreach": lambda p: optim.Adafactor(p, foreach=True),
    "Muon (matrices)": lambda p: optim.Muon([q for q in p if q.ndim == 2], lr=1e-3),
    **{name: getattr(optim, name) for name in ("AdamW", "RMSprop", "Adagrad", "NAdam", "RAdam",
                                               "Adamax", "Adadelta", "Rprop", "ASGD", "Adafactor")},
}
QUICK = (("llama", "qwen2"), ("SGD momentum", "AdamW", "Adafactor", "Adafactor foreach"))


def _batch(rows: int, seq_len: int, masked: bool = False) -> dict:
    seed = torch.Generator().manual_seed(0)
    batch = {name: torch.randint(0, VOCAB_SIZE, (rows, seq_len), generator=seed)
             for name in ("input_ids", "labels")}
    if masked:
        batch["attention_mask"] = torch.ones(rows, seq_len, dtype=torch.long)
        batch["attention_mask"][0, : seq_len // 4] = 0
    return batch


def _row(name: str, module: torch.nn.Module, make_optimizer, seq_len: int,
         masked: bool = False) -> float | None:
    """Print one row; its error, or None where the dry run refused."""
    try:
        dry = dry_run_step(module, make_optimizer(module.parameters()), _batch(2, 16, masked),
                           seq_len).peak_bytes
    except DryRunUnsupported as exc:
        print(f"{name:<40} refused: {exc.reason[:80]}")
        return None
    real = copy.deepcopy(module)
    optimizer = make_optimizer(real.parameters())
    batch = _batch(2, seq_len, masked)
    training_step_memory(real, optimizer, batch, _loss)  # the warm-up step
    measured = training_step_memory(real, optimizer, batch, _loss,
                                    make_probe("tracker", torch.device("cpu"))).peak_bytes
    error = (dry - measured) / measured
    print(f"{name:<40} {dry:>12,} {measured:>12,} {error:>+9.4%}", flush=True)
    return error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two architectures, four optimizers")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    architectures, optimizers = QUICK if args.quick else (tuple(ARCHITECTURES), tuple(OPTIMIZERS))
    print(f"{'case':<40} {'dry bytes':>12} {'measured':>12} {'error':>9}")
    errors = []
    for model_type in architectures:
        for attention in ("sdpa", "eager"):
            for masked in (False, True):
                name = f"{model_type} {attention}{' padded' if masked else ''} @128"
                torch.manual_seed(0)
                module = HFLM(model_type, attention, hidden_size=64, intermediate_size=128,
                              num_key_value_heads=2, **ARCHITECTURES[model_type])
                errors.append(_row(name, module, optim.AdamW, 128, masked))
    for name in optimizers:
        torch.manual_seed(0)
        errors.append(_row(f"GPT + {name} @256", LitGPT(d_model=64, n_layer=2),
                           OPTIMIZERS[name], 256))
    answered = [abs(e) for e in errors if e is not None]
    worst = max(answered, default=0.0)
    verdict = "PASS" if answered and worst <= TOLERANCE else "FAIL"
    print(f"SUMMARY worst |error| = {worst:.4%} over {len(answered)} rows, "
          f"{len(errors) - len(answered)} refused: {verdict} (target <= {TOLERANCE:.0%})")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
