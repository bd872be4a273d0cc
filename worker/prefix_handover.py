"""A worker's prefix cache carried over a restart: the old worker exports its cached full blocks (their keys and
their KV) into a memfd; the new worker adopts those its pool has room for, before its next step.

Rules (the handoff and the file's layout: docs/architecture.md, "Restarts with no downtime"):
- Both sides run in their engine thread, between steps (``AsyncEngine.call_blocking``): a cached full block never
  changes, and nothing can evict one while it is copied.
- Only an engine whose KV is the same adopts: ``kv_identity`` (weights, dtypes, block size, KV shape, fp8 scales,
  model config, a probe of the block-hash function: keys are Python hashes) must be equal, else nothing is adopted,
  naming the first field that differs. A tensor or pipeline parallel worker neither exports nor adopts, and says so.
- A block keeps its key whole (chained hash, tokens, salt and adapter digest), so a carried block is hit only by
  the requests that would have hit it in the old worker.
- Adopted blocks enter this pool as freed blocks (``BlockPool.adopt``): the most recent nearest the free queue's
  tail, after everything this worker had freed; they take no more than the free blocks. The export file (at most a
  KV pool's copy) lives until the new worker has copied it; then it is unmapped and closed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import struct
import time
from typing import TYPE_CHECKING, Any

import torch

from keepwarm.worker.engine.block_manager import BlockHash, hash_block_tokens
from keepwarm.worker.process.ipc import CarriedPrefixes

if TYPE_CHECKING:
    from keepwarm.worker.engine import LLMEngine

FORMAT = 1
_ALIGN = 4096


def refusal(engine: LLMEngine) -> str:
    """Why this engine cannot export or adopt ("" when it can)."""
    if engine.tp is not None:
        return "a tensor or pipeline parallel worker keeps its KV in several processes"
    if not engine.block_manager.enable_prefix_caching:
        return "prefix caching is off"
    if engine.loaded.fingerprint is None:
        return "the weights have no fingerprint"
    return ""


def kv_identity(engine: LLMEngine) -> dict[str, Any]:
    """What must be equal for one engine's KV blocks to be valid in another's pool."""
    kv = engine.runner.kv_cache
    pool = kv.key[0]
    layer0: Any = engine.loaded.model.model.layers[0]
    weight = layer0.self_attn.qkv_proj.weight
    return {
        "format": FORMAT,
        "fingerprint": engine.loaded.fingerprint,
        "quantization": weight.meta.scheme if getattr(weight, "is_quantized_weight", False) else "none",
        "dtype": str(engine.dtype),
        "kv_cache_dtype": str(pool.dtype),
        "block_size": engine.block_manager.block_size,
        "kv_shape": [len(kv.key), pool.shape[0], pool.shape[3]],
        "k_scales": list(kv.k_scales),
        "v_scales": list(kv.v_scales),
        "model_config": hashlib.sha256(repr(engine.model_config).encode()).hexdigest(),
        "hash_probe": hash_block_tokens(None, (1, 2, 3), ("keepwarm", None)).hash_value,
    }


def _layer_bytes(identity: dict[str, Any], n: int) -> int:
    _, heads, head_dim = identity["kv_shape"]
    elt = torch.empty((), dtype=_dtype(identity["kv_cache_dtype"])).element_size()
    return heads * n * identity["block_size"] * head_dim * elt


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"kv_cache_dtype {name!r} is not a torch dtype")
    return dtype


def _views(buf: Any, identity: dict[str, Any], n: int, offset: int) -> list[torch.Tensor]:
    """K and V of every layer (K0, V0, K1, ...) over ``buf`` from ``offset``, as raw bits (``_raw``)."""
    layers, heads, head_dim = identity["kv_shape"]
    step = _layer_bytes(identity, n)
    shape = (heads, n, identity["block_size"], head_dim)
    dtype = _dtype(identity["kv_cache_dtype"])
    return [_raw(torch.frombuffer(buf, dtype=torch.uint8, count=step, offset=offset + i * step).view(dtype)
                 .view(shape)) for i in range(2 * layers)]


def export_prefixes(engine: LLMEngine) -> tuple[int | None, CarriedPrefixes]:
    """The engine's cached full blocks, most recent first, in a new memfd (None, and why, when there are none or
    the engine cannot export). The caller owns (and closes) the fd."""
    t0 = time.perf_counter()
    why = refusal(engine)
    blocks = [] if why else engine.block_manager.pool.cached_by_recency()
    if why or not blocks:
        return None, CarriedPrefixes(0, 0, time.perf_counter() - t0, why or "no cached blocks")
    identity = kv_identity(engine)
    keys = [[h.hash_value, list(h.token_ids), h.extra_keys] for h in (b.block_hash for b in blocks) if h is not None]
    header = json.dumps({"identity": identity, "blocks": keys}).encode()
    offset = -(-(8 + len(header)) // _ALIGN) * _ALIGN
    total = offset + 2 * identity["kv_shape"][0] * _layer_bytes(identity, len(blocks))
    fd = os.memfd_create("keepwarm-prefixes", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, total)
        mm = mmap.mmap(fd, total)
        mm[:8] = struct.pack("<Q", len(header))
        mm[8:8 + len(header)] = header
        kv = engine.runner.kv_cache
        ids = torch.tensor([b.block_id for b in blocks], device=kv.key[0].device)
        for view, pool in zip(_views(mm, identity, len(blocks), offset), _pools(engine), strict=True):
            if pool.device.type == "cpu":
                torch.index_select(pool, 1, ids, out=view)  # straight into the file
            else:
                view.copy_(pool.index_select(1, ids))
        _close(mm)
    except BaseException:
        os.close(fd)
        raise
    return fd, CarriedPrefixes(len(blocks), total, time.perf_counter() - t0)


def _first_difference(mine: dict[str, Any], theirs: Any) -> str:
    if not isinstance(theirs, dict):
        return "the export has no identity"
    for key, value in mine.items():
        if theirs.get(key) != value:
            return f"the KV's {key} differs ({theirs.get(key)!r} there, {value!r} here)"
    return ""


def _read_header(mm: mmap.mmap, size: int) -> tuple[dict[str, Any], int]:
    if size < 8:
        raise ValueError(f"an export of {size} bytes has no header")
    (length,) = struct.unpack("<Q", mm[:8])
    if 8 + length > size:
        raise ValueError(f"its header of {length} bytes runs past the file's {size}")
    header = json.loads(mm[8:8 + length])
    if not isinstance(header, dict) or not isinstance(header.get("blocks"), list):
        raise ValueError("its header has no block list")
    return header, -(-(8 + length) // _ALIGN) * _ALIGN


def _block_keys(entries: list[Any], block_size: int) -> list[BlockHash]:
    keys = []
    for i, entry in enumerate(entries):
        if not (isinstance(entry, list) and len(entry) == 3 and type(entry[0]) is int and isinstance(entry[1], list)
                and len(entry[1]) == block_size and all(type(t) is int for t in entry[1])
                and (entry[2] is None or (isinstance(entry[2], list)
                                          and all(x is None or isinstance(x, str) for x in entry[2])))):
            raise ValueError(f"block entry {i} is not [hash, {block_size} token ids, extra keys]")
        keys.append(BlockHash(entry[0], tuple(entry[1]), None if entry[2] is None else tuple(entry[2])))
    return keys


def adopt_prefixes(engine: LLMEngine, fd: int) -> CarriedPrefixes:
    """Adopt an export's blocks into free blocks of this engine's pool. Refused (0 blocks, the reason) when the
    engine cannot adopt, the export is malformed, or its KV is not this engine's; nothing is adopted then."""
    t0 = time.perf_counter()
    why = refusal(engine)
    if why:
        return CarriedPrefixes(0, 0, time.perf_counter() - t0, why)
    size = os.fstat(fd).st_size
    mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE)  # copy-on-write: nothing is written back
    try:
        return _adopt(engine, mm, size, t0)
    finally:
        _close(mm)


def _adopt(engine: LLMEngine, mm: mmap.mmap, size: int, t0: float) -> CarriedPrefixes:
    try:
        header, offset = _read_header(mm, size)
        why = _first_difference(kv_identity(engine), header.get("identity"))
        keys = [] if why else _block_keys(header["blocks"], engine.block_manager.block_size)
    except (ValueError, UnicodeDecodeError) as e:
        why = f"a malformed export: {e}"
    if why:
        return CarriedPrefixes(0, 0, time.perf_counter() - t0, why)
    identity = header["identity"]
    need = offset + 2 * identity["kv_shape"][0] * _layer_bytes(identity, len(keys))
    if need != size:
        return CarriedPrefixes(0, 0, time.perf_counter() - t0, f"a malformed export: {size} bytes, not {need}")
    pool = engine.block_manager.pool
    adopted = pool.adopt(keys)
    if not adopted:
        return CarriedPrefixes(0, 0, time.perf_counter() - t0, "no free block, or every block is cached here already")
    try:
        nbytes = _copy_in(engine, _views(mm, identity, len(keys), offset), adopted)
    except BaseException:
        pool.forget(block for _, block in adopted)  # never a cached block without its KV
        raise
    return CarriedPrefixes(len(adopted), nbytes, time.perf_counter() - t0)


_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers of its width: copies are exact, and torch's CPU index ops know no fp8."""
    return t.view(_RAW[t.element_size()])


def _pools(engine: LLMEngine) -> list[torch.Tensor]:
    """The engine's pools in the export's order (K0, V0, K1, V1, ...), as raw bits."""
    kv = engine.runner.kv_cache
    return [_raw(p) for pair in zip(kv.key, kv.value, strict=True) for p in pair]


def _close(mm: mmap.mmap) -> None:
    """Unmap now, or (a tensor still points into it: an error's traceback holds one) once the last view is gone."""
    with contextlib.suppress(BufferError):
        mm.close()


def _copy_in(engine: LLMEngine, views: list[torch.Tensor], adopted: list[tuple[int, Any]]) -> int:
    device = engine.runner.kv_cache.key[0].device
    src = torch.tensor([i for i, _ in adopted])
    dst = torch.tensor([b.block_id for _, b in adopted], device=device)
    nbytes = 0
    every = len(adopted) == views[0].shape[1] if views else False  # all of them: no gather first
    for view, pool in zip(views, _pools(engine), strict=True):
        part = view if every else view.index_select(1, src)
        pool.index_copy_(1, dst, part.to(device))
        nbytes += part.nbytes
    views.clear()
    return nbytes
