"""The code's shape rules that no linter checks (docs/architecture.md): no function over 100 lines, no class over 400,
no docstring over 15 lines (a docstring states rules; tables, measurements and history go to docs/)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cli", "daemon", "formats", "kernels", "keepwarm", "snapshot", "weights", "worker", "benchmarks", "tests")
MAX_LINES = 100
MAX_DOCSTRING_LINES = 15
MAX_CLASS_LINES = 400


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _docstrings(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        if isinstance(node, kinds) and ast.get_docstring(node, clean=False) is not None:
            yield getattr(node, "name", "<module>"), node.body[0]


def test_no_function_over_100_lines() -> None:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "grpc_gen" not in p.parts]
    assert len(files) > 100  # the walk found the code
    long = [f"{p.relative_to(ROOT)}:{f.lineno} {f.name} ({f.end_lineno - f.lineno + 1} lines)"
            for p in files for f in _functions(p) if f.end_lineno - f.lineno + 1 > MAX_LINES]
    assert not long, "functions over 100 lines (split them):\n" + "\n".join(long)


def test_no_class_over_400_lines() -> None:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "grpc_gen" not in p.parts]
    classes = [(p, c) for p in files for c in ast.walk(ast.parse(p.read_text(), filename=str(p)))
               if isinstance(c, ast.ClassDef)]
    assert len(classes) > 100  # the walk found the code
    long = [f"{p.relative_to(ROOT)}:{c.lineno} {c.name} ({c.end_lineno - c.lineno + 1} lines)"
            for p, c in classes if c.end_lineno - c.lineno + 1 > MAX_CLASS_LINES]
    assert not long, "classes over 400 lines (give a concern its own class):\n" + "\n".join(long)


def test_no_docstring_over_15_lines() -> None:
    # tests/ is left out: a test module's docstring may describe its fixtures at length
    files = [p for pkg in PACKAGES if pkg != "tests" for p in (ROOT / pkg).rglob("*.py") if "grpc_gen" not in p.parts]
    assert len(files) > 100  # the walk found the code
    long = [f"{p.relative_to(ROOT)}:{d.lineno} {name} ({d.end_lineno - d.lineno + 1} lines)"
            for p in files for name, d in _docstrings(p) if d.end_lineno - d.lineno + 1 > MAX_DOCSTRING_LINES]
    assert not long, "docstrings over 15 lines (move tables and measurements to docs/):\n" + "\n".join(long)
