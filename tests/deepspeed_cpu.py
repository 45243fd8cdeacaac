"""Lightning's ``DeepSpeedStrategy`` on the CPU, for tests: the strategy refuses any accelerator but
CUDA (``setup_environment``) and asks for a device index; DeepSpeed itself runs on its CPU
accelerator with gloo. Nothing else of the strategy is changed: the module is wrapped in a real
``DeepSpeedEngine``, ZeRO stages 0-3 partition and reduce as on a GPU (on one rank). DeepSpeed's
shared-memory all-reduce kernel, which training on one rank never calls, is not compiled."""

from __future__ import annotations

import importlib
from typing import Any

import torch

__all__ = ["cpu_deepspeed_strategy"]


def cpu_deepspeed_strategy(**kwargs: Any) -> Any:
    """A ``DeepSpeedStrategy(**kwargs)`` (gloo) that runs on the CPU accelerator."""
    import lightning.pytorch.strategies.deepspeed as lightning_deepspeed
    from lightning.pytorch.strategies import DeepSpeedStrategy

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        # DeepSpeedStrategy's own refuses a non-CUDA accelerator
        def setup_environment(self) -> None:
            super(DeepSpeedStrategy, self).setup_environment()

        def setup_distributed(self) -> None:
            # ``deepspeed.comm.torch`` the module (the package's attribute ``torch`` is torch)
            deepspeed_torch_comm = importlib.import_module("deepspeed.comm.torch")
            check = lightning_deepspeed._validate_device_index_selection
            build_shm_op = deepspeed_torch_comm.build_shm_op
            # CPU devices have no index
            lightning_deepspeed._validate_device_index_selection = lambda devices: None
            # the CPU backend JIT-compiles its shared-memory all-reduce kernel (a minute of C++ on
            # a fresh machine or venv), used only by ``inference_all_reduce`` across several local
            # ranks (LOCAL_SIZE set): one rank trains here through torch.distributed (gloo)
            deepspeed_torch_comm.build_shm_op = lambda: None
            try:
                super().setup_distributed()
            finally:
                lightning_deepspeed._validate_device_index_selection = check
                deepspeed_torch_comm.build_shm_op = build_shm_op

        @property
        def root_device(self) -> torch.device:
            return torch.device("cpu", 0)  # DeepSpeed's engine reads the device index

    kwargs.setdefault("process_group_backend", "gloo")
    return CPUDeepSpeedStrategy(**kwargs)
