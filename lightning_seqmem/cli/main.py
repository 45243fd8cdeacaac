"""The ``seqmem`` command (``seqmem COMMAND --help`` lists the options): ``demo`` (train the
reference GPT under :class:`~lightning_seqmem.SeqMemCallback` and report), ``panels``,
``report PATH`` (print a saved report), ``forecast`` (trace a few short steps of a LightningCLI
config's model on a copy) and ``plan`` (dry-run one step per length and mitigation set on fake
tensors and pick the cheapest set that fits)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, NoReturn, Optional, Sequence

__all__ = ["main"]

from lightning_seqmem.cli.common import DEFAULT_DATA, DEFAULT_MODEL, UserError, quiet_warnings
from lightning_seqmem.cli.forecast_command import run_forecast
from lightning_seqmem.cli.plan import run_plan


# ---- seqmem demo -----------------------------------------------------------------------------
def _demo(args: argparse.Namespace) -> int:
    import torch

    if args.accelerator in ("cuda", "gpu") and not torch.cuda.is_available():
        raise UserError(f"--accelerator {args.accelerator}: this machine has no CUDA device "
                         "(torch.cuda.is_available() is False); use --accelerator cpu")
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_seqmem import Curriculum, SeqMemCallback
    from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
    from lightning_seqmem.present.report import load_report
    from lightning_seqmem.present.render import render_console, stdout_console

    quiet_warnings()
    console = stdout_console()
    pl.seed_everything(args.seed, verbose=False)
    curriculum = Curriculum(start=args.start, target=args.target,
                            steps_per_stage=args.steps_per_stage)
    # the demo prints the whole report below, so not the callback's end-of-fit summary too
    callback = SeqMemCallback(memory_budget=args.budget, curriculum=curriculum,
                              mitigations=tuple(args.mitigations), summary=False)
    # every stage, plus room for each mitigation's re-measurement (3 lengths x 2 steps)
    max_steps = (args.max_steps
                 or curriculum.num_stages * curriculum.steps_per_stage + 6 * len(args.mitigations))
    logger = TensorBoardLogger(save_dir=args.out, name="demo")
    model = LitGPT(n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head,
                   attention=args.attention)
    datamodule = SyntheticTokenDataModule(batch_size=args.batch_size,
                                          seq_len=curriculum.stages[-1],
                                          num_samples=max_steps * args.batch_size)
    trainer = pl.Trainer(max_steps=max_steps, accelerator=args.accelerator, devices=1,
                         logger=logger, callbacks=[callback], enable_checkpointing=False,
                         enable_model_summary=False, log_every_n_steps=1)
    console.print(f"[bold]seqmem demo[/bold]: {args.n_layer}-layer GPT (d={args.d_model}, "
                  f"{args.attention} attention), batch {args.batch_size}, curriculum "
                  f"{' → '.join(map(str, curriculum.stages))} "
                  f"({curriculum.steps_per_stage} steps each), {max_steps} steps, "
                  f"budget {args.budget or 'none'}")
    trainer.fit(model, datamodule=datamodule)  # the callback writes the panels, figure and report
    paths = callback.write_report(trainer)  # again, to get the paths (same content)
    assert paths is not None  # a single process is rank zero
    render_console(load_report(paths[0]), console)
    console.print(f"TensorBoard logs: {logger.log_dir}   (view: [bold]tensorboard --logdir "
                  f"{args.out}[/bold], tabs SCALARS, CUSTOM SCALARS and IMAGES)")
    console.print(f"Report: {paths[0]}\n        {paths[1]}\n        {paths[2]}")
    return 0


def _folders_below(folder: Path, pattern: str) -> str:
    """The first three folders below ``folder`` holding ``pattern``, as the end of an error."""
    found = sorted({str(p.parent) for p in folder.rglob(pattern)})[:3]
    return f"; these folders below it do: {', '.join(found)}" if found else ""


def _panels(args: argparse.Namespace) -> int:
    folder = Path(args.log_dir)
    if not folder.is_dir():
        raise UserError(f"no such folder: {args.log_dir!r} (a run's log folder holding "
                         "events.out.tfevents.* files, e.g. seqmem_runs/demo/version_0)")
    if not any(folder.glob("events.out.tfevents.*")):
        raise UserError(f"{args.log_dir!r} holds no TensorBoard event files (events.out.tfevents.*)"
                         + _folders_below(folder, "events.out.tfevents.*"))
    from lightning_seqmem.present.panels import render_panels

    render_panels(args.log_dir, args.out)
    print(f"panels of {args.log_dir} written to {args.out}")
    return 0


# ---- seqmem report ---------------------------------------------------------------------------
def _report(args: argparse.Namespace) -> int:
    from lightning_seqmem.present.report import JSON_NAME, load_report
    from lightning_seqmem.present.render import render_console, render_markdown

    path = Path(args.path)
    if not path.exists():
        raise UserError(f"no such file or folder: {args.path!r} (a {JSON_NAME}, or the run folder "
                         "holding it: the logger's version_N/, e.g. seqmem_runs/demo/version_0)")
    if path.is_dir() and not (path / JSON_NAME).is_file():
        raise UserError(f"{args.path!r} holds no {JSON_NAME} (written at the end of fit to the "
                         "logger's version_N/)" + _folders_below(path, JSON_NAME))

    report = load_report(args.path)
    if args.markdown:
        sys.stdout.write(render_markdown(report))
    else:
        render_console(report)
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, with every usage error on one line (what is wrong and where to read more)."""

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _budget_text(text: str) -> str:
    """``--budget`` of ``seqmem demo``: checked here, handed on as written."""
    _bytes(text)
    return text


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number (≥ 1), got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError("must be a fraction in [0, 1) (e.g. 0.1 keeps 10% free), "
                                         f"got {text!r}")
    return value


def _bytes(text: str) -> int:
    from lightning_seqmem.core.units import parse_bytes

    try:
        return parse_bytes(text, "--budget")
    except ValueError as err:
        hint = ""
        unit = text.strip()[-1:].upper()
        if unit in "KMGT" and unit and text.strip()[:-1].replace(".", "", 1).isdigit():
            hint = (f" (for {text!r} write {text.strip()[:-1]}{unit}iB, powers of 1024, or "
                    f"{text.strip()[:-1]}{unit}B, powers of 1000)")
        raise argparse.ArgumentTypeError(str(err).replace("`--budget` must", "must", 1)
                                         + hint) from None


def _device_budget(text: str) -> Any:
    from lightning_seqmem.cli.plan_devices import DEVICE_MEMORY

    if text.strip().lower() in DEVICE_MEMORY:
        return text.strip().lower()
    return _bytes(text)


def _config_file(text: str) -> str:
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text!r} (a LightningCLI YAML config, "
                                         "e.g. configs/cpu_demo.yaml)")
    return text


# ---- Parser ----------------------------------------------------------------------------------
def _add_demo(sub: Any) -> None:
    """``seqmem demo``: its options, checked by argparse (the rest by :func:`_check_demo`)."""
    from lightning_seqmem.core.rungs import MITIGATIONS

    demo = sub.add_parser(
        "demo", help="train a small GPT with a sequence-length curriculum and report its memory",
        description="Train the reference GPT on random tokens (CPU by default) with a growing "
        "sequence length under SeqMemCallback; log to TensorBoard and write the report.")
    demo.add_argument("--max-steps", type=_positive_int, default=None,
                      help="training steps (default: stages × steps-per-stage + 6 per mitigation, "
                      "48 with the defaults)")
    demo.add_argument("--out", default="seqmem_runs",
                      help="TensorBoard save_dir; the report goes in the run's log_dir")
    demo.add_argument("--budget", default="200MiB", type=_budget_text,
                      help="memory budget, e.g. 1GiB or 900MB; units B, KB, MB, GB, TB (powers of "
                      "1000), KiB, MiB, GiB, TiB (powers of 1024) (default 200MiB: eager attention "
                      "at 1024 tokens would not fit, so the callback switches on SDPA before that "
                      "stage)")
    demo.add_argument("--mitigations", nargs="*", default=list(MITIGATIONS),
                      help="the ladder, in order (none: warn and cap the curriculum instead)")
    demo.add_argument("--attention", choices=("eager", "sdpa"), default="eager",
                      help="eager materialises the L×L scores (quadratic memory); sdpa does not on "
                      "CPU")
    demo.add_argument("--start", type=_positive_int, default=64,
                      help="first sequence length (tokens)")
    demo.add_argument("--target", type=_positive_int, default=1024,
                      help="last sequence length (tokens)")
    demo.add_argument("--steps-per-stage", type=_positive_int, default=6,
                      help="steps at each length")
    demo.add_argument("--batch-size", type=_positive_int, default=4, help="samples per batch")
    demo.add_argument("--n-layer", type=_positive_int, default=2, help="transformer blocks")
    demo.add_argument("--d-model", type=_positive_int, default=128, help="model width")
    demo.add_argument("--n-head", type=_positive_int, default=4, help="attention heads")
    demo.add_argument("--accelerator", default="cpu",
                      help="Lightning accelerator (cpu, cuda, auto)")
    demo.add_argument("--seed", type=int, default=0, help="random seed")
    demo.set_defaults(func=_demo)


def _add_panels_and_report(sub: Any) -> None:
    """``seqmem panels LOG_DIR`` and ``seqmem report PATH``."""
    panels = sub.add_parser("panels", help="draw a run's TensorBoard panels to a PNG",
                            description="Read a run's event files and draw the seqmem "
                            "custom-scalars panels to a PNG.")
    panels.add_argument("log_dir", help="the run's log directory (holding events.out.tfevents.*)")
    panels.add_argument("--out", default="seqmem_panels.png", help="PNG to write")
    panels.set_defaults(func=_panels)

    report = sub.add_parser("report", help="print a saved report",
                            description="Print a saved seqmem report.")
    report.add_argument("path", help="seqmem_report.json, or the directory holding it")
    report.add_argument("--markdown", action="store_true",
                        help="print the Markdown summary instead of tables")
    report.set_defaults(func=_report)


def _add_config_options(command: Any, lengths: str) -> None:
    """The options ``seqmem forecast`` and ``seqmem plan`` share, checked alike."""
    command.add_argument("--config", required=True, type=_config_file,
                         help="LightningCLI YAML (model, data, trainer sections)")
    command.add_argument("--lengths", type=_positive_int, nargs="+", required=True,
                         help=f"sequence lengths {lengths} (tokens, ≥ 1)")
    command.add_argument("--batch-size", type=_positive_int, default=None,
                         help="samples per step (default: the data's)")
    command.add_argument("--safety-margin", type=_fraction, default=None,
                         help="fraction of the budget kept free, in [0, 1) (default: the config's "
                         "SeqMemCallback, else 0.1)")
    command.add_argument("--model-class", default=DEFAULT_MODEL,
                         help="model class when the config names none")
    command.add_argument("--data-class", default=DEFAULT_DATA,
                         help="datamodule class when the config names none")


def _add_forecast(sub: Any) -> None:
    """``seqmem forecast``: its options."""
    forecast = sub.add_parser(
        "forecast",
        help="predict peak memory at given lengths from a LightningCLI config, without training",
        description="Build the model and data of a LightningCLI config, trace a few short "
        "training steps on a copy of the model (nothing is trained), and print the forecast "
        "peak at each length, the largest length that fits the budget, and where the memory "
        "goes (by kind and module, attention share, crossover length, diagnoses).")
    _add_config_options(forecast, "to forecast")
    forecast.add_argument("--budget", default=None, type=_budget_text,
                          help="memory budget, e.g. 12GiB (default: the config's SeqMemCallback "
                          "memory_budget, else the GPU's total memory)")
    forecast.add_argument("--trace-lengths", type=_positive_int, nargs="+", default=None,
                          help="short lengths to trace (default 64 128 256, then a check at 512)")
    forecast.add_argument("--no-check", action="store_true",
                          help="skip the check step at a longer length")
    forecast.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=True,
                          help="after the forecast, trace one step per traced length on a fresh "
                          "copy and show where the memory goes: by kind and module, extrapolated "
                          "to the longest length asked, the attention share, the crossover length "
                          "and diagnoses (default on; --no-breakdown skips it)")
    forecast.add_argument("--json", default=None,
                          help="also write the forecasts (and the breakdown) to this JSON file")
    forecast.set_defaults(func=run_forecast)


def _add_plan(sub: Any) -> None:
    """``seqmem plan``: its options (``--world-size``, ``--emit``: :mod:`.plan_parallel`)."""
    from lightning_seqmem.cli.emit import ENGINES
    from lightning_seqmem.plan.parallel import KINDS

    plan = sub.add_parser(
        "plan", help="predict each mitigation set's peak at given lengths from a LightningCLI "
        "config and pick the cheapest that fits, without training",
        description="Build the model and data of a LightningCLI config and dry-run one training "
        "step per length and mitigation set on fake tensors (nothing is trained or allocated): "
        "print each predicted peak, which fit the usable budget, and the cheapest set that fits. "
        "The sets, in cost order: none; attention; attention + checkpointing; attention + "
        "checkpointing + microbatch, restricted to the config's SeqMemCallback mitigations (in "
        "their order), without the rungs that do not apply to the model.")
    _add_config_options(plan, "to plan for")
    plan.add_argument("--budget", type=_device_budget, nargs="+", default=None,
                      help="one or more devices to plan for: a size (80GiB, 141GB) or a GPU (h100, "
                      "a100-80gb, h200, b200); default: the config's SeqMemCallback memory_budget, "
                      "else the GPU's total memory, else for a CUDA config planned without a GPU "
                      "h100 and h200, else none (no fits column)")
    plan.add_argument("--host-budget", type=_bytes, default=None,
                      help="host (CPU) memory an offload setting may use per rank's process, e.g. "
                      "256GiB (default: the config's SeqMemCallback host_memory_budget, else this "
                      "machine's RAM)")
    plan.add_argument("--longest", action="store_true",
                      help="with a budget: search, per setting dry-run, the longest length it fits "
                      "(multiples of 8, between the longest asked length it fits and the shortest "
                      "it does not; a few dry runs each)")
    plan.add_argument("--world-size", type=_positive_int, default=None,
                      help="plan the per-rank peak at this many ranks (a dry run in a fake process "
                      "group on this machine), and with a budget the smallest world size (powers "
                      "of two up to it) at which each length fits with each mitigation set")
    plan.add_argument("--strategy", choices=("fsdp2", "ddp"), default="fsdp2",
                      help="with --world-size: fsdp2 (fully_shard: the model's configure_model(), "
                      "else each repeated block and the root) or ddp (replicas); default fsdp2")
    plan.add_argument("--sequence-parallel", choices=("auto", *KINDS, "none"), default="auto",
                      help="with --world-size and fsdp2: the sequence-parallel kinds searched "
                      "beside the rungs: ulysses (all-to-all, DeepSpeed/ALST), ring (PyTorch "
                      "context_parallel), auto (both, default) or none")
    plan.add_argument("--emit", choices=ENGINES, default=None,
                      help="with --world-size: print each length's plan as that engine's launch "
                      "config (searching only the sequence-parallel kind the engine runs)")
    plan.add_argument("--workers", type=_positive_int, default=None,
                      help="processes that dry-run the table's rows at once (forked, on Linux; "
                      "default: this machine's cores, at most 2; 1: this process alone)")
    plan.add_argument("--json", action="store_true",
                      help="print a JSON document instead of the table")
    plan.set_defaults(func=run_plan)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="seqmem",
        description="Measure, predict and tame the memory of long-sequence transformer training.",
        epilog="seqmem demo: train a small GPT and report its memory; seqmem report PATH: print a "
        "saved report; seqmem forecast --config CONFIG.yaml --lengths ...: predict peaks without "
        "training; seqmem plan --config CONFIG.yaml --lengths ...: the cheapest mitigations that "
        "fit, without training.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_demo, _add_panels_and_report, _add_forecast, _add_plan):
        add(sub)
    return parser


def _check_demo(args: argparse.Namespace) -> None:
    """What argparse cannot see in ``seqmem demo``'s options, before torch is imported."""
    from lightning_seqmem.core.curriculum import Curriculum
    from lightning_seqmem.core.rungs import check_mitigations

    if args.target < args.start:
        raise UserError(f"--target {args.target} is shorter than --start {args.start}: the "
                         "curriculum grows from --start to --target (tokens), e.g. --start 64 "
                         "--target 1024")
    try:
        Curriculum(start=args.start, target=args.target, steps_per_stage=args.steps_per_stage)
    except ValueError as err:
        raise UserError(f"--start {args.start} --target {args.target}: {err}") from None
    try:
        check_mitigations(args.mitigations)
    except ValueError as err:
        raise UserError(f"--mitigations: {err}") from None
    if args.d_model % args.n_head:
        raise UserError(f"--d-model {args.d_model} must be a multiple of --n-head {args.n_head}")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[len("seqmem: "):] if text.startswith("seqmem: ") else text


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``seqmem`` console script: a mistake in the command line, a missing
    file, a budget nothing can meet or an accelerator this machine lacks ends in one line on
    stderr and exit status 2 (``SEQMEM_TRACEBACK=1`` shows the traceback instead)."""
    parser = _parser()
    args = parser.parse_args(argv)
    prog = f"seqmem {args.command}"
    try:
        if args.command == "demo":
            _check_demo(args)
        return int(args.func(args) or 0)
    except UserError as exc:
        sys.stderr.write(f"{prog}: error: {_one_line(exc)}\n")
        return 2
    except Exception as exc:  # bad input found later: a config, a budget, a file, the accelerator
        if os.environ.get("SEQMEM_TRACEBACK") or not _is_users(exc):
            raise
        sys.stderr.write(f"{prog}: error: {_one_line(exc)} (SEQMEM_TRACEBACK=1 for the "
                         "traceback)\n")
        return 2


def _is_users(exc: BaseException) -> bool:
    """A user's mistake, said in the error's own words: our validation (ValueError, including
    :class:`~lightning_seqmem.MemoryBudgetError`), Lightning's MisconfigurationException (an
    accelerator this machine lacks), a file that is not there."""
    return (isinstance(exc, (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError))
            or type(exc).__name__ == "MisconfigurationException")


if __name__ == "__main__":
    sys.exit(main())
