"""`unison bench bandwidth`: the memory's read speed and, for a model, the bytes one decode step
reads, so the bound on one stream's speed: bandwidth / step bytes tokens a second.

At one stream a decode step reads every weight once (every linear, each mixture's routed experts,
the LM head; a hybrid also reads and writes its linear-attention state) and does little arithmetic
with each byte: the memory sets the pace. The bandwidth is
measured as the kernels meet it (csrc/bandwidth.c: threads streaming 256-bit loads over a buffer
far past the caches), best of several trials, on the threads the core would use.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def measure(threads: int | None = None, gib: float = 1.0, trials: int = 5) -> float:
    """The best of `trials` reads of a buffer of `gib` GiB (far past the caches), in GB/s, on
    `threads` threads (default: torch's); 0.0 where the C kernels cannot be built here."""
    import torch

    from unison.model.kernels import cpu_kernels

    kernels = cpu_kernels.load()
    if kernels is None:
        return 0.0
    n = int(gib * 2**30) // 256 * 256
    buf = torch.ones(n + 64, dtype=torch.uint8)
    start = (-buf.data_ptr()) % 64  # aligned loads
    threads = threads or torch.get_num_threads()
    best = 0.0
    for _ in range(trials):
        t = time.perf_counter()
        kernels.lib.read_memory(buf.data_ptr() + start, n, threads)
        best = max(best, n / (time.perf_counter() - t) / 1e9)
    return best


def main(args: argparse.Namespace) -> int:
    import torch

    threads = args.num_threads or torch.get_num_threads()
    gbps = measure(threads, args.gib, args.trials)
    if not gbps:
        print("no C compiler here: nothing to measure with")
        return 1
    print(f"memory read bandwidth: {gbps:.1f} GB/s ({threads} threads, best of {args.trials} "
          f"over {args.gib:g} GiB)")
    step = 0
    if args.model_path is not None:
        from unison.model.runner import ModelRunner

        model = ModelRunner(args.model_path, num_blocks=1).model
        step = model.step_bytes()
        print(f"{args.model_path}: a decode step moves {step / 2**20:.1f} MiB (weights, a hybrid's state) "
              f"(all weights as executed: {model.weights_bytes() / 2**20:.1f} MiB)")
        print(f"one stream's bound: {gbps * 1e9 / step:.1f} tokens/s ({step / gbps / 1e6:.2f} ms a token)")
    if args.result_file:
        figures = {"read_gbps": gbps, "threads": threads, "step_bytes": step}
        Path(args.result_file).write_text(json.dumps(figures))
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bandwidth", help="memory read bandwidth, and a model's bytes per decode step "
                                         "(one stream's speed bound)")
    p.add_argument("--model-path", default=None, help="a GGUF file or model directory (default: none)")
    p.add_argument("--num-threads", type=int, default=None, help="threads reading (default: torch's)")
    p.add_argument("--gib", type=float, default=1.0, help="buffer size, far past the caches")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--result-file", default=None, help="also write the figures as JSON here")
    p.set_defaults(func=main)
