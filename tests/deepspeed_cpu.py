"""Lightning's ``DeepSpeedStrategy`` on the CPU, for tests: the strategy refuses any accelerator but
CUDA (``setup_environment``) and asks for a device index; DeepSpeed itself runs on its CPU
accelerator with gloo. Nothing else of the strategy is changed: the module is wrapped in a real
``DeepSpeedEngine``, ZeRO stages 0-3 partition and reduce as on a GPU (on one rank)."""

from __future__ import annotations

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
            check = lightning_deepspeed._validate_device_index_selection
            # CPU devices have no index
            lightning_deepspeed._validate_device_index_selection = lambda devices: None
            try:
                super().setup_distributed()
            finally:
                lightning_deepspeed._validate_device_index_selection = check

        @property
        def root_device(self) -> torch.device:
            return torch.device("cpu", 0)  # DeepSpeed's engine reads the device index

    kwargs.setdefault("process_group_backend", "gloo")
    return CPUDeepSpeedStrategy(**kwargs)
