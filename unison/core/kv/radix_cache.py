"""RadixCache: a radix tree of token ids over KV blocks, so shared prefixes are computed once.

Edges hold whole blocks: a node's `tokens` is a multiple of block_size long and `blocks` has one
block id per block_size tokens. Each LoRA adapter has a tree of its own (adapter 0: the base
model), since KV computed under one adapter is wrong for every other. The tree holds one
reference (BlockPool.share) on each of its blocks; a request using a cached prefix holds one
more, and locks the path so it is not evicted.
Unlocked leaves are evicted in least-recently-used order when the pool runs short.

A hybrid model (linear-attention layers, whose state is not in the blocks) gives the cache a
pool of state snapshots: a node may hold one, the state after its last token. Only prefixes with
a snapshot are inserted, a match ends at the deepest node that has one, and a snapshot goes with
its node's blocks, or alone (least recently used first) when the snapshot pool runs dry, as
SGLang's radix cache for hybrid models keeps its mamba states.

Observers (core/kv_publisher.EventLog, core/disk_cache.DiskCache) hear each change of the
cached block set: stored(parent hash, the new blocks' hashes, their tokens, blocks, adapter);
removed(hashes); cleared(). The nodes keep each block's chained hash (kv_events.block_hash: they
name what leaves later, and the disk tier's files). Without an observer, nothing is hashed.

Contract:
  match(tokens, adapter)   -> (blocks, node): the longest cached prefix in whole blocks; the
                              caller takes a reference on each block and lock()s the node.
  insert(tokens, blocks, adapter, state) -> how many leading blocks the tree already held (the
                              caller's copies of those are duplicates it simply releases); the
                              rest are adopted, and the snapshot `state` (hybrids) with them.
  take_snapshot()          -> a free snapshot slot (evicting the least recently used), or -1.
  lock(node) / unlock(node)
  evict(n)                 -> blocks freed, at most n.
  drop(adapter)            -> frees a (gone) adapter's whole tree.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import Protocol

from unison.core.kv.block_pool import BlockPool
from unison.core.kv.state_pool import StatePool
from unison.wire.kv_events import block_hashes, lora_id_of

_clock = itertools.count()  # a logical clock: deterministic LRU order, even within one step


class CacheObserver(Protocol):
    def stored(self, parent: int | None, hashes: list[int], tokens: tuple[int, ...], blocks: list[int],
               adapter: int) -> None: ...

    def removed(self, hashes: list[int]) -> None: ...

    def cleared(self) -> None: ...


class Node:
    __slots__ = ("parent", "tokens", "blocks", "hashes", "children", "lock_ref", "last_access", "state")

    def __init__(self, parent: Node | None, tokens: tuple[int, ...], blocks: list[int],
                 hashes: list[int] | None = None) -> None:
        self.parent = parent
        self.tokens = tokens
        self.blocks = blocks
        self.hashes = hashes or []  # one per block, when the cache has an observer
        self.children: dict[tuple[int, ...], Node] = {}  # keyed by the child's first block
        self.lock_ref = 0
        self.last_access = next(_clock)
        self.state = -1  # a hybrid's snapshot of the state after this node's last token (-1: none)

    @property
    def above(self) -> Node:
        """The parent of a node below a root (every node but the roots has one)."""
        assert self.parent is not None
        return self.parent


class RadixCache:
    def __init__(self, pool: BlockPool, block_size: int, observers: Sequence[CacheObserver] = (),
                 snapshots: StatePool | None = None) -> None:
        self.pool = pool
        self.snapshots = snapshots  # a hybrid model's state snapshots; None: the blocks are all
        self.block_size = block_size
        self.observers = list(observers)
        self.roots: dict[int, Node] = {}  # adapter id -> its tree's root (never evicted)
        self.num_evicted = 0  # blocks evicted so far (a statistic)

    def _key(self, tokens: tuple[int, ...] | list[int], i: int = 0) -> tuple[int, ...]:
        return tuple(tokens[i: i + self.block_size])

    def root(self, adapter: int = 0) -> Node:
        node = self.roots.get(adapter)
        if node is None:
            node = self.roots[adapter] = Node(None, (), [])
            node.lock_ref = 1
        return node

    def match(self, tokens: list[int], adapter: int = 0) -> tuple[list[int], Node]:
        blocks, node = self._walk(tokens, adapter)
        if self.snapshots is not None:  # a hit needs the state at its end: back off to one that has it
            while node.parent is not None and node.state < 0:
                del blocks[len(blocks) - len(node.blocks):]
                node = node.parent
        return blocks, node

    def _walk(self, tokens: list[int], adapter: int) -> tuple[list[int], Node]:
        """The cached path along `tokens` in whole blocks, split so that it ends at a node's end."""
        bs, node, blocks, i = self.block_size, self.root(adapter), [], 0
        usable = len(tokens) // bs * bs
        while i < usable:
            child = node.children.get(self._key(tokens, i))
            if child is None:
                break
            n = self._common_blocks(child.tokens, tokens, i)
            if n < len(child.blocks):
                child = self._split(child, n)
            blocks.extend(child.blocks)
            i += len(child.tokens)
            node = child
            node.last_access = next(_clock)
        return blocks, node

    def match_partial(self, node: Node, tokens: list[int]) -> tuple[int, int]:
        """Below `node` (where a match ended), the cached block that starts with the most of
        `tokens` (less than a block): (its id, how many tokens), or (-1, 0)."""
        best, most = -1, 0
        for child in node.children.values():
            n = 0
            while n < len(tokens) and child.tokens[n] == tokens[n]:
                n += 1
            if n > most:
                best, most = child.blocks[0], n
        return best, most

    def match_len(self, tokens: list[int], adapter: int = 0) -> int:
        """Tokens of the longest cached prefix, without touching the tree (for ordering only)."""
        node, i, usable = self.roots.get(adapter), 0, 0
        if node is None:
            return 0
        while (child := node.children.get(self._key(tokens, i))) is not None:
            n = self._common_blocks(child.tokens, tokens, i)
            i += n * self.block_size
            if n < len(child.blocks):
                break
            node = child
            usable = i if node.state >= 0 else usable
        return i if self.snapshots is None else usable

    def _common_blocks(self, edge: tuple[int, ...], tokens: list[int], start: int) -> int:
        bs, n = self.block_size, 0
        while (n + 1) * bs <= len(edge) and start + (n + 1) * bs <= len(tokens) \
                and edge[n * bs: (n + 1) * bs] == tuple(tokens[start + n * bs: start + (n + 1) * bs]):
            n += 1
        return n

    def _split(self, node: Node, n_blocks: int) -> Node:
        """Cut `node` after n_blocks: a new parent holds the head, `node` keeps the tail."""
        cut = n_blocks * self.block_size
        head = Node(node.parent, node.tokens[:cut], node.blocks[:n_blocks], node.hashes[:n_blocks])
        head.lock_ref = node.lock_ref  # (the snapshot, at the end, stays with the tail)
        head.last_access = node.last_access
        node.above.children[self._key(head.tokens)] = head
        node.parent = head
        node.tokens, node.blocks = node.tokens[cut:], node.blocks[n_blocks:]
        node.hashes = node.hashes[n_blocks:]
        head.children[self._key(node.tokens)] = node
        return head

    def insert(self, tokens: list[int], blocks: list[int], adapter: int = 0, state: int = -1) -> int:
        """Cache the whole blocks of `tokens` (KV in `blocks`); returns how many it had already.
        A hybrid's `state` (a snapshot slot, after all of `tokens`, a whole number of blocks) is
        adopted with them, or given back when the cache has one there already."""
        bs = self.block_size
        n_full = min(len(tokens) // bs, len(blocks))
        if self.snapshots is not None and (state < 0 or n_full * bs != len(tokens)):
            if state >= 0:
                self.snapshots.release(state)
            return 0  # a hybrid's blocks without the state at their end could never be a hit
        matched, node = self._walk(tokens[: n_full * bs], adapter)
        have = len(matched)
        if have < n_full:
            rest = tuple(tokens[have * bs: n_full * bs])
            parent = node.hashes[-1] if node.hashes else None
            hashes = block_hashes(list(rest), bs, lora_id_of(adapter), parent) if self.observers else None
            child = Node(node, rest, list(blocks[have:n_full]), hashes)
            node.children[self._key(child.tokens)] = child
            self.pool.share(child.blocks)  # the tree's own reference
            for observer in self.observers:
                observer.stored(parent, child.hashes, rest, child.blocks, adapter)
            node = child
        if state >= 0:
            assert self.snapshots is not None  # only a hybrid's cache takes snapshots
            if node.state >= 0 or node.parent is None:
                self.snapshots.release(state)  # it has that state already
            else:
                node.state = state
        return have

    def take_snapshot(self) -> int:
        """A free snapshot slot, freeing the least recently used unlocked one (and its node's
        blocks, when the node is a leaf: no hit could reach them) if none is; -1 if none can be."""
        assert self.snapshots is not None
        if not self.snapshots.num_free:
            held = [n for n in self._nodes() if n.state >= 0 and n.lock_ref == 0]
            if not held:
                return -1
            oldest = min(held, key=lambda n: n.last_access)
            self.snapshots.release(oldest.state)
            oldest.state = -1
            if not oldest.children:
                self._evict_leaf(oldest)
        slot = self.snapshots.allocate()
        return -1 if slot is None else slot

    def lock(self, node: Node) -> None:
        at: Node | None = node
        while at is not None:
            at.lock_ref += 1
            at = at.parent

    def unlock(self, node: Node) -> None:
        at: Node | None = node
        while at is not None:
            at.lock_ref -= 1
            assert at.lock_ref >= 0, "radix cache: unlock without lock"
            at = at.parent

    def evict(self, n_blocks: int, quiet: bool = False) -> int:
        """Free up to n_blocks by evicting unlocked leaves, least recently used first (`quiet`:
        the caller reports what left)."""
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves() if leaf.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < n_blocks:
            _, _, leaf = heapq.heappop(heap)
            freed += self._evict_leaf(leaf, quiet)
            parent = leaf.above
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _evict_leaf(self, leaf: Node, quiet: bool = False) -> int:
        """Take an unlocked leaf out of the tree, its blocks and snapshot back to their pools;
        returns the blocks that became free."""
        self.pool.release(leaf.blocks)
        if leaf.state >= 0:
            assert self.snapshots is not None
            self.snapshots.release(leaf.state)
            leaf.state = -1
        self.num_evicted += len(leaf.blocks)
        if not quiet:
            self._removed(leaf.hashes)
        del leaf.above.children[self._key(leaf.tokens)]
        return sum(1 for b in leaf.blocks if self.pool.refcount(b) == 0)

    def reset(self) -> None:
        """Evict everything unlocked (all of it, when no request holds KV: then one event says so)."""
        before = set(self.block_hashes())
        self.evict(self.num_blocks, quiet=True)
        if self.num_blocks == 0:
            for observer in self.observers:
                observer.cleared()
        elif gone := before - set(self.block_hashes()):
            self._removed(sorted(gone))

    def drop(self, adapter: int) -> None:
        """Free an adapter's whole tree: the adapter is gone, so nothing can reuse those blocks
        (the registry frees an adapter only once no request holds it: nothing here is locked)."""
        root = self.roots.pop(adapter, None)
        stack = list(root.children.values()) if root is not None else []
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            assert node.lock_ref == 0, "radix cache: dropping an adapter's tree a request holds"
            self.pool.release(node.blocks)
            if node.state >= 0 and self.snapshots is not None:
                self.snapshots.release(node.state)
            self.num_evicted += len(node.blocks)
            self._removed(node.hashes)

    def _removed(self, hashes: list[int]) -> None:
        for observer in self.observers:
            observer.removed(hashes)

    def _nodes(self) -> Iterator[Node]:
        stack = [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _leaves(self) -> Iterator[Node]:
        return (n for n in self._nodes() if not n.children)

    @property
    def num_blocks(self) -> int:
        return sum(len(n.blocks) for n in self._nodes())

    def blocks(self) -> list[int]:
        return [b for n in self._nodes() for b in n.blocks]

    def block_hashes(self) -> list[int]:
        return [h for n in self._nodes() for h in n.hashes]

    def num_evictable(self) -> int:
        return sum(len(n.blocks) for n in self._nodes() if n.lock_ref == 0)

    def snapshot_slots(self) -> list[int]:
        """The snapshot slots the tree holds."""
        return [n.state for n in self._nodes() if n.state >= 0]

    def check_integrity(self) -> None:
        if self.snapshots is not None:
            self.snapshots.check_integrity(self.snapshot_slots())
        for node in self._nodes():
            assert len(node.tokens) == len(node.blocks) * self.block_size, "edge length mismatch"
            assert not self.observers or len(node.hashes) == len(node.blocks), "a block without its hash"
            assert node.above.children.get(self._key(node.tokens)) is node, "broken parent link"
            locks = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= locks, f"node locked less ({node.lock_ref}) than its children ({locks})"
