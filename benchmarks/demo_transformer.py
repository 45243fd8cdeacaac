"""Lightning's own demo model, ``lightning.pytorch.demos.Transformer`` (``nn.Transformer``, a cached
positional table and causal mask), tiny (d=8, 1 head, 1+1 layers, vocab 64, batch 1, SGD): the dry
run's peak of one training step beside the live-tensor tracker's of a real one (after a warm-up
step), at each ``--lengths``. The real step at 8192 tokens holds about 1.1 GiB and takes seconds to
minutes on a shared 2-core machine.

    python benchmarks/demo_transformer.py
    python benchmarks/demo_transformer.py --lengths 2048 8192
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from lightning.pytorch.demos import LightningTransformer, Transformer

from lightning_seqmem.dryrun.step import dry_run_step
from lightning_seqmem.measure.steps import training_step_memory
from lightning_seqmem.measure.probes import TrackerProbe

MIB = 2**20


class Demo(LightningTransformer):
    def __init__(self, max_len: int) -> None:
        super().__init__(vocab_size=64)
        self.model = Transformer(vocab_size=64, ninp=8, nhead=1, nhid=8, nlayers=1, dropout=0.0)
        self.model.pos_encoder.max_len = max_len  # the demo reads pe[:, L]: more than L positions


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print(f"{'tokens':>7} {'dry run MiB':>12} {'measured MiB':>13} {'error':>8} "
          f"{'dry s':>6} {'real s':>7}")
    for seq_len in args.lengths:
        torch.manual_seed(0)
        model = Demo(seq_len + 8)
        x = torch.randint(0, 64, (1, seq_len + 1))
        batch = (x[:, :-1], x[:, 1:])
        started = time.perf_counter()
        dry = dry_run_step(model, None, (batch[0][:, :64], batch[1][:, :64]), seq_len).peak_bytes
        dry_s = time.perf_counter() - started
        optimizer = model.configure_optimizers()
        step = lambda m, b: m.training_step(b, 0)  # noqa: E731
        # warm-up: gradients, cached pe and mask
        training_step_memory(model, optimizer, batch, step)
        started = time.perf_counter()
        real = training_step_memory(model, optimizer, batch, step, TrackerProbe("cpu")).peak_bytes
        real_s = time.perf_counter() - started
        print(f"{seq_len:>7} {dry / MIB:>12.1f} {real / MIB:>13.1f} {dry / real - 1:>+8.2%} "
              f"{dry_s:>6.1f} {real_s:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
