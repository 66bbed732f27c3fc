"""Replicas: the engine cores one HTTP worker serves, and which one takes each request.

One core: the registry's, attached over IPC. Data parallel (`unison serve --data-parallel-size
N`): N cores in Ray actors anywhere in the cluster, each attached over TCP with CURVE keys; the
launcher keeps a replicas file (ReplicaSet) current as Ray restarts them, and every HTTP worker
follows it, re-attaching to a core that came back. Routing is least outstanding requests (this
worker's own, per replica), or prefix-affine: a hash of the prompt text's first characters picks
the replica (rendezvous hashing, so a dead replica only moves its own prefixes), so that prefix
cache hits survive scale-out and the router never tokenizes.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from unison.errors import EngineDeadError
from unison.frontend.worker import TokenizerWorker
from unison.protocol import ControlRequest, ReplyT, ServerInfo

log = logging.getLogger("unison.server")

ROUTINGS = ("least_loaded", "prefix")
PREFIX_CHARS = 256  # of the rendered prompt, hashed for prefix-affine routing (SGLang's router: 256)
FOLLOW_S = 0.5  # how often a worker looks at the replicas file and retries a dead replica
ATTACH_S = 5.0  # a new replica's core has this long to welcome a worker
RETRY_ATTACH_S = 1.0  # ... and a lost one's, at its old address (usually gone: Ray restarts it)


class ReplicaAddress(msgspec.Struct, frozen=True):
    """Where one data-parallel replica's core listens, as its Ray actor reports it."""

    index: int
    address: str  # tcp://
    server_key: str
    core_pid: int
    host: str


class ReplicaRow(msgspec.Struct, frozen=True):
    """One data-parallel replica as /get_server_info lists it under `replicas`."""

    index: int
    address: str  # where its core listens
    host: str
    pid: int  # its core's
    state: dict[str, Any]  # its core's own state: the replica's `internal_states` entry, as SGLang's


class ReplicaSet(msgspec.Struct):
    """The replicas file: written by the launcher, atomically, whenever a replica moves."""

    replicas: list[ReplicaAddress]
    client_key: str  # the HTTP workers' CURVE secret key (the file is 0600 in a 0700 directory)


def write_replica_set(path: str | Path, replicas: ReplicaSet) -> None:
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.encode(replicas))
    os.rename(tmp, path)


class Replicas:
    def __init__(self, workers: list[TokenizerWorker | None], routing: str = "least_loaded",
                 replicas_path: str | None = None, on_dead: Callable[[], None] | None = None) -> None:
        self.workers = workers  # per replica; None while it is away
        self.routing = routing
        self.replicas_path = replicas_path
        self.addresses: list[ReplicaAddress | None] = [None] * len(workers)
        self._follow: asyncio.Task | None = None
        self._on_dead = on_dead  # one core, no replicas file: the worker stops with it

    @classmethod
    async def local(cls, registry_path: str, owner_pid: int, on_dead: Callable[[], None]) -> Replicas:
        worker = await TokenizerWorker.attach(registry_path, owner_pid)
        worker.on_dead = on_dead
        return cls([worker])

    @classmethod
    async def remote(cls, replicas_path: str, routing: str) -> Replicas:
        """Attach to every replica the file names (each must answer once, at start)."""
        self = cls([None] * len(_read(replicas_path).replicas), routing, replicas_path)
        await self.refresh(strict=True)
        self._follow = asyncio.get_running_loop().create_task(self._follow_file())
        return self

    # ---- following the replicas ---------------------------------------------------------------

    async def refresh(self, strict: bool = False) -> None:
        """Attach to each replica that is new or moved (Ray restarted it: a new core, a new
        address), and again to one whose connection was lost at the same address (a network
        cut); all at once, so that one slow replica holds up no other."""
        spec = _read(self.replicas_path)
        todo = [a for a in spec.replicas if self.workers[a.index] is None
                or self.addresses[a.index] != a or self.workers[a.index].dead is not None]
        await asyncio.gather(*(self._attach(a, spec.client_key, strict) for a in todo))

    async def _attach(self, addr: ReplicaAddress, client_key: str, strict: bool) -> None:
        old = self.workers[addr.index]
        retry = old is not None and self.addresses[addr.index] == addr  # its core may be gone
        try:
            new = await TokenizerWorker.connect(addr.address, addr.server_key, client_key,
                                                timeout=RETRY_ATTACH_S if retry else ATTACH_S)
        except (OSError, TimeoutError, EngineDeadError) as e:
            if strict:
                raise
            log.debug("replica %d at %s not attachable yet: %s", addr.index, addr.address, e)
            return
        if old is not None:
            await old.close(goodbye=old.dead is None)
        self.workers[addr.index], self.addresses[addr.index] = new, addr
        log.info("attached to replica %d (core pid %d on %s)", addr.index, addr.core_pid, addr.host)

    async def _follow_file(self) -> None:
        while True:
            await asyncio.sleep(FOLLOW_S)
            try:
                await self.refresh()
            except Exception:  # a half-written file, a replica mid-restart: look again soon
                log.exception("following the replicas file failed")

    async def close(self) -> None:
        if self._follow is not None:
            self._follow.cancel()
        for worker in self.workers:
            if worker is not None:
                await worker.close()

    # ---- routing ------------------------------------------------------------------------------

    @property
    def live(self) -> list[tuple[int, TokenizerWorker]]:
        return [(i, w) for i, w in enumerate(self.workers) if w is not None and w.dead is None]

    @property
    def any(self) -> TokenizerWorker:
        """A live replica's frontend, for what any of them answers alike (tokenizing, the model)."""
        live = self.live
        if not live:
            raise EngineDeadError(self._why_dead())
        return live[0][1]

    def pick(self, prompt: str | None = None) -> TokenizerWorker:
        """The replica for a request: prefix-affine on `prompt`'s head, else least outstanding."""
        live = self.live
        if not live:
            raise EngineDeadError(self._why_dead())
        if self.routing == "prefix" and prompt:
            head = prompt[:PREFIX_CHARS].encode()
            return max(live, key=lambda iw: hashlib.blake2b(head + bytes([iw[0]]), digest_size=8).digest())[1]
        return min(live, key=lambda iw: (len(iw[1].states), iw[0]))[1]

    def _why_dead(self) -> str:
        dead = [w.dead for w in self.workers if w is not None and w.dead is not None]
        return str(dead[0]) if dead else "no engine replica is attached"

    # ---- engine-wide controls, on every replica -----------------------------------------------

    async def control_all(self, req: ControlRequest[ReplyT],
                          timeout: float | None = 30.0) -> list[tuple[int, ReplyT]]:
        """(replica index, result) of a control run on every live replica (an operator's pause
        or update is engine-wide)."""
        live = self.live
        if not live:
            raise EngineDeadError(self._why_dead())
        results = await asyncio.gather(*(w.control(req, timeout) for _, w in live))
        return [(i, r) for (i, _), r in zip(live, results)]

    def replica_rows(self, infos: list[tuple[int, ServerInfo]]) -> list[ReplicaRow]:
        """A row for each replica that answered (index, its core's ServerInfo)."""
        rows = []
        for i, info in infos:
            where = self.addresses[i]
            rows.append(ReplicaRow(i, where.address, where.host, where.core_pid,
                                   info.to_dict()["internal_states"][0]))
        return rows


def _read(path: str | Path) -> ReplicaSet:
    return msgspec.json.decode(Path(path).read_bytes(), type=ReplicaSet)
