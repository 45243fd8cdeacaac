"""The README stays true: its quick start runs, its tag table is the callback's, its files exist."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import lightning_seqmem
from lightning_seqmem import SeqMemCallback

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _tags(text: str) -> list[str]:
    return re.findall(r"``?(seqmem/[a-z_]+)``?", text)


def test_tag_table_matches_the_callback_docstring():
    assert _tags(README) and set(_tags(README)) == set(_tags(SeqMemCallback.__doc__))


def test_the_arguments_table_has_every_argument_with_its_default():
    table = README.split("## Arguments")[1].split("\n\n`Curriculum(")[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", table, re.M))
    params = list(inspect.signature(SeqMemCallback.__init__).parameters.values())[1:]
    assert set(rows) == {p.name for p in params}, sorted(set(rows) ^ {p.name for p in params})
    for p in params:  # a default in code form is the code's; the rest say it in words
        if rows[p.name].startswith("`"):
            assert rows[p.name].strip() == f"`{p.default!r}`".replace("'", '"'), p.name


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
