"""A server a benchmark starts on this machine: a free port, waiting until it answers, stopping it
with everything it started; its processes' CPU time, and its info once its workers attached."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from unison.wire.messages import ServerInfo


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_ready(url: str, proc: subprocess.Popen[bytes], path: str = "/v1/models",
               timeout: float = 300) -> None:
    """Until GET url+path answers 200; an error if the process exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + path, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout} s")


def stop(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """SIGTERM to the process's group (started with start_new_session=True), SIGKILL after `timeout`."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextmanager
def serving(cmd: list[str], log_name: str, ready_path: str = "/v1/models", timeout: float = 300,
            stop_timeout: float = 30) -> Iterator[str]:
    """`cmd` (given `--port`) serving on a free port until the block ends; yields its URL. Its
    output goes to <tmp>/<log_name>.log, which an error names."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.gettempdir()) / f"{log_name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            try:
                wait_ready(url, proc, ready_path, timeout)
            except (RuntimeError, TimeoutError) as e:
                raise RuntimeError(f"{log_name}: {e} (log: {log_path})") from None
            yield url
        finally:
            stop(proc, stop_timeout)


def proc_cpu_seconds(pid: int) -> float:
    """The process's CPU seconds so far (user + system), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields_ = f.read().rpartition(")")[2].split()
    return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def attached(url: str, workers: int, timeout: float = 120) -> ServerInfo:
    """The server's info once `workers` HTTP workers have attached."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(url + "/get_server_info", timeout=5) as r:
            info = ServerInfo.from_dict(json.load(r))
        if len(info.frontends) >= workers or time.monotonic() > deadline:
            return info
        time.sleep(0.2)
