"""What the core measures: latency histograms at its own step times, and step shapes on request.

Kept in the core so every frontend reports the same engine-wide numbers, and measured when the
core produced a token rather than when a frontend delivered it: a consumer that reads late, and
gets several tokens merged into one delta, does not distort them.
"""

from __future__ import annotations

import bisect
import os
from collections import Counter

from unison.wire.messages import HistogramData

BUCKETS = {  # upper bounds in seconds, as vLLM's
    "time_to_first_token_seconds": (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    "inter_token_latency_seconds": (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
    "time_per_output_token_seconds": (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
    "e2e_request_latency_seconds": (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
    "request_queue_time_seconds": (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0),
}


class Histogram:
    __slots__ = ("buckets", "counts", "sum", "count")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.sum += value
        self.count += 1

    def data(self) -> HistogramData:
        return HistogramData(list(self.buckets), list(self.counts), self.sum, self.count)


class LatencyMetrics:
    def __init__(self) -> None:
        self.hists = {name: Histogram(b) for name, b in BUCKETS.items()}
        self.ttft = self.hists["time_to_first_token_seconds"]
        self.itl = self.hists["inter_token_latency_seconds"]
        self.queue = self.hists["request_queue_time_seconds"]

    def finished(self, arrival: float, first_token: float | None, last_token: float | None,
                 num_output_tokens: int, now: float) -> None:
        self.hists["e2e_request_latency_seconds"].observe(now - arrival)
        if first_token is not None and last_token is not None and num_output_tokens > 1:
            tpot = (last_token - first_token) / (num_output_tokens - 1)
            self.hists["time_per_output_token_seconds"].observe(tpot)

    def data(self) -> dict[str, HistogramData]:
        return {name: h.data() for name, h in self.hists.items()}


RECORD_STEP_SHAPES_ENV = "UNISON_RECORD_STEP_SHAPES"
MAX_STEP_SHAPES = 4096  # distinct shapes counted; later new ones are not


class StepShapes:
    """How many forwards ran with each (tokens, logits rows): what `bench offline` times the
    model's linears at for its ceiling. Installed as the core's step hook only when the core's
    environment asks for it, so normal serving pays nothing."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[int, int]] = Counter()

    @classmethod
    def from_env(cls) -> StepShapes | None:
        return cls() if os.environ.get(RECORD_STEP_SHAPES_ENV) == "1" else None

    def __call__(self, num_tokens: int, num_logits: int) -> None:
        shape = (num_tokens, num_logits)
        if shape in self.counts or len(self.counts) < MAX_STEP_SHAPES:
            self.counts[shape] += 1

    def rows(self) -> list[tuple[int, int, int]]:
        return [(t, rows, n) for (t, rows), n in sorted(self.counts.items())]
