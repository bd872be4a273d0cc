"""Prometheus metrics: vLLM's metric set under vLLM's names (so existing dashboards work), plus keepwarm's own.

Gauges and counters are read from the engine's snapshot at scrape time (a custom collector: no bookkeeping on
the hot path); latency histograms are observed when a request finishes. Each server owns its registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from keepwarm.worker.async_engine import EngineSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
RESTART_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0)


class _SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str,
                 info: Callable[[], dict[str, object]]) -> None:
        self._snapshot = snapshot
        self._model = model_name
        self._info = info

    def collect(self) -> Iterator:
        s = self._snapshot()
        labels = ["model_name", "engine"]
        values = [self._model, "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      s.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", s.num_preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*labels, "finished_reason"])
        for reason in ("stop", "length", "abort"):
            success.add_metric([*values, reason], s.finished.get(reason, 0))
        yield success
        info = self._info()
        yield gauge("keepwarm:kv_cache_free_blocks", "Free blocks in the paged KV pool.", s.free_blocks)
        yield gauge("keepwarm:kv_cache_total_blocks", "Blocks in the paged KV pool.", s.total_blocks)
        yield gauge("keepwarm:attach_seconds", "Seconds to attach (daemon) or load (disk) the weights.",
                    float(info["attach_seconds"]))
        yield gauge("keepwarm:resident_bytes", "Bytes of weights this worker serves from.", float(info["bytes"]))
        src = GaugeMetricFamily("keepwarm:weights_source", "Where the weights came from (1 for the source).",
                                labels=[*labels, "source"])
        for source in ("daemon", "disk"):
            src.add_metric([*values, source], 1.0 if info["source"] == source else 0.0)
        yield src
        yield gauge("keepwarm:engine_steps", "Engine steps run.", s.steps)


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
                 info: Callable[[], dict[str, object]], restarts: Callable[[], dict | None] = lambda: None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_SnapshotCollector(snapshot, model_name, info))
        self.registry.register(_RestartCollector(restarts))
        labels = ["model_name", "engine"]
        self._labels = (model_name, "0")
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds.", labels, buckets=_TPOT_BUCKETS,
                              registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                             labels, buckets=_E2E_BUCKETS, registry=self.registry)

    def observe_request(self, arrival: float, first_token: float | None, finished: float, num_output_tokens: int,
                        ) -> None:
        self.e2e.labels(*self._labels).observe(finished - arrival)
        if first_token is not None:
            self.ttft.labels(*self._labels).observe(first_token - arrival)
            if num_output_tokens > 1:
                self.tpot.labels(*self._labels).observe((finished - first_token) / (num_output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
