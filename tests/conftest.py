"""Shared fixtures: tiny real models and trainers, and an independent memory reference."""

from __future__ import annotations

import os
import tempfile
import warnings

import lightning.pytorch as pl
import pytest
import torch

os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
warnings.filterwarnings("ignore", message=".*LeafSpec.*")
warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*litlogger.*")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def make_trainer(callbacks, max_steps, **kwargs) -> pl.Trainer:
    """A quiet CPU trainer for tests; its files (the seqmem report) go to a temporary directory."""
    defaults = dict(
        default_root_dir=tempfile.mkdtemp(prefix="seqmem-test-"),
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return pl.Trainer(max_steps=max_steps, callbacks=callbacks, **defaults)
