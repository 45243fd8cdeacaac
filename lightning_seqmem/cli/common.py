"""What the ``seqmem`` commands share: building a LightningCLI config's model and data without
training, the first batch and optimizer, the usable budget, one-line user errors."""

from __future__ import annotations

import sys
import warnings
from typing import Any, Optional, Sequence

__all__ = ["build_from_config"]

_DEFAULT_MODEL = "lightning_seqmem.reference.demo.LitGPT"
_DEFAULT_DATA = "lightning_seqmem.reference.demo.SyntheticTokenDataModule"


def _quiet() -> None:
    """Silence warnings that say nothing to a user of the command (they stay visible elsewhere)."""
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*`self.log\\(\\)` but the `self.trainer` reference.*")
    warnings.filterwarnings("ignore", category=DeprecationWarning)


class _UserError(Exception):
    """A mistake in what the user asked for: :func:`main` prints its message on one line, exit 2."""



def _read_yaml(path: str, command: str = "seqmem forecast") -> dict[str, Any]:
    import yaml

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"{command}: {path} is not a LightningCLI config (a YAML mapping)")
    return data


def build_from_config(config: str, model_class: str = _DEFAULT_MODEL, data_class: str = _DEFAULT_DATA,
                      overrides: Sequence[str] = (), command: str = "seqmem forecast") -> Any:
    """A ``LightningCLI`` (not run) of ``config``: ``.model``, ``.datamodule`` and ``.trainer``.

    The config's ``model``/``data`` sections may name their class (``class_path``); without one
    they configure ``model_class`` / ``data_class``. The trainer is forced to one device without a
    logger (a forecast is per device); a CUDA config is built on the CPU when no GPU is present.
    ``command`` names the command in the messages printed or raised.
    """
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.cli import LightningCLI

    trainer_cfg = _read_yaml(config, command).get("trainer") or {}
    forced = ["--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.devices=1",
              "--trainer.num_nodes=1", "--trainer.strategy=auto"]
    if str(trainer_cfg.get("accelerator", "auto")) in ("cuda", "gpu") and not torch.cuda.is_available():
        print(f"{command}: the config asks for CUDA but none is available: tracing on the CPU "
              "(kernel choice, workspace and fragmentation on a GPU differ)", file=sys.stderr)
        forced.append("--trainer.accelerator=cpu")
    args = ["--model", model_class, "--data", data_class, "--config", config, *forced, *overrides]
    argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when both `args` and sys.argv are given
    try:
        return LightningCLI(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True,
                            subclass_mode_data=True, run=False, args=args, save_config_callback=None)
    finally:
        sys.argv = argv


def _seqmem_callback(trainer: Any) -> Any:
    """The config's :class:`~lightning_seqmem.SeqMemCallback`, or None."""
    from lightning_seqmem import SeqMemCallback

    return next((c for c in trainer.callbacks if isinstance(c, SeqMemCallback)), None)


def _usable_budget(budget: Optional[int], safety_margin: Optional[float], seqmem: Any,
                   device: Any) -> tuple[Optional[int], float, Optional[int]]:
    """``(budget, margin, usable)``: ``budget`` (bytes) if given, else the config's SeqMemCallback
    ``memory_budget``, else the CUDA device's total, else None; ``margin`` likewise (default 0.1);
    ``usable = budget × (1 − margin)``."""
    import torch

    if budget is None and seqmem is not None:
        budget = seqmem.memory_budget_bytes
    if budget is None and device.type == "cuda":
        budget = torch.cuda.get_device_properties(device).total_memory
    margin = safety_margin if safety_margin is not None else (seqmem.safety_margin if seqmem else 0.1)
    return budget, margin, None if budget is None else int(budget * (1 - margin))


def _first_batch(model: Any, datamodule: Any, seq_len: Optional[int] = None) -> Any:
    """The first training batch of the config's data (its datamodule set to ``seq_len`` tokens
    first where it has ``set_seq_len``), else of the model's own ``train_dataloader``."""
    if seq_len is not None and datamodule is not None and callable(getattr(datamodule, "set_seq_len", None)):
        datamodule.set_seq_len(seq_len)
    source = datamodule if datamodule is not None else model
    if datamodule is not None:
        datamodule.prepare_data()
        datamodule.setup("fit")
    return next(iter(source.train_dataloader()))


def _first_optimizer(module: Any) -> tuple[Any, str]:
    import torch

    try:
        conf = module.configure_optimizers()
    except Exception as exc:  # noqa: BLE001 - e.g. a schedule that reads self.trainer
        return torch.optim.AdamW(module.parameters()), f"configure_optimizers() failed ({exc!r}); traced with AdamW"
    while isinstance(conf, (list, tuple)) and conf:
        conf = conf[0]
    if isinstance(conf, dict):
        conf = conf.get("optimizer")
    if isinstance(conf, torch.optim.Optimizer):
        return conf, type(conf).__name__
    return torch.optim.AdamW(module.parameters()), "configure_optimizers() returned no optimizer; traced with AdamW"


def _loss_of(output: Any) -> Any:
    from lightning_seqmem.measure.steps import loss_of

    try:
        return loss_of(output)
    except TypeError as exc:
        raise SystemExit(f"seqmem forecast: {exc} (manual optimisation is not supported)") from None
