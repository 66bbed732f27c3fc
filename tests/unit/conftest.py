"""Unit tests start no process of ours: no core, no server, no Python subprocess. `make test-fast`
runs this folder in about a minute; a test that needs a process belongs in tests/e2e/. (The C
compiler may run: the kernels are built on first use, as in any process that loads them.)"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import sys

import pytest

_execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]


def _is_python(args: object) -> bool:
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)  # type: ignore[call-overload]
    first = os.path.basename(os.fsdecode(argv[0])) if argv else ""
    return argv[0] == sys.executable or first.startswith("python")


@pytest.fixture(scope="module", autouse=True)
def no_process_started():
    """Module-scoped, so that it is in place before the module's own fixtures start anything."""

    def execute_child(self, args, *rest, **kwargs):
        if _is_python(args):
            raise AssertionError(f"a unit test started {args!r}: move it to tests/e2e/")
        return _execute_child(self, args, *rest, **kwargs)

    def start(self):
        raise AssertionError("a unit test started a multiprocessing process: move it to tests/e2e/")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", execute_child)
        patch.setattr(multiprocessing.process.BaseProcess, "start", start)
        yield
