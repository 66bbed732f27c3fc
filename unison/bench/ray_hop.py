"""`unison bench ray-hop`: one HTTP hop, measured: a trivial FastAPI route under plain uvicorn vs the
same app as a Ray Serve deployment (proxy actor -> replica). Median latency of 300 sequential
requests, and the throughput of 640 from 32 concurrent clients. `serve` needs `pip install "ray[serve]"`.

    unison bench ray-hop uvicorn
    RAY_AUTH_MODE=disabled unison bench ray-hop serve
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from unison.bench.local_server import free_port, stop, wait_ready

APP = """
from fastapi import FastAPI
app = FastAPI()

@app.get("/ping")
async def ping():
    return {"ok": 1}
"""


def measure(url: str, n: int = 300) -> tuple[float, float]:
    """(median latency in ms, requests per second with 32 concurrent clients)"""
    import httpx

    with httpx.Client() as client:
        for _ in range(20):
            client.get(url)
        latencies = []
        for _ in range(n):
            t = time.perf_counter()
            client.get(url)
            latencies.append(time.perf_counter() - t)

    async def concurrent() -> float:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=32)) as client:
            t = time.perf_counter()
            await asyncio.gather(*(client.get(url) for _ in range(640)))
            return 640 / (time.perf_counter() - t)

    return statistics.median(latencies) * 1e3, asyncio.run(concurrent())


def report(name: str, url: str) -> None:
    ms, rate = measure(url)
    print(f"{name}: median {ms:.2f} ms, {rate:.0f} req/s")


def uvicorn() -> None:
    with tempfile.TemporaryDirectory() as where:
        Path(where, "app.py").write_text(APP)
        port = free_port()
        cmd = [sys.executable, "-m", "uvicorn", "app:app", "--port", str(port), "--log-level", "error"]
        server = subprocess.Popen(cmd, cwd=where, start_new_session=True)
        try:
            wait_ready(f"http://127.0.0.1:{port}", server, "/ping", timeout=60)
            report("uvicorn", f"http://127.0.0.1:{port}/ping")
        finally:
            stop(server)


def ray_serve() -> None:
    import ray
    from fastapi import FastAPI
    from ray import serve

    app = FastAPI()

    class Ping:
        @app.get("/ping")
        async def ping(self) -> dict[str, int]:
            return {"ok": 1}

    deployment = serve.deployment(num_replicas=1)(serve.ingress(app)(Ping))

    port = free_port()
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"port": port})
    serve.run(deployment.bind(), route_prefix="/")
    time.sleep(2)
    try:
        report("ray serve", f"http://127.0.0.1:{port}/ping")
    finally:
        serve.shutdown()
        ray.shutdown()


def main(args: argparse.Namespace) -> int:
    if args.server == "uvicorn":
        uvicorn()
    else:
        ray_serve()
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("ray-hop", help="one HTTP hop: plain uvicorn vs a Ray Serve deployment")
    p.add_argument("server", choices=["uvicorn", "serve"], help="serve: needs ray[serve]")
    p.set_defaults(func=main)
