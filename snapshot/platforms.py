"""``keepwarm snapshot add-platform NAME``: add this machine's image to a snapshot, built from its portable layer.

Rules (docs/snapshots.md, "Two layers"):
- the daemon here builds its own layout from the portable layer (re-pack only, checked against the portable arena
  digest as it reads it); that arena is then captured as an image exactly as ``create`` captures one (under a
  lease, checked against its manifest's arena digest as it is copied) and recorded under the daemon's platform
  descriptor, so a later restore on a machine of the same ``key`` loads it as it is;
- a snapshot that already holds an image for this platform is left as it is; one made before the two layers has
  no portable layer to build from, and is refused in one line;
- a model this command made resident is evicted again at the end (one resident before is kept): the daemon is
  left as it was found.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keepwarm.daemon.client import DaemonError
from keepwarm.formats import paths
from keepwarm.formats.layout import Layout
from keepwarm.snapshot import manifest as mf
from keepwarm.snapshot.create import Source, _attach, capture_arena
from keepwarm.snapshot.manifest import SnapshotError
from keepwarm.snapshot.restore import _daemon_for
from keepwarm.snapshot.store import Store

Say = Callable[[str], None]


@dataclass(frozen=True)
class AddPlatformResult:
    name: str
    platform: dict[str, Any]
    added: bool  # False: the snapshot had an image for this platform already
    new_bytes: int
    seconds: float


def add_platform(name: str, *, store: Store | None = None, say: Say = lambda s: None) -> AddPlatformResult:
    t0 = time.perf_counter()
    store = store or Store()
    rt = paths.runtime_dir()
    with store.lock():
        m = store.load(name)
        model = m["models"][0]
        arenas = mf.images(model)
        if not all(mf.layered(a) for a in arenas):
            raise SnapshotError(f"snapshot {name} was made before snapshots had a portable layer: it has no "
                                "machine-independent weights to build another platform's image from; create it again")
        client = _daemon_for(rt, model, say)
        try:
            platform = client.status()["platform"]
            if all(any(p["platform"]["key"] == platform["key"] for p in a["platforms"]) for a in arenas):
                say(f"snapshot {name} already has an image for this platform ({platform['name']}, key "
                    f"{platform['key']})")
                return AddPlatformResult(name, platform, False, 0, time.perf_counter() - t0)
            before = store.stored_bytes()
            loaded: list[str] = []
            try:
                for a in arenas:
                    a["platforms"].append(_build_image(store, client, model, a, platform, rt, loaded, say))
            finally:
                for fp in loaded:
                    with contextlib.suppress(DaemonError):
                        client.evict(fp, force=True)
        finally:
            client.close()
        mf.validate(m)
        store.save(m)
    say(f"added the {platform['name']} image (platform key {platform['key']}) to snapshot {name}")
    return AddPlatformResult(name, platform, True, max(0, store.stored_bytes() - before), time.perf_counter() - t0)


def _build_image(store: Store, client: Any, model: dict[str, Any], a: dict[str, Any], platform: dict[str, Any],
                 rt: Path, loaded: list[str], say: Say) -> dict[str, Any]:
    """This machine's image of one arena of the snapshot: built by the daemon from the portable layer, then
    captured from it (``loaded``: the fingerprints this made resident, to evict at the end)."""
    portable = a["portable"]
    pm_json = store.read_blob(portable["image_manifest"]["digest"]).decode()
    say(f"building the {platform['name']} arena of {model['name']} from its portable layer "
        f"({portable['image']['size'] / 1e6:.1f} MB)")
    try:
        reply = client.load_image(pm_json, store.blob_path(portable["image"]["digest"]), portable=True)
    except DaemonError as e:
        raise SnapshotError(f"the daemon cannot build {model['name']} from the portable layer: {e.message}") from None
    if not reply.cached:
        loaded.append(a["fingerprint"])
    pm = json.loads(pm_json)
    layout = Layout(pm.get("tp_rank", 0), pm.get("tp_size", 1), pm.get("pp_stage", 0), pm.get("pp_size", 1))
    source = Source("config", "", {"quantization": model["quantization"], "dtype": model["dtype"]},
                    Path(pm["model"]), model["fingerprint"], [], False)
    att, lease, _ = _attach(source, rt, False, say, layout)
    try:
        image, _ = capture_arena(store, lease.manifest, lease.arena)
        image_manifest = store.put_bytes(lease.manifest.encode())
        arena_digest = json.loads(lease.manifest)["arena_digest"]
    finally:
        att.close()
    return {"platform": platform, "image": image.ref(), "image_manifest": image_manifest.ref(),
            "arena_digest": arena_digest}
