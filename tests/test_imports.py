"""Import hygiene: the planner loads neither torch nor Lightning, the package has no import cycle,
and the library never imports the reference models (``nn``, ``demo``, ``hf``)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from limits import limit_s

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_seqmem"
REFERENCE_MODELS = {"lightning_seqmem.nn", "lightning_seqmem.demo", "lightning_seqmem.hf"}


def test_planner_imports_without_torch_or_lightning():
    code = ("import sys, lightning_seqmem.planner, lightning_seqmem.advice;"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning', 'pytorch_lightning')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=limit_s(120))
    assert out.stdout.strip() == "[]", out.stdout


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Package modules ``path`` imports anywhere (function bodies included), except under TYPE_CHECKING."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            candidates = [module] + [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        found |= {c for c in candidates if c.startswith("lightning_seqmem") and _exists(c)}
    found.discard(name)
    return found


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").exists() or (PACKAGE / rel / "__init__.py").exists()


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def test_no_import_cycle():
    graph = _graph()
    # the package's __init__ only re-exports: an edge into it is an edge into what it exports
    graph = {m: {d for d in deps if d not in ("lightning_seqmem", "lightning_seqmem.mitigations")} | (
        graph["lightning_seqmem.mitigations"] if "lightning_seqmem.mitigations" in deps and m != "lightning_seqmem.mitigations" and not m.startswith("lightning_seqmem.mitigations.") else set())
        for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(dep):] + [dep]))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_the_library_does_not_import_the_reference_models():
    graph = _graph()
    users = {m: deps & REFERENCE_MODELS for m, deps in graph.items()
             if m not in REFERENCE_MODELS | {"lightning_seqmem.cli"} and deps & REFERENCE_MODELS}
    assert users == {}, users
