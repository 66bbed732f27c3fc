"""`unison bench serve` and its datasets: the metric arithmetic, arrivals, prompt sources, and a
short real run against a fake OpenAI-style streaming server (no model needed)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import threading

import pytest

from unison.bench import serve
from unison.bench.datasets import WORDS, estimate_tokens, grounded_chats, random_requests, sharegpt_requests
from unison.bench.serve import RequestResult, summarize

# ---- summarize ------------------------------------------------------------------------------


def test_summarize_hand_computed():
    results = [
        RequestResult(prompt_tokens=10, output_tokens=5, ttft=0.1, itl=[0.02, 0.03, 0.05, 0.1],
                      latency=0.3),  # TPOT (0.3 - 0.1) / 4 = 50 ms
        RequestResult(prompt_tokens=20, output_tokens=3, ttft=0.2, itl=[0.1, 0.1],
                      latency=0.4),  # TPOT 100 ms
        RequestResult(prompt_tokens=30, output_tokens=1, ttft=0.3, latency=0.3),  # no TPOT
        RequestResult(prompt_tokens=40, error="HTTP 500: boom"),
        RequestResult(prompt_tokens=50, output_tokens=9, ttft=9.0, latency=9.0, error="timeout"),
    ]
    s = summarize(results, duration=2.0)
    approx = pytest.approx
    assert (s["completed"], s["failed"], s["first_error"]) == (3, 2, "HTTP 500: boom")
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (60, 9)
    assert s["request_throughput"] == approx(1.5)
    assert s["output_throughput"] == approx(4.5)
    assert s["total_token_throughput"] == approx(34.5)
    # TTFT 100, 200, 300 ms: numpy's linear percentiles, p99 at index 1.98.
    assert s["mean_ttft_ms"] == approx(200) and s["median_ttft_ms"] == approx(200)
    assert s["p90_ttft_ms"] == approx(280) and s["p99_ttft_ms"] == approx(298)
    # TPOT 50, 100 ms (the one-token request is left out).
    assert s["mean_tpot_ms"] == approx(75) and s["median_tpot_ms"] == approx(75)
    assert s["p90_tpot_ms"] == approx(95) and s["p99_tpot_ms"] == approx(99.5)
    # ITL 20, 30, 50, 100, 100, 100 ms.
    assert s["mean_itl_ms"] == approx(400 / 6) and s["median_itl_ms"] == approx(75)
    assert s["p99_itl_ms"] == approx(100)
    # E2E 300, 400, 300 ms.
    assert s["mean_e2el_ms"] == approx(1000 / 3) and s["median_e2el_ms"] == approx(300)
    assert s["p99_e2el_ms"] == approx(398)
    assert s["std_ttft_ms"] == approx(statistics.pstdev([100, 200, 300]))
    assert "Serving Benchmark Result" in serve.format_summary(s)


def test_summarize_all_failed():
    s = summarize([RequestResult(prompt_tokens=5, error="refused")], duration=1.0)
    assert (s["completed"], s["failed"], s["output_throughput"]) == (0, 1, 0.0)
    assert s["mean_ttft_ms"] is None and s["p99_itl_ms"] is None
    assert "first error: refused" in serve.format_summary(s)


# ---- arrivals -------------------------------------------------------------------------------


def test_poisson_arrivals():
    gaps = serve.inter_arrival_times(20000, rate=4.0, seed=1)
    assert gaps == serve.inter_arrival_times(20000, rate=4.0, seed=1)
    assert gaps != serve.inter_arrival_times(20000, rate=4.0, seed=2)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
    assert statistics.pstdev(gaps) == pytest.approx(0.25, rel=0.05)  # exponential: std = mean
    offsets = serve.arrival_offsets(100, rate=10.0, seed=3)
    assert len(offsets) == 100 and offsets[0] == 0.0
    assert all(b >= a for a, b in itertools.pairwise(offsets))
    assert serve.inter_arrival_times(5, float("inf")) == [0.0] * 5
    assert serve.arrival_offsets(5, float("inf")) == [0.0] * 5
    assert serve.arrival_offsets(0, 2.0) == []
    with pytest.raises(ValueError):
        serve.inter_arrival_times(3, 0.0)


# ---- datasets -------------------------------------------------------------------------------


def test_random_requests():
    reqs = random_requests(50, input_len=100, output_len=20, range_ratio=0.5, seed=7)
    assert reqs == random_requests(50, input_len=100, output_len=20, range_ratio=0.5, seed=7)
    assert reqs != random_requests(50, input_len=100, output_len=20, range_ratio=0.5, seed=8)
    for r in reqs:
        words = r.prompt.split()
        assert len(words) == r.prompt_len and 50 <= r.prompt_len <= 150
        assert 10 <= r.output_len <= 30
        assert set(words) <= set(WORDS)
    fixed = random_requests(3, input_len=64, output_len=8)
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(64, 8)] * 3
    with pytest.raises(ValueError):
        random_requests(1, 10, 10, range_ratio=1.0)


def test_grounded_chats():
    """`bench long --quality --prompt-set chat`'s prompts: grounded tasks in one message, at
    least `tokens` long as the encoder counts them, seeded by their index."""
    def encode(text):
        return [len(w) for w in text.split()]

    def render(text):
        return [-1] + encode(text) + [-2]  # a chat template's markers around the message

    prompts = grounded_chats(encode, render, 3, 300)
    assert prompts == grounded_chats(encode, render, 3, 300) and len(set(map(tuple, prompts))) == 3
    assert all(p[0] == -1 and p[-1] == -2 and 300 <= len(p) - 2 < 600 for p in prompts)
    assert grounded_chats(encode, render, 4, 300)[:3] == prompts


def test_sharegpt_loader(tmp_path):
    def conv(*turns):
        return {"conversations": [{"from": who, "value": text} for who, text in turns]}

    reply = "The sea is wide and the ships sail on it every day of the year."
    data = [
        conv(("human", "Tell me about the sea and the ships on it."), ("gpt", reply)),
        conv(("human", "A lonely question with no answer at all.")),  # one turn
        conv(("human", "Hi"), ("gpt", reply)),  # prompt too short
        conv(("human", "Say something short to me please."), ("gpt", "Ok.")),  # reply too short
        conv(("gpt", "Welcome!"), ("human", "What is the tallest mountain on earth?"),
             ("gpt", "Mount Everest is the tallest mountain above sea level.")),
        conv(("human", "word " * 1100), ("gpt", reply)),  # prompt over 1,024
        {"id": "no conversations"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))

    reqs = sharegpt_requests(str(path), 2, seed=0)
    assert sorted(r.prompt for r in reqs) == ["Tell me about the sea and the ships on it.",
                                              "What is the tallest mountain on earth?"]
    sea = next(r for r in reqs if r.prompt.startswith("Tell"))
    assert (sea.prompt_len, sea.output_len) == (11, estimate_tokens(reply)) == (11, 16)

    more = sharegpt_requests(str(path), 5, seed=0)  # only two pass: drawn again to make five
    assert len(more) == 5 and {r.prompt for r in more} == {r.prompt for r in reqs}

    fixed = sharegpt_requests(str(path), 10, seed=0, output_len=8)  # no reply-length filter
    assert {r.output_len for r in fixed} == {8}
    assert "Say something short to me please." in {r.prompt for r in fixed}

    words = sharegpt_requests(str(path), 2, seed=0, count_tokens=lambda t: len(t.split()))
    assert {r.prompt_len for r in words} == {10, 7}

    path.write_text(json.dumps([conv(("human", "Hi"), ("gpt", "Hello"))]))
    with pytest.raises(ValueError):
        sharegpt_requests(str(path), 1)


# ---- a real run against a fake server -------------------------------------------------------

FIRST, GAP, CHUNKS, USAGE_TOKENS = 0.10, 0.03, 5, 7


class FakeOpenAI:
    """An OpenAI-style streaming server on a free 127.0.0.1 port, in its own thread: waits FIRST
    seconds, sends CHUNKS content chunks GAP apart, a finish chunk, a usage chunk (completions
    only, reporting USAGE_TOKENS) and [DONE]. Chat streams open with a role-only chunk."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.active = self.peak = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="fake-openai", daemon=True)

    def __enter__(self) -> FakeOpenAI:
        started = threading.Event()
        self._started = started
        self.thread.start()
        assert started.wait(5)
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        assert not self.thread.is_alive()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._started.set()
        try:
            self.loop.run_forever()
        finally:
            server.close()
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.loop.run_until_complete(asyncio.sleep(0))
            self.loop.run_until_complete(server.wait_closed())
            self.loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            method, path, _ = head.split("\r\n", 1)[0].split(" ")
            length = next((int(h.split(":", 1)[1]) for h in head.split("\r\n")
                           if h.lower().startswith("content-length:")), 0)
            body = json.loads(await reader.readexactly(length)) if length else {}
            if method == "GET" and path == "/v1/models":
                await self._json(writer, 200, {"object": "list", "data": [{"id": "fake-model"}]})
            elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                self.bodies.append(body)
                await self._stream(writer, chat=path.endswith("chat/completions"))
            else:
                await self._json(writer, 404, {"error": {"message": f"no route {path}"}})
        finally:
            writer.close()

    async def _json(self, writer: asyncio.StreamWriter, status: int, doc: dict) -> None:
        data = json.dumps(doc).encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()

    async def _stream(self, writer: asyncio.StreamWriter, chat: bool) -> None:
        self.active += 1
        self.peak = max(self.peak, self.active)

        async def send(doc: dict | str) -> None:
            writer.write(f"data: {doc if isinstance(doc, str) else json.dumps(doc)}\n\n".encode())
            await writer.drain()

        def choice(text: str, finish: str | None = None) -> dict:
            if chat:
                delta = {"content": text} if text else {}
                return {"index": 0, "delta": delta, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        try:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Connection: close\r\n\r\n")
            if chat:
                await send({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            await asyncio.sleep(FIRST)
            for i in range(CHUNKS):
                if i:
                    await asyncio.sleep(GAP)
                await send({"choices": [choice(f" w{i}")]})
            await send({"choices": [choice("", "length")]})
            if not chat:
                await send({"choices": [], "usage": {"prompt_tokens": 3,
                                                     "completion_tokens": USAGE_TOKENS}})
            await send("[DONE]")
        finally:
            self.active -= 1


@pytest.fixture(scope="module")
def fake_server():
    with FakeOpenAI() as server:
        yield server


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers(dest="bench"))
    return parser.parse_args(argv)


def _check_timings(requests: list[dict]) -> None:
    for r in requests:
        assert r["error"] is None
        assert FIRST * 0.9 <= r["ttft"] <= FIRST + 0.3
        assert len(r["itl"]) == CHUNKS - 1
        assert GAP * 0.8 <= statistics.fmean(r["itl"]) <= GAP + 0.1
        assert r["latency"] >= FIRST + (CHUNKS - 1) * GAP * 0.9


def test_serve_cli_against_fake_server(fake_server, tmp_path, capsys):
    result = tmp_path / "result.json"
    args = _parse(["serve", "--base-url", fake_server.url + "/v1", "--num-prompts", "4",
                   "--input-len", "12", "--output-len", "9", "--max-concurrency", "2",
                   "--ignore-eos", "--result-file", str(result), "--quiet"])
    fake_server.bodies.clear()
    fake_server.peak = 0
    assert args.func(args) == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out

    doc = json.loads(result.read_text())
    assert doc["config"]["model"] == "fake-model" and doc["config"]["request_rate"] == "inf"
    s = doc["summary"]
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (4, 0, 4 * USAGE_TOKENS)
    assert s["total_input_tokens"] == 4 * 3  # the server's usage wins over the word count
    assert len(doc["requests"]) == 4
    _check_timings(doc["requests"])
    assert {r["output_tokens"] for r in doc["requests"]} == {USAGE_TOKENS}
    assert s["mean_ttft_ms"] == pytest.approx(
        1000 * statistics.fmean(r["ttft"] for r in doc["requests"]))
    # Two waves of two under the cap: the run takes at least twice one request.
    assert fake_server.peak <= 2
    assert s["duration_s"] >= 2 * (FIRST + (CHUNKS - 1) * GAP)

    body = fake_server.bodies[-1]  # 1 test request + 4 timed
    assert len(fake_server.bodies) == 5
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 9 and body["ignore_eos"] is True and body["model"] == "fake-model"
    assert len(body["prompt"].split()) == 12


def test_serve_chat_counts_chunks_without_usage(fake_server):
    samples = random_requests(3, input_len=8, output_len=5, seed=1)
    out = asyncio.run(serve.run_benchmark(samples, fake_server.url, serve.CHAT, model="m",
                                          request_rate=50.0, quiet=True))
    requests = [vars(r) for r in out["results"]]
    _check_timings(requests)  # the role-only chunk does not count as the first token
    assert {r["output_tokens"] for r in requests} == {CHUNKS}
    assert out["summary"]["completed"] == 3
    body = fake_server.bodies[-1]
    assert body["messages"] == [{"role": "user", "content": body["messages"][0]["content"]}]
    assert body["max_completion_tokens"] == 5 and "ignore_eos" not in body


def test_serve_failures(fake_server):
    samples = random_requests(2, input_len=4, output_len=4)
    with pytest.raises(ValueError, match="404"):
        asyncio.run(serve.run_benchmark(samples, fake_server.url, "/v1/nowhere", model="m",
                                        quiet=True))
    out = asyncio.run(serve.run_benchmark(samples, fake_server.url, "/v1/nowhere", model="m",
                                          quiet=True, test_request=False))
    s = out["summary"]
    assert (s["completed"], s["failed"]) == (0, 2)
    assert s["first_error"].startswith("HTTP 404") and "no route /v1/nowhere" in s["first_error"]


def test_frontend_parts_measure_one_delivery_per_token():
    """`bench frontend --parts` at no gap: the bare wake-up costs something, and the in-process path
    delivers every token (its consumers run between steps)."""
    from unison.bench import frontend_parts

    assert frontend_parts.floor_us(0.0, asyncio.new_event_loop) > 0
    us, deliveries_per_token = frontend_parts.in_process_us(0.0, frontend_parts.load_tokenizer(None))
    assert us > 0 and deliveries_per_token == 1.0
