"""The server's configuration, defined once (``ServerConfig``): vLLM's flag names, a `server.toml` with the same keys,
flags overriding the file, and the engine's settings taken from it."""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from keepwarm.worker.process.vllm_flags import FlagRefused, file_values


class ConfigError(ValueError):
    """A bad config file or flag value; one line naming the key."""


@dataclass(frozen=True)
class Flag:
    """How a ``ServerConfig`` key appears outside the file: its command-line option and the engine setting it is.

    ``names``: the option's spellings (default ``--key-with-dashes``, booleans ``--key/--no-key``); ``cli=False``:
    a file-only key. ``engine``: the ``EngineConfig`` field it sets (``""``: not an engine setting)."""

    help: str | None = None
    names: tuple[str, ...] = ()
    envvar: str | None = None
    engine: str = ""
    cli: bool = True


def setting(default: Any = None, flag: Flag = Flag(), *, factory: Any = None) -> Any:
    """A ServerConfig field with its Flag; ``engine="="`` means the EngineConfig field of the same name."""
    if factory is not None:
        return field(default_factory=factory, metadata={"flag": flag})
    return field(default=default, metadata={"flag": flag})


SAME = "="  # Flag.engine: the EngineConfig field has the key's name


@dataclass(frozen=True)
class ServerConfig:
    """Every key of `server.toml` (the flag names with underscores). ``model`` None means the bundled SmolLM2.

    The one definition of the server's settings: `keepwarm serve`'s options are generated from these fields
    (``Flag``), `server.toml` holds the same keys, and the engine's part becomes ``EngineConfig`` through
    ``engine_kwargs`` (``Flag.engine`` names the field each one sets)."""

    model: str | None = setting(None, Flag(engine=SAME, cli=False))  # the command's argument, not an option
    served_model_name: list[str] | None = None
    tokenizer: str | None = setting(None, Flag(engine=SAME))
    # a Hugging Face id (org/name) is looked up in the local Hugging Face cache, offline (worker/default_model.py)
    revision: str | None = setting(None, Flag("The model's revision (branch, tag or commit) in the Hugging Face "
                                              "cache."))
    tokenizer_revision: str | None = setting(None, Flag("The tokenizer's revision in the Hugging Face cache."))
    download_dir: str | None = setting(None, Flag("The Hugging Face cache to look in (default: HF_HUB_CACHE, "
                                                  "HF_HOME/hub, ~/.cache/huggingface/hub); nothing is downloaded."))
    chat_template: str | None = setting(None, Flag("A chat template (a file, or the template itself) instead of the "
                                                   "tokenizer's."))
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = setting(None, Flag("Bearer key required on /v1 routes.", envvar="KEEPWARM_API_KEY"))
    # engine (vLLM meanings)
    dtype: str = setting("auto", Flag(engine=SAME))
    max_model_len: int | None = setting(None, Flag(engine=SAME))
    max_num_seqs: int = setting(256, Flag(engine=SAME))
    max_num_batched_tokens: int | None = setting(None, Flag(engine=SAME))
    block_size: int = setting(16, Flag(engine=SAME))
    kv_cache_dtype: str = setting("auto", Flag("auto or fp8.", engine=SAME))
    enable_prefix_caching: bool = setting(True, Flag(engine=SAME))
    gpu_memory_utilization: float = setting(0.9, Flag(engine=SAME))
    num_gpu_blocks_override: int | None = setting(None, Flag(engine="num_gpu_blocks"))
    kv_cache_memory_bytes: int | None = setting(None, Flag(engine=SAME))
    quantization: str = setting("auto", Flag("auto (the checkpoint's own), none, int8, fp8, int4, int4-g64, int4-g32.",
                                              ("--quantization", "-q"), engine=SAME))
    seed: int = setting(0, Flag(engine=SAME))
    enforce_eager: bool = setting(False, Flag(engine=SAME))
    device: str = setting("auto", Flag(engine=SAME))
    tensor_parallel_size: int = setting(1, Flag("Split the model across this many processes on this machine "
                                                "(tensor parallelism; one per GPU, or sharing the CPU cores).",
                                                ("--tensor-parallel-size", "-tp"), engine=SAME))
    pipeline_parallel_size: int = setting(1, Flag("Split the model's layers into this many pipeline stages of "
                                                  "--tensor-parallel-size processes each (the Llama family).",
                                                  ("--pipeline-parallel-size", "-pp"), engine=SAME))
    # several machines (torchrun's meanings): node 0 serves the API, node k > 0 only runs its ranks
    nnodes: int = setting(1, Flag("Machines the tensor-parallel ranks are spread over (evenly).", engine=SAME))
    node_rank: int = setting(0, Flag("This machine's index: 0 serves the API; others only run their ranks.",
                                     engine=SAME))
    master_addr: str | None = setting(None, Flag("Node 0's address (default: $MASTER_ADDR, else 127.0.0.1).",
                                                 engine=SAME))
    master_port: int | None = setting(None, Flag("Node 0's rendezvous port, the same on every node (default: "
                                                 "$MASTER_PORT).", engine=SAME))
    # LoRA (vLLM's flags)
    enable_lora: bool = setting(False, Flag(engine=SAME))
    lora_modules: list[str] = setting(factory=list, flag=Flag("name=path"))
    max_loras: int = setting(1, Flag(engine=SAME))
    max_lora_rank: int = setting(16, Flag(engine=SAME))
    max_cpu_loras: int | None = setting(None, Flag(engine=SAME))
    enable_lora_runtime_updates: bool = False
    # tool calling (vLLM's flags): "auto" tool choice needs both
    enable_auto_tool_choice: bool = setting(False, Flag(
        "Let the model choose to call tools (tool_choice auto); needs --tool-call-parser."))
    tool_call_parser: str | None = setting(None, Flag("hermes (Hermes, Qwen), llama3_json or mistral."))
    # keepwarm
    # attach to the daemon (starting one if needed); False = --no-daemon, load from disk
    daemon: bool = setting(True, Flag("Attach to the daemon (default) or load from disk.", engine=SAME))
    runtime_dir: str | None = setting(None, Flag(engine=SAME, cli=False))
    fingerprint: str | None = setting(None, Flag("Attach only to an arena with this fingerprint.", engine=SAME))
    grpc: bool = setting(False, Flag("Also serve gRPC."))
    grpc_port: int = 50051
    shutdown_timeout: float = setting(30.0, Flag("Seconds to drain on SIGTERM."))
    threads: int | None = setting(None, Flag("torch threads."))  # default: torch's choice
    # a supervisor that owns the listening socket and forks workers from a pre-imported zygote (keepwarm restart)
    zygote: bool = setting(False, Flag("Serve from a supervisor: workers forked from a pre-imported zygote, "
                                       "restarted with no downtime by `keepwarm restart` or SIGHUP."))
    # with zygote: one more worker kept forked, attached and warmed but not accepting, taken over by the next restart
    standby: bool = setting(False, Flag("With --zygote: keep a standby worker forked, attached and warmed (not "
                                        "accepting), so a restart with unchanged flags or a crashed worker's "
                                        "replacement takes it over at once; costs one idle worker and its KV pool."))
    uvicorn_log_level: str = "warning"
    # limits (docs/reliability.md)
    trust_request_chat_template: bool = setting(False, Flag(
        "Allow a request's own chat_template (vLLM's flag); rendered sandboxed, time- and size-bounded."))
    max_request_body_mb: float = setting(16.0, Flag("Largest request body in MiB (413 past it)."))
    max_queued_requests: int = setting(1024, Flag("Sequences (a request counts prompts x n) that may wait beyond "
                                                  "--max-num-seqs (429 past it)."))
    max_request_sequences: int | None = setting(None, Flag("Sequences (prompts x n) one request may ask for (400 "
                                                           "past it; default --max-num-seqs)."))
    max_request_prompt_tokens: int | None = setting(None, Flag("Prompt tokens one request may bring, summed over its "
                                                               "prompts (400 past it; default: the KV cache's "
                                                               "tokens)."))
    client_timeout: float = setting(30.0, Flag("Seconds a client may stall sending a body (408) or reading a "
                                               "response (disconnected)."))
    # vLLM's switch is the environment variable; the store is in memory and bounded (worker/openai/responses.py)
    enable_responses_store: bool = setting(False, Flag(
        "Keep /v1/responses results (in memory, bounded) for previous_response_id and GET /v1/responses/{id}; "
        "also VLLM_ENABLE_RESPONSES_API_STORE=1, vLLM's switch.", envvar="VLLM_ENABLE_RESPONSES_API_STORE"))

    def __post_init__(self) -> None:
        for key, least in (("max_queued_requests", 0), ("max_request_sequences", 1),
                           ("max_request_prompt_tokens", 1)):
            value = getattr(self, key)
            if value is not None and value < least:
                raise ConfigError(f"{key}: must be at least {least}, got {value}")

    def engine_kwargs(self) -> dict[str, Any]:
        """The engine's settings, as ``EngineConfig`` keyword arguments (``model`` as given: None = the default).

        ``daemon`` True means "start one if none runs" to the engine, whose own default is "auto"."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            target = flag_of(f).engine
            if target:
                out[f.name if target == SAME else target] = getattr(self, f.name)
        out["daemon"] = "start" if self.daemon else False
        return out

    def to_dict(self) -> dict[str, Any]:
        """The effective config, as `server.toml` keys (what a snapshot records)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def replace(self, **changes: Any) -> ServerConfig:
        return dataclasses.replace(self, **changes)


def flag_of(f: dataclasses.Field) -> Flag:
    return f.metadata.get("flag", Flag())


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
    """A config file: TOML, or vLLM's YAML (``.yaml`` / ``.yml``: flat keys, dashes or underscores). vLLM's keys
    that keepwarm ignores are logged, those it refuses raise (worker/process/vllm_flags.py)."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    data = _load_yaml(p, text) if p.suffix in (".yaml", ".yml") else _load_toml_text(p, text)
    try:
        return from_mapping(_coerce_lists(file_values(data, str(p), FIELDS)), str(p))
    except FlagRefused as e:
        raise ConfigError(str(e)) from None


def _load_toml_text(p: Path, text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p} is not valid TOML: {e}") from None


def _load_yaml(p: Path, text: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a mapping of flag names to values")
    return data


def _coerce_lists(values: dict[str, Any]) -> dict[str, Any]:
    """vLLM's files give one value where a flag takes several (``served-model-name: x``), and a list of one for
    ``api-key``: both become keepwarm's types."""
    out = dict(values)
    for key, value in values.items():
        hint = _HINTS.get(key)
        if hint is None:
            continue
        takes_list = "list" in str(hint)
        if takes_list and isinstance(value, str):
            out[key] = [value]
        elif not takes_list and isinstance(value, list) and len(value) == 1:
            out[key] = value[0]
    return out


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
