"""The tests' own layout (docs/testing.md, "Layout"): every test module lives under unit/, e2e/ or bench/; a folder
under unit/ is a folder of the code (unit/worker/engine/ tests worker/engine/); test file names are unique, so a
name in the docs (`test_restart.py::...`) points at one file; and no test module imports another, at module level,
inside a function or through importlib: what tests share lives in support/ or a conftest.py fixture."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
HOMES = ("unit", "e2e", "bench")


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


def _python_files() -> list[Path]:
    """Every module under tests/ that a test run imports or starts: the tests, support/, conftest.py files and the
    scripts beside them (tests/data/ holds inputs written for other programs)."""
    return sorted(p for p in TESTS.rglob("*.py")
                  if "__pycache__" not in p.parts and p.relative_to(TESTS).parts[0] != "data")


def test_every_test_module_lives_under_unit_e2e_or_bench() -> None:
    files = _test_files()
    assert len(files) > 50  # the walk found the tests
    stray = [str(p.relative_to(TESTS)) for p in files if p.relative_to(TESTS).parts[0] not in HOMES]
    assert not stray, f"test modules outside {', '.join(HOMES)}/: {stray}"


def test_unit_folders_are_folders_of_the_code() -> None:
    for p in _test_files():
        rel = p.parent.relative_to(TESTS)
        if rel.parts[:1] != ("unit",) or len(rel.parts) == 1:
            continue  # unit/ itself holds the checks over the whole tree (code shape, imports, requirements)
        code = ROOT.joinpath(*rel.parts[1:])
        assert (code / "__init__.py").is_file(), f"{rel}/ is laid out like no package of the code ({code} is none)"


def test_test_file_names_are_unique() -> None:
    seen: dict[str, Path] = {}
    for p in _test_files():
        assert p.name not in seen, f"{p.relative_to(TESTS)} and {seen[p.name].relative_to(TESTS)} share a name"
        seen[p.name] = p


def _imported_names(path: Path) -> list[tuple[int, str]]:
    """(line, top-level name) of every import in the file, inside functions too, and of every importlib call
    (`import_module`, `__import__`) given a literal name; a relative import is named by its dots."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.lineno, "." * node.level if node.level else (node.module or "").split(".")[0]))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                out.append((node.lineno, node.args[0].value.split(".")[0]))
    return out


def test_no_test_module_imports_another() -> None:
    test_modules = {p.stem for p in _test_files()} | {"conftest", "tests", *HOMES}
    bad = []
    for path in _python_files():
        inside_support = path.relative_to(TESTS).parts[0] == "support"
        for line, name in _imported_names(path):
            # relative imports only inside the support package (support/x.py importing its siblings)
            if name in test_modules or (name.startswith(".") and not inside_support):
                bad.append(f"{path.relative_to(TESTS)}:{line} imports {name}")
    assert not bad, "test modules import other test modules (move what they share to support/):\n" + "\n".join(bad)
