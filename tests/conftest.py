"""Shared test setup: deliberate torch threading (2-core CI machines), GPU marker handling."""

from __future__ import annotations

import compileall
import os
import py_compile
import re
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# tests/support/ imports as the top-level package `support` under --import-mode=importlib.
sys.path.insert(0, str(Path(__file__).parent))

from support import models  # noqa: E402  (needs the path above)

# Every server, daemon and CLI process a test starts imports keepwarm again; where PYTHONDONTWRITEBYTECODE is set,
# each would compile it again too. Compiled once here (hash-checked pycs: an edited or mutated file is recompiled).
compileall.compile_dir(Path(__file__).resolve().parents[1], quiet=2, workers=1,
                       rx=re.compile(r"/(tests|build|docs|benchmarks|\.[^/]+)(/|$)"),
                       invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)

# Oversubscribed threads cost ~10x on a 2-core machine; tests that start worker processes set their own. Under
# pytest-xdist (`make test` runs two workers) the two cores are split between the workers.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(int(os.environ.get("KEEPWARM_TEST_THREADS", str(max(1, 2 // _WORKERS)))))

# A daemon that runs in the default runtime dir (a user's, or another checkout's test run) must not be found by
# tests that expect none: `LLM()` attaches to any daemon it finds. Tests that want a daemon start their own in a
# directory of their own; everything else sees this empty one.
os.environ["KEEPWARM_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="keepwarm-test-rt-")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# -- tiny random models and adapters (support/models.py: built once, cached on disk; no model hub) -------------------
@pytest.fixture(scope="session")
def model_cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where built models are kept: pytest's cache dir (reused by the next run), else this session's temp dir."""
    cache = getattr(request.config, "cache", None)
    return Path(cache.mkdir("keepwarm-models")) if cache is not None else tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model_factory(model_cache: Path):
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            key = models.build_key(name, models.TINY_MODELS[name])
            built[name] = str(models.cached_build(model_cache, name, key,
                                                  lambda d: models.make_tiny_model(d, name)))
        return built[name]

    return get


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def lora_adapters(tiny_llama, model_cache: Path) -> dict[str, str]:
    out = {}
    for i, (name, spec) in enumerate(models.LORA_SPECS.items()):
        key = models.build_key(name, spec, i, Path(tiny_llama).parent.name)  # the base model's key
        out[name] = str(models.cached_build(model_cache, name, key,
                                            lambda d, i=i, spec=spec: models.make_peft_adapter(tiny_llama, d,
                                                                                                seed=i, **spec)))
    return out


@pytest.fixture(scope="session")
def make_adapter():
    """make_peft_adapter(base_dir, out_dir, seed=0, **LoraConfig kwargs) -> adapter dir."""
    return models.make_peft_adapter


@pytest.fixture
def small_tmpfs():
    """``small_tmpfs(size_bytes)``: a tmpfs of that size mounted for the test (root only; skipped, saying why,
    where mounting is refused), unmounted after it. For full-disk tests (ENOSPC named, nothing half-written)."""
    import shutil
    import subprocess

    mounts: list[Path] = []

    def mount(size_bytes: int) -> Path:
        d = Path(tempfile.mkdtemp(prefix="kw-full-"))
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(d)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            os.rmdir(d)
            pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {r.stderr.strip()}")
        mounts.append(d)
        return d

    yield mount
    for d in mounts:
        subprocess.run(["umount", "-l", str(d)], check=False)
        shutil.rmtree(d, ignore_errors=True)
