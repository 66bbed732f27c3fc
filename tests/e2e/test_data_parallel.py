"""`unison serve --data-parallel-size 2`: two engine cores in Ray actors behind one address.

One server for the module, on the local Ray instance it starts and stops itself (its files in
the server's runtime directory). Ray's own token auth is off: everything here is on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests import conftest  # pytest's own instance (tests/ is a package: pytest imports it as tests.conftest)
from tests.e2e.test_engine import PROMPTS
from tests.serving import free_port
from tests.utils import HTTP, wait_until
from unison import Engine
from unison.deploy.replicas import Replicas
from unison.model.weights.loader import cache_root, default_gguf_path

pytest.importorskip("ray", reason="the data-parallel tests need the ray extra (make test installs it)")

RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
# A server with a HOME of its own keeps the built kernels and converted GGUFs of ours: without
# them both replicas compile the C kernels afresh (most of a minute on 2 cores).
CACHE_ENV = {"UNISON_CACHE_DIR": str(cache_root())}
BACK_WITHIN_S = 30.0  # a replica whose core died serves again within this


class DPServer:
    def __init__(self, *args: str, ray_address: str | None, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="serve-dp-", suffix=".log")
        cmd = [sys.executable, "-m", "unison.cli", "serve", "--port", str(self.port), "--num-threads", "1",
               "--data-parallel-size", "2", *(["--ray-address", ray_address] if ray_address else []), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **RAY_ENV, **(env or {})})
        try:
            wait_until(self._ready, 120, "the data-parallel server to get ready")
        except BaseException:
            self.kill()
            raise

    def _ready(self) -> bool:
        assert self.proc.poll() is None, Path(self.log.name).read_text()
        with contextlib.suppress(httpx.TransportError):
            r = HTTP.get(self.url + "/get_server_info", timeout=5)
            return r.status_code == 200 and len(r.json().get("replicas", [])) == 2
        return False

    def info(self) -> dict:
        r = HTTP.get(self.url + "/get_server_info", timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self) -> float:
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(30) == 0, Path(self.log.name).read_text()
        return time.monotonic() - start

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def dp(tmp_path_factory):
    """The server with a local Ray instance of its own (no --ray-address): Ray's processes, the
    actors and their cores live with it. They carry a mark, so that Ray's workers coming and
    going are not counted per test; once the server has stopped, the module's leak check
    requires every one of them gone, with every file and socket."""
    mark = str(tmp_path_factory.mktemp("dp"))
    conftest.MODULE_TREES.add(mark)
    server = DPServer(ray_address=None, env={"UNISON_TEST_MODULE_TREE": mark, "HOME": mark, **CACHE_ENV})
    try:
        yield server
    finally:
        try:
            took = server.stop()
            print(f"\n[figure] SIGTERM to exit, data parallel with its own local Ray: {took:.2f} s")
            wait_until(lambda: not _marked(mark), 10, "every process the server started to exit")
        finally:
            server.kill()
            for pid in _marked(mark):  # after a failure: leave nothing for the next module
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            conftest.MODULE_TREES.discard(mark)


def _marked(mark: str) -> list[int]:
    pids = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get("UNISON_TEST_MODULE_TREE") == mark and p.status() != psutil.STATUS_ZOMBIE:
                pids.append(p.pid)
    return pids


@pytest.fixture(scope="module")
def engine():
    with Engine(num_threads=1) as e:
        yield e


def served(info: dict) -> list[int]:
    return [r["state"]["stats"]["num_finished"] for r in info["replicas"]]


def test_32_concurrent_requests_complete_on_both_replicas(dp):
    before = served(dp.info())

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{dp.url}/v1", api_key="none", max_retries=0) as client:
            return await asyncio.gather(*(client.completions.create(
                model="SmolLM2-135M-Instruct", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=8)
                for i in range(32)))

    outs = asyncio.run(run())
    assert all(o.usage.completion_tokens >= 1 for o in outs)
    after = served(dp.info())
    assert all(a > b for a, b in zip(after, before)), f"a replica served nothing: {before} -> {after}"


def test_greedy_outputs_equal_one_engines(dp, engine):
    for prompt in PROMPTS[:3]:
        want = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 12})["output_ids"]
        r = HTTP.post(dp.url + "/generate", json={"text": prompt, "sampling_params": {
            "temperature": 0, "max_new_tokens": 12}}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == want


def test_server_info_metrics_and_health_cover_every_replica(dp):
    info = dp.info()
    assert [r["index"] for r in info["replicas"]] == [0, 1]
    assert all(r["pid"] > 0 and r["host"] and r["address"].startswith("tcp://") for r in info["replicas"])
    assert len(info["internal_states"]) == 2
    metrics = HTTP.get(dp.url + "/metrics").text
    assert 'unison:num_requests_running{engine="0"}' in metrics
    assert 'unison:num_requests_running{engine="1"}' in metrics
    assert HTTP.get(dp.url + "/health").status_code == 200
    r = HTTP.post(dp.url + "/pause_generation", json={"mode": "in_place"})  # on every replica
    assert r.status_code == 200
    assert all(s["paused"] for s in dp.info()["internal_states"])
    assert HTTP.post(dp.url + "/continue_generation").status_code == 200


def test_a_replica_whose_core_dies_comes_back_and_the_other_serves_meanwhile(dp, tmp_path):
    # The weights updated first (the same model, under another path): the replica that comes back
    # must serve those, as the other does, not the ones the server started with.
    weights = shutil.copy(default_gguf_path(), tmp_path / "updated.gguf")
    r = HTTP.post(dp.url + "/update_weights_from_disk", json={"model_path": str(weights)}, timeout=60)
    assert r.status_code == 200 and r.json()["success"], r.text
    with HTTP.stream("POST", dp.url + "/v1/completions", timeout=60, json={
            "prompt": PROMPTS[0], "max_tokens": 2000, "ignore_eos": True, "stream": True}) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        running = [r["state"]["num_running"] for r in dp.info()["replicas"]]
        victim = dp.info()["replicas"][running.index(1)]["pid"]  # the replica that took it
        start = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        tail = [line for line in lines if line.startswith("data:")]
    assert any("error" in line for line in tail), tail[-3:]  # ended in the stream, with a reason
    assert tail[-1] == "data: [DONE]"
    r = HTTP.post(dp.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200, r.text  # at once, on the live replica
    print(f"\n[figure] replica core kill -9 to a new request served: {time.monotonic() - start:.2f} s")

    def back() -> bool:
        replicas = dp.info()["replicas"]
        return len(replicas) == 2 and victim not in [r["pid"] for r in replicas]

    wait_until(back, BACK_WITHIN_S, "the replica to come back", interval=0.2)
    print(f"[figure] replica core kill -9 to the replica serving again (its weights updated "
          f"first): {time.monotonic() - start:.2f} s")
    assert [s["model_path"] for s in dp.info()["internal_states"]] == [str(weights)] * 2
    outs = [HTTP.post(dp.url + "/generate", json={"text": p, "sampling_params": {"max_new_tokens": 4}},
                       timeout=30) for p in PROMPTS[:4]]
    assert all(o.status_code == 200 for o in outs)


class _Fake:
    def __init__(self, outstanding: int) -> None:
        self.states, self.dead = dict.fromkeys(range(outstanding)), None


def test_routing_least_loaded_and_prefix_affine():
    least = Replicas([_Fake(3), _Fake(1), _Fake(2)])
    assert least.pick("anything") is least.workers[1]
    prefix = Replicas([_Fake(0), _Fake(0), _Fake(0)], routing="prefix")
    system = "You are a helpful assistant. " * 12  # > PREFIX_CHARS: the question does not matter
    chosen = {id(prefix.pick(system + q)) for q in ("What is 2+2?", "Name a color.", "Hi")}
    assert len(chosen) == 1
    before = {f"{i} distinct prompt": prefix.pick(f"{i} distinct prompt") for i in range(30)}
    assert len({id(w) for w in before.values()}) == 3
    gone = prefix.workers[0]
    gone.dead = "its core died"  # its prefixes move; every other prefix stays where it was
    after = {p: prefix.pick(p) for p in before}
    assert gone not in after.values()
    assert all(after[p] is w for p, w in before.items() if w is not gone)
