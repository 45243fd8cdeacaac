"""The ``"no_dropout"`` rung: every ``nn.Dropout`` of the module at ``p = 0``."""

from __future__ import annotations

from torch import nn

from lightning_seqmem.mitigations.base import MitigationResult, Rung, RungContext
from toy_rungs.no_dropout.no_dropout_spec import SPEC


class NoDropout(Rung):
    spec = SPEC

    @staticmethod
    def _dropouts(module):
        return [m for m in module.modules() if isinstance(m, nn.Dropout)]

    def is_on(self, module):
        dropouts = self._dropouts(module)
        return bool(dropouts) and all(m.p == 0 for m in dropouts)

    def is_applicable(self, ctx: RungContext):
        if not self._dropouts(ctx.pl_module):
            return False, "no nn.Dropout"
        return ((False, "dropout already 0") if self.is_on(ctx.pl_module)
                else (True, "dropout p -> 0"))

    def apply(self, ctx: RungContext):
        applies, why = self.is_applicable(ctx)
        if applies:
            for m in self._dropouts(ctx.pl_module):
                m.p = 0.0
        return MitigationResult(self.name, applies, why, "on" if applies else "off", "off")


RUNG = NoDropout
