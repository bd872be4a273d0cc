"""The server's configuration: vLLM's flag names, a `server.toml` with the same keys, flags overriding the file."""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A bad config file or flag value; one line naming the key."""


@dataclass(frozen=True)
class ServerConfig:
    """Every key of `server.toml` (the flag names with underscores). ``model`` None means the bundled SmolLM2."""

    model: str | None = None
    served_model_name: list[str] | None = None
    tokenizer: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # engine (vLLM meanings)
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    quantization: str = "none"
    seed: int = 0
    enforce_eager: bool = False
    device: str = "auto"
    # LoRA (vLLM's flags)
    enable_lora: bool = False
    lora_modules: list[str] = field(default_factory=list)
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    enable_lora_runtime_updates: bool = False
    # tool calling (vLLM's flags): "auto" tool choice needs both
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # hermes | llama3_json | mistral
    # keepwarm
    daemon: bool = True  # attach to the daemon (starting one if needed); False = --no-daemon, load from disk
    runtime_dir: str | None = None
    fingerprint: str | None = None
    grpc: bool = False
    grpc_port: int = 50051
    shutdown_timeout: float = 30.0
    threads: int | None = None  # torch threads (default: torch's choice)
    uvicorn_log_level: str = "warning"

    def to_dict(self) -> dict[str, Any]:
        """The effective config, as `server.toml` keys (what a snapshot records)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def replace(self, **changes: Any) -> ServerConfig:
        return dataclasses.replace(self, **changes)


_HINTS = typing.get_type_hints(ServerConfig)
FIELDS = {f.name for f in dataclasses.fields(ServerConfig)}


def _check(key: str, value: Any) -> Any:
    hint = _HINTS[key]
    # A union (``int | None``) allows each member; anything else (``list[str]``) is itself the one allowed type.
    allowed = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    for t in allowed:
        origin = typing.get_origin(t) or t
        if t is type(None) and value is None:
            return value
        if origin is list and isinstance(value, list) and all(isinstance(x, str) for x in value):
            return value
        if origin is bool and isinstance(value, bool):
            return value
        if origin is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if origin is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if origin is str and isinstance(value, str):
            return value
    raise ConfigError(f"{key}: expected {hint}, got {type(value).__name__} {value!r}")


def from_mapping(values: dict[str, Any], source: str = "config") -> dict[str, Any]:
    """Validate keys and types; returns the checked mapping (no defaults filled)."""
    unknown = sorted(set(values) - FIELDS)
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)} (keys are the flag names with "
                          "underscores, e.g. max_num_seqs)")
    return {k: _check(k, v) for k, v in values.items()}


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p} is not valid TOML: {e}") from None
    return from_mapping(data, str(p))


def build_config(file_values: dict[str, Any], flag_values: dict[str, Any]) -> ServerConfig:
    """Defaults < config file < flags given on the command line (``None`` flags were not given)."""
    merged = {**file_values, **{k: v for k, v in flag_values.items() if v is not None}}
    try:
        return ServerConfig(**from_mapping(merged, "flags"))
    except TypeError as e:
        raise ConfigError(str(e)) from None


def to_toml(config: ServerConfig) -> str:
    """Render the effective config as a `server.toml` (used by snapshots)."""
    lines = []
    for k, v in config.to_dict().items():
        if isinstance(v, bool):
            lines.append(f"{k} = {'true' if v else 'false'}")
        elif isinstance(v, int | float):
            lines.append(f"{k} = {v}")
        elif isinstance(v, list):
            lines.append(f"{k} = [{', '.join(_quote(x) for x in v)}]")
        else:
            lines.append(f"{k} = {_quote(v)}")
    return "\n".join(lines) + "\n"


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
