"""Where the memory goes: the per-category breakdown, theory (Korthikanti et al.), ablations and
the report's breakdown section. Torch, no Lightning.

One concern a module: :mod:`.growth` (how a part grows with L), :mod:`.categories` (which module a
byte belongs to), :mod:`.scope` (which module is running), :mod:`.tracer` (one traced step: the
``Breakdown``), :mod:`.korthikanti` (theory and ``calibrate``), :mod:`.compare` (several lengths
side by side), :mod:`.findings` (diagnoses and the attention ablation), :mod:`.traced_step` (a step
of a copy, as training runs it) and :mod:`.section` (the report's section, at safe lengths).
"""
