"""Breakdowns at several lengths side by side: how each part grows, and when attention dominates.

:func:`compare_breakdowns` fits each part (category × kind alive at the peak, kind totals, and
activations by category) as a polynomial in L (constant, linear or quadratic: :mod:`.growth`),
and gives the attention share of activation memory at each length and the length beyond which
attention activations outweigh the rest (:class:`BreakdownTable`, with a Markdown rendering).

Example:
    >>> part = PartGrowth("ffn", "activations", [64, 128], "linear", (0.0, 1.0, 0.0))
    >>> part.to_dict()["growth"]
    'linear'
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from lightning_seqmem.core.units import format_bytes
from lightning_seqmem.diagnostics.categories import ATTENTION_CATEGORIES, CATEGORIES, KINDS
from lightning_seqmem.diagnostics.growth import (classify_growth, crossover_length, fit_growth,
                                                  polynomial_at)
from lightning_seqmem.diagnostics.tracer import Breakdown

__all__ = ["BreakdownTable", "PartGrowth", "compare_breakdowns"]


@dataclass
class PartGrowth:
    """One part's bytes at each traced length, its growth class and polynomial."""

    category: str
    kind: str
    bytes: list[int]
    growth: str
    coefficients: tuple[float, float, float]

    def to_dict(self) -> dict[str, Any]:
        return {"category": self.category, "kind": self.kind, "bytes": list(self.bytes),
                "growth": self.growth, "coefficients": list(self.coefficients)}


@dataclass
class BreakdownTable:
    """Breakdowns at several lengths side by side (one batch size)."""

    seq_lens: list[int]
    batch_size: int
    peak_bytes: list[int]
    peak_parts: list[PartGrowth]  # (category, kind) live at the peak
    peak_kinds: list[PartGrowth]  # kind totals at the peak (category "all")
    activation_parts: list[PartGrowth]  # activations by category (kind "activations")
    attention_share: list[float]  # of activation memory, at each length
    attention_coefficients: tuple[float, float, float]  # sum of the attention categories' fits
    rest_coefficients: tuple[float, float, float]
    crossover_seq_len: Optional[float]  # beyond it, attention activations exceed the rest; or None

    def attention_share_at(self, seq_len: float) -> float:
        """Attention share of activations at any length, from the per-part polynomials."""
        a = polynomial_at(self.attention_coefficients, seq_len)
        r = polynomial_at(self.rest_coefficients, seq_len)
        return a / (a + r) if a + r > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq_lens": list(self.seq_lens), "batch_size": self.batch_size,
            "peak_bytes": list(self.peak_bytes),
            "peak_parts": [p.to_dict() for p in self.peak_parts],
            "peak_kinds": [p.to_dict() for p in self.peak_kinds],
            "activation_parts": [p.to_dict() for p in self.activation_parts],
            "attention_share": list(self.attention_share),
            "attention_coefficients": list(self.attention_coefficients),
            "rest_coefficients": list(self.rest_coefficients),
            "crossover_seq_len": self.crossover_seq_len,
        }

    def to_markdown(self) -> str:
        """Three tables (peak by part, activations by category, attention share), the crossover."""
        lens = [f"L={L}" for L in self.seq_lens]

        def table(title: str, first: list[str], rows: list[list[str]]) -> list[str]:
            headers = first + lens + ["growth"]
            out = [f"**{title}**", "", "| " + " | ".join(headers) + " |",
                   "|" + "---|" * len(headers)]
            out += ["| " + " | ".join(r) + " |" for r in rows]
            return out + [""]

        md: list[str] = []
        rows = [[p.kind, *(format_bytes(b) for b in p.bytes), p.growth] for p in self.peak_kinds]
        rows.append(["**peak**", *(f"**{format_bytes(b)}**" for b in self.peak_bytes), ""])
        md += table(f"Peak memory by kind (batch {self.batch_size})", ["kind"], rows)
        rows = [[p.category, p.kind, *(format_bytes(b) for b in p.bytes), p.growth]
                for p in self.peak_parts]
        md += table("Peak memory by module and kind", ["module", "kind"], rows)
        rows = [[p.category, *(format_bytes(b) for b in p.bytes), p.growth]
                for p in self.activation_parts]
        rows.append(["attention share", *(f"{s:.1%}" for s in self.attention_share), ""])
        md += table("Activations (alive when backward starts) by module", ["module"], rows)
        if self.crossover_seq_len is None:
            md.append("Attention activations never exceed the rest at any length (no quadratic "
                      "attention term).")
        else:
            md.append(
                f"Attention activations exceed the rest beyond L ≈ "
                f"{math.ceil(self.crossover_seq_len)} "
                f"(extrapolated from per-part polynomials; share at 4x the longest traced length: "
                f"{self.attention_share_at(4 * self.seq_lens[-1]):.1%}).")
        return "\n".join(md) + "\n"


def compare_breakdowns(breakdowns: Sequence[Breakdown]) -> BreakdownTable:
    """Classify every part as constant/linear/quadratic across lengths and find the crossover.
    Needs breakdowns at two or more distinct lengths and one batch size. Attention and the rest are
    extrapolated by summing each activation category's own polynomial (:func:`fit_growth`), exact
    for pure linear and pure quadratic parts even from two lengths."""
    if len({b.batch_size for b in breakdowns}) > 1:
        raise ValueError(f"`breakdowns` must share one batch size, got "
                         f"{sorted({b.batch_size for b in breakdowns})}")
    by_len: dict[int, Breakdown] = {}
    for b in breakdowns:
        by_len.setdefault(b.seq_len, b)
    if len(by_len) < 2:
        raise ValueError(
            f"`breakdowns` must cover two or more sequence lengths, got {sorted(by_len)}")
    items = [by_len[L] for L in sorted(by_len)]
    lens = [b.seq_len for b in items]

    def part(category: str, kind: str, values: list[int]) -> PartGrowth:
        return PartGrowth(category, kind, values, classify_growth(lens, values),
                          fit_growth(lens, values))

    keys = []
    for b in items:
        for c, kinds in b.peak_by_part.items():
            for k in kinds:
                if (c, k) not in keys:
                    keys.append((c, k))
    keys.sort(key=lambda ck: (CATEGORIES.index(ck[0]) if ck[0] in CATEGORIES else 99,
                              KINDS.index(ck[1])))
    peak_parts = [part(c, k, [b.peak_by_part.get(c, {}).get(k, 0) for b in items])
                  for c, k in keys]
    peak_kinds = [part("all", k, [b.peak_by_kind.get(k, 0) for b in items]) for k in KINDS
                  if any(b.peak_by_kind.get(k, 0) for b in items)]
    categories = [c for c in CATEGORIES if any(b.activation_by_category.get(c, 0) for b in items)]
    activation_parts = [part(c, "activations", [b.activation_by_category.get(c, 0) for b in items])
                        for c in categories]
    attn = np.zeros(3)
    rest = np.zeros(3)
    for p in activation_parts:
        if p.category in ATTENTION_CATEGORIES:
            attn += p.coefficients
        else:
            rest += p.coefficients
    return BreakdownTable(
        seq_lens=lens, batch_size=items[0].batch_size, peak_bytes=[b.peak_bytes for b in items],
        peak_parts=peak_parts, peak_kinds=peak_kinds, activation_parts=activation_parts,
        attention_share=[b.attention_share for b in items],
        attention_coefficients=tuple(float(x) for x in attn),
        rest_coefficients=tuple(float(x) for x in rest),
        crossover_seq_len=crossover_length(attn, rest))

