"""Frontend processes never load torch or transformers, checked on real processes: the owner, an
attached Engine, the server's launcher and its HTTP workers (the import rules read from the source
are tests/unit/test_structure.py's). A frontend that imported torch would take seconds and
hundreds of MiB to start, and every HTTP worker is one."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_frontend_imports_neither_torch_nor_transformers():
    code = (
        "import sys, unison.frontend.text.tokenizer, unison.frontend.text.detokenizer\n"
        "bad = {'torch', 'transformers'} & set(sys.modules)\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- at run time ------------------------------------------------------------------------------

WATCH = """
import os, sys
log = os.environ.get("UNISON_TEST_IMPORT_LOG")
if log:
    class _Watch:
        def find_spec(self, name, path=None, target=None):
            if name in ("torch", "transformers"):
                with open(os.path.join(log, str(os.getpid())), "a") as f:
                    f.write(name + "\\n")
            return None
    sys.meta_path.insert(0, _Watch())
"""

SCRIPT = """
import multiprocessing as mp, os, subprocess, sys, time
import httpx
from unison import Engine

def attached(parent):
    e = Engine.attach_tokenizer_worker(parent)
    assert e.generate("Hi", {"max_new_tokens": 2})["output_ids"]
    e.shutdown()

if __name__ == "__main__":
    cores = []
    with Engine(tokenizer_worker_num=2, num_threads=1) as engine:
        assert engine.generate("Hi", {"max_new_tokens": 2})["output_ids"]
        cores.append(engine.get_server_info()["core_pid"])
        p = mp.get_context("spawn").Process(target=attached, args=(os.getpid(),))
        p.start(); p.join(60)
        assert p.exitcode == 0
    port = int(sys.argv[1])
    server = subprocess.Popen([sys.executable, "-m", "unison.cli", "serve", "--port", str(port),
                               "--tokenizer-worker-num", "2", "--num-threads", "1"])
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                info = httpx.get(url + "/get_server_info", timeout=2).json()
                if len(info["frontends"]) == 2:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and server.poll() is None, "the server did not start"
            time.sleep(0.2)
        for _ in range(4):  # both workers, most likely
            r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
            assert r.status_code == 200, r.text
        cores.append(info["core_pid"])
        workers = [fe["pid"] for fe in info["frontends"]]
    finally:
        server.terminate()
        server.wait(30)
    print("CORES", *cores)
    print("FRONTENDS", os.getpid(), p.pid, server.pid, *workers)
"""


@pytest.mark.timeout(300)
def test_frontend_processes_never_import_torch_or_transformers(tmp_path: Path):
    """The owner, an attached Engine, the server's launcher and its HTTP workers: none of them
    imports torch or transformers at any point; only the cores do."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(WATCH)
    log = tmp_path / "imports"
    log.mkdir()
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "UNISON_TEST_IMPORT_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run([sys.executable, str(script), str(port)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines() if line[:5] in ("CORES", "FRONT"))
    cores = set(lines["CORES"].split())
    frontends = set(lines["FRONTENDS"].split())
    importers = {p.name: p.read_text().split() for p in log.iterdir()}
    assert cores <= set(importers), "the watch saw no core import torch: it does not work"
    assert {pid: mods for pid, mods in importers.items() if pid in frontends} == {}
    assert len(frontends) == 5  # the owner, the attached child, the launcher, two HTTP workers
