"""Compile the Triton kernels for an NVIDIA target on a machine without a GPU, and report their resources.

    python tests/support/triton_compile_check.py [--arch 90] [--quick] [--json OUT]

Catches what Triton's interpreter cannot: code-generation errors (a loop-carried constexpr, a tl.dot under 16),
shared memory over the SM's limit, register spills. It calls the real wrappers of kernels/triton_*.py on CPU
tensors of realistic shapes, with a stand-in driver that reports the target, and with every launch turned into a
compile-only warm-up; Triton's bundled ptxas and cuobjdump give the cubin and its register use. Nothing runs, so
it says nothing about speed or numerics. `--quick` compiles one configuration per kernel and path (what the test
suite runs); without it, every dtype and tile configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: this compiles the kernels")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

# Largest shared memory per block: sm_80 (A100) 163 KB, sm_90 (H100/H200) 227 KB.
SMEM_LIMIT = {80: 166912, 90: 232448}


class _TargetOnlyDriver:
    """What JITFunction.run asks the driver for before compiling; launches never happen."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def _compile_all(quick: bool) -> list[tuple[str, object, dict]]:
    from keepwarm.formats.quant import quantize
    from keepwarm.kernels import triton_attention as ta
    from keepwarm.kernels import triton_lora as tlora
    from keepwarm.kernels import triton_moe as tmoe
    from keepwarm.kernels import triton_norm as tn
    from keepwarm.kernels import triton_quant as tq
    from keepwarm.kernels.quant import QuantizedWeight

    compiled: list[tuple[str, object, dict]] = []
    original = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel, {k: v for k, v in kwargs.items() if k.isupper()}))
        return kernel

    JITFunction.run = compile_only
    # CPU tensors stand in for device ones: give the split-KV heuristic an H100's SM count.
    ta.tc.sm_count = lambda device: 132
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    dtypes = (bf16,) if quick else (bf16, fp16, fp32)

    def attention(hq, hk, d, bs, dtype, cache_dtype, max_query_len, tokens, seqs, width, **window_softcap):
        q = torch.empty(tokens, hq, d, dtype=dtype)
        cache = torch.empty(hk, 64, bs, d, dtype=cache_dtype)
        ta.paged_attention(q, cache, cache, torch.zeros(seqs, width, dtype=torch.int32),
                           torch.ones(seqs, dtype=torch.int32), torch.arange(seqs + 1, dtype=torch.int32), 0.1,
                           1.0, 1.0, max_query_len, **window_softcap)

    for dtype in dtypes:  # Llama-8B heads: decode (split-KV: 64 programs < 2 per SM), then a mixed batch
        attention(32, 8, 128, 16, dtype, dtype, 1, 32, 32, 256)
        attention(32, 8, 128, 16, dtype, dtype, None, 600, 8, 256)
    attention(32, 8, 128, 32, bf16, torch.float8_e4m3fn, 100, 600, 8, 128)
    # Gemma 2's local layers: a sliding window with soft-capped scores (head_dim 256), mixed and decode.
    attention(16, 8, 256, 16, bf16, bf16, None, 600, 8, 256, sliding_window=4096, logit_softcap=50.0)
    attention(16, 8, 256, 16, bf16, bf16, 1, 32, 32, 256, sliding_window=4096, logit_softcap=50.0)
    if quick:
        attention(32, 8, 128, 16, fp32, fp32, None, 600, 8, 256)  # float32: the FMA dot, smaller tiles
    else:
        attention(32, 8, 128, 32, bf16, torch.float8_e4m3fn, 1, 4, 4, 128)
        attention(28, 4, 128, 16, bf16, bf16, 1, 1, 1, 2048)  # group of 7, one sequence
        attention(16, 16, 256, 16, bf16, bf16, 50, 100, 2, 64)  # head_dim 256, MHA
    for cache_dtype in (bf16, torch.float8_e4m3fn) + (() if quick else (torch.float8_e5m2,)):
        k = torch.empty(64, 8, 128, dtype=bf16)
        cache = torch.empty(8, 64, 16, 128, dtype=cache_dtype)
        ta.write_kv_cache(k, k, cache, cache, torch.zeros(64, dtype=torch.int64), 0.5, 0.5)
    for dtype in dtypes:
        x = torch.empty(64, 4096, dtype=dtype)
        tn.fused_add_rms_norm(x, x, torch.empty(4096, dtype=dtype), 1e-5)
        if not quick:
            tn.rms_norm(x, torch.empty(4096, dtype=dtype), 1e-5)
        q, k, _ = torch.empty(64, 6144, dtype=dtype).split([4096, 1024, 1024], -1)
        tn.rotary_embedding(torch.zeros(64, dtype=torch.int64), q, k, 128, torch.empty(4096, 128), True)
        if not quick:
            tn.rotary_embedding(torch.zeros(64, dtype=torch.int64), q, k, 128, torch.empty(4096, 64), False)
    cases = ([("int4", bf16, 1), ("int8", bf16, 512), ("fp8", fp16, 48), ("int8", fp32, 48)] if quick else
             [(s, d, m) for s in ("int8", "fp8", "int4") for d in (bf16, fp16, fp32) for m in (1, 48, 512)])
    for scheme, dtype, rows in cases:
        qw = QuantizedWeight.from_parts(*quantize(torch.randn(256, 512), scheme, dtype, "cuda"))
        getattr(tq, f"linear_{scheme}")(torch.empty(rows, 512, dtype=dtype), qw, torch.empty(256, dtype=dtype))
    for scheme in ("int8", "fp8", "int4"):  # decode tiles as the tile table holds them: GEMV and split-K
        qw = QuantizedWeight.from_parts(*quantize(torch.randn(256, 2048), scheme, bf16, "cuda"))
        kind = getattr(tq, f"KIND_{scheme.upper()}")
        bks = (64, 128) if scheme == "int4" else (128, 256)
        for tile in [tq.Tile(1, bn, bk, 2, 4, 4) for bn in (32, 64) for bk in bks] + [tq.Tile(16, 64, bks[1], 4)]:
            tq.launch(torch.empty(1, 2048, dtype=bf16), qw, None, kind, tile)
            if quick:
                break
    for dtype in dtypes:
        buf = tlora.lora_shrink(torch.empty(40, 4096, dtype=dtype), torch.empty(3 * 4 * 16, 4096, dtype=dtype),
                                torch.zeros(40, dtype=torch.int64), 16, 4)
        tlora.lora_expand(torch.empty(40, 6144, dtype=dtype), buf[:, :64], torch.empty(4096, 64, dtype=dtype), 0)
    # Fused MoE at Mixtral-8x7B's expert shapes over 8 experts, top-2: gate_up (two accumulators) and down launches.
    moe = ([("none", bf16, 1), ("int8", bf16, 300), ("int4", fp16, 1), ("none", fp32, 300), ("fp8", fp16, 16)]
           if quick else [(s, d, t) for s in ("none", "int8", "fp8", "int4") for d in dtypes for t in (1, 16, 300)])
    for scheme, dtype, tokens in moe:
        def weight(n: int, k: int, scheme: str = scheme, dtype: torch.dtype = dtype):
            if scheme == "none":
                return torch.empty(n, k, dtype=dtype)
            return QuantizedWeight.from_parts(*quantize(torch.randn(n, k), scheme, dtype, "cuda"))

        gate_up, down = weight(2 * 14336, 4096), weight(4096, 14336)
        experts = tmoe.MoEWeights((gate_up,) * 8, (down,) * 8)  # one expert's tensors 8 times: compiling only
        ids = torch.arange(2 * tokens).reshape(tokens, 2) % 8
        tmoe.fused_moe(torch.empty(tokens, 4096, dtype=dtype), torch.empty(tokens, 2, dtype=dtype), ids, experts,
                       "silu")
    JITFunction.run = original
    return compiled


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90, choices=sorted(SMEM_LIMIT))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    driver.set_active(_TargetOnlyDriver(a.arch))
    t0 = time.perf_counter()
    compiled = _compile_all(a.quick)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    rows = []
    for name, kernel, constexprs in compiled:
        with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                   check=True).stdout
        regs = max(int(r) for r in re.findall(r"REG:(\d+)", usage))
        stack = max(int(s) for s in re.findall(r"STACK:(\d+)", usage))
        md = kernel.metadata
        config = {k: str(v).removeprefix("triton.language.") for k, v in constexprs.items()}
        rows.append({"kernel": name, "shared": md.shared, "warps": md.num_warps, "registers": regs,
                     "stack": stack, "config": config})
        print(f"{name:28s} smem {md.shared:6d}  warps {md.num_warps:2d}  regs {regs:3d}  stack {stack:4d}  "
              + " ".join(f"{k}={v}" for k, v in rows[-1]["config"].items()))
    print(f"{len(rows)} kernels compiled for sm_{a.arch} in {time.perf_counter() - t0:.1f}s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"arch": a.arch, "smem_limit": SMEM_LIMIT[a.arch], "kernels": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
