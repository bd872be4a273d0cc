"""A snapshot manifest over small fake blobs, for the store, archive, OCI and metrics tests."""

from __future__ import annotations

import os

from keepwarm.snapshot import manifest as mf
from keepwarm.snapshot.store import Store


def synthetic(store: Store, name: str = "syn") -> dict:
    """A manifest over small fake blobs (enough for the store and archive code; not restorable)."""
    def blob(data: bytes) -> dict:
        return store.put_bytes(data).ref()

    m = {"schema": mf.SCHEMA, "schema_version": mf.SCHEMA_VERSION, "name": name, "created_at": 1.7e9,
         "source": {"kind": "config", "path": "/x/server.toml", "api_key_required": False},
         "server_config": {"max_num_seqs": 3},
         "models": [{"role": "base", "name": "m", "source": "/x/m", "fingerprint": "a" * 64, "quantization": "none",
                     "dtype": "float32", "device": "cpu", "arena_digest": "b" * 64, "arena_bytes": 4096,
                     "image": blob(os.urandom(4096)), "image_manifest": blob(b"{}"),
                     "files": {"config.json": blob(b'{"x": 1}')}}],
         "adapters": [{"name": "a", "digest": "c" * 64, "files": {"adapter_config.json": blob(b"{}"),
                                                                 "adapter_model.safetensors": blob(b"w" * 100)}}]}
    store.save(m)
    return m
