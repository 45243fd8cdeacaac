"""Run by tests/test_sequence_parallel_plan.py: a Ulysses (all-to-all) sequence-parallel training
step over 2 CPU processes (gloo), FSDP2 over the same 2 ranks; each rank measures its step with the
live-tensor tracker and writes JSON; rank 0 dry-runs the same step (the plan's per-rank figure).

    python tests/scripts/sp_run.py OUT_DIR [SEQ_LEN] [BATCH_SIZE]

Also checked: ``ulysses_attention`` on each rank's chunk equals that chunk of full-length SDPA.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

# tiny model: 2 blocks, width 64, 4 heads (divisible by 2 ranks)
N_LAYER, D_MODEL, N_HEAD = 2, 64, 4
WORLD = 2


def work(rank: int, out_dir: str, seq_len: int, batch_size: int, port: int) -> None:
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_seqmem.dryrun.sequence_parallel import (sequence_parallel_attention,
                                                           sequence_parallel_dry_run_step)
    from lightning_seqmem.dryrun.sharded import unsharded_template
    from lightning_seqmem.dryrun.step_functions import plain_loss as _plain_loss
    from lightning_seqmem.measure.probes import make_probe
    from lightning_seqmem.measure.steps import training_step_memory
    from lightning_seqmem.mitigations.checkpointing.checkpointing import find_repeated_blocks
    from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule

    result: dict = {"rank": rank, "seq_len": seq_len, "batch_size": batch_size}
    local = seq_len // WORLD
    # the all-to-all layout: a rank's chunk of Ulysses attention equals that chunk of full attention
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, N_HEAD, 64, 16) for _ in range(3))
    chunk = slice(rank * 32, (rank + 1) * 32)
    with sequence_parallel_attention("ulysses", WORLD, dist.group.WORLD):
        y = F.scaled_dot_product_attention(q[:, :, chunk], k[:, :, chunk], v[:, :, chunk],
                                           is_causal=True)
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    result["ulysses_max_abs_err"] = float((y - full[:, :, chunk]).abs().max())

    torch.manual_seed(0)
    model = LitGPT(n_layer=N_LAYER, d_model=D_MODEL, n_head=N_HEAD, attention="sdpa")
    template = unsharded_template(model) if rank == 0 else None
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in find_repeated_blocks(model):
        if block is not model:
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = model.configure_optimizers()
    data = SyntheticTokenDataModule(batch_size=batch_size, seq_len=seq_len, num_samples=batch_size)
    batch = next(iter(data.train_dataloader()))
    mine = {key: (t[:, rank * local:(rank + 1) * local] if key != "index" else t)
            for key, t in batch.items()}
    probe = make_probe("tracker", torch.device("cpu"))
    with sequence_parallel_attention("ulysses", WORLD, dist.group.WORLD) as calls:
        # warm-up: gradients and AdamW state exist
        training_step_memory(model, optimizer, mine, _plain_loss)
        started = time.perf_counter()
        memory = training_step_memory(model, optimizer, mine, _plain_loss, probe)
        result["measured_seconds"] = time.perf_counter() - started
    result["attention_calls"] = calls.calls
    result["measured_peak_bytes"] = memory.peak_bytes
    result["measured_phase_peak_bytes"] = dict(memory.phase_peak_bytes)
    dist.barrier()
    if rank == 0:  # the plan's per-rank figure: a dry run of rank 0's shard in a fake process group
        dry = sequence_parallel_dry_run_step(template, batch, seq_len, WORLD, WORLD, "ulysses",
                                             batch_size)
        result["dry_run_peak_bytes"] = dry.peak_bytes
        result["dry_run_phase_peak_bytes"] = dict(dry.phase_peak_bytes)
        result["dry_run_detail"] = dry.detail
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    out_dir = sys.argv[1]
    seq_len = int(sys.argv[2]) if len(sys.argv) > 2 else 512
    batch_size = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    port = 29500 + os.getpid() % 2000
    mp.spawn(work, args=(out_dir, seq_len, batch_size, port), nprocs=WORLD)


if __name__ == "__main__":
    main()
