"""Frontend cost: how much CPU the per-request Python work takes per streamed token.

The core runs a tiny random model (`load_format="dummy"`: the real tokenizer and vocabulary, a
forward that costs next to nothing), so the frontends are the bottleneck. W attached processes
share the streams; each reports its own CPU time (getrusage: all threads) and tokens. With
--http the frontend is a `unison serve` worker, timed from /proc while a client that discards
the bytes streams SSE from it.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import resource
import time
from typing import TYPE_CHECKING

from unison import Engine
from unison.wire.messages import ServerInfo

if TYPE_CHECKING:
    from multiprocessing.queues import Queue
    from multiprocessing.synchronize import Event

PROMPT = "Tell me a long story about a lighthouse keeper and the sea."


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _stream_all(engine: Engine, streams: int, requests: int, tokens: int) -> int:
    params = {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0}
    queue = list(range(requests))
    total = 0

    async def client() -> None:
        nonlocal total
        while queue:
            queue.pop()
            chunks = await engine.async_generate(PROMPT, params, stream=True)
            assert not isinstance(chunks, dict | list)  # stream=True: an async iterator of chunks
            n = 0
            async for chunk in chunks:
                n = len(chunk["output_ids"])  # the consumer does nothing
            total += n

    await asyncio.gather(*(client() for _ in range(streams)))
    return total


def _frontend(parent: int, streams: int, requests: int, tokens: int, ready: Queue[int], go: Event,
              results: Queue[dict[str, float]]) -> None:
    engine = Engine.attach_tokenizer_worker(parent)
    try:
        asyncio.run(_stream_all(engine, 2, 4, 8))  # warm up the code paths
        ready.put(os.getpid())
        go.wait()
        cpu0, t0 = _cpu_seconds(), time.perf_counter()
        n = asyncio.run(_stream_all(engine, streams, requests, tokens))
        results.put({"tokens": n, "cpu_s": _cpu_seconds() - cpu0, "wall_s": time.perf_counter() - t0,
                     "requests": requests})
    finally:
        engine.shutdown()


def run(workers: int, streams: int, requests: int, tokens: int, model_path: str | None) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    ready: Queue[int] = ctx.Queue()
    results: Queue[dict[str, float]] = ctx.Queue()
    go = ctx.Event()
    with Engine(model_path=model_path, load_format="dummy", tokenizer_worker_num=workers + 1,
                max_running_requests=max(streams, 64)):
        procs = [ctx.Process(target=_frontend, args=(os.getpid(), streams // workers, requests // workers,
                                                     tokens, ready, go, results))
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
    tokens_total = sum(o["tokens"] for o in outs)
    cpu = sum(o["cpu_s"] for o in outs)
    return {"workers": workers, "requests_s": sum(o["requests"] for o in outs) / wall,
            "tokens_s": tokens_total / wall, "us_per_token": 1e6 * cpu / tokens_total,
            "tokens": tokens_total, "wall_s": wall}


def _proc_cpu_seconds(pid: int) -> float:
    fields_ = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def _sse_client(url: str, streams: int, requests: int, tokens: int) -> int:
    """`requests` streamed completions, `streams` at a time; the bytes are read and dropped."""
    import httpx

    body = {"prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}
    queue = list(range(requests))
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one() -> None:
            while queue:
                queue.pop()
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200, r.status_code
                    async for _ in r.aiter_raw():
                        pass
        await asyncio.gather(*(one() for _ in range(streams)))
    return requests * tokens


def run_http(streams: int, requests: int, tokens: int, model_path: str | None) -> dict[str, float]:
    """One `unison serve` worker in front of a dummy core: its CPU per streamed SSE token."""
    import json
    import subprocess
    import sys
    import urllib.request

    from unison.bench.local_server import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "unison.cli", "serve", "--port", str(port), "--load-format", "dummy",
           "--max-running-requests", str(max(streams, 64)), "--log-level", "error"]
    if model_path:
        cmd += ["--model-path", model_path]
    server, url = subprocess.Popen(cmd), f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/get_server_info", timeout=2) as r:
                    info = ServerInfo.from_dict(json.load(r))
                if info.frontends:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("unison serve did not start")
            time.sleep(0.2)
        worker = info.frontends[0].pid
        asyncio.run(_sse_client(url, 2, 4, 8))  # warm up
        cpu0, t0 = _proc_cpu_seconds(worker), time.perf_counter()
        n = asyncio.run(_sse_client(url, streams, requests, tokens))
        cpu, wall = _proc_cpu_seconds(worker) - cpu0, time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(30)
    return {"workers": 1, "requests_s": requests / wall, "tokens_s": n / wall,
            "us_per_token": 1e6 * cpu / n, "tokens": n, "wall_s": wall}


def main(args: argparse.Namespace) -> int:
    if args.http:
        r = run_http(args.streams, args.requests, args.tokens, args.model_path)
        print(f"HTTP worker: {r['tokens_s']:.0f} tok/s, {r['us_per_token']:.1f} µs of its CPU per "
              f"streamed SSE token ({r['tokens']} tokens, {args.streams} streams; cores here: "
              f"{os.cpu_count()})")
        return 0
    rows = [run(w, args.streams, args.requests, args.tokens, args.model_path)
            for w in (int(x) for x in args.workers.split(","))]
    print(f"{'workers':>7} {'req/s':>8} {'tok/s':>9} {'frontend µs/tok':>16}  (cores here: {os.cpu_count()})")
    for r in rows:
        print(f"{r['workers']:>7} {r['requests_s']:>8.1f} {r['tokens_s']:>9.0f} {r['us_per_token']:>16.1f}")
    if len(rows) > 1:
        print(f"scaling {rows[-1]['workers']} vs {rows[0]['workers']} frontends: "
              f"{rows[-1]['tokens_s'] / rows[0]['tokens_s']:.2f}x tokens/s")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("frontend", help="frontend CPU per streamed token, with a dummy model")
    p.add_argument("--workers", default="1,2", help="comma-separated frontend process counts")
    p.add_argument("--streams", type=int, default=64, help="concurrent streams in all")
    p.add_argument("--requests", type=int, default=256, help="requests in all")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--model-path", default=None, help="its tokenizer and vocabulary are used")
    p.add_argument("--http", action="store_true",
                   help="time one `unison serve` worker streaming SSE instead of Engine frontends")
    p.set_defaults(func=main)
