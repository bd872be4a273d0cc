"""Nothing resident from a failed operation (issue 43, point 3): a rejected adapter, a failed preload and a failed
snapshot restore each leave no entry in the daemon's ``status`` (models, adapters, loading), no file in its
shared-memory directory, and nothing that a daemon restarted after a SIGKILL would re-adopt.

One daemon serves the whole table (a row lists the directory and ``status`` before and after its operation), one
``keepwarm serve`` attached to it takes the adapter rows through ``/v1/load_lora_adapter``, and the restart check
runs once, last. Faults the files cannot cause (ENOSPC in the middle of a preload, an exception inside the
quantizer) are injected into the daemon process by a ``sitecustomize`` (through PYTHONPATH) that wraps one function
of ``keepwarm.weights.loader`` while a control file names the fault: no hook in keepwarm's code.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from support.daemon import DaemonProc, new_runtime_dir
from support.serve import ServeProcess

from keepwarm.daemon.client import DaemonClient, DaemonError
from keepwarm.formats import paths
from keepwarm.formats.adapter import adapter_digest

pytestmark = pytest.mark.slow  # real daemon and server processes

SITECUSTOMIZE = '''
import errno, os

_control = os.environ.get("KEEPWARM_TEST_FAULT_FILE")
if _control:
    import keepwarm.daemon.adapters
    import keepwarm.weights.loader
    import keepwarm.daemon.residency

    def _armed(fault):
        try:
            with open(_control) as f:
                return f.read().strip() == fault
        except OSError:
            return False

    def _wrap(module, name, fault, exc, when=lambda args: True):
        fn = getattr(module, name)

        def wrapper(*args, **kwargs):
            if _armed(fault) and when(args):
                raise exc()
            return fn(*args, **kwargs)

        setattr(module, name, wrapper)

    def _enospc():
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    _wrap(keepwarm.weights.loader, "pwrite_all", "enospc", _enospc)
    _wrap(keepwarm.weights.loader, "quantize", "quantize",
          lambda: RuntimeError("injected failure inside the quantizer"))
    for _module in (keepwarm.daemon.adapters, keepwarm.daemon.residency):  # the manifest, after the data landed
        _wrap(_module, "write_file_atomic", "enospc-manifest", _enospc,
              lambda args: str(args[0]).endswith(("-manifest", ".json")))
'''

LORA_RANK = 4
MAX_LORA_RANK = 8


class Daemon(DaemonProc):
    """A real `keepwarm daemon run --threads 1` on its own runtime dir, with the fault injector loaded."""

    def __init__(self, root: Path) -> None:
        (root / "inject").mkdir()
        (root / "inject" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        self.fault_file = root / "fault"
        super().__init__(new_runtime_dir("kwfo-"), threads=1, env={
            "KEEPWARM_TEST_FAULT_FILE": str(self.fault_file),
            "PYTHONPATH": os.pathsep.join([str(root / "inject"), os.environ.get("PYTHONPATH", "")])})
        self.rt = self.runtime_dir
        self.shm = paths.shm_dir(self.rt)

    def client(self, timeout: float = 60.0) -> DaemonClient:
        return super().client(timeout)

    def files(self) -> set[str]:
        return {p.name for p in self.shm.iterdir()} if self.shm.is_dir() else set()

    def resident(self) -> dict:
        """What the daemon holds: status's models and adapters, the loads in flight, the arena directory's files."""
        st = self.status()
        return {"models": sorted(m["fingerprint"] for m in st["models"]),
                "adapters": sorted(a["digest"] for a in st["adapters"]), "loading": st["loading"],
                "files": sorted(self.files())}


@contextmanager
def leaves_nothing(daemon: Daemon):
    """The operation inside may fail as it must; afterwards the daemon holds exactly what it held before."""
    before = daemon.resident()
    assert before["loading"] == []
    yield
    after = daemon.resident()
    assert after == before, f"left resident: {after} (before: {before})\n{daemon.log()[-2000:]}"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("failed-ops")).start()
    yield d
    d.stop()
    shutil.rmtree(d.shm, ignore_errors=True)
    shutil.rmtree(d.rt, ignore_errors=True)


# -- adapters ----------------------------------------------------------------------------------------------------------
def _lora_tensors(cfg: dict, rank: int, modules: dict[str, tuple[int, int]], delta: int = 0) -> dict:
    """PEFT-named A [rank, in + delta] and B [out, rank] for every layer and module (name -> (in, out))."""
    import torch

    g = torch.Generator().manual_seed(rank + delta)
    out = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (fan_in, fan_out) in modules.items():
            part = "mlp" if module.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            out[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in + delta, generator=g) * 0.1
            out[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.1
    return out


def _write_adapter(d: Path, tensors: dict | None, rank: int, targets: list[str], weights: bytes | None = None,
                   config: bool = True) -> str:
    from safetensors.torch import save_file

    d.mkdir()
    if config:
        (d / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "bias": "none"}))
    if weights is not None:
        (d / "adapter_model.safetensors").write_bytes(weights)
    else:
        save_file(tensors, str(d / "adapter_model.safetensors"))
    return str(d)


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    """One adapter the server loads at start ("good"), one more it could load but for --max-cpu-loras ("valid"),
    and one per kind of rejection."""
    cfg = json.loads((Path(tiny_llama) / "config.json").read_text())
    h = cfg["hidden_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    root = tmp_path_factory.mktemp("adapters")
    qv = {"q_proj": (h, q), "v_proj": (h, cfg["num_key_value_heads"] * cfg["head_dim"])}
    good = _lora_tensors(cfg, LORA_RANK, qv)
    return {
        "good": _write_adapter(root / "good", good, LORA_RANK, ["q_proj", "v_proj"]),
        "valid": _write_adapter(root / "valid", _lora_tensors(cfg, LORA_RANK, {"o_proj": (q, h)}), LORA_RANK,
                                ["o_proj"]),
        "random-bytes": _write_adapter(root / "random-bytes", None, LORA_RANK, ["q_proj"],
                                       weights=os.urandom(64 << 10)),
        "wrong-shapes": _write_adapter(root / "wrong-shapes", _lora_tensors(cfg, LORA_RANK, qv, delta=8), LORA_RANK,
                                       ["q_proj", "v_proj"]),
        "rank-too-high": _write_adapter(root / "rank-too-high", _lora_tensors(cfg, 2 * MAX_LORA_RANK, qv),
                                        2 * MAX_LORA_RANK, ["q_proj", "v_proj"]),
        "unknown-target": _write_adapter(root / "unknown-target", {
            "base_model.model.lm_head.lora_A.weight": good[next(iter(good))],
            "base_model.model.lm_head.lora_B.weight": good[list(good)[1]]}, LORA_RANK, ["lm_head"]),
        "missing-config": _write_adapter(root / "missing-config", good, LORA_RANK, ["q_proj"], config=False),
        "rank-mismatch": _write_adapter(root / "rank-mismatch", _lora_tensors(cfg, LORA_RANK // 2, qv), LORA_RANK,
                                        ["q_proj", "v_proj"]),
    }


@pytest.fixture(scope="module")
def server(daemon, tiny_llama, adapters):
    s = ServeProcess(tiny_llama, "--dtype", "float32", "--max-model-len", "128", "--threads", "1",
                     "--served-model-name", "base", "--enable-lora", "--enable-lora-runtime-updates",
                     "--max-lora-rank", str(MAX_LORA_RANK), "--max-cpu-loras", "1",
                     "--lora-modules", f"good={adapters['good']}", env={"KEEPWARM_RUNTIME_DIR": str(daemon.rt)})
    yield s
    s.stop()


ADAPTER_ROWS = [
    ("random-bytes", "adapter_model.safetensors is not a safetensors file"),
    ("wrong-shapes", "the model needs A(4, 128)"),
    ("rank-too-high", f"above --max-lora-rank {MAX_LORA_RANK}"),
    ("unknown-target", "targets module 'lm_head'"),
    ("missing-config", "adapter_config.json is missing"),
    ("valid", "the --max-cpu-loras limit"),  # checked out, then refused by the engine: the daemon's copy goes too
]


@pytest.mark.parametrize(("case", "message"), ADAPTER_ROWS, ids=[r[0] for r in ADAPTER_ROWS])
def test_a_rejected_adapter_leaves_nothing_resident(daemon, server, adapters, case, message) -> None:
    models = httpx.get(server.base + "/v1/models").json()["data"]
    with leaves_nothing(daemon):
        r = httpx.post(server.base + "/v1/load_lora_adapter", json={"lora_name": case, "lora_path": adapters[case]},
                       timeout=60)
        assert r.status_code == 400, r.text
        assert message in r.json()["error"]["message"], r.json()
    assert httpx.get(server.base + "/v1/models").json()["data"] == models


DAEMON_ADAPTER_ROWS = [  # (case, injected fault, error code, message)
    ("random-bytes", None, "bad_adapter", "adapter_model.safetensors is not a safetensors file"),
    ("missing-config", None, "bad_adapter", "adapter_config.json is missing"),
    ("rank-mismatch", None, "bad_adapter", f"adapter_config.json's r={LORA_RANK} needs [r, in]"),
    ("valid", "enospc-manifest", "load_failed", "No space left on device"),  # its data file had landed
]


@pytest.mark.parametrize(("case", "fault", "code", "message"), DAEMON_ADAPTER_ROWS,
                         ids=[r[0] for r in DAEMON_ADAPTER_ROWS])
def test_the_daemon_refuses_an_adapter_before_anything_is_resident(daemon, adapters, case, fault, code,
                                                                   message) -> None:
    """What needs no model is checked before the adapter's bytes are written: a client that never checks the
    adapter against a model (a script, a restore) cannot make garbage resident either; a write that fails takes
    back what it wrote."""
    if fault:
        daemon.fault_file.write_text(fault)
    try:
        with leaves_nothing(daemon), daemon.client() as c, pytest.raises(DaemonError) as e:
            c.load_adapter(adapters[case])
    finally:
        daemon.fault_file.unlink(missing_ok=True)
    assert e.value.code == code and message in e.value.message and "\n" not in e.value.message, e.value


# -- preloads ----------------------------------------------------------------------------------------------------------
def _broken_model(tiny_llama: str, root: Path, case: str) -> str:
    d = root / case
    shutil.copytree(tiny_llama, d)
    weights = d / "model.safetensors"
    cfg = json.loads((d / "config.json").read_text())
    if case == "arch":
        cfg["architectures"] = ["BertModel"]
    elif case == "quant-method":
        cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    elif case == "header":
        with open(weights, "r+b") as f:
            f.write(b"\xff" * 16)
    elif case == "truncated":
        os.truncate(weights, weights.stat().st_size * 3 // 5)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


PRELOAD_ROWS = [  # (case, quantization, tensor-parallel size, injected fault, error code, message)
    ("arch", "none", 1, None, "bad_model", "unsupported architecture 'BertModel'"),
    ("header", "none", 1, None, "bad_model", "is not a safetensors file"),
    ("truncated", "none", 1, None, "bad_model", "extends past the end of the file"),
    ("quant-method", "auto", 1, None, "bad_quantization", "quant_method"),
    ("quant-name", "int3", 1, None, "bad_quantization", "unknown quantization 'int3'"),
    ("enospc", "int8", 1, "enospc", "load_failed", "No space left on device"),
    ("quantizer", "int8", 1, "quantize", "load_failed", "injected failure inside the quantizer"),
    # the manifest written last, the arena already under its final name: one arena, then shard arenas
    ("enospc-manifest", "int8", 1, "enospc-manifest", "load_failed", "No space left on device"),
    ("enospc-manifest-shards", "int8", 2, "enospc-manifest", "load_failed", "No space left on device"),
]


@pytest.mark.parametrize(("case", "quantization", "tp", "fault", "code", "message"), PRELOAD_ROWS,
                         ids=[r[0] for r in PRELOAD_ROWS])
def test_a_failed_preload_leaves_nothing_resident(daemon, tiny_llama, tmp_path, case, quantization, tp, fault, code,
                                                  message) -> None:
    model = tiny_llama if fault or case == "quant-name" else _broken_model(tiny_llama, tmp_path, case)
    if fault:
        daemon.fault_file.write_text(fault)
    try:
        with leaves_nothing(daemon), daemon.client() as c, pytest.raises(DaemonError) as e:
            c.preload(model, quantization=quantization, dtype="float32", tp_size=tp)
    finally:
        daemon.fault_file.unlink(missing_ok=True)
    assert e.value.code == code and message in e.value.message and "\n" not in e.value.message, e.value


# -- snapshot restores -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def snapshot(daemon, tiny_llama, tmp_path_factory):
    """A snapshot of the tiny llama in int8 (not what the server holds), evicted again: a restore must load it."""
    from keepwarm.snapshot.create import create
    from keepwarm.snapshot.store import Store

    home = tmp_path_factory.mktemp("home")
    toml = home / "from.toml"
    toml.write_text(f'model = "{tiny_llama}"\ndtype = "float32"\nquantization = "int8"\nmax_model_len = 128\n'
                    f'runtime_dir = "{daemon.rt}"\n')
    store = Store(home / "store")
    m = create("base", config_path=str(toml), preload=True, store=store).manifest
    with daemon.client() as c:
        c.evict(m["models"][0]["fingerprint"])
    return home, store


def _variant(store, case: str, adapters: dict[str, str]) -> str:
    """A copy of snapshot "base" broken as ``case``; returns its name."""
    from keepwarm.snapshot import manifest as mf

    m = store.load("base")
    mod = m["models"][0]
    img = mf.platform_images(mod)[0]  # this machine's image (the one a restore here loads), changed in place
    image = store.read_blob(img["image"]["digest"])
    arena = json.loads(store.read_blob(img["image_manifest"]["digest"]))
    if case == "image-corrupt":
        tensor = arena["tensors"][len(arena["tensors"]) // 2]
        at = tensor["offset"] + tensor["nbytes"] // 2
        img["image"] = store.put_bytes(image[:at] + bytes([image[at] ^ 0xFF]) + image[at + 1:]).ref()
    elif case == "image-missing":
        img["image"] = {"digest": hashlib.sha256(b"never stored").hexdigest(), "size": img["image"]["size"]}
    elif case == "image-short":  # the manifest's layout does not fit in the image
        img["image"] = store.put_bytes(image[:len(image) // 2]).ref()
    elif case == "layout-foreign":  # a CPU layout this machine does not produce
        weight = next(iter(arena["quant"]))
        arena["quant"][weight] = {**arena["quant"][weight], "layout": "int4_cpu_from_another_torch",
                                  "scheme": "int4"}
        img["image_manifest"] = store.put_bytes(json.dumps(arena).encode()).ref()
        # made before the two layers: no portable layer for restore to build this machine's arena from instead
        for k in ("portable", "platforms"):
            del mod[k]
        mod.update({k: img[k] for k in ("image", "image_manifest", "arena_digest")})
    elif case == "adapter-rejected":  # the image loads, then the daemon refuses the adapter: the image goes again
        config, weights = b'{"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}', os.urandom(4096)
        m["adapters"] = [{"name": "junk", "digest": adapter_digest(config.decode(), weights), "rank": 4,
                          "source": "/nowhere/junk", "files": {"adapter_config.json": store.put_bytes(config).ref(),
                                                               "adapter_model.safetensors":
                                                                   store.put_bytes(weights).ref()}}]
    elif case == "adapter-mislabelled":  # a well-formed adapter under another digest: loaded, then refused
        files = {f: store.put_file(Path(adapters["valid"]) / f).ref()
                 for f in ("adapter_config.json", "adapter_model.safetensors")}
        m["adapters"] = [{"name": "mislabelled", "digest": "ab" * 32, "rank": LORA_RANK, "source": adapters["valid"],
                          "files": files}]
    m["name"] = case
    store.save(m)
    return case


RESTORE_ROWS = [
    ("image-corrupt", "does not match its manifest's arena_digest"),
    ("image-missing", "cannot read the image"),
    ("image-short", "its manifest needs"),
    ("layout-foreign", "int4_cpu_from_another_torch"),
    ("adapter-rejected", "the daemon refused adapter junk"),
    ("adapter-mislabelled", "adapter mislabelled: the daemon read digest"),
]


@pytest.mark.parametrize(("case", "message"), RESTORE_ROWS, ids=[r[0] for r in RESTORE_ROWS])
def test_a_failed_restore_leaves_nothing_resident(daemon, snapshot, adapters, monkeypatch, case, message) -> None:
    from keepwarm.snapshot.manifest import SnapshotError
    from keepwarm.snapshot.restore import restore

    home, store = snapshot
    monkeypatch.setenv("KEEPWARM_HOME", str(home))
    monkeypatch.setenv("KEEPWARM_RUNTIME_DIR", str(daemon.rt))
    name = _variant(store, case, adapters)
    target = home / "server.toml"
    with leaves_nothing(daemon), pytest.raises(SnapshotError) as e:
        restore(name, store=store, server_config=str(target))
    assert message in str(e.value) and "\n" not in str(e.value), e.value
    assert not target.exists()
    assert not [p for p in (home / "restored").rglob("*") if p.is_file()]  # staged files removed


# -- after all of them: a daemon killed and restarted adopts only what succeeded ---------------------------------------
def test_a_restarted_daemon_adopts_nothing_from_the_failures(daemon, server, adapters) -> None:
    """Runs after the table: the arena directory holds the served model's arena and the good adapter, nothing else,
    and a daemon restarted after SIGKILL (no clean shutdown removing anything) adopts exactly those."""
    before = daemon.resident()
    good = Path(adapters["good"]).resolve()
    assert [a["path"] for a in daemon.status()["adapters"]] == [str(good)]
    assert len(before["models"]) == 1 and len(before["files"]) == 4, before  # arena + manifest, adapter + manifest
    server.stop()
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait(timeout=30)
    daemon.start()
    after = daemon.resident()
    assert after == before, (after, before)
    assert daemon.status()["counters"]["adopted"] == 1
