"""The import structure of the packages: no cycles, imports flow down the layers, nothing imports scripts/,
and no production code (packages or scripts/) imports tests/.

Read from the source (import statements, also those inside functions), nothing is imported. Layers, low to
high (docs/architecture.md: `recipes → trainer → {data, trainer/comm, kernels}`, `trainer/comm → kernels`):
kernels and data import nothing of ours; trainer.config nothing; trainer.dist only trainer.config;
trainer.comm the two of them and kernels; the rest of trainer everything below it; recipes everything.

`import a.b.c` and `from a.b import c` name the module a.b.c (when it exists), not the packages above it:
that Python runs a package's `__init__` before its submodules is not an edge, or every package that
re-exports its submodules would be a cycle.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("recipes", "trainer", "data", "kernels")

MAY_IMPORT: dict[str, set[str]] = {
    "kernels": set(),
    "data": set(),
    "trainer.config": set(),
    "trainer.dist": {"trainer.config"},
    "trainer.comm": {"trainer.config", "trainer.dist", "kernels"},
    "trainer": {"trainer.config", "trainer.dist", "trainer.comm", "data", "kernels"},
    "recipes": {"trainer", "trainer.config", "trainer.dist", "trainer.comm", "data", "kernels"},
}
"""Layer -> the other layers its modules may import (a layer may always import itself)."""


@dataclass(frozen=True)
class Import:
    source: str
    """The importing module."""
    target: str
    """The imported module (ours, or the top-level name of someone else's)."""
    where: str
    """path:line of the import statement."""


def modules_of(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module of `packages` under `root`: dotted name -> file (a package is its `__init__.py`)."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _resolve(name: str, known: set[str]) -> str:
    """The longest prefix of the dotted `name` that is one of our modules, else its top-level name."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in known:
            return ".".join(parts[:end])
    return parts[0]


def imports_of(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[Import]:
    """Every import statement in the modules of `packages` (at any depth of the file), resolved to modules."""
    modules = modules_of(root, packages)
    known = set(modules)
    found = []
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [_resolve(alias.name, known) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, up level - 1 more
                    anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else _resolve(base, known)
                           for alias in node.names]
            else:
                continue
            where = f"{path.relative_to(root)}:{node.lineno}"
            found += [Import(module, target, where) for target in dict.fromkeys(targets) if target != module]
    return found


def find_cycles(imports: list[Import]) -> list[list[Import]]:
    """One cycle (as its chain of imports, back to its start) for every strongly connected set of modules."""
    graph: dict[str, list[Import]] = {}
    for imp in imports:
        graph.setdefault(imp.source, []).append(imp)
        graph.setdefault(imp.target, [])
    # Tarjan's strongly connected components, iteratively (no recursion limit on long chains).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            edges = graph[node]
            if i < len(edges):
                work.append((node, i + 1))
                nxt = edges[i].target
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return [_cycle_in(sorted(c), graph) for c in components]


def _cycle_in(component: list[str], graph: dict[str, list[Import]]) -> list[Import]:
    """A shortest chain of imports from the component's first module back to itself, inside the component."""
    members, start = set(component), component[0]
    paths: dict[str, list[Import]] = {start: []}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for imp in graph[node]:
                if imp.target == start:
                    return paths[node] + [imp]
                if imp.target in members and imp.target not in paths:
                    paths[imp.target] = paths[node] + [imp]
                    nxt_frontier.append(imp.target)
        frontier = nxt_frontier
    raise AssertionError(f"no cycle through {start} in {component}")


def describe(chain: list[Import]) -> str:
    return " -> ".join([chain[0].source] + [f"{imp.target} ({imp.where})" for imp in chain])


def layer_of(module: str) -> str | None:
    """The layer of one of our modules (the longest layer name that is a prefix of it); None: not ours."""
    matches = [layer for layer in MAY_IMPORT if module == layer or module.startswith(layer + ".")]
    return max(matches, key=len) if matches else None


def layer_violations(imports: list[Import]) -> list[str]:
    out = []
    for imp in imports:
        source, target = layer_of(imp.source), layer_of(imp.target)
        if source is None or target is None or target == source or target in MAY_IMPORT[source]:
            continue
        allowed = ", ".join(sorted(MAY_IMPORT[source])) or "nothing of ours"
        out.append(f"{imp.where}: {imp.source} (layer {source}) imports {imp.target} (layer {target}); "
                   f"{source} may import {allowed}")
    return out


# ---------------------------------------------------------------- the repository


@pytest.fixture(scope="module")
def repo_imports() -> list[Import]:
    return imports_of(ROOT)


def test_no_import_cycles(repo_imports):
    cycles = find_cycles(repo_imports)
    assert not cycles, "import cycles:\n" + "\n".join(describe(c) for c in cycles)


def test_imports_flow_down_the_layers(repo_imports):
    violations = layer_violations(repo_imports)
    assert not violations, "imports against the layers:\n" + "\n".join(violations)


def test_the_packages_do_not_import_scripts_or_tests(repo_imports):
    """scripts/ are command lines over the packages and tests/ check them; logic they share lives in a package."""
    bad = [f"{imp.where}: {imp.source} imports {imp.target}" for imp in repo_imports
           if imp.target in ("scripts", "tests")]  # imports outside the scanned packages resolve to the top name
    assert not bad, "imports of scripts/ or tests/:\n" + "\n".join(bad)


def test_scripts_do_not_import_tests():
    """A command line runs without the test suite: nothing under scripts/ imports tests/."""
    bad = [f"{imp.where}: {imp.source} imports {imp.target}" for imp in imports_of(ROOT, ("scripts",))
           if imp.target == "tests"]
    assert not bad, "imports of tests/ from scripts/:\n" + "\n".join(bad)


def test_horovod_is_imported_only_when_chosen(repo_imports):
    """Optional backend: only the backend registry imports it, and only inside the function that sets it up."""
    importers = {imp.source for imp in repo_imports if imp.target == "trainer.dist.horovod_backend"}
    assert importers == {"trainer.dist.backends"}
    tree = ast.parse((ROOT / "trainer" / "dist" / "backends.py").read_text())
    top_level = [node for node in tree.body if isinstance(node, ast.ImportFrom)]
    assert all(node.module != "trainer.dist.horovod_backend" for node in top_level)


# ---------------------------------------------------------------- the checker itself


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_checker_finds_a_cycle_through_an_import_inside_a_function(tmp_path):
    """A backend module imported inside a function of the module it imports: a cycle all the same."""
    root = write_tree(tmp_path, {
        "trainer/__init__.py": "",
        "trainer/dist.py": "class Group: ...\n\ndef setup(cfg):\n"
                           "    from trainer.horovod_backend import setup_horovod\n    return setup_horovod(cfg)\n",
        "trainer/horovod_backend.py": "from trainer.dist import Group\n\nclass HorovodGroup(Group): ...\n",
        "trainer/loop.py": "from trainer.dist import setup\n",
    })
    cycles = find_cycles(imports_of(root, ("trainer",)))
    assert [describe(c) for c in cycles] == [
        "trainer.dist -> trainer.horovod_backend (trainer/dist.py:4) -> trainer.dist (trainer/horovod_backend.py:1)"]


def test_the_checker_passes_a_package_that_re_exports_its_modules(tmp_path):
    root = write_tree(tmp_path, {
        "kernels/__init__.py": "from kernels.lars import FusedLARS\nfrom kernels import _native\n",
        "kernels/_native.py": "import os\n",
        "kernels/lars.py": "from kernels import _native\nfrom . import _native as again\n",
    })
    imports = imports_of(root, ("kernels",))
    assert {(i.source, i.target) for i in imports} == {
        ("kernels", "kernels.lars"), ("kernels", "kernels._native"), ("kernels._native", "os"),
        ("kernels.lars", "kernels._native")}
    assert find_cycles(imports) == []


def test_the_checker_names_an_import_against_the_layers(tmp_path):
    root = write_tree(tmp_path, {
        "kernels/__init__.py": "def f():\n    import trainer.loop\n",
        "trainer/__init__.py": "",
        "trainer/loop.py": "",
        "trainer/dist/__init__.py": "from trainer.comm import x\n",
        "trainer/comm/__init__.py": "from trainer.dist import y\nfrom trainer.config import z\n",
        "trainer/config.py": "",
    })
    assert layer_violations(imports_of(root, ("kernels", "trainer"))) == [
        "kernels/__init__.py:2: kernels (layer kernels) imports trainer.loop (layer trainer); kernels may import "
        "nothing of ours",
        "trainer/dist/__init__.py:1: trainer.dist (layer trainer.dist) imports trainer.comm (layer trainer.comm); "
        "trainer.dist may import trainer.config"]
