"""The attached frontends as the core sees them: who they are, whether they live, and the flow
control of what they are sent.

The core never blocks on a frontend: what its socket will not take now waits, in order, in its
outbox. Each StepOutputs is numbered and the frontend acknowledges (Ack) what it has processed,
so the core can see a frontend fall behind and stop it from holding KV blocks and batch slots.
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

    def lagging(self, max_lag_s: float, max_unacked: int) -> str | None:
        """Why this frontend has fallen behind (stopped, wedged or swamped), or None."""
        if not self.unacked:
            return None
        lag, count = time.monotonic() - self.unacked[0][1], len(self.unacked)
        if lag <= max_lag_s and count <= max_unacked:
            return None
        return (f"frontend {self.worker_id} (pid {self.pid}) fell behind: {count} outputs unprocessed "
                f"for {lag:.1f} s (frontend_max_unacked={max_unacked}, frontend_max_lag_s={max_lag_s})")


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a control, and the cid its reply must carry."""

    frontend: Frontend
    cid: int


class Frontends:
    """The attached frontends, by key and by pidfd, and what the core sends them.

    `attach` admits one (the server has checked its Hello) and watches its pidfd in the
    server's poller; `drop` detaches it and aborts its requests. Sends never block, and a
    frontend whose socket is gone is dropped. `abort_lagging` and `drop_silent` are the flow
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

    def abort_lagging(self) -> None:
        """Abort the requests of a frontend that stopped processing its outputs, so that it
        cannot hold KV blocks and batch slots indefinitely."""
        cfg, busy = self.config, self.core.report.requests_per_frontend()
        for fe in self:
            why = fe.lagging(cfg.frontend_max_lag_s, cfg.frontend_max_unacked) if fe.ident in busy else None
            if why is None:
                continue
            rids = self.core.abort_frontend(fe.ident)
            log.warning("%s; aborted its %d request(s)", why, len(rids))
            fe.unacked.clear()
            self.send_step(fe, [ReqOutput(rid, finish="abort", error=why, refused=False) for rid in rids])

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
