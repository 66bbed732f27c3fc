"""An int8 cache's recent rows: each query reads its own block's keys and values as float16.

A query weighs its nearest tokens most (previous-token and local heads), so their rounding costs
the most: on SmolLM2's long prompts the rows of the query's own block (its last 1-16 tokens) carry
about half of the attention output's error from int8 keys (KIVI keeps recent tokens in full
precision for the same reason). Here those rows are read exact, as a float16 cache holds them,
and every older row from the q8 blocks (BENCHMARKS.md, long prompts).

Block-aligned, because then whether a row is read exact depends on positions only: a prefix-cache
hit (RAM or disk) ends at a block boundary, so the rows of a query's block were computed by its own
request, in this step or an earlier one. A prompt prefilled whole, in chunks or after a hit still
gives bit-identical attention, and a verified draft what plain decoding gives. The rows this step
computes are passed to the kernel as they are; those an earlier step computed in a block the
request continues mid-way are kept in that block's twin, a float16 copy held from the step that
writes its first kept row until the request's start passes it or the block is freed. A request
holds a twin or two at a time, so they cost a block of float16 or two per running request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from unison.model.kernels.cpu_kernels import Recent


class Item(Protocol):
    """A batch item as the attention and its recent rows read it (runner.BatchItem)."""

    token_ids: list[int]  # the new tokens (only their number matters here)
    start_pos: int  # tokens of the request already in the cache
    block_table: list[int]  # KV block ids covering positions [0, start_pos + len(token_ids))
    logits_start: int  # index into token_ids from which logits are taken (later rows may be rejected drafts)


@dataclass(slots=True)
class RecentStep:
    """A step's recent rows: where each row's twin copy goes, and what each request reads."""

    twin_slots: Tensor  # [rows] int64: twin * block_size + offset, -1: none
    first_row: Tensor  # [requests] int64: the request's first row in the step
    twin: Tensor  # [requests] int64: the twin of that row's block, -1: none (it starts a block)


class RecentRows:
    """The twins of blocks that requests continue mid-way, and the step's rows, float16."""

    def __init__(self, layers: int, block_size: int, kv_heads: int, head_dim: int) -> None:
        self.block_size, self.width = block_size, kv_heads * head_dim
        shape = (layers, 0, block_size, kv_heads, head_dim)
        self.twins_k = torch.zeros(shape, dtype=torch.float16)
        self.twins_v = torch.zeros(shape, dtype=torch.float16)
        self.twin_of: dict[int, int] = {}  # block id -> twin
        self.free: list[int] = []
        self.rows_k = self.rows_v = torch.empty(0, self.width, dtype=torch.float16)

    def drop(self, block: int) -> None:
        """Block `block` is free (the block pool's on_free): its twin, if any, is too."""
        twin = self.twin_of.pop(block, None)
        if twin is not None:
            self.free.append(twin)

    def step(self, batch: Sequence[Item]) -> RecentStep:
        bs = self.block_size
        rows = sum(len(item.token_ids) for item in batch)
        slots = np.full(rows, -1, dtype=np.int64)
        first, reads = np.zeros(len(batch), dtype=np.int64), np.full(len(batch), -1, dtype=np.int64)
        row = 0
        for i, item in enumerate(batch):
            n, start, table = len(item.token_ids), item.start_pos, item.block_table
            self._release_below(table, start // bs)
            first[i] = row
            if start % bs:
                reads[i] = self.twin_of.get(table[start // bs], -1)
            # A later step starts anywhere after the last row whose logits are taken, up to the
            # end; the blocks it may continue mid-way keep twins of this step's rows in them.
            end = start + n
            lo = start + min(item.logits_start, n - 1) + 1
            lo += lo % bs == 0
            for b in range(lo // bs, (end - 1) // bs + 1):
                p0, p1 = max(b * bs, start), min((b + 1) * bs, end)
                slots[row + p0 - start: row + p1 - start] = self._twin(table[b]) * bs + np.arange(p0, p1) % bs
            row += n
        if self.rows_k.shape[0] < rows:  # grown, never shrunk: one step runs at a time
            self.rows_k = torch.empty(rows, self.width, dtype=torch.float16)
            self.rows_v = torch.empty(rows, self.width, dtype=torch.float16)
        return RecentStep(torch.from_numpy(slots), torch.from_numpy(first), torch.from_numpy(reads))

    def layer(self, step: RecentStep, layer: int | None) -> Recent:
        """What the kernels take for one layer (None: every layer's twins, for the compiled decoder)."""
        k, v = (self.twins_k, self.twins_v) if layer is None else (self.twins_k[layer], self.twins_v[layer])
        n = len(step.twin_slots)
        return Recent(self.rows_k[:n], self.rows_v[:n], k, v, step.twin_slots, step.first_row, step.twin)

    def _twin(self, block: int) -> int:
        twin = self.twin_of.get(block)
        if twin is None:
            if not self.free:
                self._grow()
            twin = self.twin_of[block] = self.free.pop()
        return twin

    def _release_below(self, table: list[int], b: int) -> None:
        # A request's twins are its last steps' blocks, consecutive: those before its start go.
        for i in range(b - 1, -1, -1):
            if table[i] not in self.twin_of:
                break
            self.drop(table[i])

    def _grow(self) -> None:
        have = self.twins_k.shape[1]
        more = max(8, have)
        shape = (self.twins_k.shape[0], more, *self.twins_k.shape[2:])
        self.twins_k = torch.cat([self.twins_k, torch.zeros(shape, dtype=torch.float16)], 1)
        self.twins_v = torch.cat([self.twins_v, torch.zeros(shape, dtype=torch.float16)], 1)
        self.free.extend(range(have + more - 1, have - 1, -1))
