"""Where the memory goes: the per-category breakdown, theory (Korthikanti et al.), ablations and the
report's breakdown section."""
