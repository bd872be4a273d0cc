"""What a snapshot was made with: keepwarm, torch, the CPU (model and the ISA flags that decide packed layouts),
the GPU when the daemon keeps its arenas on one."""

from __future__ import annotations

import os
import platform
import re
import socket
from pathlib import Path
from typing import Any

import torch

from keepwarm.formats.arena import cuda_device_by_uuid
from keepwarm.formats.version import __version__

# The flags oneDNN's and torch's CPU kernels dispatch on: they decide the blocked layout of packed bfloat16
# weights (mkldnn_packed) and which int4 pack torch produces.
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "avx_vnni", "avx_ne_convert", "amx_tile", "amx_bf16", "amx_int8",
             "amx_fp16",
             # aarch64
             "asimd", "sve", "sve2", "bf16", "i8mm", "asimddp")


def _cpuinfo() -> tuple[str, list[str]]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model", "CPU part") and model in ("", platform.machine()):
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return model, [f for f in ISA_FLAGS if f in flags]


def onednn_version() -> str | None:
    m = re.search(r"(?:oneDNN|MKL-DNN) (v[\d.]+)", torch.__config__.show())
    return m.group(1) if m else None


def machine_identity(daemon_device: str) -> dict[str, Any]:
    cpu, isa = _cpuinfo()
    ident: dict[str, Any] = {
        "keepwarm": __version__, "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "hostname": socket.gethostname(), "cpu": cpu, "cpu_isa": isa,
        "cpu_count": os.cpu_count(), "onednn": onednn_version(), "daemon_device": daemon_device, "gpu": None,
    }
    if daemon_device.startswith("cuda") and torch.cuda.is_available():
        uuid = daemon_device.split(":", 1)[1] if ":" in daemon_device else None
        dev = cuda_device_by_uuid(uuid)
        props = torch.cuda.get_device_properties(dev)
        ident["gpu"] = {"name": props.name, "uuid": uuid, "capability": f"{props.major}.{props.minor}",
                        "memory_bytes": props.total_memory}
    return ident
