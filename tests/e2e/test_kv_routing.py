"""`--routing kv`: each HTTP worker follows every replica's KV events and load reports.

The policy on fakes first (no processes); then one data-parallel server on its own local Ray: a
prefix cached on replica 1 is served there, and a killed replica's blocks leave the index.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import msgspec
import pytest

from tests import conftest  # pytest's own instance (tests/ is a package: pytest imports it as tests.conftest)
from tests.e2e.test_data_parallel import CACHE_ENV, DPServer, _marked
from tests.utils import HTTP, wait_until
from unison.deploy.replicas import Replicas
from unison.wire.kv_events import KVEventsInfo, LoadReport, block_hashes

BS = 16


class _Info:
    block_size = BS
    kv_events = None


class _Fake:
    def __init__(self, outstanding: int = 0) -> None:
        self.states, self.dead, self.info = dict.fromkeys(range(outstanding)), None, _Info()


def _report(rank: int, running: int) -> LoadReport:
    return LoadReport(time.time(), rank, running, 0, 0, 100, 0.0)


def test_kv_routing_weighs_the_cached_prefix_against_load():
    kv = Replicas([_Fake(), _Fake()], routing="kv")
    prompt = list(range(1, 8 * BS + 5))
    kv.index.apply(1, [_stored(block_hashes(prompt, BS))])
    kv.loads.update({0: _report(0, 0), 1: _report(1, 3)})
    assert kv.pick(None, prompt) is kv.workers[1]  # 3 requests more is worth the whole prefix
    assert kv.pick(None, [9] * (8 * BS)) is kv.workers[0]  # nothing cached: the least loaded
    kv.loads[1] = _report(1, 40)
    assert kv.pick(None, prompt) is kv.workers[0]  # ... until its load outweighs the prefix
    kv.index.forget(1)
    kv.loads.update({0: _report(0, 0), 1: _report(1, 0)})
    assert kv.pick(None, prompt) is kv.workers[0]  # its blocks forgotten: a tie, the lower index


def test_kv_routing_hashes_an_adapters_prompt_with_each_replicas_id_for_it():
    """Each core numbers its adapters itself: the same adapter may be 1 on one replica and 2 on
    the other, and the router hashes the prompt with each one's id (from its load reports)."""
    kv = Replicas([_Fake(), _Fake()], routing="kv")
    prompt = list(range(1, 8 * BS + 5))
    kv.index.apply(0, [_stored(block_hashes(prompt, BS, lora_id=1))])  # "sql" is 1 on replica 0
    kv.index.apply(1, [_stored(block_hashes(prompt, BS, lora_id=1))])  # ... and 1 is "chat" on 1
    kv.loads.update({0: _with_loras(_report(0, 2), sql=1), 1: _with_loras(_report(1, 0), chat=1, sql=2)})
    assert kv.pick(None, prompt, "sql") is kv.workers[0]
    assert kv.pick(None, prompt, "chat") is kv.workers[1]
    assert kv.pick(None, prompt) is kv.workers[1]  # the base model's blocks: cached nowhere


def _with_loras(report: LoadReport, **ids: int) -> LoadReport:
    return msgspec.structs.replace(report, lora_ids=ids)


def test_least_loaded_reads_the_engine_wide_reports_and_counts_what_it_sent_since():
    least = Replicas([_Fake(0), _Fake(0)])
    least.loads.update({0: _report(0, 5), 1: _report(1, 2)})  # other workers' requests, too
    picks = [least.workers.index(least.pick("x")) for _ in range(5)]
    assert picks == [1, 1, 1, 0, 1]  # 2, 3, 4 on replica 1; then 5 = 5: the lower index
    least.loads[1] = _report(1, 0)  # a new report: what was sent is in it
    assert least.pick("x") is least.workers[1]


def store(log, parent: int | None, tokens: tuple[int, ...]) -> list[int]:
    """Blocks stored in the radix cache, as it tells its event log."""
    hashes = block_hashes(list(tokens), BS, None, parent)
    log.stored(parent, hashes, tokens, list(range(len(hashes))), 0)
    return hashes


def test_a_router_feed_catches_up_by_replay_and_follows_the_stream():
    """The HTTP workers' Feed against a publisher: events published before it subscribed come by
    replay, later ones on the stream; load reports land on the board."""
    import zmq

    from unison.config import KVEventsConfig
    from unison.core.kv.publisher import EventLog, Publisher
    from unison.deploy.kv_index import Feed, KVIndex
    from unison.wire.kv_events import KVEventBatch

    async def run() -> None:
        ctx = zmq.Context()
        log = EventLog(BS)
        pub = Publisher(ctx, KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*",
                                            replay_endpoint="tcp://127.0.0.1:*"), 1, log)
        early = store(log, None, tuple(range(2 * BS)))
        pub.publish()  # seq 0 (AllBlocksCleared, then these), before anyone subscribed
        index, loads = KVIndex(), {}
        feed = Feed(1, pub.info(), "127.0.0.1", index, loads)
        try:
            async def serve_until(done) -> None:
                for _ in range(500):
                    pub.serve_replay()
                    pub.publish()
                    pub.report(lambda: (2, 1, 5, 100, 0.5))
                    if done():
                        return
                    await asyncio.sleep(0.01)
                raise AssertionError("the feed did not catch up")

            await serve_until(lambda: index.blocks.get(1) == set(early))
            late = store(log, early[-1], tuple(range(BS)))
            log.removed(early[:1])  # the index applies what it is told, chain or not
            await serve_until(lambda: index.blocks.get(1) == {early[1], *late} and 1 in loads)
            assert feed.gaps == 0 and loads[1].num_running == 2 and loads[1].data_parallel_rank == 1
            # A batch PUB dropped at its high-water mark: buffered for replay, never delivered.
            dropped = store(log, late[-1], tuple(range(BS)))
            pub.buffer.append((pub.seq, pub.encoder.encode(KVEventBatch(0.0, log.take(), 1))))
            pub.seq += 1
            after = store(log, dropped[-1], tuple(range(BS)))
            await serve_until(lambda: set(after) <= index.blocks.get(1, set()))
            assert feed.gaps == 1 and set(dropped) <= index.blocks[1]
        finally:
            feed.close()
            await asyncio.sleep(0)
            pub.close()
            ctx.term()

    asyncio.run(run())


def _stored(hashes):
    from unison.wire.kv_events import BlockStored
    return BlockStored(hashes, None, [], BS, None, "CPU")


@pytest.fixture(scope="module")
def dp(tmp_path_factory):
    mark = str(tmp_path_factory.mktemp("dpkv"))
    conftest.MODULE_TREES.add(mark)
    server = DPServer("--routing", "kv", ray_address=None,
                      env={"UNISON_TEST_MODULE_TREE": mark, "HOME": mark, **CACHE_ENV})
    try:
        yield server
    finally:
        try:
            server.stop()
            wait_until(lambda: not _marked(mark), 10, "every process the server started to exit")
        finally:
            server.kill()
            for pid in _marked(mark):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            conftest.MODULE_TREES.discard(mark)


def _finished(dp) -> list[int]:
    return [r["state"]["stats"]["num_finished"] for r in dp.info()["replicas"]]


def _running(dp) -> list[int | None]:
    """Each replica's running requests, as the HTTP worker's latest load report has them."""
    return [r["load"] and r["load"]["num_running"] for r in dp.info()["replicas"]]


def _complete(dp, prompt: str) -> dict:
    r = HTTP.post(dp.url + "/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_prefix_cached_on_replica_1_is_served_there_and_a_dead_replica_leaves_the_index(dp):
    rows = dp.info()["replicas"]
    assert all(KVEventsInfo(**r["kv_events"]).endpoint.startswith("tcp://") for r in rows)
    prefix = "The archive of the old harbour town keeps its ledgers in one long room. " * 8
    # Replica 0 busy with a long request: the prefix's first request goes to replica 1.
    long = {"prompt": "Count to a thousand.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with HTTP.stream("POST", dp.url + "/v1/completions", timeout=60, json=long) as s:
        lines = s.iter_lines()  # kept: closing it would end the request
        next(line for line in lines if line.startswith("data:"))
        wait_until(lambda: _running(dp) == [1, 0], 10, "replica 0's load report to show the long request")
        before = _finished(dp)
        _complete(dp, prefix + "Question 0?")
        assert _finished(dp)[1] == before[1] + 1
    wait_until(lambda: _running(dp) == [0, 0], 10, "both replicas idle again")
    wait_until(lambda: dp.info()["replicas"][1]["indexed_blocks"] > 0, 10, "replica 1's blocks indexed")
    # Both idle now: least_loaded would pick replica 0; the cached prefix keeps them on 1.
    before = _finished(dp)
    for i in range(1, 5):
        out = _complete(dp, prefix + f"Question {i}?")
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    after = _finished(dp)
    assert (after[0] - before[0], after[1] - before[1]) == (0, 4)

    victim = dp.info()["replicas"][1]["pid"]
    os.kill(victim, signal.SIGKILL)

    def back_and_forgotten() -> bool:
        r = HTTP.get(dp.url + "/get_server_info", timeout=30)  # 503 until its death is seen
        rows = r.json().get("replicas", []) if r.status_code == 200 else []
        return len(rows) == 2 and rows[1]["pid"] != victim and rows[1]["indexed_blocks"] == 0

    wait_until(back_and_forgotten, 40, "replica 1 to come back with nothing indexed", interval=0.3)
    before = _finished(dp)
    _complete(dp, prefix + "Question 9?")
    assert _finished(dp)[0] == before[0] + 1  # its prefix is gone with it: the least loaded again
