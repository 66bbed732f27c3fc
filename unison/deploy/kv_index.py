"""KVIndex: which blocks each replica has cached, rebuilt from its KV events (unison/wire/kv_events.py).

Since a block's hash chains its parent's, one hash names a whole prefix: a replica holds a
prompt's first k blocks when it holds the k-th one's hash and those before it. The index keeps a
set of hashes per replica, a mirror of its core's radix cache and its disk tier (a hash leaves
when no medium holds it). It applies any struct with vLLM's
field names (the router's, or a test's own copy of vLLM's definitions).

Feed follows one replica from an HTTP worker: its events into the index (asking the replay
socket for what a gap or a late start missed) and its load reports onto a board every routing
policy reads, so that every worker sees the same engine-wide load.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, KeysView
from typing import TYPE_CHECKING, cast

import msgspec

from unison.wire.kv_events import END_SEQ, BlockRemoved, BlockStored, KVEventBatch, KVEventsInfo, LoadReport

if TYPE_CHECKING:
    import zmq.asyncio

log = logging.getLogger("unison.server")

REPLAY_TIMEOUT_S = 2.0


class KVIndex:
    def __init__(self) -> None:
        # replica -> hash of a cached block -> the media holding it (a block evicted from RAM may
        # still be on disk): a hash is cached while any medium holds it
        self.media: dict[int, dict[int, set[str | None]]] = {}

    @property
    def blocks(self) -> dict[int, KeysView[int]]:
        """replica -> the hashes of its cached blocks (set-like)."""
        return {replica: held.keys() for replica, held in self.media.items()}

    def apply(self, replica: int, events: Iterable[object]) -> None:
        """Events are told apart by class name, not isinstance: a subscriber that decodes into its
        own copies of vLLM's structs (as vLLM's example subscriber does) keeps an index too."""
        media = self.media.setdefault(replica, {})
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                stored = cast(BlockStored, event)
                for h in stored.block_hashes:
                    media.setdefault(h, set()).add(stored.medium)
            elif kind == "BlockRemoved":
                removed = cast(BlockRemoved, event)
                for h in removed.block_hashes:
                    where = media.get(h, set())
                    where.discard(removed.medium)
                    if not where:
                        media.pop(h, None)
            elif kind == "AllBlocksCleared":
                media.clear()

    def forget(self, replica: int) -> None:
        self.media.pop(replica, None)

    def overlap(self, replica: int, hashes: list[int]) -> int:
        """How many of a prompt's leading blocks (their chained hashes) the replica holds."""
        held, n = self.media.get(replica, {}), 0
        while n < len(hashes) and hashes[n] in held:
            n += 1
        return n


class Feed:
    """One replica's event and load streams, followed on the running loop until cancelled."""

    def __init__(self, replica: int, info: KVEventsInfo, host: str, index: KVIndex,
                 loads: dict[int, LoadReport], events: bool = True) -> None:
        self.replica, self.info, self.host = replica, info, host
        self.index, self.loads, self.events = index, loads, events
        self.last_seq: int | None = None
        self.gaps = 0  # sequence gaps seen (each answered by a replay, when there is a socket)
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.load_decoder = msgspec.msgpack.Decoder(LoadReport)
        self.task = asyncio.get_running_loop().create_task(self._run())

    def close(self) -> None:
        self.task.cancel()
        self.index.forget(self.replica)
        self.loads.pop(self.replica, None)

    async def _run(self) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        socks = []
        try:
            load = ctx.socket(zmq.SUB)
            socks.append(load)
            load.setsockopt(zmq.SUBSCRIBE, b"")
            load.connect(_reachable(self.info.load_endpoint, self.host))
            poller = zmq.asyncio.Poller()
            poller.register(load, zmq.POLLIN)
            sub = None
            if self.events:
                sub = ctx.socket(zmq.SUB)
                socks.append(sub)
                sub.setsockopt(zmq.SUBSCRIBE, self.info.topic.encode())
                sub.connect(_reachable(self.info.endpoint, self.host))
                poller.register(sub, zmq.POLLIN)
                await self._replay(ctx, 0)  # what the core published before we subscribed
            while True:
                for sock, _ in await poller.poll():
                    if sock is load:
                        report = self.load_decoder.decode(await load.recv())
                        self.loads[self.replica] = report
                    elif sub is not None:  # (the other socket polled)
                        _, seq, payload = await sub.recv_multipart()
                        await self._batch(ctx, int.from_bytes(seq, "big"), payload)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("following replica %d's KV events failed", self.replica)
        finally:
            for sock in socks:
                sock.close(linger=0)

    async def _batch(self, ctx: zmq.asyncio.Context, seq: int, payload: bytes) -> None:
        if self.last_seq is not None and seq <= self.last_seq:
            return  # had it from a replay
        if self.last_seq is not None and seq > self.last_seq + 1:
            self.gaps += 1
            log.warning("replica %d: KV events %d..%d missed; replaying", self.replica,
                        self.last_seq + 1, seq - 1)
            await self._replay(ctx, self.last_seq + 1)
            if self.last_seq is not None and seq <= self.last_seq:
                return
        self.index.apply(self.replica, self.decoder.decode(payload).events)
        self.last_seq = seq

    async def _replay(self, ctx: zmq.asyncio.Context, start: int) -> None:
        """Apply the buffered batches from `start` on (none without a replay socket)."""
        import zmq

        if self.info.replay_endpoint is None:
            return
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(_reachable(self.info.replay_endpoint, self.host))
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                if not await sock.poll(REPLAY_TIMEOUT_S * 1000):
                    log.warning("replica %d: replay from %d timed out", self.replica, start)
                    return
                *_, seq, payload = await sock.recv_multipart()
                if seq == END_SEQ:
                    return
                n = int.from_bytes(seq, "big")
                if self.last_seq is None or n > self.last_seq:
                    self.index.apply(self.replica, self.decoder.decode(payload).events)
                    self.last_seq = n
        finally:
            sock.close(linger=0)


def _reachable(endpoint: str, host: str) -> str:
    """A bound endpoint as another process dials it: a wildcard address is the replica's host."""
    for wildcard in ("0.0.0.0", "*", "[::]"):
        endpoint = endpoint.replace(f"tcp://{wildcard}:", f"tcp://{host}:")
    return endpoint
