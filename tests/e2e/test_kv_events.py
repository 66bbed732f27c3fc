"""KV-cache events: a subscriber of its own (plain pyzmq, msgspec and vLLM's struct definitions,
copied below as vLLM's example subscriber copies them) mirrors the core's radix cache exactly.

The randomized workload drives an in-process EngineCore with a tiny KV cache (shared prefixes,
evictions, preemption, aborts, flushes, a weight update, requests on a LoRA adapter); the engine
tests run real processes.
"""

from __future__ import annotations

import random
import time
from contextlib import ExitStack, closing
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unison import Engine
from unison.bench.lora import write_adapter
from unison.config import EngineConfig, KVEventsConfig
from unison.core.engine_core import EngineCore
from unison.core.kv.publisher import Publisher
from unison.core.weight_update import load_weights
from unison.deploy.kv_index import KVIndex
from unison.model.weights.loader import default_gguf_path
from unison.wire.kv_events import LoadReport, block_hashes, offset_port
from unison.wire.messages import CoreSamplingParams, Generate

# ---- vLLM's definitions (vllm/distributed/kv_events.py), as a subscriber that is not Unison has them


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


BS = 4
LOCAL = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
         "replay_endpoint": "tcp://127.0.0.1:*"}


class Mirror:
    """A subscriber: SUB for the stream, REQ for replays (as vLLM's example), the shared index for
    the state, and the chain checks on every BlockStored."""

    def __init__(self, endpoint: str, replay: str | None = None, topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.index = KVIndex()
        self.last_seq = -1
        self.gaps: list[tuple[int, int]] = []
        self.prefix: dict[int, tuple[int, ...]] = {}  # hash -> the tokens of its whole prefix
        self.batches = 0
        self.stored: list[list[int]] = []  # each BlockStored's hashes, in order
        self.events: list[Any] = []
        self.pump = lambda: None  # an in-process core's replay socket is served by the test
        time.sleep(0.3)  # a SUB socket receives only once connected

    @property
    def blocks(self) -> set[int]:
        return self.index.blocks.get(0, set())

    def drain(self, timeout_ms: int = 200) -> None:
        while self.sub.poll(timeout_ms):
            _, seq, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq, "big")
            if seq > self.last_seq + 1:
                self.gaps.append((self.last_seq, seq))
                self.replay(self.last_seq + 1)
            if seq > self.last_seq:
                self.apply(seq, payload)
            timeout_ms = 50

    def replay(self, start: int) -> None:
        req = self.ctx.socket(zmq.DEALER)  # vLLM's protocol: [b"", start] in, [b"", seq, payload] out
        req.connect(self.replay_endpoint)
        req.send_multipart([b"", start.to_bytes(8, "big")])
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            self.pump()
            if not req.poll(20):
                continue
            _, seq, payload = req.recv_multipart()
            if not payload:
                break
            if int.from_bytes(seq, "big") > self.last_seq:
                self.apply(int.from_bytes(seq, "big"), payload)
        req.close(0)

    def apply(self, seq: int, payload: bytes) -> None:
        batch = self.decoder.decode(payload)
        for event in batch.events:
            self.events.append(event)
            if isinstance(event, BlockStored):
                self.check_chain(event)
                self.stored.append(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.prefix.clear()
            self.index.apply(0, [event])
        self.last_seq, self.batches = seq, self.batches + 1

    def check_chain(self, e: BlockStored) -> None:
        parent = e.parent_block_hash
        assert parent is None or parent in self.blocks, f"parent {parent} is not a block the mirror holds"
        assert len(e.token_ids) == e.block_size * len(e.block_hashes) and e.block_size == BS
        assert block_hashes(e.token_ids, BS, e.lora_id, parent) == e.block_hashes, "hashes do not recompute"
        head = self.prefix.get(parent, ()) if parent is not None else ()
        for i, h in enumerate(e.block_hashes):
            head = head + tuple(e.token_ids[i * BS: (i + 1) * BS])
            self.prefix[h] = head

    def close(self) -> None:
        self.ctx.destroy(linger=0)  # every socket, a replay's cut short by a failure too: term() would wait


@pytest.fixture(scope="module")
def core(model_dir, tmp_path_factory):
    config = EngineConfig(num_threads=1, block_size=BS, max_total_tokens=24 * BS, chunked_prefill_size=24,
                          max_running_requests=4, kv_events_config=LOCAL, enable_lora=True, max_lora_rank=2)
    core = EngineCore(config, str(model_dir))
    for name in ADAPTERS:  # LoRA requests key their blocks by adapter: events carry its id
        path = write_adapter(tmp_path_factory.mktemp(name), model_dir, rank=2, seed=len(name))
        assert core.loras.load(name, str(path))
    ctx = zmq.Context()
    core.publisher = Publisher(ctx, config.kv_events, 0, core.kv_events)
    yield core
    core.publisher.close()
    core.close()
    ctx.term()


@pytest.fixture(scope="module")
def mirror(core):
    info = core.publisher.info()
    m = Mirror(info.endpoint, info.replay_endpoint)
    # Replays answered at once (the core server's loop does this): a gap, which fails the test,
    # then fails it fast instead of waiting out each replay's deadline through every shrink.
    m.pump = core.publisher.serve_replay
    core.publisher.publish()  # the core's first batch: AllBlocksCleared
    yield m
    m.close()


_rids = iter(range(10**9))
ADAPTERS = ("sql", "chat")


def add(core: EngineCore, tokens: list[int], max_new: int, lora: str | None = None) -> str:
    rid = f"r{next(_rids)}"
    params = CoreSamplingParams(max_new_tokens=max_new, ignore_eos=True, temperature=0.0)
    assert core.add(b"fe", Generate(rid, tokens, params, lora_name=lora)) is None
    return rid


def step(core: EngineCore) -> None:
    seen.extend(list(r.token_ids) for r in core.requests.values())  # what a block may hold
    if core.has_work:
        core.step()
    core.publisher.publish()


def settle(core: EngineCore, mirror: Mirror) -> None:
    core.publisher.publish()
    mirror.drain()
    core.check_integrity()
    cached = set(core.scheduler.kv.cache.block_hashes())
    assert mirror.blocks == cached, (f"mirror has {len(mirror.blocks - cached)} extra, "
                                     f"misses {len(cached - mirror.blocks)}")
    assert not mirror.gaps
    # Each cached block's prefix is what some request computed (the chain carries its tokens).
    for h in cached:
        head = mirror.prefix[h]
        assert any(tuple(r[: len(head)]) == head for r in seen), "a block no request computed"


seen: list[list[int]] = []  # every prompt with its outputs, so far

OPS = st.lists(st.one_of(
    # add: (which shared head, tail tokens, max_new_tokens, LoRA adapter)
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(0, 14), st.integers(1, 24),
              st.sampled_from([None, None, ADAPTERS[0]])),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 10)),
    st.tuples(st.just("flush")),
    st.tuples(st.just("weights")),
), min_size=3, max_size=14)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(ops=OPS, seed=st.integers(0, 2**16))
def test_the_mirror_equals_the_radix_cache_after_any_workload(core, mirror, ops, seed):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 5000) for _ in range(4 * BS + 2)] for _ in range(4)]  # shared heads
    core.runner.load_weights = lambda path: None  # the same weights: the core's side of an update
    for op in ops:
        if op[0] == "add":
            _, which, tail, max_new, lora = op
            tokens = prefixes[which][: rng.randrange(BS, len(prefixes[which]))] + \
                [rng.randrange(1, 5000) for _ in range(tail)]
            add(core, tokens, max_new, lora)
        elif op[0] == "step":
            for _ in range(op[1]):
                step(core)
        elif op[0] == "abort" and core.requests:
            rids = sorted(core.requests)
            core.abort(b"fe", rids[op[1] % len(rids)])
        elif op[0] == "flush":
            core.retract_all()
            core.flush_cache()
        elif op[0] == "weights":
            load_weights(core, core.config.model_path or str(default_gguf_path()))
        seen.extend(list(r.token_ids) for r in core.requests.values())
    while core.has_work:
        step(core)
    settle(core, mirror)


def test_the_mirror_stays_exact_through_preemption_and_eviction(core, mirror):
    """Four long requests outgrow the tiny cache while decoding: preempted, recomputed, evicting."""
    evicted, preempted = core.report.num_evicted_blocks, core.scheduler.num_preemptions
    rng = random.Random(0)
    for _ in range(4):
        add(core, [rng.randrange(1, 5000) for _ in range(30)], 30)
    while core.has_work:
        step(core)
    assert core.report.num_evicted_blocks > evicted and core.scheduler.num_preemptions > preempted
    settle(core, mirror)


def test_a_dropped_subscriber_catches_up_by_replay_and_sees_the_gap(core, mirror):
    start = mirror.last_seq  # where the subscriber below dropped out
    for i in range(3):  # published while it is away
        add(core, [7, 8, 9, 10, 11, 12, 13, 14, 15, i + 1], 3)
    while core.has_work:
        step(core)
    late = Mirror(core.publisher.info().endpoint, core.publisher.info().replay_endpoint)
    late.index.media[0] = {h: set(where) for h, where in mirror.index.media[0].items()}  # what it knew
    late.last_seq = start
    add(core, [9, 9, 9, 9, 9, 9, 9, 9, 1], 2)
    while core.has_work:
        step(core)
    late.pump = core.publisher.serve_replay  # the core server's loop does this; here, the test
    late.drain()
    assert late.gaps and late.gaps[0][0] == start, "the sequence gap went unnoticed"
    assert late.blocks == set(core.scheduler.kv.cache.block_hashes())
    late.close()
    settle(core, mirror)


def test_an_adapter_s_blocks_carry_its_id_and_hash_apart(core, mirror):
    tokens = list(range(100, 100 + 3 * BS))
    for lora in (None, ADAPTERS[1]):
        add(core, tokens, 1, lora)
    while core.has_work:
        step(core)
    before = len(mirror.stored)
    settle(core, mirror)
    ours = [e for e in mirror.events[-8:] if isinstance(e, BlockStored) and e.token_ids[:BS] == tokens[:BS]]
    lora_id = core.loras.by_name[ADAPTERS[1]].id
    assert {e.lora_id for e in ours} == {None, lora_id} and len(mirror.stored) > before
    base, lora = (next(e for e in ours if e.lora_id == x) for x in (None, lora_id))
    assert base.block_hashes[0] != lora.block_hashes[0]  # the same tokens, another adapter


def test_each_data_parallel_rank_publishes_on_its_own_port():
    assert offset_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_port("tcp://*:5557", 3) == "tcp://*:5560"  # vLLM's rule: the port plus the rank
    assert offset_port("tcp://10.0.0.1:*", 3) == "tcp://10.0.0.1:*"  # any free port, for every rank
    assert offset_port("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"


def test_the_option_is_checked_by_field():
    with pytest.raises(ValueError, match="kv_events_config.endpoint"):
        EngineConfig(kv_events_config={"enable_kv_cache_events": True, "endpoint": "localhost:5557"})
    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig(kv_events_config='{"enable_kv_cache_events": true, "port": 1}')
    with pytest.raises(ValueError, match="kv_events_config.enable_kv_cache_events"):
        EngineConfig(kv_events_config={"enable_kv_cache_events": "yes"})
    with pytest.raises(ValueError, match="kv_events_config.buffer_steps"):
        EngineConfig(kv_events_config={"enable_kv_cache_events": True, "buffer_steps": 0})
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineConfig(kv_events_config="{enable")
    cfg = EngineConfig(kv_events_config='{"enable_kv_cache_events": true, "topic": "kv"}')
    assert cfg.kv_events == KVEventsConfig(enable_kv_cache_events=True, topic="kv")
    assert EngineConfig(kv_events_config={"enable_kv_cache_events": False}).kv_events is None


def test_two_engine_processes_hash_alike_and_a_silent_subscriber_changes_nothing():
    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    hashes, ids = [], None
    for _ in range(2):
        with Engine(num_threads=1, block_size=BS, kv_events_config=LOCAL) as engine, ExitStack() as stack:
            info = engine.get_server_info()["kv_events"]
            m = stack.enter_context(closing(Mirror(info["endpoint"], info["replay_endpoint"])))
            ctx = m.ctx  # these sockets close with the mirror, whatever fails
            silent = ctx.socket(zmq.SUB)  # subscribed, never read, the smallest queue: no effect
            silent.setsockopt(zmq.RCVHWM, 1)
            silent.setsockopt(zmq.SUBSCRIBE, b"")
            silent.connect(info["endpoint"])
            load = ctx.socket(zmq.SUB)
            load.setsockopt(zmq.SUBSCRIBE, b"")
            load.connect(info["load_endpoint"])
            out = engine.generate(prompt, {"max_new_tokens": 2, "temperature": 0})
            ids = engine.tokenizer.encode(prompt)  # what /tokenize answers
            assert out["meta_info"]["finish_reason"]
            m.drain()
            hashes.append(m.stored)
            first = next(e for e in m.events if isinstance(e, BlockStored))
            whole = len(ids) // BS * BS
            assert first.token_ids[:whole] == ids[:whole]  # the prompt's tokens, block by block
            assert load.poll(3000), "no load report within a second or so"
            report = msgspec.msgpack.decode(load.recv(), type=LoadReport)
            assert report.kv_blocks_total == engine.get_server_info()["num_blocks"]
            assert report.num_running + report.num_waiting <= 1 and report.data_parallel_rank == 0
            load.close(0)
            # flush_cache and a weight update each clear every block, in one event
            assert engine.flush_cache()
            assert engine.update_weights_from_disk(str(default_gguf_path()))[0]
            m.drain()
            assert not m.blocks
    assert hashes[0] == hashes[1] and hashes[0]
    whole = len(ids) // BS  # the prompt's whole blocks: docs/scaling.md's recipe gives their hashes
    assert hashes[0][0][:whole] == block_hashes(ids, BS)
