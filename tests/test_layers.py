"""The house: each top-level folder of lora_parity/ is one layer, and imports point down only.

Read from the source (ast), every import counts: at module level, inside a function, under
`if TYPE_CHECKING`. The rules are the ones each folder's `__init__.py` states in its first three lines.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.unit

PACKAGE = "lora_parity"
MAY_IMPORT: dict[str, set[str]] = {
    "util": set(),
    "evidence": {"util"},
    "verdict": {"util", "evidence"},
    "models": {"util", "evidence"},
    "backends": {"util", "evidence", "models"},
    "report": {"util", "evidence", "verdict"},
    "run": {"util", "evidence", "verdict", "models", "backends"},
    "api": {"util", "evidence", "verdict", "models", "backends", "run"},
    "stacks": {"util", "evidence", "verdict", "models", "backends", "run", "api"},
    "cli": {"util", "evidence", "verdict", "models", "backends", "report", "run", "api", "stacks"},
}
"""Folder -> the other folders its modules may import (its own always)."""
ENTRY_POINTS = {"lora_parity.__main__", "lora_parity.launch"}
"""Above the CLI: `python -m lora_parity` and torchrun's `-m lora_parity.launch`. The package itself
(`lora_parity/__init__.py`: `__version__`) imports nothing, so every module may import it."""
SHIMS = {"lora_parity.receipt", "lora_parity.config", "lora_parity.synthetic"}
"""Old module paths kept for scripts outside the package (the acceptance scripts, gpu-evidence.sh)."""
HEAVY = ("torch", "vllm", "transformers", "peft", "megatron", "tinker", "safetensors", "numpy")
"""Libraries the verdict must never import."""

Graph = dict[str, list[tuple[str, int]]]


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the package under `root`: dotted name -> file."""
    names = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _target(name: str, modules: dict[str, Path]) -> str:
    while name not in modules and "." in name:
        name = name.rpartition(".")[0]
    return name


def imports(path: Path) -> list[tuple[str, int]]:
    """(imported name, line) for every import in the file, wherever it stands; `from a import b` gives
    a.b (a submodule, or a name the caller resolves to a)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
    return found


def import_graph(root: Path) -> tuple[Graph, dict[str, list[tuple[str, int]]]]:
    """Module -> the package's modules it imports (with the line); and module -> its outside imports."""
    modules = module_names(root)
    graph: Graph = {}
    outside: dict[str, list[tuple[str, int]]] = {}
    for name, path in modules.items():
        graph[name], outside[name] = [], []
        for imported, line in imports(path):
            if imported.split(".")[0] == PACKAGE:
                target = _target(imported, modules)
                if target != name:
                    graph[name].append((target, line))
            else:
                outside[name].append((imported, line))
    return graph, outside


def floor(module: str) -> str | None:
    """The folder (layer) a module lives in; None for the top-level modules."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in MAY_IMPORT) else None


def upward_imports(graph: Graph) -> list[str]:
    """Every import a folder's rules do not allow, and every import of an entry point or a shim."""
    wrong = []
    for module, targets in graph.items():
        for target, line in targets:
            if module == PACKAGE:
                wrong.append(f"{PACKAGE}/__init__.py:{line} imports {target} (it imports nothing)")
                continue
            if target in ENTRY_POINTS | SHIMS:
                wrong.append(f"{module}:{line} imports {target} (an entry point or a shim: nothing imports it)")
                continue
            here, there = floor(module), floor(target)
            if here is None:
                if module not in ENTRY_POINTS | SHIMS | {PACKAGE}:
                    wrong.append(f"{module}: a top-level module that is neither an entry point nor a shim")
                continue
            if there is not None and there != here and there not in MAY_IMPORT[here]:
                wrong.append(f"{module}:{line} imports {target} ({here}/ may import {sorted(MAY_IMPORT[here])})")
    return wrong


def _reachable(adjacent: dict[str, list[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(adjacent[start])
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += adjacent[module]
    return seen


def circles(graph: Graph) -> list[list[str]]:
    """The import circles: each group of modules that reach one another through imports."""
    adjacent = {m: sorted({t for t, _ in ts if t in graph}) for m, ts in graph.items()}
    reachable = {m: _reachable(adjacent, m) for m in adjacent}
    found: list[list[str]] = []
    for module in sorted(adjacent):
        if module in reachable[module] and not any(module in group for group in found):
            found.append(sorted(m for m in reachable[module] if module in reachable[m]))
    return found


def test_every_import_points_down_a_floor() -> None:
    graph, _ = import_graph(ROOT)
    assert {floor(m) for m in graph} - {None} == set(MAY_IMPORT)
    assert upward_imports(graph) == []


def test_there_are_no_import_circles() -> None:
    graph, _ = import_graph(ROOT)
    assert circles(graph) == []


def test_the_verdict_imports_nothing_heavy() -> None:
    graph, outside = import_graph(ROOT)
    verdict = [m for m in graph if floor(m) == "verdict"]
    heavy = [f"{m}:{line} imports {name}" for m in verdict for name, line in outside[m]
             if name.split(".")[0] in HEAVY]
    assert heavy == []
    code = ("import sys\n" + "".join(f"import {m}\n" for m in verdict) +
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_each_folder_says_what_lives_there_and_what_it_may_import() -> None:
    for folder in MAY_IMPORT:
        doc = ast.get_docstring(ast.parse((ROOT / PACKAGE / folder / "__init__.py").read_text(encoding="utf-8")))
        assert doc is not None, folder
        head = doc.split("\n\n")[0].splitlines()
        assert len(head) == 3 and head[0].startswith(f"{folder}: "), (folder, head)
        assert "may import" in head[2].lower(), (folder, head[2])


def test_the_rules_catch_an_upward_import_and_a_circle() -> None:
    """The checks above can fail: a planted upward import and a planted circle are found."""
    graph: Graph = {
        "lora_parity.verdict.checks": [("lora_parity.backends.base", 3)],
        "lora_parity.backends.base": [("lora_parity.models.config", 1)],
        "lora_parity.models.config": [("lora_parity.models.probes", 9)],
        "lora_parity.models.probes": [("lora_parity.models.config", 4)],
        "lora_parity.run.runner": [("lora_parity.receipt", 2)],
        "lora_parity.stray": [],
        "lora_parity": [("lora_parity.util.errors", 5)],
    }
    assert upward_imports(graph) == [
        "lora_parity.verdict.checks:3 imports lora_parity.backends.base "
        "(verdict/ may import ['evidence', 'util'])",
        "lora_parity.run.runner:2 imports lora_parity.receipt (an entry point or a shim: nothing imports it)",
        "lora_parity/__init__.py:5 imports lora_parity.util.errors (it imports nothing)",
    ]
    graph["lora_parity.stray"] = [("lora_parity.util.errors", 1)]
    assert "lora_parity.stray: a top-level module that is neither an entry point nor a shim" in upward_imports(graph)
    assert circles(graph) == [["lora_parity.models.config", "lora_parity.models.probes"]]


MAX_MODULE_LINES = 450
"""The house's module size (the structure acceptance check): a module past it is split by what it does."""


def test_no_module_is_longer_than_the_house_allows() -> None:
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / PACKAGE).rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
