"""KV-cache events and load reports on the wire: vLLM's format, so its subscribers work unchanged.

A core publishes on a ZMQ PUB socket; each message is three frames: the topic, an 8-byte
big-endian sequence number and a msgpack KVEventBatch. The structs below are vLLM's
(`vllm/distributed/kv_events.py`): array-like, tagged by class name. A ROUTER replay socket
answers a start sequence number (8 bytes, big-endian) with the buffered messages since it, as
[seq, payload] pairs, then [-1, b""]. Load reports go out on a second PUB socket (a vLLM
subscriber of the first never sees a message it cannot decode).

Block hashes chain, so one hash names a whole prefix: a block's hash covers its parent's hash,
its tokens and its adapter id (block_hash). They are sha256 over msgpack, never Python's salted
hash(), so every process and every restart computes the same ones. This module imports neither
torch nor zmq: the core, the HTTP workers' router and any subscriber share it.
"""

from __future__ import annotations

import hashlib
from typing import Any, overload

import msgspec

MEDIUM = "CPU"  # where the blocks live, in vLLM's words (GPU, CPU): Unison's KV cache is in RAM
DISK = "DISK"  # ... or in the prefix cache's disk tier (kv_cache_dir), in vLLM's spelling
HASH_MASK = (1 << 63) - 1  # non-negative and below 2**63: an int64 or a uint64 to any consumer
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last message: [END_SEQ, b""]


# ---- vLLM's structs --------------------------------------------------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]  # vLLM's base: any events (KVEventBatch below decodes its own kinds)
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the KV-cache events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None  # None: the first block of a prompt
    token_ids: list[int]  # block_size per hash, in order
    block_size: int
    lora_id: int | None  # None: the base model
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


Event = BlockStored | BlockRemoved | AllBlocksCleared


class LoadReport(msgspec.Struct, gc=False):
    """One replica's load, after a step with news (rate-limited): Dynamo's KvMetrics fields."""

    ts: float
    data_parallel_rank: int
    num_running: int  # Dynamo: request_active_slots
    num_waiting: int  # num_requests_waiting
    kv_blocks_used: int  # kv_active_blocks: held by requests
    kv_blocks_total: int  # kv_total_blocks
    prefix_cache_hit_rate: float  # gpu_prefix_cache_hit_rate: cached / prompt tokens, so far
    lora_ids: dict[str, int] = {}  # loaded LoRA adapters: name -> the lora_id its blocks hash with

    @property
    def load(self) -> float:
        """One number to compare replicas by: what runs and waits, and how full the KV is."""
        return self.num_running + self.num_waiting + self.kv_blocks_used / max(self.kv_blocks_total, 1)


# ---- block hashes ----------------------------------------------------------------------------


def block_hash(parent: int | None, tokens: list[int] | tuple[int, ...], lora_id: int | None) -> int:
    """sha256(msgpack([parent hash or None, [token ids], lora id or None])), its first 8 bytes
    big-endian, masked to 63 bits."""
    data = msgspec.msgpack.encode((parent, tokens, lora_id))
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big") & HASH_MASK


def block_hashes(tokens: list[int], block_size: int, lora_id: int | None = None,
                 parent: int | None = None) -> list[int]:
    """The chained hashes of `tokens`' whole blocks (a partial last block has none)."""
    out = []
    for i in range(0, len(tokens) // block_size * block_size, block_size):
        parent = block_hash(parent, tokens[i: i + block_size], lora_id)
        out.append(parent)
    return out


def lora_id_of(adapter: int) -> int | None:
    return adapter or None  # adapter 0 is the base model: vLLM says None


# ---- endpoints per data-parallel rank (the option: config.KVEventsConfig) ----------------------


@overload
def offset_port(endpoint: str, rank: int) -> str: ...
@overload
def offset_port(endpoint: None, rank: int) -> None: ...
def offset_port(endpoint: str | None, rank: int) -> str | None:
    """vLLM's rule: a data-parallel rank's tcp port is the given one plus the rank (ipc and
    inproc paths get a suffix); a "*" port is any free one, for every rank."""
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if port in ("*", "0") else f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class KVEventsInfo(msgspec.Struct, frozen=True):
    """Where a core publishes, as bound (get_server_info's kv_events)."""

    endpoint: str
    replay_endpoint: str | None
    load_endpoint: str
    topic: str
    data_parallel_rank: int
