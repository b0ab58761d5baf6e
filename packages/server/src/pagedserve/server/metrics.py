"""/metrics: the engine's stats in Prometheus text, through prometheus-client.

Names follow vLLM's with a ``pagedserve:`` prefix (``--metrics-prefix vllm`` gives vLLM's own
``vllm:`` names, for the dashboards and autoscalers written for it), each labelled with the
served model name: gauges ``num_requests_running``, ``num_requests_waiting``,
``num_requests_waiting_by_reason{reason=capacity|deferred}``, ``kv_cache_usage_perc`` (as of
the engine's last step), ``cache_config_info`` (1, the KV cache's configuration in its labels)
and ``num_requests_in_flight`` (the server's own, live); counters
``prefix_cache_queries_total``, ``prefix_cache_hits_total`` (tokens), ``num_preemptions_total``,
``prompt_tokens_total``, ``generation_tokens_total``, ``request_success_total{finished_reason}``;
histograms per finished request ``time_to_first_token_seconds``,
``time_per_output_token_seconds`` (its mean), ``e2e_request_latency_seconds``,
``request_queue_time_seconds``, ``request_prefill_time_seconds``,
``request_decode_time_seconds``, ``request_inference_time_seconds``, ``request_prompt_tokens``,
``request_generation_tokens``; per request admitted, ``request_params_n`` and
``request_params_max_tokens`` (what it asked for: the server observes them, as it sends the
request, when its first output arrives); and per step ``iteration_tokens_total`` (tokens computed by one
engine step) and ``inter_token_latency_seconds`` (each interval between a request's tokens).
With a KV connector (offloading, disaggregated prefill), ``kv_connector_*`` by ``tier`` (``ram``,
``disk``, ``remote``): counters of hit tokens, bytes loaded and saved, load seconds and loads,
dropped saves, rejected blocks (by ``reason``) and failed loads; gauges of each tier's bytes
and blocks held (``_kv_connector_metrics``).

The engine keeps the cumulative totals itself, so they are exported through a custom collector
(the counters' values are read, never re-counted). Finished-request latencies are handed over
once by ``get_stats(drain=True)``; ``refresh`` drains them into the histograms, on every scrape
and periodically (so they never pile up in the engine between scrapes). One registry per app:
two servers in one process (tests) never share series.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "pagedserve:"
N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's request_params_n
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5)
TTFT_BUCKETS += (5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
TPOT_BUCKETS += (7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0)
LATENCY_BUCKETS += (60.0, 120.0, 240.0, 480.0, 960.0)
DEFAULT_MAX_MODEL_LEN = 8192
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > limit:
                return tuple(buckets)
            buckets.append(value)
        scale *= 10


_HISTOGRAMS = {
    # attribute of FinishedRequestStats -> (metric name, help, buckets)
    "time_to_first_token": ("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS),
    "time_per_output_token": (
        "time_per_output_token_seconds",
        "Mean time per output token after the first, per request.",
        TPOT_BUCKETS,
    ),
    "e2e_latency": ("e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS),
    "queue_time": (
        "request_queue_time_seconds",
        "Time spent waiting in the queue.",
        LATENCY_BUCKETS,
    ),
    "prefill_time": (
        "request_prefill_time_seconds",
        "Time from first scheduled to first token (the prefill).",
        LATENCY_BUCKETS,
    ),
    "decode_time": (
        "request_decode_time_seconds",
        "Time from first to last token (the decode).",
        LATENCY_BUCKETS,
    ),
    "inference_time": (
        "request_inference_time_seconds",
        "Time from first scheduled to last token (prefill and decode).",
        LATENCY_BUCKETS,
    ),
}
# per finished request, in tokens: buckets up to max_model_len
_TOKEN_HISTOGRAMS = {
    "num_prompt_tokens": ("request_prompt_tokens", "Prompt tokens per request."),
    "num_generation_tokens": ("request_generation_tokens", "Generated tokens per request."),
}
# per engine step: attribute of EngineStats (a list of samples) -> (name, help, buckets)
_STEP_HISTOGRAMS = {
    "iteration_tokens": (
        "iteration_tokens_total",
        "Tokens computed by one engine step (prefill chunks and decodes).",
        ITERATION_TOKEN_BUCKETS,
    ),
    "inter_token_latencies": (
        "inter_token_latency_seconds",
        "Time between two consecutive tokens of a request.",
        TPOT_BUCKETS,
    ),
}

_COUNTERS = {
    # attribute of EngineStats -> (metric name without _total, help)
    "prefix_cache_queries": (
        "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
    ),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "encoder_cache_encoded": ("encoder_cache_encoded", "Images the vision encoder ran on."),
    "encoder_cache_hits": (
        "encoder_cache_hits",
        "Images a request found already encoded in the encoder cache.",
    ),
    "num_preemptions": ("num_preemptions", "Requests preempted (blocks freed, recomputed later)."),
    "prompt_tokens_total": ("prompt_tokens", "Prompt tokens processed."),
    "generation_tokens_total": ("generation_tokens", "Tokens generated."),
    "spec_decode_num_drafts": ("spec_decode_num_drafts", "Sequences verified (speculative)."),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "Proposed tokens verified."),
    "spec_decode_num_accepted_tokens": (
        "spec_decode_num_accepted_tokens",
        "Proposed tokens accepted.",
    ),
    "spec_decode_num_emitted_tokens": (
        "spec_decode_num_emitted_tokens",
        "Tokens emitted by verify steps (accepted + one of the target's own per sequence).",
    ),
}


class EngineMetrics(Collector):
    """Reads ``engine.get_stats()``; ``render()`` is the /metrics body. ``max_model_len`` tops
    the token-count buckets (default: the engine's, else 8192 for an engine without one)."""

    def __init__(
        self,
        engine,
        model_name: str,
        in_flight: Callable[[], int] = lambda: 0,
        max_model_len: int | None = None,
        prefix: str = PREFIX,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.in_flight = in_flight
        self.prefix = prefix
        self.cache_config = getattr(engine, "cache_config", None)
        disable_created_metrics()  # no *_created series: they double the output for nothing
        self.registry = CollectorRegistry(auto_describe=False)
        self._lock = threading.Lock()
        self._stats = None
        if max_model_len is None:
            scheduler_config = getattr(engine, "scheduler_config", None)
            max_model_len = getattr(scheduler_config, "max_model_len", DEFAULT_MAX_MODEL_LEN)
        token_buckets = buckets_1_2_5(max_model_len)
        request_histograms = {
            **_HISTOGRAMS,
            **{a: (n, h, token_buckets) for a, (n, h) in _TOKEN_HISTOGRAMS.items()},
        }
        self.histograms = self._histograms(request_histograms)
        self.step_histograms = self._histograms(_STEP_HISTOGRAMS)
        self.request_params = self._histograms(
            {
                "n": ("request_params_n", "The n request parameter.", N_BUCKETS),
                "max_tokens": (
                    "request_params_max_tokens",
                    "The max_tokens request parameter.",
                    token_buckets,
                ),
            }
        )
        self.request_success = Counter(
            prefix + "request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.registry.register(self)

    def _histograms(self, specs: dict) -> dict:
        return {
            attr: Histogram(
                self.prefix + name, help_, ["model_name"], buckets=buckets, registry=self.registry
            ).labels(self.model_name)
            for attr, (name, help_, buckets) in specs.items()
        }

    def observe_request_params(self, params) -> None:
        """A request the engine admitted: its ``n`` and ``max_tokens`` (SamplingParams)."""
        self.request_params["n"].observe(params.n)
        if params.max_tokens is not None:
            self.request_params["max_tokens"].observe(params.max_tokens)

    def refresh(self) -> None:
        """Take a fresh snapshot and move the newly finished requests into the histograms."""
        with self._lock:
            stats = self.engine.get_stats(drain=True)
            for finished in stats.finished_requests:
                for attr, histogram in self.histograms.items():
                    value = getattr(finished, attr)
                    if value is not None:
                        histogram.observe(value)
                reason = finished.finish_reason or "unknown"
                self.request_success.labels(self.model_name, reason).inc()
            for attr, histogram in self.step_histograms.items():
                for value in getattr(stats, attr):
                    histogram.observe(value)
            self._stats = stats

    def render(self) -> bytes:
        self.refresh()
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        stats = self._stats
        if stats is None:
            return
        labels = [self.model_name]
        gauges = (
            ("num_requests_running", "Requests running (in the batch).", stats.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            (
                "kv_cache_usage_perc",
                "Fraction of KV blocks in use (1 = full).",
                stats.kv_cache_usage,
            ),
            (
                "spec_decode_acceptance_rate",
                "Accepted / proposed tokens since start (speculative decoding).",
                stats.spec_decode_acceptance_rate,
            ),
            (
                "spec_decode_mean_acceptance_length",
                "Tokens emitted per verified sequence per step since start (accepted + 1).",
                stats.spec_decode_mean_acceptance_length,
            ),
            (
                "num_requests_in_flight",
                "Engine requests the HTTP server is waiting on or streaming (live, not per step).",
                self.in_flight(),
            ),
        )
        for name, help_, value in gauges:
            gauge = GaugeMetricFamily(self.prefix + name, help_, labels=["model_name"])
            gauge.add_metric(labels, value)
            yield gauge
        yield self._waiting_by_reason(stats)
        if self.cache_config is not None:
            yield self._cache_config_info()
        if stats.max_lora:
            yield _lora_requests_info(self.prefix, stats)
        for attr, (name, help_) in _COUNTERS.items():
            counter = CounterMetricFamily(self.prefix + name, help_, labels=["model_name"])
            counter.add_metric(labels, getattr(stats, attr))
            yield counter
        if stats.kv_connector is not None:
            yield from _kv_connector_metrics(self.prefix, self.model_name, stats.kv_connector)

    def _waiting_by_reason(self, stats) -> GaugeMetricFamily:
        """vLLM's split of the waiting requests: held back by a passing condition (deferred:
        a grammar compiling, an adapter without a slot) or waiting for room (capacity); the
        two add up to ``num_requests_waiting``."""
        gauge = GaugeMetricFamily(
            self.prefix + "num_requests_waiting_by_reason",
            "Waiting requests by reason: capacity (room in the batch or the KV cache) or "
            "deferred (a passing condition); the two add up to num_requests_waiting.",
            labels=["model_name", "reason"],
        )
        deferred = stats.num_waiting_deferred
        gauge.add_metric([self.model_name, "capacity"], stats.num_waiting - deferred)
        gauge.add_metric([self.model_name, "deferred"], deferred)
        return gauge

    def _cache_config_info(self) -> GaugeMetricFamily:
        """vLLM's info-style gauge: 1, with each field of the KV cache's configuration as a
        label (``num_blocks``, given by --num-gpu-blocks-override, under vLLM's name)."""
        info = {
            ("num_gpu_blocks_override" if key == "num_blocks" else key): str(value)
            for key, value in dataclasses.asdict(self.cache_config).items()
        }
        info["model_name"] = self.model_name
        gauge = GaugeMetricFamily(
            self.prefix + "cache_config_info",
            "The KV cache's configuration (in the labels).",
            labels=list(info),
        )
        gauge.add_metric(list(info.values()), 1)
        return gauge


_KV_CONNECTOR_METRICS = (
    # (attribute of KVConnectorStats, metric name, help, label, counter?)
    ("hit_tokens", "kv_connector_hit_tokens", "Prompt tokens a KV connector supplied.", "tier", 1),
    ("loaded_bytes", "kv_connector_loaded_bytes", "Bytes loaded into the KV cache.", "tier", 1),
    ("saved_bytes", "kv_connector_saved_bytes", "Bytes saved out of the KV cache.", "tier", 1),
    ("load_seconds", "kv_connector_load_seconds", "Time from loads' start to their blocks in "
     "the KV cache (under each load's slowest tier).", "tier", 1),
    ("loads", "kv_connector_loads", "Loads into the KV cache (by slowest tier).", "tier", 1),
    ("rejected_blocks", "kv_connector_rejected_blocks", "Blocks refused by their header "
     "(mismatch) or checksum (corrupt), never loaded.", "reason", 1),
    ("dropped_saves", "kv_connector_dropped_saves", "Blocks not saved (a tier could not take "
     "them in time).", "tier", 1),
    ("tier_bytes", "kv_connector_tier_bytes", "Bytes of blocks a tier holds.", "tier", 0),
    ("tier_blocks", "kv_connector_tier_blocks", "Blocks a tier holds.", "tier", 0),
)  # fmt: skip


def _kv_connector_metrics(prefix: str, model_name: str, stats) -> Iterator[Metric]:
    """A KV connector's counters and gauges (``KVConnectorStats``), one series per tier (or
    reason); ``failed_loads``: loads that brought fewer blocks than asked."""
    for attr, name, help_, label, is_counter in _KV_CONNECTOR_METRICS:
        family = CounterMetricFamily if is_counter else GaugeMetricFamily
        metric = family(prefix + name, help_, labels=["model_name", label])
        for key, value in sorted(getattr(stats, attr).items()):
            metric.add_metric([model_name, key], value)
        yield metric
    failed = CounterMetricFamily(
        prefix + "kv_connector_failed_loads",
        "Loads that brought fewer blocks than asked (the rest recomputed).",
        labels=["model_name"],
    )
    failed.add_metric([model_name], stats.failed_loads)
    yield failed


def _lora_requests_info(prefix: str, stats) -> GaugeMetricFamily:
    """vLLM's ``vllm:lora_requests_info``: the adapters of the running and the waiting requests
    as labels (comma-separated names), the value the time of the reading."""
    labels = ["max_lora", "running_lora_adapters", "waiting_lora_adapters"]
    gauge = GaugeMetricFamily(
        prefix + "lora_requests_info", "Running and waiting LoRA adapters.", labels=labels
    )
    running, waiting = ",".join(stats.running_lora_adapters), ",".join(stats.waiting_lora_adapters)
    gauge.add_metric([str(stats.max_lora), running, waiting], time.time())
    return gauge
