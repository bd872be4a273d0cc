"""requirements.txt is the runtime: every third-party distribution the installed keepwarm package imports (at module
level or lazily, as the bundled model's GGUF conversion does), plus what transformers and torch need at run time
without keepwarm importing it, pinned as constraints.txt pins it, and no test or development tool.

`make run` installs requirements.txt alone, and the test suite runs in the dev venv, which has requirements-dev.txt
as well: a runtime package that only a dev tool pulls in (accelerate, through peft) passes every test and fails
`keepwarm preload` on a bare machine. This file checks the lists; `make test-bare-run` (tests/e2e/bare_run_check.sh)
installs requirements.txt alone into a fresh venv and serves a completion from it.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Needed at run time though no keepwarm module imports them: name -> why.
RUNTIME_ONLY_INDIRECT = {
    "accelerate": "transformers refuses to load a GGUF without it: the bundled model's conversion "
                  "(worker/default_model.py, AutoModelForCausalLM.from_pretrained(gguf_file=...))",
    "numpy": "torch's Tensor.numpy() (the daemon's loader and arena digests) and the gguf reader; torch does not "
             "require it",
}
# Imported by a keepwarm module but not a runtime requirement: name -> why.
IMPORTED_NOT_RUNTIME = {
    "vllm": "cli/peer_vllm.py runs inside vLLM's own virtual environment for the comparison benchmark",
}
# Test and development tools that must never become runtime requirements, whatever requirements-dev.txt says.
DEV_TOOLS = {"pytest", "pytest-timeout", "pytest-cov", "coverage", "openai", "ruff", "mypy", "import-linter",
             "schemathesis", "hypothesis", "peft", "grpcio-tools", "lm-eval", "langchain-openai",
             "compressed-tensors"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    """{normalized distribution: version} of a requirements file's own `name==version` lines (not its -r / -c)."""
    out: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*==\s*([^\s;]+)", line)
        assert m, f"{path.name}: {raw!r} is not an exact `name==version` pin"
        assert norm(m[1]) not in out, f"{path.name}: {m[1]} listed twice"
        out[norm(m[1])] = m[3]
    return out


def package_dirs() -> list[Path]:
    """The source folder of each top-level subpackage of the installed keepwarm (the folders package-dir maps
    onto keepwarm.<folder>), as the import system finds them; walked recursively, nested packages included."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    dirs = []
    for name in sorted(n for n in mapping if n.count(".") <= 1):
        spec = importlib.util.find_spec(name)  # imports only `keepwarm` itself, which imports nothing third-party
        assert spec is not None and spec.submodule_search_locations, f"{name} is not installed (make .venv first)"
        dirs.append(Path(next(iter(spec.submodule_search_locations))))
    return dirs


class _Imports(ast.NodeVisitor):
    """Absolute imports anywhere in a module (module level or inside functions), except `if TYPE_CHECKING:`."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
                (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.names.update(a.name.split(".")[0] for a in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:
            self.names.add(node.module.split(".")[0])


def third_party_imports() -> dict[str, set[str]]:
    """{top-level import name: files importing it} over the installed keepwarm package."""
    found: dict[str, set[str]] = {}
    for folder in package_dirs():
        for path in folder.rglob("*.py"):
            visitor = _Imports()
            visitor.visit(ast.parse(path.read_text(), str(path)))
            for name in visitor.names:
                if name in sys.stdlib_module_names or name in ("keepwarm", "__future__"):
                    continue
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_imported_distribution_is_a_runtime_requirement():
    runtime = pins(ROOT / "requirements.txt")
    dists = importlib.metadata.packages_distributions()
    imports = third_party_imports()
    assert {"torch", "transformers", "fastapi", "zmq"} <= set(imports), "the import walk found too little"
    missing = []
    for name, files in sorted(imports.items()):
        if name in IMPORTED_NOT_RUNTIME:
            continue
        candidates = {norm(d) for d in dists.get(name, [])}
        if not candidates:
            missing.append(f"{name} (no installed distribution provides it), imported by {sorted(files)[:3]}")
        elif not candidates & set(runtime):
            missing.append(f"{'/'.join(sorted(candidates))} (import {name}), imported by {sorted(files)[:3]}")
    assert not missing, "imported by keepwarm but not pinned in requirements.txt:\n  " + "\n  ".join(missing)


def test_runtime_requirements_are_only_what_runs():
    """Each requirements.txt pin is imported by keepwarm or listed above with the reason it runs; none is a dev
    tool (DEV_TOOLS, and everything requirements-dev.txt names itself)."""
    runtime = pins(ROOT / "requirements.txt")
    dists = importlib.metadata.packages_distributions()
    imported = {norm(d) for name in third_party_imports() for d in dists.get(name, [])}
    unexplained = sorted(set(runtime) - imported - set(RUNTIME_ONLY_INDIRECT))
    assert not unexplained, f"pinned in requirements.txt but neither imported by keepwarm nor explained: {unexplained}"
    assert set(RUNTIME_ONLY_INDIRECT) <= set(runtime), \
        f"needed at run time but missing from requirements.txt: {sorted(set(RUNTIME_ONLY_INDIRECT) - set(runtime))}"
    dev = set(pins(ROOT / "requirements-dev.txt")) | {norm(n) for n in DEV_TOOLS}
    assert not dev & set(runtime), f"dev-only tools in requirements.txt: {sorted(dev & set(runtime))}"


def test_runtime_pins_match_constraints_and_the_makefile():
    runtime = pins(ROOT / "requirements.txt")
    constraints = pins(ROOT / "constraints.txt")
    differ = {n: (v, constraints.get(n)) for n, v in runtime.items() if constraints.get(n) != v}
    assert not differ, f"requirements.txt vs constraints.txt (name: (requirements, constraints)): {differ}"
    makefile = (ROOT / "Makefile").read_text()
    torch_pins = set(re.findall(r"pip install -q torch==(\S+)", makefile))
    assert torch_pins == {runtime["torch"]}, f"the Makefile installs torch {torch_pins}, requirements.txt pins " \
                                            f"{runtime['torch']}"
    assert re.search(r"^test:.*\btest-bare-run\b", makefile, re.M), "`make test` must run `make test-bare-run`"
