"""TensorBoard panels: the custom-scalars layout of the ``seqmem/*`` scalars, and the memory figure.

Written by :mod:`lightning_seqmem.trainer.outputs`. matplotlib is imported lazily and draws on an
Agg canvas with its object API, touching no global backend or pyplot registry: it works headless and
leaves a notebook's backend alone. Here, at the display edge, GiB (or MiB), not bytes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

from lightning_seqmem.core.forecast import NotEnoughMeasurements
from lightning_seqmem.core.units import display_unit
from lightning_seqmem.present.dry_fit import DRY_RUN_FIT, dry_fit_anchors, dry_fit_forecast
from lightning_seqmem.present.summary import rung_changes

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

    from lightning_seqmem.plan.view import PlanView

__all__ = ["BREAKDOWN_TAG", "FIGURE_TAG", "LAYOUT_CATEGORIES", "custom_scalars_layout",
           "memory_figure"]

FIGURE_TAG = "seqmem/memory_vs_seq_len"
"""Image tag of :func:`~lightning_seqmem.trainer.outputs.log_figure` (TensorBoard's "IMAGES")."""

BREAKDOWN_TAG = "seqmem/breakdown"
"""Text tag (TensorBoard's "TEXT" tab) of the breakdown of ``SeqMemCallback(breakdown=True)``."""

LAYOUT_CATEGORIES = ("seqmem: memory per step (GiB)", "seqmem: forecast vs measured",
                     "seqmem: headroom", "seqmem: fragmentation (CUDA)")
"""Category titles of :func:`custom_scalars_layout`, in display order."""


def custom_scalars_layout(prefix: str = "seqmem/") -> dict[str, dict[str, list]]:
    """The custom-scalars layout of the planner's scalars, as ``SummaryWriter.add_custom_scalars``
    takes it: ``{category: {chart title: ["Multiline", [tag, ...]]}}``. Tags are ``prefix`` + the
    names in the :class:`~lightning_seqmem.SeqMemCallback` docstring; TensorBoard reads them as
    regular expressions, and none is a prefix of another.

    Example:
        >>> layout = custom_scalars_layout()
        >>> list(layout) == list(LAYOUT_CATEGORIES)
        True
        >>> layout["seqmem: headroom"]["largest length that fits vs current (tokens)"]
        ['Multiline', ['seqmem/max_seq_len', 'seqmem/seq_len']]
    """
    def tags(*names: str) -> list:
        return ["Multiline", [prefix + name for name in names]]

    memory, forecast, headroom, fragmentation = LAYOUT_CATEGORIES
    return {
        memory: {
            "peak per phase (GiB)": tags("peak_allocated_gib", "peak_forward_gib",
                                         "peak_backward_gib", "peak_optimizer_gib"),
            "peak allocated vs reserved vs usable budget, validation peak (GiB)": tags(
                "peak_allocated_gib", "reserved_gib", "budget_gib", "validation_peak_gib"),
            "sequence length (tokens)": tags("seq_len", "validation_seq_len"),
            "batch size (samples), curriculum stage (index), mitigations on (count)":
                tags("batch_size", "stage", "mitigations_applied"),
        },
        forecast: {
            "forecast for the next stage vs measured peak (GiB)": tags("forecast_next_gib",
                                                                       "peak_allocated_gib"),
            "verification error ((forecast - measured) / measured)": tags("verification_error"),
            "warm-up step (1 = measured, not fitted)": tags("warmup"),
        },
        headroom: {
            "headroom: usable budget - forecast (GiB)": tags("headroom_gib"),
            "headroom fraction (of the usable budget)": tags("headroom_fraction"),
            "largest length that fits vs current (tokens)": tags("max_seq_len", "seq_len"),
        },
        fragmentation: {
            "reserved - allocated at the peak, inactive split blocks (GiB)":
                tags("fragmentation_gib", "inactive_split_gib"),
            "fragmentation fraction (of reserved)": tags("fragmentation_fraction"),
            "allocator retries and OOMs (count, cumulative)": tags("alloc_retries", "num_ooms"),
        },
    }


# ---- The figure ------------------------------------------------------------------------------
def _curve_lengths(max_len: int, num: int = 80) -> list[int]:
    step = max(1, max_len // num)
    return sorted(set(range(step, max_len + 1, step)) | {max_len})


def _predictor_curve(forecaster: Any, lengths: Sequence[int], batch_size: int, method: str):
    """(lengths, peaks, uppers) in bytes, or None when that predictor is unavailable."""
    try:
        forecasts = [forecaster.forecast(L, batch_size, method=method) for L in lengths]
    except (NotEnoughMeasurements, ValueError, RuntimeError):
        return None
    if not forecasts or forecasts[0].method != method:
        return None
    return list(lengths), [f.peak_bytes for f in forecasts], [f.upper_bytes for f in forecasts]


def _dry_run_curve(view: "PlanView", right: int, batch_size: int, num: int = 8):
    """``(method, (lengths, peaks, uppers))`` of the dry run at ``num`` lengths up to ``right`` (at
    most the model's positions) and at the lengths dry-run already, or None without a dry run. With
    two :func:`~lightning_seqmem.present.dry_fit.dry_fit_anchors` or more no dry run runs: the fit
    through them answers (method ``"dry_run_fit"``); else each length is dry-run."""
    right = right if view.settings.length_limit is None else min(right, view.settings.length_limit)
    anchors = dry_fit_anchors(view, batch_size)
    evenly = {max(1, right * k // num) for k in range(1, num + 1)}
    if len(anchors) >= 2:  # no dry run: the dry runs cached and the fit through them
        dried = {L for L, fc in anchors.items() if fc.method == "dry_run" and L <= right}
        lengths = sorted(evenly | dried)
        forecasts = [dry_fit_forecast(view, L, batch_size, anchors) for L in lengths]
    else:
        lengths = sorted(evenly)
        if view.evidence.dry.peak(lengths[0], batch_size) is None:
            return None
        try:
            forecasts = [view.evidence.forecast(L, batch_size) for L in lengths]
        except (NotEnoughMeasurements, ValueError, RuntimeError):  # a length refused: no curve
            return None
    if any(f is None or f.method not in ("dry_run", DRY_RUN_FIT) for f in forecasts):
        return None
    method = DRY_RUN_FIT if any(f.method == DRY_RUN_FIT for f in forecasts) else "dry_run"
    return method, (lengths, [f.peak_bytes for f in forecasts], [f.upper_bytes for f in forecasts])


def _reference_batch_size(view: "PlanView") -> Optional[int]:
    measured = view.evidence.measured
    if measured.last_batch_size is not None:
        return measured.last_batch_size
    records = [r for r in measured.records if not r.warmup] or measured.records
    return records[-1].batch_size if records else None


def _mitigation_marks(view: "PlanView") -> list[tuple[int, str]]:
    """``(seq_len, what was switched on)`` of each switch: the ladder's events, else each record
    whose ``mitigations`` differ from the previous record's."""
    events = view.ladder.events
    if events:
        return [(int(e.seq_len), e.name) for e in events]
    marks = []
    for record, before, after in rung_changes(view.evidence.measured.records):
        added = [m for m in after if m not in before]
        marks.append((record.seq_len, ", ".join(added) if added else "off: " + ", ".join(before)))
    return marks


def _other_settings(view: "PlanView") -> list[tuple[tuple[str, ...], Any]]:
    """Forecasters of the settings other than the one on now (fitted before a switch)."""
    forecasters = view.evidence.measured.forecasters
    current = tuple(view.ladder.applied)
    return [(key, f) for key, f in forecasters.items() if tuple(key) != current and f.ready]


def _curves(view: "PlanView", lengths: list[int], right: int,
            batch_size: Optional[int]) -> dict[str, Any]:
    """``method -> (lengths, peaks, uppers)``: the setting on now's predictors (or the dry run)."""
    curves = {}
    if batch_size is not None and view.evidence.forecaster.ready:
        for method in ("quadratic", "replay"):
            curve = _predictor_curve(view.evidence.forecaster, lengths, batch_size, method)
            if curve is not None:
                curves[method] = curve
    if batch_size is not None and not curves:  # too few lengths for a fit: ask the dry run
        dry = _dry_run_curve(view, right, batch_size)
        if dry is not None:
            curves[dry[0]] = dry[1]
    return curves


def _scale(view: "PlanView", measured: list, curves: dict[str, Any], right: int,
           batch_size: Optional[int]) -> tuple[float, tuple[str, float]]:
    """The top of the y axis (bytes; 0: nothing to show) and its unit: the budget kept in view
    (curves may climb far above it at the right end)."""
    budget, usable = view.settings.budget_bytes, view.settings.usable_budget_bytes
    candidates = [r.peak_bytes for r in measured] + [b for b in (budget, usable) if b]
    candidates += [max(c[2]) for c in curves.values()]
    if batch_size is not None:
        for _, other in _other_settings(view):
            try:
                candidates.append(other.forecast(right, batch_size).peak_bytes)
            except Exception:  # noqa: BLE001
                pass
    top = (min(max(candidates, default=0),
               2.5 * max([budget or 0] + [r.peak_bytes for r in measured]))
           if budget else max(candidates, default=0))
    return top, display_unit(top)


def _scatter_measured(ax: Any, measured: list, current: tuple, batch_size: Optional[int],
                      scale: float) -> None:
    """Measured peaks, one marker per (batch size, mitigations on); the setting drawn in black."""
    groups: dict[tuple, list] = {}  # (batch size, mitigations on) -> records
    for r in measured:
        groups.setdefault((r.batch_size, tuple(r.mitigations)), []).append(r)
    markers = iter("os^Dv<>phX")
    for (b, mitigations), records in sorted(groups.items(),
                                            key=lambda kv: (kv[0][0], len(kv[0][1]))):
        mine = b == batch_size and mitigations == current
        suffix = f", with {'+'.join(mitigations)}" if mitigations else ""
        ax.scatter([r.seq_len for r in records], [r.peak_bytes / scale for r in records],
                   marker=next(markers, "o"), color="black" if mine else None, zorder=3,
                   label=f"measured peak (batch {b}{suffix})")


_STYLES = {"quadratic": ("tab:orange", "quadratic fit C + B(aL + bL²)"),
           "replay": ("tab:blue", "timeline replay"), "dry_run": ("tab:purple", "dry run"),
           DRY_RUN_FIT: ("tab:purple", "quadratic through the dry runs")}
"""Colour and legend label of each predictor's curve in :func:`memory_figure`."""


def _draw_curves(ax: Any, view: "PlanView", curves: dict[str, Any], lengths: list[int], right: int,
                 batch_size: Optional[int], scale: float) -> None:
    """The predictors' curves with their upper-bound bands, the lengths dry-run under a fit through
    them (markers: the only dry-run points), and the fits of the other settings (dashed)."""
    current = tuple(view.ladder.applied)
    setting = f", with {'+'.join(current)}" if current else ""
    for method, (xs, peaks, uppers) in curves.items():
        color, label = _STYLES[method]
        ax.plot(xs, [p / scale for p in peaks], color=color,
                label=f"{label} (batch {batch_size}{setting})")
        ax.fill_between(xs, [p / scale for p in peaks], [u / scale for u in uppers], color=color,
                        alpha=0.15, label=f"{method} upper bound")
    if DRY_RUN_FIT in curves and batch_size is not None:
        dried = [L for L in view.evidence.dry.answered(batch_size) if L <= right]  # cached
        ax.scatter(dried, [view.evidence.dry.peak(L, batch_size)[0] / scale for L in dried],
                   marker="x", color="tab:purple", zorder=3,
                   label=f"dry run (batch {batch_size}{setting})")
    for key, other in _other_settings(view) if batch_size is not None else ():
        try:
            ys = [other.forecast(L, batch_size).peak_bytes / scale for L in lengths]
        except Exception:  # noqa: BLE001 - a figure never fails on a forecast
            continue
        ax.plot(lengths, ys, color="gray", linestyle="--", linewidth=1,
                label=f"forecast {'with ' + '+'.join(key) if key else 'before mitigations'}")


def _draw_lengths(ax: Any, view: "PlanView", right: int, batch_size: Optional[int],
                  target: int) -> None:
    """Vertical lines: the largest length that fits, each switch of rungs, the target."""
    usable = view.settings.usable_budget_bytes
    if usable and batch_size is not None and view.evidence.forecaster.ready:
        try:
            fit = view.evidence.max_seq_len(usable, batch_size)
        except Exception:  # noqa: BLE001 - the figure must not fail on a forecast problem
            fit = None
        if fit and fit < right:
            ax.axvline(fit, color="tab:red", linestyle="--", alpha=0.7,
                       label=f"largest length that fits: {fit}")
    for i, (seq_len, what) in enumerate(_mitigation_marks(view)):
        ax.axvline(seq_len, color="tab:green", linestyle="-.", alpha=0.8,
                   label=f"switched on at L={seq_len}: {what}" if i < 4 else None)
    if target:
        ax.axvline(target, color="gray", linestyle=":", alpha=0.6,
                   label=f"curriculum target {target}")


def memory_figure(view: "PlanView", max_seq_len: Optional[int] = None,
                  batch_size: Optional[int] = None, title: Optional[str] = None) -> "Figure":
    """Memory against sequence length: measured points, both predictors, budget, mitigations.

    ``max_seq_len``: the curves' right end, tokens (default twice the larger of the curriculum
    target and the longest measured length); ``batch_size``: the curves' (default the last measured
    batch's); ``title``: default names the batch size. Predictors of the rungs on now are drawn with
    their upper-bound bands, the budgets as horizontal lines, rung switches as vertical ones."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    measured = [r for r in view.evidence.measured.records if not r.warmup]
    batch_size = batch_size or _reference_batch_size(view)
    target = view.settings.curriculum.target if view.settings.curriculum is not None else 0
    longest = max([r.seq_len for r in view.evidence.measured.records], default=0)
    right = max_seq_len or max(2 * max(target, longest), 16)
    lengths = _curve_lengths(right)

    curves = _curves(view, lengths, right, batch_size)
    budget, usable = view.settings.budget_bytes, view.settings.usable_budget_bytes
    top, (unit, scale) = _scale(view, measured, curves, right, batch_size)

    fig = Figure(figsize=(8.0, 5.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    _draw_curves(ax, view, curves, lengths, right, batch_size, scale)
    _scatter_measured(ax, measured, tuple(view.ladder.applied), batch_size, scale)
    if usable:
        ax.axhline(usable / scale, color="tab:red", linestyle="-",
                   label=f"usable budget {usable / scale:.2f} {unit}")
    if budget and budget != usable:
        ax.axhline(budget / scale, color="tab:red", linestyle=":", alpha=0.6,
                   label=f"budget {budget / scale:.2f} {unit}")
    _draw_lengths(ax, view, right, batch_size, target)
    ax.set_xlim(0, right)
    if top > 0:
        ax.set_ylim(0, 1.05 * top / scale)
    else:
        ax.set_ylim(bottom=0)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel(f"peak memory of a training step ({unit})")
    ax.set_title(title or f"seqmem: memory vs sequence length (batch {batch_size})")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", fontsize="small", framealpha=0.85)
    fig.tight_layout()
    return fig


# ---- A picture of the panels, from a run's event files ----------------------------------------
def render_panels(log_dir: Any, path: Any, prefix: str = "seqmem/") -> "Figure":
    """Draw the custom-scalars panels of the event files in ``log_dir`` to a PNG at ``path``: one
    subplot per chart with data (for a review or a README, where TensorBoard is not at hand)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    available = set(events.Tags().get("scalars", []))
    charts = [(category, title, [t for t in tags if t in available])
              for category, charts_ in custom_scalars_layout(prefix).items()
              for title, (_, tags) in charts_.items()]
    charts = [c for c in charts if c[2]]
    if not charts:
        raise ValueError(f"no {prefix}* scalars in the event files under {log_dir}")
    columns = 3
    rows = -(-len(charts) // columns)
    fig = Figure(figsize=(5.2 * columns, 3.0 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    for i, (category, title, tags) in enumerate(charts):
        ax = fig.add_subplot(rows, columns, i + 1)
        for tag in tags:
            scalars = events.Scalars(tag)
            ax.plot([s.step for s in scalars], [s.value for s in scalars], marker=".",
                    label=tag[len(prefix):])
        ax.set_title(f"{category.removeprefix('seqmem: ')}\n{title}", fontsize=8)
        ax.set_xlabel("step", fontsize=7)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(f"seqmem panels: {log_dir}", fontsize=10)
    fig.savefig(str(path), dpi=90)
    return fig
