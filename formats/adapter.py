"""A LoRA adapter on disk, as the daemon stores it and the worker loads it: a PEFT directory with
``adapter_config.json`` and ``adapter_model.safetensors`` (never pickle), identified by ``adapter_digest``.

Rules: the checks here need no model (shapes against the model are keepwarm.worker.lora's); errors are one line.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["LoRAError", "adapter_digest", "read_adapter_dir"]


class LoRAError(ValueError):
    """An adapter that cannot be served; the one-line message names the cause (an HTTP 400)."""


def read_adapter_dir(path: str | Path) -> tuple[str, Path]:
    """The adapter's config text and its weights file, after the checks that need no model: one-line errors."""
    p = Path(path)
    if not p.exists():
        raise LoRAError(f"adapter path {str(p)!r} does not exist")
    if not p.is_dir():
        raise LoRAError(f"adapter path {str(p)!r} is not a directory")
    cfg = p / "adapter_config.json"
    weights = p / "adapter_model.safetensors"
    if not cfg.is_file():
        raise LoRAError(f"{str(p)!r} is not a LoRA adapter: adapter_config.json is missing")
    if not weights.is_file():
        if any(p.glob("*.bin")) or any(p.glob("*.pt")):
            raise LoRAError(f"{str(p)!r} has only pickled weights (adapter_model.bin); keepwarm never loads pickle: "
                            "save the adapter with safe_serialization=True")
        raise LoRAError(f"{str(p)!r} is not a LoRA adapter: adapter_model.safetensors is missing")
    return cfg.read_text(), weights


def adapter_digest(config_text: str, weights_bytes: bytes | memoryview) -> str:
    h = hashlib.sha256(b"keepwarm-lora-v1\0")
    h.update(config_text.encode())
    h.update(b"\0")
    h.update(weights_bytes)
    return h.hexdigest()
