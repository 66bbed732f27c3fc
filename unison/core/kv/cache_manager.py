"""KVCacheManager: which KV blocks each request holds.

It allocates from the block pool, starts a request after the longest prefix the radix cache holds
(in RAM, then in its disk tier when there is one), offers computed blocks back to the cache, and
evicts cached prefixes when the pool runs dry. A hybrid model's request also holds a
linear-attention state slot (core/kv/state_pool.py), taken and given back with its blocks. The
scheduler decides who runs and how far; this decides the blocks, as vLLM v1 splits its scheduler
from its KV cache manager.
"""

from __future__ import annotations

from collections.abc import Callable

from unison.core.kv.block_pool import BlockPool
from unison.core.kv.disk_cache import DiskCache
from unison.core.kv.radix_cache import Node, RadixCache
from unison.core.kv.state_pool import StatePool
from unison.core.request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, cache: RadixCache | None = None,
                 disk: DiskCache | None = None, copy_block: Callable[[int, int], None] | None = None,
                 states: StatePool | None = None) -> None:
        self.pool = pool
        self.states = states  # a hybrid model's state slots, or None
        self.block_size = block_size
        self.cache = cache  # None: prefix caching is off
        self.disk = disk  # the cache's disk tier (one of its observers), or None
        self.copy_block = copy_block  # (src, dst): one block's KV into another (the runner's)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_tokens(self) -> int:
        """The most KV tokens the pool holds."""
        return self.pool.num_blocks * self.block_size

    def match_prefix(self, req: Request) -> None:
        """Start a request that holds no blocks after its longest cached prefix (at least one
        token is left to compute)."""
        if self.cache is None or req.block_table:
            return
        limit = req.num_tokens - 1
        if req.wants_prompt_logprobs:  # rows before the first owed logprob are not recomputed
            limit = min(limit, max(req.next_prompt_logprob - 1, 0))
        key = req.cache_ids  # an image's placeholders under the image's own id
        blocks, node = self.cache.match(key[:limit], req.adapter)
        if self.disk is not None and not req.adapter:
            blocks, node = self._load_from_disk(key, limit, blocks, node)
        self.pool.share(blocks)
        self.cache.lock(node)
        req.cache_node, req.block_table = node, blocks
        req.num_computed_tokens = len(blocks) * self.block_size
        if blocks and node.state >= 0:  # a hybrid's hit resumes from the state kept there
            req.state_restore = node.state
        self._copy_partial(req, key[req.num_computed_tokens: limit], node)
        if req.num_preemptions == 0:
            req.cached_tokens = req.num_computed_tokens

    def _copy_partial(self, req: Request, rest: list[int], node: Node) -> None:
        """The cache holds whole blocks only, so a prompt would recompute up to a block's worth of
        tokens past its match (all 16 when it is cached whole: one token is always computed).
        When a cached block starts with some of them, its KV goes into a fresh block of the
        request's own: those tokens are not recomputed (each row's KV depends on its prefix only,
        so the copy is exactly what the request would compute)."""
        assert self.cache is not None
        if self.copy_block is None or not rest or not self.pool.num_free:
            return
        src, n = self.cache.match_partial(node, rest)
        if n:
            [dst] = self.pool.allocate(1)
            self.copy_block(src, dst)
            req.block_table.append(dst)
            req.num_computed_tokens += n

    def _load_from_disk(self, tokens: list[int], limit: int, blocks: list[int],
                        node: Node) -> tuple[list[int], Node]:
        """Extend a RAM match (of tokens[:limit]) with the blocks that follow it on disk: read
        into fresh blocks (evicting, as grow does, but never the matched path), adopted by the
        radix cache. A block past `limit` is read too: _copy_partial then uses its head."""
        assert self.cache is not None and self.disk is not None
        start = len(blocks) * self.block_size
        hashes = self.disk.lookup(node.hashes[-1] if node.hashes else None, tokens[start:])
        if not hashes:
            return blocks, node
        self.cache.lock(node)
        if len(hashes) > self.pool.num_free:
            self.cache.evict(len(hashes) - self.pool.num_free)
        fresh = self.pool.allocate(min(len(hashes), self.pool.num_free))
        loaded = self.disk.load(hashes[: len(fresh)], tokens[start:], fresh)
        self.cache.unlock(node)
        end = start + loaded * self.block_size
        self.cache.insert(tokens[:end], blocks + fresh[:loaded])
        self.pool.release(fresh)  # the cache holds the loaded ones now; the rest go back
        return self.cache.match(tokens[:limit])

    def cached_prefix_len(self, req: Request) -> int:
        """Tokens of the request's prefix the cache holds (the lpm policy's key)."""
        return 0 if self.cache is None else self.cache.match_len(req.cache_ids, req.adapter)

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Blocks for the request's first `num_tokens`, evicting cached prefixes if the pool runs
        dry; False when even that is not enough (nothing is allocated then)."""
        need = self.blocks_for(num_tokens) - len(req.block_table)
        if need > self.pool.num_free and self.cache is not None:
            self.cache.evict(need - self.pool.num_free)
        if need > self.pool.num_free:
            return False
        if self.states is not None and req.state_slot < 0:
            slot = self.states.allocate()
            if slot is None:
                return False
            req.state_slot = slot
        if need > 0:
            req.block_table.extend(self.pool.allocate(need))
        return True

    def grow_for_draft(self, req: Request, end: int, draft: list[int]) -> list[int]:
        """As much of `draft` (tokens after position `end`) as free blocks hold, with its blocks:
        a guess never evicts cached prefixes."""
        room = (len(req.block_table) + self.pool.num_free) * self.block_size - end
        draft = draft[: max(room, 0)]
        need = self.blocks_for(end + len(draft)) - len(req.block_table)
        if need > 0:
            req.block_table.extend(self.pool.allocate(need))
        return draft

    def trim(self, req: Request) -> None:
        """Give back blocks past the request's tokens: those only rejected draft tokens wrote to,
        so they never reach the prefix cache."""
        keep = self.blocks_for(req.num_tokens)
        if len(req.block_table) > keep:
            self.pool.release(req.block_table[keep:])
            del req.block_table[keep:]

    def cache_computed(self, req: Request, snapshot: int = -1) -> None:
        """Offer the request's computed blocks to the prefix cache now (a prefill chunk's), so
        requests sharing the prefix need not wait for it to finish; `snapshot`: a hybrid's state
        after them (a hybrid's cache takes blocks only with one)."""
        if self.cache is not None:
            self.cache.insert(req.cache_ids[: req.num_computed_tokens], req.block_table, req.adapter,
                              snapshot)

    def take_snapshot(self) -> int:
        """A snapshot slot for a hybrid's state at a cached prefix's end (-1: none to be had)."""
        return -1 if self.cache is None or self.cache.snapshots is None else self.cache.take_snapshot()

    def free(self, req: Request, cache: bool = True) -> None:
        """Give back the request's blocks, first offering their computed prefix to the cache."""
        if cache:
            self.cache_computed(req)
        if self.cache is not None and req.cache_node is not None:
            self.cache.unlock(req.cache_node)
            req.cache_node = None
        req.state_restore = -1
        self.pool.release(req.block_table)
        req.block_table = []
        req.num_computed_tokens = 0
        if self.states is not None and req.state_slot >= 0:
            self.states.release(req.state_slot)
            req.state_slot = -1

    def reset_cache(self) -> None:
        """Empty the prefix cache, both tiers."""
        if self.cache is not None:
            self.cache.reset()
        if self.disk is not None:
            self.disk.clear()

    def check_integrity(self, tables: list[list[int]], slots: list[int] | None = None) -> None:
        """Every block is free or held, as often as the requests' `tables` and the cache hold it;
        every state slot free or held by one of the requests (`slots`: theirs)."""
        if self.states is not None:
            self.states.check_integrity([s for s in slots or [] if s >= 0])
        if self.cache is not None:
            self.cache.check_integrity()
            tables = [*tables, self.cache.blocks()]
        self.pool.check_integrity(tables)
