"""The import rules no linter checks (docs/architecture.md): no module cycle, imports inside functions counted; an
import inside a function only defers a heavy or optional module, and a comment on it (or the line above) says so."""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Measured with `python -X importtime` on the 2-core dev machine: each costs >= ~30 ms (torch 1.2 s, transformers
# 0.7 s; the least of ten runs: prometheus_client 44 ms, llguidance 34, jinja2 32, zmq 27, psutil 27); the optional
# ones may be absent.
HEAVY = {"torch", "transformers", "numpy", "httpx", "jinja2", "llguidance", "uvicorn", "fastapi", "starlette", "grpc",
         "gguf", "accelerate", "safetensors", "prometheus_client", "zmq", "psutil"}
OPTIONAL = {"triton", "vllm", "lm_eval", "openai", "compressed_tensors", "llmcompressor"}


@dataclass(frozen=True)
class Import:
    source: str
    target: str  # the keepwarm module it names, or the top-level external package
    in_function: bool
    type_checking: bool
    line: int


def modules() -> dict[str, Path]:
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = {}
    for package, folder in package_dirs.items():
        for path in (ROOT / folder).glob("*.py"):
            name = package if path.name == "__init__.py" else f"{package}.{path.stem}"
            if "grpc_gen" not in name:
                found[name] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING"


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")[: None if path.name == "__init__.py" else -1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _resolve(name: str, known: dict[str, Path]) -> str:
    if not name.startswith("keepwarm"):
        return name.split(".")[0]
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(module: str, path: Path, known: dict[str, Path]) -> list[Import]:
    found: list[Import] = []

    def walk(node: ast.AST, in_function: bool, type_checking: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                walk(child, True, type_checking)
            elif isinstance(child, ast.If) and _is_type_checking(child):
                for stmt in child.body:
                    walk(ast.Module(body=[stmt], type_ignores=[]), in_function, True)
                for stmt in child.orelse:
                    walk(ast.Module(body=[stmt], type_ignores=[]), in_function, type_checking)
            elif isinstance(child, ast.Import):
                found.extend(Import(module, _resolve(a.name, known), in_function, type_checking, child.lineno)
                             for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = _absolute(module, path, child)
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    target = full if full in known else _resolve(base, known)
                    found.append(Import(module, target, in_function, type_checking, child.lineno))
            else:
                walk(child, in_function, type_checking)

    walk(ast.parse(path.read_text(), filename=str(path)), False, False)
    return [i for i in found if i.target != module]


def all_imports() -> tuple[dict[str, Path], list[Import]]:
    known = modules()
    return known, [i for m, p in known.items() for i in imports_of(m, p, known)]


def cycles(known: dict[str, Path], edges: list[Import]) -> list[list[str]]:
    """Tarjan's strongly connected components over keepwarm modules; TYPE_CHECKING imports never run, so they are not
    edges."""
    graph: dict[str, set[str]] = {m: set() for m in known}
    for i in edges:
        if i.target in known and not i.type_checking:
            graph[i.source].add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return found


def heavy_modules(known: dict[str, Path], edges: list[Import]) -> set[str]:
    """keepwarm modules whose module-level imports reach a heavy or optional external package."""
    graph: dict[str, set[str]] = {m: set() for m in known}
    for i in edges:
        if not i.in_function and not i.type_checking:
            graph[i.source].add(i.target)
    heavy: set[str] = set()
    changed = True
    while changed:
        changed = False
        for m, targets in graph.items():
            if m not in heavy and any(t in HEAVY or t in OPTIONAL or t in heavy for t in targets):
                heavy.add(m)
                changed = True
    return heavy


def test_no_module_cycles() -> None:
    known, edges = all_imports()
    assert len(known) > 100  # the walk found the code
    found = cycles(known, edges)
    assert not found, "module cycles (imports inside functions count):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_imports_inside_functions_defer_a_heavy_or_optional_module_and_say_so() -> None:
    known, edges = all_imports()
    heavy = heavy_modules(known, edges)
    bad = []
    for i in edges:
        if not i.in_function or i.type_checking:
            continue
        lines = known[i.source].read_text().splitlines()
        said = "#" in lines[i.line - 1] or lines[i.line - 2].strip().startswith("#")
        deferrable = i.target in HEAVY or i.target in OPTIONAL or i.target in heavy
        if not (said and deferrable):
            why = "not heavy or optional" if not deferrable else "no comment saying why"
            bad.append(f"{known[i.source].relative_to(ROOT)}:{i.line} {i.target} ({why})")
    assert not bad, f"{len(bad)} imports inside functions:\n" + "\n".join(sorted(set(bad)))
