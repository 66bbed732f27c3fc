"""How long `update_weights_from_disk` holds the engine: the embedded GGUF reloaded in place, 5
times, idle (the core's own timing, in the result's message, and the call's)."""

import re
import statistics
import time

from unison import Engine
from unison.model.loader import default_gguf_path

with Engine(max_total_tokens=4096) as engine:
    core, call = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        ok, message, _ = engine.update_weights_from_disk(str(default_gguf_path()))
        call.append(time.perf_counter() - t0)
        assert ok, message
        core.append(float(re.search(r"in ([\d.]+) s", message).group(1)))
    print(f"load in the core: median {statistics.median(core):.2f} s {core}; "
          f"the call: median {statistics.median(call):.2f} s")
