"""BlockPool: the paged KV cache's block allocator. The free list is the allocation order."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable


class BlockPool:
    def __init__(self, num_blocks: int, on_free: Callable[[int], None] | None = None) -> None:
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.refs = [0] * num_blocks  # owners per block (a later prefix cache shares blocks)
        self.on_free = on_free  # (block): told when a block goes back to the free list

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self.free)} free")
        blocks = [self.free.popleft() for _ in range(n)]
        for b in blocks:
            self.refs[b] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """One more owner for blocks already allocated (a prefix-cache hit, the cache's own hold)."""
        for b in blocks:
            assert self.refs[b] > 0, f"block {b} is free: share() needs an allocated block"
            self.refs[b] += 1

    def refcount(self, block: int) -> int:
        return self.refs[block]

    def release(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)
                if self.on_free is not None:
                    self.on_free(b)

    def check_integrity(self, tables: Iterable[list[int]]) -> None:
        """Every block is free or owned, never both, never leaked, refs equal to owners."""
        owners = Counter(b for table in tables for b in table)
        free = Counter(self.free)
        problems = [f"block {b} is on the free list {n} times" for b, n in free.items() if n > 1]
        for b in range(self.num_blocks):
            if free[b] and owners[b]:
                problems.append(f"block {b} is free but owned by {owners[b]} request(s)")
            elif not free[b] and not owners[b]:
                problems.append(f"block {b} is leaked: neither free nor owned")
            if self.refs[b] != owners[b]:
                problems.append(f"block {b} has refcount {self.refs[b]} but {owners[b]} owner(s)")
        if problems:
            raise AssertionError("KV block pool integrity: " + "; ".join(problems[:10]))
