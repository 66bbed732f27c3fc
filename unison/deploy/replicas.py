"""Replicas: the engine cores one HTTP worker serves, and which one takes each request.

One core: the registry's, attached over IPC. Data parallel (`unison serve --data-parallel-size
N`): N cores in Ray actors anywhere in the cluster, each attached over TCP with CURVE keys; the
launcher keeps a replicas file (ReplicaSet) current as Ray restarts them, and every HTTP worker
follows it, re-attaching to a core that came back. Each worker also follows every replica's load
reports, and with `kv` routing its KV events (unison/deploy/kv_index.py), so that every worker sees the
same engine-wide load and what each replica has cached. Routing:

  least_loaded  the fewest running + waiting requests, engine-wide (the load reports, plus what
                this worker sent since the last one; its own outstanding count until one came)
  prefix        a hash of the prompt text's first characters picks the replica (rendezvous
                hashing, so a dead replica only moves its own prefixes); never tokenizes
  kv            the replica whose cache holds most of the prompt's leading blocks, less a
                penalty per request of load (the prompt's token ids, hashed as the cores hash)
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import msgspec

from unison.deploy.kv_index import Feed, KVIndex
from unison.errors import EngineDeadError
from unison.frontend.worker import TokenizerWorker
from unison.json_types import JSONObject
from unison.wire.kv_events import KVEventsInfo, LoadReport, block_hashes
from unison.wire.messages import ControlRequest, ReplyT, ServerInfo

log = logging.getLogger("unison.server")

# kv: a replica's cost is the share of the prompt's blocks it must compute, plus this per request
# running or waiting there: a whole prompt cached outweighs ten requests more of load.
LOAD_WEIGHT = 0.1
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
    state: JSONObject  # its core's own state: the replica's `internal_states` entry, as SGLang's
    kv_events: KVEventsInfo | None = None  # where its core publishes KV events and load reports
    indexed_blocks: int = 0  # its cached blocks as this worker's index has them (kv routing)
    load: LoadReport | None = None  # its latest load report, as this worker has it


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
        self.index = KVIndex()  # what each replica has cached (kv routing)
        self.loads: dict[int, LoadReport] = {}  # each replica's latest load report
        self.sent: dict[int, int] = {}  # requests this worker sent each replica since its last report
        self.feeds: dict[int, Feed] = {}
        self._seen: dict[int, LoadReport] = {}  # the report `sent` counts from
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
        assert self.replicas_path is not None  # (remote replicas only)
        spec = _read(self.replicas_path)
        todo = [a for a in spec.replicas if (w := self.workers[a.index]) is None
                or self.addresses[a.index] != a or w.dead is not None]
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
        self._feed(addr.index, new, addr.address.removeprefix("tcp://").rpartition(":")[0])
        log.info("attached to replica %d (core pid %d on %s)", addr.index, addr.core_pid, addr.host)

    async def _follow_file(self) -> None:
        while True:
            await asyncio.sleep(FOLLOW_S)
            try:
                await self.refresh()
            except Exception:  # a half-written file, a replica mid-restart: look again soon
                log.exception("following the replicas file failed")

    def _feed(self, index: int, worker: TokenizerWorker, host: str) -> None:
        """Follow a (new) replica's load reports and, for kv routing, its events; forget what its
        predecessor had cached (it died with its core, whose events say nothing more)."""
        if (old := self.feeds.pop(index, None)) is not None:
            old.close()
        if worker.info.kv_events is not None:
            self.feeds[index] = Feed(index, worker.info.kv_events, host, self.index, self.loads,
                                     events=self.routing == "kv")
        worker.on_dead = lambda: self._lost(index, worker)

    def _lost(self, index: int, worker: TokenizerWorker) -> None:
        if self.workers[index] is worker and (feed := self.feeds.pop(index, None)) is not None:
            feed.close()

    async def close(self) -> None:
        for feed in self.feeds.values():
            feed.close()
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

    def pick(self, prompt: str | None = None, input_ids: list[int] | None = None,
             lora_name: str | None = None) -> TokenizerWorker:
        """The replica for a request whose prompt is `prompt` (text) or `input_ids` (tokenized),
        run with LoRA adapter `lora_name` (None: the base model)."""
        live = self.live
        if not live:
            raise EngineDeadError(self._why_dead())
        if self.routing == "prefix" and prompt:
            head = prompt[:PREFIX_CHARS].encode()
            i = max(live, key=lambda iw: hashlib.blake2b(head + bytes([iw[0]]), digest_size=8).digest())[0]
        elif self.routing == "kv" and input_ids:
            first = live[0][1].info
            assert first is not None  # (attached)
            block_size = first.block_size
            hashes = functools.cache(lambda lora_id: block_hashes(input_ids, block_size, lora_id))

            def cost(iw: tuple[int, TokenizerWorker]) -> tuple[float, int]:
                # An adapter's blocks hash with the id that replica's core gave it (its reports say).
                ours = hashes(self._lora_id(iw[0], lora_name))
                missing = (len(ours) - self.index.overlap(iw[0], ours)) / max(len(ours), 1)
                return missing + LOAD_WEIGHT * self.load(*iw), iw[0]
            i = min(live, key=cost)[0]
        else:
            i = min(live, key=lambda iw: (self.load(*iw), len(iw[1].states), iw[0]))[0]
        if i in self.loads:
            self.sent[i] = self.sent.get(i, 0) + 1
        return dict(live)[i]

    def _lora_id(self, index: int, lora_name: str | None) -> int | None:
        report = self.loads.get(index)
        if lora_name is None or report is None:
            return None
        return report.lora_ids.get(lora_name, -1)  # -1: not loaded there, so nothing cached either

    def load(self, index: int, worker: TokenizerWorker) -> float:
        """A replica's requests, engine-wide: its last load report's running + waiting, and what
        this worker sent it since; without reports, this worker's own outstanding requests."""
        report = self.loads.get(index)
        if report is None:
            return len(worker.states)
        if report is not self._seen.get(index):  # a new report counts what was sent before it
            self._seen[index], self.sent[index] = report, 0
        return report.num_running + report.num_waiting + self.sent.get(index, 0)

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
            assert where is not None  # a replica that answered is attached
            report = self.loads.get(i)
            rows.append(ReplicaRow(i, where.address, where.host, where.core_pid,
                                   info.to_dict()["internal_states"][0], info.core.kv_events,
                                   len(self.index.blocks.get(i, ())), report))
        return rows


def _read(path: str | Path) -> ReplicaSet:
    return msgspec.json.decode(Path(path).read_bytes(), type=ReplicaSet)
