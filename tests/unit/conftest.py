"""Unit tests start no process: `make test-fast` runs this folder in about a minute, and a test
that needs a core, a server or a subprocess belongs in tests/e2e/."""

from __future__ import annotations

import multiprocessing.process
import subprocess

import pytest


@pytest.fixture(autouse=True)
def no_process_started(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a unit test started a process: move it to tests/e2e/")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
