"""The core's KV-cache events and load reports (wire format: unison/wire/kv_events.py).

EventLog observes the radix cache and its disk tier: it queues an event per change, each naming
its medium (MEDIUM: RAM, DISK: files). Publisher sends what queued as one KVEventBatch per step
on a PUB socket, keeps the last `buffer_steps` batches for replay, and answers replay requests
on a ROUTER socket. It never blocks the core: PUB drops messages at its high-water mark (the
replay buffer covers the gap), and every send is non-blocking.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

import msgspec
import zmq

from unison.config import KVEventsConfig
from unison.wire.kv_events import (
    DISK,
    END_SEQ,
    MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
    KVEventsInfo,
    LoadReport,
    lora_id_of,
    offset_port,
)

log = logging.getLogger("unison.core")

REPORT_EVERY_S = 1.0  # a load report at least this often, news or not (a new subscriber learns)
MAX_REPLAYS_PER_POLL = 64


class EventLog:
    """Events since the last publish. A core starts with AllBlocksCleared: whatever a subscriber
    knew of an earlier core at this address is gone."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.pending: list[Event] = [AllBlocksCleared()]

    def stored(self, parent: int | None, hashes: list[int], tokens: Sequence[int], blocks: list[int],
               adapter: int) -> None:
        self.pending.append(BlockStored(list(hashes), parent, list(tokens), self.block_size,
                                        lora_id_of(adapter), MEDIUM))

    def removed(self, hashes: list[int]) -> None:
        self.pending.append(BlockRemoved(list(hashes), MEDIUM))

    def on_disk(self, parent: int | None, hashes: list[int], tokens: Sequence[int]) -> None:
        """Blocks written to the disk tier (the base model's only: core/kv/disk_cache.py)."""
        self.pending.append(BlockStored(list(hashes), parent, list(tokens), self.block_size, None, DISK))

    def off_disk(self, hashes: list[int]) -> None:
        self.pending.append(BlockRemoved(list(hashes), DISK))

    def cleared(self) -> None:
        self.pending.append(AllBlocksCleared())

    def take(self) -> list[Event]:
        events, self.pending = self.pending, []
        return events


class Publisher:
    def __init__(self, ctx: zmq.Context, config: KVEventsConfig, rank: int, events: EventLog) -> None:
        self.config, self.rank, self.events = config, rank, events
        self.topic = config.topic.encode()
        self.pub = _socket(ctx, zmq.PUB, offset_port(config.endpoint, rank), config.hwm)
        self.replay = None
        if config.replay_endpoint:
            self.replay = _socket(ctx, zmq.ROUTER, offset_port(config.replay_endpoint, rank), config.hwm)
        load = config.load_endpoint or _any_port(config.endpoint)
        self.load = _socket(ctx, zmq.PUB, offset_port(load, rank), 64)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.seq = 0
        self.encoder = msgspec.msgpack.Encoder()
        self.last_report: tuple = ()
        self.reported_at = 0.0

    def info(self) -> KVEventsInfo:
        bound = lambda s: s.getsockopt_string(zmq.LAST_ENDPOINT)  # noqa: E731
        return KVEventsInfo(bound(self.pub), bound(self.replay) if self.replay else None, bound(self.load),
                            self.config.topic, self.rank)

    def publish(self) -> None:
        """Send what the step changed, as one batch (nothing, when nothing changed)."""
        if not self.events.pending:
            return
        payload = self.encoder.encode(KVEventBatch(time.time(), self.events.take(), self.rank))
        seq = self.seq.to_bytes(8, "big")
        try:
            self.pub.send_multipart((self.topic, seq, payload), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass  # PUB drops rather than blocks; replay has it
        self.buffer.append((self.seq, payload))
        self.seq += 1

    def serve_replay(self) -> None:
        """Answer each waiting request: the buffered [seq, payload] messages from its start
        sequence number on, then [END_SEQ, b""]. REQ clients send an empty delimiter frame, DEALER
        clients may not: the reply keeps the request's envelope."""
        replay = self.replay
        assert replay is not None  # polled only when configured
        for _ in range(MAX_REPLAYS_PER_POLL):
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            envelope, start = frames[:-1], frames[-1]
            if len(start) != 8:
                log.warning("dropped a replay request whose start is %d bytes, not 8", len(start))
                continue
            first = int.from_bytes(start, "big", signed=True)
            try:
                for seq, payload in self.buffer:
                    if seq >= first:
                        replay.send_multipart((*envelope, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
                replay.send_multipart((*envelope, END_SEQ, b""), zmq.NOBLOCK)
            except zmq.Again:
                log.warning("a replay client stopped reading; its replay was cut short")

    def report(self, state: Callable[[], tuple[int, int, int, int, float, dict[str, int]]],
               force: bool = False) -> None:
        """A LoadReport when the load changed (at most every load_interval_s), or once a second."""
        now = time.monotonic()
        if now - self.reported_at < self.config.load_interval_s and not force:
            return
        current = state()
        if current == self.last_report and now - self.reported_at < REPORT_EVERY_S and not force:
            return
        self.last_report, self.reported_at = current, now
        report = LoadReport(time.time(), self.rank, *current)
        try:
            self.load.send(self.encoder.encode(report), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def close(self) -> None:
        for sock in (self.pub, self.replay, self.load):
            if sock is not None:
                sock.close(linger=0)


def _socket(ctx: zmq.Context, kind: int, endpoint: str, hwm: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise ValueError(f"kv_events_config: cannot bind {endpoint}: {e}") from None
    return sock


def _any_port(endpoint: str) -> str:
    """The load reports' endpoint beside the events': the same host, any free port."""
    if endpoint.startswith("tcp://"):
        return endpoint.rpartition(":")[0] + ":*"
    return endpoint + "_load"
