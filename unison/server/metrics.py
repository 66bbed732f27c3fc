"""Prometheus text format for the engine-wide numbers the core owns (any worker answers alike)."""

from __future__ import annotations

from unison.protocol import ServerInfo

PREFIX = "unison"
HISTOGRAMS = {
    "time_to_first_token_seconds": "Time to first token.",
    "inter_token_latency_seconds": "Time between consecutive output tokens of a request.",
    "time_per_output_token_seconds": "Mean time per output token after the first, per request.",
    "e2e_request_latency_seconds": "End-to-end request latency.",
    "request_queue_time_seconds": "Time from arrival to the first step.",
}


def render_metrics(info: ServerInfo) -> str:
    stats = info.stats
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, value: float) -> None:
        lines.extend([f"# HELP {PREFIX}_{name} {help_}", f"# TYPE {PREFIX}_{name} {kind}",
                      f"{PREFIX}_{name} {value}"])

    metric("num_requests_running", "gauge", "Requests in the running batch.", info.num_running)
    metric("num_requests_waiting", "gauge", "Requests waiting for admission.", info.num_waiting)
    metric("kv_blocks_used", "gauge", "KV cache blocks in use.", info.kv_blocks_used)
    metric("kv_blocks_total", "gauge", "KV cache blocks in all.", info.core.num_blocks)
    metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", stats.prompt_tokens)
    metric("generation_tokens_total", "counter", "Generated tokens.", stats.generation_tokens)
    metric("num_preemptions_total", "counter", "Requests preempted for KV blocks.", stats.num_preemptions)
    metric("num_frontends", "gauge", "Attached frontends.", len(info.frontends))
    for name, help_ in HISTOGRAMS.items():
        hist = info.histograms[name]
        lines += [f"# HELP {PREFIX}_{name} {help_}", f"# TYPE {PREFIX}_{name} histogram"]
        cumulative = 0
        for bound, count in zip(hist.buckets, hist.counts):
            cumulative += count
            lines.append(f'{PREFIX}_{name}_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'{PREFIX}_{name}_bucket{{le="+Inf"}} {hist.count}')
        lines.append(f"{PREFIX}_{name}_sum {hist.sum}")
        lines.append(f"{PREFIX}_{name}_count {hist.count}")
    return "\n".join(lines) + "\n"
