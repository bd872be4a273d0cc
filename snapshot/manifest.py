"""The snapshot manifest (``store/snapshots/<name>.json``): schema version 1, and its validation.

A manifest is plain JSON; every blob it names is ``{"digest": <sha256 hex>, "size": <bytes>}``. Its keys (the
models with their arena image and files, a parallel deployment's shards, the adapters, the server config, the
machine's identity) are documented in docs/snapshots.md, "Manifest (schema version 1)". Rules:
- manifests also arrive from other machines (``import``, ``pull``), so :func:`validate` checks every field that is
  later used to build a path or a config (names, digests and file names against strict patterns, the server config
  as a server.toml) before anything is written; its size is bounded before it is parsed (MAX_MANIFEST_BYTES);
- the server config is the effective one, never with the API key;
- a parallel deployment's model lists one shard per (stage, rank), stage-major; its own fingerprint is then the
  whole model's (and, in a single-image snapshot, its image, image manifest and arena digest the first shard's);
- an arena (a model's, or each shard's) is either two layers, ``portable`` (the machine-independent form, always)
  and ``platforms`` (images for the machines they were built on, each keyed by a platform descriptor, zero or
  more), or, in a snapshot made before the two layers, one ``image`` (:func:`platform_images` reads both)."""

from __future__ import annotations

import json
import re
from typing import Any

from keepwarm.worker.process.config import ConfigError, from_mapping

SCHEMA = "keepwarm-snapshot"
SCHEMA_VERSION = 1

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
DIGEST_RE = re.compile(r"[0-9a-f]{64}")
PLATFORM_KEY_RE = re.compile(r"[0-9a-f]{24}")
# Plain file names (a model's config/tokenizer files): no directories, no leading dot.
FILE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# Real manifests are KBs; parsed JSON costs up to ~30x its bytes (1 MiB of "[]," is ~27 MiB of lists).
MAX_MANIFEST_BYTES = 1 << 20


class SnapshotError(Exception):
    """Anything a snapshot command refuses or fails at; the message is one line for the operator."""


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise SnapshotError(f"invalid snapshot name {name!r}: use letters, digits, '.', '_' and '-' "
                            "(at most 128, not starting with '.' or '-')")
    return name


def _blob(where: str, b: Any) -> dict[str, Any]:
    if not isinstance(b, dict) or set(b) != {"digest", "size"}:
        raise SnapshotError(f"manifest: {where} must be {{digest, size}}")
    if not isinstance(b["digest"], str) or not DIGEST_RE.fullmatch(b["digest"]):
        raise SnapshotError(f"manifest: {where}.digest is not a sha256 hex digest")
    if not isinstance(b["size"], int) or isinstance(b["size"], bool) or b["size"] < 0:
        raise SnapshotError(f"manifest: {where}.size must be a non-negative integer")
    return b


def _files(where: str, files: Any, allowed: tuple[str, ...] | None = None) -> None:
    if not isinstance(files, dict):
        raise SnapshotError(f"manifest: {where} must be a map of file name to blob")
    for fname, b in files.items():
        if not isinstance(fname, str) or not FILE_RE.fullmatch(fname) or ".." in fname:
            raise SnapshotError(f"manifest: {where} has an unsafe file name {fname!r}")
        if allowed is not None and fname not in allowed:
            raise SnapshotError(f"manifest: {where} has an unexpected file {fname!r}")
        _blob(f"{where}[{fname}]", b)


def _str(where: str, v: Any, pattern: re.Pattern | None = None) -> str:
    if not isinstance(v, str) or (pattern is not None and not pattern.fullmatch(v)):
        raise SnapshotError(f"manifest: {where} is missing or malformed")
    return v


def validate(m: Any) -> dict[str, Any]:
    """Check a manifest's shape; returns it. Raises SnapshotError naming the first bad field."""
    if not isinstance(m, dict):
        raise SnapshotError("manifest: not a JSON object")
    if m.get("schema") != SCHEMA:
        raise SnapshotError(f"manifest: not a keepwarm snapshot (schema {m.get('schema')!r})")
    if m.get("schema_version") != SCHEMA_VERSION:
        raise SnapshotError(f"manifest: schema version {m.get('schema_version')!r}; this keepwarm reads "
                            f"version {SCHEMA_VERSION} (upgrade keepwarm)")
    check_name(m.get("name"))
    if not isinstance(m.get("created_at"), int | float):
        raise SnapshotError("manifest: created_at must be a number")
    if not isinstance(m.get("server_config"), dict):
        raise SnapshotError("manifest: server_config must be a map")
    try:
        from_mapping(m["server_config"], "manifest server_config")
    except ConfigError as e:
        raise SnapshotError(str(e)) from None
    if not isinstance(m.get("source"), dict) or m["source"].get("kind") not in ("server", "config"):
        raise SnapshotError("manifest: source.kind must be 'server' or 'config'")
    models = m.get("models")
    if not isinstance(models, list) or not models:
        raise SnapshotError("manifest: models must be a non-empty list")
    for i, mod in enumerate(models):
        w = f"models[{i}]"
        if not isinstance(mod, dict):
            raise SnapshotError(f"manifest: {w} must be a map")
        _str(f"{w}.fingerprint", mod.get("fingerprint"), DIGEST_RE)
        for k in ("name", "source", "quantization", "dtype", "device", "role"):
            _str(f"{w}.{k}", mod.get(k))
        if "shards" not in mod:
            _arena(w, mod)
        _files(f"{w}.files", mod.get("files"))
        if "config.json" not in mod["files"]:
            raise SnapshotError(f"manifest: {w}.files has no config.json")
        if mod.get("tokenizer_files") is not None:
            _files(f"{w}.tokenizer_files", mod["tokenizer_files"])
        if "shards" in mod:
            _shards(w, mod)
    adapters = m.get("adapters")
    if not isinstance(adapters, list):
        raise SnapshotError("manifest: adapters must be a list")
    names = set()
    for i, a in enumerate(adapters):
        w = f"adapters[{i}]"
        if not isinstance(a, dict):
            raise SnapshotError(f"manifest: {w} must be a map")
        name = _str(f"{w}.name", a.get("name"))
        if not name or "=" in name or name in names:
            raise SnapshotError(f"manifest: {w}.name {name!r} is empty, has '=' or repeats")
        names.add(name)
        _str(f"{w}.digest", a.get("digest"), DIGEST_RE)
        _files(f"{w}.files", a.get("files"), ADAPTER_FILES)
        if set(a["files"]) != set(ADAPTER_FILES):
            raise SnapshotError(f"manifest: {w}.files must hold {' and '.join(ADAPTER_FILES)}")
    if not isinstance(m.get("identity", {}), dict):
        raise SnapshotError("manifest: identity must be a map")
    return m


def _size(mod: dict[str, Any], key: str) -> int:
    n = mod.get(key, 1)
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 0


def _shards(w: str, mod: dict[str, Any]) -> None:
    shards, tp, pp = mod["shards"], _size(mod, "tensor_parallel_size"), _size(mod, "pipeline_parallel_size")
    if not tp or not pp or tp * pp < 2 or not isinstance(shards, list) or len(shards) != tp * pp:
        raise SnapshotError(f"manifest: {w}.shards must list one shard per (pipeline stage, tensor-parallel rank) "
                            "of its sizes (at least 2)")
    for i, sh in enumerate(shards):
        ws = f"{w}.shards[{i}]"
        if not isinstance(sh, dict) or (sh.get("pp_stage", 0), sh.get("tp_rank")) != divmod(i, tp):
            raise SnapshotError(f"manifest: {ws} must be a map with pp_stage {i // tp} and tp_rank {i % tp}")
        _str(f"{ws}.fingerprint", sh.get("fingerprint"), DIGEST_RE)
        if layered(sh) != layered(shards[0]):
            raise SnapshotError(f"manifest: {ws} and shard 0 must both have a portable layer, or neither")
        _arena(ws, sh)
    if not layered(shards[0]):  # a single-image snapshot names shard 0's image on the model too
        _image(w, mod)
        if (shards[0]["image"], shards[0]["arena_digest"]) != (mod["image"], mod["arena_digest"]):
            raise SnapshotError(f"manifest: {w}.image must be rank 0's shard image")


def _image(where: str, img: Any) -> None:
    if not isinstance(img, dict):
        raise SnapshotError(f"manifest: {where} must be a map")
    _str(f"{where}.arena_digest", img.get("arena_digest"), DIGEST_RE)
    _blob(f"{where}.image", img.get("image"))
    _blob(f"{where}.image_manifest", img.get("image_manifest"))


def _arena(w: str, a: dict[str, Any]) -> None:
    """One arena's layers: ``portable`` + ``platforms``, or (before the two layers) one image."""
    if not layered(a):
        _image(w, a)
        return
    _image(f"{w}.portable", a["portable"])
    if not isinstance(a.get("platforms"), list):
        raise SnapshotError(f"manifest: {w}.platforms must be a list")
    keys = set()
    for i, p in enumerate(a["platforms"]):
        wp = f"{w}.platforms[{i}]"
        _image(wp, p)
        desc = p.get("platform")
        if not isinstance(desc, dict) or not isinstance(desc.get("name"), str) or desc.get("device") not in (
                "cpu", "cuda"):
            raise SnapshotError(f"manifest: {wp}.platform must be a map with a name and a device (cpu or cuda)")
        key = _str(f"{wp}.platform.key", desc.get("key"), PLATFORM_KEY_RE)
        if key in keys:
            raise SnapshotError(f"manifest: {w}.platforms names platform {key} twice")
        keys.add(key)


def layered(a: dict[str, Any]) -> bool:
    """True for an arena entry with the two layers (a portable layer and platform images)."""
    return "portable" in a


def images(mod: dict[str, Any]) -> list[dict[str, Any]]:
    """A model entry's arenas, each with its ``fingerprint`` and its layers (``portable`` and ``platforms``, or one
    ``image``): the one arena, or one shard per (stage, rank), stage-major."""
    return mod.get("shards") or [mod]


def platform_images(a: dict[str, Any]) -> list[dict[str, Any]]:
    """An arena entry's machine images, each ``{platform, image, image_manifest, arena_digest}``; the platform of a
    snapshot made before the two layers is None (its image says which machine by its manifest's layouts)."""
    if layered(a):
        return list(a["platforms"])
    return [{"platform": None, **{k: a[k] for k in ("image", "image_manifest", "arena_digest")}}]


def arena_layers(a: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every layer of an arena entry with a label for messages (``portable ``, ``cpu-x86_64-amx ``, or ``""`` for
    a single-image snapshot's image): its portable layer first, then its platform images."""
    out = [("portable ", a["portable"])] if layered(a) else []
    return out + [(f"{p['platform']['name']} " if p["platform"] else "", p) for p in platform_images(a)]


def without_platforms(m: dict[str, Any], keep: set[str]) -> dict[str, Any]:
    """A copy of ``m`` whose layered arenas keep only the platform images whose key is in ``keep`` (a pull of one
    platform from an index records what it holds)."""
    out = json.loads(json.dumps(m))
    for mod in out["models"]:
        for a in images(mod):
            if layered(a):
                a["platforms"] = [p for p in a["platforms"] if p["platform"]["key"] in keep]
    return out


def loads(text: str | bytes) -> dict[str, Any]:
    if len(text) > MAX_MANIFEST_BYTES:
        raise SnapshotError(f"manifest: {len(text)} bytes, more than {MAX_MANIFEST_BYTES}")
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SnapshotError(f"manifest: not valid JSON ({e})") from None
    except RecursionError:
        raise SnapshotError("manifest: nested too deeply to be a manifest") from None
    return validate(data)


def dumps(m: dict[str, Any]) -> str:
    return json.dumps(m, indent=1, sort_keys=True) + "\n"


def blob_refs(m: dict[str, Any]) -> list[tuple[str, int, str]]:
    """Every blob the manifest names: (digest, size, what it is), in a stable order; a digest may repeat."""
    out = []
    for mod in m["models"]:
        label = f"model {mod['name']}"
        for img in images(mod):
            shard = f" (stage {img.get('pp_stage', 0)}, rank {img['tp_rank']})" if "tp_rank" in img else ""
            for what, layer in arena_layers(img):
                out.append((layer["image"]["digest"], layer["image"]["size"], f"{label}: {what}arena image{shard}"))
                out.append((layer["image_manifest"]["digest"], layer["image_manifest"]["size"],
                            f"{label}: {what}arena manifest{shard}"))
        for fname, b in sorted(mod["files"].items()):
            out.append((b["digest"], b["size"], f"{label}: {fname}"))
        for fname, b in sorted((mod.get("tokenizer_files") or {}).items()):
            out.append((b["digest"], b["size"], f"{label}: tokenizer {fname}"))
    for a in m["adapters"]:
        for fname, b in sorted(a["files"].items()):
            out.append((b["digest"], b["size"], f"adapter {a['name']}: {fname}"))
    return out


def blobs(m: dict[str, Any]) -> dict[str, int]:
    """digest -> size of every blob the manifest names (a digest named twice must have one size)."""
    out: dict[str, int] = {}
    for digest, size, what in blob_refs(m):
        if out.setdefault(digest, size) != size:
            raise SnapshotError(f"manifest: blob {digest[:16]} ({what}) is named with two sizes")
    return out
