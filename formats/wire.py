"""One wire codec for every process boundary: typed frozen dataclass messages <-> msgpack frames, never pickle.

Rules:
- A frame is one msgpack map ``{"v": version, <tag>: <type name>, ...}`` with string keys, at most ``max_bytes``
  (checked before decoding, and when encoding). The message's fields lie beside the tag or, for a codec with a
  ``body`` key, in a map under it (the daemon's requests: ``"args"``; the other keys are the frame's envelope).
- A ``Codec`` names one boundary: its version, its tag key and its message types (frozen dataclasses; several tag
  names may share one type).
- On arrival each field is checked against its annotation: ``bool`` is not an ``int``, an ``int`` is a ``float``,
  unions and ``None`` as declared, containers by their own type only (their items are the reader's concern).
- Anything else is refused with a ``ProtocolError``: a machine-readable code and one line naming what was wrong
  (another version, an unknown type with the known ones, a missing, mistyped or, for a ``strict`` codec, unknown
  field). A codec that is not strict ignores unknown fields: a newer peer may add some.
- A field that is not msgpack-native (a tensor) travels through the ``FieldCodec`` its codec names for it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack

MAX_FRAME_BYTES = 1 << 20

T = TypeVar("T")


class ProtocolError(Exception):
    """A frame or request refused; ``code`` is machine-readable, ``message`` one line for humans."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class FieldCodec:
    """How one field that msgpack cannot carry as it is travels: ``encode`` to a msgpack value, ``decode`` back
    (raising ValueError, with one line, for a value that does not make one)."""

    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]


def type_ok(value: Any, hint: Any) -> bool:
    """Whether ``value`` (as msgpack decodes it) is of the annotated type ``hint``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(type_ok(value, h) for h in typing.get_args(hint))
    if origin is not None:  # dict[str, Any], list[...]: the container's type (its items are the reader's concern)
        return isinstance(value, origin)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, hint)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """A message type's field annotations, resolved once per type (every frame of it is checked against them)."""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def decode_fields(cls: type[T], msg: Mapping[str, Any], code: str, *, name: str | None = None,
                  strict: bool = False, fields: Mapping[str, FieldCodec] | None = None) -> T:
    """The frozen dataclass ``cls`` from the map ``msg``: every field present (or defaulted) and of its declared
    type; ProtocolError ``code`` naming the field (after ``name``, default the class's) otherwise. Unknown keys are
    refused when ``strict``, else ignored. ``fields``: the field codecs that decode (and check) those fields."""
    label = name or cls.__name__
    declared = dataclasses.fields(cls)  # type: ignore[arg-type]
    if strict:
        unknown = sorted(set(msg) - {f.name for f in declared})
        if unknown:
            raise ProtocolError(code, f"{label}: unknown field(s) {', '.join(map(repr, unknown))}")
    hints = _hints(cls)
    values = {}
    for f in declared:
        if f.name not in msg:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(code, f"{label}: missing field {f.name!r}")
            continue
        value = msg[f.name]
        special = (fields or {}).get(f.name)
        if special is not None:
            try:
                value = special.decode(value)
            except ValueError as e:
                raise ProtocolError(code, f"{label}: field {f.name!r}: {e}") from None
        elif not type_ok(value, hints[f.name]):
            raise ProtocolError(code, f"{label}: field {f.name!r} must be {hints[f.name]}, "
                                      f"got {type(value).__name__}")
        values[f.name] = value
    return cls(**values)


def pack(frame: Mapping[str, Any]) -> bytes:
    """A map as msgpack bytes (bytes stay bytes)."""
    return msgpack.packb(frame, use_bin_type=True)


def unpack(data: bytes) -> Any:
    """msgpack bytes as Python values, unchecked: what reads them checks them (``decode_fields``)."""
    return msgpack.unpackb(data, raw=False)


@dataclass(frozen=True)
class Codec:
    """The frames of one boundary. ``peer`` names who speaks it, in the version error ("this daemon speaks 1")."""

    peer: str
    version: int
    types: Mapping[str, type]  # tag name -> frozen dataclass
    tag: str = "type"
    body: str | None = None  # the fields' map lies under this key (None: beside the tag)
    strict: bool = False  # refuse unknown fields
    code: str = "bad_message"  # the code of every refusal but a version's and an unknown type's
    max_bytes: int | None = MAX_FRAME_BYTES
    fields: Mapping[str, FieldCodec] = field(default_factory=dict)  # by field name
    unicode_errors: str = "strict"  # "surrogatepass": any Python str travels (a path's undecodable bytes), as in JSON

    def _checked(self, data: bytes) -> bytes:
        if self.max_bytes is not None and len(data) > self.max_bytes:
            raise ProtocolError(self.code, f"message of {len(data)} bytes exceeds {self.max_bytes}")
        return data

    def frame(self, name: str, fields: Mapping[str, Any], **envelope: Any) -> bytes:
        """The frame of message ``name`` with these (already msgpack-native) fields, unchecked: the receiver
        checks them. ``envelope``: keys beside the tag (codecs with a ``body`` only)."""
        if envelope and self.body is None:
            raise ValueError(f"{self.peer}: an envelope needs a codec with a body key")
        head = {"v": self.version, self.tag: name, **envelope}
        frame = {**head, self.body: dict(fields)} if self.body else {**head, **fields}
        return self._checked(msgpack.packb(frame, use_bin_type=True, unicode_errors=self.unicode_errors))

    def encode(self, message: Any, name: str | None = None, **envelope: Any) -> bytes:
        """The frame of a typed message; ``name`` is needed only where several tag names share its type."""
        if name is None:
            names = [n for n, cls in self.types.items() if cls is type(message)]
            if len(names) != 1:
                raise ValueError(f"{self.peer}: {type(message).__name__} has tag names {names}; name one")
            name = names[0]
        values = {}
        for f in dataclasses.fields(message):
            value = getattr(message, f.name)
            special = self.fields.get(f.name)
            values[f.name] = special.encode(value) if special is not None else value
        return self.frame(name, values, **envelope)

    def unpack(self, data: bytes) -> dict[str, Any]:
        """The frame's map, its size, shape and version checked (the message in it is not yet)."""
        try:
            msg = msgpack.unpackb(self._checked(data), raw=False, strict_map_key=True,
                                  unicode_errors=self.unicode_errors)
        except ProtocolError:
            raise
        except Exception:  # msgpack raises several unrelated types for garbage
            raise ProtocolError(self.code, "message is not valid msgpack") from None
        if not isinstance(msg, dict):
            raise ProtocolError(self.code, "message must be a map")
        version = msg.get("v")
        if version != self.version or isinstance(version, bool):  # True == 1 in Python, not on the wire
            raise ProtocolError("version_mismatch", f"message has protocol version {version!r}; this {self.peer} "
                                                    f"speaks {self.version}")
        return msg

    def message(self, msg: Mapping[str, Any]) -> tuple[str, Any]:
        """(tag name, typed message) of an unpacked frame."""
        name = msg.get(self.tag)
        if not isinstance(name, str):
            raise ProtocolError(self.code, f"{self.tag} must be a string")
        cls = self.types.get(name)
        if cls is None:
            raise ProtocolError(f"unknown_{self.tag}", f"unknown {self.tag} {name!r} "
                                                       f"(known: {', '.join(sorted(self.types))})")
        if self.body is None:
            body = {k: v for k, v in msg.items() if k not in ("v", self.tag)}
        else:
            body = msg.get(self.body, {})
            if not isinstance(body, dict):
                raise ProtocolError(self.code, f"{name}: {self.body} must be a map")
        return name, decode_fields(cls, body, self.code, name=name, strict=self.strict, fields=self.fields)

    def decode(self, data: bytes) -> Any:
        """The typed message of a frame."""
        return self.message(self.unpack(data))[1]
