"""One HTTP hop, measured: a trivial FastAPI route under plain uvicorn vs the same app as a Ray
Serve deployment (proxy actor -> replica). Median latency of 300 sequential requests, and the
throughput of 640 from 32 concurrent clients. Needs `pip install "ray[serve]"`.

    python benchmarks/ray_serve_hop.py uvicorn
    RAY_AUTH_MODE=disabled python benchmarks/ray_serve_hop.py serve
"""

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

APP = """
from fastapi import FastAPI
app = FastAPI()

@app.get("/ping")
async def ping():
    return {"ok": 1}
"""


def measure(url: str, n: int = 300) -> tuple[float, float]:
    """(median latency in ms, requests per second with 32 concurrent clients)"""
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
    where = tempfile.mkdtemp()
    Path(where, "app.py").write_text(APP)
    cmd = [sys.executable, "-m", "uvicorn", "app:app", "--port", "30201", "--log-level", "error"]
    server = subprocess.Popen(cmd, cwd=where)
    time.sleep(3)
    try:
        report("uvicorn", "http://127.0.0.1:30201/ping")
    finally:
        server.terminate()
        server.wait()


def ray_serve() -> None:
    import ray
    from fastapi import FastAPI
    from ray import serve

    app = FastAPI()

    @serve.deployment(num_replicas=1)
    @serve.ingress(app)
    class Ping:
        @app.get("/ping")
        async def ping(self):
            return {"ok": 1}

    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"port": 30202})
    serve.run(Ping.bind(), route_prefix="/")
    time.sleep(2)
    try:
        report("ray serve", "http://127.0.0.1:30202/ping")
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    uvicorn() if sys.argv[1:] == ["uvicorn"] else ray_serve()
