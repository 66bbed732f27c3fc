"""CoreLoop: the core process's loop and its I/O: one ROUTER socket, a pidfd per frontend and one
for the owner.

ZMQ's ROUTER is the router: it knows each frontend by its socket identity, so each frontend is
sent only its own outputs. The core never blocks on a frontend: sends are non-blocking, and a
frontend whose process dies (its pidfd turns readable) has its requests aborted and KV freed.
The engine-wide controls are core/controls.py's; the attached frontends, their liveness and the
flow control of what they are sent, core/frontends.py's.
"""

from __future__ import annotations

import hmac
import logging
import os
import shutil
import signal
import time
from typing import TYPE_CHECKING

import msgspec
import zmq

from unison.core.controls import Controls
from unison.core.engine_core import EngineCore
from unison.core.frontends import Frontends, Peer
from unison.core.kv.publisher import Publisher
from unison.core.metrics import StepShapes
from unison.model.weights.loader import tokenizer_files
from unison.wire import registry
from unison.wire.messages import (
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Control,
    ControlReply,
    CoreArgs,
    CoreInfo,
    EngineInfo,
    Generate,
    Goodbye,
    Heartbeat,
    Hello,
    Reject,
    ReqOutput,
    ToCore,
    Welcome,
    decode_control_head,
    decode_to_core,
    encode,
)

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("unison.core")

IDLE_POLL_MS = 100
SHORT_POLL_MS = 2  # while a grammar compiles or a Hello is held: look again soon
STATS_INTERVAL = 10.0
HELLO_GRACE_S = 0.25
MAX_MESSAGES_PER_POLL = 4096  # a flood of messages can delay a step, never starve it


ZAP_DOMAIN = "unison"
# A frontend's key here: its socket's letter, then its routing id there (ids of two sockets may
# be equal, and a peer may choose its own).
IPC_PREFIX, TCP_PREFIX = b"i", b"t"


class CoreLoop:
    """The core's sockets and its loop: receive, act, step, send.

    It admits frontends (Hello: the registry's token over IPC, a trusted CURVE key over TCP, the
    protocol version, the tokenizer_worker_num cap), watches that they live (pidfds; heartbeats
    over TCP), hands requests to the EngineCore and controls to Controls, and sends each
    frontend its outputs without ever blocking on it. It exits when its owner does, on SIGTERM,
    and removes the registry and its runtime directory on the way out."""

    def __init__(self, args: CoreArgs, core: EngineCore) -> None:
        self.args = args
        self.config = args.config
        self.core = core
        self.step_shapes = core.on_step = StepShapes.from_env()
        self.cap = args.config.tokenizer_worker_num
        self.deferred_hellos: list[tuple[Peer, Hello, float]] = []  # at capacity, held briefly
        self.replies: dict[bytes, list[ReqOutput]] = {}  # per frontend, sent once a drain ends
        self.stopping = False
        self._stats_at, self._stats_gen = time.monotonic(), 0
        self.ctx = zmq.Context()
        self.sock = _router(self.ctx)
        self.sock.bind(args.endpoint)
        os.chmod(args.endpoint.removeprefix("ipc://"), 0o600)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.tcp, self.auth, self.tcp_address, self.server_key = None, None, None, None
        if args.config.listen:
            self.tcp, self.auth, self.server_key = _curve_router(
                self.ctx, args.config.listen, args.curve_secret_key, args.config.trusted_client_keys)
            self.tcp_address = self.tcp.getsockopt_string(zmq.LAST_ENDPOINT)
            self.poller.register(self.tcp, zmq.POLLIN)
            log.info("listening for remote frontends on %s", self.tcp_address)
        self.owner_pidfd = _pidfd(args.owner_pid)
        if self.owner_pidfd is not None:
            self.poller.register(self.owner_pidfd, zmq.POLLIN)
        self.frontends = Frontends(core, self.config, self.poller, self.owner_pidfd)
        self.controls = Controls(self)
        self.kv = None  # KV events and load reports (kv_events_config)
        if core.kv_events is not None:
            assert self.config.kv_events is not None  # the core logs events only when configured
            self.kv = Publisher(self.ctx, self.config.kv_events, self.config.data_parallel_rank,
                                core.kv_events)
            if self.kv.replay is not None:
                self.poller.register(self.kv.replay, zmq.POLLIN)
            log.info("KV events on %s", self.kv.info())

    def info(self) -> CoreInfo:
        return msgspec.structs.replace(self.core.report.info(), tcp_address=self.tcp_address,
                                       server_key=self.server_key,
                                       kv_events=self.kv.info() if self.kv is not None else None)

    # ---- lifecycle ---------------------------------------------------------------------------

    def publish(self) -> None:
        if self.args.registry_path:
            registry.publish(self.args.registry_path, EngineInfo(
                endpoint=self.args.endpoint, owner_pid=self.args.owner_pid, core_pid=os.getpid(),
                token=self.args.token, config=self.config, info=self.info(),
            ))

    def serve_forever(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        try:
            while not self.stopping:
                self.poll_once()
                self.core.grammar.poll()
                self.controls.poll()
                if self.core.has_work and not self.controls.paused:
                    self.frontends.send_outputs(self.core.step())
                    self.log_stats()
                if self.kv is not None:  # what the step or a control changed
                    self.kv.publish()
                    self.kv.report(self.core.report.load)
        finally:
            self.close()

    def log_stats(self) -> None:
        """One line every STATS_INTERVAL seconds while busy."""
        now = time.monotonic()
        if now - self._stats_at < STATS_INTERVAL:
            return
        report = self.core.report
        gen, used, total = report.stats().generation_tokens, report.kv_blocks_used, report.num_blocks
        log.info("running %d, waiting %d, KV %.0f%% (%d/%d blocks), %.1f gen tok/s",
                 report.num_running, report.num_waiting, 100 * used / total, used, total,
                 (gen - self._stats_gen) / (now - self._stats_at))
        self._stats_at, self._stats_gen = now, gen

    def close(self) -> None:
        self.core.close()
        registry.unlink(self.args.registry_path)
        shutil.rmtree(self.args.runtime_dir, ignore_errors=True)
        self.frontends.close()
        if self.kv is not None:
            self.kv.close()
        self.sock.close(linger=0)
        if self.tcp is not None:
            self.tcp.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()

    # ---- input -------------------------------------------------------------------------------

    def poll_once(self) -> None:
        busy = self.core.has_work and not self.controls.paused
        timeout = 0 if busy or self.frontends.pending else IDLE_POLL_MS
        if self.deferred_hellos:
            timeout = min(timeout, SHORT_POLL_MS)
        if self.core.grammar.compiling and not busy:
            timeout = SHORT_POLL_MS  # a grammar is compiling on its thread: look again soon
        for what, _ in self.poller.poll(timeout):
            if what is self.sock or (self.tcp is not None and what is self.tcp):
                self.drain(what)
            elif self.kv is not None and what is self.kv.replay:
                self.kv.serve_replay()
            elif what == self.owner_pidfd:
                log.warning("owner process %d exited; the core shuts down", self.args.owner_pid)
                self.stopping = True
            elif what in self.frontends.by_pidfd:
                self.frontends.drop(self.frontends.by_pidfd[what], "its process exited")
        if self.deferred_hellos:
            deferred, self.deferred_hellos = self.deferred_hellos, []
            for peer, msg, at in deferred:
                self.hello(peer, msg, at)
        self.frontends.flush()
        self.frontends.check_lag()
        if self.tcp is not None:
            self.frontends.drop_silent()

    def drain(self, sock: zmq.Socket) -> None:
        try:
            self._drain(sock)
        finally:
            self.send_replies()

    def send_replies(self) -> None:
        """What the messages of one drain earned (refusals, "queued", aborts): one StepOutputs per
        frontend, so a burst of requests does not look like a frontend falling behind."""
        replies, self.replies = self.replies, {}
        for ident, outs in replies.items():
            fe = self.frontends.get(ident)
            if fe is not None:
                self.frontends.send_step(fe, outs)

    def _drain(self, sock: zmq.Socket) -> None:
        remote = sock is self.tcp
        for _ in range(MAX_MESSAGES_PER_POLL):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                log.warning("dropped a message of %d frames", len(frames))
                continue
            peer = Peer((TCP_PREFIX if remote else IPC_PREFIX) + frames[0], sock, frames[0], remote)
            try:
                msg = decode_to_core(frames[1])
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                if not self.refuse_control(peer, frames[1], e):
                    log.warning("dropped an undecodable message: %s", e)
                continue
            self.handle(peer, msg)

    def refuse_control(self, peer: Peer, data: bytes, error: Exception) -> bool:
        """Answer a Control whose request cannot be read (an unknown op, a field of the wrong
        type) with the decoder's reason, which names the field, rather than leave its caller
        waiting for a timeout. False if `data` is no attached frontend's Control."""
        fe = self.frontends.get(peer.key)
        if fe is None:
            return False
        try:
            cid = decode_control_head(data).cid
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False
        self.frontends.send(fe, ControlReply(cid, error=f"the control could not be read: {error}"))
        return True

    def handle(self, peer: Peer, msg: ToCore) -> None:
        ident = peer.key
        fe = self.frontends.get(ident)
        if fe is not None and fe.remote:
            fe.last_heard = time.monotonic()
        if isinstance(msg, Heartbeat):
            pass
        elif isinstance(msg, Ack):
            if fe is not None:
                fe.ack(msg.seq)
        elif isinstance(msg, Hello):
            self.hello(peer, msg)
        elif fe is None:
            if not isinstance(msg, Goodbye):  # it may trail its process's exit, seen first
                log.warning("dropped %s from a frontend that has not said Hello",
                            type(msg).__name__)
        elif isinstance(msg, Generate):
            reply = self.core.add(ident, msg)  # a refusal, or "queued" when asked
            if reply is not None:
                self.replies.setdefault(ident, []).append(reply)
        elif isinstance(msg, Abort):
            out = self.core.abort(ident, msg.rid, msg.finished)
            if out is not None:
                self.replies.setdefault(ident, []).append(out)
        elif isinstance(msg, Control):
            answer = self.controls.handle(fe, msg)
            if answer is not None:  # else it comes once the control is done (a weight update)
                self.frontends.send(fe, answer)
        elif isinstance(msg, Goodbye):
            self.frontends.drop(fe, "it said goodbye")

    def hello(self, peer: Peer, msg: Hello, deferred_at: float | None = None) -> None:
        ident, reason = peer.key, None
        # Over TCP, CURVE and the ZAP authenticator have checked the frontend's key already.
        if not peer.remote and not hmac.compare_digest(msg.token.encode(), self.args.token.encode()):
            reason = "wrong token: the registry's token is required to attach"
        elif msg.version != PROTOCOL_VERSION:
            reason = f"protocol version mismatch: frontend {msg.version}, engine {PROTOCOL_VERSION}"
        elif self.frontends.get(ident) is not None:
            reason = "this frontend is attached already"
        elif len(self.frontends) >= self.cap:
            # A process that detaches and attaches again sends Goodbye and Hello on two sockets,
            # which the ROUTER may read in either order: hold a Hello at capacity for a moment.
            now = time.monotonic()
            if deferred_at is None or now - deferred_at < HELLO_GRACE_S:
                self.deferred_hellos.append((peer, msg, deferred_at or now))
                return
            reason = (f"engine {self.args.owner_pid} has {len(self.frontends)} of {self.cap} "
                      "frontends attached")
        files: dict[str, bytes] = {}
        if reason is None and msg.want_files:
            try:
                files = tokenizer_files(self.core.tokenizer_dir)
            except OSError as e:
                reason = f"the core could not read the tokenizer's files to send: {e}"
        if reason:
            log.warning("rejected a frontend (pid %d): %s", msg.pid, reason)
            self.send_raw(peer, encode(Reject(reason)))
            return
        if peer.remote:  # another host's pid means nothing here: heartbeats watch it
            pidfd = None
        else:
            pidfd = self.owner_pidfd if msg.pid == self.args.owner_pid else _pidfd(msg.pid)
        fe = self.frontends.attach(peer, msg.pid, pidfd)
        self.frontends.send(fe, Welcome(
            fe.worker_id, self.info(), self.config, os.getpid(),
            heartbeat_s=self.config.heartbeat_timeout_s / 3 if fe.remote else 0.0, files=files))

    def send_raw(self, peer: Peer, payload: bytes) -> None:
        try:
            peer.sock.send_multipart([peer.route, payload], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # a rejected frontend that is gone already


class _TrustedKeys:
    """The ZAP authenticator's CURVE check: is this client's public key one we trust?"""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys = {k.encode() for k in keys}

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.keys
        if not ok:
            log.warning("refused a remote frontend: its CURVE key %s is not trusted", key.decode())
        return ok


def _router(ctx: zmq.Context) -> zmq.Socket:
    """A ROUTER that never blocks the core: a route that is gone is an error (EHOSTUNREACH),
    not a silent drop, and nothing lingers at close."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def _curve_router(ctx: zmq.Context, address: str, secret_key: str | None,
                  trusted_keys: tuple[str, ...]) -> tuple[zmq.Socket, ThreadAuthenticator, str]:
    """A second ROUTER, on TCP, CURVE-encrypted (CURVE is set per socket: IPC stays as it
    is), its authenticator and its public key. The ZAP authenticator admits only the trusted
    client keys: without it CURVE takes any client that knows the server's public key."""
    from zmq.auth.thread import ThreadAuthenticator

    if not zmq.has("curve") or not secret_key:
        raise ValueError("listen needs libzmq with CURVE (zmq.has('curve')) and a server key")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, _TrustedKeys(trusted_keys))
    tcp = _router(ctx)
    tcp.curve_server = True
    tcp.curve_secretkey = secret_key.encode()
    tcp.zap_domain = ZAP_DOMAIN.encode()
    tcp.bind(address)
    return tcp, auth, zmq.curve_public(secret_key.encode()).decode()


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (ProcessLookupError, AttributeError, OSError, ValueError, OverflowError):
        return None
