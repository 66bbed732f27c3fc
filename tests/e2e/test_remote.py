"""Frontends that attach over TCP with CURVE keys, as from another host: no registry file, no
model cache, no pidfds; liveness by heartbeats both ways, with local death's guarantees."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import zmq

from tests.e2e.test_engine import PROMPTS
from tests.utils import wait_until
from unison import Engine, EngineDeadError, curve_keypair
from unison.errors import InvalidParam
from unison.wire.messages import Hello, UpdateTensors, encode

GREEDY = {"temperature": 0, "max_new_tokens": 8}
ENDLESS = {"max_new_tokens": 2000, "ignore_eos": True}
HEARTBEAT_S = 3.0  # the default bound
SLACK_S = 1.5  # a beat's interval plus scheduling on two shared cores
CLIENT_PUBLIC, CLIENT_SECRET = curve_keypair()


@pytest.fixture(scope="module")
def engine():
    with Engine(listen="tcp://127.0.0.1:*", trusted_client_keys=[CLIENT_PUBLIC], tokenizer_worker_num=4,
                num_threads=1, max_total_tokens=16384) as e:
        yield e


def attach(engine: Engine, secret: str = CLIENT_SECRET, server_key: str | None = None,
           heartbeat_timeout_s: float = HEARTBEAT_S) -> Engine:
    return Engine.attach_tokenizer_worker(address=engine.tcp_address, client_key=secret,
                                          server_key=server_key or engine.server_key,
                                          heartbeat_timeout_s=heartbeat_timeout_s)


def idle(engine: Engine) -> bool:
    info = engine.get_server_info()
    return info["num_running"] == info["num_waiting"] == info["kv_blocks_used"] == 0


def test_tcp_listens_only_where_asked(engine):
    assert engine.tcp_address.startswith("tcp://127.0.0.1:")
    assert engine.get_server_info()["server_key"] == engine.server_key
    with Engine(num_threads=1, max_total_tokens=2048) as plain:
        assert plain.tcp_address is None and plain.server_key is None


def test_curve_key_attaches_and_generates(engine):
    remote = attach(engine)
    try:
        want = engine.generate(PROMPTS[0], GREEDY)
        assert remote.generate(PROMPTS[0], GREEDY)["output_ids"] == want["output_ids"]
        frontends = engine.get_server_info()["frontends"]
        assert [f["remote"] for f in frontends] == [False, True], frontends  # IPC, then over TCP
        # Tensors travel as a file on the core's host: refused over TCP, by the Engine and the core.
        with pytest.raises(InvalidParam, match="core's host only"):
            remote.update_weights_from_tensor([("model.norm.weight", torch.ones(576))])
        refused = remote._control(UpdateTensors("/dev/shm/none.safetensors"))
        assert not refused and "core's host only" in refused.message
    finally:
        remote.shutdown()
    wait_until(lambda: len(engine.get_server_info()["frontends"]) == 1, 5, "the remote frontend to detach")


@pytest.mark.parametrize("which", ["client key not trusted", "wrong server key"])
def test_wrong_keys_are_refused_within_5_s(engine, which):
    other_public, other_secret = curve_keypair()
    kw = {"secret": other_secret} if which.startswith("client") else {"server_key": other_public}
    start = time.monotonic()
    with pytest.raises(ConnectionRefusedError, match="refused the connection"):
        attach(engine, **kw)
    assert time.monotonic() - start < 5
    assert len(engine.get_server_info()["frontends"]) == 1


def test_a_peer_without_keys_never_reaches_the_core(engine):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(engine.tcp_address)
        sock.send(encode(Hello(pid=os.getpid(), token="")))
        assert not sock.poll(1000), "an unauthenticated peer got an answer"
    finally:
        sock.close()
        ctx.term()
    assert len(engine.get_server_info()["frontends"]) == 1


REMOTE = """
    import json, sys
    from unison import Engine
    address, server_key, client_key = sys.argv[1:4]
    remote = Engine.attach_tokenizer_worker(address=address, server_key=server_key, client_key=client_key)
    out = remote.generate(sys.argv[4], {"temperature": 0, "max_new_tokens": 8})
    print(json.dumps(out["output_ids"]), flush=True)
    stream = remote.generate(sys.argv[4], {"max_new_tokens": 2000, "ignore_eos": True}, stream=True)
    next(stream)
    print("streaming", flush=True)
    sys.stdin.readline()  # held here, its request in flight, until killed or stopped
"""


def start_remote(engine: Engine, tmp_path) -> tuple[subprocess.Popen, list[int]]:
    """A frontend process as on another host: attached by address, an empty model cache and home."""
    (tmp_path / "cache").mkdir()
    (tmp_path / "home").mkdir()
    env = dict(os.environ, UNISON_CACHE_DIR=str(tmp_path / "cache"), HOME=str(tmp_path / "home"))
    script = tmp_path / "remote.py"
    script.write_text(textwrap.dedent(REMOTE))
    argv = [sys.executable, str(script), engine.tcp_address, engine.server_key, CLIENT_SECRET, PROMPTS[0]]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    first = json.loads(proc.stdout.readline())
    assert proc.stdout.readline().strip() == "streaming"
    return proc, first


@pytest.mark.parametrize("fault", ["SIGSTOP", "SIGKILL"])
def test_a_stopped_or_killed_remote_frontend_is_freed_within_the_heartbeat_bound(engine, tmp_path, fault):
    proc, first = start_remote(engine, tmp_path)
    try:
        assert first == engine.generate(PROMPTS[0], GREEDY)["output_ids"]
        assert not list((tmp_path / "cache").iterdir()), "the remote frontend needed a model cache"
        assert engine.get_server_info()["num_running"] == 1
        start = time.monotonic()
        os.kill(proc.pid, getattr(signal, fault))
        wait_until(lambda: idle(engine), HEARTBEAT_S + SLACK_S, f"the {fault} frontend's request freed")
        print(f"\n[figure] remote frontend {fault} to its request freed: {time.monotonic() - start:.2f} s")
        wait_until(lambda: len(engine.get_server_info()["frontends"]) == 1, HEARTBEAT_S + SLACK_S,
                   "the silent frontend dropped")
        engine.check_integrity()
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


@pytest.mark.parametrize("fault", ["SIGKILL",  # its host resets the connection at once
                                   "SIGSTOP"])  # silent: libzmq's heartbeats time out
def test_a_dead_or_silent_core_is_an_engine_dead_error_within_the_bound(fault):
    with Engine(listen="tcp://127.0.0.1:*", trusted_client_keys=[CLIENT_PUBLIC], tokenizer_worker_num=2,
                num_threads=1, max_total_tokens=2048, heartbeat_timeout_s=1.5) as owner:
        remote = attach(owner, heartbeat_timeout_s=1.5)
        core = owner.get_server_info()["core_pid"]
        try:
            stream = remote.generate(PROMPTS[0], ENDLESS, stream=True)
            next(stream)
            start = time.monotonic()
            os.kill(core, getattr(signal, fault))
            with pytest.raises(EngineDeadError, match="connection .* was lost"):
                for _ in stream:
                    pass
            took = time.monotonic() - start
            print(f"\n[figure] core {fault} to EngineDeadError in a remote frontend: {took:.2f} s")
            assert took < 1.5 + SLACK_S
            with pytest.raises(EngineDeadError):
                remote.generate("Hi", GREEDY)
        finally:
            remote.shutdown()
            if fault == "SIGSTOP":
                os.kill(core, signal.SIGKILL)


def test_a_core_busy_past_the_heartbeat_bound_is_not_dead(engine):
    """libzmq answers the heartbeats while the core's loop is busy (here: a weight load of
    about a second, over twice the frontend's 0.4 s bound); only silence is death."""
    from unison.model.weights.loader import default_gguf_path

    remote = attach(engine, heartbeat_timeout_s=0.4)
    try:
        ok, message, _ = engine.update_weights_from_disk(str(default_gguf_path()))
        assert ok, message
        time.sleep(0.5)
        want = engine.generate(PROMPTS[0], GREEDY)["output_ids"]
        assert remote.generate(PROMPTS[0], GREEDY)["output_ids"] == want
    finally:
        remote.shutdown()
