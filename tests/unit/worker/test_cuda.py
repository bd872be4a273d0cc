"""The GPU side: Triton kernels at real sizes, CUDA graphs for decode, CUDA IPC attach from the daemon.

Everything marked `gpu` is skipped without CUDA (conftest.py); `make gpu-check` runs these on a GPU machine. The
few unmarked tests check the CUDA-graph bookkeeping that needs no GPU.

Tolerances: kernels vs the torch reference on the same GPU inputs, as in tests/unit/kernels/test_triton_kernels.py
(matmuls relative to mag = max_mn sum_k |x_mk| |w_nk|: float32 1e-6, float16 2^-9, bfloat16 2^-7; bfloat16 attention vs
a float32 evaluation of the reference: 1.6e-2 relative plus 2^-8 of the largest output); greedy tokens exactly.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.daemon import WORKER_SCRIPT
from support.wait import wait_until

from keepwarm import kernels
from keepwarm.kernels import quant, reference
from keepwarm.worker.cuda_graphs import DEFAULT_BATCH_SIZES, CudaGraphRunner, graphs_supported

FP8 = torch.float8_e4m3fn
CUDA = torch.device("cuda")
MM_TOL = {torch.float32: 1e-6, torch.float16: 2.0**-9, torch.bfloat16: 2.0**-7}


@pytest.fixture(autouse=True)
def _default_backend() -> Iterator[None]:
    # A KEEPWARM_KERNELS left in the environment (or a test's set_backend) must not change what others exercise.
    previous = kernels.set_backend("auto")
    yield
    kernels.set_backend(previous)


# --------------------------------------------------------------------------- graph bookkeeping (no GPU needed)
def test_graphs_need_cuda_and_host_sync_free_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    assert graphs_supported(torch.device("cpu")) == "device cpu is not CUDA"
    kernels.set_backend("torch")
    reason = graphs_supported(CUDA)
    assert reason is not None and "torch backend" in reason


def test_graph_runner_padding_rules() -> None:
    model = SimpleNamespace(max_position=100)
    runner = CudaGraphRunner(model, None, 16, torch.device("cpu"), batch_sizes=(1, 2, 4, 8))
    assert runner.max_blocks == 7  # ceil(100 / 16): the longest context's blocks
    assert [runner.padded_size(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert runner.block_tables.shape == (8, 7) and runner.query_start_loc.tolist() == list(range(9))

    def meta(n: int, q_len: int = 1, width: int = 3) -> SimpleNamespace:
        return SimpleNamespace(max_query_len=q_len, seq_lens=torch.ones(n), block_tables=torch.zeros(n, width))

    assert runner.can_run(meta(3), 3)
    assert not runner.can_run(meta(3, q_len=4), 6)  # a prefill chunk: eager
    assert not runner.can_run(meta(9), 9)  # larger than the largest graph
    assert not runner.can_run(meta(2, width=8), 2)  # a table wider than the static one
    runner.disabled = "capture failed"
    assert not runner.can_run(meta(3), 3)
    assert DEFAULT_BATCH_SIZES[0] == 1 and list(DEFAULT_BATCH_SIZES) == sorted(DEFAULT_BATCH_SIZES)


def test_cpu_runner_has_no_graphs(tiny_llama: str) -> None:
    from keepwarm import LLM

    llm = LLM(model=tiny_llama, dtype="float32", max_model_len=64, num_gpu_blocks=8, daemon=False, device="cpu")
    assert llm.llm_engine.runner.cuda_graphs is None
    llm.close()


# --------------------------------------------------------------------------- kernels at real sizes
def _mm_close(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> None:
    mag = float((x.float().abs().reshape(-1, x.shape[-1]) @ w.float().abs().T).max())
    err = float((y.float() - ref.float()).abs().max())
    assert err <= MM_TOL[dtype] * mag, f"max error {err:.3g} > {MM_TOL[dtype]:.3g} * {mag:.3g}"


def _attention_batch(specs: list[tuple[int, int]], cache_dtype: torch.dtype, k_scale: float, v_scale: float,
                     hq: int = 32, hk: int = 8, d: int = 128, block_size: int = 16, seed: int = 0):
    """Llama-8B heads; K/V written with the reference; the rest of the pool is garbage."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = [math.ceil(n / block_size) for _, n in specs]
    num_blocks = sum(per_seq) + 16
    ids = torch.randperm(num_blocks, device="cuda", generator=g)
    tables = torch.full((len(specs), max(per_seq) + 2), 2**31 - 1, dtype=torch.int64, device="cuda")
    k_cache = torch.full((hk, num_blocks, block_size, d), 30.0, device="cuda").to(cache_dtype)
    v_cache = k_cache.clone()
    used = 0
    for s, (_, n) in enumerate(specs):
        own = ids[used:used + per_seq[s]]
        used += per_seq[s]
        tables[s, :len(own)] = own
        pos = torch.arange(n, device="cuda")
        kv = torch.randn(2, n, hk, d, device="cuda", generator=g, dtype=torch.bfloat16)
        reference.write_kv_cache(kv[0], kv[1], k_cache, v_cache, own[pos // block_size] * block_size
                                 + pos % block_size, k_scale, v_scale)
    q_lens = [q for q, _ in specs]
    query = torch.randn(sum(q_lens), hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([n for _, n in specs], dtype=torch.int32, device="cuda")
    return query, k_cache, v_cache, tables.to(torch.int32), seq_lens, qsl


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_paged_attention_real_sizes(cache_dtype: torch.dtype) -> None:
    from keepwarm.kernels import triton_attention as ta

    scales = (0.02, 0.015) if cache_dtype == FP8 else (1.0, 1.0)
    rng = torch.Generator().manual_seed(1)
    decodes = [(1, int(n)) for n in torch.randint(1, 4097, (48,), generator=rng)]
    for specs, mql in ((decodes, 1), ([(512, 2048), *decodes[:8], (300, 300), (17, 4000)], 512)):
        batch = _attention_batch(specs, cache_dtype, *scales)
        out = kernels.paged_attention(*batch, 128**-0.5, *scales, max_query_len=mql)
        assert kernels.select_backend("paged_attention", CUDA) == "triton"
        # The reference in float32 on the same cache contents: the oracle.
        oracle = reference.paged_attention(batch[0].float(), *batch[1:], 128**-0.5, *scales)
        bound = 1.6e-2 * oracle.abs() + 2.0**-8 * float(oracle.abs().max())
        assert bool(((out.float() - oracle).abs() <= bound).all()), float((out.float() - oracle).abs().max())
        for splits in (1, 4):  # split-KV on and off agree
            forced = ta.paged_attention(*batch, 128**-0.5, *scales, mql, num_splits=splits)
            torch.testing.assert_close(forced.float(), out.float(), atol=2.0**-7, rtol=1.6e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8, torch.float8_e5m2])
def test_write_kv_cache_real_sizes_is_bit_exact(cache_dtype: torch.dtype) -> None:
    key = torch.randn(4096, 8, 128, device="cuda", dtype=torch.bfloat16) * 4
    value = torch.randn(4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(2048 * 16, device="cuda")[:4096]
    slots[::7] = -1
    caches = [torch.zeros(8, 2048, 16, 128, device="cuda", dtype=cache_dtype) for _ in range(4)]
    kernels.write_kv_cache(key, value, caches[0], caches[1], slots, 0.05, 0.01)
    reference.write_kv_cache(key, value, caches[2], caches[3], slots, 0.05, 0.01)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_and_rotary_real_sizes(dtype: torch.dtype) -> None:
    x = torch.randn(512, 4096, device="cuda").to(dtype)
    res = torch.randn(512, 4096, device="cuda").to(dtype)
    w = torch.randn(4096, device="cuda").to(dtype)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 1e-5  # rsqrt and FMA contraction differ from torch's by an ulp
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), atol=ulp, rtol=ulp)
    out, summed = kernels.fused_add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_summed = reference.fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(out, ref_out, atol=ulp, rtol=ulp)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    cache = kernels.build_cos_sin_cache(128, 8192, inv_freq).cuda()
    qkv = torch.randn(512, 6144, device="cuda").to(dtype)
    q, k, _ = qkv.split([4096, 1024, 1024], dim=-1)
    pos = torch.randint(0, 8192, (512,), device="cuda")
    for neox in (True, False):
        got, ref = kernels.rotary_embedding(pos, q, k, 128, cache, neox), reference.rotary_embedding(pos, q, k, 128,
                                                                                                     cache, neox)
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, atol=ulp, rtol=ulp)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme", ["int8", "int4", "fp8"])
def test_quantized_linear_real_sizes(scheme: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    from keepwarm.formats.quant import quantize
    from keepwarm.kernels.quant import QuantizedWeight

    monkeypatch.setenv("KEEPWARM_FP8_MATMUL", "triton")  # the weight-only kernel here; W8A8 below
    w = torch.randn(14336, 4096, device="cuda") * 0.02
    qw = QuantizedWeight.from_parts(*quantize(w, scheme, dtype, "cuda"))
    dense = qw.dequantize(dtype)
    bias = torch.randn(14336, device="cuda").to(dtype)
    for rows in (1, 16, 512):
        x = torch.randn(rows, 4096, device="cuda").to(dtype)
        y = kernels.linear(x, qw, bias)
        assert kernels.select_backend(f"linear_{scheme}", CUDA) == "triton"
        _mm_close(y, quant.linear_reference(x, qw, bias), x, dense, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["int8", "int4", "fp8"])
def test_quantized_linear_split_k_real_sizes_and_deterministic(scheme: str) -> None:
    """Decode tiles with and without split-K at the 8B down projection (K = 14336) match the reference, and a
    CUDA graph replay gives the same bits as the eager call (the split-K reduction has a fixed order)."""
    from keepwarm.formats.quant import quantize
    from keepwarm.kernels import triton_quant as tq
    from keepwarm.kernels.quant import QuantizedWeight

    w = torch.randn(4096, 14336, device="cuda") * 0.02
    qw = QuantizedWeight.from_parts(*quantize(w, scheme, torch.bfloat16, "cuda"))
    dense = qw.dequantize(torch.bfloat16)
    kind = getattr(tq, f"KIND_{scheme.upper()}")
    for rows in (1, 16):
        x = torch.randn(rows, 14336, device="cuda").bfloat16()
        ref = quant.linear_reference(x, qw)
        for tile in (tq.Tile(16, 64, 128, 1), tq.Tile(16, 64, 128, 8), tq.Tile(16, 128, 64, 4, 4, 3)):
            y = tq.launch(x, qw, None, kind, tile)
            _mm_close(y, ref, x, dense, torch.bfloat16)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y_graph = tq.launch(x, qw, None, kind, tile)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y_graph, y)


@pytest.mark.gpu
def test_fp8_scaled_mm_path_on_hopper() -> None:
    from keepwarm.formats.quant import quantize
    from keepwarm.kernels import triton_quant as tq
    from keepwarm.kernels.quant import QuantizedWeight

    w = torch.randn(4096, 4096, device="cuda") * 0.02
    qw = QuantizedWeight.from_parts(*quantize(w, "fp8", torch.bfloat16, "cuda"))
    x = torch.randn(512, 4096, device="cuda").bfloat16()
    expected = "scaled_mm" if torch.cuda.get_device_capability()[0] == 9 else "triton"
    assert tq.fp8_path(x, qw) == expected
    y = tq.fp8_scaled_mm(x, qw)
    xf = x.float()
    s = (xf.abs().amax(1, keepdim=True) / 448).clamp(min=1e-12)
    oracle = ((xf / s).clamp(-448, 448).to(FP8).float() * s) @ qw.dequantize().t()
    _mm_close(y, oracle, x, qw.dequantize(), torch.bfloat16)


@pytest.mark.gpu
def test_lora_real_sizes() -> None:
    t, k, groups, slots, rank = 300, 4096, 3, 4, 16
    x = torch.randn(t, k, device="cuda").bfloat16()
    a = (torch.randn(groups * slots * rank, k, device="cuda") * 0.05).bfloat16()
    token_slots = torch.randint(-1, slots, (t,), device="cuda").sort().values  # runs of one slot each
    buf = kernels.lora_shrink(x, a, token_slots, rank, slots)
    ref = reference.lora_shrink(x, a, token_slots, rank, slots)
    _mm_close(buf, ref, x, a, torch.bfloat16)
    b = (torch.randn(4096, slots * rank, device="cuda") * 0.05).bfloat16()
    y = torch.randn(t, 6144, device="cuda").bfloat16()
    part = ref[:, :slots * rank]
    got = kernels.lora_expand(y.clone(), part, b, 1024)
    want = reference.lora_expand(y.clone(), part, b, 1024)
    torch.testing.assert_close(got, want, atol=2.0**-6, rtol=2.0**-7)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["none", "int8", "fp8", "int4"])
def test_fused_moe_real_sizes_and_graph_replay(scheme: str) -> None:
    """Mixtral-like experts at a tenth of the size (8 experts, hidden 1024, intermediate 1792, top-2 in bfloat16)
    for a decode batch, a mid batch and a prefill: the Triton kernel against the torch reference (products equal,
    summation order differs: one bfloat16 ulp of the intermediate, amplified by the down projection), and a CUDA
    graph replay equal to the eager call (the routing alignment is sync-free, so it captures)."""
    from keepwarm.formats.quant import quantize
    from keepwarm.kernels.quant import QuantizedWeight

    g = torch.Generator(device="cuda").manual_seed(0)
    dtype, e, h, i = torch.bfloat16, 8, 1024, 1792

    def weight(n: int, k: int):
        w = torch.randn(n, k, device="cuda", generator=g) * 0.02
        return w.to(dtype) if scheme == "none" else QuantizedWeight.from_parts(*quantize(w, scheme, dtype, "cuda"))

    experts = kernels.MoEWeights(tuple(weight(2 * i, h) for _ in range(e)), tuple(weight(h, i) for _ in range(e)))
    for t in (1, 16, 300):
        x = torch.randn(t, h, device="cuda", generator=g).to(dtype)
        probs = torch.softmax(torch.randn(t, e, device="cuda", generator=g), dim=-1)
        weights, ids = torch.topk(probs, 2, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
        assert kernels.select_backend("fused_moe", CUDA) == "triton"
        y = kernels.fused_moe(x, weights, ids, experts, "silu")
        ref = reference.fused_moe(x, weights, ids, experts, "silu", quant.linear_reference
                                  if scheme != "none" else torch.nn.functional.linear)
        err = float((y.float() - ref.float()).abs().max())
        assert err <= 2.0**-6 * float(ref.float().abs().max()), f"{t} tokens: max error {err:.3g}"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_graph = kernels.fused_moe(x, weights, ids, experts, "silu")
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_graph, y)


# --------------------------------------------------------------------------- whole model on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("quantization", ["none", "int8", "int4", "fp8"])
def test_triton_backend_greedy_equals_torch_backend(tiny_llama: str, quantization: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from keepwarm import LLM, SamplingParams

    prompts = [[5, 6, 7, 8, 9], list(range(20, 60)), [100, 200, 300]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "auto"):  # auto on CUDA: the triton kernels, and CUDA graphs for decodes
        kernels.set_backend(backend)
        llm = LLM(model=tiny_llama, dtype="float32", max_model_len=256, num_gpu_blocks=64, daemon=False,
                  device="cuda", quantization=quantization)
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        graphs = llm.llm_engine.runner.cuda_graphs
        assert (graphs is not None and graphs.replays > 0) == (backend == "auto")
        llm.close()
    assert tokens["auto"] == tokens["torch"]


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager(tiny_llama: str) -> None:
    from keepwarm.worker.model_loader import load_model
    from keepwarm.worker.model_runner import CacheConfig, ModelRunner, allocate_kv_cache

    loaded = load_model(Path(tiny_llama), "float32", "none", CUDA, 256, daemon=False)
    kv = allocate_kv_cache(loaded.config, CacheConfig(64, 16, torch.float32), CUDA)
    graphed = ModelRunner(loaded.model, kv, 16, lambda s: s.blocks, CUDA)
    eager = ModelRunner(loaded.model, kv, 16, lambda s: s.blocks, CUDA, enforce_eager=True)
    assert graphed.cuda_graphs is not None and eager.cuda_graphs is None
    g = torch.Generator().manual_seed(0)
    seqs = [SimpleNamespace(all_token_ids=torch.randint(0, 500, (n,), generator=g).tolist(), num_computed_tokens=0,
                            blocks=list(range(4 * i, 4 * i + 4))) for i, n in enumerate((5, 20, 33))]

    def batch(active, lens):
        return SimpleNamespace(seqs=active, num_new_tokens=lens)

    eager.execute(batch(seqs, [len(s.all_token_ids) for s in seqs]), [])  # prefill: eager on both
    for s in seqs:
        s.num_computed_tokens = len(s.all_token_ids)
    for step, active in enumerate((seqs, seqs, seqs[:2], seqs[:1])):  # 3 (pads to 4), 2, 1 sequences
        for s in active:
            s.all_token_ids.append(100 + step)
        rows = list(range(len(active)))
        want = eager.execute(batch(active, [1] * len(active)), rows)
        got = graphed.execute(batch(active, [1] * len(active)), rows)  # rewrites the same K/V, same values
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
        for s in active:
            s.num_computed_tokens += 1
    assert graphed.cuda_graphs.replays == 4 and sorted(graphed.cuda_graphs.graphs) == [1, 2, 4]


# --------------------------------------------------------------------------- CUDA IPC attach
@pytest.mark.gpu
@pytest.mark.slow
def test_cuda_ipc_attach_matches_disk_and_kill9_drops_lease(tiny_llama: str) -> None:
    from keepwarm.daemon.client import DaemonClient
    from keepwarm.formats import paths

    runtime_dir = Path(tempfile.mkdtemp(prefix="kwgpu-", dir="/tmp"))  # short: unix socket paths are limited
    env = {**os.environ, "KEEPWARM_RUNTIME_DIR": str(runtime_dir), "OMP_NUM_THREADS": "1"}
    log = open(runtime_dir / "daemon.log", "ab")  # noqa: SIM115 (closed in finally)
    daemon = subprocess.Popen([sys.executable, "-m", "keepwarm.cli.main", "daemon", "run", "--threads", "2",
                               "--device", "cuda"], env=env, stdout=log, stderr=log)
    workers: list[subprocess.Popen] = []

    def worker(mode: str) -> tuple[subprocess.Popen, dict]:
        p = subprocess.Popen([sys.executable, WORKER_SCRIPT, tiny_llama, "--daemon", mode, "--hold"], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        workers.append(p)
        line = p.stdout.readline()
        assert line, f"worker died: {p.stderr.read()[-3000:]}"
        return p, json.loads(line)

    def status() -> dict:
        with DaemonClient(runtime_dir, timeout=10) as c:
            return c.status()

    def answers() -> bool:
        c = DaemonClient(runtime_dir)
        try:
            return c.ping(timeout=0.5) is not None
        finally:
            c.close()

    try:
        wait_until(answers, 120, interval=0.1)
        assert status()["device"].startswith("cuda:GPU-")
        disk_proc, disk = worker("off")
        attached_proc, attached = worker("on")
        assert disk["source"] == "disk" and attached["source"] == "daemon"
        assert attached["fingerprint"] == disk["fingerprint"]
        assert attached["tokens"] == disk["tokens"]
        (model,) = status()["models"]
        assert model["device"].startswith("cuda:GPU-") and len(model["leases"]) == 1
        # A second attach of the same arena from another process sees the same weights.
        _, second = worker("on")
        assert second["tokens"] == disk["tokens"]
        wait_until(lambda: status()["leases"] == 2, 30, interval=0.1)
        attached_proc.send_signal(signal.SIGKILL)
        attached_proc.wait(timeout=30)
        wait_until(lambda: status()["leases"] == 1, 30, interval=0.1)  # its pid is gone: the lease is dropped
        assert status()["counters"]["leases_dropped"] == 1
    finally:
        for p in workers:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        daemon.terminate()
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.close()
        shutil.rmtree(paths.shm_dir(runtime_dir), ignore_errors=True)
        shutil.rmtree(runtime_dir, ignore_errors=True)
