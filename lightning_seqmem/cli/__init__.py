"""The ``seqmem`` command."""

from lightning_seqmem.cli.main import main

__all__ = ["main"]
