"""One tag table: the planner's metrics, the TensorBoard panels, the callback's docstring and the
README all name the tags of ``lightning_seqmem.core.tags.TAGS``, with the same meanings."""

from __future__ import annotations

import re
from pathlib import Path

from lightning_seqmem import SeqMemCallback
from lightning_seqmem.core.curriculum import Curriculum
from lightning_seqmem.core.records import StepMemory
from lightning_seqmem.core.rungs import MITIGATIONS
from lightning_seqmem.core.tags import PREFIX, TAGS
from lightning_seqmem.plan.metrics import metrics as plan_metrics
from lightning_seqmem.plan.planner import SeqMemPlanner
from lightning_seqmem.present.panels import custom_scalars_layout

README = Path(__file__).resolve().parents[1] / "README.md"


def _measured_planner():
    """A planner that has seen every kind of measurement: a budget, a curriculum, CUDA counters."""
    p = SeqMemPlanner(warmup_steps=1, memory_budget_bytes=10**9, safety_margin=0.1,
                      curriculum=Curriculum(start=64, target=256, steps_per_stage=2,
                                            multiple_of=64))
    records = []
    for step in range(8):
        d = p.decide((2, 256), {m: (False, "test") for m in MITIGATIONS})
        p.commit(d)
        L = d.seq_len or 256
        s = p.begin_step(L, 2, True, global_step=step)
        peak = 1_000_000 + 2 * (300 * L + 4 * L * L)
        memory = StepMemory(peak, {"forward": peak, "backward": peak - 1, "optimizer": 1_000_000},
                            1_000_000, 1_000_000, reserved_bytes=peak + 4096,
                            fragmentation_bytes=4096, fragmentation_fraction=0.001,
                            inactive_split_bytes=0, alloc_retries=0, num_ooms=0)
        records.append(p.observe(s, memory))
        p.course.end_batch()
    return p, records


def test_the_planner_logs_every_tag_and_only_those():
    p, records = _measured_planner()
    logged = set()
    for r in records:
        logged |= set(plan_metrics(r, p.evidence, p.course))
    assert logged == {t for t in TAGS if not t.startswith("validation_")}  # (the fit's own)


def test_every_tag_has_a_panel_and_every_panel_a_tag():
    charted = {tag for category in custom_scalars_layout().values() for _, tags in category.values()
               for tag in tags}
    assert charted == {PREFIX + t for t in TAGS}


def test_the_callback_docstring_table_is_the_tag_table():
    rows = re.findall(r"``seqmem/(\w+)``\s+(.+)", SeqMemCallback.__doc__)
    assert dict(rows) == TAGS and [t for t, _ in rows] == list(TAGS)


def test_the_readme_table_is_the_tag_table():
    rows = re.findall(r"^\| `seqmem/(\w+)` \| (.+?) \|$", README.read_text(), flags=re.M)
    assert dict(rows) == TAGS and [t for t, _ in rows] == list(TAGS)
