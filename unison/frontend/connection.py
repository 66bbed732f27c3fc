"""CoreConnection: a frontend's line to its engine core (transport, handshake, liveness, outbox).

TokenizerWorker (worker.py) is the request layer above it; this file knows nothing of requests,
only of messages: it says Hello, hands every later message from the core to its owner, sends in
order without ever blocking the loop, and turns the core's death into one EngineDeadError.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import zmq

from unison.errors import EngineDeadError
from unison.wire.messages import (
    Ack,
    ControlReply,
    Goodbye,
    Heartbeat,
    Hello,
    Reject,
    StepOutputs,
    ToCore,
    Welcome,
    decode_to_frontend,
    encode,
)
from unison.wire.registry import pid_alive

if TYPE_CHECKING:
    from zmq.utils.monitor import _MonitorMessage  # the type recv_monitor_message returns

MAX_MESSAGES_PER_WAKE = 64  # messages taken in one pass when they queue up
RETRY_SEND_S = 0.001  # while the pipe to the core is full
GOODBYE_LINGER_MS = 200

log = logging.getLogger("unison.frontend")

HANDSHAKE_EVENTS_NAMES: dict[int, str] = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
                          zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed: protocol",
                          zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake failed: key not trusted"}
# The connection's events, watched over TCP: a refused handshake while attaching, and after it a
# lost connection (a dead core's host resets it at once, well before a heartbeat would be missed).
HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | sum(HANDSHAKE_EVENTS_NAMES)


class CoreConnection:
    """One DEALER socket to an engine core: over IPC (the core watched through its pidfd), or over
    TCP with CURVE keys (the core watched through libzmq's heartbeats and the connection's events).

    What it guarantees, on the asyncio loop that called `open`:
    - It never blocks that loop: sends are non-blocking; what the pipe cannot take now waits in
      the outbox and leaves in order as soon as there is room.
    - Every message the core sends after Welcome reaches `on_messages`, in order, in batches of
      at most MAX_MESSAGES_PER_WAKE; the StepOutputs of a batch are acknowledged (one Ack) after
      the handler has run, so the core sees how far behind this frontend is.
    - When the core dies (its pidfd fires; over TCP its connection drops or stays silent past
      `heartbeat_timeout_s`), when a handler raises, or on `close`, `dead` is set and `on_dead`
      is called with it exactly once; from then on nothing is sent.
    """

    def __init__(self, endpoint: str, token: str, core_pid: int, curve: tuple[str, str] | None,
                 on_messages: Callable[[list[StepOutputs | ControlReply]], None],
                 on_dead: Callable[[EngineDeadError], None], heartbeat_timeout_s: float = 3.0) -> None:
        """`curve`: (the core's public key, this frontend's secret key) to attach over TCP."""
        if curve is not None and not endpoint.startswith("tcp://"):
            raise ValueError(f"address must be tcp://HOST:PORT, got {endpoint!r}")
        if curve is not None and not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE support, which attaching over TCP needs")
        if not heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s}")
        self.endpoint = endpoint
        self.token = token
        self.core_pid = core_pid  # 0 over TCP until Welcome names it
        self.curve = curve
        self.heartbeat_timeout_s = heartbeat_timeout_s  # over TCP: a core silent this long is dead
        self.on_messages = on_messages
        self.on_dead = on_dead
        self.loop: asyncio.AbstractEventLoop | None = None
        self.dead: EngineDeadError | None = None
        self._sock: zmq.Socket | None = None
        self._outbox: deque[bytes] = deque()  # encoded, waiting for room in the pipe to the core
        self._retry: asyncio.TimerHandle | None = None
        self._read_scheduled = False
        self._pidfd: int | None = None
        self._monitor: zmq.Socket | None = None  # CURVE handshake events, while attaching
        self._beat: asyncio.TimerHandle | None = None

    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        """The loop `open` ran on: everything but `open` runs after it."""
        assert self.loop is not None
        return self.loop

    # ---- handshake ---------------------------------------------------------------------------

    async def open(self, timeout: float, alive: Callable[[], str | None]) -> Welcome:
        """Connect, say Hello and return the core's Welcome; from then on the core is watched.
        `alive` returns why the engine cannot answer, or None. Raises ConnectionRefusedError
        (Reject, an untrusted key), EngineDeadError or TimeoutError, the socket closed."""
        loop = self.loop = asyncio.get_running_loop()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            self._monitor = _use_curve(self._sock, *self.curve, self.heartbeat_timeout_s)
        self._sock.connect(self.endpoint)
        # A plain socket read from the loop's own reader: every message is taken as it comes,
        # without a future or a task per message. ZMQ's FD is edge-triggered, so every send and
        # receive is followed by a look at what is pending (_check_pending).
        self._fd = self._sock.fileno()
        loop.add_reader(self._fd, self._on_readable)
        self._welcome = loop.create_future()
        self.send(Hello(pid=os.getpid(), token=self.token, want_files=self.curve is not None))
        reply = await self._await_welcome(timeout, alive)
        if isinstance(reply, Reject):
            self._close_socket()
            raise ConnectionRefusedError(f"the engine refused this frontend: {reply.reason}")
        self.core_pid = reply.core_pid
        if reply.heartbeat_s > 0:  # over TCP: no pidfd across hosts
            self._beat = loop.call_later(reply.heartbeat_s, self._heartbeat, reply.heartbeat_s)
            if self._monitor is not None:
                loop.add_reader(self._monitor.fileno(), self._on_monitor)
                self._on_monitor()
        else:
            self._watch_core()
        self._check_pending()
        return reply

    async def _await_welcome(self, timeout: float, alive: Callable[[], str | None]) -> Welcome | Reject:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(self._welcome), 0.1)
            except asyncio.TimeoutError:
                pass
            refused = self._handshake_refused()
            if refused:
                self._close_socket()
                raise ConnectionRefusedError(refused)
            problem = alive()
            if problem is None and self.curve is None and not pid_alive(self.core_pid):
                problem = f"the core (pid {self.core_pid}) is not running"
            if problem:
                self._close_socket()
                raise EngineDeadError(problem)
            if time.monotonic() > deadline:
                self._close_socket()
                where = f" at {self.endpoint} (check the address and server_key)" if self.curve else ""
                raise TimeoutError(f"the engine{where} did not answer within {timeout:.0f} s")

    def _handshake_refused(self) -> str | None:
        """Why the CURVE handshake failed, if it did (from the socket's monitor events)."""
        for event in _events(self._monitor):
            if event["event"] != zmq.EVENT_HANDSHAKE_SUCCEEDED:
                kind = HANDSHAKE_EVENTS_NAMES.get(event["event"], "disconnected")
                return (f"the engine at {self.endpoint} refused the connection ({kind}, code "
                        f"{event['value']}): check server_key, and that this frontend's public key is "
                        "among the engine's trusted_client_keys")
        return None

    # ---- liveness ----------------------------------------------------------------------------

    def _heartbeat(self, interval: float) -> None:
        """Tell the core this frontend is alive (from the loop: a stopped or wedged frontend
        stays silent, and the core drops it and frees its requests)."""
        self.send(Heartbeat())
        self._beat = self._loop.call_later(interval, self._heartbeat, interval)

    def _on_monitor(self) -> None:
        """Attached over TCP: a lost connection is a dead engine (ZMQ would reconnect under a new
        identity, which the core has never welcomed)."""
        for event in _events(self._monitor):
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._mark_dead(f"the connection to the engine core at {self.endpoint} was lost (closed, "
                                f"or silent past the {self.heartbeat_timeout_s:g} s heartbeat timeout)")
                return

    def _watch_core(self) -> None:
        why = f"the engine core (pid {self.core_pid}) exited"
        try:
            self._pidfd = os.pidfd_open(self.core_pid)
        except (ProcessLookupError, OSError):
            self._mark_dead(why)
            return
        self._loop.add_reader(self._pidfd, self._mark_dead, why)

    def _mark_dead(self, why: str) -> None:
        for timer in (self._retry, self._beat):
            if timer is not None:
                timer.cancel()
        self._retry = self._beat = None
        self._outbox.clear()  # nobody will read it
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self.dead is None:
            self.dead = EngineDeadError(why)
            self.on_dead(self.dead)

    def close(self, goodbye: bool, why: str) -> None:
        """End the connection: `goodbye` tells a live core first (it frees this frontend's slot
        at once); then this connection is dead, with `why`."""
        linger = 0
        if goodbye and self.dead is None and self._sock is not None:
            try:
                self._sock.send(encode(Goodbye()), zmq.NOBLOCK)
                linger = GOODBYE_LINGER_MS  # let it leave before the socket closes
            except zmq.ZMQError:
                pass
        self._mark_dead(why)
        self._close_socket(linger)

    def _close_socket(self, linger: int = 0) -> None:
        if self._sock is None:
            return
        if self._monitor is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self._monitor.fileno())
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        self._loop.remove_reader(self._fd)
        if self._retry is not None:
            self._retry.cancel()
        self._sock.close(linger=linger)
        self._ctx.term()
        self._sock = None

    # ---- messages ----------------------------------------------------------------------------

    def send(self, msg: ToCore) -> None:
        """Send now, or, while the pipe to the core is full, in order as soon as it has room."""
        if self._sock is None:
            return
        self._outbox.append(encode(msg))
        if self._retry is None:  # else a retry is due: it sends this one in order
            self._flush()

    def _flush(self) -> None:
        self._retry = None
        while self._outbox and self._sock is not None:
            try:
                self._sock.send(self._outbox[0], zmq.NOBLOCK)
            except zmq.Again:
                self._retry = self._loop.call_later(RETRY_SEND_S, self._flush)
                break
            self._outbox.popleft()
        self._check_pending()

    def _check_pending(self) -> None:
        """After a send: messages that arrived meanwhile raise no new edge on the FD; look."""
        if self._sock is not None and not self._read_scheduled and _readable(self._sock):
            self._read_scheduled = True
            self._loop.call_soon(self._on_readable)

    def _on_readable(self) -> None:
        self._read_scheduled = False
        try:
            self._receive()
        except Exception as e:  # a bug: fail every request loudly rather than hang them
            log.exception("the frontend failed to process the core's messages")
            self._mark_dead(f"this frontend failed: {e!r}")

    def _receive(self) -> None:
        """Take what has arrived, up to a batch: a frontend behind the core applies several
        steps in one pass, wakes each consumer once and acknowledges them with one Ack."""
        frames: list[bytes] = []
        while len(frames) < MAX_MESSAGES_PER_WAKE and self._sock is not None:
            try:
                frames.append(self._sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
        news: list[StepOutputs | ControlReply] = []
        for msg in map(decode_to_frontend, frames):
            if not isinstance(msg, (Welcome, Reject)):
                news.append(msg)
            elif not self._welcome.done():
                self._welcome.set_result(msg)
        if news:
            self.on_messages(news)
        seqs = [msg.seq for msg in news if isinstance(msg, StepOutputs)]
        if seqs:
            self.send(Ack(seqs[-1]))
        if len(frames) == MAX_MESSAGES_PER_WAKE:  # more may wait: let the consumers run first
            self._read_scheduled = True
            self._loop.call_soon(self._on_readable)
        else:
            self._check_pending()


def _readable(sock: zmq.Socket) -> bool:
    events = sock.getsockopt(zmq.EVENTS)
    return isinstance(events, int) and bool(events & zmq.POLLIN)  # (EVENTS: an int option)


def _use_curve(sock: zmq.Socket, server_key: str, secret_key: str, heartbeat_timeout_s: float) -> zmq.Socket:
    """Set up `sock` for TCP with CURVE keys; returns its monitor of handshake events."""
    secret = secret_key.encode()
    sock.curve_serverkey = server_key.encode()
    sock.curve_secretkey = secret
    sock.curve_publickey = zmq.curve_public(secret)
    # The core's liveness: ZMTP heartbeats, answered by libzmq's I/O thread, so a long step or a
    # weight load is not silence; a stopped or unreachable core is, and its connection is closed
    # after the timeout (then EVENT_DISCONNECTED: CoreConnection._on_monitor).
    ms = int(heartbeat_timeout_s * 1000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(ms // 3, 1))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, ms)
    # A refused key shows only as a handshake event: watched until Welcome comes.
    return sock.get_monitor_socket(HANDSHAKE_EVENTS)


def _events(monitor: zmq.Socket | None) -> Iterator[_MonitorMessage]:
    """The connection's events that have come (over TCP; none without a monitor), oldest first."""
    from zmq.utils.monitor import recv_monitor_message

    while monitor is not None:
        try:
            yield recv_monitor_message(monitor, zmq.NOBLOCK)
        except zmq.Again:
            return
