"""``RungSpec``: what the torch-free planner knows of one rung, as a plain value: name, advice
words, step-time prior and the few facts the planner acts on. Each rung's own spec is in its folder
(``mitigations/<rung>/<rung>_spec.py``).

Example:
    >>> RungSpec("checkpointing", "enable activation checkpointing", 0.33).at("2/4").step_time_prior
    0.165
"""

from __future__ import annotations

from dataclasses import dataclass, replace

LEVEL_SEP = ":"
"""Between a rung's name and its level in a variant's name (``"checkpointing:3/8"``)."""

__all__ = ["LEVEL_SEP", "RungSpec"]


@dataclass(frozen=True)
class RungSpec:
    """What the planner knows of one rung (plain values).

    Example:
        >>> RungSpec("fused_loss", "use a fused cross-entropy", 0.02).linearises_attention
        False
    """

    name: str  # as in ``SeqMemCallback(mitigations=[...])``, the policy's ``.name`` too
    advice: str  # what to do, in words, for a warning ("enable activation checkpointing")
    step_time_prior: float = 0.0  # extra step time as a fraction of the plain step, until measured
    linearises_attention: bool = False  # the L² term should fall after it: checked, warned if not
    first_step_check: bool = False  # its first step runs a one-time check (dry-run apart)
    training_only: bool = False  # lowers only what backward keeps: no step without gradients
    # priors of named levels (``(("selective", 0.08),)``); a level "k/N" scales the prior by k/N
    level_priors: tuple[tuple[str, float], ...] = ()
    # priors on one device type where it differs (``(("cpu", 0.6),)``: an eager fallback kernel)
    device_priors: tuple[tuple[str, float], ...] = ()
    # its switch in other engines' configs (``seqmem plan --emit``), "" for none
    engine_feature: str = ""

    def prior_on(self, device_type: "str | None") -> float:
        """The step-time prior on ``device_type`` (``"cpu"``, ``"cuda"``; None: the general one).

        >>> RungSpec("fused_loss", "x", 0.05, device_priors=(("cpu", 0.6),)).prior_on("cpu")
        0.6
        """
        return (dict(self.device_priors).get(device_type, self.step_time_prior) if device_type
                else self.step_time_prior)

    def at(self, level: "str | None") -> "RungSpec":
        """This spec for variant ``level`` (None: the full rung): its name and step-time prior.

        >>> r = RungSpec("checkpointing", "x", 0.3, level_priors=(("selective", 0.1),))
        >>> r.at("selective").step_time_prior
        0.1
        """
        if level is None:
            return self
        prior = dict(self.level_priors).get(level)
        if prior is None:
            k, _, n = level.partition("/")
            prior = (self.step_time_prior * int(k) / int(n)
                     if k.isdigit() and n.isdigit() and int(n) > 0 else self.step_time_prior)
        return replace(self, name=f"{self.name}{LEVEL_SEP}{level}", step_time_prior=prior,
                       device_priors=())
