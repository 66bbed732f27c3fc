"""Frontend cost: how much CPU the per-request Python work takes per streamed token.

The core runs a tiny random model (`load_format="dummy"`: the real tokenizer and vocabulary, a
one-layer forward), so the frontends do the request's whole Python work while the model costs
little. W attached processes share the streams; each reports its own CPU time (getrusage: all
threads), the tokens and the deliveries (stream items: one per token unless a consumer fell
behind and got several merged, which the figures show rather than hide). With --http the
frontends are `unison serve` workers, timed from /proc while a client that discards the bytes
streams SSE from them; the core's busy fraction says whether the core or the frontends limit.
With --prompt-tokens the requests carry long prompts (chat messages over HTTP) and one output
token: the CPU per prompt token of tokenizing and chat templates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from unison import Engine
from unison.bench.local_server import attached, proc_cpu_seconds, serving

if TYPE_CHECKING:
    from multiprocessing.queues import Queue
    from multiprocessing.synchronize import Event

PROMPT = "Tell me a long story about a lighthouse keeper and the sea."
# About 14 tokens a repetition with the embedded model's tokenizer (plain English).
LONG_TEXT = "The keeper climbed the spiral stairs each evening to light the great lamp above the sea. "
REPEATS = 3  # each figure: the median of this many runs


@dataclass
class Load:
    """What a run asks for: `streams` at a time, `requests` in all, `tokens` each; prompts of
    about `prompt_tokens` tokens (0: a short one)."""

    streams: int
    requests: int
    tokens: int
    prompt_tokens: int = 0

    @property
    def prompt(self) -> str:
        return LONG_TEXT * max(self.prompt_tokens // 14, 1) if self.prompt_tokens else PROMPT


@dataclass
class Run:
    """One timed run: frontend CPU (all frontends), tokens out, prompt tokens in, deliveries."""

    workers: int
    wall_s: float
    cpu_s: float
    tokens: int
    prompt_tokens: int
    deliveries: int
    core_busy: float = float("nan")  # the core's CPU / wall (HTTP runs)

    @property
    def us_per_token(self) -> float:
        return 1e6 * self.cpu_s / max(self.tokens, 1)

    @property
    def us_per_prompt_token(self) -> float:
        return 1e6 * self.cpu_s / max(self.prompt_tokens, 1)

    @property
    def tokens_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def deliveries_per_token(self) -> float:
        return self.deliveries / max(self.tokens, 1)


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ---- Engine API frontends -------------------------------------------------------------------


async def _stream_all(engine: Engine, load: Load) -> tuple[int, int, int]:
    """(tokens, prompt tokens, deliveries) of `load` streamed through `engine`."""
    params = {"max_new_tokens": load.tokens, "ignore_eos": True, "temperature": 0}
    queue, tokens, prompt_tokens, deliveries = list(range(load.requests)), 0, 0, 0

    async def client() -> None:
        nonlocal tokens, prompt_tokens, deliveries
        while queue:
            queue.pop()
            chunks = await engine.async_generate(load.prompt, params, stream=True)
            assert not isinstance(chunks, dict | list)  # stream=True: an async iterator of chunks
            last: dict = {}
            async for chunk in chunks:  # the consumer does nothing but count
                deliveries += 1
                last = chunk
            tokens += len(last["output_ids"])
            prompt_tokens += last["meta_info"]["prompt_tokens"]

    await asyncio.gather(*(client() for _ in range(load.streams)))
    return tokens, prompt_tokens, deliveries


def _frontend(parent: int, load: Load, ready: Queue[int], go: Event, results: Queue[tuple]) -> None:
    engine = Engine.attach_tokenizer_worker(parent)
    try:
        asyncio.run(_stream_all(engine, Load(2, 4, 8)))  # warm up the code paths
        ready.put(os.getpid())
        go.wait()
        cpu0, t0 = _cpu_seconds(), time.perf_counter()
        counts = asyncio.run(_stream_all(engine, load))
        results.put((_cpu_seconds() - cpu0, time.perf_counter() - t0, *counts))
    finally:
        engine.shutdown()


def run_engine(workers: int, load: Load, model_path: str | None) -> Run:
    """`workers` attached processes, each streaming its share of `load`."""
    ctx = mp.get_context("spawn")
    ready: Queue[int] = ctx.Queue()
    results: Queue[tuple] = ctx.Queue()
    go = ctx.Event()
    share = Load(load.streams // workers, load.requests // workers, load.tokens, load.prompt_tokens)
    with Engine(model_path=model_path, load_format="dummy", tokenizer_worker_num=workers + 1,
                max_running_requests=max(load.streams, 64)):
        procs = [ctx.Process(target=_frontend, args=(os.getpid(), share, ready, go, results))
                 for _ in range(workers)]
        for p in procs:
            p.start()
        try:
            for _ in procs:
                ready.get(timeout=120)
            t0 = time.perf_counter()
            go.set()
            outs = [results.get(timeout=600) for _ in procs]
            wall = time.perf_counter() - t0
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
    return Run(workers, wall, sum(o[0] for o in outs), sum(o[2] for o in outs), sum(o[3] for o in outs),
               sum(o[4] for o in outs))


# ---- HTTP workers ---------------------------------------------------------------------------


async def _sse_client(url: str, load: Load) -> tuple[int, int, int]:
    """`load` as streamed chat completions (a user message of the prompt); the bytes are read,
    counted (deliveries: SSE events bearing tokens) and dropped."""
    import httpx

    body = {"messages": [{"role": "user", "content": load.prompt}], "max_tokens": load.tokens,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    queue, tokens, prompt_tokens, deliveries = list(range(load.requests)), 0, 0, 0
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one() -> None:
            nonlocal tokens, prompt_tokens, deliveries
            while queue:
                queue.pop()
                tail = b""
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200, r.status_code
                    async for raw in r.aiter_raw():
                        deliveries += raw.count(b'"content":')
                        tail = (tail + raw)[-4096:]
                usage = json.loads(tail.rsplit(b"data: ", 2)[-2])["usage"]  # the last event before [DONE]
                tokens += usage["completion_tokens"]
                prompt_tokens += usage["prompt_tokens"]
        await asyncio.gather(*(one() for _ in range(load.streams)))
    return tokens, prompt_tokens, deliveries


def run_http(workers: int, load: Load, model_path: str | None) -> Run:
    """`unison serve --tokenizer-worker-num workers` in front of a dummy core: its workers' CPU."""
    cmd = [sys.executable, "-m", "unison.cli", "serve", "--load-format", "dummy",
           "--tokenizer-worker-num", str(workers), "--max-running-requests", str(max(load.streams, 64)),
           "--log-level", "error", *(["--model-path", model_path] if model_path else [])]
    with serving(cmd, "bench-frontend-http", timeout=120) as url:
        info = attached(url, workers)
        pids = [fe.pid for fe in info.frontends]
        asyncio.run(_sse_client(url, Load(2, 4, 8)))  # warm up
        cpu0, core0 = sum(map(proc_cpu_seconds, pids)), proc_cpu_seconds(info.core_pid)
        t0 = time.perf_counter()
        counts = asyncio.run(_sse_client(url, load))
        wall = time.perf_counter() - t0
        cpu, core = sum(map(proc_cpu_seconds, pids)) - cpu0, proc_cpu_seconds(info.core_pid) - core0
    return Run(workers, wall, cpu, *counts, core_busy=core / wall)


# ---- the command ----------------------------------------------------------------------------


def median_run(runs: list[Run]) -> Run:
    """The run of median CPU per token (per prompt token when they carry long prompts)."""
    key = (lambda r: r.us_per_prompt_token) if runs[0].tokens <= runs[0].prompt_tokens else \
        (lambda r: r.us_per_token)
    return sorted(runs, key=key)[len(runs) // 2]


def main(args: argparse.Namespace) -> int:
    if args.parts:
        from unison.bench import frontend_parts

        frontend_parts.main(args.gap_ms, args.repeats, args.model_path)
        return 0
    load = Load(args.streams, args.requests, 1 if args.prompt_tokens else args.tokens, args.prompt_tokens)
    bench = run_http if args.http else run_engine
    where = "HTTP workers (SSE)" if args.http else "Engine API frontends"
    print(f"{where}: {load.streams} streams, {load.requests} requests x {load.tokens} tokens"
          f"{f', prompts of ~{load.prompt_tokens} tokens' if load.prompt_tokens else ''}; median of "
          f"{args.repeats}; cores here: {os.cpu_count()}")
    head = "µs/prompt tok" if load.prompt_tokens else "µs/token"
    print(f"{'workers':>7} {'tok/s':>9} {head:>14} {'deliveries/tok':>15} {'core busy':>10}   runs ({head})")
    rows = []
    for w in (int(x) for x in args.workers.split(",")):
        runs = [bench(w, load, args.model_path) for _ in range(args.repeats)]
        r = median_run(runs)
        per = (lambda x: x.us_per_prompt_token) if load.prompt_tokens else (lambda x: x.us_per_token)
        print(f"{w:>7} {r.tokens_s:>9.0f} {per(r):>14.2f} {r.deliveries_per_token:>15.2f} "
              f"{r.core_busy:>10.2f}   {', '.join(f'{per(x):.2f}' for x in runs)}")
        rows.append(statistics.median(x.tokens_s for x in runs))
    if len(rows) > 1:
        print(f"scaling: {', '.join(f'{t / rows[0]:.2f}x' for t in rows)} tokens/s of the first")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("frontend", help="frontend CPU per streamed token, with a dummy model")
    p.add_argument("--workers", default="1", help="comma-separated frontend process counts")
    p.add_argument("--streams", type=int, default=64, help="concurrent streams in all")
    p.add_argument("--requests", type=int, default=256, help="requests in all")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="prompts of about this many tokens, one new token each: the CPU per prompt token")
    p.add_argument("--repeats", type=int, default=REPEATS, help="runs per figure (the median is shown)")
    p.add_argument("--model-path", default=None, help="its tokenizer and vocabulary are used")
    p.add_argument("--http", action="store_true",
                   help="`unison serve` workers streaming SSE chat completions instead of Engine frontends")
    p.add_argument("--parts", action="store_true",
                   help="the cost taken apart in one process: asyncio's own per wake-up, then Unison's "
                        "fan-out and consumers without the core or sockets")
    p.add_argument("--gap-ms", type=float, default=10.0,
                   help="with --parts: the idle time between steps (a core's step time)")
    p.set_defaults(func=main)
