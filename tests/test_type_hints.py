"""Every public function of the packages states its argument and return types (read from the source)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("recipes", "trainer", "data", "kernels")


def unannotated(source: str) -> list[str]:
    """`name:line [what]` for each public function (or method) of `source` missing an annotation."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
        missing = [a.arg for a in args if a.annotation is None and a.arg not in ("self", "cls")]
        missing += [f"*{a.arg}" for a in (node.args.vararg, node.args.kwarg) if a is not None and a.annotation is None]
        if node.returns is None:
            missing.append("return")
        if missing:
            found.append(f"{node.name}:{node.lineno} {missing}")
    return found


def test_the_checker_sees_a_missing_argument_and_return_type():
    assert unannotated("def f(x: int) -> int: ...\ndef _g(x): ...") == []
    assert unannotated("def f(x, y: int): ...") == ["f:1 ['x', 'return']"]
    assert unannotated("class A:\n    def m(self, *a) -> None: ...") == ["m:2 ['*a']"]


def test_every_public_function_has_type_hints():
    missing = [f"{path.relative_to(ROOT)}: {item}" for package in PACKAGES
               for path in sorted((ROOT / package).rglob("*.py")) for item in unannotated(path.read_text())]
    assert not missing, "public functions without type hints:\n" + "\n".join(missing)
