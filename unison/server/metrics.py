"""/metrics: the core's engine-wide numbers in Prometheus text format, with prometheus_client.

Every worker renders the same ServerInfo, so any worker answers alike. The names are vLLM's with
its `vllm:` prefix as `unison:` (`vllm:kv_cache_usage_perc` -> `unison:kv_cache_usage_perc`), so
dashboards built for vLLM port with a prefix change. A registry of its own per scrape: no
`process_*` or `python_gc_*` metrics of whichever worker answered get mixed into them.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from unison.wire.messages import HistogramData, ServerInfo, SpecDecodeStats

PREFIX = "unison:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
HISTOGRAMS = {  # ServerInfo.histograms key -> (name, help)
    "time_to_first_token_seconds": ("time_to_first_token_seconds", "Time to first token."),
    "inter_token_latency_seconds": ("inter_token_latency_seconds", "Time between consecutive tokens."),
    "time_per_output_token_seconds": ("request_time_per_output_token_seconds",
                                      "Mean time per output token after the first, per request."),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds", "End-to-end request latency."),
    "request_queue_time_seconds": ("request_queue_time_seconds", "Time from arrival to the first step."),
}


class _EngineCollector:
    """One engine's metrics; `labels` tell it from the others: `engine` among data-parallel
    replicas, `model_name` among several models (vLLM's)."""

    def __init__(self, info: ServerInfo, labels: dict[str, str]) -> None:
        self.info, self.labels = info, labels

    def collect(self) -> Iterator[Metric]:
        info, stats = self.info, self.info.stats
        _gauge, _counter, _histogram = (functools.partial(f, labels=self.labels)
                                        for f in (_gauge_of, _counter_of, _histogram_of))
        yield _gauge("num_requests_running", "Requests in the running batch.", info.num_running)
        yield _gauge("num_requests_waiting", "Requests waiting for admission.", info.num_waiting)
        yield _gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (0-1).",
                     info.kv_blocks_used / max(info.core.num_blocks, 1))
        yield _gauge("num_frontends", "Attached frontends (tokenizer workers).", len(info.frontends))
        yield _counter("prompt_tokens", "Prompt tokens of finished requests.", stats.prompt_tokens)
        yield _counter("generation_tokens", "Generated tokens.", stats.generation_tokens)
        yield _counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                       stats.prefix_cache_queries)
        yield _counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                       stats.prefix_cache_hits)
        yield _counter("num_preemptions", "Requests preempted for KV blocks.", stats.num_preemptions)
        yield _counter("request_success", "Requests that finished (not aborted).", stats.num_finished)
        yield _counter("request_aborted", "Requests aborted or refused while running.", stats.num_aborted)
        for key, (name, doc) in HISTOGRAMS.items():
            yield _histogram(name, doc, info.histograms[key])
        if stats.spec_decode is not None:
            yield from _spec_decode(stats.spec_decode, self.labels)
        if info.config.enable_lora:
            yield from _lora(info, self.labels)


def _lora(info: ServerInfo, labels: dict[str, str]) -> Iterator[Metric]:
    """vLLM's lora_requests_info (a gauge whose labels name the adapters running and waiting),
    and requests per adapter."""
    adapters = info.lora_adapters
    names = {"max_lora": str(info.config.max_loras_per_batch),
             "running_lora_adapters": ",".join(a.name for a in adapters if a.running),
             "waiting_lora_adapters": ",".join(a.name for a in adapters if a.waiting)}
    family = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running stats on LoRA requests.",
                               labels=[*labels, *names])
    family.add_metric([*labels.values(), *names.values()], time.time())
    yield family
    served = CounterMetricFamily(PREFIX + "lora_requests", "Requests per LoRA adapter loaded now.",
                                 labels=[*labels, "lora_name"])
    for a in adapters:
        served.add_metric([*labels.values(), a.name], a.served)
    yield served


def _spec_decode(spec: SpecDecodeStats, labels: dict[str, str]) -> Iterator[Metric]:
    """vLLM's spec-decode counters (vllm:spec_decode_* as unison:spec_decode_*)."""
    yield _counter_of("spec_decode_num_drafts", "Drafts verified.", spec.num_drafts, labels)
    yield _counter_of("spec_decode_num_draft_tokens", "Tokens drafted.", spec.num_draft_tokens, labels)
    yield _counter_of("spec_decode_num_accepted_tokens", "Drafted tokens accepted.",
                      spec.num_accepted_tokens, labels)
    family = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                 "Drafted tokens accepted, per position in the draft.",
                                 labels=[*labels, "position"])
    for pos, count in enumerate(spec.accepted_per_pos):
        family.add_metric([*labels.values(), str(pos)], count)
    yield family


def _gauge_of(name: str, doc: str, value: float, labels: dict[str, str]) -> Metric:
    family = GaugeMetricFamily(PREFIX + name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def _counter_of(name: str, doc: str, value: float, labels: dict[str, str]) -> Metric:
    family = CounterMetricFamily(PREFIX + name, doc, labels=list(labels))  # exposed as <name>_total
    family.add_metric(list(labels.values()), value)
    return family


def _histogram_of(name: str, doc: str, h: HistogramData, labels: dict[str, str]) -> Metric:
    cumulative, buckets = 0, []
    for bound, count in zip(h.buckets, h.counts):
        cumulative += count
        buckets.append((repr(float(bound)), cumulative))
    buckets.append(("+Inf", h.count))
    family = HistogramMetricFamily(PREFIX + name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), buckets, sum_value=h.sum)
    return family


class _Engines:
    """Every engine's metrics as one family per name, a sample set per engine's labels."""

    def __init__(self, infos: list[ServerInfo], labels: list[dict[str, str]] | None) -> None:
        self.collectors = [_EngineCollector(i, one) for i, one in zip(infos, labels or [{}] * len(infos))]

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for collector in self.collectors:
            for family in collector.collect():
                if family.name in merged:
                    merged[family.name].samples += family.samples
                else:
                    merged[family.name] = family
        yield from merged.values()


def render_metrics(infos: list[ServerInfo], labels: list[dict[str, str]] | None = None) -> bytes:
    """The engine's metrics; several engines': each one's with its labels (engine="i" for a
    data-parallel replica, model_name="..." for one of several models)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Engines(infos, labels))
    return generate_latest(registry)
