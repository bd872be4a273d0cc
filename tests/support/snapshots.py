"""Snapshot manifests over small fake blobs, for the store, archive, OCI and metrics tests: one made before the two
layers (``synthetic``) and one with a portable layer and platform images (``synthetic_layered``)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from keepwarm.snapshot import manifest as mf
from keepwarm.snapshot.store import Store


def synthetic(store: Store, name: str = "syn") -> dict:
    """A manifest over small fake blobs (enough for the store and archive code; not restorable)."""
    m = _synthetic(store, name, {"arena_digest": "b" * 64, "image": _blob(store, os.urandom(4096)),
                                 "image_manifest": _blob(store, b"{}")})
    store.save(m)
    return m


def _blob(store: Store, data: bytes) -> dict:
    return store.put_bytes(data).ref()


def _synthetic(store: Store, name: str, arena: dict) -> dict:
    def blob(data: bytes) -> dict:
        return _blob(store, data)

    return {"schema": mf.SCHEMA, "schema_version": mf.SCHEMA_VERSION, "name": name, "created_at": 1.7e9,
            "source": {"kind": "config", "path": "/x/server.toml", "api_key_required": False},
            "server_config": {"max_num_seqs": 3},
            "models": [{"role": "base", "name": "m", "source": "/x/m", "fingerprint": "a" * 64, "quantization": "none",
                        "dtype": "float32", "device": "cpu", "arena_bytes": 4096, **arena,
                        "files": {"config.json": blob(b'{"x": 1}')}}],
            "adapters": [{"name": "a", "digest": "c" * 64, "files": {"adapter_config.json": blob(b"{}"),
                                                                    "adapter_model.safetensors": blob(b"w" * 100)}}]}


def fake_platform(name: str, device: str = "cpu", arch: str = "x86_64") -> dict:
    """A platform descriptor for a machine named ``name`` (its key: a hash of the name)."""
    d = {"device": device, "name": name, "key": hashlib.sha256(name.encode()).hexdigest()[:24], "layout_version": 1,
         "torch": "2.13.0"}
    if device == "cpu":
        d.update(arch=arch, isa=["avx2", "fma"], onednn="oneDNN v3.7", pack_key="k" + name, int4_layout="int4_cpu_x")
    else:
        d.update(capability="9.0", gpu="NVIDIA H100")
    return d


def synthetic_layered(store: Store, name: str = "lay", platforms: list[str | dict] | tuple = ("cpu-a", "cpu-b")
                      ) -> dict:
    """A manifest with the two layers over small fake blobs: a portable layer and one image per platform (a name
    makes a fake CPU descriptor, a dict is the descriptor), each image's bytes its own (not restorable)."""
    descs = [fake_platform(p) if isinstance(p, str) else p for p in platforms]
    portable = {"image": _blob(store, os.urandom(3000)), "image_manifest": _blob(store, b'{"device": "portable"}'),
                "arena_digest": "d" * 64}
    images = [{"platform": d, "image": _blob(store, os.urandom(2000 + i)),
               "image_manifest": _blob(store, json.dumps({"platform": d["key"]}).encode()),
               "arena_digest": hashlib.sha256(d["key"].encode()).hexdigest()} for i, d in enumerate(descs)]
    m = _synthetic(store, name, {"portable": portable, "platforms": images})
    store.save(m)
    return m


def flip_byte(path: Path, offset: int) -> None:
    """Flip one byte of a file in place (a read-only blob is made writable first): a corrupted blob."""
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
