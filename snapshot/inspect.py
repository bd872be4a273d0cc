"""``list``, ``show`` and ``diff``: reading manifests for people."""

from __future__ import annotations

import json
from typing import Any

from keepwarm.snapshot import manifest as mf
from keepwarm.snapshot.store import Store, iso


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} KB"


def model_line(mod: dict[str, Any]) -> str:
    return f"{mod['name']} ({mod['quantization']}/{mod['dtype']}, {mod['device']}, {mod['fingerprint'][:12]})"


def list_rows(store: Store) -> list[dict[str, Any]]:
    ms, bad = store.readable_manifests()
    unique = store.unique_sizes(ms)
    rows = [{"name": name, "created_at": 0, "created": "-", "size": 0, "unique_size": 0,
             "models": [f"(unreadable: {why})"], "adapters": []} for name, why in bad.items()]
    for name, m in sorted(ms.items(), key=lambda kv: kv[1]["created_at"]):
        rows.append({"name": name, "created_at": m["created_at"], "created": iso(m["created_at"]),
                     "size": sum(mf.blobs(m).values()), "unique_size": unique[name],
                     "models": [model_line(x) for x in m["models"]], "adapters": [a["name"] for a in m["adapters"]]})
    return rows


def list_text(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no snapshots"
    width = max(4, *(len(r["name"]) for r in rows))
    lines = [f"{'NAME':{width}}  {'CREATED':19}  {'UNIQUE':>10}  {'TOTAL':>10}  MODELS"]
    for r in rows:
        extra = f"  +{len(r['adapters'])} adapter(s)" if r["adapters"] else ""
        lines.append(f"{r['name']:{width}}  {r['created']:19}  {mb(r['unique_size']):>10}  {mb(r['size']):>10}  "
                     f"{', '.join(r['models'])}{extra}")
    return "\n".join(lines)


def show_text(m: dict[str, Any]) -> str:
    src = m["source"]
    ident = m.get("identity", {})
    lines = [f"snapshot {m['name']}, created {iso(m['created_at'])} from the "
             + (f"server at {src.get('url')}" if src["kind"] == "server" else f"config {src.get('path')}")
             + (" (an API key was required)" if src.get("api_key_required") else ""),
             f"  made with keepwarm {ident.get('keepwarm', '?')}, torch {ident.get('torch', '?')} on "
             f"{ident.get('hostname', '?')}: {ident.get('cpu', '?')}"
             + (f", GPU {ident['gpu']['name']}" if ident.get("gpu") else "")
             + f"; daemon device {ident.get('daemon_device', '?')}",
             f"  CPU ISA: {' '.join(ident.get('cpu_isa', [])) or '-'}; oneDNN {ident.get('onednn') or '-'}"]
    for mod in m["models"]:
        lines.append(f"  model {model_line(mod)}")
        lines.append(f"    source {mod['source']}; fingerprint {mod['fingerprint']}")
        lines.append(f"    layouts {', '.join(mod.get('layouts', [])) or '-'}; files: "
                     f"{', '.join(sorted(mod['files']))}")
        lines += [f"    {line}" for line in layer_lines(mod)]
    for a in m["adapters"]:
        lines.append(f"  adapter {a['name']}: rank {a.get('rank') or '?'}, digest {a['digest'][:16]}, from "
                     f"{a.get('source', '?')}")
    lines.append("  server config:")
    for k, v in sorted(m["server_config"].items()):
        lines.append(f"    {k} = {json.dumps(v)}")
    blobs = mf.blobs(m)
    lines.append(f"  {len(blobs)} blobs, {mb(sum(blobs.values()))}")
    return "\n".join(lines)


def layer_lines(mod: dict[str, Any]) -> list[str]:
    """The model's arena layers: the portable layer and each platform image (per shard when split)."""
    out = []
    for img in mf.images(mod):
        shard = f" (stage {img.get('pp_stage', 0)}, rank {img['tp_rank']})" if "shards" in mod else ""
        if mf.layered(img):
            p = img["portable"]
            shared = any(x["image"]["digest"] == p["image"]["digest"] for x in img["platforms"])
            out.append(f"portable layer{shard} {mb(p['image']['size'])} (blob {p['image']['digest'][:16]}"
                       + (", the same blob as an image" if shared else "") + ")")
        for x in mf.platform_images(img):
            p = x["platform"]
            name = f"{p['name']} image (platform {p['key']})" if p else "arena image"
            out.append(f"{name}{shard} {mb(x['image']['size'])} (blob {x['image']['digest'][:16]})")
    return out


def diff(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Differences as {what, key, a, b}: config keys, models (fingerprint, quantization, dtype, ...), adapters."""
    out: list[dict[str, Any]] = []
    ca, cb = a["server_config"], b["server_config"]
    for k in sorted(set(ca) | set(cb)):
        if ca.get(k) != cb.get(k):
            out.append({"what": "config", "key": k, "a": ca.get(k), "b": cb.get(k)})
    ma = {x["role"]: x for x in a["models"]}
    mb_ = {x["role"]: x for x in b["models"]}
    for role in sorted(set(ma) | set(mb_)):
        x, y = ma.get(role), mb_.get(role)
        if x is None or y is None:
            out.append({"what": "model", "key": role, "a": x and model_line(x), "b": y and model_line(y)})
            continue
        for k in ("name", "source", "fingerprint", "quantization", "dtype", "device", "arena_digest"):
            if x.get(k) != y.get(k):
                out.append({"what": "model", "key": f"{role}.{k}", "a": x.get(k), "b": y.get(k)})
        px, py = _platforms(x), _platforms(y)
        if px != py:
            out.append({"what": "model", "key": f"{role}.platforms", "a": px, "b": py})
        for fname in sorted(set(x["files"]) | set(y["files"])):
            dx, dy = x["files"].get(fname, {}).get("digest"), y["files"].get(fname, {}).get("digest")
            if dx != dy:
                out.append({"what": "model", "key": f"{role}.files.{fname}", "a": dx and dx[:16], "b": dy and dy[:16]})
    aa = {x["name"]: x for x in a["adapters"]}
    ab = {x["name"]: x for x in b["adapters"]}
    for n in sorted(set(aa) | set(ab)):
        dx, dy = (aa[n]["digest"] if n in aa else None), (ab[n]["digest"] if n in ab else None)
        if dx != dy:
            out.append({"what": "adapter", "key": n, "a": dx and dx[:16], "b": dy and dy[:16]})
    ia, ib = a.get("identity", {}), b.get("identity", {})
    for k in ("keepwarm", "torch", "cpu", "cpu_isa", "daemon_device", "hostname"):
        if ia.get(k) != ib.get(k):
            out.append({"what": "identity", "key": k, "a": ia.get(k), "b": ib.get(k)})
    return out


def _platforms(mod: dict[str, Any]) -> list[str]:
    """The platform names a model entry holds images for (``portable`` first where it has that layer)."""
    arena = mf.images(mod)[0]
    names = ["portable"] if mf.layered(arena) else []
    return names + [x["platform"]["name"] if x["platform"] else "image" for x in mf.platform_images(arena)]


def diff_text(name_a: str, name_b: str, changes: list[dict[str, Any]]) -> str:
    if not changes:
        return f"{name_a} and {name_b} hold the same state"

    def fmt(v: Any) -> str:
        return "(absent)" if v is None else json.dumps(v)

    return "\n".join(f"{c['what']} {c['key']}: {fmt(c['a'])} -> {fmt(c['b'])}" for c in changes)
