"""The code's shape rules that no linter checks (docs/architecture.md): no function over 100 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cli", "daemon", "formats", "kernels", "keepwarm", "snapshot", "worker", "benchmarks", "tests")
MAX_LINES = 100


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_function_over_100_lines() -> None:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "grpc_gen" not in p.parts]
    assert len(files) > 100  # the walk found the code
    long = [f"{p.relative_to(ROOT)}:{f.lineno} {f.name} ({f.end_lineno - f.lineno + 1} lines)"
            for p in files for f in _functions(p) if f.end_lineno - f.lineno + 1 > MAX_LINES]
    assert not long, "functions over 100 lines (split them):\n" + "\n".join(long)
