"""One-command GPU check of SeqMemCallback's CUDA probe and forecasts (< 5 minutes on one GPU).

Without CUDA it prints ``no CUDA device: gpu_check skipped`` and exits 0. With CUDA, for each
variant (attention ``sdpa`` in bf16-mixed and fp32; ``flash`` in bf16-mixed when flash-attn can
run), as time allows:

1. Curriculum run: LitGPT (d=512, 8 layers, 8 heads, batch 4, vocab 256) trained with
   ``SeqMemCallback(curriculum=Curriculum(start=256, target=1024, steps_per_stage=4))``. Every
   record's CUDA probe figures are printed beside an independent reading of
   ``torch.cuda.max_memory_allocated()`` / ``max_memory_reserved()`` for the same step: peaks are
   reset at batch start by a callback placed *before* the SeqMemCallback, and read at batch end in
   the LightningModule's ``on_train_batch_end`` (Lightning calls it after the callbacks). The
   probe itself resets the peak counters at every phase boundary, so the same callback also reads
   them just before the probe does (``on_before_backward``, ``on_before_optimizer_step``); the
   independent step peak is the maximum of the three segments.
2. Forecasts from the curriculum run at 2048, 4096 and 8192 tokens (2x, 4x, 8x the longest
   traced length; 8x-32x the shortest), each compared with a fresh run measured at that length:
   error of the allocated peak (replay and quadratic) and of reserved memory (the forecast peak
   times the reserved/allocated ratio measured so far; and whether ``reserved_upper_bytes``
   covered the measured reserved memory).

3. The ``activation_offload`` rung (also alone: ``--offload-only``): at 2048 and 4096 tokens, in
   fp32 and bf16-mixed, without it, with it, with checkpointing and with both: the dry run's peak
   against the allocator's, the bytes the dry run says go to host against those ``save_on_cpu``
   copied, and the step time.

Every variant and every target length is wrapped: one failure (an OOM, a kernel missing) is
printed and the next one runs. Exit status is 0 unless the script itself is broken.

    python benchmarks/gpu_check.py
    python benchmarks/gpu_check.py --budget-s 200 --targets 2048 4096
    python benchmarks/gpu_check.py --ring   # ring attention (context_parallel) vs the plan, 2 ranks

Ring attention's step cannot run on CPU (``context_parallel`` dispatches CUDA SDPA kernels only):
``--ring`` is where the plan's ring figures meet a measured step (benchmarks/ring_check.py).
    python benchmarks/gpu_check.py --offload-only
"""

from __future__ import annotations

import argparse
import gc
import logging
import tempfile
import time
import traceback
import warnings
from typing import Any, Optional

import torch

warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*litlogger.*")
warnings.filterwarnings("ignore", message=".*LeafSpec.*")
warnings.filterwarnings("ignore", category=DeprecationWarning)

MiB = 2**20

# Model and data of the check (nanoGPT-style: meaning and units beside each value).
D_MODEL = 512  # residual width (features per token)
N_LAYER = 8  # transformer blocks
N_HEAD = 8  # attention heads per block
BATCH_SIZE = 4  # samples per step
VOCAB_SIZE = 256  # token ids
CURRICULUM = dict(start=256, target=1024, steps_per_stage=4)  # tokens; steps at each length
TARGET_STEPS = 4  # steps of a fresh run at a target length (2 warm-up + 2 measured)


def _mib(nbytes: Optional[float]) -> str:
    return "     -" if nbytes is None else f"{nbytes / MiB:8.1f}"


def _pct(x: Optional[float]) -> str:
    return "    -" if x is None else f"{x:+7.2%}"


def _err(pred: Optional[float], measured: Optional[float]) -> Optional[float]:
    if pred is None or not measured:
        return None
    return (pred - measured) / measured


def _cleanup() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def build(args: argparse.Namespace):
    """Classes that need Lightning (imported only on the CUDA path)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from lightning_seqmem.reference.demo import LitGPT

    class IndependentPeaks(Callback):
        """Reads the allocator's peak counters itself; place it before the SeqMemCallback."""

        def __init__(self) -> None:
            self.steps: list[dict[str, int]] = []
            self._allocated: list[int] = []
            self._reserved: list[int] = []

        def _read(self) -> None:
            self._allocated.append(torch.cuda.max_memory_allocated())
            self._reserved.append(torch.cuda.max_memory_reserved())

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._allocated, self._reserved = [], []
            torch.cuda.reset_peak_memory_stats()

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            self._read()  # before the probe's mark_phase("backward") resets the peak

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self._read()  # before the probe's mark_phase("optimizer") resets the peak

        def finish(self) -> None:
            """Called from the LightningModule's on_train_batch_end (after every callback's)."""
            self._read()
            self.steps.append(
                {
                    "peak_bytes": max(self._allocated),
                    "reserved_peak_bytes": max(self._reserved),
                    "reserved_bytes": torch.cuda.memory_reserved(),
                }
            )

    class CheckedLitGPT(LitGPT):
        peak_reader: Optional[IndependentPeaks] = None

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.peak_reader is not None:
                self.peak_reader.finish()

    def trainer(callbacks, max_steps: int, precision: str) -> pl.Trainer:
        return pl.Trainer(
            # the callback's report goes there
            default_root_dir=tempfile.mkdtemp(prefix="seqmem-bench-"),
            accelerator="cuda",
            devices=1,
            precision=precision,
            max_steps=max_steps,
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )

    return IndependentPeaks, CheckedLitGPT, trainer


def train(classes, attention: str, precision: str, seq_len: int, max_steps: int, curriculum=None):
    """A fresh model trained ``max_steps``; returns (SeqMemCallback, IndependentPeaks)."""
    from lightning_seqmem import SeqMemCallback
    from lightning_seqmem.reference.demo import SyntheticTokenDataModule

    IndependentPeaks, CheckedLitGPT, make_trainer = classes
    torch.manual_seed(0)
    reader = IndependentPeaks()
    seqmem = SeqMemCallback(curriculum=curriculum)  # default probe: the CUDA allocator counters
    model = CheckedLitGPT(
        vocab_size=VOCAB_SIZE, n_layer=N_LAYER, n_head=N_HEAD, d_model=D_MODEL, attention=attention
    )
    model.peak_reader = reader
    data = SyntheticTokenDataModule(
        batch_size=BATCH_SIZE, seq_len=seq_len, num_samples=BATCH_SIZE * max_steps,
        vocab_size=VOCAB_SIZE
    )
    trainer = make_trainer([reader, seqmem], max_steps, precision)  # reader BEFORE seqmem
    try:
        trainer.fit(model, datamodule=data)
    finally:
        del trainer, model, data
        _cleanup()
    if seqmem.edge.failed:
        print("  WARNING: SeqMemCallback disabled itself after an internal failure "
              "(see warnings above)")
    return seqmem, reader


def print_records(seqmem, reader) -> None:
    print(
        f"  {'step':>4} {'L':>5} {'flags':<6} {'fwd MiB':>8} {'bwd MiB':>8} {'opt MiB':>8} "
        f"{'peak MiB':>8} "
        f"{'indep':>8} {'diff':>7} {'resv MiB':>8} {'indep':>8} {'frag MiB':>8} {'frag%':>6} "
        f"{'inact MiB':>9} {'retry':>5} {'ooms':>4}"
    )
    for r in seqmem.records:
        ind = reader.steps[r.step] if r.step < len(reader.steps) else {}
        flags = ("w" if r.warmup else "") + ("t" if r.traced else "")
        print(
            f"  {r.step:>4} {r.seq_len:>5} {flags:<6} {_mib(r.forward_peak_bytes)} "
            f"{_mib(r.backward_peak_bytes)} "
            f"{_mib(r.optimizer_peak_bytes)} {_mib(r.peak_bytes)} {_mib(ind.get('peak_bytes'))} "
            f"{_pct(_err(r.peak_bytes, ind.get('peak_bytes')))} {_mib(r.reserved_bytes)} "
            f"{_mib(ind.get('reserved_peak_bytes'))} {_mib(r.fragmentation_bytes)} "
            f"{(r.fragmentation_fraction or 0.0):6.1%} {_mib(r.inactive_split_bytes):>9} "
            f"{r.alloc_retries if r.alloc_retries is not None else '-':>5} "
            f"{r.num_ooms if r.num_ooms is not None else '-':>4}"
        )
    print("  flags: w = warm-up (not fitted), t = traced for the replay; indep = independent "
          "reading, diff = probe vs it")


def check_variant(classes, attention: str, precision: str, targets: list[int],
                  deadline: float) -> list[dict]:
    from lightning_seqmem import Curriculum

    print(f"\n=== attention={attention} precision={precision} ===")
    curriculum = Curriculum(**CURRICULUM)
    t0 = time.perf_counter()
    seqmem, reader = train(
        classes, attention, precision, curriculum.target,
        CURRICULUM["steps_per_stage"] * curriculum.num_stages, curriculum
    )
    print(f"curriculum run {curriculum.stages} took {time.perf_counter() - t0:.1f} s")
    print_records(seqmem, reader)
    traced = sorted(t.seq_len for t in seqmem.forecaster.traces)
    timeline = seqmem.forecaster.timeline
    print(
        f"traced lengths {traced}; replay "
        + ("available" if timeline is not None
           else f"unavailable: {seqmem.forecaster.timeline_unavailable_reason}")
        + f"; reserved/allocated ratio {seqmem.forecaster.reserved_ratio:.3f}"
    )
    forecasts = {}
    for L in targets:
        fc = seqmem.forecast(L, BATCH_SIZE)
        try:
            quad = seqmem.forecaster.forecast(L, BATCH_SIZE, method="quadratic")
        except Exception as exc:  # noqa: BLE001 - informational
            quad = None
            print(f"  quadratic forecast at {L} unavailable: {exc}")
        forecasts[L] = (fc, quad)
        print(
            f"  forecast L={L}: {fc.method} peak {_mib(fc.peak_bytes)} MiB, upper "
            f"{_mib(fc.upper_bytes)} MiB, reserved upper {_mib(fc.reserved_upper_bytes)} MiB"
            + (f"; quadratic peak {_mib(quad.peak_bytes)} MiB" if quad is not None else "")
        )
    ratio = seqmem.forecaster.reserved_ratio
    rows = []
    for L in targets:
        if time.perf_counter() > deadline:
            print(f"  L={L}: skipped (time budget spent)")
            continue
        fc, quad = forecasts[L]
        try:
            t0 = time.perf_counter()
            measured_cb, measured_reader = train(classes, attention, precision, L, TARGET_STEPS)
            done = [r for r in measured_cb.records if not r.warmup]
            if not done:
                raise RuntimeError(f"no non-warm-up step measured at L={L}")
            r = done[-1]
            ind = measured_reader.steps[r.step]
            row = {
                "variant": f"{attention}/{precision}",
                "L": L,
                "method": fc.method,
                "measured": r.peak_bytes,
                "independent": ind["peak_bytes"],
                "err_alloc": _err(fc.peak_bytes, r.peak_bytes),
                "err_quad": _err(quad.peak_bytes if quad else None, r.peak_bytes),
                "upper_ok": fc.upper_bytes >= r.peak_bytes,
                "reserved": r.reserved_bytes,
                "err_reserved": _err(fc.peak_bytes * ratio, r.reserved_bytes),
                "reserved_upper_ok": fc.reserved_upper_bytes >= (r.reserved_bytes or 0),
            }
            rows.append(row)
            print(
                f"  measured L={L} ({time.perf_counter() - t0:.1f} s): "
                f"peak {_mib(r.peak_bytes)} MiB "
                f"(independent {_mib(ind['peak_bytes'])}), reserved {_mib(r.reserved_bytes)} MiB, "
                f"fragmentation {_mib(r.fragmentation_bytes)} MiB, retries {r.alloc_retries}"
            )
        except torch.cuda.OutOfMemoryError as exc:
            print(f"  L={L}: CUDA OOM in the measuring run ({str(exc).splitlines()[0]})")
            _cleanup()
        except Exception:  # noqa: BLE001 - one failure must not stop the check
            print(f"  L={L}: measuring run FAILED:")
            traceback.print_exc()
            _cleanup()
    return rows


OFFLOAD_LENGTHS = (2048, 4096)  # tokens per sample of the activation offload check
OFFLOAD_SETTINGS = ((), ("activation_offload",), ("checkpointing",),
                    ("checkpointing", "activation_offload"))


def check_offload(deadline: float, lengths=OFFLOAD_LENGTHS) -> list[dict]:
    """The ``activation_offload`` rung on CUDA: for each setting and length, the dry run's peak
    (fake CUDA step, 512-byte blocks, resident workspaces) against the allocator's measured peak of
    a real step (``training_step_memory`` with the CUDA probe, after a warm-up step), the bytes the
    dry run says go to host against those ``save_on_cpu`` copied, and the step time (the transfers'
    cost)."""
    from lightning_seqmem.reference.demo import LitGPT
    from lightning_seqmem.dryrun.step import dry_run_step
    from lightning_seqmem.measure.probes import make_probe
    from lightning_seqmem.measure.steps import training_step_memory
    from lightning_seqmem.mitigations import ladder
    from lightning_seqmem.mitigations.activation_offload.activation_offload import (
        offloaded_bytes, reset_offloaded_bytes)

    cuda = torch.device("cuda")
    loss = lambda model, batch: model.training_step(batch, 0)  # noqa: E731
    precisions = [("32-true", None)]
    if torch.cuda.is_bf16_supported():
        precisions.append(("bf16-mixed", lambda: torch.autocast("cuda", dtype=torch.bfloat16)))
    print(f"\n=== activation_offload: LitGPT d={D_MODEL} {N_LAYER} layers, "
          f"batch {BATCH_SIZE}, sdpa ===")
    print(f"  {'precision':<10} {'L':>5} {'setting':<34} {'dry MiB':>8} {'meas MiB':>8} {'err':>7} "
          f"{'host dry':>8} {'host real':>9} {'step ms':>8}")
    rows = []
    for precision, autocast in precisions:
        for L in lengths:
            for setting in OFFLOAD_SETTINGS:
                if time.perf_counter() > deadline:
                    print(f"  {precision} L={L} {setting}: skipped (time budget spent)")
                    continue
                try:
                    torch.manual_seed(0)
                    module = LitGPT(n_layer=N_LAYER, d_model=D_MODEL, n_head=N_HEAD,
                                    vocab_size=VOCAB_SIZE, attention="sdpa").to(cuda)
                    optimizer = module.configure_optimizers()
                    tokens = torch.randint(0, VOCAB_SIZE, (BATCH_SIZE, L + 1), device=cuda)
                    batch = {"input_ids": tokens[:, :-1].contiguous(),
                             "labels": tokens[:, 1:].contiguous()}
                    _cleanup()
                    dry = dry_run_step(module, optimizer, batch, L, BATCH_SIZE, setting, autocast)
                    for name in setting:
                        applied, detail = ladder.try_apply(name, None, module)
                        if not applied:
                            raise RuntimeError(f"{name} did not go on: {detail}")
                    # warm-up
                    training_step_memory(module, optimizer, batch, loss, context=autocast)
                    reset_offloaded_bytes(module)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    measured = training_step_memory(module, optimizer, batch, loss,
                                                    make_probe("cuda", cuda), context=autocast)
                    torch.cuda.synchronize()
                    step_s = time.perf_counter() - t0
                    row = {"precision": precision, "L": L, "setting": " + ".join(setting) or "none",
                           "dry": dry.peak_bytes, "measured": measured.peak_bytes,
                           "err": _err(dry.peak_bytes, measured.peak_bytes),
                           "host_dry": dry.host_bytes,
                           "host_real": offloaded_bytes(module), "step_s": step_s}
                    rows.append(row)
                    print(f"  {precision:<10} {L:>5} {row['setting']:<34} {_mib(row['dry'])} "
                          f"{_mib(row['measured'])} "
                          f"{_pct(row['err'])} {_mib(row['host_dry'])} {_mib(row['host_real'])} "
                          f"{step_s * 1e3:8.1f}")
                    del module, optimizer, batch, tokens
                except torch.cuda.OutOfMemoryError as exc:
                    print(f"  {precision} L={L} {setting}: CUDA OOM ({str(exc).splitlines()[0]})")
                except Exception:  # noqa: BLE001 - one failure must not stop the check
                    print(f"  {precision} L={L} {setting}: FAILED")
                    traceback.print_exc()
                _cleanup()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-s", type=float, default=270.0,
                        help="stop starting new runs after this many seconds")
    parser.add_argument("--targets", type=int, nargs="+", default=[2048, 4096, 8192],
                        help="lengths to forecast and measure")
    parser.add_argument("--ring", action="store_true",
                        help="only the ring attention (context_parallel) check: "
                        "2 ranks, measured per-rank peak against the plan's dry run "
                        "(benchmarks/ring_check.py)")
    parser.add_argument("--offload-only", action="store_true",
                        help="run only the activation_offload check")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if not torch.cuda.is_available():
        print("no CUDA device: gpu_check skipped")
        return 0
    if args.ring:
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from ring_check import check_ring

        try:
            check_ring()
        except Exception:  # noqa: BLE001 - the script reports, it does not fail
            traceback.print_exc()
        return 0
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*self.trainer.*")
    if args.offload_only:
        check_offload(start + args.budget_s)
        print(f"total runtime: {time.perf_counter() - start:.1f} s")
        return 0
    from lightning_seqmem.reference.nn import flash_attn_available, flash_attn_unavailable_reason

    print(
        f"gpu_check: {torch.cuda.get_device_name()} "
        f"({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB), "
        f"torch {torch.__version__}; LitGPT d={D_MODEL} {N_LAYER} layers {N_HEAD} heads, batch "
        f"{BATCH_SIZE}, curriculum {CURRICULUM}"
    )
    variants = []
    if torch.cuda.is_bf16_supported():
        variants.append(("sdpa", "bf16-mixed"))
    variants.append(("sdpa", "32-true"))
    if flash_attn_available() and torch.cuda.is_bf16_supported():
        variants.append(("flash", "bf16-mixed"))
    else:
        print(f"flash variant skipped: {flash_attn_unavailable_reason() or 'no bf16 support'}")
    classes = build(args)
    deadline = start + args.budget_s
    rows: list[dict] = []
    for attention, precision in variants:
        if time.perf_counter() > deadline:
            print(f"\n=== attention={attention} precision={precision}: skipped "
                  "(time budget spent) ===")
            continue
        try:
            rows += check_variant(classes, attention, precision, args.targets, deadline)
        except torch.cuda.OutOfMemoryError as exc:
            print(f"variant {attention}/{precision}: CUDA OOM ({str(exc).splitlines()[0]})")
            _cleanup()
        except Exception:  # noqa: BLE001 - one failure must not stop the next variant
            print(f"variant {attention}/{precision} FAILED:")
            traceback.print_exc()
            _cleanup()
    try:  # the activation_offload rung, last (as time allows; --offload-only runs it alone)
        check_offload(deadline)
    except Exception:  # noqa: BLE001 - the summary still prints
        print("activation_offload check FAILED:")
        traceback.print_exc()
        _cleanup()
    print("\nSUMMARY forecast error = (forecast - measured) / measured, fresh run at each length")
    print(
        f"  {'variant':<18} {'L':>5} {'method':<9} {'alloc err':>9} {'quad err':>9} "
        f"{'upper>=meas':>11} "
        f"{'resv err':>9} {'resv upper>=meas':>16}"
    )
    for row in rows:
        print(
            f"  {row['variant']:<18} {row['L']:>5} {row['method']:<9} {_pct(row['err_alloc']):>9} "
            f"{_pct(row['err_quad']):>9} {str(row['upper_ok']):>11} {_pct(row['err_reserved']):>9} "
            f"{str(row['reserved_upper_ok']):>16}"
        )
    if not rows:
        print("  (no target length was measured)")
    print(f"total runtime: {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
