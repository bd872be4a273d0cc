"""Snapshots that restore on a machine of another kind (issue 48), with real daemons: snapshots are made on a
"foreign" machine (a daemon and CLI under capped CPU ISAs: its oneDNN bf16 packing and its int4 nibble order are
not this machine's, support/portable.py) and restored on this one, which has no checkpoint to read.

- Through the portable layer: for bf16, int8, int4, fp8, a GGUF and a compressed-tensors checkpoint, the restored
  arena is bit for bit a preload's here (same arena_digest, tensors, quant) and serves the same greedy tokens; the
  daemon's status says "portable"; nothing is read from the checkpoint.
- The foreign platform image itself is refused here as incompatible where its layouts are not this machine's.
- ``add-platform`` here adds this machine's image (then says it has it), and the next restore loads that image.
- A CUDA machine's snapshot (its image built on this CPU with the CUDA layouts) restores on this CPU daemon.
- A snapshot made before the two layers (one image, no portable layer) still restores, as an image.
- A corrupted portable blob is named by ``snapshot verify`` and by ``restore``, and nothing is loaded.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.cli import kw, one_line_error
from support.daemon import Side
from support.portable import (
    ForeignSide,
    as_cuda_snapshot,
    as_single_image,
    carry,
    evict_all,
    greedy,
    resident,
    server_toml,
    write_tiny_gguf,
)
from support.snapshots import flip_byte

from keepwarm.daemon.client import DaemonClient, DaemonError
from keepwarm.snapshot import manifest as mf

pytestmark = pytest.mark.slow  # real daemons, the CLI

DATA = Path(__file__).resolve().parents[1] / "data" / "quantized"
CASES = {  # id -> (model: a tiny model, "gguf", or a tests/data/quantized checkpoint; quantization; dtype)
    "bf16": ("llama3_tied", "none", "bfloat16"),
    "int8": ("llama", "int8", "bfloat16"),
    "int4": ("llama", "int4", "bfloat16"),
    "fp8": ("llama", "fp8", "bfloat16"),
    "gguf": ("gguf", "auto", "bfloat16"),
    "compressed": ("w4a16_g128", "auto", "bfloat16"),
}


@pytest.fixture(scope="module")
def fleet(tiny_model_factory, tmp_path_factory):
    """The foreign machine (it makes the snapshots, each once, on first use: ``fleet.made(case)``) and this one
    (its own store and daemon), whose platform keys differ."""
    root = tmp_path_factory.mktemp("portable")
    foreign, here = ForeignSide(root / "foreign"), Side(root / "here")
    made: dict[str, SimpleNamespace] = {}

    def model_of(name: str) -> str:
        if name == "gguf":
            gguf = root / "gguf" / "tiny.gguf"
            return str(gguf if gguf.exists() else write_tiny_gguf(gguf.parent, tiny_model_factory("llama")))
        return str(DATA / name) if (DATA / name).is_dir() else tiny_model_factory(name)

    def make(case: str) -> SimpleNamespace:
        if case not in made:
            name, quantization, dtype = CASES[case]
            model = model_of(name)
            toml = server_toml(root / f"{case}.toml", model, quantization, dtype)
            kw(foreign.env, "snapshot", "create", case, "--from-config", toml, "--preload")
            carry(foreign.store, here.store, case, root)
            mod = here.store.load(case)["models"][0]
            (image,) = mod["platforms"]
            made[case] = SimpleNamespace(name=case, model=model, quantization=quantization, dtype=dtype,
                                         fingerprint=mod["fingerprint"], entry=mod, image=image)
        return made[case]

    try:
        foreign.start_daemon()
        here.start_daemon()
        platforms = foreign.status()["platform"], here.status()["platform"]
        assert platforms[0]["key"] != platforms[1]["key"], platforms  # the simulation makes another machine
        yield SimpleNamespace(foreign=foreign, here=here, root=root, made=make, foreign_platform=platforms[0],
                              platform=platforms[1])
    finally:
        foreign.stop()
        here.stop()


def _restore(fleet, name: str, monkeypatch, tmp_path) -> list[str]:
    """`snapshot restore NAME` on this machine (in this process, as the CLI runs it); the lines it says."""
    from keepwarm.snapshot.restore import restore

    for k in ("KEEPWARM_HOME", "KEEPWARM_RUNTIME_DIR"):
        monkeypatch.setenv(k, fleet.here.env[k])
    said: list[str] = []
    restore(name, store=fleet.here.store, server_config=str(tmp_path / "server.toml"), say=said.append)
    return said


def _is_a_preload(fleet, model: str, quantization: str, dtype: str, fingerprint: str, origin: str) -> dict:
    """The resident arena of ``fingerprint`` came in by ``origin``, is byte for byte what a preload of the
    checkpoint makes here (arena digest, tensors, layouts) and serves a preload's greedy tokens; evicted after.
    Returns its arena manifest."""
    here = fleet.here
    entry, arena = resident(here, fingerprint)
    assert entry["origin"] == origin
    tokens = greedy(here, here.home / "restored" / fingerprint, quantization, dtype, fingerprint=fingerprint)
    evict_all(here)
    with DaemonClient(here.rt) as c:
        c.preload(model, quantization, dtype)
    entry, preloaded = resident(here, fingerprint)
    assert entry["origin"] == "preload"
    assert (arena["arena_digest"], arena["tensors"], arena["quant"]) == (
        preloaded["arena_digest"], preloaded["tensors"], preloaded["quant"])
    assert tokens == greedy(here, model, quantization, dtype)
    evict_all(here)
    return arena


def _machine_specific(arena: dict) -> bool:
    return any(q["layout"] == "mkldnn_packed" or q["layout"].startswith("int4_cpu_") for q in arena["quant"].values())


def _not_this_machines(arena: dict) -> bool:
    """True when a layout of the arena manifest ``arena`` is not what this machine makes (oneDNN's packed format of
    a shape, as this process packs it; torch's int4 nibble order)."""
    import torch

    from keepwarm.formats.packed import packed_layout
    from keepwarm.formats.quant import cpu_int4_layout

    for q in arena["quant"].values():
        if q["layout"] == "mkldnn_packed" and packed_layout(tuple(q["shape"]), torch.bfloat16)[1].hex() != q[
                "descriptor"]:
            return True
        if q["layout"].startswith("int4_cpu_") and q["layout"] != cpu_int4_layout():
            return True
    return False


def _surely_foreign(fleet, case: str) -> bool:
    """Whether the foreign machine's arena of ``case`` must differ from this one's: bf16 where this CPU has AMX
    (oneDNN capped at AVX512_CORE packs in another format), int4 where ATen's default kernels pack another order."""
    int4 = fleet.platform["int4_layout"] != fleet.foreign_platform["int4_layout"]
    surely = {"bf16": "amx_bf16" in fleet.platform["isa"], "int4": int4, "gguf": int4, "compressed": int4}
    return surely.get(case, False)


# -- through the portable layer ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_a_foreign_snapshot_restores_through_the_portable_layer_as_a_preload(fleet, case, monkeypatch,
                                                                              tmp_path) -> None:
    snap = fleet.made(case)
    here = fleet.here
    assert snap.image["platform"]["key"] == fleet.foreign_platform["key"]
    evict_all(here)
    before = here.status()["counters"]
    said = _restore(fleet, case, monkeypatch, tmp_path)
    assert any("loading the portable layer" in s for s in said), said
    assert any("built from the portable layer" in s for s in said), said
    counters = here.status()["counters"]
    assert counters["preloads"] == before["preloads"]  # no checkpoint read, nothing quantized
    arena = _is_a_preload(fleet, snap.model, snap.quantization, snap.dtype, snap.fingerprint, "portable")
    # the foreign image holds another machine's bytes exactly where its layouts are not this machine's
    foreign = json.loads(here.store.read_blob(snap.image["image_manifest"]["digest"]))
    differs = _not_this_machines(foreign)
    assert (foreign["arena_digest"] != arena["arena_digest"]) == differs == (foreign["quant"] != arena["quant"])
    assert differs or not _surely_foreign(fleet, case)
    # the portable layer is a blob of its own exactly where the foreign arena has machine-specific layouts
    assert (snap.entry["portable"]["image"] != snap.image["image"]) == _machine_specific(foreign)


@pytest.mark.parametrize("case", ["bf16", "int4"])
def test_the_foreign_platform_image_is_refused_as_it_is(fleet, case) -> None:
    """Loaded as an image (not through the portable layer), the foreign image is refused wherever its layouts
    differ from this machine's: proof that its bytes are another machine's."""
    snap = fleet.made(case)
    here = fleet.here
    manifest_json = here.store.read_blob(snap.image["image_manifest"]["digest"]).decode()
    differs = _not_this_machines(json.loads(manifest_json))
    assert differs or not _surely_foreign(fleet, case)
    evict_all(here)
    with DaemonClient(here.rt) as c:
        if differs:
            with pytest.raises(DaemonError) as e:
                c.load_image(manifest_json, here.store.blob_path(snap.image["image"]["digest"]))
            assert e.value.code == "incompatible_image", e.value
            assert c.status()["models"] == []
        else:  # the same layouts here: the image is this machine's too
            assert c.load_image(manifest_json, here.store.blob_path(snap.image["image"]["digest"]))["origin"] == "image"
    evict_all(here)


# -- add-platform ------------------------------------------------------------------------------------------------------
def test_add_platform_adds_this_machines_image_and_the_next_restore_loads_it(fleet, monkeypatch, tmp_path) -> None:
    snap = fleet.made("bf16")
    here = fleet.here
    side = Side(tmp_path / "P", runtime_dir=here.rt)  # a store of its own, this machine's daemon
    carry(here.store, side.store, snap.name, tmp_path)
    evict_all(here)
    r = kw(side.env, "snapshot", "restore", snap.name, "--server-config", tmp_path / "server.toml")
    assert "loading the portable layer" in r.stdout, r.stdout
    assert re.search(r"built from the portable layer \(re-packed where this machine's layout differs, never "
                     r"re-quantized\) in [0-9.]+s", r.stdout), r.stdout
    log = (here.rt / "test-daemon.log").read_text()
    assert re.search(r"built the arena of \S+ \(none, bfloat16\) from its portable layer: [1-9]\d* weights re-packed",
                     log), log[-2000:]
    evict_all(here)

    r = kw(side.env, "snapshot", "add-platform", snap.name)
    assert f"added the {fleet.platform['name']} image" in r.stdout, r.stdout
    mod = side.store.load(snap.name)["models"][0]
    keys = [p["platform"]["key"] for p in mod["platforms"]]
    assert keys == [fleet.foreign_platform["key"], fleet.platform["key"]]
    assert mod["portable"] == snap.entry["portable"]  # the portable layer is kept as it was
    assert here.status()["models"] == []  # what add-platform made resident is evicted again

    from keepwarm.snapshot.platforms import add_platform
    from keepwarm.snapshot.restore import restore
    from keepwarm.snapshot.verify import verify

    for k in ("KEEPWARM_HOME", "KEEPWARM_RUNTIME_DIR"):
        monkeypatch.setenv(k, side.env[k])
    said: list[str] = []
    again = add_platform(snap.name, store=side.store, say=said.append)
    assert not again.added and again.platform["key"] == fleet.platform["key"]
    assert any("already has an image for this platform" in s for s in said), said
    assert side.store.load(snap.name)["models"][0] == mod
    verify(side.store, snap.name)  # both images and the portable layer, each against its arena digest
    said.clear()
    restore(snap.name, store=side.store, server_config=str(tmp_path / "server.toml"), say=said.append)
    assert any(f"loading the {fleet.platform['name']} image" in s for s in said), said
    entry, arena = resident(here, snap.fingerprint)
    assert entry["origin"] == "image" and arena["arena_digest"] == mod["platforms"][1]["arena_digest"]
    evict_all(here)


# -- a CUDA machine's snapshot, an old snapshot ------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["bf16", "int4"])
def test_a_cuda_snapshot_restores_on_a_cpu_daemon(fleet, case, monkeypatch, tmp_path) -> None:
    """The snapshot a CUDA machine makes (its image: the CUDA arena, built here by keepwarm's loader with the CUDA
    layouts; its portable layer: the same blob) restores on this CPU daemon through the portable layer."""
    snap = fleet.made(case)
    here = fleet.here
    name = f"{case}-cuda"
    m = as_cuda_snapshot(here.store, snap.name, name, snap.model, snap.quantization, snap.dtype)
    mod = m["models"][0]
    assert mod["portable"]["image"] == mod["platforms"][0]["image"]  # one blob serves both
    assert mod["device"].startswith("cuda:") and mod["platforms"][0]["platform"]["device"] == "cuda"
    assert mod["portable"]["arena_digest"] == snap.entry["portable"]["arena_digest"]  # the CPU's portable form
    evict_all(here)
    said = _restore(fleet, name, monkeypatch, tmp_path)
    assert any("built from the portable layer" in s for s in said), said
    _is_a_preload(fleet, snap.model, snap.quantization, snap.dtype, snap.fingerprint, "portable")


def test_a_snapshot_made_before_the_two_layers_still_restores(fleet, monkeypatch, tmp_path) -> None:
    from keepwarm.snapshot.create import create
    from keepwarm.snapshot.verify import verify

    here = fleet.here
    model, quantization, dtype = fleet.made("bf16").model, "none", "bfloat16"
    for k in ("KEEPWARM_HOME", "KEEPWARM_RUNTIME_DIR"):
        monkeypatch.setenv(k, here.env[k])
    create("layered-here", config_path=str(server_toml(tmp_path / "s.toml", model, quantization, dtype)),
           preload=True, store=here.store, force=True)
    old = as_single_image(here.store, "layered-here", "old", fleet.platform["key"])
    mod = here.store.load("old")["models"][0]
    assert not mf.layered(mod) and mf.platform_images(mod)[0]["platform"] is None
    assert _machine_specific(json.loads(here.store.read_blob(mod["image_manifest"]["digest"])))  # packed bf16
    assert verify(here.store, "old")[0] == len(mf.blobs(old))
    evict_all(here)
    said = _restore(fleet, "old", monkeypatch, tmp_path)
    assert any("loading the image of" in s for s in said), said
    _is_a_preload(fleet, model, quantization, dtype, mod["fingerprint"], "image")


# -- corruption --------------------------------------------------------------------------------------------------------
def test_a_corrupted_portable_blob_is_named_and_nothing_loads(fleet, tmp_path) -> None:
    snap = fleet.made("bf16")
    here = fleet.here
    side = Side(tmp_path / "C", runtime_dir=here.rt)
    carry(here.store, side.store, snap.name, tmp_path)
    portable = snap.entry["portable"]
    assert portable["image"] != snap.image["image"]  # a blob of its own (packed bf16 is machine-specific)
    pm = json.loads(side.store.read_blob(portable["image_manifest"]["digest"]))
    tensor = pm["tensors"][len(pm["tensors"]) // 2]
    digest = portable["image"]["digest"]
    flip_byte(side.store.blob_path(digest), tensor["offset"] + tensor["nbytes"] // 2)
    evict_all(here)
    target = tmp_path / "server.toml"
    err = one_line_error(kw(side.env, "snapshot", "verify", snap.name, check=False))
    assert digest in err and "portable" in err, err
    err = one_line_error(kw(side.env, "snapshot", "restore", snap.name, "--server-config", target, check=False))
    assert digest in err and "does not match its manifest's arena_digest" in err, err
    st = here.status()
    assert st["models"] == [] and not target.exists()
    assert not [p for p in (side.home / "restored").rglob("*") if p.is_file()]
    assert not [p for p in Path(st["arena_dir"]).iterdir() if p.name.startswith(".portable")]
    # the same layer whole again restores
    shutil.copy(here.store.blob_path(digest), side.store.blob_path(digest))
    from keepwarm.snapshot.verify import verify

    verify(side.store, snap.name)


# -- on a GPU ----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_a_cpu_snapshot_restores_on_a_cuda_daemon_and_serves(fleet, monkeypatch, tmp_path) -> None:
    """On a GPU: a snapshot made on a CPU (bf16, oneDNN-packed where that CPU packs) restores on a CUDA daemon
    through its portable layer (CUDA's layout: copied, not re-packed), byte for byte the arena a preload makes
    there, and a worker on the GPU serves it with the preload's greedy tokens."""
    from keepwarm import LLM, SamplingParams
    from keepwarm.snapshot.restore import restore

    snap = fleet.made("bf16")
    gpu = Side(tmp_path / "gpu").start_daemon("--device", "cuda")
    try:
        carry(fleet.here.store, gpu.store, snap.name, tmp_path)
        for k in ("KEEPWARM_HOME", "KEEPWARM_RUNTIME_DIR"):
            monkeypatch.setenv(k, gpu.env[k])
        said: list[str] = []
        restore(snap.name, store=gpu.store, server_config=str(tmp_path / "server.toml"), say=said.append)
        assert any("loading the portable layer" in s for s in said), said
        entry, arena = resident(gpu, snap.fingerprint)
        assert entry["origin"] == "portable" and entry["device"].startswith("cuda:")

        def tokens(model: str, **extra: str) -> list[list[int]]:
            llm = LLM(model=model, dtype=snap.dtype, max_model_len=128, daemon=True, device="cuda",
                      runtime_dir=str(gpu.rt), **extra)
            try:
                assert llm.weights_source == "daemon"
                params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
                return [o.outputs[0].token_ids for o in llm.generate(["The capital of France is"], params)]
            finally:
                llm.close()

        restored = tokens(str(gpu.home / "restored" / snap.fingerprint), fingerprint=snap.fingerprint)
        evict_all(gpu)
        with DaemonClient(gpu.rt) as c:
            c.preload(snap.model, snap.quantization, snap.dtype)
        _, preloaded = resident(gpu, snap.fingerprint)
        assert (arena["arena_digest"], arena["tensors"]) == (preloaded["arena_digest"], preloaded["tensors"])
        assert restored == tokens(snap.model)
    finally:
        gpu.stop()
