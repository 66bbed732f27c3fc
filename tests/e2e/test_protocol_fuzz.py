"""The core survives whatever arrives on its socket: random and truncated frames, messages before
Hello, and well-formed messages with hostile values. It drops them and keeps serving."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import unison
from tests.e2e.test_engine import wait_idle
from unison import Engine
from unison.sampling import BY_NAME, CORE_OPTIONS, Option
from unison.wire import messages as protocol
from unison.wire import registry

FUZZ = settings(max_examples=60, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def engine():
    with Engine(tokenizer_worker_num=2, num_threads=1, chunked_prefill_size=64) as e:
        yield e


@contextlib.contextmanager
def dealer() -> Iterator[tuple[zmq.Socket, protocol.EngineInfo]]:
    """A bare protocol client connected to this process's engine (it has not said Hello yet)."""
    info = registry.read(registry.registry_path(os.getpid()))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(info.endpoint)
    try:
        yield sock, info
    finally:
        sock.close()
        ctx.term()


@pytest.fixture(scope="module")
def raw(engine):
    """A bare DEALER that has said Hello with the registry's token."""
    with dealer() as (sock, info):
        sock.send(protocol.encode(protocol.Hello(pid=os.getpid(), token=info.token)))
        assert sock.poll(5000) and isinstance(protocol.decode_to_frontend(sock.recv()), protocol.Welcome)
        yield sock
        sock.send(protocol.encode(protocol.Goodbye()))


@pytest.fixture(autouse=True)
def integrity(request):
    """After each test (all of a fuzz test's examples): the engine drains to idle, every KV block
    back, and its tables agree."""
    yield
    if "engine" in request.fixturenames:
        engine = request.getfixturevalue("engine")
        wait_idle(engine)
        engine.check_integrity()


cids = itertools.count(1_000_000)  # apart from the cids the fuzzed messages carry


def answers(raw: zmq.Socket) -> None:
    """A control round trip on the raw socket: the core handles one socket's messages in order,
    so its reply proves it has read everything sent before, survived it, and that its tables
    still agree (the integrity check runs between steps, requests in flight or not). Outputs of
    earlier requests are acknowledged on the way, as a frontend does."""
    cid = next(cids)
    raw.send(protocol.encode(protocol.Control(cid, protocol.CheckIntegrity())))
    while True:
        assert raw.poll(5000), "the core did not answer"
        reply = protocol.decode_to_frontend(raw.recv())
        if isinstance(reply, protocol.StepOutputs):
            raw.send(protocol.encode(protocol.Ack(reply.seq)))
        elif isinstance(reply, protocol.ControlReply) and reply.cid == cid:
            assert reply.error is None and isinstance(reply.result, protocol.OpResult) \
                and reply.result.success, reply
            return


def still_serving(engine: Engine) -> None:
    out = engine.generate("The capital of France is", {"max_new_tokens": 4, "temperature": 0})
    assert out["text"].startswith(" Paris")


def test_runtime_dir_and_registry_are_private(engine):
    path = registry.registry_path(os.getpid())
    assert path.stat().st_mode & 0o777 == 0o600 and path.stat().st_uid == os.getuid()
    socket_file = Path(registry.read(path).endpoint.removeprefix("ipc://"))
    runtime = socket_file.parent
    assert runtime.stat().st_mode & 0o777 == 0o700 and runtime.stat().st_uid == os.getuid()
    assert socket_file.stat().st_mode & 0o077 == 0, "the socket must not be open to others"
    assert socket_file.stat().st_uid == os.getuid()


def test_nothing_crosses_processes_as_pickle():
    """Every message between processes is msgpack (wire/messages.py): no module of the package may
    reach for pickle or an API that unpickles (multiprocessing connections, torch.load)."""
    banned = re.compile(r"\bimport pickle\b|\bfrom pickle\b|\bpickle\.|\bcloudpickle\b|"
                        r"multiprocessing\.connection|torch\.load\(|\brecv_pyobj\b|\bsend_pyobj\b")
    root = Path(unison.__file__).parent
    hits = [f"{f.relative_to(root)}:{n}: {line.strip()}" for f in root.rglob("*.py")
            for n, line in enumerate(f.read_text().splitlines(), 1) if banned.search(line)]
    assert not hits, hits


@FUZZ
@given(st.binary(max_size=300))
def test_random_frames(engine, raw, frame):
    raw.send(frame)
    raw.send_multipart([frame, frame])  # a frame count the core does not expect
    answers(raw)


@FUZZ
@given(st.sampled_from([
    protocol.Generate("x", [1, 2, 3], protocol.CoreSamplingParams()),
    protocol.Control(1, protocol.GetServerInfo()),
    protocol.Control(2, protocol.CheckIntegrity()),
    protocol.Control(3, protocol.AbortRequests("x")),
    protocol.Abort("x"),
    protocol.Abort("x", finished=True),
]), st.integers(1, 40))
def test_truncated_messages(engine, raw, msg, cut):
    data = protocol.encode(msg)
    raw.send(data[: max(1, len(data) - cut)])
    answers(raw)


def hostile(o: Option) -> st.SearchStrategy:
    """Any value of the option's wire type, in range or not: the core must refuse, not crash."""
    if o.type is float:
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    if o.type is int:
        return st.integers(-5 if o.lo is None else int(o.lo) - 5, 10**6)
    return st.from_type(o.type)


params = st.builds(
    protocol.CoreSamplingParams,
    max_new_tokens=st.integers(-5, 6),
    logit_bias=st.dictionaries(st.integers(-10, 10**6), hostile(BY_NAME["temperature"]), max_size=3),
    seed=st.integers(0, 2**64 - 1), stop_token_ids=st.lists(st.integers(-10, 10**6), max_size=3),
    **{o.name: hostile(o) for o in CORE_OPTIONS},
)


rids = itertools.count()


@FUZZ
@given(st.lists(st.integers(-10, 60_000), max_size=20), params, st.booleans(),
       st.integers(-5, 10**6), st.integers(-5, 50), st.integers(-5, 5))
def test_hostile_generate_values(engine, raw, ids, p, return_logprob, top_n, start, priority):
    # Each runs to its end (no abort): whatever the core accepts must get through a step.
    msg = protocol.Generate(f"fuzz-{next(rids)}", ids, p, return_logprob, top_n, start, priority)
    raw.send(protocol.encode(msg))
    answers(raw)


def test_messages_before_hello_are_dropped(engine):
    with dealer() as (sock, _):
        sock.send(protocol.encode(protocol.Generate("intruder", [1, 2, 3], protocol.CoreSamplingParams())))
        sock.send(protocol.encode(protocol.Control(1, protocol.GetServerInfo())))
        # One socket's messages are handled in order: an answer to either of those two would
        # arrive before the answer to this Hello, so no window of silence needs waiting out.
        sock.send(protocol.encode(protocol.Hello(pid=os.getpid(), token="guessed")))
        assert sock.poll(5000)
        first = protocol.decode_to_frontend(sock.recv())
        assert isinstance(first, protocol.Reject), f"a frontend that has not said Hello got {first}"
        info = engine.get_server_info()
        assert all(fe["pid"] == os.getpid() for fe in info["frontends"])
        assert info["num_running"] + info["num_waiting"] == 0, "the intruder's request was queued"
        assert "intruder" not in {rid for _, rid in info["admissions"]}, "the intruder's request ran"


P = protocol.CoreSamplingParams
HOSTILE = [
    protocol.Generate("h1", [1, 2, 3], P(max_new_tokens=2), True, 10**6),  # top-k beyond the vocab
    protocol.Generate("h2", [1, 2, 3], P(max_new_tokens=2, temperature=float("nan"))),
    protocol.Generate("h3", [1, 2, 3], P(max_new_tokens=2, top_p=float("inf"), top_k=10**9)),
    protocol.Generate("h4", [1, 2, 3], P(max_new_tokens=-3)),
    protocol.Generate("h5", [1, 2, 3], P(max_new_tokens=2, logit_bias={10**7: 1.0})),
    protocol.Generate("h6", [1, 2, 3], P(max_new_tokens=2, stop_token_ids=[-1])),
    protocol.Generate("h7", [1, 2, 3], P(max_new_tokens=2, min_new_tokens=-4)),
    protocol.Generate("h8", [1, 2, 3], P(max_new_tokens=2), True, 3, -7),
    protocol.Generate("h9", [1, 2, 3], P(max_new_tokens=2, repetition_penalty=0.0)),
]


@pytest.mark.parametrize("msg", HOSTILE, ids=[m.rid for m in HOSTILE])
def test_hostile_values_are_refused(raw, msg):
    raw.send(protocol.encode(msg))
    while True:  # skip outputs of earlier tests' requests
        assert raw.poll(5000), "the core did not answer"
        reply = protocol.decode_to_frontend(raw.recv())
        if isinstance(reply, protocol.StepOutputs) and any(o.rid == msg.rid for o in reply.outputs):
            break
    [out] = [o for o in reply.outputs if o.rid == msg.rid]
    assert out.finish == "abort" and out.error and out.refused, out


def control_reply(raw: zmq.Socket, cid: int) -> protocol.ControlReply:
    while True:  # skip outputs of earlier tests' requests
        assert raw.poll(5000), "the core did not answer"
        reply = protocol.decode_to_frontend(raw.recv())
        if isinstance(reply, protocol.ControlReply) and reply.cid == cid:
            return reply


@pytest.mark.parametrize("request_, where", [
    ({"type": "pause", "mode": "sideways"}, "$.request.mode"),  # a value of the wrong kind
    ({"type": "reboot"}, "$.request.type"),  # no such control
    ({"type": "update_weights"}, "model_path"),  # a required field left out
])
def test_unreadable_controls_are_answered_with_the_field(raw, request_, where):
    """The frontend waiting on the cid hears why at once, rather than at its timeout."""
    raw.send(msgspec.msgpack.encode({"type": "Control", "cid": 900, "request": request_}))
    reply = control_reply(raw, 900)
    assert reply.result is None and where in reply.error, reply


def test_a_control_its_handler_refuses_is_answered_with_the_error(raw):
    raw.send(protocol.encode(protocol.Control(901, protocol.AbortRequests())))
    reply = control_reply(raw, 901)
    assert reply.result is None and "abort_requests needs a rid" in reply.error, reply


def test_the_core_kept_serving(engine, raw):
    still_serving(engine)
    wait_idle(engine)
    engine.check_integrity()


def test_server_binds_loopback_by_default(monkeypatch):
    import unison.deploy.launch as launch
    from unison import cli

    seen = []
    monkeypatch.setattr(launch, "serve", lambda config, settings: seen.append(settings) or 0)
    assert cli.main(["serve"]) == 0
    assert seen[0].host == "127.0.0.1", "only an explicit --host may expose the server"
