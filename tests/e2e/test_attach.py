"""Many frontends, one core: processes that attach to a running engine, use it, leave or die.

Each attached frontend lives in a real process started with multiprocessing's spawn; the owner
is this test process unless a test kills it. Times a user would notice (how fast a dead
frontend's KV is freed, how fast a dead core or owner is noticed) are asserted and printed: run
with `pytest -s` to see them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import math
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import psutil
import pytest
import zmq

from tests.e2e.test_engine import PROMPTS, top_dicts, wait_idle
from tests.utils import assert_greedy_close, wait_until
from unison import Engine, EngineDeadError
from unison.wire import messages as protocol
from unison.wire import registry

SPAWN = multiprocessing.get_context("spawn")
if multiprocessing.parent_process() is None:
    # Spawn starts multiprocessing's resource tracker once per session and keeps it: start it
    # before the leak check takes its snapshot, so it does not count as left behind here.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()

ATTACH_ERROR_WITHIN = 5.0  # an attach that cannot succeed says so this fast
DEATH_NOTICED_WITHIN = 3.0  # a dead frontend, core or owner is noticed this fast
SHUTDOWN_WITHIN = 5.0

CAPITAL_PROMPTS = ["The capital of France is", "1 + 1 ="]
GREEDY_8 = {"temperature": 0, "max_new_tokens": 8}
REF_TOKENS = 16
GREEDY_REF = {"temperature": 0, "max_new_tokens": REF_TOKENS, "ignore_eos": True}
ENDLESS = {"max_new_tokens": 1000, "ignore_eos": True}  # outlives any test that does not end it
# Eight distinct prompts of 5 to 46 tokens.
MIXED_PROMPTS = PROMPTS[:4] + [p + " " + " ".join(PROMPTS[: i + 1])
                               for i, p in enumerate(PROMPTS[4:])]
# One torch thread: these engines share the machine's cores with each other, the frontend
# processes and the test clients, and spinning OpenMP threads collapse when oversubscribed.
ENGINE_ARGS = {"chunked_prefill_size": 128, "num_threads": 1}


def figure(name: str, seconds: float) -> None:
    print(f"\n[figure] {name}: {seconds * 1000:.0f} ms")


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    with Engine(tokenizer_worker_num=8, max_running_requests=64, **ENGINE_ARGS) as e:
        yield e


@pytest.fixture(scope="module")
def pair():
    """An engine for its owner's frontend and one attached frontend, as in SGLang's example."""
    with Engine(tokenizer_worker_num=2, **ENGINE_ARGS) as e:
        yield e


@pytest.fixture(autouse=True)
def engine_back_to_normal(request):
    """After a test of the shared engine: idle, intact, unpaused, only its owner attached."""
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        eng.continue_generation()
        info = wait_until(lambda: _idle_with_owner_only(eng), 5,
                          "the shared engine to be idle with only its owner attached")
        eng.check_integrity()
        assert not info["paused"], "a test left the engine paused"


def _idle_with_owner_only(engine: Engine) -> dict | None:
    info = engine.get_server_info()
    idle = info["num_running"] + info["num_waiting"] == 0 and info["kv_blocks_used"] == 0
    return info if idle and frontend_pids(info) == [os.getpid()] else None


@pytest.fixture(scope="module")
def references(engine) -> dict[str, tuple[list[int], list[dict[int, float]]]]:
    """Each prompt run alone: (greedy ids, top-5 logprobs) for REF_TOKENS tokens."""
    refs = {}
    for prompt in MIXED_PROMPTS:
        out = engine.generate(prompt, GREEDY_REF, return_logprob=True, top_logprobs_num=5)
        refs[prompt] = (out["output_ids"], top_dicts(out))
    return refs


# ---- helpers ----------------------------------------------------------------------------------


def frontend_pids(info: dict) -> list[int]:
    return sorted(fe["pid"] for fe in info["frontends"])


def in_flight(info: dict, pid: int) -> int:
    return sum(fe["requests_in_flight"] for fe in info["frontends"] if fe["pid"] == pid)


def registry_file_of(engine: Engine) -> Path:
    """The registry of this engine (a process's second engine has a suffixed name)."""
    info = engine.get_server_info()
    for path in registry.REGISTRY_DIR.glob(f"{registry.PREFIX}{info['owner_pid']}*"):
        if registry.read(path).core_pid == info["core_pid"]:
            return path
    raise AssertionError(f"no registry for the engine with core pid {info['core_pid']}")


def attach_target(engine: Engine) -> tuple[int, str | None]:
    """(owner pid, registry_file) for attach_tokenizer_worker: the file only where the owner's
    default registry name belongs to another of its engines."""
    path = registry_file_of(engine)
    owner = engine.get_server_info()["owner_pid"]
    return owner, None if path == registry.registry_path(owner) else str(path)


def runtime_dir_of(registry_file: Path) -> Path:
    return Path(registry.read(registry_file).endpoint.removeprefix("ipc://")).parent


def process_exited(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def caught_up(chunks: list[dict], engine: Engine, rid: str) -> bool:
    """A stream's consumer has every token its frontend holds for `rid`. After a control's reply
    (pause_generation's, say) the frontend holds every output the core sent before it: the
    frontend applies a batch of outputs before the reply's waiter runs."""
    if not chunks:
        return False
    last = chunks[-1]
    state = engine._worker().states.get(rid)  # gone once finished: then the final chunk is due
    if last["meta_info"]["finish_reason"] is not None:
        return True
    return state is not None and len(last["output_ids"]) == len(state.output_ids)


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def stop_child(proc: multiprocessing.process.BaseProcess, timeout: float = 10) -> None:
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def send_foreign_abort(registry_file: str | Path, rid: str) -> None:
    """As a bare protocol client of its own: Hello, Abort(rid), then a Control whose reply proves
    the Abort was handled (one socket's messages are handled in order), then Goodbye."""
    info = registry.read(Path(registry_file))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(info.endpoint)

    def receive():
        assert sock.poll(5000), "the core did not answer"
        return protocol.decode_to_frontend(sock.recv())

    try:
        sock.send(protocol.encode(protocol.Hello(pid=os.getpid(), token=info.token)))
        assert isinstance(receive(), protocol.Welcome), "Hello was not welcomed"
        sock.send(protocol.encode(protocol.Abort(rid)))
        sock.send(protocol.encode(protocol.Control(cid=7, request=protocol.GetServerInfo())))
        while not isinstance(reply := receive(), protocol.ControlReply):
            pass  # a StepOutputs would mean the Abort was acted on: the owner's check sees it
        assert reply.cid == 7 and reply.error is None, reply
        sock.send(protocol.encode(protocol.Goodbye()))
    finally:
        sock.close()


# ---- code run in spawned processes (module level, so that spawn can import it) ----------------


def _attach_and_generate(parent_pid: int, registry_file: str | None, results) -> None:
    """The SGLang pattern: attach to the parent's engine, generate, shut down, exit."""
    try:
        t0 = time.monotonic()
        engine = Engine.attach_tokenizer_worker(parent_pid, registry_file=registry_file)
        report = {"attach_s": time.monotonic() - t0, "torch_imported": "torch" in sys.modules}
        try:
            report["main thread"] = engine.generate(CAPITAL_PROMPTS, GREEDY_8)
            box: dict = {}
            t = threading.Thread(
                target=lambda: box.update(out=engine.generate(CAPITAL_PROMPTS, GREEDY_8)))
            t.start()
            t.join(60)
            report["thread without a loop"] = box["out"]
            report["running asyncio loop"] = asyncio.run(
                engine.async_generate(CAPITAL_PROMPTS, GREEDY_8))
        finally:
            engine.shutdown()
        results.put(report)
    except BaseException as e:
        results.put({"error": repr(e)})
        raise


def _serve_commands(conn, parent_pid: int, registry_file: str | None) -> None:
    """One attached frontend driven by (command, *args) over a Pipe; replies ("ok", value) or
    ("error", exception). A streaming request runs in a thread, so commands keep flowing."""
    engine: Engine | None = None
    stream: dict = {}

    def consume(kwargs: dict) -> None:
        try:
            for chunk in engine.generate(stream=True, **kwargs):
                stream["last"] = chunk
                stream["started"].set()
        except BaseException as e:
            stream["error"] = e
        finally:
            stream["ended_at"] = time.monotonic()
            stream["started"].set()
            stream["done"].set()

    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:
            return
        if cmd == "exit":  # without shutdown(): the Engine's finalizer says Goodbye at exit
            return
        try:
            if cmd == "attach":
                engine = Engine.attach_tokenizer_worker(parent_pid, registry_file=registry_file)
                value = None
            elif cmd == "drop":  # garbage-collect the Engine without shutdown()
                engine = None
                gc.collect()
                value = None
            elif cmd == "call":
                name, kwargs = args
                value = getattr(engine, name)(**kwargs)
            elif cmd == "stream":
                stream.clear()
                stream.update(started=threading.Event(), done=threading.Event())
                threading.Thread(target=consume, args=(args[0],), daemon=True).start()
                assert stream["started"].wait(60), "no first chunk within 60 s"
                if "error" in stream:
                    raise stream["error"]
                value = None
            elif cmd == "stream_result":
                if not stream["done"].wait(args[0]):
                    raise TimeoutError(f"the stream is still running after {args[0]} s")
                value = {k: stream.get(k) for k in ("last", "error", "ended_at")}
            elif cmd == "foreign_abort":
                send_foreign_abort(registry_file or registry.registry_path(parent_pid), args[0])
                value = None
            else:
                raise ValueError(f"unknown command {cmd!r}")
            reply = ("ok", value)
        except BaseException as e:
            reply = ("error", e)
        try:
            conn.send(reply)
        except Exception as e:  # an unpicklable exception
            conn.send(("error", RuntimeError(repr(e))))


def _own_engine(conn, tokenizer_worker_num: int) -> None:
    """An owner process: starts an engine, reports its pids, keeps it until told to stop."""
    with Engine(tokenizer_worker_num=tokenizer_worker_num, **ENGINE_ARGS) as engine:
        conn.send((os.getpid(), engine.get_server_info()["core_pid"]))
        with contextlib.suppress(EOFError):
            conn.recv()


def _attach_detach_loop(parent_pid: int, registry_file: str | None, rounds: int, results) -> None:
    """Attach, generate two tokens, detach: `rounds` times."""
    report: dict = {"pid": os.getpid(), "outputs": [], "error": None}
    try:
        for i in range(rounds):
            engine = Engine.attach_tokenizer_worker(parent_pid, registry_file=registry_file)
            try:
                prompt = MIXED_PROMPTS[(os.getpid() + i) % len(MIXED_PROMPTS)]
                out = engine.generate(prompt, dict(GREEDY_REF, max_new_tokens=2))
                report["outputs"].append((prompt, out["output_ids"]))
            finally:
                engine.shutdown()
    except BaseException as e:
        report["error"] = repr(e)
    results.put(report)


def load_specs(seed: int, count: int = 50) -> list[tuple[str, int, bool]]:
    """(prompt, max_new_tokens, stream) per request: 8 prompts, 8 or 16 tokens, a third streamed."""
    return [(MIXED_PROMPTS[(seed + i) % 8], 8 if (seed + i) // 8 % 2 else 16, (seed + i) % 3 == 0)
            for i in range(count)]


async def run_load(engine: Engine, specs: list[tuple[str, int, bool]]) -> list[tuple[list, list]]:
    """All requests at once; (output ids, top-5 logprobs) of each."""
    async def one(prompt: str, max_new: int, stream: bool):
        params = dict(GREEDY_REF, max_new_tokens=max_new)
        kwargs = {"return_logprob": True, "top_logprobs_num": 5}
        if stream:
            chunks = await engine.async_generate(prompt, params, stream=True, **kwargs)
            out = [chunk async for chunk in chunks][-1]
        else:
            out = await engine.async_generate(prompt, params, **kwargs)
        return out["output_ids"], top_dicts(out)

    return await asyncio.gather(*(one(*spec) for spec in specs))


def _load_client(parent_pid: int, registry_file: str | None, seed: int, go, results) -> None:
    """Attach, wait for the start signal, send 50 requests at once with asyncio.gather."""
    try:
        engine = Engine.attach_tokenizer_worker(parent_pid, registry_file=registry_file)
        try:
            results.put(("ready", seed, os.getpid()))
            assert go.wait(60), "no start signal"
            results.put(("done", seed, asyncio.run(run_load(engine, load_specs(seed)))))
        finally:
            engine.shutdown()
    except BaseException as e:
        results.put(("error", seed, repr(e)))


class AttachedProcess:
    """A spawned process with a frontend attached to `engine`: see _serve_commands."""

    def __init__(self, engine: Engine) -> None:
        self.conn, child_conn = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=_serve_commands,
                                  args=(child_conn, *attach_target(engine)), daemon=True)
        self.proc.start()
        child_conn.close()
        self.pid = self.proc.pid
        self.ask("attach", timeout=60)

    def ask(self, *cmd, timeout: float = 30):
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the attached process did not answer {cmd[0]!r} in {timeout} s")
        kind, value = self.conn.recv()
        if kind == "error":
            raise value
        return value

    def call(self, name: str, timeout: float = 30, **kwargs):
        """Call an Engine method in the attached process."""
        return self.ask("call", name, kwargs, timeout=timeout)

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("exit",))
        stop_child(self.proc)
        self.conn.close()

    def __enter__(self) -> AttachedProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- 1. the SGLang case -----------------------------------------------------------------------


def test_spawned_process_attaches_and_generates_like_the_owner(pair):
    expected = pair.generate(CAPITAL_PROMPTS, GREEDY_8)
    results = SPAWN.Queue()
    child = SPAWN.Process(target=_attach_and_generate, args=(*attach_target(pair), results))
    child.start()
    try:
        report = results.get(timeout=90)
        child.join(30)
        assert "error" not in report, f"the attached process failed: {report.get('error')}"
        assert child.exitcode == 0, f"the attached process exited with {child.exitcode}"
    finally:
        stop_child(child)
    figure("attach from a spawned process", report["attach_s"])
    assert report["attach_s"] < ATTACH_ERROR_WITHIN, f"attach took {report['attach_s']:.2f} s"
    assert not report["torch_imported"], "an attached frontend must not import torch"
    for how in ("main thread", "thread without a loop", "running asyncio loop"):
        got = report[how]
        assert [o["text"] for o in got] == [o["text"] for o in expected], f"texts differ ({how})"
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected], how
        assert [o["meta_info"]["completion_tokens"] for o in got] == [8, 8], how
    wait_until(lambda: frontend_pids(pair.get_server_info()) == [os.getpid()], 1,
               "the detached frontend to leave the list")


# ---- 2. attach, list, detach; attach errors ---------------------------------------------------


def test_server_info_lists_attached_frontends_until_they_leave(engine):
    def listed() -> list[int]:
        return frontend_pids(engine.get_server_info())

    with AttachedProcess(engine) as child:
        info = engine.get_server_info()
        assert frontend_pids(info) == sorted([os.getpid(), child.pid]), info["frontends"]
        assert child.call("get_server_info")["frontends"] == info["frontends"], \
            "every frontend must see the same engine-wide list"
        child.ask("stream", {"prompt": PROMPTS[0], "sampling_params": ENDLESS})
        info = engine.get_server_info()
        assert in_flight(info, child.pid) == 1 and in_flight(info, os.getpid()) == 0, info

        child.call("shutdown")  # detaches and ends its stream; the process lives on
        wait_until(lambda: child.pid not in listed(), 1, "the detached frontend to leave")
        ended = child.ask("stream_result", 5)
        assert isinstance(ended["error"], EngineDeadError), f"its stream should fail: {ended}"
        with pytest.raises(EngineDeadError, match="shut down"):
            child.call("generate", prompt=PROMPTS[0])

        child.ask("attach")
        assert child.pid in listed()
        child.ask("drop")  # garbage-collected without shutdown(): its finalizer says Goodbye
        wait_until(lambda: child.pid not in listed(), 1, "a garbage-collected frontend to leave")
        assert child.proc.is_alive(), "the frontend must have left by Goodbye, not by exiting"

        child.ask("attach")
        child.conn.send(("exit",))  # exits without shutdown()
        child.proc.join(10)
        assert child.proc.exitcode == 0, f"exit without shutdown gave code {child.proc.exitcode}"
    wait_until(lambda: listed() == [os.getpid()], 1, "the exited frontend to leave")


def test_attach_beyond_the_cap_is_refused(pair):
    pid, registry_file = attach_target(pair)
    with AttachedProcess(pair):
        t0 = time.monotonic()
        with pytest.raises(ConnectionRefusedError,
                           match=f"engine {pid} has 2 of 2 frontends attached"):
            Engine.attach_tokenizer_worker(pid, registry_file=registry_file)
        assert time.monotonic() - t0 < ATTACH_ERROR_WITHIN
        assert len(pair.get_server_info()["frontends"]) == 2
    wait_until(lambda: len(pair.get_server_info()["frontends"]) == 1, 3, "the slot to be freed")
    again = Engine.attach_tokenizer_worker(pid, registry_file=registry_file)  # a free slot again
    try:
        assert again.generate(CAPITAL_PROMPTS[0], GREEDY_8)["text"] == pair.generate(
            CAPITAL_PROMPTS[0], GREEDY_8)["text"]
    finally:
        again.shutdown()
    wait_until(lambda: len(pair.get_server_info()["frontends"]) == 1, 1, "the slot to be freed")


def test_attach_to_a_process_that_is_not_running():
    pid = dead_pid()
    t0 = time.monotonic()
    with pytest.raises(ConnectionRefusedError, match=f"process {pid}: it is not running"):
        Engine.attach_tokenizer_worker(pid)
    assert time.monotonic() - t0 < ATTACH_ERROR_WITHIN


def test_attach_to_an_engine_with_one_frontend():
    conn, child_conn = SPAWN.Pipe()
    owner = SPAWN.Process(target=_own_engine, args=(child_conn, 1))
    owner.start()
    try:
        assert conn.poll(120), "the owner process did not start its engine"
        owner_pid, _ = conn.recv()
        t0 = time.monotonic()
        with pytest.raises(ConnectionRefusedError, match="tokenizer_worker_num > 1"):
            Engine.attach_tokenizer_worker(owner_pid)
        assert time.monotonic() - t0 < ATTACH_ERROR_WITHIN
        conn.send("stop")
        owner.join(15)
        assert owner.exitcode == 0
    finally:
        conn.close()
        stop_child(owner)


@pytest.mark.parametrize("change, error, match", [
    ("stale", EngineDeadError, "stale registry"),
    ("token", ConnectionRefusedError, "wrong token"),
    ("version", ConnectionRefusedError, "protocol"),
])
def test_attach_with_a_bad_registry(engine, tmp_path, change, error, match):
    info = registry.read(registry_file_of(engine))
    gone = dead_pid()
    info = msgspec.structs.replace(info, **{
        "stale": {"owner_pid": gone, "core_pid": gone},
        "token": {"token": "0" * len(info.token)},
        "version": {"version": "0"},
    }[change])
    path = tmp_path / f"unison_{change}"
    registry.publish(path, info)
    t0 = time.monotonic()
    with pytest.raises(error, match=match):
        Engine.attach_tokenizer_worker(info.owner_pid, registry_file=str(path))
    assert time.monotonic() - t0 < ATTACH_ERROR_WITHIN
    assert frontend_pids(engine.get_server_info()) == [os.getpid()], \
        "a refused frontend must not hold a slot"


# ---- 3. engine-wide controls ------------------------------------------------------------------


def test_pause_from_attached_frontend_holds_the_owners_work(engine):
    with AttachedProcess(engine) as child, ThreadPoolExecutor(1) as pool:
        for resumer in ("attached", "owner"):
            child.call("pause_generation", mode="in_place")
            try:
                held = pool.submit(engine.generate, PROMPTS[0], GREEDY_8)

                def queued(held=held) -> bool:
                    info = engine.get_server_info()
                    assert info["paused"], "a pause from the attached frontend must pause the engine"
                    assert info["num_running"] == 0 and not held.done(), \
                        "the owner's request ran while paused"
                    return info["num_waiting"] == 1

                wait_until(queued, 10, "the owner's request to be queued in the paused engine")
                # Each reply comes from a later turn of the core's loop, and each turn would step
                # (admit the request) were the engine not paused.
                for _ in range(3):
                    assert queued(), "the owner's request left the queue while paused"
                assert child.call("get_server_info")["paused"]
            finally:
                if resumer == "attached":
                    child.call("continue_generation")
                else:
                    engine.continue_generation()
            out = held.result(30)
            assert out["meta_info"]["completion_tokens"] == 8, f"resumed by the {resumer}"
            assert not engine.get_server_info()["paused"]


# ---- 4. request ids ---------------------------------------------------------------------------


def test_rids_are_engine_wide_and_aborts_touch_only_their_owner(engine, references):
    prompt = MIXED_PROMPTS[2]
    with AttachedProcess(engine) as child:
        stream = engine.generate(prompt, GREEDY_REF, stream=True, rid="shared-rid",
                                 return_logprob=True, top_logprobs_num=5)
        next(stream)
        engine.pause_generation(mode="in_place")  # keeps the owner's request in flight however fast
        try:
            with pytest.raises(ValueError, match="'shared-rid' is already in flight"):
                child.call("generate", prompt=PROMPTS[0], sampling_params=GREEDY_8,
                           rid="shared-rid")
            child.call("abort_request", rid="shared-rid")  # not its request: nothing to abort
            child.ask("foreign_abort", "shared-rid")  # the core ignores a non-owner's Abort
            assert in_flight(engine.get_server_info(), os.getpid()) == 1, \
                "the owner's request was aborted by another frontend"
        finally:
            engine.continue_generation()
        *_, last = stream
        assert last["meta_info"]["finish_reason"] == {"type": "length", "length": REF_TOKENS}
        assert_greedy_close(*references[prompt], last["output_ids"], top_dicts(last),
                            name="the owner's request after foreign aborts")
        # Once finished, the rid is free for anyone.
        out = child.call("generate", prompt=PROMPTS[0], sampling_params=GREEDY_8,
                         rid="shared-rid")
        assert out["meta_info"]["id"] == "shared-rid" and out["meta_info"]["completion_tokens"] == 8


# ---- 5. faults --------------------------------------------------------------------------------


def test_kill_of_attached_process_frees_its_requests(engine):
    params = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    logprobs = {"return_logprob": True, "top_logprobs_num": 5}
    ref = engine.generate(PROMPTS[3], params, **logprobs)
    prompt_len = ref["meta_info"]["prompt_tokens"]
    block_size = engine.get_server_info()["block_size"]
    chunks: list[dict] = []
    owner_stream = threading.Thread(target=lambda: chunks.extend(
        engine.generate(PROMPTS[3], params, stream=True, rid="owner", **logprobs)))

    def child_requests_gone(pid: int) -> bool:
        info = engine.get_server_info()
        owned = in_flight(info, os.getpid())
        return pid not in frontend_pids(info) and info["num_running"] + info["num_waiting"] == owned

    with AttachedProcess(engine) as child:
        child.ask("stream", {"prompt": PROMPTS[:2], "sampling_params": ENDLESS})
        owner_stream.start()
        try:
            wait_until(lambda: chunks, 10, "the owner's first chunk")
            assert in_flight(engine.get_server_info(), child.pid) == 2

            t0 = time.monotonic()
            os.kill(child.pid, signal.SIGKILL)
            wait_until(lambda: child_requests_gone(child.pid), DEATH_NOTICED_WITHIN,
                       "the killed frontend's requests to be aborted")
            figure("attached process kill -9 -> its requests aborted, KV freed",
                   time.monotonic() - t0)

            # Paused, the owner's request holds exactly the blocks of its computed tokens.
            engine.pause_generation(mode="in_place")
            try:
                wait_until(lambda: caught_up(chunks, engine, "owner"), 5, "the owner's stream to settle")
                done = chunks[-1]["meta_info"]["finish_reason"] is not None
                computed = 0 if done else prompt_len + len(chunks[-1]["output_ids"]) - 1
                used = engine.get_server_info()["kv_blocks_used"]
                assert used == math.ceil(computed / block_size), \
                    f"{used} KV blocks in use; the owner's request has {computed} tokens computed"
                engine.check_integrity()
            finally:
                engine.continue_generation()
        finally:
            owner_stream.join(60)
    assert not owner_stream.is_alive(), "the owner's stream did not finish"
    final = chunks[-1]
    assert final["meta_info"]["completion_tokens"] == 48
    assert_greedy_close(ref["output_ids"], top_dicts(ref), final["output_ids"], top_dicts(final),
                        name="the owner's stream across another frontend's death")


def test_kill_of_core_fails_attached_frontend_fast():
    owner = Engine(tokenizer_worker_num=2, **ENGINE_ARGS)
    try:
        registry_file = registry_file_of(owner)
        runtime_dir = runtime_dir_of(registry_file)
        core_pid = owner.get_server_info()["core_pid"]
        with AttachedProcess(owner) as child:
            child.ask("stream", {"prompt": PROMPTS[0], "sampling_params": ENDLESS})
            t0 = time.monotonic()
            os.kill(core_pid, signal.SIGKILL)
            ended = child.ask("stream_result", DEATH_NOTICED_WITHIN + 2)
            assert isinstance(ended["error"], EngineDeadError), f"the stream should fail: {ended}"
            waiting_s = ended["ended_at"] - t0  # CLOCK_MONOTONIC is one clock for all processes
            with pytest.raises(EngineDeadError):
                child.call("generate", prompt=PROMPTS[0], sampling_params=GREEDY_8)
            later_s = time.monotonic() - t0
            figure("core kill -9 -> waiting call in the attached process raises", waiting_s)
            figure("core kill -9 -> later call in the attached process raises", later_s)
            assert waiting_s < DEATH_NOTICED_WITHIN and later_s < DEATH_NOTICED_WITHIN

            # The owner lives, so the registry outlives the core: attaching must see it is stale.
            t1 = time.monotonic()
            with pytest.raises(EngineDeadError, match="stale registry"):
                Engine.attach_tokenizer_worker(os.getpid(), registry_file=str(registry_file))
            assert time.monotonic() - t1 < ATTACH_ERROR_WITHIN
            child.call("shutdown", timeout=5)
        with pytest.raises(EngineDeadError):
            owner.generate(PROMPTS[0])
    finally:
        owner.shutdown()
    assert not registry_file.exists() and not runtime_dir.exists(), \
        "the owner's shutdown must clean up after a dead core"


def test_kill_of_owner_stops_core_and_fails_attached_frontend():
    conn, child_conn = SPAWN.Pipe()
    owner = SPAWN.Process(target=_own_engine, args=(child_conn, 2))
    owner.start()
    core_pid, registry_file, attached = None, None, None
    try:
        assert conn.poll(120), "the owner process did not start its engine"
        owner_pid, core_pid = conn.recv()
        registry_file = registry.registry_path(owner_pid)
        runtime_dir = runtime_dir_of(registry_file)
        attached = Engine.attach_tokenizer_worker(owner_pid)  # this test process attaches
        stream = attached.generate(PROMPTS[0], ENDLESS, stream=True)
        next(stream)

        t0 = time.monotonic()
        os.kill(owner_pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            for _ in stream:
                pass
        error_s = time.monotonic() - t0
        wait_until(lambda: process_exited(core_pid), DEATH_NOTICED_WITHIN, "the core to exit")
        figure("owner kill -9 -> core exited", time.monotonic() - t0)
        figure("owner kill -9 -> the attached frontend's stream raises", error_s)
        assert error_s < DEATH_NOTICED_WITHIN
        wait_until(lambda: not registry_file.exists() and not runtime_dir.exists(), 1,
                   "the core to remove the registry and its runtime directory")
        with pytest.raises(EngineDeadError):
            attached.generate(PROMPTS[0])
    finally:
        if attached is not None:
            attached.shutdown()
        conn.close()
        stop_child(owner)
        if core_pid is not None and not process_exited(core_pid):
            os.kill(core_pid, signal.SIGKILL)
        if registry_file is not None:
            registry.unlink(registry_file)


def test_owner_shutdown_while_attached_frontend_streams():
    owner = Engine(tokenizer_worker_num=2, **ENGINE_ARGS)
    registry_file = registry_file_of(owner)
    try:
        with AttachedProcess(owner) as child:
            child.ask("stream", {"prompt": PROMPTS[0], "sampling_params": ENDLESS})
            t0 = time.monotonic()
            owner.shutdown()
            shutdown_s = time.monotonic() - t0
            ended = child.ask("stream_result", DEATH_NOTICED_WITHIN)
            figure("owner shutdown() with an attached frontend streaming", shutdown_s)
            figure("owner shutdown() -> the attached frontend's stream ended",
                   ended["ended_at"] - t0)
            assert shutdown_s < SHUTDOWN_WITHIN
            assert isinstance(ended["error"], EngineDeadError) or (
                ended["error"] is None and ended["last"]["meta_info"]["finish_reason"]), ended
            with pytest.raises(EngineDeadError):
                child.call("generate", prompt=PROMPTS[0], sampling_params=GREEDY_8,
                           timeout=DEATH_NOTICED_WITHIN)
            child.call("shutdown", timeout=5)
    finally:
        owner.shutdown()
    assert not registry_file.exists()


# ---- 6. churn ---------------------------------------------------------------------------------


def test_attach_detach_churn_leaks_nothing(engine, references):
    registry_file = registry_file_of(engine)
    core_pid = engine.get_server_info()["core_pid"]
    fds_before = open_fds(core_pid)
    stop, streamed, errors = threading.Event(), [], []

    def stream_until_stopped():
        try:
            for i in itertools.count():
                if stop.is_set():
                    return
                prompt = MIXED_PROMPTS[i % len(MIXED_PROMPTS)]
                *_, last = engine.generate(prompt, GREEDY_REF, stream=True)
                streamed.append((prompt, last["output_ids"]))
        except BaseException as e:
            errors.append(e)

    owner_stream = threading.Thread(target=stream_until_stopped)
    results = SPAWN.Queue()
    children = [SPAWN.Process(target=_attach_detach_loop,
                              args=(*attach_target(engine), 10, results)) for _ in range(5)]
    t0 = time.monotonic()
    owner_stream.start()
    try:
        for c in children:
            c.start()
        reports = [results.get(timeout=60) for _ in children]
        churn_s = time.monotonic() - t0
    finally:
        stop.set()
        owner_stream.join(30)
        for c in children:
            stop_child(c)
    figure("5 processes x 10 attach/generate/detach while the owner streams", churn_s)
    assert churn_s < 60
    assert [c.exitcode for c in children] == [0] * 5
    assert not errors, f"the owner's stream failed: {errors}"
    assert all(r["error"] is None for r in reports), [r["error"] for r in reports]
    assert sum(len(r["outputs"]) for r in reports) == 50
    assert streamed, "the owner streamed nothing during the churn"
    for prompt, ids in [o for r in reports for o in r["outputs"]] + streamed:
        ref_ids, ref_top = references[prompt]
        assert_greedy_close(ref_ids[: len(ids)], ref_top, ids, name=prompt)

    assert registry_file.exists(), "the registry must stay while the engine lives"
    info = wait_idle(engine)
    assert frontend_pids(info) == [os.getpid()], info["frontends"]
    wait_until(lambda: open_fds(core_pid) <= fds_before, 3,
               f"the core's open fds to drop back to {fds_before}")
    print(f"\n[figure] core open fds before/after the churn: {fds_before}/{open_fds(core_pid)}")


# ---- 7. load ----------------------------------------------------------------------------------


def test_four_frontends_200_requests_match_greedy_alone(engine, references):
    results, go = SPAWN.Queue(), SPAWN.Event()
    seeds = [1, 2, 3]  # 0 is the owner
    children = [SPAWN.Process(target=_load_client,
                              args=(*attach_target(engine), seed, go, results)) for seed in seeds]
    for c in children:
        c.start()
    try:
        ready = [results.get(timeout=60) for _ in children]
        assert all(r[0] == "ready" for r in ready), ready
        assert len(engine.get_server_info()["frontends"]) == 4
        t0 = time.monotonic()
        go.set()
        outputs = {0: asyncio.run(run_load(engine, load_specs(0)))}
        for _ in children:
            kind, seed, value = results.get(timeout=120)
            assert kind == "done", f"load client {seed} failed: {value}"
            outputs[seed] = value
        load_s = time.monotonic() - t0
        for c in children:
            c.join(10)
    finally:
        for c in children:
            stop_child(c)
    figure("200 requests from 4 frontends at once (2 shared cores)", load_s)
    assert load_s < 120
    assert [c.exitcode for c in children] == [0] * 3
    assert sum(len(v) for v in outputs.values()) == 200
    for seed, outs in outputs.items():
        specs = load_specs(seed)
        for i, ((prompt, max_new, stream), (ids, tops)) in enumerate(zip(specs, outs, strict=True)):
            ref_ids, ref_top = references[prompt]
            name = f"frontend {seed} request {i} ({'streamed' if stream else 'whole'})"
            assert len(ids) == max_new, f"{name}: {len(ids)} tokens"
            assert_greedy_close(ref_ids[:max_new], ref_top, ids, tops, name=name)


CTRL_C_CHILD = """
import signal, sys, time
from unison import Engine
# A shell that starts a job in the background (`make test &`) leaves SIGINT ignored in it, and
# Python keeps an inherited SIG_IGN: restore what an interactive Ctrl-C would find.
signal.signal(signal.SIGINT, signal.default_int_handler)
engine = Engine.attach_tokenizer_worker(int(sys.argv[1]), registry_file=sys.argv[2] or None)
print("attached", flush=True)
try:
    engine.generate("Once upon a time", {"max_new_tokens": 2000, "ignore_eos": True})
except KeyboardInterrupt:
    print("interrupted", flush=True)
time.sleep(30)  # stay alive: the abort must come from Ctrl-C, not from this process's exit
"""


def test_ctrl_c_in_sync_generate_aborts_the_request(engine):
    owner, registry_file = attach_target(engine)  # this process may own more than one engine
    child = subprocess.Popen([sys.executable, "-c", CTRL_C_CHILD, str(owner), registry_file or ""],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "attached"
        wait_until(lambda: in_flight(engine.get_server_info(), child.pid) == 1, 10,
                   "the child's request to be in flight")
        # Not a wait before an assertion but a margin before acting: the core has the request
        # as soon as the child sent it, a moment before the child's generate() reaches the loop
        # that aborts on Ctrl-C, and no public state tells when it has.
        time.sleep(0.3)
        child.send_signal(signal.SIGINT)
        line = child.stdout.readline().strip()
        assert line == "interrupted", f"the child said {line!r}, exit code {child.poll()}"
        t0 = time.monotonic()
        wait_until(lambda: in_flight(engine.get_server_info(), child.pid) == 0, 3,
                   "Ctrl-C to abort the request in the core")
        figure("Ctrl-C to request aborted", time.monotonic() - t0)
        assert child.poll() is None, "the child must still be alive"
    finally:
        child.kill()
        child.wait()


STALLED_CHILD = """
import json, sys
from unison import Engine
engine = Engine.attach_tokenizer_worker(int(sys.argv[1]), registry_file=sys.argv[2] or None)
params = {"temperature": 0, "max_new_tokens": int(sys.argv[3]), "ignore_eos": True}
try:
    for i, out in enumerate(engine.generate(sys.argv[4], params, stream=True, return_logprob=True,
                                            top_logprobs_num=5)):
        if i == 2:
            print("streaming", flush=True)
    print("finished " + json.dumps(out), flush=True)
except RuntimeError as e:
    print(f"error: {type(e).__name__}: {e}", flush=True)
engine.shutdown()
"""
STALLED_PROMPT = "The three primary colors are"


@contextlib.contextmanager
def stalled_child(owner: Engine, max_new: int, prompt: str = STALLED_PROMPT):
    """An attached process streaming a greedy request, stopped (SIGSTOP) once it is under way."""
    owner_pid, registry_file = attach_target(owner)
    child = subprocess.Popen([sys.executable, "-c", STALLED_CHILD, str(owner_pid), registry_file or "",
                              str(max_new), prompt], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "streaming"
        child.send_signal(signal.SIGSTOP)
        yield child
    finally:
        child.send_signal(signal.SIGCONT)
        child.kill()
        child.wait()


def resumed(child: subprocess.Popen) -> str:
    """SIGCONT, and what the child said at its end."""
    child.send_signal(signal.SIGCONT)
    line = child.stdout.readline().strip()
    assert child.wait(30) == 0
    return line


def behind(engine: Engine, pid: int) -> bool:
    return any(fe["behind"] for fe in engine.get_server_info()["frontends"] if fe["pid"] == pid)


def finished(line: str) -> dict:
    assert line.startswith("finished "), line[:300]
    return json.loads(line.removeprefix("finished "))


class Pace:
    """Timestamps of a long stream of the owner's, read in a thread: its inter-token gaps in a
    window show whether anything stalled it."""

    def __init__(self, owner: Engine) -> None:
        self.stamps: list[float] = []
        self.stop = threading.Event()
        self.stream = owner.generate("Once upon a time", {"max_new_tokens": 4000, "ignore_eos": True},
                                     stream=True)
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()

    def read(self) -> None:
        for _ in self.stream:
            self.stamps.append(time.monotonic())
            if self.stop.is_set():
                return

    def gaps(self, windows: dict[str, tuple[float, float]]) -> dict[str, float]:
        """The median gap in each window that holds a few tokens."""
        return {name: statistics.median(b - a for a, b in itertools.pairwise(
                    [t for t in self.stamps if lo <= t < hi]))
                for name, (lo, hi) in windows.items() if sum(lo <= t < hi for t in self.stamps) > 2}

    def close(self) -> None:
        self.stop.set()
        self.reader.join(10)
        self.stream.close()


@pytest.mark.parametrize("bound", ["age", "count"])
def test_a_stopped_frontend_is_parked_and_completes_when_it_resumes(bound, capfd):
    """SIGSTOP of an attached process for 3 s, with room in the core: once its unprocessed outputs
    are older or more than the bound its request is parked (not stepped, so nothing piles up),
    the owner's stream keeps its pace throughout, and after SIGCONT the stopped process's stream
    completes with the tokens of the same request run alone."""
    limits = ({"frontend_max_lag_s": 1.0} if bound == "age"
              else {"frontend_max_lag_s": 60.0, "frontend_max_silence_s": 120.0, "frontend_max_unacked": 8})
    with Engine(tokenizer_worker_num=2, **limits, **ENGINE_ARGS) as owner:
        pace = Pace(owner)
        try:
            time.sleep(1.0)  # the owner's pace for a second before the stop: the "before" window
            with stalled_child(owner, 200) as child:
                t0 = time.monotonic()
                wait_until(lambda: behind(owner, child.pid), 5, "the stopped frontend to be parked")
                parked_after = time.monotonic() - t0
                time.sleep(max(3.0 - parked_after, 0))
                assert in_flight(owner.get_server_info(), child.pid) == 1  # parked, not ended
                gaps = pace.gaps({"before": (t0 - 1, t0), "stopped": (t0, t0 + 3)})
                assert {"before", "stopped"} <= set(gaps), f"the owner's stream stalled: {gaps}"
                assert max(gaps.values()) < 3 * gaps["before"] + 0.05, f"the owner slowed down: {gaps}"
                out = finished(resumed(child))
            assert not behind(owner, child.pid)
            assert "fell behind" in capfd.readouterr().err
            with capfd.disabled():
                figure(f"SIGSTOP -> the stopped frontend's request parked (bound: {limits}; owner's gaps "
                       f"{', '.join(f'{k} {v * 1e3:.0f} ms' for k, v in gaps.items())})", parked_after)
        finally:
            pace.close()
        ref = owner.generate(STALLED_PROMPT, {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True})
        assert out["output_ids"] == ref["output_ids"]
        wait_until(lambda: _idle_with_owner_only(owner), 5, "the owner's engine to be idle")
        owner.check_integrity()


def test_a_stopped_frontends_kv_goes_to_others_under_pressure(capfd):
    """A KV cache too small for both: a stopped frontend's request is parked, then preempted as
    soon as the owner's long prompt needs its blocks (the owner waits about frontend_max_lag_s,
    not for the stopped one's end); after SIGCONT it is recomputed and completes as it would
    have alone."""
    lag = 1.0
    with Engine(tokenizer_worker_num=2, frontend_max_lag_s=lag, max_total_tokens=512, block_size=16,
                **ENGINE_ARGS) as owner:
        long_prompt, child_prompt = " ".join(PROMPTS * 8), " ".join(PROMPTS * 3)
        with stalled_child(owner, 300, child_prompt) as child:
            t0 = time.monotonic()
            out = owner.generate(long_prompt, {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
            took = time.monotonic() - t0
            assert out["meta_info"]["prompt_tokens"] > 400  # more than the stopped one leaves
            assert took < lag + 3.0, f"the owner waited {took:.1f} s for the stopped frontend's KV"
            info = owner.get_server_info()
            assert info["stats"]["num_preemptions"] >= 1
            assert in_flight(info, child.pid) == 1  # preempted, not ended
            got = finished(resumed(child))
        with capfd.disabled():
            figure("a stopped frontend's KV given to a long prompt (frontend_max_lag_s = 1 s)", took)
        ref = owner.generate(child_prompt, {"temperature": 0, "max_new_tokens": 300, "ignore_eos": True},
                             return_logprob=True, top_logprobs_num=5)
        assert_greedy_close(ref["output_ids"], top_dicts(ref), got["output_ids"], top_dicts(got),
                            name="recomputed after preemption")
        wait_until(lambda: _idle_with_owner_only(owner), 5, "the owner's engine to be idle")
        owner.check_integrity()


def test_a_silent_frontends_requests_end_with_a_typed_error(capfd):
    """Only a frontend silent for frontend_max_silence_s has its requests ended: each with
    FrontendStalledError naming the cause (HTTP: a 503), learnt when it resumes."""
    with Engine(tokenizer_worker_num=2, frontend_max_lag_s=0.5, frontend_max_silence_s=2.0,
                **ENGINE_ARGS) as owner:
        with stalled_child(owner, 4000) as child:
            t0 = time.monotonic()
            wait_until(lambda: in_flight(owner.get_server_info(), child.pid) == 0, 6,
                       "the silent frontend's request to be ended")
            took = time.monotonic() - t0
            assert took > 1.5, f"ended after {took:.1f} s, before frontend_max_silence_s"
            assert "frontend_max_silence_s=2.0" in capfd.readouterr().err
            line = resumed(child)
        assert line.startswith("error: FrontendStalledError: ") and "processed none" in line, line
        with capfd.disabled():
            figure("SIGSTOP -> the silent frontend's request ended (frontend_max_silence_s = 2 s)", took)
        wait_until(lambda: _idle_with_owner_only(owner), 5, "the owner's engine to be idle")
        owner.check_integrity()
