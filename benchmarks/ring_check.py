"""Ring attention (PyTorch ``context_parallel``) on CUDA: a measured per-rank peak against the \
plan's.

Run by ``benchmarks/gpu_check.py`` (``--ring`` for this check alone). Ring attention's real step
(forward and backward) cannot run on CPU: ``context_parallel`` dispatches only the CUDA SDPA kernels
(flash, memory-efficient, cuDNN). Here 2 processes train LitGPT (2 blocks, width 512, 8 heads, fp32,
batch 1) with FSDP2 and ``context_parallel`` over a 2-rank mesh (NCCL on 2 GPUs; with one GPU both
processes share it over gloo, which moves CUDA tensors through the host), measure
``torch.cuda.max_memory_allocated()`` of the second step, and rank 0 dry-runs the same rank shard
with :func:`lightning_seqmem.dryrun.sequence_parallel.sequence_parallel_dry_run_step`
(``kind="ring"``) on the CUDA device. The error is printed, not asserted (the dry run models the CPU
flash kernel's buffers; CUDA kernels' workspaces differ).

    python benchmarks/ring_check.py [SEQ_LEN]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback

import torch

WORLD = 2


def _worker(rank: int, seq_len: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.device_count() >= WORLD else "gloo"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=WORLD)
    result: dict = {"rank": rank, "backend": backend, "seq_len": seq_len}
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.experimental import context_parallel

        from lightning_seqmem.dryrun.sharded import unsharded_template
        from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule

        torch.manual_seed(0)
        model = LitGPT(n_layer=2, d_model=512, n_head=8, attention="sdpa")
        template = unsharded_template(model)
        model = model.to(device)
        mesh = init_device_mesh("cuda", (WORLD,))
        for block in model.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = model.configure_optimizers()
        batch = next(iter(SyntheticTokenDataModule(batch_size=1, seq_len=seq_len,
                                                   num_samples=1).train_dataloader()))

        def step() -> None:
            ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
            with context_parallel(mesh, buffers=[ids, labels], buffer_seq_dims=[1, 1]):
                loss = model.training_step({"input_ids": ids, "labels": labels}, 0)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            optimizer.step()

        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        result["measured_peak_bytes"] = torch.cuda.max_memory_allocated()
        if rank == 0:
            try:
                from lightning_seqmem.dryrun.sequence_parallel import sequence_parallel_dry_run_step

                dry = sequence_parallel_dry_run_step(template, batch, seq_len, WORLD, WORLD, "ring",
                                                     1, device="cuda")
                result["dry_run_peak_bytes"] = dry.peak_bytes
            except Exception as exc:  # noqa: BLE001 - reported
                result["dry_run_error"] = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-2000:]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def check_ring(seq_len: int = 8192) -> list[dict]:
    """Run the 2-process ring step; print and return each rank's result."""
    import torch.multiprocessing as mp

    if not torch.cuda.is_available():
        print("ring check: no CUDA device: skipped (ring attention runs only on CUDA)")
        return []
    print(f"\n=== ring attention (context_parallel) over {WORLD} ranks, {seq_len} tokens "
          f"({torch.cuda.device_count()} GPU(s)) ===")
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(seq_len, 29500 + os.getpid() % 2000, out_dir), nprocs=WORLD)
        ranks = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(WORLD)]
    planned = ranks[0].get("dry_run_peak_bytes")
    for r in ranks:
        if "error" in r:
            print(f"  rank {r['rank']} ({r['backend']}): FAILED {r['error']}\n{r['traceback']}")
            continue
        err = ("" if planned is None else f", plan {planned / 2**20:.1f} MiB "
               f"({(planned - r['measured_peak_bytes']) / r['measured_peak_bytes']:+.1%})")
        print(f"  rank {r['rank']} ({r['backend']}): measured "
              f"{r['measured_peak_bytes'] / 2**20:.1f} MiB{err}")
    if "dry_run_error" in ranks[0]:
        print(f"  plan (dry run) failed: {ranks[0]['dry_run_error']}")
    return ranks


if __name__ == "__main__":
    check_ring(int(sys.argv[1]) if len(sys.argv) > 1 else 8192)
