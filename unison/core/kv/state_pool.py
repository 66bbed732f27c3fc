"""StatePool: the slots of a hybrid model's linear-attention states (model/layers/linear_attention.py
holds the tensors). A request takes one slot when it is admitted, beside its KV blocks, and gives
it back with them; one that finds no slot free waits, as one that finds no block does. A second
pool, of the slots after those, holds the prefix cache's snapshots (core/kv/radix_cache.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class StatePool:
    def __init__(self, num_slots: int, first: int = 0) -> None:
        self.num_slots, self.first = num_slots, first
        self.free = list(range(first + num_slots - 1, first - 1, -1))  # popped from the end: lowest first

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int | None:
        """A free slot, or None when every slot is held."""
        return self.free.pop() if self.free else None

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def check_integrity(self, held: Iterable[int]) -> None:
        """Every slot is free or held by one request, never both, never leaked."""
        owners = Counter(held) + Counter(self.free)
        problems = [f"slot {s} is held or free {n} times" for s, n in owners.items() if n > 1]
        problems += [f"slot {s} is leaked: neither free nor held"
                     for s in range(self.first, self.first + self.num_slots) if not owners[s]]
        if problems:
            raise AssertionError("linear-attention state pool integrity: " + "; ".join(problems[:10]))
