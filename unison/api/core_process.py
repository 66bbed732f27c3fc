"""CoreProcess: start `python -m unison.core`, know when it is ready, stop it, clean up after it.

Used by the Engine (whose own frontend then attaches) and by the server launcher (which has no
frontend: its HTTP workers attach through the registry).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from unison.config import EngineConfig
from unison.errors import EngineDeadError
from unison.wire import registry
from unison.wire.messages import CoreArgs, encode

SHUTDOWN_GRACE = 4.0

# oneDNN (and ideep above it) cache a compiled primitive per input shape of every packed linear,
# about 0.6 MiB each, 1,024 of them by default: a core that sees ever new batch sizes grows by
# hundreds of MiB (measured: +72 MiB in 600 serving requests). 64 keep the shapes of the last
# dozen or so steps; re-creating one costs far less than a step. A user's own setting wins.
ONEDNN_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}


def curve_keypair() -> tuple[str, str]:
    """A fresh CURVE (public, secret) key pair, Z85 text: for a core, or a remote frontend."""
    import zmq

    if not zmq.has("curve"):
        raise RuntimeError("this libzmq has no CURVE support: remote frontends need it "
                           "(pip install pyzmq, whose wheels bundle a libzmq with CURVE)")
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


class CoreProcess:
    def __init__(self, config: EngineConfig, publish: bool, curve_secret_key: str | None = None,
                 registry_path: Path | None = None) -> None:
        config.check_model_path()
        if config.listen and curve_secret_key is None:
            curve_secret_key = curve_keypair()[1]
        # 0700; short (ipc paths < 107 bytes); named by the owner so a leftover can be traced
        self.runtime_dir = tempfile.mkdtemp(prefix=f"unison-{os.getpid()}-")
        self.endpoint = f"ipc://{self.runtime_dir}/core.sock"
        self.token = secrets.token_hex(16)
        # (a caller that starts several cores at once names each one's: none has published yet)
        if publish and registry_path is None:
            registry_path = registry.free_registry_path(os.getpid())
        self.registry_path = registry_path if publish else None
        args = CoreArgs(
            config=config, endpoint=self.endpoint,
            runtime_dir=self.runtime_dir, token=self.token, owner_pid=os.getpid(),
            registry_path=str(self.registry_path) if self.registry_path else None,
            # PR_SET_PDEATHSIG fires when the starting *thread* exits: only safe from the main one.
            pdeathsig=threading.current_thread() is threading.main_thread(),
            curve_secret_key=curve_secret_key,
        )
        env = {**ONEDNN_CACHES, **os.environ}
        self.proc = subprocess.Popen([sys.executable, "-m", "unison.core"], stdin=subprocess.PIPE, env=env)
        assert self.proc.stdin is not None  # (stdin=PIPE)
        self.proc.stdin.write(encode(args))
        self.proc.stdin.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def startup_problem(self) -> str | None:
        """Why the core cannot answer (it exited), or None while it runs."""
        code = self.proc.poll()
        if code is None:
            return None
        error = Path(self.runtime_dir, "startup_error")
        detail = error.read_text() if error.exists() else "see its log above"
        return f"the engine core exited with code {code} while starting: {detail}"

    def wait_published(self, timeout: float) -> None:
        """Block until the core has loaded the model and published its registry."""
        assert self.registry_path is not None
        deadline = time.monotonic() + timeout
        while not self.registry_path.exists():
            problem = self.startup_problem()
            if problem:
                raise EngineDeadError(problem)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine core did not get ready within {timeout:.0f} s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(SHUTDOWN_GRACE)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # The core removes both itself; after a kill -9 it could not.
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        registry.unlink(self.registry_path)
