"""Shared fixtures: tiny real models and trainers, and an independent memory reference."""

from __future__ import annotations

import itertools
import os
import random
import socket
import sys
import tempfile
import warnings

import lightning.pytorch as pl
import pytest
import torch

os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
# the test processes already fill the cores (xdist): a plan dry-runs in its own process alone unless
# a test asks for workers (tests/test_plan_workers.py passes --workers)
os.environ.setdefault("SEQMEM_PLAN_WORKERS", "1")
warnings.filterwarnings("ignore", message=".*LeafSpec.*")
warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*litlogger.*")

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    # pytest-xdist: one share of the cores per worker (torch would take all of them in each worker),
    # inherited by the processes a test starts (DDP ranks, benchmark and example scripts)
    _threads = str(max(1, len(os.sched_getaffinity(0)) // _WORKERS))
    os.environ.setdefault("OMP_NUM_THREADS", _threads)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): one worker per core on CPU; none with a GPU, whose tests
    measure the device's memory and must not share it with another test."""
    if torch.cuda.is_available():
        return 0
    return max(1, len(os.sched_getaffinity(0)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _port_range() -> tuple[int, int]:
    """Ports the OS never hands out itself (below the ephemeral range), split between xdist workers.

    Each pytest-xdist worker takes its own slice, so two workers can never pick the same
    MASTER_PORT; being below the ephemeral range, no process's ``bind(0)``/``connect`` (gloo's pair
    sockets, the other worker's store clients) can take it between the choice and the bind either.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    low = 10000
    if ephemeral_low - low < 2000:  # an unusual range: take the ports above it instead
        low, ephemeral_low = 61000, 65535
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), index + 1)
    size = (ephemeral_low - low) // count
    return low + index * size, low + (index + 1) * size


def _ports():
    start, stop = _port_range()
    # another session on the machine starts elsewhere
    first = random.Random(os.getpid()).randrange(start, stop)
    for port in itertools.chain(range(first, stop), itertools.cycle(range(start, stop))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue  # in use: the next one
        yield port


_PORTS = _ports()


@pytest.fixture(autouse=True)
def _master_port(monkeypatch):
    """A fresh MASTER_PORT for every test, inherited by the DDP processes it starts (Lightning uses
    it instead of asking the OS for a free port), from this xdist worker's own slice of ports."""
    monkeypatch.setenv("MASTER_PORT", str(next(_PORTS)))


def make_trainer(callbacks, max_steps, **kwargs) -> pl.Trainer:
    """A quiet CPU trainer for tests; its files (the seqmem report) go to a temporary directory."""
    defaults = dict(
        default_root_dir=tempfile.mkdtemp(prefix="seqmem-test-"),
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return pl.Trainer(max_steps=max_steps, callbacks=callbacks, **defaults)



def fit_messages(callbacks, model, data, max_steps, **kwargs) -> list[str]:
    """``make_trainer(callbacks, max_steps, **kwargs).fit(model, data)`` with every warning recorded
    (none filtered, repeats too): their messages, in the order they came."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(callbacks, max_steps, **kwargs).fit(model, data)
    return [str(w.message) for w in caught]

def measured_step(model, optimizer, batch, loss_fn, probe=None, *, record_events=False,
                  after_warmup=None):
    """One real training step after one unmeasured warm-up step (the first step has no optimizer
    state), measured by ``probe`` (default: the live-tensor tracker on CPU): its ``StepMemory``.
    ``after_warmup()``, when given, runs between the two steps (to reset a counter)."""
    from lightning_seqmem.measure.probes import make_probe
    from lightning_seqmem.measure.steps import training_step_memory

    training_step_memory(model, optimizer, batch, loss_fn)
    if after_warmup is not None:
        after_warmup()
    probe = probe if probe is not None else make_probe("tracker", torch.device("cpu"))
    return training_step_memory(model, optimizer, batch, loss_fn, probe,
                                record_events=record_events)


def plan_config(tmp_path, mitigations, model, data):
    """A ``seqmem plan`` config file on CPU: the demo ``LitGPT`` (``model``: its init_args) on its
    synthetic data (``data``: the data module's init_args), under a callback with a 1GiB budget and
    ``mitigations``."""
    import json

    config = tmp_path / "plan.yaml"
    config.write_text(f"""
trainer:
  accelerator: cpu
  logger: false
  enable_checkpointing: false
  callbacks:
    - class_path: lightning_seqmem.SeqMemCallback
      init_args:
        memory_budget: 1GiB
        mitigations: {json.dumps(list(mitigations))}
model:
  class_path: lightning_seqmem.reference.demo.LitGPT
  init_args: {json.dumps(model)}
data:
  class_path: lightning_seqmem.reference.demo.SyntheticTokenDataModule
  init_args: {json.dumps(data)}
""")
    return config


def plan_json(config, capsys, lengths):
    """The JSON ``seqmem plan --config CONFIG --lengths ... --json`` prints (it must exit 0)."""
    import json

    from lightning_seqmem.cli.main import main

    assert main(["plan", "--config", str(config), "--lengths", *map(str, lengths), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def ddp_full_and_micro(fit, out) -> None:
    """A test module's ``__main__`` under DDP: ``fit(None)`` (the full batch) then ``fit(1)``
    (micro-batches of one sample) in one launch (the launcher re-runs the script for rank 1, which
    runs both too); rank 0 saves ``{"full": ..., "micro": ...}`` to ``out``."""
    results = {"full": fit(None), "micro": fit(1)}
    if results["full"]["rank"] == 0:
        torch.save(results, out)


def launch_ddp_script(script, tmp_path, base_s):
    """Run a test module as a script (its ``__main__``: :func:`ddp_full_and_micro`) in ``tmp_path``,
    without the rank variables of this process (MASTER_PORT: this test's own, see ``_master_port``),
    under the hang guard of ``base_s`` seconds; it must exit 0. What rank 0 saved."""
    from limits import run

    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR"):
        env.pop(name, None)
    out = tmp_path / "ddp.pt"
    proc = run([sys.executable, str(script), str(out)], base_s, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


def planner_batches(p, shape, n, applicable, peak_fn, static_bytes, switch_on, seconds_fn=None):
    """``n`` batches of ``shape`` (batch size, length) as the callback runs them through planner
    ``p``: decide, commit, ``switch_on(p, decision, L, B)`` (the rungs the decision names), begin
    the step, measure ``peak_fn(L, B, rungs on)`` (a step starting and ending at ``static_bytes``),
    observe it (with ``seconds_fn(L, B, rungs on)`` as its wall time, if given), end the batch.
    ``[(decision, record)]`` in order."""
    from lightning_seqmem.core.records import StepMemory

    out = []
    for _ in range(n):
        d = p.decide(shape, applicable)
        p.commit(d)
        L = d.seq_len or shape[1]
        B = p.course.batch_at(shape[0], shape[1], L) if p.settings.curriculum else shape[0]
        switch_on(p, d, L, B)
        s = p.begin_step(L, B, True, global_step=p.course.step)
        value = peak_fn(L, B, p.ladder.applied)
        seconds = None if seconds_fn is None else seconds_fn(L, B, p.ladder.applied)
        out.append((d, p.observe(s, StepMemory(value, {"forward": value}, static_bytes,
                                               static_bytes), step_seconds=seconds)))
        p.course.end_batch()
    return out
