"""The one wire codec (keepwarm.formats.wire) as units: typed messages round-trip, and every refusal is one line
with its code; fast, no process. The supervisor's ipc frames are checked here too (over a socketpair), the daemon's
in test_daemon_protocol.py, the tensor-parallel ranks' in test_tensor_parallel.py."""

from __future__ import annotations

import json
import os
import pickle
import socket
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest

from keepwarm.formats import wire
from keepwarm.worker.process import ipc


@dataclass(frozen=True)
class Hello:
    pid: int
    name: str
    scale: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Bye:
    pass


@dataclass(frozen=True)
class Blob:
    data: list[int]  # travels as bytes through a field codec


CODEC = wire.Codec("peer", 3, {"hello": Hello, "bye": Bye})
STRICT = wire.Codec("peer", 3, {"hello": Hello}, tag="kind", strict=True, code="bad", max_bytes=None)


def refused(codec: wire.Codec, data: bytes) -> wire.ProtocolError:
    with pytest.raises(wire.ProtocolError) as e:
        codec.decode(data)
    assert "\n" not in e.value.message and str(e.value) == e.value.message
    return e.value


def test_messages_round_trip_as_msgpack_maps() -> None:
    m = Hello(7, "a", 2, {"k": [1, 2]})
    data = CODEC.encode(m)
    assert msgpack.unpackb(data) == {"v": 3, "type": "hello", "pid": 7, "name": "a", "scale": 2, "extra": {"k": [1, 2]}}
    assert CODEC.decode(data) == m
    assert CODEC.decode(CODEC.encode(Bye())) == Bye()
    assert CODEC.message(CODEC.unpack(data)) == ("hello", m)
    assert CODEC.decode(CODEC.frame("hello", {"pid": 1, "name": "b"})) == Hello(1, "b")  # defaults fill in


@pytest.mark.parametrize("frame, code, message", [
    ({"v": 3, "type": "launch"}, "unknown_type", "unknown type 'launch' (known: bye, hello)"),
    ({"v": 3}, "bad_message", "type must be a string"),
    ({"v": 4, "type": "bye"}, "version_mismatch", "message has protocol version 4; this peer speaks 3"),
    ({"v": True, "type": "bye"}, "version_mismatch", "message has protocol version True; this peer speaks 3"),
    ({"v": 3, "type": "hello", "name": "a"}, "bad_message", "hello: missing field 'pid'"),
    ({"v": 3, "type": "hello", "pid": True, "name": "a"}, "bad_message",
     "hello: field 'pid' must be <class 'int'>, got bool"),
    ({"v": 3, "type": "hello", "pid": 1, "name": "a", "scale": "x"}, "bad_message",
     "hello: field 'scale' must be <class 'float'>, got str"),
    ({"v": 3, "type": "hello", "pid": 1, "name": "a", "extra": []}, "bad_message",
     "hello: field 'extra' must be dict[str, typing.Any], got list"),
])
def test_refusals_name_what_is_wrong(frame: dict, code: str, message: str) -> None:
    e = refused(CODEC, msgpack.packb(frame))
    assert (e.code, e.message) == (code, message)


def test_lenient_codecs_ignore_new_fields_strict_ones_refuse_them() -> None:
    frame = {"v": 3, "type": "hello", "kind": "hello", "pid": 1, "name": "a", "later": 1}
    assert CODEC.decode(msgpack.packb(frame)) == Hello(1, "a")
    e = refused(STRICT, msgpack.packb(frame))
    assert (e.code, e.message) == ("bad", "hello: unknown field(s) 'later', 'type'")


def test_garbage_pickle_and_non_string_keys_are_refused() -> None:
    for data in (b"\xc1", pickle.dumps(Hello(1, "a")), msgpack.packb({1: 1, "v": 3})):
        assert refused(CODEC, data).message in ("message is not valid msgpack", "message must be a map")
    assert refused(CODEC, msgpack.packb([1])).message == "message must be a map"


def test_size_is_checked_on_both_ends() -> None:
    small = wire.Codec("peer", 1, {"hello": Hello}, max_bytes=64)
    with pytest.raises(wire.ProtocolError, match=r"^message of \d+ bytes exceeds 64$"):
        small.encode(Hello(1, "x" * 64))
    e = refused(small, CODEC.encode(Hello(1, "x" * 64)))
    assert e.code == "bad_message" and e.message.endswith("bytes exceeds 64")


def test_body_codec_keeps_fields_under_their_key_beside_the_envelope() -> None:
    codec = wire.Codec("daemon", 1, {"hello": Hello, "hi": Hello}, tag="verb", body="args", strict=True)
    data = codec.encode(Hello(2, "b"), name="hi", id="r1")
    assert msgpack.unpackb(data) == {"v": 1, "verb": "hi", "id": "r1", "args": {"pid": 2, "name": "b", "scale": 1.0,
                                                                              "extra": {}}}
    assert codec.unpack(data)["id"] == "r1" and codec.decode(data) == Hello(2, "b")
    with pytest.raises(ValueError, match="name one"):
        codec.encode(Hello(2, "b"))  # two tag names share the type
    with pytest.raises(ValueError, match="envelope"):
        CODEC.frame("bye", {}, id="x")
    e = refused(codec, msgpack.packb({"v": 1, "verb": "hi", "args": [1]}))
    assert e.message == "hi: args must be a map"


def test_field_codecs_carry_what_msgpack_cannot() -> None:
    def decode(raw: Any) -> list[int]:
        if not isinstance(raw, bytes):
            raise ValueError("expected bytes")
        return list(raw)

    codec = wire.Codec("peer", 1, {"blob": Blob}, fields={"data": wire.FieldCodec(bytes, decode)})
    data = codec.encode(Blob([1, 2, 255]))
    assert msgpack.unpackb(data)["data"] == b"\x01\x02\xff"
    assert codec.decode(data) == Blob([1, 2, 255])
    e = refused(codec, msgpack.packb({"v": 1, "type": "blob", "data": "no"}))
    assert e.message == "blob: field 'data': expected bytes"


def test_decode_fields_checks_a_map_against_a_dataclass() -> None:
    assert wire.decode_fields(Hello, {"pid": 1, "name": "a", "other": 0}, "bad_reply") == Hello(1, "a")
    with pytest.raises(wire.ProtocolError, match="^Hello: missing field 'name'$") as e:
        wire.decode_fields(Hello, {"pid": 1}, "bad_reply")
    assert e.value.code == "bad_reply"
    assert wire.type_ok(1, float) and not wire.type_ok(True, int) and wire.type_ok(None, int | None)


def test_ipc_messages_travel_with_their_fds_and_any_python_str() -> None:
    a, b = ipc.pair()
    r, w = os.pipe()
    with a, b:
        sent = ipc.Fork(config={"model": "/m/\udcff"}, restarts={"total": {"zygote": 1}})  # a path's undecodable byte
        ipc.send(a, sent, (r,))
        got, fds = ipc.recv(b, timeout=5)
        assert got == sent and len(fds) == 1 and not os.get_inheritable(fds[0])
        os.write(w, b"x")
        assert os.read(fds[0], 1) == b"x"
        for fd in (r, w, *fds):
            os.close(fd)
        ipc.send(a, ipc.CarriedPrefixes(3, 4096, 0.5))  # the one answer to ExportPrefixes and to AdoptPrefixes
        assert ipc.recv(b, timeout=5) == (ipc.CarriedPrefixes(3, 4096, 0.5, ""), [])


def test_ipc_refuses_an_older_keepwarms_json_and_closes_the_fds_beside_a_refused_message() -> None:
    a, b = ipc.pair()
    r, w = os.pipe()
    with a, b:
        a.sendall(json.dumps({"v": 1, "type": "hello", "pid": 1}).encode())
        with pytest.raises(wire.ProtocolError) as e:
            ipc.recv(b, timeout=5)
        assert (e.value.code, e.value.message) == ("version_mismatch", "message has protocol version 1 (JSON); "
                                                                       f"this keepwarm speaks {ipc.IPC_VERSION}")
        before = len(os.listdir("/proc/self/fd"))
        socket.send_fds(a, [ipc.CODEC.frame("hello", {"pid": "1"})], [r])
        with pytest.raises(wire.ProtocolError, match="^hello: field 'pid' must be <class 'int'>, got str$"):
            ipc.recv(b, timeout=5)
        assert len(os.listdir("/proc/self/fd")) == before  # the fd that came with it is closed
        os.close(r)
        os.close(w)
