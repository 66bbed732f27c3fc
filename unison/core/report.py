"""What the core reports: its counts, load, info and stats, read from its parts, so that the core
server, the controls and the frontend registry never reach into the scheduler, the block pool or
the adapter registry themselves."""

from __future__ import annotations

from collections import Counter
from typing import Protocol

import msgspec

from unison.config import EngineConfig
from unison.core.kv.block_pool import BlockPool
from unison.core.lora import LoraRegistry
from unison.core.request import Request
from unison.core.scheduler import Scheduler
from unison.core.spec_decode import Drafter
from unison.model.decoder import DecoderModel
from unison.model.pooling.encoder_runner import EncoderRunner
from unison.model.runner import ModelRunner
from unison.wire.messages import CoreInfo, EngineStats, LoraAdapterInfo, RequestInfo


class ReportedCore(Protocol):
    """The engine core's parts a report reads (core/engine_core.py: EngineCore)."""

    config: EngineConfig
    model_dir: str
    tokenizer_dir: str
    context_length: int
    eos_token_ids: frozenset[int]
    runner: ModelRunner | EncoderRunner
    task: str
    pool: BlockPool
    scheduler: Scheduler
    loras: LoraRegistry
    drafter: Drafter | None
    requests: dict[str, Request]
    counts: EngineStats


class CoreReport:
    def __init__(self, core: ReportedCore) -> None:
        self.core = core

    def info(self) -> CoreInfo:
        core, runner = self.core, self.core.runner
        return CoreInfo(
            model_dir=core.model_dir, tokenizer_dir=core.tokenizer_dir, context_length=core.context_length,
            max_req_input_len=core.context_length - 1, vocab_size=runner.vocab_size,
            eos_token_ids=sorted(core.eos_token_ids), block_size=core.config.block_size,
            num_blocks=self.num_blocks, max_total_tokens=self.num_blocks * core.config.block_size,
            quantization=runner.quantization, kv_cache_dtype=str(runner.kv_dtype).removeprefix("torch."),
            weights=runner.model.linear_kinds(), weights_bytes=runner.model.weights_bytes(),
            step_bytes=runner.model.step_bytes() if isinstance(runner.model, DecoderModel) else 0,
            max_queued_requests=core.config.max_queued_requests, task=core.task,
            embedding_size=runner.output_size, rerank_template=runner.rerank_template,
            image=None if runner.vision is None else runner.vision.spec,
        )

    @property
    def num_running(self) -> int:
        return len(self.core.scheduler.holding_kv)  # parked ones run, waiting for their frontend

    @property
    def num_waiting(self) -> int:
        return len(self.core.scheduler.waiting)

    @property
    def num_blocks(self) -> int:
        return self.core.pool.num_blocks

    @property
    def cached_blocks(self) -> int:
        """Blocks only the prefix cache holds: free to evict when requests need room."""
        cache, pool = self.core.scheduler.kv.cache, self.core.pool
        return 0 if cache is None else sum(1 for b in cache.blocks() if pool.refcount(b) == 1)

    @property
    def kv_blocks_used(self) -> int:
        return self.core.pool.num_used - self.cached_blocks

    @property
    def num_evicted_blocks(self) -> int:
        cache = self.core.scheduler.kv.cache
        return cache.num_evicted if cache else 0

    def load(self) -> tuple[int, int, int, int, float, dict[str, int]]:
        """A load report's fields: running, waiting, KV blocks used and total, prefix-cache hit rate,
        and the loaded LoRA adapters' ids (a router hashes an adapter's prompts with it).
        Blocks used are those the running requests hold, counted from their tables (the cache may
        be far larger: kv_blocks_used walks it, too slow for every report)."""
        counts = self.core.counts
        queries = counts.prefix_cache_queries
        rate = counts.prefix_cache_hits / queries if queries else 0.0
        used = len({b for req in self.core.scheduler.holding_kv for b in req.block_table})
        lora_ids = {name: adapter.id for name, adapter in self.core.loras.by_name.items()}
        return self.num_running, self.num_waiting, used, self.num_blocks, rate, lora_ids

    def admissions(self) -> list[tuple[bytes, str]]:
        """(frontend, rid) of the latest admissions, oldest first."""
        return list(self.core.scheduler.admissions)

    def lora_adapters(self) -> list[LoraAdapterInfo]:
        sched = self.core.scheduler
        return self.core.loras.infos(Counter(r.adapter for r in sched.holding_kv),
                                     Counter(r.adapter for r in sched.waiting))

    def requests(self, worker_ids: dict[bytes, int]) -> list[RequestInfo]:
        """Every request the scheduler holds, running first."""
        sched = self.core.scheduler
        running = self.num_running
        return [RequestInfo(r.rid, worker_ids.get(r.frontend, -1), i < running,
                            r.num_prompt_tokens, r.num_tokens - r.num_prompt_tokens, r.params.max_new_tokens,
                            r.cached_tokens) for i, r in enumerate(sched)]

    def requests_per_frontend(self) -> Counter[bytes]:
        return Counter(req.frontend for req in self.core.requests.values())

    def stats(self) -> EngineStats:
        drafter = self.core.drafter
        spec = None if drafter is None else msgspec.structs.replace(
            drafter.stats, accepted_per_pos=list(drafter.stats.accepted_per_pos))
        return msgspec.structs.replace(self.core.counts, num_preemptions=self.core.scheduler.num_preemptions,
                                       spec_decode=spec)
