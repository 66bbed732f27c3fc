"""How long a weight update holds the engine, idle, 5 times each (the core's own timing, in the
result's message, and the whole call's):
- `update_weights_from_disk`: the embedded GGUF reloaded in place (int4, as it runs on CPU);
- `update_weights_from_tensor`: every tensor of the same model, float32, as a trainer on this
  host would send them, into an engine running it unquantized."""

import re
import statistics
import time

from unison import Engine
from unison.model.loader import default_gguf_path, open_weights

GGUF = str(default_gguf_path())


def timed(update, runs: int = 5) -> str:
    core, call = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        ok, message = update()[:2]
        call.append(time.perf_counter() - t0)
        assert ok, message
        core.append(float(re.search(r"in ([\d.]+) s", message).group(1)))
    return (f"in the core: median {statistics.median(core):.2f} s {core}; "
            f"the call: median {statistics.median(call):.2f} s {[round(c, 2) for c in call]}")


with Engine(max_total_tokens=4096) as engine:
    print(f"update_weights_from_disk (GGUF, int4): {timed(lambda: engine.update_weights_from_disk(GGUF))}")

source, _ = open_weights(GGUF)
tensors = [(name, source.float(name).float()) for name in sorted(source.names()) if name.startswith("model.")]
mib = sum(t.numel() * t.element_size() for _, t in tensors) / (1 << 20)
with Engine(model_path=GGUF, quantization="none", max_total_tokens=4096) as engine:
    print(f"update_weights_from_tensor ({len(tensors)} tensors, {mib:.0f} MiB float32): "
          f"{timed(lambda: engine.update_weights_from_tensor(tensors))}")
