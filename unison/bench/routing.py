"""`unison bench serve --routings least_loaded,prefix,kv`: the data-parallel routing modes side by side.

For each mode it starts `unison serve --data-parallel-size N --routing MODE <--serve-args>` on a
free port, runs the same requests `--trials` times (the prefix caches flushed before each, so
every trial starts cold), and stops the server. The table gives each mode's medians: throughput,
the prefix-cache hit rate and that rate as a share of the workload's ceiling: the hit rate if
every request after a group's first found its group's whole shared prefix cached.
"""

from __future__ import annotations

import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable

from unison.bench import Json
from unison.bench.datasets import SampleRequest
from unison.bench.local_server import free_port
from unison.wire.messages import ServerInfo

READY_S = 300.0


class _Server:
    def __init__(self, routing: str, size: int, serve_args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"bench-{routing}-", suffix=".log")
        cmd = [sys.executable, "-m", "unison.cli", "serve", "--port", str(self.port),
               "--data-parallel-size", str(size), "--routing", routing, *shlex.split(serve_args)]
        env = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", **os.environ}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.size = size

    def wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"the server exited while starting:\n{self.log.read()[-3000:]}")
            try:
                r = httpx.get(self.url + "/get_server_info", timeout=5)
                if r.status_code == 200 and len(r.json().get("replicas", [])) == self.size:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the server did not get ready within {READY_S:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def ceiling(samples: list[SampleRequest], url: str, block_size: int) -> float:
    """The workload's best hit rate: per group (requests whose text shares the part before the
    first newline), every request but the first finds the group's common token prefix cached, in
    whole blocks."""
    import httpx

    def ids(text: str) -> list[int]:
        r = httpx.post(url + "/tokenize", json={"prompt": text}, timeout=30)
        r.raise_for_status()
        return r.json()["tokens"]

    groups: dict[str, list[list[int]]] = defaultdict(list)
    for s in samples:
        groups[str(s.prompt).split("\n", 1)[0]].append(ids(str(s.prompt)))
    hits = 0
    for members in groups.values():
        for other in members[1:]:
            hits += len(os.path.commonprefix([members[0], other])) // block_size * block_size
    return hits / max(sum(len(t) for g in groups.values() for t in g), 1)


def compare(samples: list[SampleRequest], routings: list[str], size: int, trials: int, serve_args: str,
            run: Callable[[str], Json]) -> list[Json]:
    """`run(base_url)` runs the benchmark once and returns its summary; a row per routing mode (as the
    result file holds them)."""
    import httpx

    rows = []
    for routing in routings:
        server = _Server(routing, size, serve_args)
        try:
            server.wait_ready()
            info = ServerInfo.from_dict(httpx.get(server.url + "/get_server_info", timeout=30).json())
            top = ceiling(samples, server.url, info.core.block_size)
            summaries = []
            for _ in range(trials):
                flushed = httpx.post(server.url + "/flush_cache", timeout=60)
                if flushed.status_code != 200:
                    raise RuntimeError(f"/flush_cache failed: {flushed.text}")
                summaries.append(run(server.url))
        finally:
            server.stop()
        med = {key: statistics.median(s[key] for s in summaries) for key in (
            "prefix_cache_hit_rate", "request_throughput", "total_token_throughput", "output_throughput")}
        rows.append({"routing": routing, "trials": trials, "ceiling": top,
                     "hit_rate": med["prefix_cache_hit_rate"],
                     "of_ceiling": med["prefix_cache_hit_rate"] / top,
                     "request_throughput": med["request_throughput"],
                     "total_token_throughput": med["total_token_throughput"],
                     "output_throughput": med["output_throughput"],
                     "each": [{k: s[k] for k in ("prefix_cache_hit_rate", "total_token_throughput",
                                                 "request_throughput")} for s in summaries]})
    base = next((r for r in rows if r["routing"] == "least_loaded"), rows[0])
    for r in rows:
        r["vs_least_loaded"] = r["total_token_throughput"] / base["total_token_throughput"]
    return rows


def format_table(rows: list[Json]) -> str:
    lines = [f"{'routing':<13}{'hit rate':>9}{'ceiling':>9}{'of ceil':>9}{'req/s':>8}{'tok/s':>9}"
             f"{'vs least':>10}"]
    for r in rows:
        lines.append(f"{r['routing']:<13}{r['hit_rate']:>9.3f}{r['ceiling']:>9.3f}{r['of_ceiling']:>9.2f}"
                     f"{r['request_throughput']:>8.2f}{r['total_token_throughput']:>9.0f}"
                     f"{r['vs_least_loaded']:>9.2f}x")
    return "\n".join(lines)
