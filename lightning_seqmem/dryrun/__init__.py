"""Dry runs: the user's own step on a fake copy of the module under ``FakeTensorMode``, on one rank
or in a fake process group of N ranks, and the callable the planner is handed."""

# the simulated accelerator must exist before the first backward (autograd counts each device
# type's devices once): registered on import where CUDA is absent (see .accelerator)
from lightning_seqmem.dryrun.accelerator import register_early as _register_early  # noqa: E402

# CUDA's kernels modelled on the simulated device (registered with it)
from lightning_seqmem.dryrun import kernels as _kernels  # noqa: E402,F401

_register_early()
