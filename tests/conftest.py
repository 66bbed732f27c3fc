"""Shared fixtures. Tests run the real thing: real processes, sockets and the embedded model.

Nothing may outlive its test module: a leftover process, registry, runtime directory or engine
thread fails the module (the model cache is expected to stay).
"""

from __future__ import annotations

import glob
import threading
import time
from pathlib import Path

import psutil
import pytest

from unison.model.loader import resolve_model_dir


def _leftovers() -> dict[str, set]:
    return {
        "processes": {p.pid for p in psutil.Process().children(recursive=True)
                      if p.status() != psutil.STATUS_ZOMBIE},
        "registries": set(glob.glob("/dev/shm/unison_*")),
        "runtime dirs": set(glob.glob("/tmp/unison-*")),
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
