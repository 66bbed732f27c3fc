"""CoreServer: the core process's I/O. One ROUTER socket, a pidfd per frontend and one for the owner.

ZMQ's ROUTER is the router: it knows each frontend by its socket identity, so each frontend is
sent only its own outputs. The core never blocks on a frontend: sends are non-blocking, and a
frontend whose process dies (its pidfd turns readable) has its requests aborted and KV freed.
"""

from __future__ import annotations

import hmac
import logging
import os
import shutil
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import UnionType
from typing import Any

import msgspec
import zmq

from unison import registry
from unison.core.engine_core import EngineCore
from unison.core.metrics import StepShapes
from unison.core.request import Request
from unison.model.loader import tokenizer_files
from unison.model.weights import TENSOR_FILE_DIRS, TENSOR_FILE_PREFIX
from unison.protocol import (
    PROTOCOL_VERSION,
    Abort,
    AbortRequests,
    Ack,
    Control,
    ControlOp,
    ControlReply,
    CoreArgs,
    CoreInfo,
    EngineInfo,
    FrontendInfo,
    Generate,
    Goodbye,
    Heartbeat,
    Hello,
    OpResult,
    Pause,
    PauseMode,
    Reject,
    ReqOutput,
    ServerInfo,
    StepOutputs,
    UpdateTensors,
    UpdateWeights,
    Welcome,
    decode_to_core,
    encode,
)

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


@dataclass(frozen=True, slots=True)
class Peer:
    """Who sent a message: its key in `frontends`, and how to answer it."""

    key: bytes
    sock: zmq.Socket
    route: bytes
    remote: bool


@dataclass
class PendingUpdate:
    """A weight update waiting for the requests that were in flight when it came to finish."""

    frontend: bytes
    cid: int
    arg: UpdateWeights | UpdateTensors
    waits_for: set[Request]  # the requests themselves: a rid may come back, held, meanwhile


@dataclass
class Frontend:
    ident: bytes  # its key here: IPC_PREFIX or TCP_PREFIX, then `route`
    worker_id: int
    pid: int
    pidfd: int | None
    sock: zmq.Socket  # the ROUTER it came through
    route: bytes  # its routing id on that socket
    remote: bool = False  # over TCP: watched by heartbeats, not a pidfd
    last_heard: float = 0.0  # remote: when its last message came
    outbox: deque[bytes] = field(default_factory=deque)
    seq: int = 0  # StepOutputs sent so far
    unacked: deque[tuple[int, float]] = field(default_factory=deque)  # (seq, sent at), oldest first


class CoreServer:
    def __init__(self, args: CoreArgs, core: EngineCore) -> None:
        self.args = args
        self.config = args.config
        self.core = core
        self.step_shapes = core.on_step = StepShapes.from_env()
        self.cap = args.config.tokenizer_worker_num
        self.frontends: dict[bytes, Frontend] = {}
        self.by_pidfd: dict[int, Frontend] = {}
        self.worker_ids: dict[bytes, int] = {}  # kept after detach while admission records name them
        self.next_worker_id = 0
        self.paused: PauseMode | None = None
        self.update: PendingUpdate | None = None
        self.weights_version = 0  # successful weight updates
        self.deferred_hellos: list[tuple[Peer, Hello, float]] = []  # at capacity, held briefly
        self.replies: dict[bytes, list[ReqOutput]] = {}  # per frontend, sent once a drain ends
        self.stopping = False
        self._stats_at, self._stats_gen = time.monotonic(), 0
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(args.endpoint)
        os.chmod(args.endpoint.removeprefix("ipc://"), 0o600)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.tcp, self.auth, self.tcp_address, self.server_key = None, None, None, None
        if args.config.listen:
            self._listen(args.config.listen, args.curve_secret_key)
        self._beat_at = time.monotonic()
        self.owner_pidfd = _pidfd(args.owner_pid)
        if self.owner_pidfd is not None:
            self.poller.register(self.owner_pidfd, zmq.POLLIN)

    def _listen(self, address: str, secret_key: str | None) -> None:
        """A second ROUTER, on TCP, CURVE-encrypted (CURVE is set per socket: IPC stays as it
        is). The ZAP authenticator admits only the trusted client keys: without it CURVE takes
        any client that knows the server's public key."""
        from zmq.auth.thread import ThreadAuthenticator

        if not zmq.has("curve") or not secret_key:
            raise ValueError("listen needs libzmq with CURVE (zmq.has('curve')) and a server key")
        self.auth = ThreadAuthenticator(self.ctx)
        self.auth.start()
        self.auth.configure_curve_callback(ZAP_DOMAIN, _TrustedKeys(self.config.trusted_client_keys))
        tcp = self.tcp = self.ctx.socket(zmq.ROUTER)
        tcp.setsockopt(zmq.ROUTER_MANDATORY, 1)
        tcp.setsockopt(zmq.LINGER, 0)
        tcp.curve_server = True
        tcp.curve_secretkey = secret_key.encode()
        tcp.zap_domain = ZAP_DOMAIN.encode()
        tcp.bind(address)
        self.tcp_address = tcp.getsockopt_string(zmq.LAST_ENDPOINT)
        self.server_key = zmq.curve_public(secret_key.encode()).decode()
        self.poller.register(tcp, zmq.POLLIN)
        log.info("listening for remote frontends on %s", self.tcp_address)

    def info(self) -> CoreInfo:
        return msgspec.structs.replace(self.core.info(), tcp_address=self.tcp_address,
                                       server_key=self.server_key)

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
                self.core.poll_grammars()
                if self.update_may_run():
                    self.finish_update()
                if self.core.has_work and not self.paused:
                    self.send_outputs(self.core.step())
                    self.log_stats()
        finally:
            self.close()

    def log_stats(self) -> None:
        """One line every STATS_INTERVAL seconds while busy."""
        now = time.monotonic()
        if now - self._stats_at < STATS_INTERVAL:
            return
        core = self.core
        gen, used, total = core.stats().generation_tokens, core.kv_blocks_used, core.num_blocks
        log.info("running %d, waiting %d, KV %.0f%% (%d/%d blocks), %.1f gen tok/s",
                 core.num_running, core.num_waiting, 100 * used / total, used, total,
                 (gen - self._stats_gen) / (now - self._stats_at))
        self._stats_at, self._stats_gen = now, gen

    def close(self) -> None:
        self.core.close()
        registry.unlink(self.args.registry_path)
        shutil.rmtree(self.args.runtime_dir, ignore_errors=True)
        for fe in list(self.frontends.values()):
            if fe.pidfd is not None and fe.pidfd != self.owner_pidfd:
                os.close(fe.pidfd)
        self.sock.close(linger=0)
        if self.tcp is not None:
            self.tcp.close(linger=0)
            self.auth.stop()
        self.ctx.term()

    # ---- input -------------------------------------------------------------------------------

    def poll_once(self) -> None:
        busy = self.core.has_work and not self.paused
        timeout = 0 if busy or any(fe.outbox for fe in self.frontends.values()) else IDLE_POLL_MS
        if self.deferred_hellos:
            timeout = min(timeout, SHORT_POLL_MS)
        if self.core.compiling and not busy:
            timeout = SHORT_POLL_MS  # a grammar is compiling on its thread: look again soon
        for what, _ in self.poller.poll(timeout):
            if what is self.sock or what is self.tcp:
                self.drain(what)
            elif what == self.owner_pidfd:
                log.warning("owner process %d exited; the core shuts down", self.args.owner_pid)
                self.stopping = True
            elif what in self.by_pidfd:
                self.drop_frontend(self.by_pidfd[what], "its process exited")
        if self.deferred_hellos:
            deferred, self.deferred_hellos = self.deferred_hellos, []
            for peer, msg, at in deferred:
                self.hello(peer, msg, at)
        self.flush_outboxes()
        self.abort_lagging()
        if self.tcp is not None:
            self.heartbeat()

    def heartbeat(self) -> None:
        """Over TCP: a remote frontend sends a Heartbeat every third of the timeout; one silent
        for the whole timeout (dead, stopped, cut off) is dropped, its requests aborted. (Its
        view of the core is libzmq's heartbeats: see TokenizerWorker.connect.)"""
        now, timeout = time.monotonic(), self.config.heartbeat_timeout_s
        if now - self._beat_at < timeout / 3:
            return
        self._beat_at = now
        for fe in [f for f in self.frontends.values() if f.remote and now - f.last_heard > timeout]:
            self.drop_frontend(fe, f"it sent nothing for {now - fe.last_heard:.1f} s "
                                   f"(heartbeat_timeout_s={timeout})")

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
                self.send_step(fe, outs)

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
            try:
                msg = decode_to_core(frames[1])
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                log.warning("dropped an undecodable message: %s", e)
                continue
            prefix = TCP_PREFIX if remote else IPC_PREFIX
            self.handle(Peer(prefix + frames[0], sock, frames[0], remote), msg)

    def handle(self, peer: Peer, msg: Any) -> None:
        ident = peer.key
        fe = self.frontends.get(ident)
        if fe is not None and fe.remote:
            fe.last_heard = time.monotonic()
        if isinstance(msg, Heartbeat):
            pass
        elif isinstance(msg, Ack):
            if fe is not None:
                while fe.unacked and fe.unacked[0][0] <= msg.seq:
                    fe.unacked.popleft()
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
            reply = self.control(ident, msg)
            if reply is not None:  # else it comes once the control is done (a weight update)
                self.send(fe, reply)
        elif isinstance(msg, Goodbye):
            self.drop_frontend(fe, "it said goodbye")

    def hello(self, peer: Peer, msg: Hello, deferred_at: float | None = None) -> None:
        ident, reason = peer.key, None
        # Over TCP, CURVE and the ZAP authenticator have checked the frontend's key already.
        if not peer.remote and not hmac.compare_digest(msg.token.encode(), self.args.token.encode()):
            reason = "wrong token: the registry's token is required to attach"
        elif msg.version != PROTOCOL_VERSION:
            reason = f"protocol version mismatch: frontend {msg.version}, engine {PROTOCOL_VERSION}"
        elif ident in self.frontends:
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
                files = tokenizer_files(self.core.model_dir)
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
        fe = Frontend(ident, self.next_worker_id, msg.pid, pidfd, peer.sock, peer.route, peer.remote,
                      time.monotonic())
        self.next_worker_id += 1
        self.frontends[ident] = fe
        self.worker_ids[ident] = fe.worker_id
        if pidfd is not None and pidfd != self.owner_pidfd:
            self.by_pidfd[pidfd] = fe
            self.poller.register(pidfd, zmq.POLLIN)
        log.info("frontend %d attached (pid %d%s)", fe.worker_id, fe.pid, ", over TCP" if fe.remote else "")
        self.send(fe, Welcome(
            fe.worker_id, self.info(), self.config, os.getpid(),
            heartbeat_s=self.config.heartbeat_timeout_s / 3 if fe.remote else 0.0, files=files))

    def drop_frontend(self, fe: Frontend, why: str) -> None:
        aborted = len(self.core.abort_frontend(fe.ident))
        self.frontends.pop(fe.ident, None)
        named = {f for f, _ in self.core.admissions()} | self.frontends.keys()
        self.worker_ids = {f: w for f, w in self.worker_ids.items() if f in named}  # bounded
        if fe.pidfd is not None and fe.pidfd != self.owner_pidfd:
            self.by_pidfd.pop(fe.pidfd, None)
            self.poller.unregister(fe.pidfd)
            os.close(fe.pidfd)
        log.info("frontend %d (pid %d) detached: %s; aborted %d request(s)",
                 fe.worker_id, fe.pid, why, aborted)

    def control(self, ident: bytes, msg: Control) -> ControlReply | None:
        try:
            if msg.op is ControlOp.UPDATE_WEIGHTS:
                return self.start_update(ident, msg)
            return ControlReply(msg.cid, result=self.control_op(msg.op, msg.arg))
        except Exception as e:  # a bad control op must not take the core down
            return ControlReply(msg.cid, error=f"{type(e).__name__}: {e}")

    def control_op(self, op: ControlOp, arg: Any) -> Any:
        if op is ControlOp.SERVER_INFO:
            return self.server_info()
        if op is ControlOp.CHECK_INTEGRITY:
            self.core.check_integrity()
            return True
        if op is ControlOp.FLUSH_CACHE:
            try:
                self.core.flush_cache()
            except RuntimeError as e:
                return OpResult(False, str(e))
            return OpResult(True, "the prefix cache is empty")
        if op is ControlOp.PAUSE:
            return self.pause(_arg(arg, Pause, op).mode)
        if op is ControlOp.CONTINUE:
            self.paused = None
            return OpResult(True, "generation continues")
        if op is ControlOp.ABORT_REQUESTS:
            return self.abort_requests(_arg(arg, AbortRequests, op))
        if op is ControlOp.STEP_SHAPES:
            if self.step_shapes is None:
                raise ValueError("step shapes are recorded only when the core starts with "
                                 "UNISON_RECORD_STEP_SHAPES=1 in its environment")
            return self.step_shapes.rows()
        raise ValueError(f"unknown control op {op!r}")

    # ---- engine-wide controls: pause, abort, weight updates -------------------------------------

    def pause(self, mode: PauseMode) -> OpResult:
        """Stop stepping. Requests that arrive meanwhile queue (held, not refused)."""
        affected = len(self.core.requests)
        if mode is PauseMode.ABORT:
            self.abort_all("aborted: generation was paused (mode='abort')")
        elif mode is PauseMode.RETRACT:
            self.core.retract_all()
        self.paused = mode
        return OpResult(True, f"generation paused (mode={mode.value!r}, {affected} request(s) in "
                              "flight)", num_paused_requests=len(self.core.requests))

    def abort_all(self, message: str) -> None:
        self.send_outputs(self.core.abort_where(lambda r: True, message))

    def abort_requests(self, arg: AbortRequests) -> OpResult:
        """Abort by id (with its n samples), or all; unlike a frontend's Abort, it reaches the
        requests of every frontend: it is the operator's control, not a client's."""
        if not arg.abort_all and not arg.rid:
            raise ValueError("abort_requests needs a rid or abort_all=True")
        before = len(self.core.requests)
        if arg.abort_all:
            self.abort_all("aborted: abort_all")
        else:
            child = arg.rid + "-"
            self.send_outputs(self.core.abort_where(
                lambda r: r.rid == arg.rid or (r.rid.startswith(child) and r.rid[len(child):].isdigit()),
                f"aborted: abort_request(rid={arg.rid!r})"))
        return OpResult(True, f"aborted {before - len(self.core.requests)} request(s)")

    def start_update(self, ident: bytes, msg: Control) -> ControlReply | None:
        """Load new weights now when nothing runs (or generation is paused), else once the
        requests in flight have finished; new requests wait meanwhile (SGLang's order)."""
        arg = _arg(msg.arg, UpdateWeights | UpdateTensors, msg.op)
        refused = self.refuse_update(ident, arg)
        if refused:
            return ControlReply(msg.cid, result=OpResult(False, refused))
        if isinstance(arg, UpdateWeights) and arg.abort_all_requests:
            self.abort_all("aborted: the weights are being updated (abort_all_requests=True)")
        waits_for = set() if self.paused else set(self.core.requests.values())
        self.update = PendingUpdate(ident, msg.cid, arg, waits_for)
        self.core.hold_new(True)
        if waits_for:
            log.info("weight update (%s) waits for %d request(s) in flight", _source(arg), len(waits_for))
        else:
            self.finish_update()
        return None  # finish_update answers

    def refuse_update(self, ident: bytes, arg: UpdateWeights | UpdateTensors) -> str:
        """Why this update cannot be taken ("" if it can)."""
        if self.update is not None:
            return "another weight update is in progress"
        if isinstance(arg, UpdateTensors) and self.frontends[ident].remote:
            return ("update_weights_from_tensor works on the core's host only (the tensors come as "
                    "a file there); over TCP, save a checkpoint the core can read and use "
                    "update_weights_from_disk")
        if isinstance(arg, UpdateWeights) and arg.load_format not in (None, "auto", "safetensors", "gguf"):
            return (f"load_format={arg.load_format!r} is not supported: weights load from a "
                    "safetensors directory or a GGUF file")
        return ""

    def update_may_run(self) -> bool:
        """A pending weight update runs once what it waited for has finished, or on a pause."""
        upd = self.update
        return upd is not None and (self.paused is not None or not any(
            self.core.requests.get(r.rid) is r for r in upd.waits_for))

    def finish_update(self) -> None:
        upd, self.update = self.update, None
        held = len(self.core.requests)  # queued meanwhile, or paused: they run on the new weights
        started = time.monotonic()
        try:
            if isinstance(upd.arg, UpdateTensors):
                count = self.core.update_tensors(upd.arg.path, upd.arg.flush_cache)
                done = f"{count} tensor(s) updated"
            else:
                self.core.load_weights(upd.arg.model_path)
                done = f"weights updated from {upd.arg.model_path}"
        except Exception as e:  # refused, or failed to load: the old weights keep serving
            result = OpResult(False, f"the weights were not updated: {type(e).__name__}: {e}",
                              num_paused_requests=held)
            log.warning("weight update (%s) refused: %s", _source(upd.arg), e)
        else:
            result = OpResult(True, f"{done} in {time.monotonic() - started:.1f} s",
                              num_paused_requests=held)
            log.info("%s", result.message)
            self.weights_version += 1
            try:
                self.publish()  # a frontend attaching later sees the model path now served
            except OSError as e:
                log.warning("could not republish the registry: %s", e)
        finally:
            self.core.hold_new(False)
            if isinstance(upd.arg, UpdateTensors):
                _remove_tensor_file(upd.arg.path)
        fe = self.frontends.get(upd.frontend)
        if fe is not None:
            self.send(fe, ControlReply(upd.cid, result=result))

    def server_info(self) -> ServerInfo:
        core, inflight = self.core, self.core.requests_per_frontend()
        return ServerInfo(
            version=PROTOCOL_VERSION, core_pid=os.getpid(), owner_pid=self.args.owner_pid,
            config=self.config, core=self.info(), paused=self.paused is not None,
            pause_mode=self.paused.value if self.paused else None, weights_version=self.weights_version,
            num_running=core.num_running,
            num_waiting=core.num_waiting, kv_blocks_used=core.kv_blocks_used,
            kv_blocks_cached=core.cached_blocks, num_evicted_blocks=core.num_evicted_blocks,
            stats=core.stats(), histograms=core.latency.data(),
            admissions=[(self.worker_ids.get(f, -1), rid) for f, rid in core.admissions()],
            frontends=[FrontendInfo(fe.pid, fe.worker_id, inflight[fe.ident], fe.remote)
                       for fe in self.frontends.values()],
        )

    # ---- output ------------------------------------------------------------------------------

    def send_outputs(self, outputs: dict[bytes, list[ReqOutput]]) -> None:
        for ident, outs in outputs.items():
            fe = self.frontends.get(ident)
            if fe is not None and outs:
                self.send_step(fe, outs)

    def send_step(self, fe: Frontend, outs: list[ReqOutput]) -> None:
        fe.seq += 1
        fe.unacked.append((fe.seq, time.monotonic()))
        self.send(fe, StepOutputs(outs, fe.seq))

    def abort_lagging(self) -> None:
        """Abort the requests of a frontend that stopped processing its outputs (stopped, wedged
        or swamped), so that it cannot hold KV blocks and batch slots indefinitely."""
        cfg, now = self.config, time.monotonic()
        busy = self.core.requests_per_frontend()
        for fe in self.frontends.values():
            if fe.ident not in busy or not fe.unacked:
                continue
            lag, count = now - fe.unacked[0][1], len(fe.unacked)
            if lag <= cfg.frontend_max_lag_s and count <= cfg.frontend_max_unacked:
                continue
            why = (f"frontend {fe.worker_id} (pid {fe.pid}) fell behind: {count} outputs unprocessed "
                   f"for {lag:.1f} s (frontend_max_unacked={cfg.frontend_max_unacked}, "
                   f"frontend_max_lag_s={cfg.frontend_max_lag_s})")
            rids = self.core.abort_frontend(fe.ident)
            log.warning("%s; aborted its %d request(s)", why, len(rids))
            fe.unacked.clear()
            self.send_step(fe, [ReqOutput(rid, finish="abort", error=why, refused=False) for rid in rids])

    def send(self, fe: Frontend, msg: Any) -> None:
        fe.outbox.append(encode(msg))
        self.flush(fe)

    def flush_outboxes(self) -> None:
        for fe in list(self.frontends.values()):
            if fe.outbox:
                self.flush(fe)

    def flush(self, fe: Frontend) -> None:
        while fe.outbox:
            try:
                fe.sock.send_multipart([fe.route, fe.outbox[0]], zmq.NOBLOCK)
            except zmq.Again:
                return  # its queue is full: retry after the next step
            except zmq.ZMQError as e:
                if e.errno == zmq.EHOSTUNREACH:
                    self.drop_frontend(fe, "its socket is gone")
                    return
                raise
            fe.outbox.popleft()

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


def _arg(arg: Any, kind: type | UnionType, op: ControlOp) -> Any:
    if not isinstance(arg, kind):
        raise ValueError(f"{op.value} needs a {getattr(kind, '__name__', kind)} argument, "
                         f"got {type(arg).__name__}")
    return arg


def _source(arg: UpdateWeights | UpdateTensors) -> str:
    return f"from {arg.model_path}" if isinstance(arg, UpdateWeights) else "from tensors"


def _remove_tensor_file(path: str) -> None:
    """A tensors file is spent once read. Its writer removes it when the call returns; this is
    for a writer that died waiting (only ever save_tensors' own files)."""
    file = Path(path)
    if file.parent in TENSOR_FILE_DIRS and file.name.startswith(TENSOR_FILE_PREFIX):
        file.unlink(missing_ok=True)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (ProcessLookupError, AttributeError, OSError, ValueError, OverflowError):
        return None
