"""The daemon's wire protocol: versioned, typed messages encoded with msgpack (never pickle).

A request is ``{"v": PROTOCOL_VERSION, "id": str, "verb": str, "args": {...}}``. The daemon answers with zero or
more events (``{"v", "id", "event": "progress", ...}``) and then one reply: ``{"v", "id", "ok": true, ...}`` or
``{"v", "id", "ok": false, "error": {"code", "message"}}``. Each verb's arguments are a frozen dataclass; unknown
fields, missing fields and wrong types are rejected with code ``bad_request``.

Replies that code reads field by field are frozen dataclasses too (``AttachReply``, ``LoadReply``,
``AdapterReply``): the daemon builds them, ``decode_reply`` (called by the client, the one place replies are
decoded) checks them. A reply with a missing or mistyped field is an error, extra fields are ignored (a newer
daemon may add some). ``status`` and ``list`` replies stay maps: they are shown to people as they are.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 1 << 20


class ProtocolError(Exception):
    """A request the daemon refuses; ``code`` is machine-readable, ``message`` one line for humans."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


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


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if origin is not None:  # dict[str, Any], list[...]: the container's type (its items are the reader's concern)
        return isinstance(value, origin)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, hint)


def parse_args(verb: str, args: Any) -> Any:
    cls = VERBS.get(verb)
    if cls is None:
        raise ProtocolError("unknown_verb", f"unknown verb {verb!r} (known: {', '.join(sorted(VERBS))})")
    if not isinstance(args, dict):
        raise ProtocolError("bad_request", f"{verb}: args must be a map")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(args) - set(fields))
    if unknown:
        raise ProtocolError("bad_request", f"{verb}: unknown field(s) {', '.join(map(repr, unknown))}")
    for name, f in fields.items():
        if name not in args:
            if f.default is dataclasses.MISSING:
                raise ProtocolError("bad_request", f"{verb}: missing field {name!r}")
            continue
        if not _type_ok(args[name], hints[name]):
            raise ProtocolError("bad_request", f"{verb}: field {name!r} must be {hints[name]}, "
                                               f"got {type(args[name]).__name__}")
    return cls(**args)


def encode(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def decode_request(raw: bytes) -> tuple[str, str, Any]:
    """(request id, verb, typed args); raises ProtocolError for anything malformed."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise ProtocolError("bad_request", f"message of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        msg = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception:  # msgpack raises several unrelated types for garbage
        raise ProtocolError("bad_request", "message is not valid msgpack") from None
    if not isinstance(msg, dict):
        raise ProtocolError("bad_request", "message must be a map")
    version = msg.get("v")
    if version != PROTOCOL_VERSION or isinstance(version, bool):  # True == 1 in Python, not on the wire
        raise ProtocolError("version_mismatch",
                            f"message has protocol version {version!r}; this daemon speaks {PROTOCOL_VERSION}")
    rid = msg.get("id", "")
    if not isinstance(rid, str):
        raise ProtocolError("bad_request", "id must be a string")
    verb = msg.get("verb")
    if not isinstance(verb, str):
        raise ProtocolError("bad_request", "verb must be a string")
    return rid, verb, parse_args(verb, msg.get("args", {}))


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
T = TypeVar("T")


def decode_reply(cls: type[R], msg: dict[str, Any]) -> R:
    """The typed reply in ``msg`` (an ``ok`` reply); ProtocolError ``bad_reply`` naming the field if it is not."""
    return decode_fields(cls, msg)


def decode_fields(cls: type[T], msg: dict[str, Any], code: str = "bad_reply") -> T:
    """The frozen dataclass ``cls`` from the map ``msg``: every field present (or defaulted) and of its declared
    type, extra keys ignored (a newer peer may add some); ProtocolError ``code`` naming the field otherwise. Also
    used by the server's supervisor messages (keepwarm.worker.api.ipc)."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in msg:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(code, f"{cls.__name__}: missing field {f.name!r}")
            continue
        if not _type_ok(msg[f.name], hints[f.name]):
            raise ProtocolError(code, f"{cls.__name__}: field {f.name!r} must be {hints[f.name]}, "
                                      f"got {type(msg[f.name]).__name__}")
        values[f.name] = msg[f.name]
    return cls(**values)
