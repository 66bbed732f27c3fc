"""LoraRegistry: the engine's LoRA adapters, one registry in the core that every frontend asks.

SGLang keeps its adapter registry in each tokenizer worker, so an adapter loaded through one
worker is unknown to the others; here frontends only name adapters, and the core resolves each
name to an id when a request arrives. A load or unload through any frontend is therefore seen by
every other at once, and no frontend holds a copy that could drift.

An adapter's id is never reused, so a request always runs with the weights it was admitted
with. Unloading removes the name at once (new requests naming it are refused, and the name may
be loaded again); the weights stay until the requests that hold them end. Loaded adapters past
`max_loaded_loras` are evicted least recently used first, unless pinned or in use.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from unison.wire.messages import LoraAdapterInfo

if TYPE_CHECKING:
    from unison.model.runner import ModelRunner


@dataclass(slots=True, eq=False)
class Adapter:
    name: str
    id: int
    path: str
    rank: int
    targets: tuple[str, ...]
    pinned: bool
    loaded_at: float
    requests: int = 0  # queued or running with it: while any, it is never evicted or freed
    last_used: int = 0  # the registry's clock at its last request (LRU)
    served: int = 0  # requests that ran with it (metrics)
    unloaded: bool = False  # its name is gone; freed when its last request ends


class LoraRegistry:
    def __init__(self, runner: ModelRunner, *, max_rank: int, max_loaded: int | None,
                 on_free: Callable[[int], None] | None = None) -> None:
        """`on_free(id)`: an adapter's weights are gone (the prefix cache drops its blocks)."""
        self.runner, self.max_rank, self.max_loaded, self.on_free = runner, max_rank, max_loaded, on_free
        self.by_name: dict[str, Adapter] = {}
        self.by_id: dict[int, Adapter] = {}  # also adapters unloaded while requests still hold them
        self._ids = itertools.count(1)  # 0 is the base model
        self._clock = itertools.count(1)

    def load(self, name: str, path: str, pinned: bool = False) -> str:
        """Load a PEFT adapter under `name`; an error says why not, and nothing changes."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError("lora_name must be a non-empty string")
        if name in self.by_name:
            raise ValueError(f"lora_name {name!r} is already loaded (from {self.by_name[name].path}); "
                             "unload it first")
        if not Path(path).expanduser().exists():
            raise ValueError(f"lora_path {path!r} does not exist")
        from unison.model.layers.lora import read_peft  # torch: the core's side only

        evict = self._to_evict()
        weights = read_peft(Path(path).expanduser(), self.runner.config, self.max_rank)
        adapter_id = next(self._ids)
        self.runner.add_lora(adapter_id, weights)
        if evict is not None:
            self._free(evict)
        adapter = Adapter(name, adapter_id, str(path), weights.rank, weights.targets, pinned, time.time(),
                          last_used=next(self._clock))
        self.by_name[name] = self.by_id[adapter_id] = adapter
        gone = f"; evicted {evict.name!r} (least recently used)" if evict is not None else ""
        return f"loaded LoRA adapter {name!r} (rank {weights.rank}, {', '.join(weights.targets)}){gone}"

    def _to_evict(self) -> Adapter | None:
        """The adapter a new load must make room for, if max_loaded_loras is reached."""
        if self.max_loaded is None or len(self.by_name) < self.max_loaded:
            return None
        idle = [a for a in self.by_name.values() if not a.pinned and a.requests == 0]
        if not idle:
            raise ValueError(f"max_loaded_loras ({self.max_loaded}) adapters are loaded and each is "
                             "pinned or in use; unload one first")
        return min(idle, key=lambda a: a.last_used)

    def unload(self, name: str) -> str:
        adapter = self.by_name.pop(name, None)
        if adapter is None:
            raise ValueError(f"lora_name {name!r} is not loaded; loaded: {sorted(self.by_name)}")
        adapter.unloaded = True
        if adapter.requests == 0:
            self._free(adapter)
            return f"unloaded LoRA adapter {name!r}"
        return (f"unloaded LoRA adapter {name!r}: new requests are refused, and the "
                f"{adapter.requests} in flight finish with it")

    def _free(self, adapter: Adapter) -> None:
        if self.by_name.get(adapter.name) is adapter:
            del self.by_name[adapter.name]
        del self.by_id[adapter.id]
        self.runner.remove_lora(adapter.id)
        if self.on_free is not None:
            self.on_free(adapter.id)

    def acquire(self, name: str) -> int:
        """The id a new request runs with (the name is loaded), held until release()."""
        adapter = self.by_name[name]
        adapter.requests += 1
        adapter.served += 1
        adapter.last_used = next(self._clock)
        return adapter.id

    def release(self, adapter_id: int) -> None:
        adapter = self.by_id.get(adapter_id)
        if adapter is None:
            return
        adapter.requests -= 1
        if adapter.requests == 0 and adapter.unloaded:
            self._free(adapter)

    def infos(self, running: Counter[int], waiting: Counter[int]) -> list[LoraAdapterInfo]:
        """Every loaded adapter, with how many requests run and wait with it (by adapter id)."""
        return [LoraAdapterInfo(a.name, a.id, a.path, a.rank, list(a.targets), a.pinned, running[a.id],
                                waiting[a.id], a.served, a.loaded_at) for a in self.by_name.values()]
