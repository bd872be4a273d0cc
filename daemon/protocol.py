"""The daemon's wire protocol: versioned, typed messages in keepwarm.formats.wire's frames (msgpack, never pickle).

A request is ``{"v": PROTOCOL_VERSION, "id": str, "verb": str, "args": {...}}``. The daemon answers with zero or
more events (``{"v", "id", "event": "progress", ...}``) and then one reply: ``{"v", "id", "ok": true, ...}`` or
``{"v", "id", "ok": false, "error": {"code", "message"}}``. Each verb's arguments are a frozen dataclass; unknown
fields, missing fields and wrong types are rejected with code ``bad_request`` (``REQUESTS``, a strict codec).

Replies that code reads field by field are frozen dataclasses too (``AttachReply``, ``LoadReply``,
``AdapterReply``): the daemon builds them, ``decode_reply`` (called by the client, the one place replies are
decoded) checks them. A reply with a missing or mistyped field is an error, extra fields are ignored (a newer
daemon may add some). ``status`` and ``list`` replies stay maps: they are shown to people as they are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

from keepwarm.formats.wire import MAX_FRAME_BYTES, Codec, ProtocolError, decode_fields, pack, unpack

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = MAX_FRAME_BYTES


@dataclass(frozen=True)
class PreloadArgs:
    model: str
    quantization: str = "auto"
    dtype: str = "auto"
    fingerprint: str | None = None  # when given, the resident arena must have exactly this fingerprint
    tp_size: int = 1  # > 1: one shard arena per tensor-parallel rank (CPU daemons), built in one pass
    pp_size: int = 1  # > 1: one per pipeline stage (times tp_size), in the same pass


@dataclass(frozen=True)
class AttachArgs:
    model: str
    pid: int
    quantization: str = "auto"
    dtype: str = "auto"
    fingerprint: str | None = None  # the whole model's (for a shard too)
    preload: bool = True  # preload the model when it is not resident
    tp_rank: int = 0  # with tp_size or pp_size > 1: attach this (stage, rank)'s shard arena
    tp_size: int = 1
    pp_stage: int = 0
    pp_size: int = 1


@dataclass(frozen=True)
class LeaseArgs:
    lease_id: str


@dataclass(frozen=True)
class EvictArgs:
    model: str  # a model path, a fingerprint (or its prefix), or a model directory name
    force: bool = False


@dataclass(frozen=True)
class LoadAdapterArgs:
    path: str


@dataclass(frozen=True)
class UnloadAdapterArgs:
    adapter: str  # a digest (or its prefix), the adapter's path, or its directory name


@dataclass(frozen=True)
class LoadImageArgs:
    manifest: str  # the arena manifest (JSON) of the image
    image: str  # absolute path of the image file: the arena's bytes (e.g. a snapshot blob), read by the daemon
    sha256: str | None = None  # the file's sha256 (a snapshot blob's digest): checked in the same pass as the load
    # The image is a snapshot's portable layer (its manifest's device is "portable"): the daemon builds its own
    # layout from it (re-pack only, keepwarm.weights.portable), or loads it as is where its layout is this one.
    portable: bool = False


@dataclass(frozen=True)
class NoArgs:
    pass


VERBS: dict[str, type] = {
    "preload": PreloadArgs,
    "attach": AttachArgs,
    "detach": LeaseArgs,
    "heartbeat": LeaseArgs,
    "list": NoArgs,
    "evict": EvictArgs,
    "status": NoArgs,
    "shutdown": NoArgs,
    "load_adapter": LoadAdapterArgs,
    "unload_adapter": UnloadAdapterArgs,
    "load_image": LoadImageArgs,
}


REQUESTS = Codec("daemon", PROTOCOL_VERSION, VERBS, tag="verb", body="args", strict=True, code="bad_request",
                 max_bytes=MAX_MESSAGE_BYTES)


def encode(message: dict[str, Any]) -> bytes:
    """A reply or event map as a frame's bytes."""
    return pack(message)


def encode_request(rid: str, verb: str, args: dict[str, Any]) -> bytes:
    """A request's frame; its arguments are the daemon's to check (a refusal comes back as a reply)."""
    return REQUESTS.frame(verb, args, id=rid)


def decode_request(raw: bytes) -> tuple[str, str, Any]:
    """(request id, verb, typed args); raises ProtocolError for anything malformed."""
    msg = REQUESTS.unpack(raw)
    rid = msg.get("id", "")
    if not isinstance(rid, str):
        raise ProtocolError("bad_request", "id must be a string")
    verb, args = REQUESTS.message(msg)
    return rid, verb, args


def decode_answer(raw: bytes) -> dict[str, Any]:
    """An event or reply map as the client reads it (its fields are checked by ``decode_reply``)."""
    return unpack(raw)


def reply_ok(rid: str, **fields: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": rid, "ok": True, **fields}


def reply_error(rid: str, code: str, message: str) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": rid, "ok": False, "error": {"code": code, "message": message}}


def event(rid: str, kind: str, **fields: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": rid, "event": kind, **fields}


# -- replies ---------------------------------------------------------------------------------------------------------
class Reply:
    """A typed reply. Fields read as attributes; ``reply["field"]`` and ``reply.get`` read them as on the wire
    map, for scripts and the CLI's JSON output."""

    def __getitem__(self, key: str) -> Any:
        if key not in {f.name for f in dataclasses.fields(self)}:  # type: ignore[arg-type]
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]


@dataclass(frozen=True)
class AttachReply(Reply):
    """``attach``: a lease on a resident arena, and where its bytes are."""

    lease_id: str
    lease_ttl: float
    manifest: str  # the ArenaManifest as JSON
    arena: dict[str, Any]  # {"kind": "cpu", "path", "size"} or {"kind": "cuda", ...the CUDA IPC handle}
    origin: str  # how the daemon got the arena: "preload", "adopted" or "image"
    cached: bool = False  # resident before this request (no load ran for it)


@dataclass(frozen=True)
class LoadReply(Reply):
    """``preload`` and ``load_image``: the resident model (as in ``status``'s ``models``)."""

    cached: bool
    model: str
    name: str
    fingerprint: str
    quantization: str
    dtype: str
    device: str
    bytes: int
    origin: str
    load_seconds: float
    loaded_at: float
    last_used: float
    leases: list[dict[str, Any]]
    source_bytes: int = 0  # read to build it (checkpoint files or the image); 0 when adopted
    arena_bytes: int = 0  # the arena's allocation
    tp_rank: int = 0  # a shard's layout (0, 1, 0, 1 for a whole arena)
    tp_size: int = 1
    pp_stage: int = 0
    pp_size: int = 1
    source_fingerprint: str = ""  # a shard's whole-model fingerprint
    shards: list[dict[str, Any]] = field(default_factory=list)  # a split preload: every shard, stage-major


@dataclass(frozen=True)
class AdapterReply(Reply):
    """``load_adapter``: the adapter's bytes in the daemon's shared memory, and its identity."""

    cached: bool
    digest: str
    path: str
    config_json: str
    data_file: str
    size: int


R = TypeVar("R", bound=Reply)


def decode_reply(cls: type[R], msg: dict[str, Any]) -> R:
    """The typed reply in ``msg`` (an ``ok`` reply); ProtocolError ``bad_reply`` naming the field if it is not."""
    return decode_fields(cls, msg, "bad_reply")
