"""What a snapshot was made with: keepwarm, torch, the CPU (model and the ISA flags that decide packed layouts),
the GPU when the daemon keeps its arenas on one."""

from __future__ import annotations

import os
import platform
import socket
from pathlib import Path
from typing import Any

import torch

from keepwarm.formats.arena import cuda_device_by_uuid
from keepwarm.formats.version import __version__
from keepwarm.kernels.cpu_native import layout_isa_flags
from keepwarm.kernels.cpu_packed import onednn_version


def _cpu_model() -> str:
    model = platform.processor() or platform.machine()
    if model != platform.machine():  # the OS named it
        return model
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "CPU part"):
                return value.strip()
    except OSError:
        pass
    return model


def machine_identity(daemon_device: str) -> dict[str, Any]:
    ident: dict[str, Any] = {
        "keepwarm": __version__, "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "hostname": socket.gethostname(), "cpu": _cpu_model(),
        "cpu_isa": layout_isa_flags(),
        "cpu_count": os.cpu_count(), "onednn": onednn_version(), "daemon_device": daemon_device, "gpu": None,
    }
    if daemon_device.startswith("cuda") and torch.cuda.is_available():
        uuid = daemon_device.split(":", 1)[1] if ":" in daemon_device else None
        dev = cuda_device_by_uuid(uuid)
        props = torch.cuda.get_device_properties(dev)
        ident["gpu"] = {"name": props.name, "uuid": uuid, "capability": f"{props.major}.{props.minor}",
                        "memory_bytes": props.total_memory}
    return ident
