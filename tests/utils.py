"""Test helpers: the one rule for comparing greedy outputs, the Hugging Face reference, and
waiting on a condition (never a fixed sleep) before an assertion."""

from __future__ import annotations

import asyncio
import functools
import os
import time
from pathlib import Path

import httpx

# One client for the suite's HTTP calls: httpx's module-level get / post build a client, and its TLS
# context (the CA bundle read and parsed), per call: two minutes of the suite's CPU went to that,
# mostly in polls for a server's readiness. No keep-alive, so each call is still a new connection
# (the tests that reach several HTTP workers rely on that).
HTTP = httpx.Client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))

# Prompts of every kind (prose, code, a list, a long sentence): the model and quantization tests'
# greedy references run on them.
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
    "Photosynthesis is the process by which plants convert sunlight into chemical energy. "
    "It takes place mainly in the leaves, where",
]

TOP_N = 5
MAX_GAP = 0.1  # a divergence is tolerated only where the reference's top-2 logprobs are this close


def _top(logprobs: dict[int, float], n: int = TOP_N) -> list[int]:
    return sorted(logprobs, key=logprobs.__getitem__, reverse=True)[:n]


def assert_greedy_close(ref_ids: list[int], ref_top: list[dict[int, float]], got_ids: list[int],
                        got_top: list[dict[int, float]] | None = None, name: str = "",
                        max_gap: float = MAX_GAP) -> None:
    """Token-exact, or diverging only at a near-tie of the reference (vLLM's check_logprobs_close).

    At the first position where the tokens differ, the reference's top-2 logprob gap must be
    < max_gap and each side's token must be in the other's top-5 (only the got token in the
    reference's when `got_top` is None). Nothing after the first divergence is compared: the
    sequences legitimately differ from there on. (Quantized weights against float32 allow a
    wider gap: they move logprobs by more than batch shapes do.)
    """
    where = f"{name}: " if name else ""
    for i, (r, g) in enumerate(zip(ref_ids, got_ids)):
        if r == g:
            continue
        ranked = _top(ref_top[i])
        gap = ref_top[i][ranked[0]] - ref_top[i][ranked[1]] if len(ranked) > 1 else float("inf")
        problems = []
        if gap >= max_gap:
            problems.append(f"reference top-2 gap {gap:.4f} >= {max_gap}")
        if g not in ranked:
            problems.append(f"got token {g} not in reference top-{TOP_N} {ranked}")
        if got_top is not None and r not in _top(got_top[i]):
            problems.append(f"reference token {r} not in got top-{TOP_N} {_top(got_top[i])}")
        if problems:
            raise AssertionError(f"{where}greedy outputs diverge at position {i}: reference token "
                                 f"{r}, got {g}, gap {gap:.4f}: {'; '.join(problems)}\n"
                                 f"  reference: {ref_ids}\n  got:       {got_ids}")
        return
    if len(ref_ids) != len(got_ids):
        raise AssertionError(f"{where}same tokens but different lengths: reference {len(ref_ids)}, "
                             f"got {len(got_ids)}\n  reference: {ref_ids}\n  got:       {got_ids}")


# The device the model-parity tests run Unison on: cpu, or cuda (UNISON_TEST_DEVICE=cuda, as
# `make device-check` sets it). transformers' reference always runs on the CPU, in float32.
TEST_DEVICE = os.environ.get("UNISON_TEST_DEVICE", "cpu")


def on_test_device() -> dict[str, str]:
    """ModelRunner options for Unison's side of a parity test: the test device, in float32 (the
    reference's dtype; on CUDA the default would be bf16)."""
    if TEST_DEVICE != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"UNISON_TEST_DEVICE={TEST_DEVICE}, but torch {torch.__version__} sees "
                               "no CUDA device")
    return {"device": TEST_DEVICE, "dtype": "float32"}


def hf_model(path=None):
    """A GGUF (default: the embedded one) as transformers' own GGUF loader builds it (never
    Unison's cache), once per test run. The embedded model's is rebuilt from what that loader
    built once per machine (its config and tensors, in the test-model cache): several processes of
    a run want it, and the loader takes ~17 s of CPU in each (it walks the file's vocabulary in
    Python); rebuilding takes 1.5 s, with the loader's logits bit for bit."""
    path = _gguf(path)
    return _hf_rebuilt(path) if path == _gguf(None) else _gguf_loader(path)


def _gguf(path) -> Path:
    from unison.model.weights.loader import default_gguf_path

    return Path(path or default_gguf_path())


@functools.cache
def _gguf_loader(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32)
    return model.eval()


@functools.cache
def _hf_rebuilt(path: Path):
    """_gguf_loader(path)'s model, from its config and tensors as that loader built them."""
    import inspect

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.references import cached_json

    config = dict(cached_json(path, inspect.getsource(_gguf_loader),
                              lambda: _gguf_loader(path).config.to_dict()))
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config),
                                             dtype=torch.float32)
    model.load_state_dict(hf_state_dict(path))  # strict: every tensor the loader built, no other
    return model.eval()


def hf_state_dict(path=None) -> dict:
    """The tensors transformers' GGUF loader builds for `path`. Loaded once per machine and kept in
    the test-model cache (tests/references.py)."""
    import inspect

    from tests.references import cached_tensors

    path = _gguf(path)
    return cached_tensors(path, inspect.getsource(_gguf_loader), lambda: _gguf_loader(path).state_dict())


def hf_reference(prompts_ids: list[list[int]], max_new_tokens: int, path=None,
                 ) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Greedy continuations by transformers on a GGUF (default: the embedded one): (ids, top-5
    logprobs at each new position) per prompt. Computed once per machine and kept in the
    test-model cache (tests/references.py), keyed by the file, the versions and this code."""
    import inspect

    from tests.references import cached_reference

    path = _gguf(path)
    code = inspect.getsource(_gguf_loader) + inspect.getsource(_hf_rebuilt) + inspect.getsource(_hf_greedy)
    return cached_reference(path, code, prompts_ids, max_new_tokens,
                            lambda: _hf_greedy(hf_model(path), prompts_ids, max_new_tokens))


def _hf_greedy(model, prompts_ids: list[list[int]], max_new_tokens: int,
               ) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Generates exactly max_new_tokens (no stop on EOS), one prompt at a time: no padding, so
    the reference is transformers at its plainest."""
    import inspect

    import torch
    from transformers import DynamicCache

    # transformers renamed past_key_values to cache; accept either version
    params = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    results = []
    # A hybrid (linear-attention layers) needs its config to make the cache's recurrent layers.
    types = getattr(model.config, "layer_types", None) or []
    hybrid = {"config": model.config} if "linear_attention" in types else {}
    with torch.inference_mode():
        for prompt in prompts_ids:
            ids, tops, cache = [], [], DynamicCache(**hybrid)
            step = torch.tensor([prompt])
            for _ in range(max_new_tokens):
                logits = model(step, use_cache=True, **{cache_arg: cache}).logits[0, -1].float()
                logprobs = torch.log_softmax(logits, dim=-1)
                values, indices = logprobs.topk(TOP_N)
                tops.append(dict(zip(indices.tolist(), values.tolist())))
                ids.append(int(logits.argmax()))
                step = torch.tensor([[ids[-1]]])
            results.append((ids, tops))
    return results


# ---- driving a ModelRunner directly (no scheduler) --------------------------------------------
# torch is imported inside: spawned test children import this module and must stay torch-free.

class Blocks:
    """The simplest allocator: consecutive fresh blocks per request."""

    def __init__(self, runner):
        self.runner, self.next = runner, 0

    def table(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // self.runner.block_size)
        assert self.next + n <= self.runner.num_blocks
        self.next += n
        return list(range(self.next - n, self.next))


def top_logprobs(logits, n: int = 5) -> list[dict[int, float]]:
    import torch

    values, indices = torch.log_softmax(logits.float(), dim=-1).topk(n)
    return [dict(zip(i.tolist(), v.tolist())) for i, v in zip(indices, values)]


def greedy(runner, prompts: list[list[int]], new_tokens: int):
    """All requests together: one forward prefills every prompt, then they decode in lockstep."""
    import torch

    from unison.model.runner import BatchItem

    blocks = Blocks(runner)
    tables = [blocks.table(len(p) + new_tokens) for p in prompts]
    outs: list[tuple[list[int], list[dict[int, float]]]] = [([], []) for _ in prompts]
    # (state_slot: a hybrid model's linear-attention state, one per request; others ignore it)
    batch = [BatchItem(list(p), 0, t, len(p) - 1, state_slot=i)
             for i, (p, t) in enumerate(zip(prompts, tables))]
    for _ in range(new_tokens):
        logits = runner.forward(batch)
        assert logits.shape == (len(prompts), runner.vocab_size) and logits.dtype == torch.float32
        for (ids, tops), top, row in zip(outs, top_logprobs(logits), logits):
            ids.append(int(row.argmax()))
            tops.append(top)
        batch = [BatchItem([ids[-1]], b.start_pos + len(b.token_ids), b.block_table, 0,
                           state_slot=b.state_slot)
                 for b, (ids, _) in zip(batch, outs)]
    return outs


# ---- waiting on a condition, never a fixed sleep, before an assertion -------------------------

def wait_until(predicate, timeout: float = 10.0, what: str = "the condition", interval: float = 0.02):
    """Poll until `predicate()` is truthy and return its value; an AssertionError naming `what`
    once `timeout` seconds have passed. A predicate may raise itself to fail at once, where what
    it sees can no longer turn into what is awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(interval)


async def wait_until_async(predicate, timeout: float = 10.0, what: str = "the condition",
                           interval: float = 0.02):
    """wait_until for a coroutine: `predicate` is a plain function, run in a worker thread (it may
    block, e.g. on an Engine's sync methods), and the loop keeps running between polls."""
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        await asyncio.sleep(interval)
