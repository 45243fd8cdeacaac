"""The modelled CUDA kernels against the GPU: a dry run on the simulated device vs a measured CUDA \
step.

A plan made without a GPU dry-runs on the simulated CUDA device, where SDPA's backends, flash-attn,
and their kernels' own buffers are modelled from their sources
(``lightning_seqmem.dryrun.kernels``). This script holds those models against the allocator: for a
small Hugging Face Llama (grouped-query heads) per variant and length, the simulated dry run's peak
(run in a subprocess that sees no CUDA, as on a laptop) beside the measured step peak of the same
model on the GPU, less what the allocator held before the step (cuBLAS workspaces), and the error.

Variants: ``sdpa`` in bf16 (PyTorch's flash kernel), ``sdpa`` in fp32 (memory-efficient), ``sdpa``
in bf16 with a padding mask (memory-efficient, mask expanded), ``flash_attention_2`` in bf16 where
flash-attn is installed (the modelled flash-attn 2 in the dry run).

Without CUDA it prints the simulated dry runs alone (no measured column) and exits 0:

    python benchmarks/kernels_check.py                      # 2048 and 8192 tokens
    python benchmarks/kernels_check.py --lengths 4096 --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Optional

import torch

MiB = 2**20
HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, VOCAB = 512, 2, 8, 2, 1376, 4096  # Llama-like
BATCH = 1  # samples per step
VARIANTS = ("sdpa-bf16", "sdpa-fp32", "sdpa-bf16-padded", "flash_attention_2-bf16")


class _Llama(torch.nn.Module):
    """A random-config Llama training on its own loss (with the batch's padding mask, if any)."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        import transformers

        from lightning_seqmem.dryrun.kernels import modelled_kernels

        implementation, dtype = variant.split("-")[0], variant.split("-")[1]
        config = transformers.LlamaConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                          num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                          intermediate_size=INTERMEDIATE, vocab_size=VOCAB)
        torch.manual_seed(0)
        with modelled_kernels():  # flash-attn modelled where it cannot run
            self.model = transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation=implementation,
                dtype=getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[dtype]))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.model(**batch, use_cache=False).loss


def _batch(variant: str, seq_len: int, device: str) -> dict:
    ids = torch.randint(0, VOCAB, (BATCH, seq_len), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if variant.endswith("padded"):
        mask = torch.ones(BATCH, seq_len, dtype=torch.long)
        mask[:, : seq_len // 8] = 0  # left padding: the mask is not all ones
        batch["attention_mask"] = mask
    return {k: v.to(device) for k, v in batch.items()}


def _loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return model.training_step(batch, 0)


def simulated(variants: list[str], lengths: list[int]) -> list[dict[str, Any]]:
    """Dry runs on the simulated CUDA device (this process must see no CUDA)."""
    from lightning_seqmem.dryrun.step import dry_run_step

    rows = []
    for variant in variants:
        module = _Llama(variant)
        for seq_len in lengths:
            started = time.perf_counter()
            dry = dry_run_step(module, torch.optim.AdamW(module.parameters(), lr=1e-4),
                               _batch(variant, 16, "cpu"), seq_len, device="cuda")
            rows.append({"variant": variant, "seq_len": seq_len, "simulated_bytes": dry.peak_bytes,
                         "kernels": list(dry.modelled_kernels),
                         "seconds": round(time.perf_counter() - started, 2)})
    return rows


def measured(variant: str, seq_len: int) -> Optional[int]:
    """The measured step peak on the GPU less what the allocator held before it (None: failed)."""
    from lightning_seqmem.dryrun.cuda import resident_bytes, warm_cuda_workspaces
    from lightning_seqmem.measure.probes import make_probe
    from lightning_seqmem.measure.steps import training_step_memory

    device = torch.device("cuda")
    try:
        module = _Llama(variant).to(device)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        batch = _batch(variant, seq_len, "cuda")
        warm_cuda_workspaces(device)
        training_step_memory(module, optimizer, batch, _loss)  # warm-up: optimizer state
        tensors = (list(module.parameters()) + list(batch.values())
                   + [v for s in optimizer.state.values() for v in s.values()])
        resident = resident_bytes(device, tensors)
        step = training_step_memory(module, optimizer, batch, _loss, make_probe("cuda", device))
        return step.peak_bytes - resident
    except Exception as exc:  # noqa: BLE001 - one variant failing (OOM, no kernel) is printed
        print(f"  {variant} at {seq_len}: measured step failed: {type(exc).__name__}: {exc}")
        return None
    finally:
        torch.cuda.empty_cache()


def _simulated_in_subprocess(variants: list[str], lengths: list[int]) -> list[dict[str, Any]]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, __file__, "--simulated-json", "--variants", *variants,
                          "--lengths", *map(str, lengths)], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--variants", nargs="+", default=None, choices=VARIANTS)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON at the end")
    parser.add_argument("--simulated-json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import importlib.util

    flash = importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()
    variants = args.variants or [v for v in VARIANTS if flash or not v.startswith("flash")]
    if args.simulated_json:
        print(json.dumps(simulated(variants, args.lengths)))
        return 0
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    rows = (_simulated_in_subprocess(variants, args.lengths) if cuda
            else simulated(variants, args.lengths))
    if not cuda:
        print("no CUDA device: the measured column is skipped (simulated dry runs only)")
    print(f"kernels_check: Llama d={HIDDEN}, {LAYERS} layers, "
          f"{HEADS}/{KV_HEADS} heads, batch {BATCH}")
    print(f"{'variant':<24}{'seq_len':>8}{'simulated MiB':>15}{'measured MiB':>14}{'error':>9}  "
          "kernels")
    for row in rows:
        got = measured(row["variant"], row["seq_len"]) if cuda else None
        row["measured_bytes"] = got
        error = None if not got else (row["simulated_bytes"] - got) / got
        print(f"{row['variant']:<24}{row['seq_len']:>8}{row['simulated_bytes'] / MiB:>15.1f}"
              f"{'-' if got is None else f'{got / MiB:.1f}':>14}"
              f"{'-' if error is None else f'{error:+.2%}':>9}"
              f"  {'; '.join(row['kernels'])}")
    print(f"total runtime: {time.perf_counter() - started:.1f} s")
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
