"""The choice of a setting (pure): among the settings the run may switch to (:func:`candidates`),
the one that fits with the least predicted step time (:mod:`.pricing`), searched best-first.

A *setting* is a tuple of rung names (variants included, ``"checkpointing:3/8"``), at most one
entry per rung; rungs never go off. A setting *dominated* by one judged over (:func:`dominated`)
is skipped unjudged. Past ``max_judgements`` judgements the ladder order takes over.

Example (``checkpointing`` and a toy ``fused_loss``; only settings with ``fused_loss`` fit):
    >>> from lightning_seqmem.core.rung_spec import RungSpec
    >>> from lightning_seqmem.core.rungs import register_spec, unregister_spec
    >>> from lightning_seqmem.plan.pricing import prior_factor
    >>> register_spec(RungSpec("fused_loss", "use a fused loss", 0.02))
    >>> rungs = ("checkpointing", "fused_loss")
    >>> ok = {rung: (True, "") for rung in rungs}
    >>> fits = lambda s: "fits" if "fused_loss" in s else "over"
    >>> c = choose((), rungs, ok, fits, lambda s: prior_factor(s))
    >>> c.setting, c.rungs, c.fits, c.judged   # fused loss (+2%) first: judged once, it fits
    (('fused_loss',), ('fused_loss',), True, 1)
    >>> c.why
    'fused loss: fits, +2% step time; checkpointing would cost +33%'
    >>> fits = lambda s: "fits" if s == ("checkpointing", "fused_loss") else "over"
    >>> c = choose((), rungs, ok, fits, lambda s: prior_factor(s))
    >>> c.setting, c.judged   # fused loss over: checkpointing alone (not dominated) judged too
    (('checkpointing', 'fused_loss'), 3)
    >>> unregister_spec("fused_loss")
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional, Sequence

from lightning_seqmem.core.rungs import at_most, base_name, level_of

Setting = tuple[str, ...]
Applicability = Mapping[str, "tuple[bool, str]"]
MAX_JUDGEMENTS = 12  # judgements (dry runs) one decision spends on the search before ladder order

__all__ = ["Choice", "MAX_JUDGEMENTS", "candidates", "choose", "combine", "describe", "dominated",
           "switched_on", "with_why"]


@dataclass(frozen=True)
class Choice:
    """The chosen ``setting`` (all of it), the ``rungs`` to switch on for it (new entries and
    upgrades, in order), whether it ``fits`` (False: nothing fits, every rung is on), the one-line
    ``why``, the judgements spent (``judged``), whether the search ``fell_back`` to ladder order."""

    setting: Setting
    rungs: Setting
    fits: bool
    why: str
    judged: int
    fell_back: bool = False
    verdict: object = None  # the judgement of ``setting`` (its ``bound_bytes``); None: unjudged


def combine(on: Sequence[str], rungs: Sequence[str]) -> Setting:
    """``on`` plus ``rungs``: a variant of a rung on replaces its entry, a new rung is appended.

    >>> combine(("attention", "checkpointing:2/8"), ("checkpointing:4/8", "microbatch"))
    ('attention', 'checkpointing:4/8', 'microbatch')
    """
    out = list(on)
    for name in rungs:
        same = [i for i, n in enumerate(out) if base_name(n) == base_name(name)]
        if same:
            out[same[0]] = name
        else:
            out.append(name)
    return tuple(out)


def switched_on(on: Sequence[str], setting: Sequence[str]) -> Setting:
    """The entries of ``setting`` to switch on from ``on`` (new or changed), in ``setting``'s order.

    >>> switched_on(("checkpointing:2/8",), ("checkpointing", "fused_loss"))
    ('checkpointing', 'fused_loss')
    """
    return tuple(n for n in setting if n not in on)


def dominated(setting: Sequence[str], over: Sequence[str]) -> bool:
    """Whether every entry of ``setting`` is on in ``over`` at a level not lower (then ``setting``
    holds at least as much memory as ``over``: over ``over`` is over it too).

    >>> dominated(("attention", "checkpointing:2/8"),
    ...           ("attention", "checkpointing:4/8", "microbatch"))
    True
    >>> dominated(("attention", "checkpointing"), ("attention", "checkpointing:4/8"))
    False
    """
    return all(any(at_most(x, y) for y in over) for x in setting)


def _options(name: str, on: Sequence[str], applicable: Applicability) -> list[Optional[str]]:
    """None (leave rung ``name`` as it is) and each applicable variant of it, new or an upgrade."""
    current = next((n for n in on if base_name(n) == name), None)
    variants = [v for v, (ok, _) in applicable.items()
                if ok and base_name(v) == name and v != current]
    if current is not None:
        variants = [v for v in variants if at_most(current, v)]
    return [None] + sorted(variants, key=lambda v: (level_of(v) is None, v))


def candidates(on: Sequence[str], allowed: Sequence[str],
               applicable: Applicability) -> list[Setting]:
    """Every setting the run may switch to from ``on``, not ``on`` itself: at most one applicable
    variant per rung of ``allowed`` (new, or an upgrade), new rungs in ``allowed``'s order.

    >>> candidates(("attention",), ("attention", "checkpointing", "microbatch"),
    ...            {"checkpointing": (True, ""), "checkpointing:1/2": (True, ""),
    ...             "microbatch": (False, "batch 1")})
    [('attention', 'checkpointing:1/2'), ('attention', 'checkpointing')]
    """
    on = tuple(on)
    per_rung = [_options(name, on, applicable) for name in allowed]
    out = [combine(on, [v for v in pick if v is not None]) for pick in itertools.product(*per_rung)]
    return [setting for setting in out if setting != on]


def describe(setting: Sequence[str]) -> str:
    """A setting in words (``"checkpointing 3 of 8 blocks + fused loss"``; ``"nothing"`` if empty).

    >>> d = describe
    >>> d(("checkpointing:3/8", "fused_loss")), d(("checkpointing:selective",)), d(())
    ('checkpointing 3 of 8 blocks + fused loss', 'checkpointing (selective)', 'nothing')
    """
    words = []
    for name in setting:
        base, level = base_name(name).replace("_", " "), level_of(name)
        k, _, n = (level or "").partition("/")
        words.append(base if level is None
                     else f"{base} {k} of {n} blocks" if k.isdigit() and n.isdigit()
                     else f"{base} ({level})")
    return " + ".join(words) or "nothing"


def with_why(words: Any, choice: Optional[Choice]) -> Any:
    """An over-budget warning (an :class:`~lightning_seqmem.core.advice.Advice`) with the line that
    says why the setting was chosen (unchanged when nothing fits or nothing was chosen)."""
    if choice is None or not choice.fits:
        return words
    return replace(words, text=f"{words.text} Chosen as the fastest setting that fits: "
                               f"{choice.why}.")


def _pct(cost: float, base: float) -> str:
    return f"{(cost / base - 1) * 100 if base > 0 else 0.0:+.0f}%"


def _why_chosen(on: Setting, chosen: Setting, verdict: object,
                overs: Sequence[tuple[Setting, object]], ranked: Sequence[Setting],
                costs: Mapping[Setting, float], base_cost: float, price: Callable[[Setting], float],
                fmt: Callable[[int], str], usable: Optional[int]) -> str:
    """Why :func:`choose` chose ``chosen``: what it fits and costs, the cheaper setting judged over,
    and what the full levels (or the next cheapest setting) would cost."""
    bound = getattr(verdict, "bound_bytes", None)
    why = f"{describe(switched_on(on, chosen))}: fits"
    if bound is not None:
        why += f" (at most {fmt(bound)}" + (f" of {fmt(usable)})" if usable is not None else ")")
    why += f", {_pct(costs[chosen], base_cost)} step time"
    cheaper = [(s, v) for s, v in overs if costs[s] <= costs[chosen]]
    if cheaper:
        s, v = cheaper[0]
        b = getattr(v, "bound_bytes", None)
        why += f"; {describe(switched_on(on, s))} ({_pct(costs[s], base_cost)}) would not fit" + (
            f" ({fmt(b)})" if b is not None else "")
    fuller = combine(chosen, [base_name(n) for n in switched_on(on, chosen)
                              if level_of(n) is not None])
    if fuller != chosen:
        full_names = [f"full {base_name(n).replace('_', ' ')}" for n in switched_on(on, chosen)
                      if level_of(n)]
        why += f"; {' + '.join(full_names)} would cost {_pct(price(fuller), base_cost)}"
    else:  # the next cheapest setting not judged over, nor one the chosen one makes fit anyway
        judged_over = {o for o, _ in overs}
        rest = [s for s in ranked[ranked.index(chosen) + 1:]
                if s not in judged_over and not dominated(s, chosen) and not dominated(chosen, s)]
        if rest:
            why += (f"; {describe(switched_on(on, rest[0]))} would cost "
                    f"{_pct(costs[rest[0]], base_cost)}")
    return why


def choose(on: Sequence[str], allowed: Sequence[str], applicable: Applicability,
           judge: Callable[[Setting], object], price: Callable[[Setting], float],
           max_judgements: int = MAX_JUDGEMENTS, fmt: Callable[[int], str] = lambda b: f"{b} B",
           usable: Optional[int] = None) -> Optional[Choice]:
    """The setting that fits with the least ``price`` (ties: more rungs first, then ladder order),
    judged by ``judge(setting)``: a :class:`~lightning_seqmem.plan.judging.Verdict` or its kind;
    ``fmt``: bytes in the why; ``usable``: the budget it names. None when nothing can be switched
    to, or none fits and a judgement is unknown; every rung on, ``fits=False``, if all are over."""
    on = tuple(on)
    options = candidates(on, allowed, applicable)
    if not options:
        return None
    order = {name: i for i, name in enumerate(allowed)}
    base_cost = price(on)
    costs = {s: price(s) for s in options}
    ranked = sorted(options, key=lambda s: (costs[s], -len(s),
                                            [order.get(base_name(n), len(order)) for n in s]))
    overs: list[tuple[Setting, object]] = []
    judged, unknown, fell_back = 0, False, False
    verdicts: dict[Setting, object] = {}

    def fits(s: Setting) -> bool:
        nonlocal judged, unknown
        if s not in verdicts:
            verdicts[s] = judge(s)
            judged += 1
        kind = (verdicts[s] if isinstance(verdicts[s], str)
                else getattr(verdicts[s], "kind", "unknown"))
        if kind == "over":
            overs.append((s, verdicts[s]))
        unknown |= kind == "unknown"
        return kind == "fits"

    chosen: Optional[Setting] = None
    for s in ranked:
        if any(dominated(s, o) for o, _ in overs):
            continue
        if judged >= max_judgements:
            fell_back = True
            break
        if fits(s):
            chosen = s
            break
    if chosen is None and fell_back:  # ladder order: each prefix of the rungs left, at full level
        left = [n for n in allowed if applicable.get(n, (False, ""))[0] and n not in on]
        for k in range(1, len(left) + 1):
            s = combine(on, left[:k])
            if not any(dominated(s, o) for o, _ in overs) and fits(s):
                chosen = s
                break
    if chosen is None:
        if unknown:
            return None
        most = max(options, key=lambda s: (len(s), sum(level_of(n) is None for n in s), -costs[s]))
        return Choice(most, switched_on(on, most), False,
                      f"nothing fits: {describe(most)} is on, "
                      f"{_pct(costs[most], base_cost)} step time",
                      judged, fell_back, verdicts.get(most))
    verdict = verdicts[chosen]
    why = _why_chosen(on, chosen, verdict, overs, ranked, costs, base_cost, price, fmt, usable)
    if fell_back:
        why += f" (after {max_judgements} settings judged by cost, the ladder order chose)"
    return Choice(chosen, switched_on(on, chosen), True, why, judged, fell_back, verdict)
