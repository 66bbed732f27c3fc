"""The linear-layer ceiling of a run: the model's own GEMMs, timed alone at the run's step shapes.

The engine core counts how many forwards ran with each (tokens, logits rows) shape. Every forward
runs each layer's four linears (fused QKV, output, fused gate/up, down) over all its tokens and
the LM head over its logits rows; nothing else in it can be cheaper than those. Timing exactly
those GEMMs, with the same packed weights, at the same thread count, gives the time a run would
take if attention, norms, sampling and all Python cost nothing: the ceiling that a run's
throughput is a fraction of.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import torch

from unison.model.decoder import DecoderModel

EXACT_LIMIT = 32  # more distinct sizes than this: time a grid of them and interpolate


def shape_counts(step_shapes: Shapes) -> Counter[tuple[int, int]]:
    return Counter({(t, rows): n for t, rows, n in step_shapes})


Shapes = list[tuple[int, int, int]]  # GetStepShapes' rows: (tokens, logits rows, forwards)


def subtract(after: Shapes, before: Shapes) -> Counter[tuple[int, int]]:
    """The steps of one run: the core's counts after it minus those before it."""
    return shape_counts(after) - shape_counts(before)


def _best_of(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm: oneDNN picks and caches its kernel for the shape on first use
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _grid(sizes: set[int]) -> list[int]:
    if len(sizes) <= EXACT_LIMIT:
        return sorted(sizes)
    lo, hi = min(sizes), max(sizes)
    points, m = {lo, hi}, 1.0
    while m < hi:  # about 12 points per doubling... coarse enough to stay quick, fine enough
        m *= 1.06  # that GEMM time (piecewise linear in M) interpolates to within a few percent
        points.add(min(hi, max(lo, round(m))))
    return sorted(points)


def _timer(sizes: set[int], measure: Callable[[int], float]) -> Callable[[int], float]:
    """Time per size: measured at each size (or a grid of them), linear in between."""
    if not sizes:
        return lambda m: 0.0
    grid = _grid(sizes)
    times = {m: measure(m) for m in grid}

    def at(m: int) -> float:
        if m in times:
            return times[m]
        hi = next(g for g in grid if g > m)
        lo = max(g for g in grid if g < m)
        return times[lo] + (times[hi] - times[lo]) * (m - lo) / (hi - lo)
    return at


def total(shapes: Counter[tuple[int, int]], layers: Callable[[int], float],
          head: Callable[[int], float]) -> float:
    return sum(n * (layers(t) + (head(rows) if rows else 0.0)) for (t, rows), n in shapes.items())


def linears_time(model: DecoderModel, shapes: Counter[tuple[int, int]], reps: int = 3) -> float:
    """Seconds the run's steps spend in the model's linear layers alone (best of `reps`)."""
    cfg = model.cfg

    def layers(m: int) -> float:
        x = torch.randn(m, cfg.hidden_size, dtype=model.dtype)
        a = torch.randn(m, cfg.num_attention_heads * cfg.head_dim, dtype=model.dtype)  # attention out
        y = torch.randn(m, cfg.intermediate_size, dtype=model.dtype)

        def run() -> None:
            for layer in model.layers:
                if layer.qkv is not None and layer.o_proj is not None:  # not a linear-attention layer
                    layer.qkv(x), layer.o_proj(a)
                if layer.gate_up is not None and layer.down is not None:  # not a mixture of experts
                    layer.gate_up(x), layer.down(y)
        return _best_of(run, reps)

    with torch.inference_mode():
        return total(shapes, _timer({t for t, _ in shapes}, layers),
                     _timer({rows for _, rows in shapes if rows}, lambda m: lm_head_time(model, m, reps)))


def lm_head_time(model: DecoderModel, m: int, reps: int = 3) -> float:
    """Seconds of the LM head on `m` rows (best of `reps`)."""
    x = torch.randn(m, model.cfg.hidden_size, dtype=model.dtype)
    with torch.inference_mode():
        return _best_of(lambda: model.lm_head(x), reps)


def measure(model_path: str | None, shapes: Counter[tuple[int, int]], num_threads: int | None,
            quantization: str = "auto") -> float:
    """The ceiling of a run on `model_path`, with its linears as the engine ran them."""
    from unison.model.runner import ModelRunner

    if num_threads:
        torch.set_num_threads(num_threads)
    runner = ModelRunner(model_path, quantization=quantization, num_blocks=1)
    return linears_time(runner.model, shapes)
