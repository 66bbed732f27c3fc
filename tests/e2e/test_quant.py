"""Quantized weights through the whole engine: batch invariance on every path, and the core's
memory as the weights as executed (the kernels and quality in-process: tests/unit/test_quant.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_quant import KERNELS
from unison import Engine
from unison.model.weights.loader import default_gguf_path

pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler here: no quantized kernels")


# ---- the engine: batch invariance, what runs as what, memory ------------------------------------

INVARIANCE_PROMPTS = [f"{i + 1}. {t}" for i, t in enumerate(
    ["The capital of France is", "Water boils at", "Once upon a time", "List three fruits:",
     "The three primary colors are", "def add(a, b):", "In 1969, the first person on the moon was",
     "My favourite book is", "The speed of light is", "A haiku about rain:", "SELECT * FROM",
     "Dear diary, today", "The largest planet is", "Roses are red,", "import numpy as np",
     "Q: What is 2 + 2? A:"])]


@pytest.mark.parametrize("kind", ["int8", "int4/avx2", "int4/vnni", "int4/amx"])
def test_batch_invariance(kind: str, monkeypatch: pytest.MonkeyPatch):
    """The same 16 prompts alone and together give identical tokens, on each path. (No prefix
    cache: a hit prefills through another attention shape, a different float sum.)"""
    quantization, _, path = kind.partition("/")
    if path:
        if path not in KERNELS.supported_quant_paths():
            pytest.skip(f"this CPU or build cannot run the {path} path")
        monkeypatch.setenv("UNISON_QUANT_KERNEL", path)  # the core process inherits it
    path = path or KERNELS.supported_quant_paths()[-1]  # the fastest, as an engine picks
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    with Engine(quantization=quantization, disable_radix_cache=True) as engine:
        info = engine.get_server_info()
        assert info["quantization"] == quantization and info["kv_cache_dtype"] == "float16"
        weights = info["weights"]
        assert weights["embed_tokens"] == "q8_0" and weights["lm_head"] == f"q8_0/{path}"  # as stored
        assert weights["layers.0.qkv"] == f"{quantization}/{path}"
        alone = [engine.generate(p, params)["output_ids"] for p in INVARIANCE_PROMPTS]
        together = [o["output_ids"] for o in engine.generate(INVARIANCE_PROMPTS, params)]
    assert together == alone


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.parametrize("model", ["embedded", "gemma3"])
def test_core_memory_is_the_weights_as_executed(model: str, request: pytest.FixtureRequest):
    """Peak RSS of the core, minus that of a dummy-weight core with the same KV cache, is within
    1.3x of the quantized weights' bytes: no float copy of the file exists at any point."""
    path = default_gguf_path() if model == "embedded" else request.getfixturevalue("gemma3_path")
    opts = {"model_path": str(path), "max_total_tokens": 8192, "num_threads": 1}
    with Engine(load_format="dummy", **opts) as dummy:
        base = _peak_rss(dummy.get_server_info()["core_pid"])
    with Engine(**opts) as engine:
        info = engine.get_server_info()
        peak = _peak_rss(info["core_pid"])
    size = path.stat().st_size
    print(f"\n[figure] {model}: core peak RSS over a dummy core: {(peak - base) / 2**20:.1f} MiB; "
          f"weights as executed {info['weights_bytes'] / 2**20:.1f} MiB; the file {size / 2**20:.1f} MiB")
    assert peak - base <= 1.3 * info["weights_bytes"]
    # Every tensor runs at the file's own bytes (the rest of the file: float norms, the tokenizer).
    assert info["weights_bytes"] < 1.03 * size


