"""The ``"checkpointing"`` rung's :class:`.RungSpec` (torch-free) and step-time prior."""

from __future__ import annotations

from lightning_seqmem.core.rung_spec import RungSpec

__all__ = ["SPEC"]

# every block recomputed in backward: about one more forward, ~1/3 of a step (Chen et al. 2016);
# "k/N" blocks cost k/N of it; "selective" recomputes the pointwise ops only (norms, activations,
# residual adds). benchmarks/checkpointing_levels.py on CPU (reference GPT, 4 layers, d_model 256,
# L=512, batch 2, AdamW), step time over plain in two runs: selective x1.089 / x1.213, 2/4 x1.128 /
# x1.259, all x1.271 / x1.373: selective's extra is 0.33-0.57 of full's, so 0.45 x 0.33 ~ 0.15. Its
# dispatch mode costs per op: on small models as much as full (x1.42 vs x1.44, d_model 128, L=256).
SPEC = RungSpec("checkpointing", "enable activation checkpointing", 0.33,
                level_priors=(("selective", 0.15),), engine_feature="activation_checkpointing",
                training_only=True)
