"""CacheBudget: how many KV blocks and linear-attention state slots the memory holds.

The KV cache (blocks of the layers that keep KV) and a hybrid model's state pool (a slot per
running request, and the prefix cache's snapshots) share one budget: `kv_cache_memory_gb`,
SGLang's `mem_fraction_static`, or by default a quarter of the free memory (at most 8 GiB) on
CPU. The states are paid for first; what is left holds blocks.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@dataclass(slots=True)
class CacheBudget:
    block_bytes: int  # one KV block over every layer that keeps KV
    slot_bytes: int  # one request's linear-attention state over every such layer (0: none)
    slots: int  # state slots for running requests
    snapshots: int  # state slots for the prefix cache's snapshots
    device: torch.device

    @property
    def state_bytes(self) -> int:
        """The state pool's memory, snapshots included."""
        return (self.slots + self.snapshots) * self.slot_bytes

    def num_blocks(self, block_size: int, num_blocks: int | None, max_total_tokens: int | None,
                   kv_cache_memory_gb: float | None, mem_fraction_static: float | None,
                   total_memory: int) -> int:
        """The KV blocks the first option given asks for (else the default budget's); a cache that
        does not fit in free memory is refused at start, with the numbers (rather than by the OOM
        killer in the middle of a run)."""
        if num_blocks:
            blocks = num_blocks
        elif max_total_tokens:
            blocks = -(-max_total_tokens // block_size)
        elif kv_cache_memory_gb:
            blocks = self.blocks_for(int(kv_cache_memory_gb * (1 << 30)), "kv_cache_memory_gb")
        elif mem_fraction_static:
            blocks = self._blocks_for_fraction(mem_fraction_static, total_memory)
        else:
            blocks = self._default_blocks()
        need, free = blocks * self.block_bytes, free_memory(self.device)
        if need > free:
            raise ValueError(
                f"the KV cache ({blocks * block_size} tokens, {need / (1 << 30):.2f} GiB) does not fit in "
                f"the {free / (1 << 30):.2f} GiB left after loading the model; lower max_total_tokens or "
                "kv_cache_memory_gb")
        return blocks

    def blocks_for(self, budget: int, name: str) -> int:
        """The KV blocks that fit in `budget` bytes once the state pool is paid for."""
        rest = budget - self.state_bytes
        if rest < self.block_bytes:
            raise ValueError(
                f"{name}: {budget / (1 << 30):.2f} GiB does not hold the linear-attention states "
                f"({self.slots} requests and {self.snapshots} snapshots x {self.slot_bytes / (1 << 20):.1f} "
                "MiB) and a KV block; raise it or lower max_running_requests")
        return rest // self.block_bytes

    def _blocks_for_fraction(self, fraction: float, total: int) -> int:
        """SGLang's mem_fraction_static: weights + KV cache take `fraction` of the memory there
        was before loading, so the KV cache gets what is free now less the (1 - fraction) kept."""
        free = free_memory(self.device)
        rest = free - total * (1 - fraction) - self.state_bytes
        if rest < self.block_bytes:
            raise ValueError(
                f"mem_fraction_static={fraction} leaves no memory for the KV cache: "
                f"{free / (1 << 30):.2f} GiB free of {total / (1 << 30):.2f} GiB after loading the "
                f"weights, {(1 - fraction) * total / (1 << 30):.2f} GiB to keep; raise it")
        return int(rest) // self.block_bytes

    def _default_blocks(self) -> int:
        # CPU: a quarter of available memory, at most 8 GiB (pages are touched only when used).
        # CUDA: most of what is free once the weights are loaded.
        if self.device.type == "cuda":
            budget = int(torch.cuda.mem_get_info(self.device)[0] * 0.85)
        else:
            budget = min(available_memory() // 4, 8 << 30)
        self._fit_states(budget // 2)
        return self.blocks_for(budget, "the default KV budget")

    def _fit_states(self, room: int) -> None:
        """Fewer state slots and snapshots where the asked-for ones would take more than `room`
        (the default budget's half: a large hybrid's 64 states can outweigh it). Requests past
        the slots wait for one, as for KV blocks."""
        if not self.slot_bytes or self.state_bytes <= room:
            return
        fit = max(2, room // self.slot_bytes)
        slots = min(self.slots, max(1, fit // 2))
        snapshots = min(self.snapshots, fit - slots)
        log.warning("linear-attention states: %d slots and %d snapshots fit the default budget (of %d "
                    "and %d asked); set kv_cache_memory_gb for more", slots, snapshots, self.slots,
                    self.snapshots)
        self.slots, self.snapshots = slots, snapshots


def free_memory(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_memory()


def total_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:  # a container's limit, when it has one
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        return min(total, int(limit)) if limit.isdigit() else total
    except OSError:
        return total


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
