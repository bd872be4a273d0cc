"""The preload daemon with real processes: attach from workers, leases, kill -9, re-adoption, bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import msgpack
import pytest
import zmq
from support.daemon import DaemonProc, Worker, new_runtime_dir, remove_runtime_dir
from support.wait import wait_until

from keepwarm.daemon.client import DaemonError
from keepwarm.formats import paths
from keepwarm.formats.arena import ArenaManifest, CpuArenaFile, arena_digest_of


@pytest.fixture
def runtime_dir():
    d = new_runtime_dir()
    yield d
    remove_runtime_dir(d)


@pytest.fixture
def daemon(runtime_dir):
    procs: list[DaemonProc] = []

    def make(*args: str) -> DaemonProc:
        p = DaemonProc(runtime_dir).start(*args)
        procs.append(p)
        return p

    yield make
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def shared_daemon(tiny_llama):
    """One daemon with the tiny llama resident, for the tests that only send it requests that must change nothing
    (refused preloads and messages, a second daemon refused): each checks it still holds exactly that model."""
    d = DaemonProc(new_runtime_dir()).start()
    with d.client() as c:
        c.preload(tiny_llama)
    yield d
    d.stop()
    remove_runtime_dir(d.runtime_dir)


@pytest.fixture(scope="session")
def medium_model(tmp_path_factory) -> str:
    """~70 MB of float32 weights: big enough that memory accounting cannot hide them."""
    from keepwarm.worker.models.random_model import make_random_model

    return str(make_random_model(tmp_path_factory.mktemp("medium"), "llama", vocab_size=8192, hidden_size=512,
                                 intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                                 num_key_value_heads=2, head_dim=64, initializer_range=0.1))


@pytest.mark.slow
def test_two_workers_attach_share_and_cannot_write(daemon, runtime_dir, medium_model) -> None:
    d = daemon()
    with d.client() as c:
        pre = c.preload(medium_model)
    disk = Worker(medium_model, runtime_dir, daemon="off", hold=False)
    w1 = Worker(medium_model, runtime_dir)
    w2 = Worker(medium_model, runtime_dir)
    try:
        assert disk.report["source"] == "disk"
        assert w1.report["source"] == w2.report["source"] == "daemon"
        assert w1.report["fingerprint"] == w2.report["fingerprint"] == pre["fingerprint"] == disk.report["fingerprint"]
        assert w1.report["tokens"] == w2.report["tokens"] == disk.report["tokens"]
        weights = w1.report["weights_bytes"]
        assert weights > 60e6
        # The arena mapping is shared, never private: the weights are not in the workers' own memory.
        for w in (w1, w2):
            arena = w.report["memory"]["arena"]
            assert arena["private"] == 0, arena
            assert arena["shared"] > 0.5 * weights, arena
        assert disk.report["memory"]["uss"] - w1.report["memory"]["uss"] > 0.8 * weights
        # PSS: two workers share the arena, so each counts about half the weights where the disk process counts all
        # (0.5 * weights apart, plus the processes' other memory: 0.38 measured once under the full suite's load)
        assert w1.report["memory"]["pss"] < disk.report["memory"]["pss"] - 0.25 * weights
        st = d.status()
        (model,) = st["models"]
        assert sorted(x["pid"] for x in model["leases"]) == sorted([w1.report["pid"], w2.report["pid"]])

        # A write into the read-only mapping faults the writer; the arena is unchanged for everyone else.
        w1.send("write")
        assert w1.proc.wait(timeout=30) == -signal.SIGSEGV
        w2.send("tokens")
        assert w2.read()["tokens"] == disk.report["tokens"]
        m = ArenaManifest.from_json((paths.shm_dir(runtime_dir) / f"{pre['fingerprint']}.json").read_text())
        arena_file = CpuArenaFile.open_readonly(paths.shm_dir(runtime_dir) / f"{pre['fingerprint']}.arena",
                                                m.total_bytes)
        assert arena_digest_of(arena_file.flat, m.tensors) == m.arena_digest
        # The dead writer's lease is dropped (its pid is gone).
        wait_until(lambda: [x["pid"] for x in d.status()["models"][0]["leases"]] == [w2.report["pid"]], 20)
    finally:
        w2.close()
        if w1.proc.poll() is None:
            w1.proc.kill()


@pytest.mark.slow
def test_kill9_worker_then_daemon_readopts(daemon, runtime_dir, tiny_llama) -> None:
    d = daemon("--lease-ttl", "30")
    w = Worker(tiny_llama, runtime_dir)
    try:
        assert d.status()["counters"]["preloads"] == 1
        w.proc.send_signal(signal.SIGKILL)
        w.proc.wait(timeout=10)
        wait_until(lambda: d.status()["leases"] == 0, 10)  # pid gone -> lease dropped
        assert d.status()["counters"]["leases_dropped"] == 1

        survivor = Worker(tiny_llama, runtime_dir)
        expected = survivor.report["tokens"]
        fingerprint = d.status()["models"][0]["fingerprint"]
        d.kill9()
        arena_dir = paths.shm_dir(runtime_dir)
        assert (arena_dir / f"{fingerprint}.arena").exists()  # SIGKILL: the arena outlives the daemon
        (arena_dir / ".building-deadbeef.arena").write_bytes(b"half a preload")  # debris to be removed

        d2 = daemon("--lease-ttl", "3")
        st = d2.status()
        assert st["counters"]["adopted"] == 1 and st["counters"]["preloads"] == 0
        assert [m["fingerprint"] for m in st["models"]] == [fingerprint]
        assert st["models"][0]["origin"] == "adopted"
        assert not (arena_dir / ".building-deadbeef.arena").exists()
        # The survivor's lease died with the old daemon: its keeper re-attaches by fingerprint.
        wait_until(lambda: [x["pid"] for x in d2.status()["models"][0]["leases"]] == [survivor.report["pid"]], 20)
        survivor.send("tokens")
        assert survivor.read()["tokens"] == expected
        fresh = Worker(tiny_llama, runtime_dir, hold=False)
        assert fresh.report["source"] == "daemon" and fresh.report["tokens"] == expected
        assert d2.status()["counters"]["preloads"] == 0  # attached warm: no reload
        survivor.close()

        # A clean stop leaves nothing in shared memory.
        out = subprocess.run([sys.executable, "-m", "keepwarm.cli.main", "daemon", "stop"], env=d2.env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "stopped" in out.stdout
        d2.proc.wait(timeout=30)
        assert not arena_dir.exists()
        assert not paths.socket_path(runtime_dir).exists()
    finally:
        for p in (w.proc,):
            if p.poll() is None:
                p.kill()


def test_corrupted_arena_is_not_readopted(daemon, runtime_dir, tiny_llama) -> None:
    d = daemon()
    with d.client() as c:
        fp = c.preload(tiny_llama)["fingerprint"]
    d.kill9()
    arena = paths.shm_dir(runtime_dir) / f"{fp}.arena"
    data = bytearray(arena.read_bytes())
    data[1000] ^= 0xFF
    arena.write_bytes(bytes(data))
    d2 = daemon()
    st = d2.status()
    assert st["models"] == [] and st["counters"]["adopted"] == 0
    assert not arena.exists()
    assert "arena bytes do not match" in d2.log()


def test_missed_renewals_drop_lease_and_eviction_rules(daemon, runtime_dir, tiny_llama, tiny_model_factory) -> None:
    d = daemon("--lease-ttl", "2")  # the evict below must come within one TTL of the attach, on a loaded machine
    with d.client() as c:
        lease = c.attach(tiny_llama)["lease_id"]  # our own pid is alive, but we never renew
        with pytest.raises(DaemonError) as e:
            c.evict(tiny_llama)
        assert e.value.code == "in_use"
        wait_until(lambda: d.status()["leases"] == 0, 10)
        with pytest.raises(DaemonError) as e:
            c.heartbeat(lease)
        assert e.value.code == "unknown_lease"
        lease = c.attach(tiny_llama)["lease_id"]
        assert c.evict(tiny_llama, force=True)["evicted"]
        assert d.status()["models"] == []


def test_memory_budget_evicts_lru_or_refuses(daemon, runtime_dir, tiny_model_factory) -> None:
    a, b, q = tiny_model_factory("llama"), tiny_model_factory("mistral"), tiny_model_factory("qwen2")
    d = daemon("--memory-budget", "4M")  # each tiny model's arena is ~1.7 MB
    with d.client() as c:
        c.preload(a)
        c.preload(b)
        c.preload(a)  # touch a: b is now least recently used
        c.preload(q)
        names = sorted(m["model"] for m in d.status()["models"])
        assert names == sorted([str(Path(a).resolve()), str(Path(q).resolve())])
        assert d.status()["counters"]["evictions"] == 1
        c.attach(a)
        c.attach(q)
        with pytest.raises(DaemonError) as e:
            c.preload(b)
        # The lease message, not the "larger than the whole budget" one: b (~1.7 MB) fits the 4 MB budget, but
        # both residents hold leases, so nothing may be evicted for it.
        assert e.value.code == "memory_budget"
        assert "0.0 MB held by models without leases" in e.value.message
        assert "evict a model with live leases first" in e.value.message
        assert len(d.status()["models"]) == 2


def test_fingerprint_covers_weight_bytes(daemon, runtime_dir, tiny_llama, tmp_path) -> None:
    from keepwarm.weights.checkpoint import read_safetensors_header

    model = tmp_path / "m"
    shutil.copytree(tiny_llama, model)
    d = daemon()
    with d.client() as c:
        fp1 = c.preload(str(model))["fingerprint"]
        assert c.preload(str(model))["cached"] is True
        st_file = model / "model.safetensors"
        header_before = read_safetensors_header(st_file)
        entry = header_before["model.norm.weight"]
        with open(st_file, "r+b") as f:  # change one weight's bytes; the header stays byte-identical
            f.seek(entry.offset)
            f.write(b"\x00\x00\x00\x40")  # 2.0f (norm weights start at 1.0)
        assert {k: (v.shape, v.offset) for k, v in read_safetensors_header(st_file).items()} == \
            {k: (v.shape, v.offset) for k, v in header_before.items()}
        reply = c.preload(str(model))
        assert reply["cached"] is False
        assert reply["fingerprint"] != fp1
        assert [m["fingerprint"] for m in d.status()["models"]] == [reply["fingerprint"]]  # stale arena evicted
        # Quantization is part of the fingerprint too.
        assert c.preload(str(model), quantization="int8")["fingerprint"] not in (fp1, reply["fingerprint"])


@pytest.mark.parametrize("case, code, pattern", [
    ("missing", "bad_model", "does not exist"),
    ("not_model", "bad_model", "config.json is missing"),
    ("arch", "bad_model", "unsupported architecture 'BertModel'"),
    ("quant", "bad_quantization", "unknown quantization 'int3'"),
])
def test_bad_preloads_get_one_line_errors(shared_daemon, tiny_llama, tmp_path, case, code, pattern) -> None:
    d = shared_daemon
    with d.client() as c:
        c.preload(tiny_llama)
        model = {"missing": str(tmp_path / "nope"), "not_model": str(tmp_path), "arch": str(tmp_path / "bert"),
                 "quant": tiny_llama}[case]
        if case == "arch":
            shutil.copytree(tiny_llama, model)
            cfg = json.loads((Path(model) / "config.json").read_text())
            cfg["architectures"] = ["BertModel"]
            (Path(model) / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(DaemonError) as e:
            c.preload(model, quantization="int3" if case == "quant" else "none")
        assert e.value.code == code and pattern in e.value.message and "\n" not in e.value.message
        assert len(c.status()["models"]) == 1  # still serving, still holding its weights
    out = subprocess.run([sys.executable, "-m", "keepwarm.cli.main", "preload", model] +
                         (["-q", "int3"] if case == "quant" else []), env=d.env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and pattern in lines[0], out.stderr


def test_memory_budget_too_small_is_a_clear_error(daemon, tiny_llama) -> None:
    d = daemon("--memory-budget", "100K")
    with d.client() as c, pytest.raises(DaemonError) as e:
        c.preload(tiny_llama)
    assert e.value.code == "memory_budget" and "needs" in e.value.message
    assert d.status()["models"] == []


@pytest.mark.parametrize("payload, code", [
    (msgpack.packb({"v": 99, "id": "x", "verb": "status"}), "version_mismatch"),
    (b"\xc1 not msgpack", "bad_request"),
    (msgpack.packb([1, 2, 3]), "bad_request"),
    (msgpack.packb({"v": 1, "id": "x", "verb": "launch"}), "unknown_verb"),
    (msgpack.packb({"v": 1, "id": "x", "verb": "preload", "args": {"model": 5}}), "bad_request"),
    (msgpack.packb({"v": 1, "id": "x", "verb": "preload", "args": {"model": "m", "extra": 1}}), "bad_request"),
    (msgpack.packb({"v": 1, "id": "x", "verb": "attach", "args": {"model": "m"}}), "bad_request"),
    (msgpack.packb({"v": 1, "id": "x", "verb": "heartbeat", "args": "lease"}), "bad_request"),
])
def test_malformed_messages_are_refused(shared_daemon, tiny_llama, payload, code) -> None:
    d = shared_daemon
    with d.client() as c:
        c.preload(tiny_llama)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(paths.endpoint(d.runtime_dir))
    try:
        sock.send(payload)
        assert sock.poll(10_000)
        reply = msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.close()
    assert reply["ok"] is False and reply["error"]["code"] == code, reply
    assert len(d.status()["models"]) == 1


SYSTEM_PYTHON = "/usr/bin/python3"  # readable by any user, unlike a venv under /root

PEER_PROBE = """
import os, socket, sys
if sys.argv[2] == "other":
    os.setgid(65534); os.setuid(65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(5)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("EACCES"); sys.exit()
try:
    s.sendall(b"\\xff" + bytes(8) + b"\\x7f\\x03")  # the start of a ZMTP 3 greeting
    data = s.recv(64)
except (BrokenPipeError, ConnectionResetError):
    print("CLOSED"); sys.exit()
except socket.timeout:
    print("TIMEOUT"); sys.exit()
print("GREETING" if data[:1] == b"\\xff" else "CLOSED")
"""


@pytest.mark.skipif(os.getuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
                    reason="making another user's process needs root and a system python")
def test_other_user_cannot_attach(daemon, runtime_dir, tiny_llama) -> None:
    d = daemon()
    sock = str(paths.socket_path(runtime_dir))

    def probe(who: str) -> str:
        return subprocess.run([SYSTEM_PYTHON, "-I", "-c", PEER_PROBE, sock, who], capture_output=True, text=True,
                              timeout=60, cwd="/").stdout.strip()

    assert probe("self") == "GREETING"  # control: the probe speaks enough ZMTP to get the daemon's greeting
    assert probe("other") == "EACCES"  # the 0700 runtime directory keeps other users out
    # Even with the directory and socket opened up by mistake, the daemon checks the peer's uid (SO_PEERCRED)
    # and hangs up on another user's connection before any message.
    os.chmod(runtime_dir, 0o755)
    os.chmod(sock, 0o777)
    try:
        assert probe("other") == "CLOSED"
    finally:
        os.chmod(runtime_dir, 0o700)
    assert d.status()["pid"] == d.proc.pid


def test_second_daemon_on_same_runtime_dir_refuses(shared_daemon) -> None:
    d = shared_daemon
    out = subprocess.run([sys.executable, "-m", "keepwarm.cli.main", "daemon", "run"], env=d.env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "already runs" in out.stderr
    assert d.status()["pid"] == d.proc.pid


def test_a_cpu_daemon_warms_up_beside_its_socket_loop(daemon, tiny_llama) -> None:
    """The packing probe and the native library are paid for at start, in a thread, and logged; status answers
    meanwhile, and a preload after it gives the same arena as always."""
    d = daemon()

    def warmed_up() -> bool:
        assert "warm-up failed" not in d.log(), d.log()[-2000:]
        return "warm-up: the packing probe, native kernels and hashes ready in" in d.log()

    wait_until(warmed_up, 60, message=lambda: d.log()[-2000:])
    with d.client() as c:
        assert c.preload(tiny_llama, "none", "auto").fingerprint


def test_warm_up_fills_the_caches_a_first_preload_would() -> None:
    code = ("from keepwarm.weights.loader import warm_up\n"
            "from keepwarm.kernels import cpu_native, cpu_packed\n"
            "before = (cpu_packed._probe.cache_info().currsize, cpu_native._load.cache_info().currsize)\n"
            "seconds = warm_up()\n"
            "after = (cpu_packed._probe.cache_info().currsize, cpu_native._load.cache_info().currsize)\n"
            "print(before, after, seconds > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=tempfile.gettempdir())
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "(0, 0) (1, 1) True"


def test_runtime_dir_must_be_private(tmp_path) -> None:
    rt = tmp_path / "open"
    rt.mkdir(mode=0o755)
    rt.chmod(0o755)
    env = {**os.environ, "KEEPWARM_RUNTIME_DIR": str(rt)}
    out = subprocess.run([sys.executable, "-m", "keepwarm.cli.main", "daemon", "run"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and "needs 0700" in out.stderr


def test_status_without_daemon_exits_nonzero(runtime_dir) -> None:
    env = {**os.environ, "KEEPWARM_RUNTIME_DIR": str(runtime_dir)}
    out = subprocess.run([sys.executable, "-m", "keepwarm.cli.main", "status", "--json"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and json.loads(out.stdout)["running"] is False


def test_llm_without_daemon_says_disk(runtime_dir, tiny_llama, caplog) -> None:
    import logging

    from keepwarm import LLM

    with caplog.at_level(logging.WARNING, logger="keepwarm.worker"):
        llm = LLM(model=tiny_llama, dtype="float32", daemon="auto", runtime_dir=str(runtime_dir))
    assert llm.weights_source == "disk"
    assert llm.llm_engine.loaded.fallback_reason.startswith("no keepwarm daemon answers")
    assert any("weights from disk, not the daemon" in r.message for r in caplog.records)


def test_bfloat16_packed_weights_are_viewed_in_the_arena(daemon, runtime_dir, tiny_model_factory,
                                                         monkeypatch) -> None:
    import torch

    from keepwarm import LLM, SamplingParams
    from keepwarm.kernels import cpu_packed

    if not cpu_packed.packing_available(torch.bfloat16):
        pytest.skip("bfloat16 weight packing unavailable here (mkldnn bf16 support or libtorch's C shim)")
    model = tiny_model_factory("llama3_tied")
    daemon()  # packing on (the default) in the daemon
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60))]
    llm = LLM(model=model, dtype="bfloat16", daemon=True, runtime_dir=str(runtime_dir), max_model_len=128)
    try:
        assert llm.weights_source == "daemon"
        flat = llm.llm_engine.loaded.attachment.storage.flat  # the worker's read-only mapping
        m = llm.llm_engine.loaded.model
        for w in (m.lm_head.weight, m.model.layers[0].self_attn.qkv_proj.weight):
            assert isinstance(w, cpu_packed.PackedWeight)
            addr = torch.ops.mkldnn.data_ptr(w.tensor)
            assert flat.data_ptr() <= addr and addr + w.nbytes <= flat.data_ptr() + flat.numel()  # no copy
        packed = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.close()
    monkeypatch.setenv(cpu_packed.ENV_VAR, "0")
    plain = LLM(model=model, dtype="bfloat16", daemon=False, max_model_len=128)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params)] == packed
