"""Scheduler, RadixCache and BlockPool on a tiny pool with exact block ids (no model)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from unison.core.kv.block_pool import BlockPool
from unison.core.kv.radix_cache import RadixCache
from unison.core.request import Request
from unison.core.scheduler import Scheduler
from unison.wire.messages import CoreSamplingParams

BS = 2


def make(num_blocks: int = 8) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(num_blocks)
    return pool, RadixCache(pool, BS)


def owned(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Blocks a finished request held for `tokens` (one reference, its own)."""
    return pool.allocate(-(-len(tokens) // BS))


def check(pool: BlockPool, cache: RadixCache, *tables: list[int]) -> None:
    cache.check_integrity()
    pool.check_integrity([*tables, cache.blocks()])


def test_insert_then_match_returns_the_same_blocks():
    pool, cache = make()
    blocks = owned(pool, [1, 2, 3, 4, 5])  # [0, 1, 2]: the last block is partial
    assert cache.insert([1, 2, 3, 4, 5], blocks) == 0
    pool.release(blocks)  # the request is done: the tree keeps its two full blocks
    assert [pool.refcount(b) for b in range(8)] == [1, 1, 0, 0, 0, 0, 0, 0]
    assert list(pool.free) == [3, 4, 5, 6, 7, 2]
    assert cache.match([1, 2, 3, 4, 9])[0] == [0, 1]
    assert cache.match([1, 2, 3])[0] == [0]  # only whole blocks match
    assert cache.match([9, 9])[0] == []
    check(pool, cache)


def test_partial_edge_match_splits_the_node():
    pool, cache = make()
    blocks = owned(pool, [1, 2, 3, 4, 5, 6])
    cache.insert([1, 2, 3, 4, 5, 6], blocks)
    pool.release(blocks)
    assert len(list(cache._nodes())) == 1
    got, node = cache.match([1, 2, 3, 4, 7, 7])
    assert got == [0, 1] and node.tokens == (1, 2, 3, 4) and node.blocks == [0, 1]
    [tail] = node.children.values()
    assert tail.tokens == (5, 6) and tail.blocks == [2]
    check(pool, cache)


def test_insert_of_a_shared_prefix_reports_the_duplicates():
    pool, cache = make()
    a = owned(pool, [1, 2, 3, 4])
    cache.insert([1, 2, 3, 4], a)
    pool.release(a)
    b = owned(pool, [1, 2, 3, 4, 5, 6])  # computed separately: [2, 3, 4]
    assert b == [2, 3, 4]
    assert cache.insert([1, 2, 3, 4, 5, 6], b) == 2  # blocks 2, 3 duplicate 0, 1; 4 is adopted
    pool.release(b)
    assert cache.match([1, 2, 3, 4, 5, 6])[0] == [0, 1, 4]
    assert sorted(pool.free) == [2, 3, 5, 6, 7]
    check(pool, cache)


def test_locked_nodes_are_not_evicted_and_eviction_is_lru():
    pool, cache = make(num_blocks=6)
    for prompt in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 8, 8]):
        blocks = owned(pool, prompt)
        cache.insert(prompt, blocks)
        pool.release(blocks)
    # Ages: [1,2,3,4] oldest. Touch it, then lock [5,6,...] as a running request would.
    cache.match([1, 2, 3, 4])
    blocks, node = cache.match([5, 6, 7, 8])
    pool.share(blocks)
    cache.lock(node)
    assert cache.evict(2) == 2
    assert cache.match([9, 9, 8, 8])[0] == []  # the least recently used unlocked leaf went first
    assert cache.match([5, 6, 7, 8])[0] == [2, 3]
    assert cache.evict(10) == 2  # only [1,2,3,4] was left to evict
    assert cache.match([5, 6, 7, 8])[0] == [2, 3]
    check(pool, cache, blocks)
    cache.unlock(node)
    pool.release(blocks)
    assert cache.evict(10) == 2 and pool.num_free == 6
    check(pool, cache)


def _req(rid: str, tokens: list[int], max_new: int = 4) -> Request:
    return Request(b"fe", rid, list(tokens), len(tokens), CoreSamplingParams(max_new_tokens=max_new))


def _finish_step(sched: Scheduler) -> list[Request]:
    """Pretend to run one step: computed counters advance, finished requests leave."""
    items = sched.schedule()
    for it in items:
        it.req.num_computed_tokens += it.num_new
        if it.sample:
            it.req.token_ids.append(100)
            if it.req.num_output_tokens >= it.req.params.max_new_tokens:
                sched.finish(it.req)
    return [it.req for it in items]


def test_scheduler_reuses_a_finished_requests_prefix():
    pool = BlockPool(16)
    sched = Scheduler(pool, block_size=BS, max_running=4, token_budget=64,
                      cache=RadixCache(pool, BS))
    first = _req("a", [1, 2, 3, 4, 5, 6, 7], max_new=1)
    sched.add(first)
    _finish_step(sched)
    assert not sched.has_work
    second = _req("b", [1, 2, 3, 4, 5, 6, 8, 9])
    sched.add(second)
    [item] = sched.schedule()
    assert second.cached_tokens == 6 and item.num_new == 2
    assert second.block_table[:3] == [0, 1, 2]  # the first request's three full blocks
    sched.check_integrity()


@settings(max_examples=60, derandomize=True, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "step", "abort", "behind", "caught up"]),
                          st.lists(st.integers(0, 3), min_size=1, max_size=12)), max_size=40))
def test_random_admit_finish_abort_evict_keep_the_invariants(ops):
    """... with two frontends, either of which may fall behind (its requests parked) and catch up."""
    pool = BlockPool(12)
    sched = Scheduler(pool, block_size=BS, max_running=3, token_budget=8,
                      cache=RadixCache(pool, BS))
    for i, (op, tokens) in enumerate(ops):
        frontend = b"fe" if len(tokens) % 2 else b"other"
        if op == "add":
            req = _req(str(i), tokens, max_new=3)
            req.frontend = frontend
            sched.add(req)
        elif op == "step":
            _finish_step(sched)
        elif op == "abort" and (reqs := list(sched)):
            sched.remove(reqs[len(tokens) % len(reqs)])
        elif op in ("behind", "caught up"):
            sched.set_behind(frontend, op == "behind")
        sched.check_integrity()
        assert not any(r.frontend in sched.behind for r in sched.running)
    for frontend in (b"fe", b"other"):
        sched.set_behind(frontend, False)
    while sched.has_work:
        _finish_step(sched)
        sched.check_integrity()
    sched.flush_cache()
    assert pool.num_free == 12


def test_a_frontend_behind_has_its_requests_parked_until_it_catches_up():
    pool = BlockPool(64)
    sched = Scheduler(pool, block_size=BS, max_running=8, token_budget=64, cache=RadixCache(pool, BS))
    for rid, frontend in (("a", b"A"), ("b", b"B")):
        sched.add(Request(frontend, rid, [1, 2, 3], 3, CoreSamplingParams(max_new_tokens=5)))
    assert {r.rid for r in _finish_step(sched)} == {"a", "b"}
    sched.set_behind(b"B", True)
    sched.add(Request(b"B", "b2", [4, 5], 2, CoreSamplingParams(max_new_tokens=5)))
    for _ in range(2):
        assert [r.rid for r in _finish_step(sched)] == ["a"]  # b keeps its KV, b2 waits
    assert [r.rid for r in sched.parked] == ["b"] and sched.parked[0].block_table
    assert [r.rid for r in sched.waiting] == ["b2"] and sched.has_work
    sched.check_integrity()
    sched.set_behind(b"B", False)
    assert {r.rid for r in _finish_step(sched)} == {"a", "b", "b2"}
    assert sched.num_preemptions == 0  # room enough: nothing was recomputed


def test_parked_requests_are_the_first_preempted_when_kv_runs_short():
    """B (behind) holds most of a small pool; A's running request and A's new one need blocks:
    B's are freed for them (A's own are never touched), and B resumes once it has caught up."""
    pool = BlockPool(8)
    sched = Scheduler(pool, block_size=BS, max_running=8, token_budget=64, cache=RadixCache(pool, BS))
    sched.add(Request(b"A", "a", [1, 2], 2, CoreSamplingParams(max_new_tokens=6)))
    sched.add(Request(b"B", "b", [3, 4, 5, 6, 7, 8, 9, 10, 11], 9, CoreSamplingParams(max_new_tokens=3)))
    _finish_step(sched)
    assert pool.num_free == 2  # a: 1 block (+1 once it grows); b: 5
    sched.set_behind(b"B", True)
    sched.add(Request(b"A", "a2", [12, 13, 14, 15, 16], 5, CoreSamplingParams(max_new_tokens=1)))
    ran = [r.rid for r in _finish_step(sched)]
    assert ran == ["a", "a2"] and not sched.parked  # b was preempted to admit a2
    b = next(r for r in sched.waiting if r.rid == "b")
    assert b.num_preemptions == 1 and not b.block_table and sched.num_preemptions == 1
    sched.check_integrity()
    sched.set_behind(b"B", False)
    while sched.has_work:
        _finish_step(sched)
    assert b.num_output_tokens == 3  # recomputed and finished
    sched.check_integrity()


def _policy_sched(policy: str) -> Scheduler:
    pool = BlockPool(64)
    return Scheduler(pool, block_size=BS, max_running=2, token_budget=16,
                     cache=RadixCache(pool, BS), policy=policy)


def _admitted(sched: Scheduler, steps: int) -> list[str]:
    for _ in range(steps):
        _finish_step(sched)
    return [rid for _, rid in sched.admissions]


def test_fair_policy_admits_a_small_frontend_between_a_floods_requests():
    for policy, expect_b_early in (("fair", True), ("fcfs", False)):
        sched = _policy_sched(policy)
        for i in range(100):
            sched.add(Request(b"A", f"a{i}", [1, 2, 3, 4], 4, CoreSamplingParams(max_new_tokens=2)))
        for i in range(4):
            sched.add(Request(b"B", f"b{i}", [5, 6], 2, CoreSamplingParams(max_new_tokens=1)))
        order = _admitted(sched, 12)
        b_at = [order.index(f"b{i}") if f"b{i}" in order else None for i in range(4)]
        if expect_b_early:
            assert None not in b_at and max(b_at) < 10, (policy, order)
        else:
            assert b_at == [None] * 4, (policy, order)  # B waits behind A's queue


def test_priority_and_longest_prefix_order_admission():
    sched = _policy_sched("fcfs")
    for rid, prio in (("low", 0), ("high", 5), ("mid", 1)):
        sched.add(Request(b"A", rid, [1, 2, 3], 3, CoreSamplingParams(max_new_tokens=1), priority=prio))
    assert _admitted(sched, 1) == ["high", "mid"]
    lpm = _policy_sched("lpm")
    done = Request(b"A", "seed", [7, 7, 7, 7, 7, 7, 1], 7, CoreSamplingParams(max_new_tokens=1))
    lpm.add(done)
    _finish_step(lpm)  # caches the blocks of [7, 7, 7, 7, 7, 7]
    lpm.add(Request(b"A", "cold", [9, 9, 9, 9, 9], 5, CoreSamplingParams(max_new_tokens=1)))
    lpm.add(Request(b"A", "warm", [7, 7, 7, 7, 8], 5, CoreSamplingParams(max_new_tokens=1)))
    _finish_step(lpm)
    assert [rid for _, rid in lpm.admissions][1:] == ["warm", "cold"]


def test_a_step_holds_at_most_max_adapters_and_starves_none():
    """Adapter 1's requests keep coming; adapter 2's one request is passed over while 1 fills the
    only adapter slot, then gets it soon after LORA_PATIENCE admissions; the base model never counts."""
    pool = BlockPool(256)
    sched = Scheduler(pool, block_size=BS, max_running=4, token_budget=64, cache=RadixCache(pool, BS),
                      max_adapters=1)

    def add(rid: str, adapter: int, max_new: int = 3) -> None:
        req = Request(b"A", rid, [1, 2, 3], 3, CoreSamplingParams(max_new_tokens=max_new))
        req.adapter = adapter
        sched.add(req)

    for i in range(4):
        add(f"one{i}", 1, 2 + i)  # they end one step apart: adapter 1 never leaves the batch
    add("two", 2)
    add("base", 0)
    admitted_at = None
    for step in range(40):  # without the rule: starved for as long as the flood lasts
        reqs = _finish_step(sched)
        assert len({r.adapter for r in reqs if r.adapter}) <= 1, [r.rid for r in reqs]
        if any(r.rid == "two" for r in reqs):
            admitted_at = step
            break
        add(f"more{step}", 1, 2 + step % 4)  # a flood for the adapter already running
    assert admitted_at is not None, "adapter 2's request starved"
    assert "base" in [rid for _, rid in sched.admissions]  # the base model never waits for a slot


def test_the_prefix_cache_never_shares_blocks_across_adapters():
    pool, cache = make()
    blocks = owned(pool, [1, 2, 3, 4])
    cache.insert([1, 2, 3, 4], blocks, adapter=1)
    pool.release(blocks)
    assert cache.match([1, 2, 3, 4, 5], adapter=1)[0] == blocks
    assert cache.match([1, 2, 3, 4, 5], adapter=2)[0] == [] and cache.match([1, 2, 3, 4, 5])[0] == []
    assert cache.match_len([1, 2, 3, 4, 5], adapter=1) == 4 and cache.match_len([1, 2, 3, 4, 5]) == 0
    check(pool, cache)
    cache.drop(1)  # the adapter is gone: its tree with it
    assert cache.num_blocks == 0 and pool.num_free == 8 and cache.match([1, 2, 3, 4], adapter=1)[0] == []
    check(pool, cache)


def test_chunks_never_split_an_image_and_the_cache_keys_it_by_hash():
    """A prefill chunk ends before an image or takes all of it (its tokens see one another);
    the prefix cache keys an image's placeholders by the image's hash."""
    from unison.core.request import image_key
    from unison.wire.messages import ImageInput

    pool = BlockPool(64)
    sched = Scheduler(pool, block_size=BS, max_running=4, token_budget=5, cache=RadixCache(pool, BS))
    image = ImageInput(b"\x01\x02\x03\x04", offset=3, tokens=6, shape=(3, 1, 1), pixels=b"")
    req = _req("a", [10, 11, 12] + [7] * 6 + [13, 14], max_new=1)
    req.images = [image]
    sched.add(req)
    chunks = []
    while req.num_computed_tokens < req.num_prompt_tokens:
        [item] = sched.schedule()
        chunks.append(item.num_new)
        req.num_computed_tokens += item.num_new
    assert chunks == [3, 6, 2]  # before the image; the image whole (past the budget of 5); the rest
    key = image_key(image.hash)
    assert req.cache_ids == [10, 11, 12] + [key] * 6 + [13, 14] and key >= 1 << 40
    assert req.token_ids == [10, 11, 12] + [7] * 6 + [13, 14]  # what the model and sampler see
