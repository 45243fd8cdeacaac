"""The 0.1 import path of the memory breakdown, kept for one release: it re-exports the modules of
:mod:`lightning_seqmem.diagnostics`, where each concern now lives.

========================  ==========================================================================
:mod:`.growth`            ``fit_growth``, ``classify_growth``, ``crossover_length``, ``is_quadratic_shape``
:mod:`.korthikanti`       ``korthikanti_activation_bytes``, ``calibrate``, ``Calibration``
:mod:`.categories`        ``module_category``, ``CATEGORIES``, ``KINDS``, ``find_attention_modules``
:mod:`.tracer`            ``trace_breakdown`` (measurement only), ``Breakdown``, ``AllocationRecord``
:mod:`.compare`           ``compare_breakdowns``, ``BreakdownTable``, ``PartGrowth``
:mod:`.findings`          ``diagnose``, ``attention_ablation``, ``MemoryDiagnosisWarning``
========================  ==========================================================================

Two names keep their 0.1 behaviour here: :func:`trace_breakdown` and :func:`attention_ablation`
also calibrate what they trace against Korthikanti et al. (``Breakdown.calibration``), as they did.
New code imports from the modules above and calls :func:`~.korthikanti.calibrate` itself.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_seqmem.diagnostics import findings, tracer
from lightning_seqmem.diagnostics.categories import (
    ATTENTION_CATEGORIES,
    CATEGORIES,
    KINDS,
    find_attention_modules,
    module_category,
)
from lightning_seqmem.diagnostics.compare import BreakdownTable, PartGrowth, compare_breakdowns
from lightning_seqmem.diagnostics.findings import AttentionAblation, MemoryDiagnosisWarning, diagnose
from lightning_seqmem.diagnostics.growth import GROWTHS, classify_growth, crossover_length, fit_growth, is_quadratic_shape
from lightning_seqmem.diagnostics.korthikanti import Calibration, calibrate, korthikanti_activation_bytes
from lightning_seqmem.diagnostics.tracer import AllocationRecord, Breakdown

__all__ = [
    "ATTENTION_CATEGORIES",
    "AllocationRecord",
    "AttentionAblation",
    "Breakdown",
    "BreakdownTable",
    "CATEGORIES",
    "Calibration",
    "GROWTHS",
    "KINDS",
    "MemoryDiagnosisWarning",
    "PartGrowth",
    "attention_ablation",
    "calibrate",
    "classify_growth",
    "compare_breakdowns",
    "crossover_length",
    "diagnose",
    "find_attention_modules",
    "fit_growth",
    "is_quadratic_shape",
    "korthikanti_activation_bytes",
    "module_category",
    "trace_breakdown",
]


def _calibrated(breakdown: Breakdown, model: nn.Module) -> Breakdown:
    if breakdown.calibration is None:
        breakdown.calibration = calibrate(breakdown, model)
    return breakdown


def trace_breakdown(step_fn: Any, model: nn.Module, *args: Any, **kwargs: Any) -> Breakdown:
    """:func:`.tracer.trace_breakdown`, then :func:`.korthikanti.calibrate` (0.1's behaviour)."""
    return _calibrated(tracer.trace_breakdown(step_fn, model, *args, **kwargs), model)


def attention_ablation(step_fn: Any, model: nn.Module, *args: Any, **kwargs: Any) -> AttentionAblation:
    """:func:`.findings.attention_ablation`, both steps calibrated (0.1's behaviour)."""
    ablation = findings.attention_ablation(step_fn, model, *args, **kwargs)
    _calibrated(ablation.with_attention, model)
    _calibrated(ablation.without_attention, model)
    return ablation
