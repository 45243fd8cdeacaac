"""Forecast the peak memory of training at long sequence lengths without training: plain PyTorch.

    python examples/forecast_without_training.py

Three short training steps (64, 128, 256 tokens) are traced on a copy of the model and optimizer;
the timeline replay and the quadratic fit then predict any length. One step at 512 checks the
forecast.
"""

import copy

import torch
import torch.nn.functional as F

from lightning_seqmem.reference.nn import GPT, GPTConfig
from lightning_seqmem.measure.steps import trace_training_steps


def loss_fn(model, batch):
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def main() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=128, attention="eager"))
    batch_size, longest = 4, 512
    tokens = torch.randint(0, 256, (batch_size, longest + 1))
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    work = copy.deepcopy(model)  # the traced steps update weights: keep the real model untouched
    optimizer = torch.optim.AdamW(work.parameters(), lr=3e-4)
    forecaster = trace_training_steps(work, optimizer, batch, [64, 128, 256], loss_fn,
                                      check_seq_lens=[512])

    for v in forecaster.verifications:
        print(f"check at {v.seq_len}: forecast {v.forecast_bytes / 2**20:.1f} MiB, measured "
              f"{v.measured_bytes / 2**20:.1f} MiB ({v.relative_error:+.1%}, {v.method})")
    print(f"{'seq_len':>8} {'replay (MiB)':>13} {'quadratic (MiB)':>16} {'upper bound (MiB)':>18}")
    for length in (1024, 2048, 4096, 8192):
        replay = forecaster.forecast(length, batch_size, method="replay")
        quadratic = forecaster.forecast(length, batch_size, method="quadratic")
        print(f"{length:8d} {replay.peak_bytes / 2**20:13.1f} {quadratic.peak_bytes / 2**20:16.1f} "
              f"{replay.upper_bytes / 2**20:18.1f}")
    budget = 8 * 2**30
    print(f"largest length that fits 8 GiB at batch {batch_size}: "
          f"{forecaster.max_seq_len(budget, batch_size)} tokens")
    print(f"... at batch 1: {forecaster.max_seq_len(budget, 1)} tokens")


if __name__ == "__main__":
    main()
