"""Step time and measured peak of each level of the checkpointing rung, on CPU.

The reference GPT (4 layers, d_model 256, 4 heads, SDPA, vocabulary 512) trains with AdamW on
batches of 2 x 512 tokens: plain, ``selective``, ``2/4`` and every block. Steps are interleaved
(one of each level per round) so machine noise hits every level alike; the median of the last
``--rounds - 2`` rounds is printed with its ratio to the plain step, then each level's peak as
counted by the live-tensor tracker. The ``selective`` step-time prior in
``lightning_seqmem/core/rungs.py`` cites this benchmark.

    python benchmarks/checkpointing_levels.py
    python benchmarks/checkpointing_levels.py --quick --json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.nn.functional as F

from lightning_seqmem.measure.probes import make_probe
from lightning_seqmem.measure.steps import training_step_memory
from lightning_seqmem.mitigations import ladder
from lightning_seqmem.mitigations.base import RungContext
from lightning_seqmem.reference.nn import GPT, GPTConfig

LEVELS = ("plain", "checkpointing:selective", "checkpointing:2/4", "checkpointing")


def _loss(model, ids):
    return F.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="d_model 128, 256 tokens, 4 rounds")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args()
    d_model, seq_len, rounds = (128, 256, 4) if args.quick else (256, 512, args.rounds)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=512, n_layer=4, d_model=d_model, n_head=4, attention="sdpa"))
    ids = torch.randint(0, 512, (2, seq_len), generator=torch.Generator().manual_seed(0))
    models = {}
    for name in LEVELS:
        model = copy.deepcopy(base)
        if name != "plain":
            assert ladder.rung(name).apply(RungContext(model)).applied
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    seconds = {name: [] for name in LEVELS}
    for _ in range(rounds):
        for name, (model, optimizer) in models.items():
            started = time.perf_counter()
            loss = _loss(model, ids)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seconds[name].append(time.perf_counter() - started)
    median = {name: statistics.median(s[2:]) for name, s in seconds.items()}
    peaks = {name: training_step_memory(m, o, ids, _loss,
                                        make_probe("tracker", torch.device("cpu"))).peak_bytes
             for name, (m, o) in models.items()}
    for name in LEVELS:
        print(f"{name:25s} {median[name] * 1e3:8.1f} ms  x{median[name] / median['plain']:.3f}  "
              f"peak {peaks[name] / 2**20:7.2f} MiB")
    if args.json:
        print(json.dumps({"step_time_ratio": {n: median[n] / median["plain"] for n in LEVELS},
                          "peak_bytes": peaks}))


if __name__ == "__main__":
    main()
