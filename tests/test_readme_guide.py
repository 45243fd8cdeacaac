"""The README's user guide stays true: it starts with the two commands for a fresh machine, then
your model; its warning table names every kind of warning the callback gives; its examples name
their extras."""

from __future__ import annotations

import re
from pathlib import Path

from lightning_seqmem.core.advice import KINDS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_the_readme_starts_with_the_demo_and_test_commands_then_the_quick_start():
    head = README[: README.index("## Quick start")]
    blocks = re.findall(r"```bash\n(.*?)\n```", head, re.S)
    assert (len(blocks) == 2 and blocks[0].endswith("seqmem demo")
            and blocks[1].endswith("python -m pytest -q"))
    assert README.index("## Quick start") < README.index("## Reading the panels") < README.index(
        "## How it works")


def test_the_warning_table_names_every_kind():
    table = README[README.index("## What each warning means and what to do"):]
    table = table[: table.index("\n## ", 1)]
    named = set(re.findall(r"`([a-z_]+)`",
                           " ".join(line.split("|")[1] for line in table.splitlines()
                                                     if line.startswith("| `"))))
    assert named == set(KINDS), set(KINDS) ^ named


def test_the_examples_that_need_an_extra_say_so():
    assert "`.[hf]` for `examples/hf_causal_lm.py`" in README
    assert '.[hf]' in (ROOT / "examples" / "hf_causal_lm.py").read_text()
    assert "--lengths 1024,4096" not in (ROOT / "examples" / "fsdp2_cpu.py").read_text()
