"""DiskCache: the prefix cache's second tier, KV blocks in files that outlive the process.

Every full block the radix cache adopts (base model only: an adapter's id does not survive a
restart) is copied out at once and written by a background thread, so the core never waits on the
disk and a kill -9 keeps what was written (write-through, as SGLang's hierarchical cache can).
Eviction from RAM then costs nothing more. A prefix lookup that ends in RAM goes on here: the
following blocks' chained hashes (kv_events.block_hash, the KV events' own) name their files, and
the consecutive ones found are read back into fresh blocks and adopted by the radix cache.

Files live in DIR/<model fingerprint>/<block hash>.kv: the fingerprint covers the weights files
(names, sizes, mtimes), the KV layout and dtype and the block size, so another model, another
dtype or a changed file never reads them. A file is MAGIC, the header's length, a msgpack
BlockHeader, then the block's bytes (attention.read_block's). A file whose header, name, tokens,
length or checksum disagree is removed, never served. Past `capacity` bytes, the least recently
used files go. Writes are temp file + rename, so a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO, Protocol

import msgspec

from unison.config import EngineConfig
from unison.model.pooling.encoder_runner import EncoderRunner
from unison.model.runner import ModelRunner
from unison.model.weights.loader import default_gguf_path
from unison.wire.kv_events import block_hash

log = logging.getLogger("unison.core")

MAGIC = b"UNKV\x01\n"
FORMAT = 1  # bump when the file layout changes: the fingerprint then moves to a new directory
MAX_PENDING_BYTES = 1 << 30  # copies waiting for the writer; past it new blocks are not written


class BlockHeader(msgspec.Struct, array_like=True):
    fingerprint: bytes
    block_hash: int
    parent: int | None
    tokens: list[int]
    nbytes: int  # of the payload that follows
    crc32: int  # of the payload


class BlockIO(Protocol):
    """Where blocks' bytes live (the runner's PagedAttention)."""

    @property
    def block_nbytes(self) -> int: ...

    def read_block(self, block: int) -> bytes: ...

    def write_block(self, block: int, data: bytearray | memoryview) -> None: ...


class DiskEvents(Protocol):
    """What hears the files come and go (core/kv_publisher.EventLog)."""

    def on_disk(self, parent: int | None, hashes: list[int], tokens: Sequence[int]) -> None: ...

    def off_disk(self, hashes: list[int]) -> None: ...


def open_disk_cache(config: EngineConfig, runner: ModelRunner | EncoderRunner,
                    events: DiskEvents | None) -> DiskCache:
    """The disk tier at config.kv_cache_dir, serving the files of the runner's weights."""
    if not isinstance(runner, ModelRunner):
        raise ValueError("kv_cache_dir: an encoder model keeps no KV cache to store")
    assert config.kv_cache_dir is not None
    disk = DiskCache(config.kv_cache_dir, int(config.kv_cache_disk_gb * (1 << 30)), config.block_size,
                     runner.attention, events)
    disk.open(weights_key(runner, config.model_path or str(default_gguf_path())))
    return disk


def weights_key(runner: ModelRunner, model_path: str) -> bytes:
    """The fingerprint of the KV this runner computes with the weights at `model_path`."""
    k, rounding = runner.attention.k_cache, runner.attention.key_rounding
    layout = (str(k.dtype), list(k[:, 0].shape), runner.quantization, str(runner.dtype),
              # int8 keys are stored less a mean measured at load, which every key a query reads
              # must share: files of another mean are another cache's
              None if rounding is None else hashlib.sha256(rounding.mean.numpy().tobytes()).hexdigest())
    return fingerprint(model_path, layout)


def fingerprint(model_path: str, layout: object) -> bytes:
    """What the files are valid for: the weights files as they are now, and the cache's layout
    (anything msgpack encodes: dtype, shapes, block size)."""
    path = Path(model_path)
    files = [path] if path.is_file() else sorted(
        f for f in path.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf", ".json"))
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return hashlib.sha256(msgspec.msgpack.encode((FORMAT, stats, layout))).digest()[:16]


class DiskCache:
    def __init__(self, root: str | Path, capacity_bytes: int, block_size: int, io: BlockIO,
                 events: DiskEvents | None = None) -> None:
        self.root, self.capacity, self.block_size = Path(root), capacity_bytes, block_size
        self.io, self.events = io, events
        self.key: bytes | None = None  # the fingerprint served; None: the tier is off
        self.dir = self.root
        # hash -> its file's bytes, least recently used first
        self.index: OrderedDict[int, int] = OrderedDict()
        self.used = 0  # bytes of the indexed files
        self.num_loaded = self.num_bad = 0  # blocks, so far
        self.writer = _Writer()

    # ---- which weights ------------------------------------------------------------------------

    def open(self, key: bytes) -> None:
        """Serve the files of fingerprint `key`: index those a previous run left (checking each
        header), remove what is foreign or half-written."""
        self.retire()
        self.key, self.dir = key, self.root / key.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        found = []
        for path in self.dir.iterdir():
            got = self._header(path) if path.suffix == ".kv" else None
            if got is None:
                path.unlink(missing_ok=True)
            else:
                found.append(got)
        for header, stat in sorted(found, key=lambda f: f[1].st_mtime_ns):  # oldest first: the LRU order
            self._add(header.block_hash, stat.st_size)
        if self.events is not None:
            for header in _parents_first([header for header, _ in found]):
                self.events.on_disk(header.parent, [header.block_hash], header.tokens)
        log.info("KV disk cache %s: %d blocks, %.2f GiB", self.dir, len(self.index), self.used / (1 << 30))

    def retire(self) -> None:
        """Stop reading and writing (the weights changed in place: no file matches them)."""
        self._forget(remove=False)
        self.key = None

    # ---- the radix cache's observer -----------------------------------------------------------

    def stored(self, parent: int | None, hashes: list[int], tokens: Sequence[int], blocks: list[int],
               adapter: int) -> None:
        """Blocks the radix cache adopted: copy them out now (their RAM may be reused before the
        writer gets to them) and queue the files (the writer adds the checksum)."""
        if self.key is None or adapter:
            return
        bs = self.block_size
        for i, (h, block) in enumerate(zip(hashes, blocks)):
            if h not in self.index and h not in self.writer.queued:
                payload = self.io.read_block(block)
                header = BlockHeader(self.key, h, parent, list(tokens[i * bs: (i + 1) * bs]), len(payload), 0)
                self.writer.put(self._path(h), header, payload)
            parent = h

    def removed(self, hashes: list[int]) -> None:
        """Evicted from RAM: the files stay (they were written when the blocks were stored)."""

    def cleared(self) -> None:
        """The RAM tier emptied itself; the files stay."""

    # ---- the core loop ------------------------------------------------------------------------

    def poll(self) -> None:
        """Index the files the writer finished, and keep under capacity (once a step)."""
        for header, nbytes in self.writer.take():
            h = header.block_hash
            if nbytes and header.fingerprint == self.key and h not in self.index:
                self._add(h, nbytes)
                if self.events is not None:
                    self.events.on_disk(header.parent, [h], header.tokens)
        gone = []
        while self.used > self.capacity and self.index:
            h, nbytes = self.index.popitem(last=False)
            self.used -= nbytes
            self._path(h).unlink(missing_ok=True)
            gone.append(h)
        if gone and self.events is not None:
            self.events.off_disk(gone)

    def lookup(self, parent: int | None, tokens: Sequence[int]) -> list[int]:
        """The hashes of `tokens`' leading whole blocks (chained after `parent`) that have files."""
        bs, found = self.block_size, list[int]()
        if self.key is None:
            return found
        for i in range(0, len(tokens) // bs * bs, bs):
            parent = block_hash(parent, tuple(tokens[i: i + bs]), None)
            if parent not in self.index:
                break
            found.append(parent)
        return found

    def load(self, hashes: list[int], tokens: Sequence[int], blocks: list[int]) -> int:
        """Read the files of `hashes` (lookup's, for `tokens`) into `blocks`, in order; returns
        how many loaded before the first missing or bad one (a bad one is removed)."""
        bs = self.block_size
        for i, (h, block) in enumerate(zip(hashes, blocks)):
            data = self._read(h, tokens[i * bs: (i + 1) * bs])
            if data is None:
                self.num_bad += 1
                self.used -= self.index.pop(h, 0)
                self._path(h).unlink(missing_ok=True)
                if self.events is not None:
                    self.events.off_disk([h])
                return i
            self.io.write_block(block, data)
            self.index.move_to_end(h)
            self.num_loaded += 1
        return len(hashes)

    def clear(self) -> None:
        """Remove every file of the served fingerprint (flush_cache: nothing cached survives)."""
        self._forget(remove=True)

    def _forget(self, remove: bool) -> None:
        """Empty the index once the queued writes have landed (and `remove` their files)."""
        self.writer.drain()
        self.poll()
        for h in self.index if remove else ():
            self._path(h).unlink(missing_ok=True)
        if self.events is not None and self.index:
            self.events.off_disk(list(self.index))
        self.index, self.used = OrderedDict(), 0

    def close(self) -> None:
        """Finish the queued writes (a restart then finds them), then stop the writer."""
        self.writer.close()

    # ---- files --------------------------------------------------------------------------------

    def _path(self, h: int) -> Path:
        return self.dir / f"{h:016x}.kv"

    def _add(self, h: int, nbytes: int) -> None:
        self.index[h] = nbytes
        self.used += nbytes

    def _header(self, path: Path) -> tuple[BlockHeader, os.stat_result] | None:
        """The file's header and stat when it is ours and whole (the payload is checked when
        read)."""
        try:
            with path.open("rb") as f:
                header = _decode(f)
                stat = os.fstat(f.fileno())
        except (OSError, ValueError, msgspec.DecodeError):
            return None
        if header.fingerprint != self.key or path.name != f"{header.block_hash:016x}.kv" \
                or len(header.tokens) != self.block_size or header.nbytes != self.io.block_nbytes \
                or stat.st_size != len(_encode(header)) + header.nbytes:
            return None
        return header, stat

    def _read(self, h: int, tokens: Sequence[int]) -> bytearray | None:
        """The block's bytes, when the file is whole, ours, and holds exactly these tokens."""
        try:
            with self._path(h).open("rb") as f:
                header = _decode(f)
                data = bytearray(header.nbytes)
                n = f.readinto(data)
                extra = f.read(1)
        except (OSError, ValueError, msgspec.DecodeError):
            return None
        ok = (header.fingerprint == self.key and header.block_hash == h and header.tokens == list(tokens)
              and header.nbytes == self.io.block_nbytes and n == header.nbytes and not extra
              and zlib.crc32(data) == header.crc32)
        if not ok:
            log.warning("KV disk cache: removed a bad file for block %016x", h)
        return data if ok else None

def _parents_first(headers: list[BlockHeader]) -> list[BlockHeader]:
    """The headers, each after its parent's when both are here (KV event subscribers build
    chains)."""
    by_hash = {h.block_hash: h for h in headers}
    depth: dict[int, int] = {}
    for header in headers:
        chain: list[int] = []
        at: int | None = header.block_hash
        while at is not None and at in by_hash and at not in depth:
            chain.append(at)
            at = by_hash[at].parent
        d = -1 if at is None else depth.get(at, -1)
        for h in reversed(chain):
            d += 1
            depth[h] = d
    return sorted(headers, key=lambda h: depth[h.block_hash])


def _encode(header: BlockHeader) -> bytes:
    body = msgspec.msgpack.encode(header)
    return MAGIC + struct.pack("<I", len(body)) + body


def _decode(f: BinaryIO) -> BlockHeader:
    head = f.read(len(MAGIC) + 4)
    if len(head) != len(MAGIC) + 4 or not head.startswith(MAGIC):
        raise ValueError("not a KV block file")
    (n,) = struct.unpack("<I", head[len(MAGIC):])
    if n > 1 << 20:
        raise ValueError("header too long")
    return msgspec.msgpack.decode(f.read(n), type=BlockHeader)


class _Writer:
    """A thread that writes queued files (temp file, then rename). The core only queues and,
    once a step, takes what finished."""

    def __init__(self) -> None:
        self.jobs: queue.Queue[tuple[Path, BlockHeader, bytes] | None] = queue.Queue()
        self.queued: set[int] = set()  # hashes queued or being written (the core thread's)
        self.pending_bytes = 0
        self.done: list[tuple[BlockHeader, int]] = []  # (header, file bytes; 0: failed)
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.warned = False

    def put(self, path: Path, header: BlockHeader, payload: bytes) -> None:
        with self.lock:
            if self.pending_bytes + len(payload) > MAX_PENDING_BYTES:
                if not self.warned:
                    log.warning("KV disk cache: the disk is behind; blocks past %d MiB queued are not "
                                "written", MAX_PENDING_BYTES >> 20)
                    self.warned = True
                return
            self.pending_bytes += len(payload)
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="unison-kv-disk", daemon=True)
            self.thread.start()
        self.queued.add(header.block_hash)
        self.jobs.put((path, header, payload))

    def take(self) -> list[tuple[BlockHeader, int]]:
        with self.lock:
            done, self.done = self.done, []
        for header, _ in done:
            self.queued.discard(header.block_hash)
        return done

    def drain(self) -> None:
        self.jobs.join()

    def close(self) -> None:
        if self.thread is not None:
            self.jobs.put(None)
            self.thread.join()
            self.thread = None

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            path, header, payload = job
            tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp")
            header.crc32 = zlib.crc32(payload)
            head, nbytes = _encode(header), 0
            try:
                with tmp.open("wb") as f:
                    f.write(head)
                    f.write(payload)
                os.replace(tmp, path)
                nbytes = len(head) + len(payload)
            except OSError as e:
                log.warning("KV disk cache: could not write %s: %s", path, e)
                tmp.unlink(missing_ok=True)
            with self.lock:
                self.pending_bytes -= len(payload)
                self.done.append((header, nbytes))
            self.jobs.task_done()
        self.jobs.task_done()
