"""The callback's run state is one :class:`~lightning_seqmem.trainer.run_state.EdgeState`, cb.edge.

Real fits of a tiny eager GPT on the CPU tracker (no budget, no dry run: a few steps each): the
state holds what its docstring table says during and after a fit, a second fit starts from a fresh
one (on the same Trainer and module only the breakdown results are carried), and no module of
``lightning_seqmem/trainer/`` but ``callback.py`` reads the callback's private names (the parts
use ``cb.edge`` and :mod:`lightning_seqmem.trainer.guard`).
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import warnings

import torch
from lightning.pytorch.callbacks import Callback

from conftest import make_trainer
from lightning_seqmem import Curriculum, SeqMemCallback
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.plan.schedule import PendingStep
from lightning_seqmem.trainer.run_state import EdgeState

TRAINER_DIR = pathlib.Path(__file__).resolve().parents[1] / "lightning_seqmem" / "trainer"
# setup sets them again after the reset
SET_BY_SETUP = {"probe", "device", "fit_refs", "sharding_template"}


class Spy(Callback):
    """After the SeqMemCallback in the list: the state it holds at setup and at each backward."""

    def __init__(self, cb: SeqMemCallback) -> None:
        self.cb, self.at_setup, self.in_step = cb, [], []

    def setup(self, trainer, pl_module, stage):
        state = self.cb.edge
        self.at_setup.append((state,
                              {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}))

    def on_before_backward(self, trainer, pl_module, loss):
        self.in_step.append((self.cb.edge.pending, self.cb.edge.step_started_s, self.cb.edge.shape))


def _fit(steps: int, cb: SeqMemCallback = None, trainer=None, module=None):
    torch.manual_seed(0)
    cb = cb or SeqMemCallback(warmup_steps=1, dry_run=False, summary=False,
                              curriculum=Curriculum(start=16, target=32, steps_per_stage=2))
    spy = Spy(cb)
    trainer = trainer or make_trainer([cb, spy], max_steps=steps)
    module = module or LitGPT(n_layer=1, d_model=32, n_head=2)
    with warnings.catch_warnings():
        # "this fit starts afresh" on a new Trainer: said, not tested here
        warnings.simplefilter("ignore")
        trainer.fit(module, SyntheticTokenDataModule(batch_size=2, seq_len=32, num_samples=16))
    return cb, spy, trainer, module


def test_after_a_short_fit_the_state_holds_what_its_table_says():
    cb, spy, trainer, module = _fit(4)
    state = cb.edge
    assert isinstance(state, EdgeState) and [r.seq_len for r in cb.records] == [16, 16, 32, 32]
    # during each step: the step begun at its batch start, timed from then, at the length cut
    assert len(spy.in_step) == 4
    for (pending, started_s, shape), record in zip(spy.in_step, cb.records):
        assert isinstance(pending, PendingStep) and pending.seq_len == record.seq_len
        assert isinstance(started_s, float) and shape == (2, record.seq_len)
    # after the batch end: nothing pending, the last cut kept
    assert state.pending is None and state.step_started_s is None and state.shape == (2, 32)
    # a mapping: cut in place
    assert not state.failed and not state.stopped and not state.uses_datamodule_length
    assert (state.probe.name == "tracker" and not state.probe.running
            and state.device == torch.device("cpu"))
    assert state.fit_refs[0]() is trainer and state.fit_refs[1]() is module
    assert (state.dry_runner is None and state.compiled_reason is None
            and state.breakdown_batch is None)
    assert (state.resume_phrases == [] and state.resume_removed == ()
            and not state.reapply_on_fit_start)
    # the names users and tests read are the state's
    assert (cb.edge.failed is state.failed and cb.edge.probe is state.probe
            and cb.breakdowns is state.breakdowns)
    assert cb.breakdown_report is None and cb.breakdown_table is None


def _fresh_but_for(snapshot: dict, kept: set) -> list[str]:
    """The fields of a state seen at setup that differ from a fresh EdgeState's, less ``kept``."""
    fresh = EdgeState()
    return [name for name, value in snapshot.items()
            if name not in SET_BY_SETUP | kept and value != getattr(fresh, name)]


def test_a_second_fit_with_a_new_trainer_starts_from_a_fresh_state():
    cb, _, _, _ = _fit(3)
    first = cb.edge
    first.breakdown_report = {"from": "the first fit"}  # as a breakdown would leave it
    assert first.shape is not None and first.fit_refs is not None  # the first fit left its marks
    _, spy, trainer, _ = _fit(2, cb=cb)
    (state, snapshot), = spy.at_setup
    assert state is not first and state is cb.edge
    assert _fresh_but_for(snapshot, kept=set()) == []
    assert cb.edge.breakdown_report is None  # a new Trainer: not the first fit's
    assert cb.edge.fit_refs[0]() is trainer and len(spy.in_step) == 2


def test_a_second_fit_on_the_same_trainer_and_module_keeps_only_the_breakdown_results():
    cb, _, trainer, module = _fit(2)
    first = cb.edge
    first.breakdown_report, first.breakdowns = {"from": "the first fit"}, ["a breakdown"]
    spy = Spy(cb)
    trainer.callbacks.append(spy)
    trainer.fit_loop.epoch_loop.max_steps = 3  # one more step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, SyntheticTokenDataModule(batch_size=2, seq_len=32, num_samples=16))
    (state, snapshot), = spy.at_setup
    assert state is not first
    assert _fresh_but_for(snapshot, kept={"breakdowns", "breakdown_report"}) == []
    assert (state.breakdowns is first.breakdowns
            and cb.edge.breakdown_report == {"from": "the first fit"})


# -- no trainer/ module but callback.py reads the callback's private names ------------------------

CALLBACK_NAMES = {"cb", "callback"}


def private_reads(source: str) -> list[str]:
    """``name._attr`` (and ``getattr(name, "_attr")``, ``setattr``, ``hasattr``) where ``name`` is
    ``cb``, ``callback`` or a parameter annotated ``SeqMemCallback``."""
    tree = ast.parse(source)
    names = set(CALLBACK_NAMES)
    for node in ast.walk(tree):
        if (isinstance(node, ast.arg) and node.annotation is not None
                and "SeqMemCallback" in ast.unparse(node.annotation)):
            names.add(node.arg)
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in names):
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append(f"{node.value.id}.{node.attr} (line {node.lineno})")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
              and len(node.args) >= 2
              and isinstance(node.args[0], ast.Name) and node.args[0].id in names
              and isinstance(node.args[1], ast.Constant)
              and str(node.args[1].value).startswith("_")):
            found.append(
                f"{node.func.id}({node.args[0].id}, {node.args[1].value!r}) (line {node.lineno})")
    return found


def test_the_private_name_finder_finds_each_form():
    source = ("def f(cb, other: 'SeqMemCallback', x):\n"
              "    cb._pending = None\n"
              "    getattr(cb, '_last_fit', None)\n"
              "    other._fail('where', None)\n"
              "    return x._pending, cb.edge.pending, cb.__class__\n")
    assert sorted(private_reads(source)) == ["cb._pending (line 2)",
                                             "getattr(cb, '_last_fit') (line 3)",
                                             "other._fail (line 4)"]


def test_no_trainer_module_but_the_callback_reads_its_private_names():
    modules = sorted(p for p in TRAINER_DIR.glob("*.py") if p.name != "callback.py")
    assert ({"guard.py", "batch_cycle.py", "fit_cycle.py", "own_memory.py"}
            <= {p.name for p in modules})
    found = {p.name: private_reads(p.read_text()) for p in modules}
    assert {name: reads for name, reads in found.items() if reads} == {}
