"""`unison serve` end to end: the launcher, its uvicorn workers and the core as real processes.

Driven by the official openai client (sync and async) and plain HTTP; greedy outputs and token
counts are checked against an Engine in this process with the server's model and core config.
Then the faults: bad requests, overload, client disconnects, SIGTERM with requests in flight and
the core killed by kill -9. The time each fault took to handle is printed at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from tests.serving import FIGURES, Server, assert_openai_error, serve
from tests.utils import HTTP, wait_until
from unison import Engine
from unison.model.weights.loader import default_gguf_path

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-unison-test"
PROMPT = "The capital of France is"
PROMPTS = ["The capital of France is", "1 + 1 ="]
CHAT = [{"role": "user", "content": "What is the capital of Italy?"}]
HELLO = [{"role": "user", "content": "hello"}]
LONG_TEXT = "Once upon a time, in a small village by the sea, " * 12  # ~150 tokens: prefill chunks
GREEDY = {"temperature": 0, "max_new_tokens": 16}
LONG = {"max_tokens": 2000, "ignore_eos": True}  # runs far longer than any check below
COMP, CHAT_URL = "/v1/completions", "/v1/chat/completions"
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool turns') }}"
            "{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")


@pytest.fixture(scope="module")
def server():
    yield from serve("1 worker", "--chunked-prefill-size", "64")


@pytest.fixture(scope="module")
def server2():
    yield from serve("2 workers", "--chunked-prefill-size", "64", "--tool-call-parser", "hermes",
                     workers=2, api_key=KEY)


@pytest.fixture(scope="module")
def small_queue_server():
    # One request runs at a time, so the others wait: the engine-wide queue fills deterministically.
    yield from serve("2 workers, queue of 2", "--max-queued-requests", "2", "--max-running-requests", "1",
                     "--chunked-prefill-size", "64", "--chat-template", TEMPLATE, workers=2)


@pytest.fixture(scope="module")
def engine():
    # The servers' core config: same chunking and threads, so greedy runs compute alike.
    with Engine(num_threads=1, chunked_prefill_size=64) as e:
        yield e


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


@pytest.fixture(autouse=True)
def idle_after(request):
    """Every test on a shared server leaves it idle: nothing running, no KV block held."""
    yield
    for name in ("server", "server2", "small_queue_server"):
        if name in request.fixturenames:
            request.getfixturevalue(name).wait_freed(timeout=10)


def complete(client: openai.OpenAI, prompt: Any = PROMPT, **kw: Any):
    return client.completions.create(model=MODEL, prompt=prompt, **{"temperature": 0, **kw})


def chat(client: openai.OpenAI, messages: list = CHAT, **kw: Any):
    return client.chat.completions.create(model=MODEL, messages=messages,
                                          **{"temperature": 0, **kw})


USAGE = {"stream": True, "stream_options": {"include_usage": True}}


def offsets_of(tokens: list[str]) -> list[int]:
    return [len("".join(tokens[:k])) for k in range(len(tokens))]


# ---- 1. the OpenAI API, one worker ----------------------------------------------------------


def test_completion_greedy_and_usage_match_engine(server, client, engine):
    want = engine.generate(PROMPT, GREEDY)
    meta = want["meta_info"]
    r = complete(client, max_tokens=16)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert r.choices[0].text == want["text"]
    assert r.choices[0].finish_reason == "length" and r.choices[0].index == 0
    assert r.usage.prompt_tokens == meta["prompt_tokens"]
    assert r.usage.completion_tokens == meta["completion_tokens"]
    assert r.usage.total_tokens == meta["prompt_tokens"] + meta["completion_tokens"]

    chunks = list(complete(client, max_tokens=16, **USAGE))
    assert len(chunks) > 2 and len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks[:-1]) == want["text"]
    finishes = [c.choices[0].finish_reason for c in chunks[:-1]]
    assert finishes == [None] * (len(finishes) - 1) + ["length"]
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == meta["completion_tokens"]
    assert last.usage.prompt_tokens == meta["prompt_tokens"]


def test_chat_greedy_and_usage_match_engine(server, client, engine):
    want = engine.generate(engine.tokenizer.apply_chat_template(CHAT), GREEDY)
    meta = want["meta_info"]
    finish = "length" if meta["finish_reason"]["type"] == "length" else "stop"
    r = chat(client, max_tokens=16)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want["text"]
    assert r.choices[0].finish_reason == finish
    assert r.usage.prompt_tokens == meta["prompt_tokens"]
    assert r.usage.completion_tokens == meta["completion_tokens"]

    chunks = list(chat(client, max_tokens=16, **USAGE))
    deltas = [c.choices[0].delta for c in chunks[:-1]]
    assert deltas[0].role == "assistant" and all(d.role is None for d in deltas[1:])
    assert "".join(d.content or "" for d in deltas) == want["text"]
    assert chunks[-2].choices[0].finish_reason == finish
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == meta["completion_tokens"]
    assert chunks[-1].usage.prompt_tokens == meta["prompt_tokens"]


@pytest.mark.parametrize("form", ["string", "strings", "token ids", "token-id lists"])
def test_completion_prompt_forms(server, client, engine, form):
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    prompt = {"string": PROMPTS[0], "strings": PROMPTS, "token ids": ids[0],
              "token-id lists": ids}[form]
    n = 2 if form in ("strings", "token-id lists") else 1
    want = engine.generate(input_ids=ids[:n], sampling_params=GREEDY)  # the server's batch
    r = complete(client, prompt, max_tokens=16)
    assert [c.index for c in r.choices] == list(range(n))
    assert [c.text for c in r.choices] == [w["text"] for w in want]
    assert r.usage.prompt_tokens == sum(len(i) for i in ids[:n])
    assert r.usage.completion_tokens == sum(w["meta_info"]["completion_tokens"] for w in want)


def test_n_2(server, client, engine):
    sampled = {"max_tokens": 8, "temperature": 0.8, "seed": 1234}
    want = engine.generate(PROMPT, {"n": 2, "max_new_tokens": 8, "temperature": 0.8,
                                    "sampling_seed": 1234})
    r = complete(client, n=2, **sampled)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [w["text"] for w in want]  # child i: seed + i
    assert r.usage.prompt_tokens == want[0]["meta_info"]["prompt_tokens"]  # once, as OpenAI
    assert r.usage.completion_tokens == sum(w["meta_info"]["completion_tokens"] for w in want)

    chunks = list(complete(client, n=2, **sampled, **USAGE))
    texts = ["", ""]
    for c in chunks[:-1]:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == [w["text"] for w in want]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens

    r = chat(client, n=2, logprobs=True, top_logprobs=2, **sampled)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.message.content and 0 < len(c.logprobs.content) <= 8
        assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)


def test_completion_logprobs_match_engine(server, client, engine):
    want = engine.generate(PROMPT, GREEDY, return_logprob=True, top_logprobs_num=2)
    meta = want["meta_info"]

    def tok(t: int) -> str:
        return engine.tokenizer.decode([t], skip_special_tokens=False)

    lp = complete(client, max_tokens=16, logprobs=2).choices[0].logprobs
    assert lp.tokens == [tok(t) for t in want["output_ids"]]
    want_lps = [x for x, _, _ in meta["output_token_logprobs"]]
    assert lp.token_logprobs == pytest.approx(want_lps, abs=1e-4)
    assert len(lp.top_logprobs) == len(meta["output_top_logprobs"])
    for got, top in zip(lp.top_logprobs, meta["output_top_logprobs"], strict=True):
        assert got == pytest.approx({tok(t): x for x, t, _ in top}, abs=1e-4)
    assert lp.text_offset == offsets_of(lp.tokens)

    streamed = [c.choices[0].logprobs for c in complete(client, max_tokens=16, logprobs=2,
                                                        stream=True)]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset


def test_chat_logprobs_match_engine(server, client, engine):
    want = engine.generate(engine.tokenizer.apply_chat_template(CHAT), GREEDY,
                           return_logprob=True, top_logprobs_num=2)
    meta = want["meta_info"]
    content = chat(client, max_tokens=16, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert len(content) == len(want["output_ids"])
    for got, (x, _, _), top in zip(content, meta["output_token_logprobs"],
                                   meta["output_top_logprobs"], strict=True):
        assert got.logprob == pytest.approx(x, abs=1e-4)
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([t[0] for t in top], abs=1e-4)
        assert got.bytes == list(got.token.encode())
    streamed = chat(client, max_tokens=16, logprobs=True, top_logprobs=2, stream=True)
    assert [t.token for c in streamed for t in c.choices[0].logprobs.content] == \
        [t.token for t in content]


@pytest.mark.parametrize("prompt", [PROMPT, LONG_TEXT], ids=["short", "chunked prefill"])
def test_echo_with_logprobs(server, client, engine, prompt):
    want = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 4}, return_logprob=True,
                           logprob_start_len=0, top_logprobs_num=1)
    n_prompt = want["meta_info"]["prompt_tokens"]
    r = complete(client, prompt, max_tokens=4, echo=True, logprobs=1)
    text, lp = r.choices[0].text, r.choices[0].logprobs
    assert text == prompt + want["text"]
    assert len(lp.tokens) == n_prompt + len(want["output_ids"])
    assert "".join(lp.tokens[:n_prompt]) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing before it
    want_lps = [x for x, _, _ in want["meta_info"]["input_token_logprobs"][1:]]
    assert lp.token_logprobs[1:n_prompt] == pytest.approx(want_lps, abs=1e-4)
    assert lp.text_offset == offsets_of(lp.tokens)
    assert r.usage.prompt_tokens == n_prompt

    # Streamed, the prompt's logprobs come over several prefill chunks; the echo is whole anyway.
    chunks = [c.choices[0] for c in complete(client, prompt, max_tokens=4, echo=True, logprobs=1,
                                             stream=True)]
    assert "".join(c.text for c in chunks) == text
    assert sum((c.logprobs.tokens for c in chunks), []) == lp.tokens

    plain = complete(client, prompt, max_tokens=4, echo=True).choices[0]
    assert plain.text == text and plain.logprobs is None


def test_async_client(server, engine):
    want = engine.generate(PROMPT, GREEDY)
    want_chat = engine.generate(engine.tokenizer.apply_chat_template(CHAT), GREEDY)

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                      max_retries=0, timeout=60) as c:
            r = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
            assert r.choices[0].text == want["text"]
            stream = await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16,
                                                     temperature=0, **USAGE)
            chunks = [ch async for ch in stream]
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks[:-1])
            assert text == want_chat["text"]
            assert chunks[-1].usage.completion_tokens == want_chat["meta_info"]["completion_tokens"]
            # Concurrent requests share steps: every one completes, with exact token counts.
            outs = await asyncio.gather(*(
                c.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True}) for p in PROMPTS * 3))
            for o in outs:
                assert o.usage.completion_tokens == 6 and o.choices[0].finish_reason == "length"

    asyncio.run(main())


def test_info_routes(server, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    r = server.get("/health")
    assert r.status_code == 200 and r.content == b""
    info = server.server_info()
    assert info["core_pid"] == server.core_pid and info["owner_pid"] == server.proc.pid
    # One worker: uvicorn runs in the launcher, which is then the only frontend.
    assert [f["pid"] for f in info["frontends"]] == [server.proc.pid]
    assert info["context_length"] == 8192 and info["config"]["chunked_prefill_size"] == 64
    r = server.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True
    assert r.headers["x-unison-worker-pid"] == str(server.proc.pid)


def _scrape(text: str) -> dict[str, float]:
    """Prometheus text -> {name{labels}: value}, parsed by prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = "".join(f'{{{k}="{v}"}}' for k, v in sorted(sample.labels.items()))
            samples[sample.name + labels] = sample.value
    return samples


HISTOGRAMS = ("time_to_first_token_seconds", "request_time_per_output_token_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds")


def test_metrics_count_requests(server, client):
    r = server.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    before = _scrape(r.text)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "num_frontends"):
        assert f"unison:{name}" in before, name
    assert not [k for k in before if k.startswith(("process_", "python_"))]  # engine-wide only
    out = complete(client, max_tokens=5, extra_body={"ignore_eos": True})
    chunks = list(chat(client, max_tokens=3, extra_body={"ignore_eos": True}, **USAGE))
    after = _scrape(server.get("/metrics").text)
    assert after["unison:num_requests_running"] == after["unison:kv_cache_usage_perc"] == 0
    gen = after["unison:generation_tokens_total"] - before["unison:generation_tokens_total"]
    assert gen == 5 + 3
    prompt = after["unison:prompt_tokens_total"] - before["unison:prompt_tokens_total"]
    assert prompt == out.usage.prompt_tokens + chunks[-1].usage.prompt_tokens
    queried = after["unison:prefix_cache_queries_total"] - before["unison:prefix_cache_queries_total"]
    assert queried == prompt
    assert after["unison:request_success_total"] - before["unison:request_success_total"] == 2
    for h in HISTOGRAMS:
        name = f"unison:{h}"
        assert after[f"{name}_count"] - before[f"{name}_count"] == 2, h
        assert after[f"{name}_sum"] > before[f"{name}_sum"]
        buckets = [v for k, v in after.items() if k.startswith(f"{name}_bucket")]
        assert len(buckets) > 2
        assert buckets == sorted(buckets) and buckets[-1] == after[f"{name}_count"]


def test_native_generate(server, engine):
    params = {"temperature": 0, "max_new_tokens": 8}
    want = engine.generate(PROMPT, params)
    r = server.post("/generate", {"text": PROMPT, "sampling_params": params})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["text"] == want["text"] and out["output_ids"] == want["output_ids"]
    assert set(out["meta_info"]) == set(want["meta_info"])
    for k in ("prompt_tokens", "completion_tokens", "finish_reason"):
        assert out["meta_info"][k] == want["meta_info"][k], k
    # What each engine's prefix cache holds depends on what it served before (a cached block's
    # leading tokens count too): a count of the prompt's tokens, at least one computed.
    assert 0 <= out["meta_info"]["cached_tokens"] < out["meta_info"]["prompt_tokens"]
    ids = engine.tokenizer.encode(PROMPT)
    by_ids = server.post("/generate", {"input_ids": ids, "sampling_params": params})
    assert by_ids.json()["output_ids"] == want["output_ids"]

    body = {"text": PROMPT, "sampling_params": params, "stream": True}
    with HTTP.stream("POST", f"{server.url}/generate", json=body, timeout=60) as s:
        assert s.status_code == 200
        assert s.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in s.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert len(chunks) > 1 and chunks[-1]["text"] == want["text"]
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b["text"].startswith(a["text"])  # cumulative, as Engine.generate streams

    r = server.post("/generate", {"text": PROMPT, "temperatur": 0})
    assert_openai_error(r, 400, "temperatur")


# ---- 2. two workers and an API key ----------------------------------------------------------


def _from_both(server2: Server, send) -> dict[int, httpx.Response]:
    """Send on fresh connections until both workers have answered (each connection hits one;
    the kernel hands it to whichever worker is waiting in accept, so a busy host may give one
    worker many in a row: keep trying for a while, pausing between tries)."""
    seen: dict[int, httpx.Response] = {}
    deadline = time.monotonic() + 20
    while len(seen) < 2 and time.monotonic() < deadline:
        r = send()
        seen.setdefault(int(r.headers["x-unison-worker-pid"]), r)
        time.sleep(0.01)
    assert set(seen) == server2.worker_pids, f"answered by {sorted(seen)} of {server2.worker_pids}"
    return seen


def test_two_workers_share_requests_and_agree(server2, engine):
    assert server2.proc.pid not in server2.worker_pids  # N > 1: workers are their own processes
    want = engine.generate(PROMPT, GREEDY)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    for pid, r in _from_both(server2, lambda: server2.post(COMP, body)).items():
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want["text"], pid
        assert r.json()["usage"]["completion_tokens"] == want["meta_info"]["completion_tokens"]


@pytest.mark.parametrize("auth", [None, "Bearer wrong", KEY], ids=["none", "wrong", "no Bearer"])
def test_api_key_enforced_on_both_workers(server2, auth):
    headers = {"Authorization": auth} if auth else {}
    for route in ("/v1/models", "/get_server_info"):
        send = functools.partial(httpx.get, server2.url + route, headers=headers)
        for r in _from_both(server2, send).values():
            err = assert_openai_error(r, 401, "api key")
            assert err["type"] == "authentication_error"
    send = functools.partial(httpx.post, server2.url + COMP, json={"prompt": "hi"}, headers=headers)
    for r in _from_both(server2, send).values():
        assert_openai_error(r, 401)


CONTROLS = ["/pause_generation", "/continue_generation", "/abort_request", "/update_weights_from_disk",
            "/flush_cache"]


def test_control_routes_need_the_key(server2):
    for route in CONTROLS:
        send = functools.partial(httpx.post, server2.url + route, json={})
        for r in _from_both(server2, send).values():
            assert_openai_error(r, 401, "api key")
    assert HTTP.get(server2.url + "/get_model_info").status_code == 401


def test_control_routes_in_sglangs_shapes_act_engine_wide(server2):
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(server2.post, "/generate", body)
        server2.wait_running(1)
        busy = server2.post("/flush_cache")
        assert busy.status_code == 400 and not busy.json()["success"] and "hold KV" in busy.json()["message"]
        # in_place from whichever worker answers: the engine pauses, the request keeps its KV
        r = server2.post("/pause_generation", {"mode": "in_place"})
        assert r.status_code == 200 and r.json()["status"] == "ok"
        info = server2.server_info()
        assert info["paused"] and info["pause_mode"] == "in_place" and info["kv_blocks_used"] > 0
        assert server2.post("/continue_generation").status_code == 200
        assert server2.post("/abort_request", {"abort_all": True}).status_code == 200
        out = running.result(30).json()  # another worker's request, ended by the operator's abort
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    server2.wait_freed(5)
    assert_openai_error(server2.post("/pause_generation", {"mode": "sideways"}), 400, "mode")
    assert_openai_error(server2.post("/abort_request", {}), 400, "rid")
    assert server2.post("/pause_generation").json()["status"] == "ok"  # SGLang's default: abort
    assert server2.server_info()["pause_mode"] == "abort"
    assert server2.post("/continue_generation").status_code == 200
    model = server2.get("/get_model_info").json()
    gguf = str(default_gguf_path())
    assert model["is_generation"] and model["model_path"] == gguf  # the embedded file: what is served
    ok = server2.post("/update_weights_from_disk", {"model_path": gguf})
    assert ok.status_code == 200 and ok.json()["success"], ok.text
    assert server2.get("/get_model_info").json()["model_path"] == gguf
    bad = server2.post("/update_weights_from_disk", {"model_path": "/no/such/model"})
    assert bad.status_code == 400 and not bad.json()["success"] and "does not exist" in bad.json()["message"]
    r = server2.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
    assert r.status_code == 200, r.text


def test_api_key_accepted_health_and_metrics_open(server2):
    for route in ("/health", "/metrics"):  # no key, as in vLLM: probes and scrapers
        send = functools.partial(httpx.get, f"{server2.url}{route}")
        for r in _from_both(server2, send).values():
            assert r.status_code == 200, route
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server2.url}/v1", api_key="wrong", max_retries=0).models.list()
    with openai.OpenAI(base_url=f"{server2.url}/v1", api_key=KEY, max_retries=0) as ok:
        assert complete(ok, max_tokens=2).usage.completion_tokens == 2


def test_metrics_agree_across_workers(server2):
    server2.post(COMP, {"prompt": PROMPT, "max_tokens": 4})
    server2.wait_freed(timeout=10)
    a, b = (_scrape(r.text) for r in _from_both(server2, lambda: server2.get("/metrics")).values())
    assert a == b  # engine-wide numbers live in the core
    assert a["unison:num_frontends"] == 2 and a["unison:generation_tokens_total"] >= 4


# ---- tool calls ------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
NOTE = {"type": "function", "function": {
    "name": "take_note", "parameters": {"type": "object", "properties": {
        "text": {"type": "string", "maxLength": 12}}, "required": ["text"], "additionalProperties": False}}}
TOOL_CHAT = [{"role": "user", "content": "What is the weather in Rome?"}]


@pytest.fixture(scope="module")
def client2(server2):
    with openai.OpenAI(base_url=f"{server2.url}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def _check_calls(calls: list[tuple[str, str]], tools: list[dict]) -> None:
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), schemas[name])


def _streamed_calls(stream) -> tuple[list[tuple[str, str]], str | None, set[str]]:
    """Reassemble OpenAI tool-call deltas: (name, arguments) per index, the finish reason, ids."""
    calls: dict[int, list] = {}
    finish, ids = None, set()
    for chunk in stream:
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                if d.id is not None:  # the first delta of a call: its id, type and name
                    assert d.type == "function" and d.function.name and d.function.arguments == ""
                    calls[d.index] = [d.function.name, ""]
                    ids.add(d.id)
                else:
                    calls[d.index][1] += d.function.arguments
            finish = choice.finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish, ids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_required_gives_valid_calls(client2, stream):
    tools = [WEATHER, NOTE]
    kw = {"tools": tools, "tool_choice": "required", "max_tokens": 120}
    if stream:
        calls, finish, ids = _streamed_calls(chat(client2, TOOL_CHAT, stream=True, **kw))
        assert len(ids) == len(calls)
    else:
        r = chat(client2, TOOL_CHAT, **kw)
        message, finish = r.choices[0].message, r.choices[0].finish_reason
        assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls)
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert finish == "tool_calls"
    _check_calls(calls, tools)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_named_tool_choice_calls_that_function(client2, stream):
    kw = {"tools": [WEATHER, NOTE], "max_tokens": 60,
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    if stream:
        calls, finish, _ = _streamed_calls(chat(client2, TOOL_CHAT, stream=True, **kw))
    else:
        r = chat(client2, TOOL_CHAT, **kw)
        calls = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
        finish = r.choices[0].finish_reason
    assert [name for name, _ in calls] == ["get_weather"] and finish == "stop"  # as OpenAI's
    _check_calls(calls, [WEATHER])


def test_parallel_tool_calls_false_allows_one(client2):
    r = chat(client2, TOOL_CHAT, tools=[WEATHER, NOTE], tool_choice="required", parallel_tool_calls=False,
             max_tokens=120)
    assert len(r.choices[0].message.tool_calls) == 1


def test_tool_result_turn_and_choice_none(client2):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}
    turn = [*TOOL_CHAT, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]
    r = chat(client2, turn, tools=[WEATHER], max_tokens=8)
    assert r.choices[0].message.content is not None  # auto, read by hermes: plain text here
    plain = chat(client2, TOOL_CHAT, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "length"


# ---- 3. errors ------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "f"}}]
MB = 1 << 20
ERRORS = [  # (id, route, body, status, param, message fragment); a body with "rid" runs one first
    ("empty prompt", COMP, {"prompt": ""}, 400, "prompt", "prompt is empty"),
    ("no prompt", COMP, {"max_tokens": 3}, 400, "prompt", "prompt"),
    ("empty prompt list", COMP, {"prompt": []}, 400, "prompt", "prompt"),
    ("prompt over the context", COMP, {"prompt": "hello " * 9000, "max_tokens": 1}, 400, "prompt",
     "context length"),
    ("token id out of range", COMP, {"prompt": [10**9]}, 400, "prompt", "token ids"),
    ("token id negative", COMP, {"prompt": [-1]}, 400, "prompt", "token ids"),
    ("max_tokens -1", COMP, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", "max_tokens"),
    ("max_tokens over the context", COMP, {"prompt": "hi", "max_tokens": 9000}, 400, "max_tokens",
     "context length"),
    ("max_tokens abc", COMP, {"prompt": "hi", "max_tokens": "abc"}, 400, "max_tokens", "max_tokens"),
    ("temperature -1", COMP, {"prompt": "hi", "temperature": -1}, 400, "temperature", "temperature"),
    ("temperature NaN", COMP, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature",
     "temperature"),
    ("temperature hot", COMP, {"prompt": "hi", "temperature": "hot"}, 400, "temperature",
     "temperature"),
    ("top_p 0", COMP, {"prompt": "hi", "top_p": 0}, 400, "top_p", "top_p"),
    ("top_p 2", COMP, {"prompt": "hi", "top_p": 2}, 400, "top_p", "top_p"),
    ("top_k 0", COMP, {"prompt": "hi", "top_k": 0}, 400, "top_k", "top_k"),
    ("top_k -2", COMP, {"prompt": "hi", "top_k": -2}, 400, "top_k", "top_k"),
    ("presence_penalty 3", COMP, {"prompt": "hi", "presence_penalty": 3.0}, 400, "presence_penalty",
     "presence_penalty"),
    ("frequency_penalty -3", COMP, {"prompt": "hi", "frequency_penalty": -3.0}, 400,
     "frequency_penalty", "frequency_penalty"),
    ("repetition_penalty 0", COMP, {"prompt": "hi", "repetition_penalty": 0}, 400,
     "repetition_penalty", "repetition_penalty"),
    ("n 0", COMP, {"prompt": "hi", "n": 0}, 400, "n", "n must"),
    ("n 1000", COMP, {"prompt": "hi", "n": 1000}, 400, "n", "n must"),
    ("100 stop strings", COMP, {"prompt": "hi", "stop": [f"s{i}" for i in range(100)]}, 400, "stop",
     "stop"),
    ("empty stop string", COMP, {"prompt": "hi", "stop": ""}, 400, "stop", "stop"),
    ("logit_bias id out of range", COMP, {"prompt": "hi", "logit_bias": {"999999999": 1}}, 400,
     "logit_bias", "logit_bias"),
    ("logit_bias id abc", COMP, {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias",
     "logit_bias"),
    ("logprobs 50", COMP, {"prompt": "hi", "logprobs": 50}, 400, "logprobs", "logprobs"),
    ("unknown field", COMP, {"prompt": "hi", "foo": 1}, 400, "foo", "unknown field 'foo'"),
    ("unknown model", COMP, {"prompt": "hi", "model": "gpt-4"}, 404, "model", "gpt-4"),
    ("chat temperature -1", CHAT_URL, {"messages": HELLO, "temperature": -1}, 400, "temperature",
     "temperature"),
    ("chat unknown field", CHAT_URL, {"messages": HELLO, "foo": 1}, 400, "foo", "unknown field 'foo'"),
    ("chat unknown model", CHAT_URL, {"messages": HELLO, "model": "gpt-4"}, 404, "model", "gpt-4"),
    ("chat over the context", CHAT_URL,
     {"messages": [{"role": "user", "content": "hello " * 9000}]}, 400, "messages", "context length"),
    ("chat auto tools without a parser", CHAT_URL, {"messages": HELLO, "tools": TOOLS}, 400, "tool_choice",
     "--tool-call-parser"),
    ("chat tool_choice of no tool", CHAT_URL, {"messages": HELLO, "tools": TOOLS,
     "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice", "not among"),
    ("chat malformed tool", CHAT_URL, {"messages": HELLO, "tools": [{"type": "function"}],
     "tool_choice": "required"}, 400, "tools[0]", "tools[0]"),
    ("chat tool_choice without tools", CHAT_URL, {"messages": HELLO, "tool_choice": "required"}, 400,
     "tool_choice", "needs tools"),
    ("chat unknown role", CHAT_URL, {"messages": [{"role": "robot", "content": "hi"}]}, 400,
     "messages[0]", "role"),
    ("chat messages not a list", CHAT_URL, {"messages": "hello"}, 400, "messages", "messages"),
    ("chat top_logprobs alone", CHAT_URL, {"messages": HELLO, "top_logprobs": 2}, 400, "top_logprobs",
     "logprobs"),
    ("bad JSON", COMP, b'{"prompt": "hi",', 400, None, "JSON"),
    ("invalid UTF-8", COMP, b'{"prompt": "\xff\xfe"}', 400, None, "UTF-8"),
    ("chat invalid UTF-8", CHAT_URL, b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}',
     400, None, "UTF-8"),
    ("body not an object", COMP, b"[1, 2]", 400, None, ""),
    ("body of 50 MB", COMP, lambda: b"x" * (50 * MB), 413, None, "max_request_bytes"),
    ("body of 50 MB, chunked", COMP, lambda: (b"x" * MB for _ in range(50)), 413, None,
     "max_request_bytes"),
    ("generate invalid UTF-8", "/generate", b'{"text": "\xff"}', 400, None, "JSON"),
    ("generate unknown field", "/generate", {"text": "hi", "foo": 1}, 400, "foo", "foo"),
    ("generate temperature -1", "/generate", {"text": "hi", "sampling_params": {"temperature": -1}},
     400, "temperature", "temperature"),
    ("generate top_logprobs_num abc", "/generate", {"text": "hi", "top_logprobs_num": "abc"}, 400,
     "top_logprobs_num", "top_logprobs_num"),
    ("generate duplicate rid", "/generate", {"text": "hi", "rid": "dup-1"}, 400, "rid",
     "already in flight"),
    ("unknown route", "/v1/nothing", {}, 404, None, "not found"),
    ("lone surrogate in the prompt", COMP, b'{"prompt": "hi \\ud800"}', 400, "prompt", "not valid text"),
    ("lone surrogate in a stop string", COMP, b'{"prompt": "hi", "stop": ["\\udfff"]}', 400, "stop[0]",
     "not valid text"),
    ("lone surrogate in a message", CHAT_URL,
     b'{"messages": [{"role": "user", "content": "\\ud800 hi"}]}', 400, "messages[0].content",
     "not valid text"),
    ("generate lone surrogate", "/generate", b'{"text": "\\ud800"}', 400, "text", "not valid text"),
    ("tokenize lone surrogate", "/tokenize", b'{"prompt": "\\ud800"}', 400, "prompt", "not valid text"),
    ("detokenize id out of range", "/detokenize", {"tokens": [10**9]}, 400, "tokens", "token ids"),
    ("tokenize both", "/tokenize", {"prompt": "hi", "messages": HELLO}, 400, "prompt", "exactly one"),
]


def queue_counters(info: dict, running: bool = False) -> dict:
    """What a request leaves in the engine: tokens counted, queues, admissions (the tokens
    generated keep moving while a request runs)."""
    stats = info["stats"]
    return {"prompt_tokens": stats["prompt_tokens"], "num_running": info["num_running"],
            "num_waiting": info["num_waiting"], "admissions": info["admissions"],
            **({} if running else {"generation_tokens": stats["generation_tokens"]})}


@contextlib.contextmanager
def generating(server: Server, rid: str):
    """A long /generate stream with this rid, in flight until the block ends."""
    body = {"text": PROMPT, "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    with HTTP.stream("POST", server.url + "/generate", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: its generator, once collected, would close the stream
        assert next(lines).startswith("data: ")
        yield


@pytest.mark.parametrize("route, body, status, param, fragment", [e[1:] for e in ERRORS],
                         ids=[e[0] for e in ERRORS])
def test_bad_requests_get_openai_errors_and_queue_nothing(server, route, body, status, param, fragment):
    rid = body.get("rid") if isinstance(body, dict) else None
    with generating(server, rid) if rid else contextlib.nullcontext():
        before = queue_counters(server.server_info(), running=bool(rid))
        content = body() if callable(body) else body
        if isinstance(content, dict):
            r = server.post(route, content)
        else:
            r = HTTP.post(server.url + route, content=content, timeout=60,
                           headers={"content-type": "application/json"})
        assert r.status_code != 422
        err = assert_openai_error(r, status, fragment)
        assert err["param"] == param, err
        assert queue_counters(server.server_info(), running=bool(rid)) == before
    server.wait_freed(timeout=10)
    good = server.post(COMP, {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2, good.text


def test_huge_bodies_are_refused_in_milliseconds(server):
    """A body past the limit the context derives is refused unread; one under it, but whose text
    is far past the context, after tokenizing a prefix. Either way fast, naming what is wrong
    (tokenizing the whole of either took seconds)."""
    ctx = server.info["context_length"]
    limit = 4 * MB + 64 * ctx  # --max-request-bytes' default
    for route, field, size in [(CHAT_URL, "messages", limit - MB), (COMP, "prompt", limit - MB),
                               (CHAT_URL, None, 20 * MB)]:
        text = "a " * (size // 2)
        body = {"messages": [{"role": "user", "content": text}]} if route == CHAT_URL else {"prompt": text}
        t0 = time.perf_counter()
        r = server.post(route, body)
        elapsed = time.perf_counter() - t0
        if field is None:
            assert_openai_error(r, 413, f"limit of {limit} bytes")
        else:
            assert assert_openai_error(r, 400, f"exceeds the context length ({ctx})")["param"] == field
        assert elapsed < 2.0, (route, size, elapsed)


def test_tokenize_detokenize_round_trip(server, client):
    r = server.post("/tokenize", {"prompt": LONG_TEXT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == server.info["context_length"]
    assert body["count"] == complete(client, LONG_TEXT, max_tokens=1).usage.prompt_tokens
    back = server.post("/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": LONG_TEXT, "content": LONG_TEXT}
    chat_count = server.post("/tokenize", {"messages": CHAT}).json()["count"]
    assert chat_count == chat(client, max_tokens=1).usage.prompt_tokens
    strs = server.post("/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()["token_strs"]
    assert "".join(strs) == PROMPT


def test_tokenize_takes_llama_servers_body_too(server):
    """llama-server's /tokenize body ({"content"}) on the same path, answered in its shape."""
    vllm = server.post("/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"]
    assert server.post("/tokenize", {"content": PROMPT}).json() == {"tokens": vllm}
    with_bos = server.post("/tokenize", {"prompt": PROMPT}).json()["tokens"]
    assert server.post("/tokenize", {"content": PROMPT, "add_special": True}).json() == {"tokens": with_bos}
    pieces = server.post("/tokenize", {"content": PROMPT, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == vllm and "".join(p["piece"] for p in pieces) == PROMPT
    assert_openai_error(server.post("/tokenize", {"content": PROMPT, "prompt": PROMPT}), 400, "content",
                        "not both")
    assert_openai_error(server.post("/tokenize", {"content": PROMPT, "parse_special": False}), 400,
                        "parse_special")
    # llama-server's /detokenize: the same body as vLLM's, its text under "content"
    assert server.post("/detokenize", {"tokens": with_bos}).json()["content"].endswith(PROMPT)


def test_vllm_request_fields(server, client):
    plain = complete(client, max_tokens=12).choices[0].text
    stop = plain.split()[1]  # a word the greedy output contains
    trimmed = complete(client, max_tokens=12, stop=[stop]).choices[0].text
    kept = complete(client, max_tokens=12, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == trimmed + stop
    lp = complete(client, max_tokens=3, logprobs=1, extra_body={"return_tokens_as_token_ids": True})
    assert all(t.startswith("token_id:") for t in lp.choices[0].logprobs.tokens)
    ids = [int(t.removeprefix("token_id:")) for t in lp.choices[0].logprobs.tokens]
    assert server.post("/detokenize", {"tokens": ids}).json()["prompt"] == lp.choices[0].text
    unspecial = complete(client, max_tokens=2, extra_body={"add_special_tokens": False})
    assert unspecial.usage.completion_tokens == 2
    with_prompt = chat(client, max_tokens=1).usage.prompt_tokens
    cont = [*CHAT, {"role": "assistant", "content": "The capital of Italy"}]
    continued = chat(client, cont, max_tokens=4, extra_body={
        "add_generation_prompt": False, "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert continued.usage.prompt_tokens > with_prompt  # the final message, left open
    r = server.post(CHAT_URL, {"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert_openai_error(r, 400, "chat_template_kwargs")


def test_chat_template_option_replaces_the_models(small_queue_server, server):
    body = {"messages": [{"role": "user", "content": "hello"}]}
    ours = small_queue_server.post("/tokenize", body).json()["tokens"]
    assert ours == small_queue_server.post("/tokenize", {"prompt": "[user] hello\n",
                                                         "add_special_tokens": False}).json()["tokens"]
    assert server.post("/tokenize", body).json()["tokens"] != ours  # the model's own template
    refused = small_queue_server.post(CHAT_URL, {"messages": [{"role": "tool", "content": "x"}]})
    err = assert_openai_error(refused, 400, "chat template refused", "no tool turns")
    assert err["param"] == "messages"


def test_generation_config_defaults_fill_unset_fields(tmp_path):
    from unison.server.apis.openai.bodies import CompletionRequest
    from unison.server.pipeline.inputs import generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.3, "top_k": 20, "max_new_tokens": 8, "bos_token_id": 1}))
    defaults = generation_defaults(str(tmp_path), "unused")
    assert defaults == {"temperature": 0.3, "top_k": 20, "max_new_tokens": 8}
    p = CompletionRequest(prompt="hi").sampling_params(16, defaults)
    assert (p.temperature, p.top_k, p.max_new_tokens) == (0.3, 20, 8)  # 8 caps the 16
    p = CompletionRequest(prompt="hi", temperature=0, top_k=5, max_tokens=4).sampling_params(16, defaults)
    assert (p.temperature, p.top_k, p.max_new_tokens) == (0, 5, 4)  # what a request sets wins
    assert generation_defaults("vllm", str(tmp_path)) == {}
    assert generation_defaults("auto", str(tmp_path / "none")) == {}
    with pytest.raises(FileNotFoundError, match="generation_config.json"):
        generation_defaults(str(tmp_path / "none"), "unused")


def test_model_card_and_version(server):
    card = server.get(f"/v1/models/{MODEL}")
    assert card.status_code == 200 and card.json()["id"] == MODEL
    assert_openai_error(server.get("/v1/models/gpt-4"), 404, "gpt-4")
    import unison

    assert server.get("/version").json() == {"version": unison.__version__}


def test_unknown_fields_are_rejected_standard_ones_accepted(server, client):
    err = assert_openai_error(server.post(COMP, {"prompt": "hi", "max_tokens": 2, "not_a_field": {"x": 1}}),
                              400, "unknown field 'not_a_field'")
    assert err["param"] == "not_a_field"
    with pytest.raises(openai.BadRequestError, match="unknown field 'temperatur'"):
        complete(client, max_tokens=1, extra_body={"temperatur": 0.5})
    standard = {"user": "u-1", "metadata": {"a": "b"}, "store": False, "service_tier": "auto"}
    r = server.post(COMP, {"prompt": "hi", "max_tokens": 2, **standard})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    r = server.post(CHAT_URL, {"messages": [{"role": "user", "content": "hi", "extra": 1}],
                               "max_tokens": 2, "parallel_tool_calls": False, **standard})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    assert "gpt-4" in e.value.message
    with pytest.raises(openai.BadRequestError):
        complete(client, temperature=-1)


# ---- 4. overload ----------------------------------------------------------------------------


def test_overload_sheds_extra_requests_at_once(small_queue_server):
    """max_queued_requests counts waiting requests engine-wide (as SGLang's does), whichever
    worker took them: over it, every worker answers 503 at once and queues nothing."""
    s = small_queue_server
    body = {"model": MODEL, "prompt": PROMPT, "stream": True, **LONG}

    async def main():
        async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
            held = []
            for n in range(3):  # one runs, two wait: the queue is full
                r = await c.send(c.build_request("POST", COMP, json=body), stream=True)
                assert r.status_code == 200
                held.append(r)
                if n == 0:
                    await asyncio.to_thread(s.wait_running, 1)
            await asyncio.to_thread(wait_until, lambda: s.server_info()["num_waiting"] == 2, 30,
                                    "two waiting requests")

            async def extra(route: str, payload: dict) -> tuple[httpx.Response, float]:
                t0 = time.monotonic()
                r = await c.post(route, json=payload)
                return r, time.monotonic() - t0

            extras = await asyncio.gather(
                extra(COMP, body), extra(COMP, {**body, "stream": False}),
                extra(CHAT_URL, {"messages": HELLO, **LONG}),
                extra("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 99}}))
            for r, took in extras:
                assert_openai_error(r, 503, "overloaded", "max_queued_requests=2")
                assert took < 2.0, f"a shed request took {took:.2f} s"
            FIGURES["overload: slowest 503"] = max(took for _, took in extras)
            both = await asyncio.to_thread(_from_both, s, lambda: s.post(COMP, {"prompt": PROMPT}))
            for r in both.values():
                assert_openai_error(r, 503, "overloaded")
            info = s.server_info()
            assert (info["num_running"], info["num_waiting"]) == (1, 2)  # nothing more was queued
            for r in held:
                await r.aclose()

    asyncio.run(main())
    # The accepted ones were aborted as their clients left; the queue takes requests again.
    s.wait_freed(timeout=5)
    assert s.post(COMP, {"prompt": PROMPT, "max_tokens": 2}).status_code == 200


# ---- 5. client disconnects ------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_client_disconnect_aborts_in_the_core(server, stream):
    body = {"model": MODEL, "prompt": LONG_TEXT, "stream": stream, **LONG}
    if stream:
        with HTTP.stream("POST", server.url + COMP, json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ") and next(lines) == ""
            assert server.server_info()["num_running"] == 1
        left = time.monotonic()
    else:
        gone: list[float] = []

        def post() -> None:  # gives up after 2 s without an answer: closes its connection
            with contextlib.suppress(httpx.ReadTimeout):
                HTTP.post(server.url + COMP, json=body, timeout=httpx.Timeout(30, read=2.0))
                return
            gone.append(time.monotonic())

        t = threading.Thread(target=post)
        t.start()
        server.wait_running(1)
        t.join(10)
        assert gone, "the client did not time out: the request ended on its own"
        left = gone[0]
    server.wait_freed(timeout=3)
    took = time.monotonic() - left
    FIGURES[f"client disconnect ({'streaming' if stream else 'non-streaming'}) to KV freed"] = took
    assert took < 3


# ---- 6. SIGTERM with requests in flight -----------------------------------------------------


def _in_flight(server: Server, n_stream: int, n_plain: int) -> tuple[list[threading.Thread], dict]:
    """Start long requests in threads; returns them and what each client saw, once it ends."""
    seen: dict[int, tuple] = {}

    def stream(k: int) -> None:
        body = {"prompt": PROMPT, "stream": True, **LONG}
        try:
            with HTTP.stream("POST", server.url + COMP, json=body, headers=server.headers,
                              timeout=30) as r:
                seen[k] = ("stream", r.status_code, [x for x in r.iter_lines() if x][-2:])
        except httpx.HTTPError as e:
            seen[k] = ("stream", type(e).__name__)

    def plain(k: int) -> None:
        try:
            r = server.post(COMP, {"prompt": PROMPT, **LONG})
            seen[k] = ("plain", r.status_code, r.text)
        except httpx.HTTPError as e:
            seen[k] = ("plain", type(e).__name__)

    threads = [threading.Thread(target=stream if k < n_stream else plain, args=(k,))
               for k in range(n_stream + n_plain)]
    for t in threads:
        t.start()
    server.wait_running(n_stream + n_plain)
    return threads, seen


def _looks_complete(seen: tuple) -> bool:
    """A client's view of a request that ran to its end: a 200 and, for a stream, [DONE] with
    no error event before it (a stream cut off after its 200 says so in an error event)."""
    if len(seen) == 2 or seen[1] != 200:
        return False
    if seen[0] == "plain":
        return True
    return seen[2][-1:] == ["data: [DONE]"] and not any('"error"' in line for line in seen[2])


def test_sigterm_with_requests_in_flight():
    server = Server("--chunked-prefill-size", "64")
    try:
        threads, seen = _in_flight(server, 2, 1)
        server.proc.send_signal(signal.SIGTERM)
        code, took = server.wait_exit(10)
        FIGURES["SIGTERM with 3 requests in flight to exit"] = took
        assert code == 0, server.output()
        server.assert_gone()
        for t in threads:
            t.join(5)
        assert len(seen) == 3, f"a client hangs after the server exited: {seen}"
        for s in seen.values():  # cut off (after the 5 s drain), never passed off as complete
            assert not _looks_complete(s), s
    finally:
        if server.proc.poll() is None:
            server.kill()


# ---- 7. the core killed ---------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2])
def test_core_killed_fails_clients_and_stops_the_launcher(workers):
    server = Server("--chunked-prefill-size", "64", workers=workers, api_key=KEY)
    try:
        threads, seen = _in_flight(server, 2, 2)
        t0 = time.monotonic()
        os.kill(server.core_pid, signal.SIGKILL)
        for t in threads:
            t.join(10)
        FIGURES[f"core kill -9 to in-flight clients failed ({workers} worker(s))"] = \
            time.monotonic() - t0
        assert len(seen) == 4, f"a client hangs after the core died: {seen}"
        code, _ = server.wait_exit(max(0.1, 10 - (time.monotonic() - t0)))
        FIGURES[f"core kill -9 to launcher exit ({workers} worker(s))"] = time.monotonic() - t0
        assert code != 0
        log = server.output()
        assert f"the engine core (pid {server.core_pid}) exited (killed by SIGKILL)" in log, log
        server.assert_gone()
        for s in seen.values():  # an error that says why, in the response or in the stream
            assert len(s) == 3, s
            if s[0] == "plain":
                assert_openai_error(httpx.Response(s[1], text=s[2]), 503, "engine is not running")
            else:
                assert s[1] == 200 and s[2][1] == "data: [DONE]", s
                error = json.loads(s[2][0].removeprefix("data: "))["error"]
                assert error["code"] == 503 and "engine is not running" in error["message"], s
    finally:
        if server.proc.poll() is None:
            server.kill()
