"""CoreServer: the core process's I/O. One ROUTER socket, a pidfd per frontend and one for the owner.

ZMQ's ROUTER is the router: it knows each frontend by its socket identity, so each frontend is
sent only its own outputs. The core never blocks on a frontend: sends are non-blocking, and a
frontend whose process dies (its pidfd turns readable) has its requests aborted and KV freed.
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import shutil
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from unison import registry
from unison.core.engine_core import EngineCore
from unison.core.metrics import LatencyMetrics
from unison.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Control,
    ControlReply,
    CoreArgs,
    EngineInfo,
    Generate,
    Goodbye,
    Hello,
    Reject,
    ReqOutput,
    RequestStats,
    StepOutputs,
    Welcome,
    decode_to_core,
    encode,
)

log = logging.getLogger("unison.core")

IDLE_POLL_MS = 100
GRAMMAR_POLL_MS = 2
STATS_INTERVAL = 10.0
MAX_MESSAGES_PER_POLL = 4096  # a flood of messages can delay a step, never starve it


@dataclass
class Frontend:
    ident: bytes
    worker_id: int
    pid: int
    pidfd: int | None
    outbox: deque[bytes] = field(default_factory=deque)
    seq: int = 0  # StepOutputs sent so far
    unacked: deque[tuple[int, float]] = field(default_factory=deque)  # (seq, sent at), oldest first


class CoreServer:
    def __init__(self, args: CoreArgs, core: EngineCore) -> None:
        self.args = args
        self.core = core
        self.cap = args.config["tokenizer_worker_num"]
        self.frontends: dict[bytes, Frontend] = {}
        self.by_pidfd: dict[int, Frontend] = {}
        self.worker_ids: dict[bytes, int] = {}  # kept after detach while admission records name them
        self.next_worker_id = 0
        self.paused = False
        self.stopping = False
        self.latency = LatencyMetrics()
        self._stats_at, self._stats_gen = time.monotonic(), 0
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(args.endpoint)
        os.chmod(args.endpoint.removeprefix("ipc://"), 0o600)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.owner_pidfd = _pidfd(args.owner_pid)
        if self.owner_pidfd is not None:
            self.poller.register(self.owner_pidfd, zmq.POLLIN)

    # ---- lifecycle ---------------------------------------------------------------------------

    def publish(self) -> None:
        if self.args.registry_path:
            registry.publish(self.args.registry_path, EngineInfo(
                endpoint=self.args.endpoint, owner_pid=self.args.owner_pid, core_pid=os.getpid(),
                token=self.args.token, model_dir=self.args.model_dir, config=self.args.config,
                info=self.core.info(),
            ))

    def serve_forever(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        try:
            while not self.stopping:
                self.poll_once()
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
        gen = self.core.stats["generation_tokens"]
        sched, pool = self.core.scheduler, self.core.pool
        log.info("running %d, waiting %d, KV %.0f%% (%d/%d blocks), %.1f gen tok/s",
                 len(sched.running), len(sched.waiting), 100 * pool.num_used / pool.num_blocks,
                 pool.num_used, pool.num_blocks, (gen - self._stats_gen) / (now - self._stats_at))
        self._stats_at, self._stats_gen = now, gen

    def close(self) -> None:
        if self.core.grammars is not None:
            self.core.grammars.close()
        registry.unlink(self.args.registry_path)
        shutil.rmtree(self.args.runtime_dir, ignore_errors=True)
        for fe in list(self.frontends.values()):
            if fe.pidfd is not None and fe.pidfd != self.owner_pidfd:
                os.close(fe.pidfd)
        self.sock.close(linger=0)
        self.ctx.term()

    # ---- input -------------------------------------------------------------------------------

    def poll_once(self) -> None:
        busy = self.core.has_work and not self.paused
        timeout = 0 if busy or any(fe.outbox for fe in self.frontends.values()) else IDLE_POLL_MS
        if self.core.compiling and not busy:
            timeout = GRAMMAR_POLL_MS  # a grammar is compiling on its thread: look again soon
        for what, _ in self.poller.poll(timeout):
            if what is self.sock:
                self.drain()
            elif what == self.owner_pidfd:
                log.warning("owner process %d exited; the core shuts down", self.args.owner_pid)
                self.stopping = True
            elif what in self.by_pidfd:
                self.drop_frontend(self.by_pidfd[what], "its process exited")
        self.flush_outboxes()
        self.abort_lagging()

    def drain(self) -> None:
        for _ in range(MAX_MESSAGES_PER_POLL):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
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
            self.handle(frames[0], msg)

    def handle(self, ident: bytes, msg: Any) -> None:
        fe = self.frontends.get(ident)
        if isinstance(msg, Ack):
            if fe is not None:
                while fe.unacked and fe.unacked[0][0] <= msg.seq:
                    fe.unacked.popleft()
        elif isinstance(msg, Hello):
            self.hello(ident, msg)
        elif fe is None:
            if not isinstance(msg, Goodbye):  # it may trail its process's exit, seen first
                log.warning("dropped %s from a frontend that has not said Hello",
                            type(msg).__name__)
        elif isinstance(msg, Generate):
            refusal = self.core.add(ident, msg)
            if refusal is not None:
                self.send_step(fe, [refusal])
        elif isinstance(msg, Abort):
            out = self.core.abort(ident, msg.rid)
            if out is not None:
                self.send_step(fe, [out])
        elif isinstance(msg, Control):
            self.send(fe, self.control(msg))
        elif isinstance(msg, RequestStats):
            if all(math.isfinite(x) and x >= 0 for x in (msg.ttft, msg.e2e, msg.tpot or 0.0)):
                self.latency.observe(msg.ttft, msg.tpot, msg.e2e)
        elif isinstance(msg, Goodbye):
            self.drop_frontend(fe, "it said goodbye")

    def hello(self, ident: bytes, msg: Hello) -> None:
        reason = None
        if not hmac.compare_digest(msg.token.encode(), self.args.token.encode()):
            reason = "wrong token: the registry's token is required to attach"
        elif msg.version != PROTOCOL_VERSION:
            reason = f"protocol version mismatch: frontend {msg.version}, engine {PROTOCOL_VERSION}"
        elif ident in self.frontends:
            reason = "this frontend is attached already"
        elif len(self.frontends) >= self.cap:
            reason = (f"engine {self.args.owner_pid} has {len(self.frontends)} of {self.cap} "
                      "frontends attached")
        if reason:
            log.warning("rejected a frontend (pid %d): %s", msg.pid, reason)
            self.send_raw(ident, encode(Reject(reason)))
            return
        pidfd = self.owner_pidfd if msg.pid == self.args.owner_pid else _pidfd(msg.pid)
        fe = Frontend(ident, self.next_worker_id, msg.pid, pidfd)
        self.next_worker_id += 1
        self.frontends[ident] = fe
        self.worker_ids[ident] = fe.worker_id
        if pidfd is not None and pidfd != self.owner_pidfd:
            self.by_pidfd[pidfd] = fe
            self.poller.register(pidfd, zmq.POLLIN)
        log.info("frontend %d attached (pid %d)", fe.worker_id, fe.pid)
        self.send(fe, Welcome(fe.worker_id, self.core.info()))

    def drop_frontend(self, fe: Frontend, why: str) -> None:
        aborted = len(self.core.abort_frontend(fe.ident))
        self.frontends.pop(fe.ident, None)
        named = {f for f, _ in self.core.scheduler.admissions} | self.frontends.keys()
        self.worker_ids = {f: w for f, w in self.worker_ids.items() if f in named}  # bounded
        if fe.pidfd is not None and fe.pidfd != self.owner_pidfd:
            self.by_pidfd.pop(fe.pidfd, None)
            self.poller.unregister(fe.pidfd)
            os.close(fe.pidfd)
        log.info("frontend %d (pid %d) detached: %s; aborted %d request(s)",
                 fe.worker_id, fe.pid, why, aborted)

    def control(self, msg: Control) -> ControlReply:
        try:
            return ControlReply(msg.cid, result=self.control_op(msg.op))
        except Exception as e:  # a bad control op must not take the core down
            return ControlReply(msg.cid, error=f"{type(e).__name__}: {e}")

    def control_op(self, op: str) -> Any:
        if op == "server_info":
            return self.server_info()
        if op == "check_integrity":
            self.core.check_integrity()
            return True
        if op == "flush_cache":
            self.core.scheduler.flush_cache()
            return True
        if op in ("pause", "continue"):
            self.paused = op == "pause"
            return self.paused
        raise ValueError(f"unknown control op {op!r}")

    def server_info(self) -> dict[str, Any]:
        inflight: dict[bytes, int] = {}
        for req in self.core.requests.values():
            inflight[req.frontend] = inflight.get(req.frontend, 0) + 1
        sched = self.core.scheduler
        return {
            "version": PROTOCOL_VERSION,
            "core_pid": os.getpid(),
            "owner_pid": self.args.owner_pid,
            "config": self.args.config,
            **self.core.info(),
            "paused": self.paused,
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "kv_blocks_used": self.core.pool.num_used - self.core.cached_blocks,
            "kv_blocks_cached": self.core.cached_blocks,
            "num_preemptions": sched.num_preemptions,
            "num_evicted_blocks": sched.cache.num_evicted if sched.cache else 0,
            "stats": dict(self.core.stats),
            "histograms": self.latency.to_dict(),
            "admissions": [[self.worker_ids.get(f, -1), rid] for f, rid in sched.admissions],
            "frontends": [
                {"pid": fe.pid, "worker_id": fe.worker_id, "requests_in_flight": inflight.get(fe.ident, 0)}
                for fe in self.frontends.values()
            ],
        }

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
        cfg, now = self.args.config, time.monotonic()
        busy = {req.frontend for req in self.core.requests.values()}
        for fe in self.frontends.values():
            if fe.ident not in busy or not fe.unacked:
                continue
            lag, count = now - fe.unacked[0][1], len(fe.unacked)
            if lag <= cfg["frontend_max_lag_s"] and count <= cfg["frontend_max_unacked"]:
                continue
            why = (f"frontend {fe.worker_id} (pid {fe.pid}) fell behind: {count} outputs unprocessed "
                   f"for {lag:.1f} s (frontend_max_unacked={cfg['frontend_max_unacked']}, "
                   f"frontend_max_lag_s={cfg['frontend_max_lag_s']})")
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
                self.sock.send_multipart([fe.ident, fe.outbox[0]], zmq.NOBLOCK)
            except zmq.Again:
                return  # its queue is full: retry after the next step
            except zmq.ZMQError as e:
                if e.errno == zmq.EHOSTUNREACH:
                    self.drop_frontend(fe, "its socket is gone")
                    return
                raise
            fe.outbox.popleft()

    def send_raw(self, ident: bytes, payload: bytes) -> None:
        try:
            self.sock.send_multipart([ident, payload], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # a rejected frontend that is gone already


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (ProcessLookupError, AttributeError, OSError, ValueError, OverflowError):
        return None
