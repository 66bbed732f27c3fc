"""The attached frontends as the core sees them: who they are, whether they live, and the flow
control of what they are sent.

The core never blocks on a frontend: what its socket will not take now waits, in order, in its
outbox. Each StepOutputs is numbered and the frontend acknowledges (Ack) what it has processed,
so the core can see a frontend fall behind. Being behind is not a fault (a busy host deschedules
a healthy process for seconds): the frontend's requests are parked until it catches up (not
stepped, so nothing piles up; preempted first when KV runs short), and only a frontend silent for
`frontend_max_silence_s` has them ended, each with an error naming the cause.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import zmq

from unison.config import EngineConfig
from unison.core.engine_core import EngineCore
from unison.wire.messages import ReqOutput, StepOutputs, ToFrontend, encode

log = logging.getLogger("unison.core")


@dataclass(frozen=True, slots=True)
class Peer:
    """Who sent a message: its key in Frontends, and how to answer it."""

    key: bytes  # its socket's letter, then `route` (ids of two sockets may be equal)
    sock: zmq.Socket
    route: bytes
    remote: bool


@dataclass
class Frontend:
    """An attached frontend: how to reach it, and what it has not taken or acknowledged yet.

    `send` and `send_step` never block; they return False once the frontend's socket is gone.
    `lagging` says why it counts as fallen behind, or None."""

    ident: bytes  # its key here: as Peer.key
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

    def send(self, msg: ToFrontend) -> bool:
        self.outbox.append(encode(msg))
        return self.flush()

    def send_step(self, outs: list[ReqOutput]) -> bool:
        self.seq += 1
        self.unacked.append((self.seq, time.monotonic()))
        return self.send(StepOutputs(outs, self.seq))

    def flush(self) -> bool:
        """Send what the socket takes now; False if the frontend is gone."""
        while self.outbox:
            try:
                self.sock.send_multipart([self.route, self.outbox[0]], zmq.NOBLOCK)
            except zmq.Again:
                return True  # its queue is full: retry after the next step
            except zmq.ZMQError as e:
                if e.errno == zmq.EHOSTUNREACH:
                    return False
                raise
            self.outbox.popleft()
        return True

    def ack(self, seq: int) -> None:
        while self.unacked and self.unacked[0][0] <= seq:
            self.unacked.popleft()

    @property
    def lag(self) -> float:
        """Seconds since the oldest output it has not acknowledged was sent (0: none)."""
        return time.monotonic() - self.unacked[0][1] if self.unacked else 0.0

    def __str__(self) -> str:
        return f"frontend {self.worker_id} (pid {self.pid})"


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a control, and the cid its reply must carry."""

    frontend: Frontend
    cid: int


class Frontends:
    """The attached frontends, by key and by pidfd, and what the core sends them.

    `attach` admits one (the server has checked its Hello) and watches its pidfd in the
    server's poller; `drop` detaches it and aborts its requests. Sends never block, and a
    frontend whose socket is gone is dropped. `check_lag` and `drop_silent` are the flow
    control and liveness checks the server runs after every poll."""

    def __init__(self, core: EngineCore, config: EngineConfig, poller: zmq.Poller,
                 owner_pidfd: int | None) -> None:
        self.core, self.config, self.poller, self.owner_pidfd = core, config, poller, owner_pidfd
        self.by_key: dict[bytes, Frontend] = {}
        self.by_pidfd: dict[int, Frontend] = {}
        self.worker_ids: dict[bytes, int] = {}  # kept after detach while admission records name them
        self.next_worker_id = 0
        self.beat_at = time.monotonic()

    def __len__(self) -> int:
        return len(self.by_key)

    def __iter__(self) -> Iterator[Frontend]:
        return iter(list(self.by_key.values()))  # a copy: sending may drop one

    def get(self, key: bytes) -> Frontend | None:
        return self.by_key.get(key)

    def attach(self, peer: Peer, pid: int, pidfd: int | None) -> Frontend:
        fe = Frontend(peer.key, self.next_worker_id, pid, pidfd, peer.sock, peer.route, peer.remote,
                      time.monotonic())
        self.next_worker_id += 1
        self.by_key[fe.ident] = fe
        self.worker_ids[fe.ident] = fe.worker_id
        if pidfd is not None and pidfd != self.owner_pidfd:
            self.by_pidfd[pidfd] = fe
            self.poller.register(pidfd, zmq.POLLIN)
        log.info("frontend %d attached (pid %d%s)", fe.worker_id, fe.pid, ", over TCP" if fe.remote else "")
        return fe

    def drop(self, fe: Frontend, why: str) -> None:
        aborted = len(self.core.abort_frontend(fe.ident))
        self.core.scheduler.set_behind(fe.ident, False)
        self.by_key.pop(fe.ident, None)
        named = {f for f, _ in self.core.report.admissions()} | self.by_key.keys()
        self.worker_ids = {f: w for f, w in self.worker_ids.items() if f in named}  # bounded
        if fe.pidfd is not None and fe.pidfd != self.owner_pidfd:
            self.by_pidfd.pop(fe.pidfd, None)
            self.poller.unregister(fe.pidfd)
            os.close(fe.pidfd)
        log.info("frontend %d (pid %d) detached: %s; aborted %d request(s)",
                 fe.worker_id, fe.pid, why, aborted)

    def close(self) -> None:
        for fe in self.by_key.values():
            if fe.pidfd is not None and fe.pidfd != self.owner_pidfd:
                os.close(fe.pidfd)

    # ---- output ------------------------------------------------------------------------------

    def send(self, fe: Frontend, msg: ToFrontend) -> None:
        if not fe.send(msg):
            self.drop(fe, "its socket is gone")

    def send_step(self, fe: Frontend, outs: list[ReqOutput]) -> None:
        if not fe.send_step(outs):
            self.drop(fe, "its socket is gone")

    def send_outputs(self, outputs: dict[bytes, list[ReqOutput]]) -> None:
        for ident, outs in outputs.items():
            fe = self.by_key.get(ident)
            if fe is not None and outs:
                self.send_step(fe, outs)

    @property
    def pending(self) -> bool:
        """Some outbox holds what its socket would not take yet."""
        return any(fe.outbox for fe in self.by_key.values())

    def flush(self) -> None:
        for fe in self:
            if fe.outbox and not fe.flush():
                self.drop(fe, "its socket is gone")

    # ---- flow control and liveness -------------------------------------------------------------

    def check_lag(self) -> None:
        """Park the requests of a frontend behind its outputs (frontend_max_lag_s, or
        frontend_max_unacked steps), resume them once it has caught up, and end them when it has
        processed nothing for frontend_max_silence_s."""
        cfg, sched = self.config, self.core.scheduler
        for fe in self:
            lag = fe.lag
            behind = lag > cfg.frontend_max_lag_s or len(fe.unacked) > cfg.frontend_max_unacked
            if behind != (fe.ident in sched.behind):
                sched.set_behind(fe.ident, behind)
                if behind:
                    log.warning("%s fell behind its outputs (%d steps, %.1f s): its requests are parked", fe,
                                len(fe.unacked), lag)
                else:
                    log.info("%s caught up: its requests resume", fe)
            if lag > cfg.frontend_max_silence_s and fe.ident in self.core.report.requests_per_frontend():
                self.end_silent(fe, lag)

    def end_silent(self, fe: Frontend, lag: float) -> None:
        """End the requests of a frontend that processed nothing for `lag` seconds (stopped or
        wedged), so that they cannot hold KV blocks and batch slots indefinitely. It learns why
        when it resumes."""
        why = (f"{fe} processed none of the engine's outputs for {lag:.1f} s "
               f"(frontend_max_silence_s={self.config.frontend_max_silence_s}): its requests were ended")
        rids = self.core.abort_frontend(fe.ident)
        log.warning("%s; %d request(s)", why, len(rids))
        self.send_step(fe, [ReqOutput(rid, finish="abort", error=why, refused=False, stalled=True)
                            for rid in rids])

    def drop_silent(self) -> None:
        """Over TCP: a remote frontend sends a Heartbeat every third of the timeout; one silent
        for the whole timeout (dead, stopped, cut off) is dropped, its requests aborted. (Its
        view of the core is libzmq's heartbeats: see TokenizerWorker.connect.)"""
        now, timeout = time.monotonic(), self.config.heartbeat_timeout_s
        if now - self.beat_at < timeout / 3:
            return
        self.beat_at = now
        for fe in [f for f in self if f.remote and now - f.last_heard > timeout]:
            self.drop(fe, f"it sent nothing for {now - fe.last_heard:.1f} s (heartbeat_timeout_s={timeout})")
