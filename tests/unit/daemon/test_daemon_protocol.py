"""The daemon's wire protocol (keepwarm.daemon.protocol, on keepwarm.formats.wire) as units: every verb's typed
arguments, every refusal with its code and one-line message, and the reply/event shapes; fast, no daemon process."""

from __future__ import annotations

import msgpack
import pytest

from keepwarm.daemon import protocol as p
from keepwarm.formats import wire


def raw(**msg) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def refused(data: bytes) -> p.ProtocolError:
    with pytest.raises(p.ProtocolError) as e:
        p.decode_request(data)
    assert "\n" not in e.value.message and str(e.value) == e.value.message
    return e.value


def test_every_verb_parses_into_its_dataclass_with_defaults() -> None:
    assert p.decode_request(raw(v=1, id="r1", verb="preload", args={"model": "/m"})) == \
        ("r1", "preload", p.PreloadArgs("/m", "auto", "auto", None))
    rid, verb, a = p.decode_request(raw(v=1, id="r2", verb="attach", args={"model": "/m", "pid": 7}))
    assert (rid, verb) == ("r2", "attach") and a == p.AttachArgs("/m", 7, "auto", "auto", None, True)
    assert p.decode_request(raw(v=1, id="", verb="detach", args={"lease_id": "L"}))[2] == p.LeaseArgs("L")
    assert p.decode_request(raw(v=1, id="x", verb="heartbeat", args={"lease_id": "L"}))[2] == p.LeaseArgs("L")
    assert p.decode_request(raw(v=1, id="x", verb="evict", args={"model": "ab"}))[2] == p.EvictArgs("ab", False)
    assert p.decode_request(raw(v=1, id="x", verb="load_adapter", args={"path": "/a"}))[2] == \
        p.LoadAdapterArgs("/a")
    assert p.decode_request(raw(v=1, id="x", verb="unload_adapter", args={"adapter": "d"}))[2] == \
        p.UnloadAdapterArgs("d")
    assert p.decode_request(raw(v=1, id="x", verb="load_image", args={"manifest": "{}", "image": "/i"}))[2] == \
        p.LoadImageArgs("{}", "/i")
    for verb in ("list", "status", "shutdown"):
        assert p.decode_request(raw(v=1, id="x", verb=verb))[2] == p.NoArgs()  # args may be left out
    assert sorted(p.VERBS) == sorted(["preload", "attach", "detach", "heartbeat", "list", "evict", "status",
                                      "shutdown", "load_adapter", "unload_adapter", "load_image"])


def test_given_values_are_kept() -> None:
    a = p.decode_request(raw(v=1, id="q", verb="attach", args={
        "model": "/m", "pid": 9, "quantization": "int4", "dtype": "float32", "fingerprint": "f" * 64,
        "preload": False}))[2]
    assert a == p.AttachArgs("/m", 9, "int4", "float32", "f" * 64, False)
    assert p.decode_request(raw(v=1, id="q", verb="evict", args={"model": "m", "force": True}))[2].force is True
    assert p.decode_request(raw(v=1, verb="status"))[0] == ""  # a missing id is the empty id


@pytest.mark.parametrize("data, code, message", [
    (b"\xc1", "bad_request", "message is not valid msgpack"),
    (msgpack.packb([1, 2]), "bad_request", "message must be a map"),
    (raw(id="x", verb="status"), "version_mismatch",
     "message has protocol version None; this daemon speaks 1"),
    (raw(v=2, id="x", verb="status"), "version_mismatch", "message has protocol version 2; this daemon speaks 1"),
    (raw(v=True, id="x", verb="status"), "version_mismatch",
     "message has protocol version True; this daemon speaks 1"),
    (raw(v=1, id=5, verb="status"), "bad_request", "id must be a string"),
    (raw(v=1, id="x"), "bad_request", "verb must be a string"),
    (raw(v=1, id="x", verb=3), "bad_request", "verb must be a string"),
    (raw(v=1, id="x", verb="launch"), "unknown_verb",
     "unknown verb 'launch' (known: attach, detach, evict, heartbeat, list, load_adapter, load_image, preload, "
     "shutdown, status, unload_adapter)"),
    (raw(v=1, id="x", verb="status", args=[1]), "bad_request", "status: args must be a map"),
    (raw(v=1, id="x", verb="preload", args={}), "bad_request", "preload: missing field 'model'"),
    (raw(v=1, id="x", verb="attach", args={"model": "/m"}), "bad_request", "attach: missing field 'pid'"),
    (raw(v=1, id="x", verb="preload", args={"model": "/m", "zz": 1, "aa": 2}), "bad_request",
     "preload: unknown field(s) 'aa', 'zz'"),
    (raw(v=1, id="x", verb="status", args={"x": 1}), "bad_request", "status: unknown field(s) 'x'"),
    (raw(v=1, id="x", verb="preload", args={"model": 5}), "bad_request",
     "preload: field 'model' must be <class 'str'>, got int"),
    (raw(v=1, id="x", verb="attach", args={"model": "/m", "pid": True}), "bad_request",
     "attach: field 'pid' must be <class 'int'>, got bool"),
    (raw(v=1, id="x", verb="attach", args={"model": "/m", "pid": 1.5}), "bad_request",
     "attach: field 'pid' must be <class 'int'>, got float"),
    (raw(v=1, id="x", verb="attach", args={"model": "/m", "pid": 1, "preload": 1}), "bad_request",
     "attach: field 'preload' must be <class 'bool'>, got int"),
    (raw(v=1, id="x", verb="preload", args={"model": "/m", "fingerprint": 3}), "bad_request",
     "preload: field 'fingerprint' must be str | None, got int"),
    (raw(v=1, id="x", verb="evict", args={"model": None}), "bad_request",
     "evict: field 'model' must be <class 'str'>, got NoneType"),
])
def test_malformed_requests_are_refused_with_code_and_message(data: bytes, code: str, message: str) -> None:
    e = refused(data)
    assert (e.code, e.message) == (code, message)


def test_size_limit_is_checked_before_decoding() -> None:
    empty = raw(v=1, id="x", verb="load_adapter", args={"path": ""})
    n = p.MAX_MESSAGE_BYTES - len(empty) - 4  # a str32 header takes 4 bytes more than the empty string's
    big = raw(v=1, id="x", verb="load_adapter", args={"path": "a" * n})
    assert len(big) == p.MAX_MESSAGE_BYTES  # exactly at the limit: accepted
    assert p.decode_request(big)[2].path == "a" * n
    over = big + b"\x00" * (p.MAX_MESSAGE_BYTES + 1 - len(big))
    e = refused(over)
    assert e.code == "bad_request" and e.message == f"message of {p.MAX_MESSAGE_BYTES + 1} bytes exceeds 1048576"
    assert p.MAX_MESSAGE_BYTES == 1 << 20


def test_never_pickle_and_non_string_map_keys_refused() -> None:
    import pickle

    assert refused(pickle.dumps({"v": 1, "verb": "status"})).message in ("message is not valid msgpack",
                                                                         "message must be a map")
    e = refused(msgpack.packb({1: 1, "v": 1}))
    assert e.code == "bad_request" and e.message == "message is not valid msgpack"


def test_float_fields_take_ints_but_not_bools() -> None:
    assert wire.type_ok(1, float) and wire.type_ok(1.5, float) and not wire.type_ok(True, float)
    assert not wire.type_ok("1", float)
    assert wire.type_ok(None, str | None) and wire.type_ok("s", str | None) and not wire.type_ok(1, str | None)
    assert wire.type_ok(None, type(None)) and not wire.type_ok(0, type(None))


def test_reply_and_event_shapes_round_trip() -> None:
    assert p.reply_ok("r", bytes=3) == {"v": 1, "id": "r", "ok": True, "bytes": 3}
    assert p.reply_error("r", "busy", "try later") == {"v": 1, "id": "r", "ok": False,
                                                        "error": {"code": "busy", "message": "try later"}}
    assert p.event("r", "progress", done=1) == {"v": 1, "id": "r", "event": "progress", "done": 1}
    msg = p.reply_ok("r", name="m", data=b"\x00\xff")
    assert msgpack.unpackb(p.encode(msg), raw=False) == msg  # bytes stay bytes (use_bin_type)
    req = {"v": p.PROTOCOL_VERSION, "id": "z", "verb": "evict", "args": {"model": "m", "force": True}}
    assert p.decode_request(p.encode(req)) == ("z", "evict", p.EvictArgs("m", True))
    assert msgpack.unpackb(p.encode_request("z", "evict", {"model": "m", "force": True})) == req  # the same frame
    assert p.decode_answer(p.encode(msg)) == msg


def test_protocol_error_carries_code_and_message() -> None:
    assert p.ProtocolError is wire.ProtocolError  # one error type for every boundary
    e = p.ProtocolError("memory_budget", "too big")
    assert (e.code, e.message, str(e), e.args) == ("memory_budget", "too big", "too big", ("too big",))


@pytest.mark.parametrize("verb", sorted(p.VERBS))
def test_parsed_arguments_are_frozen(verb: str) -> None:
    """Handlers pass the parsed arguments around (jobs, leases): none of them may change underneath."""
    import dataclasses

    cls = p.VERBS[verb]
    assert dataclasses.fields(cls) == () or cls.__dataclass_params__.frozen
    args = {f.name: (1 if f.type in ("int", int) else "x") for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING}
    parsed = p.REQUESTS.message({"verb": verb, "args": args})[1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        parsed.extra = 1


def test_decode_reply_checks_every_field() -> None:
    full = {"lease_id": "l1", "lease_ttl": 5, "manifest": "{}", "arena": {"kind": "cpu"}, "origin": "preload"}
    r = p.decode_reply(p.AttachReply, {"v": 1, "id": "x", "ok": True, **full})  # envelope keys are not fields
    assert r == p.AttachReply("l1", 5, "{}", {"kind": "cpu"}, "preload") and r.cached is False
    assert r["lease_id"] == "l1" and r.get("nope", 3) == 3 and r.to_dict() == {**full, "cached": False}
    assert p.decode_reply(p.AttachReply, {**full, "cached": True}).cached is True
    for name in full:
        with pytest.raises(p.ProtocolError, match=f"AttachReply: missing field '{name}'") as e:
            p.decode_reply(p.AttachReply, {k: v for k, v in full.items() if k != name})
        assert e.value.code == "bad_reply"
    with pytest.raises(p.ProtocolError, match="field 'lease_ttl' must be <class 'float'>, got str"):
        p.decode_reply(p.AttachReply, {**full, "lease_ttl": "5"})
    with pytest.raises(p.ProtocolError, match="field 'cached' must be <class 'bool'>, got int"):
        p.decode_reply(p.AttachReply, {**full, "cached": 1})


def test_replies_are_frozen() -> None:
    import dataclasses

    replies = p.Reply.__subclasses__()
    assert len(replies) >= 3
    for cls in replies:
        assert cls.__dataclass_params__.frozen, cls  # type: ignore[attr-defined]
    r = p.AttachReply("l", 1.0, "{}", {}, "preload")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.cached = True  # type: ignore[misc]
