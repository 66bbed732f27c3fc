"""Latency histograms, kept in the core so every frontend reports the same engine-wide numbers."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

BUCKETS = {
    "time_to_first_token_seconds": (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    "time_per_output_token_seconds": (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
    "e2e_request_latency_seconds": (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
}


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.sum += value
        self.count += 1

    def to_dict(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum,
                "count": self.count}


class LatencyMetrics:
    def __init__(self) -> None:
        self.hists = {name: Histogram(b) for name, b in BUCKETS.items()}

    def observe(self, ttft: float, tpot: float | None, e2e: float) -> None:
        self.hists["time_to_first_token_seconds"].observe(ttft)
        if tpot is not None:
            self.hists["time_per_output_token_seconds"].observe(tpot)
        self.hists["e2e_request_latency_seconds"].observe(e2e)

    def to_dict(self) -> dict:
        return {name: h.to_dict() for name, h in self.hists.items()}
