"""The Engine API end to end: a real core process running the embedded model."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import statistics
import threading
import time
from pathlib import Path

import pytest

from tests.utils import assert_greedy_close, hf_reference, wait_until, wait_until_async
from unison import Engine, EngineDeadError

GREEDY = {"temperature": 0, "max_new_tokens": 16}
PROMPTS = [
    "The capital of France is",
    "1 + 1 =",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at",
    "List three fruits:",
    "In 1969, the first person to walk on the moon was",
]


@pytest.fixture(scope="module")
def engine():
    # A short step budget forces long prompts through chunked prefill. The float32 reference
    # path: greedy outputs are compared with transformers' (tests/unit/test_quant.py has the rest).
    with Engine(chunked_prefill_size=64, max_running_requests=32, quantization="none") as e:
        yield e


@pytest.fixture(autouse=True)
def integrity(request):
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        wait_idle(eng)
        eng.check_integrity()


def wait_idle(engine: Engine, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = engine.get_server_info()
        if info["num_running"] + info["num_waiting"] == 0 and info["kv_blocks_used"] == 0:
            return info
        assert time.monotonic() < deadline, f"engine not idle: {info}"
        time.sleep(0.05)


def top_dicts(out: dict) -> list[dict[int, float]]:
    return [{tid: lp for lp, tid, _ in top} for top in out["meta_info"]["output_top_logprobs"]]


def test_capital_of_france(engine):
    out = engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
    assert out["text"].startswith(" Paris.")
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 8 == len(out["output_ids"])
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["cached_tokens"] == 0 and meta["e2e_latency"] > 0
    assert out["text"] == engine.tokenizer.decode(out["output_ids"])


PARITY_CHATS = ("What is the capital of Italy?", "Name a color.", "Say hello.", "What is 2 + 2?")
PARITY_TOKENS = 32


def parity_prompts(tok) -> list[str]:
    return PROMPTS + [tok.apply_chat_template([{"role": "user", "content": q}]) for q in PARITY_CHATS]


def hf_references() -> list[tuple[Path | None, list[list[int]], int]]:
    """The transformers references this module asks for: (GGUF, prompts, tokens) for
    hf_reference (tests/references.py computes them ahead of the tests, in the background)."""
    from unison.frontend.text.tokenizer import Tokenizer  # inside: spawned children import this module
    from unison.model.weights.loader import resolve_model_dir

    tok = Tokenizer.from_dir(resolve_model_dir(None))
    return [(None, [tok.encode(p) for p in parity_prompts(tok)], PARITY_TOKENS)]


def test_greedy_parity_with_transformers(engine):
    tok = engine.tokenizer
    prompts = parity_prompts(tok)
    ids = [tok.encode(p) for p in prompts]
    outs = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": PARITY_TOKENS,
                                                          "ignore_eos": True},
                           return_logprob=True, top_logprobs_num=5)
    refs = hf_reference(ids, PARITY_TOKENS)
    for prompt, out, (ref_ids, ref_top) in zip(prompts, outs, refs):
        assert_greedy_close(ref_ids, ref_top, out["output_ids"], top_dicts(out), name=prompt)
        first_ours, first_ref = top_dicts(out)[0], ref_top[0]
        assert set(first_ours) == set(first_ref), prompt
        for tid, lp in first_ref.items():
            assert abs(first_ours[tid] - lp) < 1e-3, (prompt, tid, first_ours[tid], lp)


def test_batch_of_prompts_with_n(engine):
    outs = engine.generate(PROMPTS[:3], {"max_new_tokens": 6, "n": 3, "sampling_seed": 7})
    assert len(outs) == 9
    for o in outs:
        assert o["meta_info"]["completion_tokens"] == 6
    # Children of one prompt use different seeds, so they rarely all agree.
    texts = {o["text"] for o in outs[:3]}
    assert len(texts) > 1


def test_streaming_is_cumulative_and_matches(engine):
    chunks = list(engine.generate(PROMPTS[2], GREEDY, stream=True))
    assert len(chunks) > 1
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"])
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] is not None
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    whole = engine.generate(PROMPTS[2], GREEDY)
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]


def test_stop_string_across_tokens_is_trimmed(engine):
    full = engine.generate(PROMPTS[2], {"temperature": 0, "max_new_tokens": 24})
    ids, tok = full["output_ids"], engine.tokenizer
    # A stop string that starts inside token 4 and ends inside token 6.
    prefix, upto = tok.decode(ids[:4]), tok.decode(ids[:6])
    start = len(prefix) - 2
    stop = upto[start:]
    assert len(stop) >= 3
    out = engine.generate(PROMPTS[2], {"temperature": 0, "max_new_tokens": 24, "stop": stop})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full["text"][: full["text"].index(stop)]
    assert out["output_ids"] == ids[: 6]  # ends at the token that completed the stop string
    chunks = list(engine.generate(PROMPTS[2], {"temperature": 0, "max_new_tokens": 24, "stop": stop},
                                  stream=True))
    assert all(stop not in c["text"] for c in chunks)
    assert chunks[-1]["text"] == out["text"]
    kept = engine.generate(PROMPTS[2], {"temperature": 0, "max_new_tokens": 24, "stop": stop,
                                        "no_stop_trim": True})
    assert kept["text"].endswith(stop)


def test_utf8_streaming_never_breaks_a_character(engine):
    tok = engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write the word 'hello' in Japanese, "
                                       "Chinese and Korean, then add three emoji."}])
    chunks = list(engine.generate(prompt, {"temperature": 0, "max_new_tokens": 48}, stream=True))
    final = chunks[-1]
    assert any(ord(ch) > 0x2000 for ch in final["text"]), final["text"]  # multi-byte output happened
    for c in chunks[:-1]:  # only the very end may hold a character cut off by max_new_tokens
        assert "\ufffd" not in c["text"]
    assert final["text"] == tok.decode(final["output_ids"])


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    params = {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 16, "sampling_seed": 1234}
    alone = engine.generate(PROMPTS[0], params)
    again = engine.generate(PROMPTS[0], params)
    assert alone["output_ids"] == again["output_ids"]
    batch = engine.generate(PROMPTS[:6], [dict(params, sampling_seed=s) for s in (1234, 1, 2, 3, 4, 5)])
    assert batch[0]["output_ids"] == alone["output_ids"]
    other_seed = engine.generate(PROMPTS[0], dict(params, sampling_seed=99))
    assert other_seed["output_ids"] != alone["output_ids"]


def test_top_k_1_equals_greedy(engine):
    greedy = engine.generate(PROMPTS[4], GREEDY)
    top1 = engine.generate(PROMPTS[4], {"temperature": 1.5, "top_k": 1, "max_new_tokens": 16})
    assert top1["output_ids"] == greedy["output_ids"]


def test_sampling_controls(engine):
    base = engine.generate(PROMPTS[1], {"temperature": 0, "max_new_tokens": 4})
    first = base["output_ids"][0]
    banned = engine.generate(PROMPTS[1], {"temperature": 0, "max_new_tokens": 4,
                                          "logit_bias": {str(first): -100}})
    assert banned["output_ids"][0] != first
    stopped = engine.generate(PROMPTS[1], {"temperature": 0, "max_new_tokens": 4, "stop_token_ids": [first]})
    assert stopped["output_ids"] == [first]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    forced = engine.generate(PROMPTS[1], {"temperature": 0, "max_new_tokens": 4, "min_new_tokens": 3,
                                          "stop_token_ids": [first]})
    assert len(forced["output_ids"]) >= 3 and first not in forced["output_ids"][:2]
    eos = engine.tokenizer.encode("<|im_end|>")[0]
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    short = engine.generate(chat, {"temperature": 0, "max_new_tokens": 64})
    assert short["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    long = engine.generate(chat, {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True})
    assert long["meta_info"]["completion_tokens"] == 64
    penal = engine.generate(PROMPTS[6], {"temperature": 0, "max_new_tokens": 24, "repetition_penalty": 1.3,
                                         "frequency_penalty": 0.5, "presence_penalty": 0.5})
    assert penal["meta_info"]["completion_tokens"] > 0


def test_prompt_only_and_prompt_logprobs(engine):
    prompt_ids = engine.tokenizer.encode(PROMPTS[0])
    out = engine.generate(input_ids=prompt_ids, sampling_params={"max_new_tokens": 0},
                          return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["finish_reason"]["type"] == "length"
    lps = meta["input_token_logprobs"]
    assert len(lps) == len(prompt_ids) and lps[0][0] is None
    assert [t for _, t, _ in lps] == prompt_ids
    assert len(meta["input_top_logprobs"]) == len(prompt_ids)
    # The prompt logprob of a token equals the output logprob that produced it.
    gen = engine.generate(input_ids=prompt_ids[:-1], sampling_params={"max_new_tokens": 1, "temperature": 0},
                          return_logprob=True)
    produced_lp, produced = gen["meta_info"]["output_token_logprobs"][0][:2]
    again = engine.generate(input_ids=prompt_ids[:-1] + [produced], sampling_params={"max_new_tokens": 1},
                            return_logprob=True, logprob_start_len=len(prompt_ids) - 1)
    assert again["meta_info"]["input_token_logprobs"][0][1] == produced
    assert abs(again["meta_info"]["input_token_logprobs"][0][0] - produced_lp) < 1e-3


def test_long_prompt_logprobs_span_chunks(engine):
    ids = engine.tokenizer.encode(" ".join(PROMPTS) * 3)  # > 64 tokens: several prefill chunks
    assert len(ids) > 150
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 2, "temperature": 0},
                          return_logprob=True, logprob_start_len=10)
    lps = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in lps] == ids[10:]
    assert all(lp is not None and lp <= 0 for lp, _, _ in lps)


def test_closing_a_stream_aborts_and_frees(engine):
    stream = engine.generate(PROMPTS[2], {"max_new_tokens": 500, "ignore_eos": True}, stream=True)
    next(stream), next(stream)
    assert engine.get_server_info()["num_running"] == 1
    stream.close()
    wait_idle(engine, timeout=3)
    unread = engine.generate(PROMPTS[2], {"max_new_tokens": 500, "ignore_eos": True}, stream=True)
    unread.close()  # never iterated: still aborted
    wait_idle(engine, timeout=3)


def test_async_generate_and_cancel(engine):
    asyncio.run(_async_generate_and_cancel(engine))


async def _async_generate_and_cancel(engine):
    out = await engine.async_generate(PROMPTS[0], {"max_new_tokens": 8, "temperature": 0})
    assert out["text"].startswith(" Paris.")
    greedy8 = {"max_new_tokens": 8, "temperature": 0}
    chunks = [c async for c in await engine.async_generate(PROMPTS[0], greedy8,
                                                           stream=True)]
    assert chunks[-1]["text"] == out["text"]
    outs = await asyncio.gather(*[engine.async_generate(p, GREEDY) for p in PROMPTS[:4]])
    alone = await asyncio.to_thread(engine.generate, PROMPTS[:4], GREEDY)
    assert [o["text"] for o in outs] == [o["text"] for o in alone]
    long = {"max_new_tokens": 500, "ignore_eos": True}
    generated_before = (await asyncio.to_thread(engine.get_server_info))["stats"]["generation_tokens"]
    task = asyncio.ensure_future(engine.async_generate(PROMPTS[1], long))

    def generated() -> int:  # by the long request: the engine runs nothing else now
        return engine.get_server_info()["stats"]["generation_tokens"] - generated_before

    def running() -> bool:
        return engine.get_server_info()["num_running"] == 1 and generated() > 0

    await wait_until_async(running, 10, "the long request to run and produce a token")
    await asyncio.to_thread(engine.pause_generation, "in_place")  # from here it cannot finish by itself
    try:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Gone, KV freed, while paused: the cancel aborted it, it did not run to its length.
        await asyncio.to_thread(wait_idle, engine, 3)
    finally:
        await asyncio.to_thread(engine.continue_generation)
    tokens = await asyncio.to_thread(generated)
    assert 0 < tokens < long["max_new_tokens"], f"the cancelled request generated {tokens} tokens"


def test_sync_generate_inside_running_loop_warns(engine):
    asyncio.run(_sync_generate_inside_loop(engine))


async def _sync_generate_inside_loop(engine):
    with pytest.warns(RuntimeWarning, match="blocks the running event loop"):
        out = engine.generate(PROMPTS[0], {"max_new_tokens": 8, "temperature": 0})
    assert out["text"].startswith(" Paris.")


def test_generate_from_thread_without_loop(engine):
    result = {}
    t = threading.Thread(target=lambda: result.setdefault(
        "out", engine.generate(PROMPTS[0], {"max_new_tokens": 8, "temperature": 0})))
    t.start()
    t.join(60)
    assert result["out"]["text"].startswith(" Paris.")


def queue_counters(info: dict, running: bool = False) -> dict:
    """What a request leaves in the engine: tokens counted, queues, admissions (the tokens
    generated keep moving while a request runs)."""
    stats = info["stats"]
    return {"prompt_tokens": stats["prompt_tokens"], "num_running": info["num_running"],
            "num_waiting": info["num_waiting"], "admissions": info["admissions"],
            **({} if running else {"generation_tokens": stats["generation_tokens"]})}


BAD_INPUT = [  # (id, generate kwargs, the error names the field); "rid" runs one in flight first
    ("empty prompt", {"prompt": ""}, "prompt is empty"),
    ("no prompt", {"prompt": None}, "exactly one of prompt and input_ids"),
    ("prompt not a string", {"prompt": 5}, "prompt must be"),
    ("empty input_ids", {"input_ids": []}, "input_ids must be a non-empty"),
    ("prompt over the context", {"input_ids": [1] * 9000, "sampling_params": {"max_new_tokens": 0}},
     r"prompt \(9000 tokens\) exceeds the context length"),
    ("token id out of range", {"input_ids": [1, 2, 10**9]}, "input_ids"),
    ("token id negative", {"input_ids": [-1]}, "input_ids"),
    ("max_new_tokens negative", {"sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ("max_new_tokens over the context", {"sampling_params": {"max_new_tokens": 9000}},
     r"max_new_tokens \(9000\) .* context length"),
    ("max_new_tokens a string", {"sampling_params": {"max_new_tokens": "8"}},
     "max_new_tokens must be an integer"),
    ("temperature negative", {"sampling_params": {"temperature": -0.5}}, "temperature"),
    ("temperature NaN", {"sampling_params": {"temperature": float("nan")}}, "temperature"),
    ("temperature a string", {"sampling_params": {"temperature": "hot"}}, "temperature must be a number"),
    ("top_p 0", {"sampling_params": {"top_p": 0}}, "top_p"),
    ("top_p 1.5", {"sampling_params": {"top_p": 1.5}}, "top_p"),
    ("top_k 0", {"sampling_params": {"top_k": 0}}, "top_k"),
    ("top_k -2", {"sampling_params": {"top_k": -2}}, "top_k"),
    ("min_p 2", {"sampling_params": {"min_p": 2}}, "min_p"),
    ("repetition_penalty 0", {"sampling_params": {"repetition_penalty": 0}}, "repetition_penalty"),
    ("repetition_penalty 3", {"sampling_params": {"repetition_penalty": 3}}, "repetition_penalty"),
    ("frequency_penalty 3", {"sampling_params": {"frequency_penalty": 3.0}}, "frequency_penalty"),
    ("presence_penalty -3", {"sampling_params": {"presence_penalty": -3.0}}, "presence_penalty"),
    ("n 0", {"sampling_params": {"n": 0}}, "n must be"),
    ("n 1000", {"sampling_params": {"n": 1000}}, r"n must be in \[1, 128\], got 1000"),
    ("100 stop strings", {"sampling_params": {"stop": ["x"] * 100}}, "stop has 100 strings"),
    ("empty stop string", {"sampling_params": {"stop": [""]}}, "stop"),
    ("logit_bias id not a number", {"sampling_params": {"logit_bias": {"x": 1}}}, "logit_bias"),
    ("logit_bias id out of range", {"sampling_params": {"logit_bias": {"99999999": 1}}}, "logit_bias"),
    ("logit_bias id negative", {"sampling_params": {"logit_bias": {"-5": 1}}}, "logit_bias"),
    ("unknown sampling field", {"sampling_params": {"bogus": 1}}, "unknown sampling parameter.*bogus"),
    ("chat message with an unknown role", {"messages": [{"role": "robot", "content": "hi"}]},
     r"messages\[0\]: role"),
    ("duplicate rid", {"rid": "dup-1"}, "already in flight"),
]


@pytest.mark.parametrize("kwargs, match", [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_bad_input_raises_before_queueing(engine, kwargs, match):
    kwargs = {"prompt": "Hello", **kwargs}
    if "input_ids" in kwargs:
        kwargs.pop("prompt")
    held = None
    if "rid" in kwargs:  # a duplicate of a request in flight
        held = engine.generate(PROMPTS[0], {"max_new_tokens": 500, "ignore_eos": True}, stream=True,
                               rid=kwargs["rid"])
        next(held)
    before = queue_counters(engine.get_server_info(), running=held is not None)
    with pytest.raises(ValueError, match=match):
        if "messages" in kwargs:
            kwargs["prompt"] = engine.tokenizer.apply_chat_template(kwargs.pop("messages"))
        engine.generate(**kwargs)
    assert queue_counters(engine.get_server_info(), running=held is not None) == before
    if held is not None:
        held.close()
        wait_idle(engine)
    out = engine.generate(PROMPTS[0], {"temperature": 0, "max_new_tokens": 4})
    assert out["text"].startswith(" Paris") and out["meta_info"]["completion_tokens"] == 4


def test_pause_and_continue(engine):
    engine.pause_generation(mode="in_place")
    try:
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("out", engine.generate(PROMPTS[0], GREEDY)))
        t.start()

        def queued() -> bool:
            info = engine.get_server_info()
            assert info["paused"], "the engine is not paused"
            assert info["num_running"] == 0 and "out" not in result, "the request ran while paused"
            return info["num_waiting"] == 1

        wait_until(queued, 10, "the request to be queued in the paused engine")
        # Each reply comes from a later turn of the core's loop, and each turn would step
        # (admit the request) were the engine not paused.
        for _ in range(3):
            assert queued(), "the request left the queue while paused"
    finally:
        engine.continue_generation()
    t.join(30)
    assert result["out"]["meta_info"]["finish_reason"] is not None


def test_missing_model_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        Engine(model_path="/tmp/no-such-model.gguf")


def test_unknown_engine_option():
    with pytest.raises(ValueError, match="unknown engine option"):
        Engine(chunked_prefil_size=3)


def test_killed_core_raises_engine_dead_error():
    with Engine() as e:
        stream = e.generate(PROMPTS[0], {"max_new_tokens": 2000, "ignore_eos": True}, stream=True)
        next(stream)
        core_pid = e.get_server_info()["core_pid"]
        t0 = time.monotonic()
        os.kill(core_pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            for _ in stream:
                pass
        assert time.monotonic() - t0 < 3
        with pytest.raises(EngineDeadError):
            e.generate(PROMPTS[0])


def test_prefix_cache_reuses_a_shared_prefix(engine):
    prefix = engine.tokenizer.encode(" ".join(PROMPTS) * 8)[:300]
    assert len(prefix) == 300
    params = {"temperature": 0, "max_new_tokens": 8}
    engine.generate(input_ids=prefix + engine.tokenizer.encode(" First question?"), sampling_params=params)
    second = prefix + engine.tokenizer.encode(" Second question?")
    hit = engine.generate(input_ids=second, sampling_params=params, return_logprob=True, top_logprobs_num=5)
    assert hit["meta_info"]["cached_tokens"] >= 288  # 300 tokens: 18 whole blocks of 16
    wait_idle(engine)
    assert engine.flush_cache()
    assert engine.get_server_info()["kv_blocks_cached"] == 0
    miss = engine.generate(input_ids=second, sampling_params=params, return_logprob=True, top_logprobs_num=5)
    assert miss["meta_info"]["cached_tokens"] == 0
    assert_greedy_close(miss["output_ids"], top_dicts(miss), hit["output_ids"], top_dicts(hit))


def test_flush_cache_is_refused_while_requests_run(engine):
    stream = engine.generate(PROMPTS[0], {"max_new_tokens": 200, "ignore_eos": True}, stream=True)
    try:
        next(stream)
        result = engine.flush_cache()  # SGLang's shape: a falsy result with the reason, no raise
        assert not result and not result.success
        assert "cannot flush the prefix cache while 1 request" in result.message
    finally:
        stream.close()


def test_kv_cache_that_does_not_fit_is_a_clear_error():
    with pytest.raises(EngineDeadError, match="does not fit"):
        Engine(num_threads=1, kv_cache_memory_gb=100_000)


def test_kv_capacity_from_a_memory_budget_is_reported():
    with Engine(num_threads=1, kv_cache_memory_gb=0.5) as e:
        info = e.get_server_info()
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 x 2 (K and V) x 2 bytes (the quantized model's
    # float16 cache) = 23,040 bytes per token.
    assert info["kv_cache_dtype"] == "float16"
    assert info["max_total_tokens"] == (1 << 29) // (23040 * 16) * 16


def test_a_slow_consumer_gets_merged_deltas(engine):
    """A consumer that falls behind the core gets fewer, larger items: everything since it last
    looked, merged, with nothing lost and the same final text and ids."""
    params = {"max_new_tokens": 48, "ignore_eos": True, "temperature": 0}
    fast, stamps = [], []
    for item in engine.generate(PROMPTS[0], params, stream=True):
        fast.append(item)
        stamps.append(time.monotonic())
    # Away for several decode steps each time, as long as a step takes here (a loaded machine's
    # steps are slower: a fixed sleep would not outlast enough of them).
    away = max(0.05, 5 * statistics.median(b - a for a, b in itertools.pairwise(stamps)))
    slow = []
    for item in engine.generate(PROMPTS[0], params, stream=True):
        slow.append(item)
        time.sleep(away)
    assert len(slow) < len(fast) / 2, (len(slow), len(fast), away)
    assert (slow[-1]["text"], slow[-1]["output_ids"]) == (fast[-1]["text"], fast[-1]["output_ids"])
    assert len(slow[-1]["output_ids"]) == 48
    for before, after in zip(slow, slow[1:]):  # each item extends the last: nothing skipped
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    assert [i["meta_info"]["finish_reason"] for i in slow].count(None) == len(slow) - 1


def test_a_full_queue_is_a_typed_error_at_once():
    from unison.errors import EngineOverloadedError

    long = {"max_new_tokens": 2000, "ignore_eos": True}
    with Engine(max_running_requests=1, max_queued_requests=1, num_threads=1) as e:
        running = e.generate(PROMPTS[0], long, stream=True)
        next(running)
        waiting = e.generate(PROMPTS[1], long, stream=True)
        wait_until(lambda: e.get_server_info()["num_waiting"] == 1, 30, "one waiting request")
        t0 = time.monotonic()
        with pytest.raises(EngineOverloadedError, match="max_queued_requests=1"):
            e.generate(PROMPTS[2], {"max_new_tokens": 4})
        assert time.monotonic() - t0 < 2.0
        info = e.get_server_info()
        assert (info["num_running"], info["num_waiting"]) == (1, 1)  # nothing was queued
        running.close()
        waiting.close()
        wait_until(lambda: e.get_server_info()["num_running"] == 0, 10, "the aborts")
        assert len(e.generate(PROMPTS[2], {"max_new_tokens": 4})["output_ids"]) >= 1


def test_a_burst_under_a_queue_limit_is_not_taken_for_a_lagging_frontend():
    """With a limit, the core answers each request with "queued"; a burst of them must not count
    as unacknowledged steps (frontend_max_unacked), which would abort the whole frontend."""
    with Engine(max_queued_requests=500, frontend_max_unacked=2, num_threads=1) as e:
        outs = e.generate(PROMPTS[0], {"max_new_tokens": 2, "n": 100, "ignore_eos": True})
        assert [len(o["output_ids"]) for o in outs] == [2] * 100
