"""What the ``seqmem`` commands share: a LightningCLI config's model and data built without
training, the first batch and optimizer, the usable budget, one-line user errors.

Example:
    >>> DEFAULT_MODEL
    'lightning_seqmem.reference.demo.LitGPT'
    >>> str(UserError("--start 0: a length is at least 1"))
    '--start 0: a length is at least 1'
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Optional, Sequence

__all__ = ["DEFAULT_DATA", "DEFAULT_MODEL", "UserError", "asks_for_cuda", "build_from_config",
           "config_margin", "find_seqmem_callback", "first_batch", "first_optimizer", "host_budget",
           "quiet_warnings", "usable_budget"]

DEFAULT_MODEL = "lightning_seqmem.reference.demo.LitGPT"
"""The model class of ``seqmem forecast/plan --model-class`` when the config names none."""
DEFAULT_DATA = "lightning_seqmem.reference.demo.SyntheticTokenDataModule"
"""The datamodule class of ``seqmem forecast/plan --data-class`` when the config names none."""


def quiet_warnings() -> None:
    """Silence warnings that say nothing to a user of the command: each command calls it first."""
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore",
                            message=".*`self.log\\(\\)` but the `self.trainer` reference.*")
    warnings.filterwarnings("ignore", category=DeprecationWarning)


class UserError(Exception):
    """A mistake in what the user asked for: :func:`~lightning_seqmem.cli.main.main` prints its
    message on one line and exits with status 2 (no traceback)."""


def _read_yaml(path: str, command: str = "seqmem forecast") -> dict[str, Any]:
    import yaml

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"{command}: {path} is not a LightningCLI config (a YAML mapping)")
    return data


def asks_for_cuda(config: str, command: str = "seqmem plan") -> bool:
    """Whether ``config``'s trainer names a CUDA accelerator (``cuda`` or ``gpu``)."""
    trainer_cfg = _read_yaml(config, command).get("trainer") or {}
    return str(trainer_cfg.get("accelerator", "auto")) in ("cuda", "gpu")


def _cli_class(meta: bool, model_context: Any) -> Any:
    """LightningCLI, or (``meta``) a subclass that builds the model on the ``meta`` device under
    ``model_context()``, then its ``configure_model()`` likewise (as the trainer does in fit)."""
    from lightning.pytorch.cli import LightningCLI

    if not meta:
        return LightningCLI

    class _MetaBuildCLI(LightningCLI):
        def _add_instantiators(self) -> None:
            super()._add_instantiators()
            from lightning.pytorch.cli import _InstantiatorFn, _get_module_type

            lightning_fn = _InstantiatorFn(cli=self, key="model")

            def on_meta(class_type: Any, *args: Any, applied_instantiation_links: dict,
                        **kwargs: Any) -> Any:
                import torch

                with torch.device("meta"), model_context():
                    return lightning_fn(class_type, *args,
                                        applied_instantiation_links=applied_instantiation_links,
                                        **kwargs)

            self.parser.add_instantiator(on_meta, _get_module_type(self._model_class),
                                         subclasses=self.subclass_mode_model, prepend=True)

        def instantiate_classes(self) -> None:
            super().instantiate_classes()
            configure = getattr(self.model, "configure_model", None)
            if callable(configure):
                import torch

                with (torch.device("meta"), model_context(),
                      self.trainer.precision_plugin.module_init_context()):
                    configure()

    return _MetaBuildCLI


def build_from_config(config: str, model_class: str = DEFAULT_MODEL, data_class: str = DEFAULT_DATA,
                      overrides: Sequence[str] = (), command: str = "seqmem forecast",
                      meta: bool = False, model_context: Any = None) -> Any:
    """A ``LightningCLI`` (not run) of ``config``: ``.model``, ``.datamodule`` and ``.trainer``.

    The ``model``/``data`` sections may name their class (``class_path``), else they configure
    ``model_class`` / ``data_class``. The trainer is forced to one device without a logger (a
    forecast is per device); a CUDA config is built on the CPU when no GPU is present. ``meta``: the
    model and its ``configure_model()`` built on ``meta`` (an 8B model costs nothing) under
    ``model_context()`` (default :func:`lightning_seqmem.dryrun.kernels.modelled_kernels`: a
    flash-attn model builds where it cannot run); a model that cannot (its ``__init__`` reads tensor
    values) raises :class:`UserError`. ``command`` names the command in messages."""
    import contextlib

    import lightning.pytorch as pl
    import torch

    forced = ["--trainer.logger=false", "--trainer.enable_progress_bar=false",
              "--trainer.devices=1", "--trainer.num_nodes=1", "--trainer.strategy=auto"]
    if asks_for_cuda(config, command) and not torch.cuda.is_available():
        if not meta:
            print(f"{command}: the config asks for CUDA but none is available: tracing on the CPU "
                  "(kernel choice, workspace and fragmentation on a GPU differ)", file=sys.stderr)
        forced.append("--trainer.accelerator=cpu")
    args = ["--model", model_class, "--data", data_class, "--config", config, *forced, *overrides]
    argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when given `args` and sys.argv
    if model_context is None and meta:
        from lightning_seqmem.dryrun.kernels import modelled_kernels as model_context
    cli_class = _cli_class(meta, model_context or contextlib.nullcontext)
    try:
        return cli_class(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True,
                         subclass_mode_data=True, run=False, args=args, save_config_callback=None)
    except (NotImplementedError, RuntimeError) as exc:
        if meta and "meta" in str(exc):
            raise UserError(f"{command}: the config's model cannot be built on the meta device "
                            "(its __init__ or configure_model() reads tensor values: "
                            f"{type(exc).__name__}: {exc}); make it build without reading values, "
                            "or plan a smaller copy") from None
        raise
    finally:
        sys.argv = argv


def find_seqmem_callback(trainer: Any) -> Any:
    """The config's :class:`~lightning_seqmem.SeqMemCallback`, or None."""
    from lightning_seqmem import SeqMemCallback

    return next((c for c in trainer.callbacks if isinstance(c, SeqMemCallback)), None)


def usable_budget(budget: Optional[int], safety_margin: Optional[float], seqmem: Any,
                   device: Any) -> tuple[Optional[int], float, Optional[int]]:
    """``(budget, margin, usable)``: ``budget`` (bytes) if given, else the config's SeqMemCallback
    ``memory_budget``, else the CUDA device's total, else None; ``margin`` likewise (default 0.1);
    ``usable = budget × (1 − margin)``."""
    from lightning_seqmem.cli.plan_devices import device_budgets

    margin = config_margin(safety_margin, seqmem)
    found = device_budgets(None if budget is None else [budget], margin, seqmem, device)
    if not found:
        return None, margin, None
    return found[0].budget_bytes, margin, found[0].usable_bytes


def config_margin(safety_margin: Optional[float], seqmem: Any) -> float:
    """The safety margin: ``safety_margin`` if given, else the config's SeqMemCallback's, else 0.1.

    >>> config_margin(None, None), config_margin(0.2, None)
    (0.1, 0.2)
    """
    if safety_margin is not None:
        return safety_margin
    return seqmem.config.safety_margin if seqmem else 0.1


def host_budget(host_budget_bytes: Optional[int], seqmem: Any,
                machine: bool = True) -> Optional[int]:
    """The host budget of a plan (bytes): ``--host-budget``, else the config's SeqMemCallback
    ``host_memory_budget``, else (``machine``) this machine's RAM, else None.

    >>> host_budget(2**30, None), host_budget(None, None, machine=False)
    (1073741824, None)
    """
    from lightning_seqmem.plan.budgets import machine_memory_bytes

    if host_budget_bytes is None and seqmem is not None:
        host_budget_bytes = seqmem.config.host_memory_budget_bytes
    if host_budget_bytes is not None or not machine:
        return host_budget_bytes
    return machine_memory_bytes()


def first_batch(model: Any, datamodule: Any, seq_len: Optional[int] = None) -> Any:
    """The first training batch of the config's data (its datamodule set to ``seq_len`` tokens
    first where it has ``set_seq_len``), else of the model's own ``train_dataloader``."""
    if (seq_len is not None and datamodule is not None
            and callable(getattr(datamodule, "set_seq_len", None))):
        datamodule.set_seq_len(seq_len)
    source = datamodule if datamodule is not None else model
    if datamodule is not None:
        datamodule.prepare_data()
        datamodule.setup("fit")
    return next(iter(source.train_dataloader()))


def first_optimizer(module: Any) -> tuple[Any, str]:
    """``(optimizer, what)``: the first optimizer ``module.configure_optimizers()`` returns
    (unwrapped as Lightning does) and its class name; else an ``AdamW`` over its parameters and why.

    >>> import torch
    >>> class Tiny(torch.nn.Linear):
    ...     def configure_optimizers(self):
    ...         return [torch.optim.SGD(self.parameters(), lr=0.1)], []
    >>> first_optimizer(Tiny(2, 2))[1]
    'SGD'
    >>> first_optimizer(torch.nn.Linear(2, 2))[1].endswith("; traced with AdamW")
    True
    """
    import torch

    try:
        conf = module.configure_optimizers()
    except Exception as exc:  # noqa: BLE001 - e.g. a schedule that reads self.trainer
        return (torch.optim.AdamW(module.parameters()),
                f"configure_optimizers() failed ({exc!r}); traced with AdamW")
    while isinstance(conf, (list, tuple)) and conf:
        conf = conf[0]
    if isinstance(conf, dict):
        conf = conf.get("optimizer")
    if isinstance(conf, torch.optim.Optimizer):
        return conf, type(conf).__name__
    return (torch.optim.AdamW(module.parameters()),
            "configure_optimizers() returned no optimizer; traced with AdamW")
