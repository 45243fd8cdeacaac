"""Train the reference GPT from a LightningCLI config, with SeqMemCallback configured in YAML.

    python examples/train_gpt_cli.py fit --config configs/cpu_demo.yaml
    python examples/train_gpt_cli.py fit --config configs/cpu_demo.yaml --trainer.max_steps 12
    python examples/train_gpt_cli.py fit --config configs/ddp_cpu.yaml
    python examples/train_gpt_cli.py fit --help   # every option, SeqMemCallback's included

At the end the seqmem report (JSON, Markdown, figure) is written to the logger's log_dir and
printed.
"""

import sys

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningCLI

from lightning_seqmem import SeqMemCallback
from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule
from lightning_seqmem.plan.view import PlanView


def report(trainer) -> None:
    """Write and print the report of the first SeqMemCallback (rank zero only)."""
    from lightning_seqmem.trainer.outputs import log_figure, write_layout
    from lightning_seqmem.present.report import build_report
    from lightning_seqmem.present.render import render_console

    callback = next((c for c in trainer.callbacks if isinstance(c, SeqMemCallback)), None)
    if callback is None or not trainer.is_global_zero:
        return
    write_layout(trainer)
    log_figure(trainer, PlanView.of(callback.planner))
    paths = callback.write_report(trainer)
    render_console(build_report(PlanView.of(callback.planner), trainer, include_records=False))
    print(f"seqmem report: {paths[0]}")


def main() -> None:
    try:
        cli = LightningCLI(LitGPT, SyntheticTokenDataModule, save_config_kwargs={"overwrite": True})
    except MisconfigurationException as exc:  # e.g. a GPU config on a machine without one: one line
        hint = (" (a GPU config: on CPU try configs/cpu_demo.yaml)" if "CUDAAccelerator" in str(exc)
                else "")
        raise SystemExit(f"{sys.argv[0]}: error: {' '.join(str(exc).split())}{hint}") from None
    if cli.subcommand == "fit":
        report(cli.trainer)


if __name__ == "__main__":
    main()
