"""What is live at the peak of a real CUDA training step, and what the dry run does not see.

Without CUDA it prints ``no CUDA device: cuda_peak_anatomy skipped`` and exits 0. With CUDA, for the
reference GPT (2 layers, d=128, 4 heads, batch 4, AdamW) at each ``--lengths`` and attention:

* ``resident``: ``torch.cuda.memory_allocated()`` before the step minus the bytes of the tensors
  the step starts with (parameters, gradients, optimizer state, batch; 512-byte blocks): memory the
  process holds outside them (cuBLAS / cuBLASLt workspaces, anything else the user keeps).
* the real step's phase peaks (the CUDA allocator probe) beside the dry run's, and their gap;
* with ``torch.cuda.memory._record_memory_history`` on: the blocks allocated during the step and
  live at its peak, largest first, each with the innermost Python frames that allocated it.

    python benchmarks/cuda_peak_anatomy.py
    python benchmarks/cuda_peak_anatomy.py --lengths 1024 2048 --attention eager
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
MIB = 2**20


def _frames(frames: list[dict], n: int = 3) -> str:
    mine = [f for f in frames if "/torch/" not in f.get("filename", "")
            and f.get("filename", "").endswith(".py")]
    ops = [f for f in frames if "at::native" in f.get("name", "")
           or "autograd::generated" in f.get("name", "")]
    pick = (mine or ops or frames)[:n]
    return " <- ".join(f"{os.path.basename(f.get('filename', '?'))}:{f.get('line', '?')} "
                       f"{f.get('name', '?')}" for f in pick)


def live_at_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """Replay a device trace: (peak bytes above the start, blocks live at that moment)."""
    live: dict[int, dict] = {}
    now = peak = 0
    at_peak: list[dict] = []
    for event in trace:
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = event
            now += event["size"]
            if now > peak:
                peak, at_peak = now, list(live.values())
        elif action == "free_completed" and event["addr"] in live:
            now -= live.pop(event["addr"])["size"]
    return peak, at_peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048])
    parser.add_argument("--attention", nargs="+", default=["eager", "sdpa"])
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--cpp", action="store_true",
                        help="record C++ frames too (op names of unnamed blocks)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: cuda_peak_anatomy skipped")
        return 0
    warnings.filterwarnings("ignore")
    from dry_run import _batch, _gpt, _loss

    from lightning_seqmem.dryrun.step import dry_run_step
    from lightning_seqmem.measure.steps import existing_tensors, training_step_memory
    from lightning_seqmem.measure.probes import make_probe, round_cuda_block_bytes

    from lightning_seqmem.dryrun.cuda import resident_bytes, warm_cuda_workspaces

    device = torch.device("cuda")
    probe_model = _gpt(128, "sdpa")().to(device)
    params = list(probe_model.parameters())
    print("resident outside the model's tensors: fresh "
          f"{resident_bytes(device, params) / MIB:.1f} MiB", end="")
    warm_cuda_workspaces(device)
    print(f", after warm_cuda_workspaces {resident_bytes(device, params) / MIB:.1f} MiB", end="")
    opt = torch.optim.AdamW(probe_model.parameters(), lr=1e-4)
    for precision in ("fp32", "bf16"):
        ctx = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if precision == "bf16"
               else None)
        batch = _batch(4, 256, device=device)
        training_step_memory(probe_model, opt, batch, _loss, context=ctx)
        print(f", after a {precision} step "
              f"{resident_bytes(device, existing_tensors(probe_model, [opt], batch)) / MIB:.1f} "
              "MiB", end="")
    print()
    del probe_model, params, opt, batch
    torch.cuda.empty_cache()
    for attention in args.attention:
        for seq_len in args.lengths:
            torch.manual_seed(0)
            module = _gpt(128, attention)().to(device)
            optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
            dry = dry_run_step(module, optimizer, _batch(4, 32, device=device), seq_len)
            real = copy.deepcopy(module)
            opt = torch.optim.AdamW(real.parameters(), lr=1e-4)
            batch = _batch(4, seq_len, seed=1, device=device)
            training_step_memory(real, opt, batch, _loss)  # warm-up: state, workspaces
            del module, optimizer
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            seen: set[int] = set()
            known = 0
            for t in existing_tensors(real, [opt], batch):
                s = t.untyped_storage()
                if s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    known += round_cuda_block_bytes(s.nbytes())
            resident = torch.cuda.memory_allocated() - known
            torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="all" if args.cpp
                                                     else "python")
            m = training_step_memory(real, opt, batch, _loss, make_probe("cuda", device))
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            trace = snapshot["device_traces"][0]
            _, at_peak = live_at_peak(trace)
            print(f"\n=== gpt-2L-d128 {attention} L={seq_len} batch 4 fp32 ===")
            print(f"tensors at start {known / MIB:.1f} MiB; resident outside them "
                  f"{resident / MIB:.1f} MiB")
            for phase in ("forward", "backward", "optimizer"):
                r, d = m.phase_peak_bytes.get(phase, 0), dry.phase_peak_bytes.get(phase, 0)
                print(f"  {phase:<9} real {r / MIB:9.2f} MiB  dry {d / MIB:9.2f} MiB  gap "
                      f"{(r - d) / MIB:+8.2f} MiB")
            print(f"  step      real {m.peak_bytes / MIB:9.2f} MiB  dry "
                  f"{dry.peak_bytes / MIB:9.2f} MiB  "
                  f"gap {(m.peak_bytes - dry.peak_bytes) / MIB:+8.2f} MiB; gap - resident "
                  f"{(m.peak_bytes - dry.peak_bytes - resident) / MIB:+8.2f} MiB")  # fmt: skip
            print(f"  allocated during the step and live at its peak (top {args.top}):")
            for block in sorted(at_peak, key=lambda b: -b["size"])[: args.top]:
                frames = block.get("frames", [])
                print(f"    {block['size'] / MIB:9.2f} MiB  {_frames(frames)}")
                if args.cpp:
                    ops = [f.get("name", "")[:90] for f in frames
                           if "at::native" in f.get("name", "")
                           or "autograd::generated" in f.get("name", "")][:3]
                    print(f"               {' <- '.join(ops)}")
            del real, opt, batch
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
