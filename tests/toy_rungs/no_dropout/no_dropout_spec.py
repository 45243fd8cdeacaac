"""The ``"no_dropout"`` rung's spec: what the torch-free planner knows of it."""

from __future__ import annotations

from lightning_seqmem.core.rung_spec import RungSpec

SPEC = RungSpec("no_dropout", advice="set dropout to 0", step_time_prior=0.0)
