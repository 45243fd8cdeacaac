"""Step-time prices (pure): the seconds one training step would take with a setting at
``(seq_len, batch_size)``. The predictor, most trusted first:

1. ``"measured"``: the setting's fitted, untraced steps at the measured length nearest
   ``seq_len``: the median seconds per token, times ``seq_len·batch_size``;
2. ``"nearest setting"``: the measured setting differing in the fewest rungs, scaled by the ratio
   of their prior factors ``1 + Σ priors`` (a variant's scaled to its level:
   :attr:`~lightning_seqmem.core.rung_spec.RungSpec.step_time_prior`);
3. ``"priors"``: nothing timed yet: no seconds, only the prior factor.

Example (the plain setting ran at 128 tokens, batch 2, in 0.10 s; nothing else ran):
    >>> from lightning_seqmem.core.records import StepRecord
    >>> ran = [StepRecord(i, i, 0, 128, 2, i == 0, False, 1, None, None, None, 0, step_seconds=0.1)
    ...        for i in range(3)]
    >>> predict_step(ran, (), 256, 2)
    Price(seconds=0.2, factor=1.0, method='measured', basis=())
    >>> p = predict_step(ran, ("checkpointing",), 256, 2)
    >>> round(p.seconds, 3), p.method, p.basis
    (0.266, 'nearest setting', ())
    >>> p = predict_step([], ("checkpointing", "microbatch"), 256, 2)
    >>> p.seconds, round(p.factor, 2), p.method
    (None, 1.43, 'priors')
    >>> round(relative_cost(ran, ("checkpointing",), (), 256, 2), 2)   # +33% over the one on now
    1.33
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from statistics import median
from typing import Mapping, Optional, Sequence

from lightning_seqmem.core.records import StepRecord
from lightning_seqmem.core.rung_spec import RungSpec
from lightning_seqmem.core.rungs import base_name, spec

Setting = tuple[str, ...]

__all__ = ["Price", "predict_step", "prior_factor", "relative_cost", "setting_distance",
           "timed_records", "timed_settings"]


@dataclass(frozen=True)
class Price:
    """The predicted cost of one step with a setting: ``seconds`` (None: priors only), ``factor``
    (``1 + Σ step_time_prior``), ``method`` (see the module doc), ``basis`` (the measured setting
    the seconds come from; None: priors)."""

    seconds: Optional[float]
    factor: float
    method: str
    basis: Optional[Setting]

    @property
    def key(self) -> float:
        """What to compare two prices by (seconds where timed, else the prior factor)."""
        return self.factor if self.seconds is None else self.seconds


def prior_factor(setting: Sequence[str], device_type: Optional[str] = None,
                 specs: Optional[Mapping[str, RungSpec]] = None) -> float:
    """``1 + Σ step_time_prior`` of the rungs of ``setting`` (its step time over the plain step), on
    ``device_type`` (:meth:`RungSpec.prior_on`), from ``specs`` (default the registry's).

    >>> f = prior_factor
    >>> f(()), f(("attention", "checkpointing")), round(f(("checkpointing:1/3",)), 2)
    (1.0, 1.33, 1.11)
    """
    return 1.0 + sum(spec(name, specs).prior_on(device_type) for name in setting)


def setting_distance(a: Sequence[str], b: Sequence[str]) -> float:
    """Distance of two settings: 1 per rung on in one only, 0.5 per rung on in both at other levels.

    >>> d, ck = setting_distance, "checkpointing"
    >>> d(("attention",), ("attention", ck)), d(("checkpointing:2/4",), (ck,))
    (1.0, 0.5)
    """
    ra, rb = {base_name(n): n for n in a}, {base_name(n): n for n in b}
    return (float(len(ra.keys() ^ rb.keys()))
            + 0.5 * sum(ra[k] != rb[k] for k in ra.keys() & rb.keys()))


def timed_records(records: Sequence[StepRecord]) -> list[StepRecord]:
    """The records a price is made from: fitted, untraced steps that carry ``step_seconds``."""
    return [r for r in records if not r.warmup and not r.traced and r.step_seconds is not None
            and r.step_seconds > 0 and r.seq_len > 0 and r.batch_size > 0]


def timed_settings(records: Sequence[StepRecord]) -> dict[Setting, int]:
    """``setting -> number of timed steps`` (fitted, untraced steps that carry ``step_seconds``)."""
    return dict(Counter(tuple(r.mitigations) for r in timed_records(records)))


def _measured_seconds(timed: Sequence[StepRecord], setting: Setting, seq_len: int,
                      batch_size: int) -> Optional[float]:
    rows = [r for r in timed if tuple(r.mitigations) == setting]
    if not rows:
        return None
    nearest = min(abs(math.log(r.seq_len / seq_len)) for r in rows)
    per_token = [r.step_seconds / (r.seq_len * r.batch_size) for r in rows  # type: ignore[operator]
                 if abs(math.log(r.seq_len / seq_len)) == nearest]
    return median(per_token) * seq_len * batch_size


def predict_step(records: Sequence[StepRecord], setting: Sequence[str], seq_len: int,
                 batch_size: int, device_type: Optional[str] = None,
                 specs: Optional[Mapping[str, RungSpec]] = None) -> Price:
    """The predicted cost of one step with ``setting`` at ``(seq_len, batch_size)`` (see the module
    doc), the priors (of ``specs``, default the registry's) taken on ``device_type``."""
    setting = tuple(setting)
    factor = prior_factor(setting, device_type, specs)
    timed = timed_records(records)
    own = _measured_seconds(timed, setting, seq_len, batch_size)
    if own is not None:
        return Price(own, factor, "measured", setting)
    counts = timed_settings(timed)
    if not counts:
        return Price(None, factor, "priors", None)
    basis = min(counts, key=lambda s: (setting_distance(s, setting), -counts[s]))
    seconds = _measured_seconds(timed, basis, seq_len, batch_size)
    assert seconds is not None
    return Price(seconds * factor / prior_factor(basis, device_type, specs), factor,
                 "nearest setting", basis)


def relative_cost(records: Sequence[StepRecord], setting: Sequence[str], reference: Sequence[str],
                  seq_len: int, batch_size: int) -> float:
    """``setting``'s predicted step time over ``reference``'s (both by :func:`predict_step`)."""
    a, b = (predict_step(records, setting, seq_len, batch_size),
            predict_step(records, reference, seq_len, batch_size))
    if a.seconds is not None and b.seconds is not None and b.seconds > 0:
        return a.seconds / b.seconds
    return a.factor / b.factor
