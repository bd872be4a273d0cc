#!/usr/bin/env bash
# A vLLM launch script as deployments write it (tests/unit/cli/test_vllm_flags.py runs it with VLLM naming keepwarm and
# MODEL a tiny model directory; nothing else changes). Its flags are taken from:
# - the vLLM production-stack Helm chart: helm/templates/deployment-vllm-multi.yaml renders a modelSpec's values
#   (enableLoRA, enableTool, toolCallParser, vllmConfig: enableChunkedPrefill, enablePrefixCaching, maxModelLen, dtype,
#   tensorParallelSize, maxNumSeqs, gpuMemoryUtilization -> --gpu_memory_utilization, maxLoras -> --max_loras,
#   extraArgs, chatTemplate -> --chat-template /templates/...) into `vllm serve MODEL --host 0.0.0.0 --port 8000 ...`;
#   its tutorials' extraArgs: ["--disable-log-requests", "--swap-space", 0] and ["--gpu-memory-utilization", "0.8"];
# - vLLM's documentation: the OpenAI-compatible server quickstart (`--dtype auto --api-key token-abc123`), the default
#   sampling parameters (`--generation-config vllm`), quantized KV cache (`--kv-cache-dtype fp8`), performance tuning
#   (`--max-num-batched-tokens`, `--enforce-eager`), engine arguments (`--download-dir`, `--load-format`,
#   `--seed`, `--block-size`, `--max-logprobs`, `--distributed-executor-backend mp`, `--disable-log-stats`,
#   `--trust-remote-code`, `--max-seq-len-to-capture`), and Red Hat AI Inference Server's server arguments
#   (`--disable-uvicorn-access-log`, `--uvicorn-log-level`).
set -euo pipefail

MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
PORT="${PORT:-8000}"
CHAT_TEMPLATE_DIR="${CHAT_TEMPLATE_DIR:-/templates}"

# shellcheck disable=SC2086  # VLLM may be a command with arguments
exec ${VLLM:-vllm} serve "$MODEL" \
  --host 0.0.0.0 \
  --port "$PORT" \
  --served-model-name llama-3.1-8b-instruct \
  --api-key token-abc123 \
  --enable-lora \
  --enable-auto-tool-choice \
  --tool-call-parser hermes \
  --enable-chunked-prefill \
  --enable-prefix-caching \
  --max-model-len 4096 \
  --dtype bfloat16 \
  --tensor-parallel-size 1 \
  --pipeline-parallel-size 1 \
  --max-num-seqs 32 \
  --gpu_memory_utilization 0.85 \
  --max_loras 2 \
  --max-lora-rank 64 \
  --disable-log-requests \
  --swap-space 0 \
  --chat-template "$CHAT_TEMPLATE_DIR/tool_chat_template_hermes.jinja" \
  --generation-config vllm \
  --kv-cache-dtype fp8 \
  --max-num-batched-tokens 8192 \
  --block-size 16 \
  --seed 0 \
  --max-logprobs 20 \
  --trust-remote-code \
  --download-dir "${HF_HOME:-/data}" \
  --load-format safetensors \
  --distributed-executor-backend mp \
  --disable-log-stats \
  --disable-uvicorn-access-log \
  --uvicorn-log-level warning \
  --max-seq-len-to-capture 8192 \
  --enforce-eager
