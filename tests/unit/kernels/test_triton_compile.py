"""The Triton kernels compile for Hopper (sm_90) on this GPU-less machine, fit in shared memory and do not spill.

The interpreter tests (test_triton_kernels.py) check the numbers but not code generation: the compiler rejects
things the interpreter accepts (a loop-carried variable that starts as a constexpr, tl.dot under 16 rows), and
only the compiled kernel shows its registers and shared memory. tests/support/triton_compile_check.py compiles the real
wrappers' launches with Triton's bundled ptxas (no GPU needed) in a subprocess, since TRITON_INTERPRET must be
unset for it; one configuration per kernel and path here (~6 s on 2 cores, once Triton's cache is warm: less).
Run the script without --quick (and with --arch 80 for A100s) for every dtype and tile configuration.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).resolve().parents[2] / "support" / "triton_compile_check.py"


def _nvidia_backend() -> bool:
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return False
    return (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists()


@pytest.mark.skipif(not _nvidia_backend(), reason="triton with its NVIDIA backend (ptxas, cuobjdump) is not installed")
def test_kernels_compile_for_sm90_without_spills(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "compile.json"
    r = subprocess.run([sys.executable, str(CHECK), "--quick", "--arch", "90", "--json", str(out)], env=env,
                       capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[3])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    report = json.loads(out.read_text())
    names = {k["kernel"] for k in report["kernels"]}
    assert names == {"_paged_attention_kernel", "_combine_splits_kernel", "_write_kv_cache_kernel",
                     "_rms_norm_kernel", "_rotary_kernel", "_wq_linear_kernel", "_wq_gemv_kernel",
                     "_splitk_reduce_kernel", "_lora_shrink_kernel", "_lora_expand_kernel", "_moe_gemm_kernel"}
    for k in report["kernels"]:
        assert k["shared"] <= report["smem_limit"], k
        assert k["stack"] == 0, f"{k['kernel']} spills: {k}"  # register spills go to the stack frame
        assert k["registers"] <= 255, k
