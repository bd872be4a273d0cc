"""Shard arenas (weights/shards.py): one arena per (pipeline stage, tensor-parallel rank), built in one pass.

- Exactness, no processes: every weight of a (stage, rank)'s shard arena is, part for part and byte for byte, what
  that rank binds when it cuts its part from the whole arena (``stage_tensors`` then ``shard_weights``, the path
  whose tokens the TP / PP tests compare with one process): an int8 model with one KV head (replicated) and tied
  embeddings (as TP=2, and as TP=2 x PP=2, where the last stage's head is the embedding's rows), an int4 model,
  and a bf16 Qwen2 with biases whose linear weights and derived head are oneDNN-packed (TP=2, and PP=2). The
  shard's fingerprint derives from the whole model's, which it records.
- A real daemon: `keepwarm preload --tensor-parallel-size 2` writes two shards (`keepwarm status` shows them), a
  second preload is answered from them, a rank attaches its own shard, a size that does not divide the heads is
  refused in one line, a SIGKILLed daemon's successor re-adopts both shards, and `evict` by name drops both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.daemon import DaemonProc, new_runtime_dir, remove_runtime_dir

from keepwarm.daemon.client import DaemonError
from keepwarm.formats.arena import shard_fingerprint
from keepwarm.formats.layout import Layout
from keepwarm.kernels.cpu_packed import packing_available
from keepwarm.weights.checkpoint import Checkpoint
from keepwarm.weights.loader import build_arena, plan_arena, read_tensor, resolve_dtype
from keepwarm.weights.sharding import Shard, shard_weights, stage_of, stage_tensors
from keepwarm.weights.shards import as_parts, build_shards
from keepwarm.worker.attach import model_tensors

CASES = {  # (tiny model, quantization, dtype, tensor-parallel size, pipeline-parallel size)
    "llama_tied_kv1_int8_tp2": ("llama3_tied", "int8", "float32", 2, 1),
    "llama_tied_kv1_int8_tp2_pp2": ("llama3_tied", "int8", "float32", 2, 2),
    "llama_int4_tp2": ("llama", "int4-g32", "float32", 2, 1),
    "qwen2_bias_packed_bf16_tp2": ("qwen2", "none", "bfloat16", 2, 1),
    "qwen2_bias_packed_bf16_pp2": ("qwen2", "none", "bfloat16", 1, 2),
}


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()


@pytest.mark.parametrize("case", list(CASES))
def test_each_shard_arena_is_exactly_what_its_rank_cuts_from_the_whole_arena(tiny_model_factory, tmp_path,
                                                                             monkeypatch, case: str) -> None:
    import keepwarm.weights.shards as shards_module

    name, quantization, dtype, tp, pp = CASES[case]
    ckpt = Checkpoint(tiny_model_factory(name))
    _, total = plan_arena(ckpt, quantization, resolve_dtype(ckpt, dtype), "cpu")
    flat = torch.empty(total, dtype=torch.uint8)
    whole = build_arena(ckpt, quantization, dtype, flat, "cpu")
    read_whole = []  # the tensors read whole: only quantized ones (plain ones are read slice by slice)
    monkeypatch.setattr(shards_module, "read_tensor", lambda p: (read_whole.append(p), read_tensor(p))[1])
    shards = build_shards(ckpt, quantization, dtype, tp, pp, tmp_path, threads=2)
    assert all(p.quantized for p in read_whole), [p.name for p in read_whole if not p.quantized]
    assert len(read_whole) < len(plan_arena(ckpt, quantization, resolve_dtype(ckpt, dtype), "cpu")[0])
    if quantization == "none" and packing_available(torch.bfloat16):
        assert "mkldnn_packed" in {q["layout"] for q in whole.quant.values()}  # the packed path ran
    assert [m.layout for _, m in shards] == [Layout(r, tp, s, pp) for s in range(pp) for r in range(tp)]
    for storage, m in shards:
        assert m.source_fingerprint == whole.fingerprint
        assert m.fingerprint == shard_fingerprint(whole.fingerprint, m.layout) != whole.fingerprint
        assert storage.path.stat().st_size >= m.total_bytes and oct(storage.path.stat().st_mode & 0o777) == "0o600"
        expected = model_tensors(whole, flat)
        if pp > 1:  # as bind_model: the stage's weights, then the rank's cut of them
            expected = stage_tensors(expected, stage_of(ckpt.config, pp, m.pp_stage))
        if tp > 1:
            expected = shard_weights(expected, ckpt.config, Shard(m.tp_rank, tp))
        got = model_tensors(m, storage.flat)
        assert sorted(got) == sorted(expected)
        for weight, want in expected.items():
            assert type(got[weight]) is type(want), weight
            want_parts, want_meta = as_parts(want)
            got_parts, got_meta = as_parts(got[weight])
            assert got_meta == want_meta, weight
            assert {p: (t.dtype, tuple(t.shape), _bytes(t)) for p, t in got_parts.items()} == \
                {p: (t.dtype, tuple(t.shape), _bytes(t)) for p, t in want_parts.items()}, weight
        storage.close()


# -- a real daemon -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama3_tied", "qwen2"])
def test_slices_read_straight_from_the_file_are_the_cuts_of_the_whole_tensor(tiny_model_factory, name) -> None:
    """Every (stage, rank) destination of every plain tensor, read straight from the file (weights/slices.py: rows,
    cols and vocab cuts, KV heads replicated over ranks, the tied head a second holder of the embedding's rows),
    equals the plain cut of the whole tensor, zero padding included, and the parts' digests are the whole read's;
    cuts that leave bytes unread are refused (None), not hashed short."""
    from keepwarm.weights.loader import scratch
    from keepwarm.weights.sharding import plan_cut, shard_weight
    from keepwarm.weights.slices import read_slices

    ckpt = Checkpoint(tiny_model_factory(name))
    planned, _ = plan_arena(ckpt, "none", torch.float32, "cpu")
    shards = [Shard(r, 2) for r in range(2)]
    kinds = set()
    for p in planned:
        names = [p.name, "lm_head.weight"] if p.name == "model.embed_tokens.weight" else [p.name]
        dests = [(n, s) for n in names for s in shards]
        cuts = [plan_cut(n, ckpt.config, s) for n, s in dests]
        kinds |= {c[0] if c else None for c in cuts}
        slices, digests = read_slices(p.source, cuts, torch.empty(p.source.nbytes * 4, dtype=torch.uint8))
        staging, whole_digests = read_tensor(p)
        whole = staging.view(p.source.dtype).view(p.source.shape).clone()
        assert digests == whole_digests, p.name
        for (n, s), got in zip(dests, slices, strict=True):
            assert torch.equal(got, shard_weight(n, whole, ckpt.config, s)), (p.name, n, s)
        if any(cuts):
            assert read_slices(p.source, cuts[:1], scratch(p.source.nbytes * 2)) is None, p.name
    assert kinds == {"rows", "cols", "vocab", None}


@pytest.fixture
def daemon():
    d = DaemonProc(new_runtime_dir("kwsh-")).start()
    yield d
    d.stop()
    remove_runtime_dir(d.runtime_dir)


def _cli(d: DaemonProc, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "keepwarm.cli.main", *args], env=d.env, capture_output=True,
                          text=True, timeout=120)


def test_preload_for_two_ranks_keeps_two_shards_that_ranks_attach(daemon, tiny_model_factory) -> None:
    model = tiny_model_factory("llama3_tied")
    out = _cli(daemon, "preload", model, "-q", "int8", "--tensor-parallel-size", "2")
    assert out.returncode == 0, out.stderr
    assert "2 tensor-parallel shards (2 arenas) of" in out.stderr
    st = daemon.status()
    shards = sorted(st["models"], key=lambda m: m["tp_rank"])
    assert [(m["tp_rank"], m["tp_size"], m["quantization"], m["origin"]) for m in shards] == \
        [(0, 2, "int8", "preload"), (1, 2, "int8", "preload")]
    source = shards[0]["source_fingerprint"]
    assert shards[1]["source_fingerprint"] == source and len(source) == 64
    assert st["counters"]["preloads"] == 1  # one pass over the checkpoint, two arenas
    arena_dir = Path(st["arena_dir"])
    assert {p.name for p in arena_dir.glob("*.arena")} == {f"{m['fingerprint']}.arena" for m in shards}
    text = _cli(daemon, "status").stdout
    assert f"tensor-parallel shard 0/2 of {source[:16]}" in text and f"shard 1/2 of {source[:16]}" in text

    with daemon.client() as c:
        again = c.preload(model, "int8", tp_size=2)
        assert again.cached and [x["fingerprint"] for x in again.shards] == [m["fingerprint"] for m in shards]
        reply = c.attach(model, "int8", fingerprint=source, layout=Layout(1, 2), pid=os.getpid())
        m1 = json.loads(reply.manifest)
        assert (m1["tp_rank"], m1["tp_size"], m1["fingerprint"]) == (1, 2, shards[1]["fingerprint"])
        c.detach(reply.lease_id)
        with pytest.raises(DaemonError, match="tensor-parallel size 3 does not divide num_attention_heads") as e:
            c.preload(model, "int8", tp_size=3)
        assert e.value.code == "tensor_parallel" and "\n" not in e.value.message
        assert daemon.status()["counters"]["preloads"] == 1

    daemon.kill9()  # a successor re-adopts both shards (their bytes still hash to their manifests)
    daemon.start()
    adopted = sorted(daemon.status()["models"], key=lambda m: m["tp_rank"])
    assert [(m["fingerprint"], m["origin"]) for m in adopted] == [(m["fingerprint"], "adopted") for m in shards]
    out = _cli(daemon, "evict", Path(model).name)
    assert out.returncode == 0, out.stderr
    assert daemon.status()["models"] == [] and not list(arena_dir.glob("*.arena"))


def test_4bit_group_codes_shard_as_their_int8_twin(tiny_model_factory) -> None:
    """An int8_group_u4 weight (GGUF Q4_K's 4-bit codes) cut for each rank, by rows (qkv, gate_up) or by columns
    (o, down: the codes unpacked, cut, packed again), equals the cut of the same codes stored as int8."""
    from keepwarm.formats.quant import LAYOUT_INT8_GROUP_U4, QuantMeta, pack_u4_groups
    from keepwarm.kernels.quant import QuantizedWeight
    from keepwarm.weights.sharding import plan_cut, shard_weight

    ckpt = Checkpoint(tiny_model_factory("llama3_tied"))
    planned, _ = plan_arena(ckpt, "none", torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    kinds = set()
    for p in planned:
        if not p.name.endswith(("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")):
            continue
        n, k = p.source.shape
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
        s, z = (torch.randn(n, k // 32, generator=g) for _ in range(2))
        i8 = QuantizedWeight(QuantMeta("int8_group", "int8_group", 32, (n, k)), {"qweight": q, "scales": s, "zeros": z})
        u4 = QuantizedWeight(QuantMeta("int8_group", LAYOUT_INT8_GROUP_U4, 32, (n, k)),
                             {"qweight": pack_u4_groups(q), "scales": s, "zeros": z})
        for r in range(2):
            kinds.add(plan_cut(p.name, ckpt.config, Shard(r, 2))[0])
            a, b = (shard_weight(p.name, w, ckpt.config, Shard(r, 2)) for w in (u4, i8))
            assert a.meta.layout == LAYOUT_INT8_GROUP_U4 and a.meta.shape == b.meta.shape, p.name
            assert torch.equal(a.dequantize(), b.dequantize()), (p.name, r)
    assert kinds == {"rows", "cols"}
