"""How close is a dry run of a Mixture-of-Experts step to the real one, and what does it cost? (CPU)

Accuracy: tiny random-config Hugging Face MoE models (Mixtral, Qwen2-MoE, OLMoE; 4 experts, top-2),
each experts implementation transformers runs on a CPU (``grouped_mm``, ``batched_mm``,
``eager``), fp32 and bf16 autocast. :func:`~lightning_seqmem.dryrun.step.dry_run_step` forecasts
one training step at ``4·L0`` and ``16·L0`` tokens from a batch of ``L0``; a real step is measured
at that length on a deep copy (AdamW, one warm-up step, then the live-tensor tracker). ``ratio`` is
dry / measured: 1 where no size depends on the routing (``exact``), at least 1 where it does
(``bound``: the heaviest routing, :mod:`lightning_seqmem.dryrun.moe`).

Cost: the dry run alone (no real step) at 8k and 32k tokens, seconds per call.

    python benchmarks/moe_dry_run.py           # L0=32, 2 models' cost rows
    python benchmarks/moe_dry_run.py --quick   # L0=16, 4·L0 only, one cost row at 8k
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch
from torch import nn

from lightning_seqmem.dryrun.step import dry_run_step
from lightning_seqmem.measure.probes import make_probe
from lightning_seqmem.measure.steps import training_step_memory

VOCAB = 256
CPU = torch.device("cpu")
EXPERTS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
}
IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")


class MoELM(nn.Module):
    def __init__(self, model_type: str, experts: str) -> None:
        import transformers

        super().__init__()
        torch.manual_seed(0)
        fields = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, intermediate_size=128, vocab_size=VOCAB,
                      max_position_embeddings=65536, **EXPERTS[model_type])
        config = transformers.AutoConfig.for_model(model_type, **fields)
        self.model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="sdpa", experts_implementation=experts)

    def training_step(self, batch, batch_idx):
        out = self.model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False)
        return out.loss


def _batch(seq_len: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randint(0, VOCAB, (2, seq_len), generator=g) for k in ("input_ids", "labels")}


def _loss(model, batch):
    return model.training_step(batch, 0)


def _measured(module: nn.Module, seq_len: int, autocast) -> int:
    real = copy.deepcopy(module)
    optimizer = torch.optim.AdamW(real.parameters(), lr=1e-3)
    training_step_memory(real, optimizer, _batch(seq_len), _loss, context=autocast)
    probe = make_probe("tracker", CPU)
    step = training_step_memory(real, optimizer, _batch(seq_len), _loss, probe, context=autocast)
    return step.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="L0=16, 4·L0 only, one cost row")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    started = time.perf_counter()
    l0 = 16 if args.quick else 32
    factors = (4,) if args.quick else (4, 16)
    precisions = {"fp32": None, "bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}
    print(f"moe_dry_run: batch 2, vocab {VOCAB}, 2 layers, 4 experts top-2, L0={l0}")
    print(f"{'model':<10} {'experts':<11} {'precision':<9} {'tokens':>6} {'measured MiB':>12} "
          f"{'dry MiB':>8} {'ratio':>7}  routing")
    worst: dict[str, float] = {"exact": 0.0, "bound": 0.0}
    for model_type in EXPERTS:
        for experts in IMPLEMENTATIONS:
            module = MoELM(model_type, experts)
            optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
            for precision, autocast in precisions.items():
                for factor in factors:
                    seq_len = factor * l0
                    dry = dry_run_step(module, optimizer, _batch(l0), seq_len, autocast=autocast)
                    measured = _measured(module, seq_len, autocast)
                    ratio = dry.peak_bytes / measured
                    kind = "bound" if "an upper bound" in dry.detail else "exact"
                    worst[kind] = max(worst[kind], abs(ratio - 1))
                    print(f"{model_type:<10} {experts:<11} {precision:<9} {seq_len:>6} "
                          f"{measured / 2**20:>12.3f} {dry.peak_bytes / 2**20:>8.3f} "
                          f"{ratio:>7.4f}  {kind}")
    print(f"SUMMARY exact: worst |ratio - 1| {100 * worst['exact']:.3f}%; "
          f"bound: worst ratio - 1 {100 * worst['bound']:.3f}%")
    print(f"{'cost':<10} {'experts':<11} {'tokens':>6} {'seconds':>8} {'dry MiB':>9}")
    cost_rows = [("mixtral", "grouped_mm", 8192)] if args.quick else [
        (m, e, n) for m in ("mixtral", "olmoe") for e in ("grouped_mm", "eager")
        for n in (8192, 32768)]
    for model_type, experts, seq_len in cost_rows:
        module = MoELM(model_type, experts)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        dry_run_step(module, optimizer, _batch(l0), 64)  # warm-up
        t0 = time.perf_counter()
        dry = dry_run_step(module, optimizer, _batch(l0), seq_len)
        print(f"{model_type:<10} {experts:<11} {seq_len:>6} {time.perf_counter() - t0:>8.2f} "
              f"{dry.peak_bytes / 2**20:>9.1f}")
    print(f"total runtime: {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
