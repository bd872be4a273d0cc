"""Prometheus metrics: vLLM's metric set under vLLM's names (so vLLM's dashboards and alerts work), plus keepwarm's own.

Rules (each series, and why some are left out: docs/vllm-compat.md, "Metrics"):
- Names, types, label names, help strings and histogram buckets are vLLM 0.32's (``PrometheusStatLogger``;
  tests/data/vllm_metrics.json lists every series, and tests/e2e/test_vllm_metrics.py holds this module to it). Every
  vLLM series carries ``model_name`` (the first served name) and ``engine="0"`` where vLLM's do.
- Every value is read from the engine's snapshot at scrape time: its figures and the cumulative histograms its thread
  folds after every step. Nothing is observed on the request path (any front end's requests count).
- A series that needs what keepwarm does not have (a KV connector, multimodal inputs, speculative decoding...) is left
  out, never exported as a constant; label values vLLM creates up front are all exported (those never reached stay 0);
  two names dashboards still chart (``vllm:gpu_cache_usage_perc``, ``vllm:time_per_output_token_seconds``) carry their
  successors' values.
- ``keepwarm:*`` series are keepwarm's own (weights, KV pool, restarts); each server owns its registry. The preload
  figures come with the weights at attach time: nothing is asked of the daemon at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from keepwarm.worker.async_engine import Distribution, EngineSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

RESTART_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
# vLLM's FinishReason strings: keepwarm ends sequences with the first four ("error": failed inside the engine);
# it has no repetition detection, so "repetition" stays 0 like any reason that did not happen.
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# vLLM's CacheHitSource: the tier cached prompt tokens came from. keepwarm's KV lives in one pool ("device").
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
# vLLM's frontend admission limits: keepwarm's admission bound (max_num_seqs + --max-queued-requests sequences,
# a request counting prompts x n) is max_num_queued_reqs; it has no prompt-token cap (max_num_queued_tokens).
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")

HISTOGRAM_HELP = {
    "vllm:request_prompt_tokens": "Number of prefill tokens processed.",
    "vllm:request_generation_tokens": "Number of generation tokens processed.",
    "vllm:iteration_tokens_total": "Histogram of number of tokens per engine_step.",
    "vllm:request_max_num_generation_tokens": "Histogram of maximum number of requested generation tokens.",
    "vllm:request_params_n": "Histogram of the n request parameter.",
    "vllm:request_params_max_tokens": "Histogram of the max_tokens request parameter.",
    "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "vllm:time_per_output_token_seconds": "Histogram of time per output token in seconds.DEPRECATED: Use "
                                          "vllm:inter_token_latency_seconds instead.",
    "vllm:request_time_per_output_token_seconds": "Histogram of time_per_output_token_seconds per request.",
    "vllm:e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "vllm:request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "vllm:request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "vllm:request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "vllm:request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "vllm:request_prefill_kv_computed_tokens": "Histogram of new KV tokens computed during prefill (excluding "
                                               "cached tokens).",
    "vllm:request_num_preemptions": "Histogram of the number of times a request was preempted.",
}


def histogram_buckets(d: Distribution) -> list[tuple[str, float]]:
    """Prometheus's cumulative ``le`` buckets of ``d``, bounds written as prometheus_client writes them."""
    out: list[tuple[str, float]] = []
    total = 0
    for bound, n in zip((*d.bounds, float("inf")), d.counts, strict=True):
        total += n
        out.append((floatToGoString(bound), total))
    return out


class _SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str,
                 info: Callable[[], dict[str, object]], admission_refused: Callable[[], int] | None) -> None:
        self._snapshot = snapshot
        self._model = model_name
        self._info = info
        self._admission_refused = admission_refused
        self._labels = ["model_name", "engine"]
        self._values = [model_name, "0"]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=self._labels)
        g.add_metric(self._values, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=self._labels)
        c.add_metric(self._values, value)
        return c

    def _labelled(self, family: type, name: str, doc: str, label: str, values: dict[str, float]) -> Any:
        f = family(name, doc, labels=[*self._labels, label])
        for key, value in values.items():
            f.add_metric([*self._values, key], value)
        return f

    def collect(self) -> Iterator:
        s = self._snapshot()
        yield from self._scheduler(s)
        yield from self._counters(s)
        for name, dist in s.histograms.items():
            h = HistogramMetricFamily(name, HISTOGRAM_HELP[name], labels=self._labels)
            h.add_metric(self._values, histogram_buckets(dist), sum_value=dist.sum)
            yield h
        yield from self._info_gauges(s)
        yield from self._keepwarm(s)

    def _scheduler(self, s: EngineSnapshot) -> Iterator:
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                          s.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting)
        yield self._labelled(
            GaugeMetricFamily, "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
            "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all "
            "reasons equals vllm:num_requests_waiting.", "reason",
            {"capacity": s.num_waiting - s.num_waiting_deferred, "deferred": s.num_waiting_deferred})
        # keepwarm has no sleep mode: its engine is awake whenever the server answers
        yield self._labelled(
            GaugeMetricFamily, "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.", "sleep_state",
            {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0})
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage)
        yield self._gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.DEPRECATED: "
                          "Use vllm:kv_cache_usage_perc instead.", s.kv_cache_usage)

    def _counters(self, s: EngineSnapshot) -> Iterator:
        yield self._counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
                            "tokens.", s.prefix_cache_queries)
        yield self._counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                            s.prefix_cache_hits)
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                            s.num_preemptions)
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        # keepwarm has no KV connector: no prompt token ever comes from an external transfer
        sources = dict(zip(PROMPT_SOURCES, (s.prompt_tokens_computed, s.prompt_tokens_cached, 0), strict=True))
        yield self._labelled(CounterMetricFamily, "vllm:prompt_tokens_by_source", "Number of prompt tokens by "
                             "source.", "source", sources)
        yield self._counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
                            s.prompt_tokens_cached)
        # vLLM adds the local prefix-cache hits to "device" (the same tokens as vllm:prefix_cache_hits); the other
        # tiers are a KV connector's, which keepwarm does not have
        yield self._labelled(
            CounterMetricFamily, "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to "
            "DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at "
            "admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.", "source",
            {src: s.prefix_cache_hits if src == "device" else 0 for src in CACHE_HIT_SOURCES})
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens)
        yield self._labelled(CounterMetricFamily, "vllm:request_success", "Count of successfully processed "
                             "requests.", "finished_reason", {r: s.finished.get(r, 0) for r in FINISHED_REASONS})
        if self._admission_refused is not None:  # vLLM's labels: model_name and reason, no engine
            rejections = CounterMetricFamily("vllm:admission_rejections", "Number of admission attempts rejected by "
                                             "a queue limit, by reason.", labels=["model_name", "reason"])
            refused = {"max_num_queued_reqs": self._admission_refused(), "max_num_queued_tokens": 0}
            for reason in ADMISSION_REASONS:
                rejections.add_metric([self._model, reason], refused[reason])
            yield rejections

    def _info_gauges(self, s: EngineSnapshot) -> Iterator:
        if s.cache_config:  # vLLM: CacheConfig's fields and "engine" as labels, value 1
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                     labels=[*s.cache_config, "engine"])
            info.add_metric([*s.cache_config.values(), "0"], 1.0)
            yield info
        if s.lora is not None:  # vLLM: only with --enable-lora; the value is when it was last updated
            lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                     labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            lora.add_metric([str(s.lora.max_loras), ",".join(s.lora.waiting), ",".join(s.lora.running)],
                            time.time() - (time.monotonic() - s.last_step_time))
            yield lora

    def _keepwarm(self, s: EngineSnapshot) -> Iterator:
        info = self._info()
        yield self._gauge("keepwarm:kv_cache_free_blocks", "Free blocks in the paged KV pool.", s.free_blocks)
        yield self._gauge("keepwarm:kv_cache_total_blocks", "Blocks in the paged KV pool.", s.total_blocks)
        yield self._gauge("keepwarm:attach_seconds", "Seconds to attach (daemon) or load (disk) the weights.",
                          float(info["attach_seconds"]))
        yield self._gauge("keepwarm:resident_bytes", "Bytes of weights this worker serves from.", float(info["bytes"]))
        yield self._labelled(GaugeMetricFamily, "keepwarm:weights_source", "Where the weights came from (1 for the "
                             "source).", "source",
                             {src: 1.0 if info["source"] == src else 0.0 for src in ("daemon", "disk")})
        yield self._gauge("keepwarm:engine_steps", "Engine steps run.", s.steps)
        yield from self._preload(info.get("preload"))

    def _preload(self, p: dict[str, Any] | None) -> Iterator:
        """How the weights were read and built: the daemon's preload (or image load) of the arena this worker
        attached, as its ``status`` reports it, or this worker's own disk load; left out when nothing was read
        (an adopted arena). Preload GB/s = source_bytes / seconds / 1e9."""
        if not p:
            return
        for name, doc, key in (
                ("keepwarm:preload_seconds", "Seconds the weights' load took: the daemon's preload or image load "
                 "(its status figure), or this worker's disk load (read and build, binding excluded).", "seconds"),
                ("keepwarm:preload_source_bytes", "Bytes that load read (checkpoint tensors, or the arena image).",
                 "source_bytes"),
                ("keepwarm:preload_arena_bytes", "Bytes of the arena that load allocated.", "arena_bytes")):
            yield self._labelled(GaugeMetricFamily, name, doc, "origin", {str(p["origin"]): float(p[key])})


class _RestartCollector(Collector):
    """The supervisor's restart history (``keepwarm serve --zygote``; zeros without a supervisor): it outlives
    every worker, so each new worker is handed the history and shows it."""

    def __init__(self, history: Callable[[], dict | None]) -> None:
        self._history = history

    def collect(self) -> Iterator:
        h = self._history() or {}
        total = CounterMetricFamily("keepwarm:restarts", "Restarts handed over to a new worker, by how it started "
                                    "(standby: the standby worker took over; zygote: forked warm; cold: a zygote "
                                    "had to be started first).", labels=["mode"])
        for mode in ("standby", "zygote", "cold"):
            total.add_metric([mode], h.get("total", {}).get(mode, 0))
        yield total
        yield CounterMetricFamily("keepwarm:restarts_failed", "Restarts whose new worker failed; the old one kept "
                                  "serving.", value=h.get("failed", 0))
        yield CounterMetricFamily("keepwarm:worker_replacements", "Workers that exited on their own (a crash, the "
                                  "engine failed) and were replaced by a new one forked warm.",
                                  value=h.get("replaced", 0))
        yield CounterMetricFamily("keepwarm:worker_replacements_failed", "Attempts to replace a worker that "
                                  "failed (after too many in a row the server exits).",
                                  value=h.get("replace_failed", 0))
        yield CounterMetricFamily("keepwarm:restart_prefix_blocks_carried", "Prefix-cache blocks restarts carried "
                                  "over from the old worker to the new one.", value=h.get("prefix_blocks_carried", 0))
        durations = h.get("durations", [])
        buckets = [(str(b), sum(d <= b for d in durations)) for b in RESTART_BUCKETS]
        yield HistogramMetricFamily("keepwarm:restart_duration_seconds", "Restart request to the new worker "
                                    "accepting on the listening socket.",
                                    buckets=[*buckets, ("+Inf", len(durations))], sum_value=sum(durations))


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str,
                 info: Callable[[], dict[str, object]], restarts: Callable[[], dict | None] = lambda: None,
                 admission_refused: Callable[[], int] | None = None) -> None:
        """``admission_refused``: the requests the admission bound refused (429; limits.Admission.refused), for
        ``vllm:admission_rejections`` (not exported without it)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_SnapshotCollector(snapshot, model_name, info, admission_refused))
        self.registry.register(_RestartCollector(restarts))

    def render(self) -> bytes:
        return generate_latest(self.registry)
