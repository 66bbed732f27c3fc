"""Shared fixtures. Tests run the real thing: real processes, sockets and the embedded model.

Nothing may outlive its test module: a leftover process, registry, runtime directory or engine
thread fails the module (the model cache is expected to stay).
"""

from __future__ import annotations

import glob
import os
import re
import threading
import time
from pathlib import Path

import psutil
import pytest

from unison.model.loader import resolve_model_dir


def _ours(path: str) -> bool:
    """Registries and runtime dirs are named by their owner's pid. Ours: owned by this process,
    a descendant, or a process that is gone (then nothing cleaned it up). A live process of
    someone else's (another test run on this machine) is not ours to judge."""
    m = re.match(r"unison[_-](\d+)", os.path.basename(path))
    if m is None:
        return True
    pid = int(m.group(1))
    me = psutil.Process()
    return pid == me.pid or not psutil.pid_exists(pid) or pid in {p.pid for p in me.children(recursive=True)}


def _leftovers() -> dict[str, set]:
    return {
        "processes": {p.pid for p in psutil.Process().children(recursive=True)
                      if p.status() != psutil.STATUS_ZOMBIE},
        "registries": {p for p in glob.glob("/dev/shm/unison_*") if _ours(p)},
        "runtime dirs": {p for p in glob.glob("/tmp/unison-*") if _ours(p)},
        "threads": {t.name for t in threading.enumerate() if t.name.startswith("unison")},
    }


def assert_nothing_left(before: dict[str, set], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:  # a process that was just told to exit may need a moment
        now = _leftovers()
        extra = {k: sorted(now[k] - before[k]) for k in now if now[k] - before[k]}
        if not extra or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not extra, f"left behind: {extra}"


@pytest.fixture(scope="module", autouse=True)
def no_leaks():
    """Set up before, torn down after, every other module fixture (engines included)."""
    before = _leftovers()
    yield
    assert_nothing_left(before)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return resolve_model_dir(None)
