"""`unison serve` as a test subject: start it, wait for every worker, stop or kill it, check that
nothing of it is left (one model, or several: ModelsServer); the OpenAI error shape; the
fault-timing report."""

from __future__ import annotations

import contextlib
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests import conftest  # pytest's own instance (tests/ is a package: pytest imports it as tests.conftest)
from tests.utils import HTTP, wait_until
from unison.wire import registry

FIGURES: dict[str, float] = {}  # seconds each fault took to handle, printed after each module


def free_port() -> int:
    """A free port below the kernel's ephemeral range: a port the kernel hands out for a bind to
    port 0 (a data-parallel core's ZMQ sockets on "any free port") could be taken between this
    check and the server's own bind."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port below the ephemeral range")


class Server:
    """`unison serve` in a subprocess, ready once the core lists every worker as a frontend."""

    def __init__(self, *args: str, workers: int = 1, api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.log = tempfile.NamedTemporaryFile("w+", prefix="serve-", suffix=".log")
        cmd = [sys.executable, "-m", "unison.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--tokenizer-worker-num", str(workers),
               "--num-threads", "1", *(["--api-key", api_key] if api_key else []), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.registry = registry.registry_path(self.proc.pid)
        self.pids = {self.proc.pid}
        try:
            self.info = self._wait_ready(workers)
            endpoint = registry.read(self.registry).endpoint
            self.runtime_dir = Path(endpoint.removeprefix("ipc://")).parent
        except BaseException:
            self.kill()
            raise
        self.core_pid = self.info["core_pid"]
        self.worker_pids = {f["pid"] for f in self.info["frontends"]}
        self.pids |= {self.core_pid, *self.worker_pids}

    def _wait_ready(self, workers: int, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n"
                                     f"{self.output()}")
            try:
                r = HTTP.get(f"{self.url}/get_server_info", headers=self.headers, timeout=5)
                if r.status_code == 200 and len(r.json()["frontends"]) == workers:
                    return r.json()
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"the server did not get ready:\n{self.output()}"
            time.sleep(0.1)

    def output(self) -> str:
        return Path(self.log.name).read_text()

    def get(self, path: str) -> httpx.Response:
        return HTTP.get(self.url + path, headers=self.headers, timeout=30)

    def post(self, path: str, body: Any = None) -> httpx.Response:
        return HTTP.post(self.url + path, json=body, headers=self.headers, timeout=60)

    def server_info(self) -> dict:
        r = self.get("/get_server_info")
        assert r.status_code == 200, r.text
        return r.json()

    def wait_freed(self, timeout: float) -> None:
        """Until nothing runs, waits or holds a KV block; fails after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.server_info()
            if info["num_running"] == info["num_waiting"] == info["kv_blocks_used"] == 0:
                return
            assert time.monotonic() < deadline, f"not freed within {timeout} s: {info}"
            time.sleep(0.02)

    def wait_running(self, n: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.server_info()["num_running"] < n:
            assert time.monotonic() < deadline, f"{n} requests never ran: {self.server_info()}"
            time.sleep(0.02)

    def wait_exit(self, timeout: float) -> tuple[int, float]:
        t0 = time.monotonic()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the launcher did not exit within {timeout:.1f} s:\n"
                                 f"{self.output()}") from None
        return code, time.monotonic() - t0

    def stop(self) -> float:
        """SIGTERM: exit code 0 within 10 s, nothing left behind; returns the seconds it took."""
        if self.proc.poll() is not None:
            return math.nan
        self.proc.send_signal(signal.SIGTERM)
        code, took = self.wait_exit(10.0)
        assert code == 0, f"exit code {code}:\n{self.output()}"
        self.assert_gone()
        return took

    def assert_gone(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while (alive := {p for p in self.pids if registry.pid_alive(p)}) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive, f"processes left behind: {alive}\n{self.output()}"
        assert not self.registry.exists(), f"registry {self.registry} left behind"
        assert not self.runtime_dir.exists(), f"runtime dir {self.runtime_dir} left behind"

    def kill(self) -> None:
        """After a failure: leave nothing running for the next test."""
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                if registry.pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)
        registry.unlink(self.registry)
        if hasattr(self, "runtime_dir"):
            shutil.rmtree(self.runtime_dir, ignore_errors=True)


def serve(name: str, *args: str, **kw: Any):
    server = Server(*args, **kw)
    try:
        yield server
    finally:
        try:
            FIGURES[f"SIGTERM to exit, idle ({name})"] = server.stop()
        finally:
            if server.proc.poll() is None:
                server.kill()


def assert_openai_error(r: httpx.Response, status: int, *fragments: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body  # never a raw pydantic dump ("detail", "loc", "input")
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status and isinstance(err["message"], str) and err["type"]
    for f in fragments:
        assert f.lower() in err["message"].lower(), (f, err["message"])
    return err


class ModelsServer:
    """`unison serve` of several models in a subprocess; its processes carry a mark, so the cores it
    starts and stops as models come and go are counted by the module's leak check, not per test."""

    def __init__(self, mark: str, *args: str, workers: int = 1) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="serve-models-", suffix=".log")
        cmd = [sys.executable, "-m", "unison.cli", "serve", "--port", self.url.rpartition(":")[2],
               "--tokenizer-worker-num", str(workers), "--num-threads", "1", *args]
        self.mark = mark
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "UNISON_TEST_MODULE_TREE": mark})
        try:
            wait_until(self._ready, 60, f"the server to answer:\n{self.output()}")
        except BaseException:
            self.kill()
            raise

    def _ready(self) -> bool:
        assert self.proc.poll() is None, self.output()
        with contextlib.suppress(httpx.TransportError):
            return HTTP.get(f"{self.url}/health", timeout=2).status_code == 200
        return False

    def output(self) -> str:
        return Path(self.log.name).read_text()

    def post(self, path: str, body: dict, timeout: float = 120) -> httpx.Response:
        return HTTP.post(self.url + path, json=body, timeout=timeout)

    def models(self) -> dict[str, dict]:
        r = HTTP.get(f"{self.url}/v1/models", timeout=10)
        assert r.status_code == 200, r.text
        return {card["id"]: card for card in r.json()["data"]}

    def state(self, name: str) -> str:
        return self.models()[name]["state"]

    def marked(self) -> list[int]:
        found = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                ours = p.environ().get("UNISON_TEST_MODULE_TREE") == self.mark
                if ours and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p.pid)
        return found

    def stop(self) -> None:
        """SIGTERM: exit 0, with every core it started gone."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(15) == 0, self.output()
        wait_until(lambda: not self.marked(), 10, "every process of the server to exit")

    def kill(self) -> None:
        for pid in [self.proc.pid, *self.marked()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)


@contextlib.contextmanager
def models_server(tmp_path_factory, *args: str, workers: int = 1):
    mark = str(tmp_path_factory.mktemp("models"))
    conftest.MODULE_TREES.add(mark)
    server = ModelsServer(mark, *args, workers=workers)
    try:
        yield server
        server.stop()
    finally:
        server.kill()
        conftest.MODULE_TREES.discard(mark)
