"""Import hygiene: the wings of the package and their one-way doors, no import cycle, and the
library never imports the reference models.

The doors (``A <- B``: B may import A, never the reverse)::

    core <- plan <- present <- trainer, cli
    core <- measure <- mitigations <- dryrun <- diagnostics <- trainer, cli

``core`` and ``plan`` import neither torch nor Lightning; only ``trainer``, ``cli`` and the
reference models import Lightning; ``reference`` (nn, demo, hf) is imported by no wing but ``cli``
(``seqmem demo`` trains the reference GPT). Imports anywhere in a module count (function bodies
included), except under ``TYPE_CHECKING``; doctests are documentation, not imports.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from limits import limit_s

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_seqmem"
ROOT = "lightning_seqmem"

# wing -> the wings it may import (itself included)
DOORS = {
    "core": {"core"},
    "plan": {"core", "plan"},
    "present": {"core", "plan", "present"},
    "measure": {"core", "measure"},
    "mitigations": {"core", "measure", "mitigations"},
    "dryrun": {"core", "measure", "mitigations", "dryrun"},
    "diagnostics": {"core", "measure", "mitigations", "dryrun", "diagnostics"},
    "trainer": {"core", "plan", "present", "measure", "mitigations", "dryrun", "diagnostics",
                "trainer"},
    "cli": {"core", "plan", "present", "measure", "mitigations", "dryrun", "diagnostics", "trainer",
            "cli", "reference"},
    "reference": {"core", "reference"},
}
NO_TORCH = {"core", "plan", "present"}
LIGHTNING_ALLOWED = {"trainer", "cli", "reference"}
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _wing(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""  # "" is the package's own __init__


def _from_module(node: ast.ImportFrom, package: str) -> str:
    """The absolute name of the module a ``from ... import`` in ``package`` imports from."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(package modules, top-level external packages) that ``path`` imports, except under
    TYPE_CHECKING."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    found: set[str] = set()
    external: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            module = _from_module(node, package)
            candidates = [module] + [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        external |= {c.split(".")[0] for c in candidates[:1] if not c.startswith(ROOT)}
        found |= {c for c in candidates if c.startswith(ROOT) and _exists(c)}
    found.discard(name)
    return found, external


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").exists() or (PACKAGE / rel / "__init__.py").exists()


def _graph() -> dict[str, tuple[set[str], set[str]]]:
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def test_every_module_sits_in_a_wing():
    flat = sorted(m for m in _graph() if m != ROOT and _wing(m) not in DOORS)
    assert flat == [], f"modules outside the wings {sorted(DOORS)}: {flat}"


def test_the_doors_open_one_way():
    broken = []
    for module, (deps, _) in sorted(_graph().items()):
        wing = _wing(module)
        if not wing:
            continue
        for dep in sorted(deps):
            if dep != ROOT and _wing(dep) not in DOORS.get(wing, set()):
                broken.append(f"{module} imports {dep}")
    assert broken == [], "\n".join(broken)


def test_torch_stays_out_of_core_plan_and_present_and_lightning_out_of_the_library():
    broken = []
    for module, (_, external) in sorted(_graph().items()):
        wing = _wing(module)
        if wing in NO_TORCH and "torch" in external:
            broken.append(f"{module} imports torch")
        if wing not in LIGHTNING_ALLOWED and external & set(LIGHTNING):
            broken.append(f"{module} imports Lightning")
    assert broken == [], "\n".join(broken)


def test_no_import_cycle():
    graph = {m: deps for m, (deps, _) in _graph().items()}
    # a package's __init__ that only re-exports: an edge into it is an edge into what it exports
    for pkg in [m for m in graph if (PACKAGE / Path(*m.split(".")[1:]) / "__init__.py").exists()]:
        for m, deps in graph.items():
            if pkg in deps and not m.startswith(pkg + ".") and m != pkg:
                deps.discard(pkg)
                deps |= graph[pkg]
            elif pkg in deps:
                deps.discard(pkg)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: "
                                     + " -> ".join(stack[stack.index(dep):] + [dep]))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


@pytest.mark.parametrize("modules", [
    "lightning_seqmem.plan.planner, lightning_seqmem.core.advice, lightning_seqmem.plan.checkpoint",
    "lightning_seqmem.present.report, lightning_seqmem.present.panels",
])
def test_torch_free_wings_import_without_torch_or_lightning(modules):
    code = (f"import sys; import {modules};"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning', "
            "'pytorch_lightning')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=limit_s(120))
    assert out.stdout.strip() == "[]", out.stdout


def test_one_path_per_module_no_old_flat_names():
    """A module has one import path: the flat names of 0.1 (never released) are not importable."""
    import importlib

    import lightning_seqmem

    assert not hasattr(lightning_seqmem, "_OLD_NAMES")
    for old in ("demo", "callback", "planner", "probes", "edge", "advice_now"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"lightning_seqmem.{old}")


# Words that are rung names but mean something else where they stand (not a rung compared or
# dispatched on)
_NOT_A_RUNG = {
    # the JSON key of the attention-call counts of `seqmem plan --world-size`
    ("cli/plan_parallel.py", "attention"),
    # module names matched as attention in the breakdown
    ("diagnostics/categories.py", "attention"),
    ("present/render.py", "attention: "),  # prose: the attention backend a traced step ran
}


def _code_strings(path: Path) -> list[tuple[int, str]]:
    """The string constants of ``path`` that are code, not docstrings or bare string statements."""
    tree = ast.parse(path.read_text())
    docs = {id(n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_rung_names_appear_in_code_only_in_their_rung_file_and_the_registry():
    """A rung is one folder; no other module compares or dispatches on its name (docs and doctests
    may name it). The registry is core/rungs.py (the folders) and mitigations/ladder.py."""
    from lightning_seqmem.core.rung_spec import LEVEL_SEP
    from lightning_seqmem.core.rungs import BUILTIN_RUNGS, RUNG_FOLDERS

    owners = {name: (f"mitigations/{name}/",) for name in RUNG_FOLDERS}
    assert (set(owners) == set(BUILTIN_RUNGS)
            and all((PACKAGE / o[0]).is_dir() for o in owners.values()))
    registry = ("core/rungs.py", "mitigations/ladder.py")
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for line, text in _code_strings(path):
            name = text.split(LEVEL_SEP)[0]
            if (name in owners and not rel.startswith(owners[name] + registry)
                    and (rel, text) not in _NOT_A_RUNG):
                found.append(f"{rel}:{line}: {text!r}")
    assert found == [], "rung names compared outside their rung file:\n" + "\n".join(found)



# Imports of another module's `_private` name still allowed, each with its reason (remove the entry
# with the import): {(file under lightning_seqmem/, module imported from, name): reason}
_PRIVATE_IMPORT_EXCEPTIONS: dict[tuple[str, str, str], str] = {}


def _private_imports(source: str, module_name: str,
                     is_package: bool = False) -> list[tuple[str, str, int]]:
    """``(module imported from, _name, line)`` of each ``from lightning_seqmem... import _name`` in
    ``module_name`` (relative imports too; dunders such as ``__version__`` are not private)."""
    package = module_name if is_package else module_name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = _from_module(node, package)
        if module != ROOT and not module.startswith(ROOT + "."):
            continue
        found += [(module, a.name, node.lineno) for a in node.names
                  if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_module_imports_a_private_name_of_another():
    """issue 17: a `_private` name another module uses is that module's API: public there (in its
    ``__all__``, with a docstring), or moved into its one user."""
    found, used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for module, name, line in _private_imports(path.read_text(), _module_name(path),
                                                   path.name == "__init__.py"):
            if (rel, module, name) in _PRIVATE_IMPORT_EXCEPTIONS:
                used.add((rel, module, name))
            else:
                found.append(f"{rel}:{line}: from {module} import {name}")
    assert found == [], "private names imported from another module:\n" + "\n".join(found)
    assert used == set(_PRIVATE_IMPORT_EXCEPTIONS), (
        f"stale exceptions: {set(_PRIVATE_IMPORT_EXCEPTIONS) - used}")


def test_the_private_import_check_sees_a_planted_one():
    """The check above finds a private import, absolute, relative and in a function body, and passes
    a public name (even imported ``as _alias``), a dunder and another package's private name."""
    source = ("from lightning_seqmem.measure.tracker import _PLAIN_TENSORS, tensor_storages\n"
              "def f():\n    from .tracker import _flat\n"
              "from ..trainer.guard import guarded as _guarded\n"
              "from lightning_seqmem import __version__\nfrom os import _exit\n")
    assert _private_imports(source, "lightning_seqmem.measure.planted") == [
        ("lightning_seqmem.measure.tracker", "_PLAIN_TENSORS", 1),
        ("lightning_seqmem.measure.tracker", "_flat", 3)]


def test_no_two_modules_share_a_basename():
    """One path per name: a module's file name says which it is, in any wing but ``__init__.py``."""
    seen: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(PACKAGE)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def test_a_rung_folder_holds_its_rung_its_spec_and_its_card_and_the_spec_is_torch_free_data():
    """Each built-in rung's folder: a card (its ``__init__`` docstring, importing nothing), its rung
    (``<rung>.py`` with ``RUNG``) and its spec (``<rung>_spec.py``: imports core only, so the
    torch-free planner reads it)."""
    from lightning_seqmem.core.rungs import RUNG_FOLDERS, spec

    for name in RUNG_FOLDERS:
        folder = PACKAGE / "mitigations" / name
        card = ast.parse((folder / "__init__.py").read_text())
        assert ast.get_docstring(card) and len(card.body) == 1, (
            f"{name}: the card is a docstring only")
        assert "RUNG = " in (folder / f"{name}.py").read_text()
        spec_path = folder / f"{name}_spec.py"
        imported, external = _imports(spec_path)
        assert {_wing(m) for m in imported} <= {"core"} and external <= {"__future__"}, (
            name, imported, external)
        assert spec(name).name == name


def _reexports(path: Path) -> list[str]:
    """Names ``path``'s ``__all__`` lists that it imports from another module of the package."""
    tree = ast.parse(path.read_text())
    imported = {a.asname or a.name for n in tree.body
                if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(ROOT)
                for a in n.names}
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    listed: list[str] = []
    for n in tree.body:
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                             for t in n.targets):
            listed = list(ast.literal_eval(n.value))
    return sorted(name for name in listed if name in imported and name not in defined)


def test_no_module_re_exports_another_modules_names():
    """One path per name: a module's ``__all__`` is what it defines. The package's own ``__init__``
    (the public API, ``from lightning_seqmem import SeqMemCallback``) is the exception."""
    allowed = {PACKAGE / "__init__.py"}
    found = {str(p.relative_to(PACKAGE)): r for p in sorted(PACKAGE.rglob("*.py"))
             if p not in allowed for r in [_reexports(p)] if r}
    assert found == {}
