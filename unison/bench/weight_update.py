"""`unison bench weight-update`: how long a weight update holds the engine, idle, 5 times each (the
core's own timing, in the result's message, and the whole call's):
- `update_weights_from_disk`: the embedded GGUF reloaded in place (int4, as it runs on CPU);
- `update_weights_from_tensor`: every tensor of the same model, float32, as a trainer on this
  host would send them, into an engine running it unquantized."""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections.abc import Callable


def timed(update: Callable[[], tuple[bool, str] | tuple[bool, str, int]], runs: int) -> str:
    """The update `runs` times: the core's seconds (read from its message) and the call's."""
    core, call = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        ok, message = update()[:2]
        call.append(time.perf_counter() - t0)
        if not ok:
            raise RuntimeError(message)
        seconds = re.search(r"in ([\d.]+) s", message)
        if seconds is None:
            raise RuntimeError(f"no time in the update's message: {message}")
        core.append(float(seconds.group(1)))
    return (f"in the core: median {statistics.median(core):.2f} s {core}; "
            f"the call: median {statistics.median(call):.2f} s {[round(c, 2) for c in call]}")


def main(args: argparse.Namespace) -> int:
    from unison import Engine
    from unison.model.weights.loader import default_gguf_path, open_weights

    gguf = str(default_gguf_path())
    with Engine(max_total_tokens=4096) as engine:
        print(f"update_weights_from_disk (GGUF, int4): "
              f"{timed(lambda: engine.update_weights_from_disk(gguf), args.runs)}")

    source, _ = open_weights(gguf)
    tensors = [(name, source.float(name).float()) for name in sorted(source.names())
               if name.startswith("model.")]
    mib = sum(t.numel() * t.element_size() for _, t in tensors) / (1 << 20)
    with Engine(model_path=gguf, quantization="none", max_total_tokens=4096) as engine:
        print(f"update_weights_from_tensor ({len(tensors)} tensors, {mib:.0f} MiB float32): "
              f"{timed(lambda: engine.update_weights_from_tensor(tensors), args.runs)}")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("weight-update", help="how long a weight update holds the engine")
    p.add_argument("--runs", type=int, default=5)
    p.set_defaults(func=main)
