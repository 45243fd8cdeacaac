"""The README stays true: its quick start runs, its tag table is the callback's, its files exist."""

from __future__ import annotations

import re
from pathlib import Path

import lightning_seqmem
from lightning_seqmem import SeqMemCallback

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _tags(text: str) -> list[str]:
    return re.findall(r"``?(seqmem/[a-z_]+)``?", text)


def test_tag_table_matches_the_callback_docstring():
    assert _tags(README) and set(_tags(README)) == set(_tags(SeqMemCallback.__doc__))


def test_quick_start_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    block = re.search(r"## Quick start\n[^`]*```python\n(.*?)```", README, re.S).group(1)
    assert len([line for line in block.splitlines() if line.strip()]) <= 7  # imports + five lines
    namespace: dict = {}
    exec(compile(block.replace("max_steps=48", "max_steps=40"), "README quick start", "exec"),
         namespace)
    cb = namespace["cb"]
    assert cb.records and cb.applied_mitigations == ("attention",)


def test_files_the_readme_names_exist():
    root = Path(__file__).resolve().parents[1]
    for path in re.findall(r"((?:configs|examples|benchmarks|docs)/[\w/-]+\.(?:py|yaml|png))",
                           README):
        assert (root / path).exists(), path


def test_public_names_are_exported():
    for name in ("SeqMemCallback", "Curriculum", "PredictedOOMWarning", "QuadraticMemoryModel",
                 "TimelineModel"):
        assert name in lightning_seqmem.__all__
