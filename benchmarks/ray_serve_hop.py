"""One HTTP hop, measured: a trivial FastAPI route under plain uvicorn vs the same app as a Ray
Serve deployment (proxy actor -> replica). Median latency of sequential requests, and
throughput with 32 concurrent clients."""
import asyncio, statistics, subprocess, sys, time, os
import httpx

APP = '''
from fastapi import FastAPI
app = FastAPI()
@app.get("/ping")
async def ping():
    return {"ok": 1}
'''

def measure(url, n=300):
    with httpx.Client() as c:
        for _ in range(20): c.get(url)
        lat = []
        for _ in range(n):
            t = time.perf_counter(); c.get(url); lat.append(time.perf_counter() - t)
    async def conc():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=32)) as c:
            t = time.perf_counter()
            await asyncio.gather(*(c.get(url) for _ in range(640)))
            return 640 / (time.perf_counter() - t)
    return statistics.median(lat) * 1e3, asyncio.run(conc())

mode = sys.argv[1]
if mode == "uvicorn":
    open("/tmp/rs/app.py", "w").write(APP)
    p = subprocess.Popen([sys.executable, "-m", "uvicorn", "app:app", "--port", "30201", "--log-level", "error"], cwd="/tmp/rs")
    time.sleep(3)
    try: print("uvicorn: median %.2f ms, %.0f req/s" % measure("http://127.0.0.1:30201/ping"))
    finally: p.terminate(); p.wait()
else:
    import ray
    from ray import serve
    from fastapi import FastAPI
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
    try: print("ray serve: median %.2f ms, %.0f req/s" % measure("http://127.0.0.1:30202/ping"))
    finally: serve.shutdown(); ray.shutdown()
