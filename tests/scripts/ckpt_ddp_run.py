"""Run by tests/test_partial_checkpointing.py: 2 CPU processes (gloo) under DDP, each with its own
sequence length, switch a checkpointing variant on between two steps; each rank writes JSON.

    python tests/scripts/ckpt_ddp_run.py OUT_DIR VARIANT [--seq-lens 32,48]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_seqmem.mitigations import ladder
from lightning_seqmem.mitigations.base import RungContext
from lightning_seqmem.reference.nn import GPT, GPTConfig


def _loss(model, ids):
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _run(rank: int, port: int, out: str, variant: str, seq_lens: list[int]) -> None:
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=64, n_layer=4, d_model=32, n_head=2, attention="sdpa"))
    models = {"plain": DDP(copy.deepcopy(base)), "variant": DDP(copy.deepcopy(base))}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 64, (2, seq_lens[rank]), generator=g) for _ in range(2)]
    result: dict = {"rank": rank}
    for step, ids in enumerate(batches):
        # between steps, on the live module inside DDP, as the callback switches a rung on
        if step == 1:
            inner = models["variant"].module
            rung = ladder.rung(variant)
            result["variants"] = list(ladder.rung("checkpointing").variants(RungContext(inner)))
            applied = rung.apply(RungContext(inner))
            result["applied"] = [applied.applied, applied.detail, applied.before, applied.after]
            result["levels"] = ladder.rung("checkpointing").policy.block_levels(inner)
        for key, model in models.items():
            optimizers[key].zero_grad(set_to_none=True)
            _loss(model, ids).backward()
            if step == 1:
                result.setdefault("grads", {})[key] = [p.grad.double().norm().item()
                                                       for p in model.parameters()]
            optimizers[key].step()
    result["param_sums"] = {k: [p.double().sum().item() for p in m.parameters()]
                            for k, m in models.items()}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("variant")
    parser.add_argument("--seq-lens", default="32,48")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_run, args=(port, args.out, args.variant, [int(x) for x in args.seq_lens.split(",")]),
             nprocs=2)


if __name__ == "__main__":
    main()
