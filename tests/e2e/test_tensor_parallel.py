"""Tensor parallelism (worker/parallel) on the CPU with gloo: real rank processes, greedy tokens equal to one process.

- Sharding rules, without processes: every layout's shard dequantizes to exactly the slice of the full weight;
  KV heads split or replicated; the vocabulary padded; a quantization group that would straddle a shard refused.
- Refusals (one line, before any process is started): an unsupported family, sizes that do not divide, more
  pipeline stages than layers.
- Pipeline parallelism, PP=2: greedy tokens equal to one process with prefix caching, chunked prefill and
  preemption on (micro-batches sent; a killed stage fails the engine, no hang), and from the daemon's int8 arena
  with tied embeddings (each stage binds views of the arena); TP=2 x PP=2 (four processes) equal too.
- LoRA: each rank's part of a pair gives its rows of the full delta (column-parallel) or a partial sum that adds up
  to it (row-parallel); TP=2, and PP=2, with two adapters and the base model in one batch give one process's greedy
  tokens.
- Greedy tokens with TP=2 equal to one process: tiny Llama with 2 KV heads (split) with prefix caching, chunked
  prefill and preemption on; tiny Llama with 1 KV head (replicated, tied embeddings) from the daemon's int8 shard
  arenas (one per rank, one preload, each rank's mapping of its shard without a private byte); tiny Qwen2 (q/k/v
  biases, tied embeddings).
- Two "nodes" on localhost: node 1 started on its own joins node 0's engine through MASTER_ADDR / MASTER_PORT.
- A real `keepwarm serve --tensor-parallel-size 2` on a daemon: it reports its ranks (each leasing its shard),
  answers, and exits non-zero when a rank is killed with SIGKILL (no hang: a generous bound, not a speed assert);
  the restarted server attaches the same shards (no second preload) and answers the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from support.daemon import DaemonProc, new_runtime_dir, remove_runtime_dir
from support.ports import free_port
from support.serve import ServeProcess
from support.wait import wait_until

from keepwarm import LLM, SamplingParams
from keepwarm.formats.model_config import load_model_config
from keepwarm.formats.quant import quantize
from keepwarm.formats.wire import ProtocolError
from keepwarm.kernels.cpu_packed import PackedWeight, pack, packing_available
from keepwarm.kernels.quant import QuantizedWeight
from keepwarm.weights.sharding import (
    Shard,
    TensorParallelError,
    plan_cut,
    shard_weight,
    vocab_block,
)
from keepwarm.worker.parallel import messages

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, 512) for _ in range(n)] for n in (3, 17, 33, 40, 55, 70)]
    prompts[3] = prompts[2][:32] + prompts[3][:8]  # two full blocks shared with prompt 2: a prefix-cache hit
    return prompts


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


def _children() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


def _live_ranks() -> list[psutil.Process]:
    """Rank processes still running under this one; a zombie (any exited child another test left unreaped) has
    exited and its command line cannot be read, so it is not one."""
    ranks = []
    for p in _children():
        try:
            if "rank_main" in " ".join(p.cmdline()):
                ranks.append(p)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
    return ranks


# -- sharding rules, no processes --------------------------------------------------------------------------------
def _dense(q: QuantizedWeight | PackedWeight) -> torch.Tensor:
    return q.dequantize(torch.float32)


@pytest.mark.parametrize("scheme,device_type", [("int8", "cpu"), ("fp8", "cpu"), ("int4-g32", "cpu"),
                                                ("int4-g32", "cuda")])
@pytest.mark.parametrize("kind", ["rows", "cols"])
def test_quantized_shards_are_exact_slices(scheme: str, device_type: str, kind: str) -> None:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    meta, parts = quantize(w, scheme, torch.float32, device_type)
    full = QuantizedWeight.from_parts(meta, parts)
    segs = [(0, 16), (32, 32)] if kind == "rows" else [(64, 64)]
    name = "model.layers.0.self_attn.qkv_proj.weight" if kind == "rows" else "model.layers.0.mlp.down_proj.weight"
    from keepwarm.weights import sharding

    part = sharding._cut_quantized(name, full, kind, segs)
    axis = 0 if kind == "rows" else 1
    expected = torch.cat([_dense(full).narrow(axis, s, n) for s, n in segs], dim=axis)
    assert part.meta.layout == meta.layout and torch.equal(_dense(part), expected)


def test_a_group_that_would_straddle_a_shard_is_refused_naming_the_shape() -> None:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    meta, parts = quantize(w, "int4", torch.float32, "cpu")  # groups of 128: all of K
    full = QuantizedWeight.from_parts(meta, parts)
    from keepwarm.weights import sharding

    with pytest.raises(TensorParallelError, match=r"down_proj.weight \[64, 128\].*groups of 128.*64 columns"):
        sharding._cut_quantized("model.layers.0.mlp.down_proj.weight", full, "cols", [(64, 64)])


@pytest.mark.skipif(not packing_available(torch.bfloat16), reason="oneDNN bf16 packing unavailable on this CPU")
def test_packed_weights_are_repacked_exactly() -> None:
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    raw, desc = pack(w)
    from keepwarm.formats.quant import LAYOUT_MKLDNN_PACKED, QuantMeta

    full = PackedWeight(QuantMeta("none", LAYOUT_MKLDNN_PACKED, None, (96, 64), desc.hex()), raw, torch.bfloat16)
    from keepwarm.weights import sharding

    part = sharding._cut_packed("model.layers.0.mlp.down_proj.weight", full, "cols", [(32, 32)])
    assert isinstance(part, PackedWeight) and torch.equal(part.dequantize(torch.bfloat16), w[:, 32:64])


def test_kv_heads_split_or_replicated_and_vocab_padded(tiny_model_factory) -> None:
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    split = load_model_config(tiny_model_factory("llama"))  # 4 heads, 2 KV heads of 32
    assert plan_cut(qkv, split, Shard(1, 2)) == ("rows", [(64, 64), (128 + 32, 32), (192 + 32, 32)])
    one = load_model_config(tiny_model_factory("llama3_tied"))  # 1 KV head: both ranks hold it
    for rank in (0, 1):
        assert plan_cut(qkv, one, Shard(rank, 2)) == ("rows", [(rank * 64, 64), (128, 32), (160, 32)])
    assert plan_cut("model.layers.1.self_attn.o_proj.weight", split, Shard(1, 2)) == ("cols", [(64, 64)])
    assert plan_cut("model.layers.1.self_attn.o_proj.bias", split, Shard(1, 2)) is None  # added after the reduce
    assert vocab_block(513, Shard(1, 2)) == (257, 257)
    emb = torch.arange(513 * 2, dtype=torch.float32).view(513, 2)
    last = shard_weight("model.embed_tokens.weight", emb, dataclasses.replace(split, vocab_size=513), Shard(1, 2))
    assert torch.equal(last[:256], emb[257:]) and not last[256:].any()  # one zero padding row
    with pytest.raises(TensorParallelError, match="no sharding rule for weight 'model.layers.0.extra.weight'"):
        plan_cut("model.layers.0.extra.weight", split, Shard(0, 2))


def test_step_message_round_trips_and_bad_fields_are_named() -> None:
    step = messages.Step(torch.arange(5), torch.arange(5), torch.arange(5), torch.zeros(2, 3, dtype=torch.int32),
                         torch.tensor([3, 2], dtype=torch.int32), torch.tensor([0, 3, 5], dtype=torch.int32), 3,
                         torch.tensor([2, 4]), torch.tensor([1, -1]))
    back = messages.decode(messages.encode(step))
    assert isinstance(back, messages.Step) and back.max_query_len == 3
    assert torch.equal(back.block_tables, step.block_tables) and torch.equal(back.token_rows, step.token_rows)
    assert torch.equal(back.lora_slots, step.lora_slots)
    import msgpack

    with pytest.raises(ProtocolError, match="'block_size'"):
        messages.decode(msgpack.packb({"v": messages.VERSION, "kind": "cache", "num_blocks": 4, "block_size": "16",
                                       "kv_dtype": "float32"}))
    # A LoRA slot's weights round-trip bit for bit (bf16 too); bytes that do not make the shape are named.
    pair = (torch.randn(4, 8).to(torch.bfloat16), torch.randn(6, 4))
    sent = messages.LoRASlot(2, "ad", "sha", 4, 0.5, messages.lora_weights({(1, "q_proj"): pair}))
    got = messages.decode(messages.encode(sent))
    assert isinstance(got, messages.LoRASlot) and got.slot == 2 and got.scaling == 0.5
    (a, b), = messages.lora_tensors(got.weights).values()
    assert a.dtype == torch.bfloat16 and torch.equal(a, pair[0]) and torch.equal(b, pair[1])
    bad = [[1, "q_proj", "float32", [4, 9], bytes(128), "float32", [6, 4], bytes(96)]]
    with pytest.raises(ProtocolError, match=r"q_proj of layer 1\): bytes do not make shape \[4, 9\]"):
        messages.lora_tensors(bad)


@pytest.mark.parametrize("model", ["llama", "llama3_tied"])
def test_lora_shards_give_the_full_delta(tiny_model_factory, model: str) -> None:
    """Column-parallel: each rank's LoRA output is its rows of the full one (replicated KV heads: all of them);
    row-parallel: the ranks' partial outputs sum to the full one."""
    from keepwarm.weights.sharding import shard_lora
    from keepwarm.worker.lora import module_dims

    mc = load_model_config(tiny_model_factory(model))
    g = torch.Generator().manual_seed(0)
    i = mc.intermediate_size
    kv_rows = mc.kv_size // 2 if mc.num_key_value_heads >= 2 else mc.kv_size
    for module in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        fan_in, fan_out = module_dims(mc, module)
        a, b, x = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((4, fan_in), (fan_out, 4), (3, fan_in)))
        full = x @ a.T @ b.T
        parts = [shard_lora(module, a, b, mc, Shard(r, 2)) for r in (0, 1)]
        if module in ("o_proj", "down_proj"):
            width = fan_in // 2
            assert all(pa.shape == (4, width) and pb is b for pa, pb in parts)
            total = sum(x[:, r * width:(r + 1) * width] @ pa.T @ pb.T for r, (pa, pb) in enumerate(parts))
            torch.testing.assert_close(total, full)
            continue
        rows = {"q_proj": mc.q_size // 2, "gate_proj": i // 2, "up_proj": i // 2}.get(module, kv_rows)
        for r, (pa, pb) in enumerate(parts):
            replicated = module in ("k_proj", "v_proj") and mc.num_key_value_heads < 2
            start = 0 if replicated else r * rows
            assert pa is a and pb.shape == (rows, 4)
            torch.testing.assert_close(x @ pa.T @ pb.T, full[:, start:start + rows], msg=f"{module} rank {r}")


# -- refusals: one line, before any process is started ------------------------------------------------------------
@pytest.mark.parametrize("model,kwargs,match", [
    ("gemma2", {}, "supports the Llama family .* Gemma2ForCausalLM is not supported"),
    ("llama", {"tensor_parallel_size": 3}, "size 3 does not divide num_attention_heads \\(4\\)"),
    ("llama", {"tensor_parallel_size": 1, "pipeline_parallel_size": 3},
     "pipeline-parallel size 3 is more than the model's 2 layers"),
    ("gemma2", {"tensor_parallel_size": 1, "pipeline_parallel_size": 2},
     "pipeline parallelism supports the Llama family .* Gemma2ForCausalLM"),
])
def test_refusals_name_the_cause_before_starting_ranks(tiny_model_factory, model, kwargs, match) -> None:
    before = {p.pid for p in _children()}
    with pytest.raises(TensorParallelError, match=match):
        LLM(model=tiny_model_factory(model), dtype="float32", daemon=False,
            **{"tensor_parallel_size": 2, **kwargs})
    assert {p.pid for p in _children()} <= before


# -- greedy tokens equal to one process -------------------------------------------------------------------------
TP_CASES = {
    # 2 KV heads split; prefix caching, chunked prefill (24-token budget) and preemption (12 blocks) on.
    "llama_split_kv": ("llama", dict(max_num_batched_tokens=24, num_gpu_blocks=12, max_model_len=160)),
    # 1 KV head replicated on both ranks, tied embeddings, each rank attached to its own shard of the daemon's int8
    # arena (per-channel scales; the daemon cut both in one pass); the one-process reference loads from disk.
    "llama_replicated_kv_int8_daemon": ("llama3_tied", dict(quantization="int8")),
    # q/k/v biases (column side: sliced), tied embeddings.
    "qwen2_bias_tied": ("qwen2", {}),
}


@contextlib.contextmanager
def _daemon_if(wanted: bool, common: dict):
    """A daemon of its own for the case (``common`` then attaches to it), or nothing."""
    if not wanted:
        yield None
        return
    daemon = DaemonProc(new_runtime_dir("kwtp-")).start()
    common.update(daemon=True, runtime_dir=str(daemon.runtime_dir))
    try:
        yield daemon
    finally:
        daemon.stop()
        remove_runtime_dir(daemon.runtime_dir)


def _reference(factory, name: str, kwargs: dict) -> tuple[str, list[list[int]], dict, list[list[int]]]:
    """(model dir, prompts, the engine settings both runs share, one process's greedy tokens)."""
    model = factory(name)
    prompts = _prompts()
    common = dict(dtype="float32", daemon=False, **kwargs)
    single = LLM(model=model, **common)
    expected = _tokens(single, prompts)
    single.close()
    return model, prompts, common, expected


@pytest.mark.parametrize("case", list(TP_CASES))
def test_tp2_greedy_tokens_equal_one_process(tiny_model_factory, tmp_path_factory, case: str) -> None:
    model, prompts, common, expected = _reference(tiny_model_factory, *TP_CASES[case])
    with _daemon_if(case.endswith("_daemon"), common) as daemon:
        _check_tp2(LLM(model=model, tensor_parallel_size=2, **common), case, prompts, expected, daemon)
    assert not _live_ranks()  # ranks exited on close


def _check_tp2(llm: LLM, case: str, prompts: list[list[int]], expected: list[list[int]], daemon) -> None:
    try:
        engine = llm.llm_engine
        assert engine.effective_config()["tensor_parallel_size"] == 2 and len(_children()) >= 1
        assert _tokens(llm, prompts) == expected
        if daemon is not None:
            _check_shards_attached(llm, daemon)
        if case == "llama_split_kv":
            assert engine.scheduler.num_preemptions > 0
            hits = engine.block_manager.prefix_cache_hits
            assert _tokens(llm, prompts[2:4]) == expected[2:4] and engine.block_manager.prefix_cache_hits > hits
            assert engine.tp is not None and engine.tp.stats.all_reduce_calls > 0
            _kill_a_rank_mid_request(llm)
        if case == "llama_replicated_kv_int8_daemon":
            assert engine.effective_config()["quantization"] == "int8"
    finally:
        llm.close()


def _check_shards_attached(llm: LLM, daemon) -> None:
    """Each rank holds a lease on its own shard arena, built in one preload, and maps it shared: zero private bytes
    (no private copy of the weights); rank 0's bound weights are views of its shard."""
    st = daemon.status()
    shards = sorted(st["models"], key=lambda m: m["tp_rank"])
    pids = llm.llm_engine.effective_config()["tensor_parallel_pids"]
    assert llm.weights_source == "daemon" and st["counters"]["preloads"] == 1
    assert [(m["tp_rank"], m["tp_size"], m["quantization"]) for m in shards] == [(0, 2, "int8"), (1, 2, "int8")]
    assert [[x["pid"] for x in m["leases"]] for m in shards] == [[pids[0]], [pids[1]]]
    assert llm.llm_engine.loaded.fingerprint == shards[0]["source_fingerprint"] == shards[1]["source_fingerprint"]
    for pid, m in zip(pids, shards, strict=True):
        path = str(Path(st["arena_dir"]) / f"{m['fingerprint']}.arena")
        (mapping,) = [x for x in psutil.Process(pid).memory_maps(grouped=True) if x.path == path]
        assert mapping.private_clean + mapping.private_dirty == 0 and mapping.rss > 0, (pid, mapping)
    engine = llm.llm_engine
    arena = engine.loaded.attachment
    qkv = engine.loaded.model.model.layers[0].self_attn.qkv_proj.weight
    assert arena is not None and arena.tensors["model.layers.0.self_attn.qkv_proj.weight"] is qkv


_BUSY = dict(max_num_batched_tokens=24, num_gpu_blocks=12, max_model_len=160)
PP_CASES = {  # (tiny model, engine settings, tensor-parallel size per stage)
    # Two stages of one layer each; prefix caching, chunked prefill (24-token budget) and preemption (12 blocks) on.
    "llama_pp2": ("llama", _BUSY, 1),
    # Tied embeddings (the last stage's head is the embedding's rows) from the daemon's int8 arenas, one per stage
    # (one preload): each stage binds views into its own (no copy).
    "llama_tied_int8_daemon_pp2": ("llama3_tied", dict(quantization="int8"), 1),
    # TP=2 x PP=2, four processes: each stage all-reduces and gathers its logits within its own group.
    "llama_tp2_pp2": ("llama", _BUSY, 2),
}


@pytest.mark.parametrize("case", list(PP_CASES))
def test_pp2_greedy_tokens_equal_one_process(tiny_model_factory, case: str) -> None:
    name, kwargs, tp_size = PP_CASES[case]
    model, prompts, common, expected = _reference(tiny_model_factory, name, kwargs)
    with _daemon_if("_daemon" in case, common) as daemon:
        llm = LLM(model=model, pipeline_parallel_size=2, tensor_parallel_size=tp_size, **common)
        try:
            engine = llm.llm_engine
            cfg = engine.effective_config()
            assert (cfg["pipeline_parallel_size"], cfg["tensor_parallel_size"]) == (2, tp_size)
            assert len(cfg["tensor_parallel_pids"]) == 2 * tp_size
            assert engine.runner.stage is not None and engine.runner.stage.layers == range(0, 1)
            assert _tokens(llm, prompts) == expected
            assert engine.tp is not None and engine.tp.stats.steps > engine.stats.steps  # micro-batches were sent
            if daemon is not None:  # each stage attached its own arena (a lease each); this one's layer is a view
                st = daemon.status()
                stages = sorted(st["models"], key=lambda m: m["pp_stage"])
                assert [(m["pp_stage"], m["pp_size"], m["tp_size"]) for m in stages] == [(0, 2, 1), (1, 2, 1)]
                assert [[x["pid"] for x in m["leases"]] for m in stages] == [[p] for p in cfg["tensor_parallel_pids"]]
                assert st["counters"]["preloads"] == 1
                arena = engine.loaded.attachment
                qkv = engine.loaded.model.model.layers[0].self_attn.qkv_proj.weight
                assert arena is not None and arena.tensors["model.layers.0.self_attn.qkv_proj.weight"] is qkv
            else:
                assert engine.scheduler.num_preemptions > 0
                hits = engine.block_manager.prefix_cache_hits
                assert _tokens(llm, prompts[2:4]) == expected[2:4] and engine.block_manager.prefix_cache_hits > hits
                if tp_size == 1:
                    _kill_a_rank_mid_request(llm)
        finally:
            llm.close()
    assert not _live_ranks()


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2"])
def test_two_lora_adapters_in_one_batch_equal_one_process(tiny_llama, lora_adapters, parallel: dict) -> None:
    """Two adapters (one on q/v; one on every projection, o_proj and down_proj row-parallel under TP) and the base
    model in one batch; then a third adapter, which rewrites a slot (rank 1 is told, and rewrites its part too;
    under PP each stage holds its own layers' part)."""
    from keepwarm.worker.lora import LoRARequest

    prompts = _prompts()
    requests = [None, LoRARequest("ad_qv", 1, lora_adapters["ad_qv"]),
                LoRARequest("ad_all", 2, lora_adapters["ad_all"])]
    loras = [requests[k % 3] for k in range(len(prompts))]
    third = LoRARequest("ad_mlp", 3, lora_adapters["ad_mlp"])
    common = dict(dtype="float32", daemon=False, enable_lora=True, max_loras=2, max_lora_rank=16, max_model_len=160)

    def run(llm: LLM) -> tuple[list[list[int]], ...]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=loras)
        again = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], GREEDY, lora_request=third)
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].token_ids for o in again]

    single = LLM(model=tiny_llama, **common)
    expected = run(single)
    base = _tokens(single, prompts)
    single.close()
    assert [e != b for e, b in zip(expected[0], base, strict=True)] == [lo is not None for lo in loras]
    assert expected[1] != base[:2]
    llm = LLM(model=tiny_llama, **parallel, **common)
    try:
        assert run(llm) == expected
        manager = llm.llm_engine.lora_manager
        assert manager is not None and manager.slot_refs == [0, 0]
        if "pipeline_parallel_size" in parallel:  # stage 0 holds layer 0's buffers only
            assert manager.shard is None and [bool(layer) for layer in manager.layers] == [True, False]
        else:
            assert manager.shard == Shard(0, 2)
        assert "ad_mlp" in [a.name for a in manager.slot_adapter if a is not None]  # a slot was rewritten
    finally:
        llm.close()


def test_two_nodes_on_localhost_give_one_process_tokens(tiny_llama) -> None:
    """Node 1 started on its own (`keepwarm serve --nnodes 2 --node-rank 1`, MASTER_ADDR from the environment as
    torchrun sets it, the port as --master-port) joins node 0's engine: the same greedy tokens as one process;
    node 1 exits 0 after node 0 closes. A split that is not even is refused in one line, nothing started."""
    import sys

    prompts = _prompts()[:3]
    common = dict(dtype="float32", daemon=False)
    single = LLM(model=tiny_llama, **common)
    expected = _tokens(single, prompts)
    single.close()
    port = free_port()
    node1 = subprocess.Popen([sys.executable, "-m", "keepwarm.cli.main", "serve", tiny_llama, "-tp", "2",
                              "--nnodes", "2", "--node-rank", "1", "--master-port", str(port), "--no-daemon"],
                             env={**os.environ, "MASTER_ADDR": "127.0.0.1"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        llm = LLM(model=tiny_llama, tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=port,
                  **common)
        try:
            engine = llm.llm_engine
            assert engine.tp is not None and engine.tp.children == []  # rank 1 is node 1's, not a child here
            assert _tokens(llm, prompts) == expected
        finally:
            llm.close()
        out, _ = node1.communicate(timeout=60)
        assert node1.returncode == 0, out
        assert "node 1 of 2, ranks 1-1" in out
    finally:
        if node1.poll() is None:
            node1.kill()
    uneven = subprocess.run([sys.executable, "-m", "keepwarm.cli.main", "serve", tiny_llama, "-tp", "2",
                             "--nnodes", "3", "--node-rank", "1", "--master-port", "1"],
                            capture_output=True, text=True, timeout=60)
    assert uneven.returncode == 2 and uneven.stderr.strip() == \
        "error: --nnodes 3 does not divide the 2 ranks (tensor-parallel size)"


def _kill_a_rank_mid_request(llm: LLM) -> None:
    """SIGKILL rank 1 while a long request runs: the step fails with EngineDeadError (no hang)."""
    from keepwarm.worker.engine import EngineDeadError

    engine = llm.llm_engine
    steps = engine.stats.steps
    pid = engine.effective_config()["tensor_parallel_pids"][1]

    def kill_when_running() -> None:
        wait_until(lambda: engine.stats.steps >= steps + 3, 120, interval=0.01)
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_running, daemon=True)
    killer.start()
    with pytest.raises(EngineDeadError, match="forward pass failed|rank 1"):
        llm.generate([[5, 6, 7]] * 2, SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True))
    killer.join(timeout=5)


# -- a real server: reports its ranks, dies with one, restarts warm --------------------------------------------------
@pytest.mark.slow
def test_serve_tp_dies_with_a_killed_rank_and_restarts_warm(tiny_llama) -> None:
    """`keepwarm serve -tp 2` on a daemon: each rank attaches its shard; SIGKILL of rank 1 takes the server down
    (non-zero, bounded); a restart attaches both shards again without a preload."""

    single = LLM(model=tiny_llama, dtype="float32", daemon=False)
    expected = single.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=8))[0]
    single.close()
    common: dict = {}
    with _daemon_if(True, common) as daemon:
        env = {"OMP_NUM_THREADS": "2", "KEEPWARM_RUNTIME_DIR": common["runtime_dir"]}
        args = (tiny_llama, "--dtype", "float32", "--tensor-parallel-size", "2")
        server = ServeProcess(*args, env=env)
        try:
            pids = _serve_tp_answers(server, tiny_llama, expected.outputs[0].text)
            shards = daemon.status()["models"]
            assert sorted((m["tp_rank"], m["tp_size"]) for m in shards) == [(0, 2), (1, 2)]
            assert sorted(x["pid"] for m in shards for x in m["leases"]) == sorted(pids)
            os.kill(pids[1], signal.SIGKILL)
            t0 = time.monotonic()
            try:
                code = server.proc.wait(timeout=120)  # generous: a bound on the hang, not a speed figure
            except subprocess.TimeoutExpired:
                pytest.fail(f"the server still runs {time.monotonic() - t0:.0f}s after a rank was killed")
            assert code != 0
            assert "rank 1" in server.output() and "exited" in server.output()
        finally:
            server.stop(signal.SIGKILL)
        restarted = ServeProcess(*args, env=env)
        try:
            pids = _serve_tp_answers(restarted, tiny_llama, expected.outputs[0].text)
            st = daemon.status()
            assert st["counters"]["preloads"] == 1  # warm: the same two shards, no second preload
            assert sorted(m["fingerprint"] for m in st["models"]) == sorted(m["fingerprint"] for m in shards)
            held = {x["pid"] for m in st["models"] for x in m["leases"]}
            assert set(pids) <= held
        finally:
            restarted.stop()


def _serve_tp_answers(server: ServeProcess, model: str, expected: str) -> list[int]:
    """The server's rank pids, after checking it reports two ranks on the daemon and answers ``expected``."""
    from openai import OpenAI

    engine = httpx.get(server.base + "/keepwarm/config").json()["engine"]
    assert engine["tensor_parallel_size"] == 2
    pids = engine["tensor_parallel_pids"]
    assert pids[0] == server.proc.pid and psutil.pid_exists(pids[1])
    client = OpenAI(base_url=server.base + "/v1", api_key="none")
    out = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=8, temperature=0)
    assert out.choices[0].text == expected
    return pids


# -- CUDA: NCCL between two GPUs (the CPU twin is test_tp2_greedy_tokens_equal_one_process) ------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tp2_on_two_gpus_matches_one_gpu(tiny_model_factory) -> None:
    model = tiny_model_factory("qwen2")
    common = dict(dtype="float32", daemon=False, device="cuda")
    single = LLM(model=model, **common)
    expected = _tokens(single, _prompts())
    single.close()
    llm = LLM(model=model, tensor_parallel_size=2, **common)
    try:
        assert llm.llm_engine.tp is not None and llm.llm_engine.tp.backend == "nccl"
        assert _tokens(llm, _prompts()) == expected
    finally:
        llm.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_pp2_on_two_gpus_matches_one_gpu(tiny_model_factory) -> None:
    """The CPU twin is test_pp2_greedy_tokens_equal_one_process."""
    model, prompts, common, expected = _reference(tiny_model_factory, "qwen2", dict(device="cuda"))
    llm = LLM(model=model, pipeline_parallel_size=2, **common)
    try:
        assert llm.llm_engine.tp is not None and llm.llm_engine.tp.backend == "nccl"
        assert _tokens(llm, prompts) == expected
    finally:
        llm.close()
