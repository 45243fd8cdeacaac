"""FSDP2 ``CPUOffloadPolicy`` planned by dry run on a Llama-3.1-8B-shaped model (bf16, built on \
meta).

    python benchmarks/offload_plan.py                      # 2 layers, 4096 tokens, 1 and 8 ranks
    python benchmarks/offload_plan.py --layers 32 --world-sizes 1

Prints, per world size, the per-rank device peak (simulated CUDA device: 512-byte blocks) and host
peak (pinned blocks rounded up to powers of two) without and with offload, and the seconds each dry
run took. Nothing is allocated: the model is built on ``meta`` and every dry run is fake.
"""

from __future__ import annotations

import argparse
import time

import torch

from lightning_seqmem.dryrun.sharded import sharded_dry_run_step, unsharded_template
from lightning_seqmem.reference.demo import SyntheticTokenDataModule

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_attention_heads=32, num_key_value_heads=8)


class MetaLlama(torch.nn.Module):
    """A Hugging Face Llama built on the meta device in bf16, trained on its own loss."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.for_model("llama", num_hidden_layers=layers, **LLAMA_8B)
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                          dtype=torch.bfloat16)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"],
                          use_cache=False).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    module = MetaLlama(args.layers)
    billions = sum(p.numel() for p in module.parameters()) / 1e9
    print(f"offload_plan: Llama-8B-shaped, {args.layers} layers "
          f"({billions:.2f} B parameters, bf16), "
          f"{args.seq_len} tokens, batch 1")
    batch = next(iter(SyntheticTokenDataModule(batch_size=1, seq_len=64,
                                               vocab_size=LLAMA_8B[
                                                   "vocab_size"]).train_dataloader()))
    template = unsharded_template(module)
    gib = 2**30
    print(f"{'ranks':>5} {'offload':>7} {'device GiB':>10} {'host GiB':>9} {'seconds':>7}")
    for world_size in args.world_sizes:
        for offload in (False, True):
            started = time.perf_counter()
            result = sharded_dry_run_step(template, batch, args.seq_len, world_size, device="cuda",
                                          offload=offload)
            print(f"{world_size:>5} {str(offload):>7} {result.peak_bytes / gib:>10.2f} "
                  f"{result.host_peak_bytes / gib:>9.2f} {time.perf_counter() - started:>7.1f}")


if __name__ == "__main__":
    main()
