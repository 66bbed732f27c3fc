"""EngineCore: schedule, run the model, sample, update. No sockets here (see server.py)."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

from unison.config import EngineConfig
from unison.core.grammar import GrammarGate, advance
from unison.core.kv.block_pool import BlockPool
from unison.core.kv.disk_cache import open_disk_cache
from unison.core.kv.publisher import EventLog
from unison.core.kv.radix_cache import RadixCache
from unison.core.kv.state_pool import StatePool
from unison.core.lora import LoraRegistry
from unison.core.metrics import LatencyMetrics
from unison.core.report import CoreReport
from unison.core.request import Request, check_generate
from unison.core.sampler import Sampled, Sampler, prompt_logprobs
from unison.core.scheduler import ScheduledItem, Scheduler
from unison.core.spec_decode import Drafter, add_drafts, verify
from unison.model.pooling.encoder_config import DecoderPooling, DecoderReranker, encoder_task, model_task
from unison.model.pooling.encoder_runner import EncoderRunner
from unison.model.runner import BatchItem, ModelRunner
from unison.model.weights.loader import default_gguf_path
from unison.wire.messages import EngineStats, Generate, ReqOutput

Outputs = dict[bytes, list[ReqOutput]]  # per frontend identity


class EngineCore:
    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        self.config = config
        self.runner = make_runner(config, model_dir)
        self.task = self.runner.task  # what every request must be: generate, or pooling (embed, rerank)
        if config.model_path is None:  # what is served, so that SGLang's idiom
            # update_weights_from_disk(get_server_info()["model_path"]) works on the embedded model
            config.model_path = str(default_gguf_path())
        model_limit = self.runner.context_length
        self.context_length = min(config.context_length or model_limit, model_limit)
        self.eos_token_ids = frozenset(self.runner.eos_token_ids)
        encoder = isinstance(self.runner, EncoderRunner)  # it keeps no KV: nothing to cache or chunk
        # An int8 cache reads a request's own block as float16 from rows the request computed
        # (model/layers/recent_rows.py): a freed block's copy goes, and a partial-block hit is not copied.
        recent = None if encoder else cast(ModelRunner, self.runner).attention.recent
        self.pool = BlockPool(self.runner.num_blocks, on_free=None if recent is None else recent.drop)
        # The radix cache's changes as KV events, when they are published (core/kv/publisher.py)
        self.kv_events = EventLog(config.block_size) if config.kv_events is not None else None
        # The prefix cache's disk tier (kv_cache_dir), or None
        self.disk = open_disk_cache(config, self.runner, self.kv_events) if config.kv_cache_dir else None
        observers = [o for o in (self.kv_events, self.disk) if o is not None]
        self.states, snapshots = _state_pools(None if encoder else cast(ModelRunner, self.runner), self.disk)
        cache = None if config.disable_radix_cache or encoder else \
            RadixCache(self.pool, config.block_size, observers, snapshots)
        # (a hybrid's partial-block hit would need the state inside the block: not copied)
        runner = None if encoder else cast(ModelRunner, self.runner)
        copy = None if runner is None or recent or self.states else runner.attention.copy_block
        self.scheduler = Scheduler(
            self.pool, block_size=config.block_size, max_running=config.max_running_requests,
            token_budget=config.chunked_prefill_size, cache=cache,
            policy=config.schedule_policy, seed=config.random_seed,
            max_adapters=config.max_loras_per_batch, whole_prompts=encoder, disk=self.disk,
            copy_block=copy, states=self.states,
            snapshot_interval=None if snapshots is None else config.state_snapshot_interval)
        # An encoder never reaches it: make_runner refuses enable_lora for one.
        self.loras = LoraRegistry(cast(ModelRunner, self.runner), max_rank=config.max_lora_rank,
                                  max_loaded=config.max_loaded_loras,
                                  on_free=None if cache is None else cache.drop)
        for module in config.lora_modules():  # a bad one fails the start, naming it
            try:
                self.loras.load(module.name, module.path, module.pinned)
            except ValueError as e:
                raise ValueError(f"lora_paths: {module.name}: {e}") from None
        self.sampler = Sampler(self.runner.vocab_size, self.eos_token_ids)
        spec = config.speculative_config
        assert not isinstance(spec, str)  # EngineConfig parsed it
        self.drafter = None if spec is None else Drafter(spec)
        self.requests: dict[str, Request] = {}  # rid -> request; rids are unique engine-wide
        self.model_dir, self.tokenizer_dir = model_dir, config.tokenizer_path or model_dir  # (SGLang's)
        self.grammar = GrammarGate(self.tokenizer_dir, self.runner.vocab_size, self.eos_token_ids)
        self.holding = False  # a weight update waits: new requests queue, unadmitted, until it is done
        self.counts = EngineStats()  # the running totals; report.stats() adds the live ones
        self.latency = LatencyMetrics()
        self.report = CoreReport(self)
        # Instrumentation for benchmarks (see metrics.StepShapes): called with each forward's
        # (tokens, logits rows) when set, and only then.
        self.on_step: Callable[[int, int], None] | None = None

    @property
    def has_work(self) -> bool:
        """Something to step: a running request, an admissible waiting one (Scheduler.admissible),
        or a request to refuse. Call grammar.poll() first to see finished compiles."""
        sched = self.scheduler
        return bool(sched.running) or bool(self.grammar.failed) or any(map(sched.admissible, sched.waiting))

    def flush_cache(self) -> None:
        """Empty the prefix cache, its disk tier too; RuntimeError while requests hold KV (they
        may share its blocks)."""
        self.scheduler.flush_cache()

    def retract_all(self) -> int:
        """Free the KV of every running request; they wait, first in line, to be recomputed."""
        return self.scheduler.retract_all()

    def hold_new(self, hold: bool) -> None:
        """While held, new requests queue but are not admitted (a weight update waits for what
        is in flight); releasing admits what queued meanwhile."""
        self.holding = hold
        if not hold:
            for req in self.scheduler.waiting:
                req.held = False

    def abort_where(self, match: Callable[[Request], bool], message: str) -> Outputs:
        """End every request `match` selects, whichever frontend owns it (an engine-wide control):
        each ends as aborted with `message`, as a result, not an error."""
        outputs: Outputs = defaultdict(list)
        for req in [r for r in self.requests.values() if match(r)]:
            self._drop(req)
            self.counts.num_aborted += 1
            outputs[req.frontend].append(ReqOutput(req.rid, finish="abort", message=message))
        return outputs

    def close(self) -> None:
        self.grammar.close()
        if self.disk is not None:
            self.disk.close()

    def add(self, frontend: bytes, msg: Generate) -> ReqOutput | None:
        """Queue a request; returns a refusal instead when it cannot be served (or, when the
        frontend asked, word that it was queued)."""
        if msg.rid in self.requests:
            return ReqOutput(msg.rid, finish="abort", error=f"request id {msg.rid!r} is already in flight")
        limit = self.config.max_queued_requests
        waiting = len(self.scheduler.waiting)
        if limit is not None and waiting >= limit:
            return ReqOutput(msg.rid, finish="abort", overloaded=True,
                             error=f"the engine is overloaded: {waiting} requests waiting "
                                   f"(max_queued_requests={limit}); retry later")
        problem = check_generate(msg, self.runner.vocab_size, self.context_length, self.task,
                                 None if self.runner.vision is None else self.runner.vision.spec)
        if problem is None and msg.lora_name is not None:
            if not self.config.enable_lora:
                problem = "lora_path: LoRA is off; start the engine with enable_lora=True (--enable-lora)"
            elif msg.lora_name not in self.loras.by_name:
                return ReqOutput(msg.rid, finish="abort", unknown_adapter=True,
                                 error=f"LoRA adapter {msg.lora_name!r} is not loaded; loaded: "
                                       f"{sorted(self.loras.by_name)}")
        if problem is None:
            req = Request.from_message(frontend, msg)
            req.held = self.holding
            try:
                self.scheduler.add(req)
            except ValueError as e:
                problem = str(e)
            else:
                if msg.lora_name is not None:
                    req.adapter = self.loras.acquire(msg.lora_name)
                self.requests[msg.rid] = req
                if msg.params.grammar is not None:
                    self.grammar.compile(req, msg.params.grammar)
                return ReqOutput(msg.rid, queued=True) if msg.report_queued else None
        return ReqOutput(msg.rid, finish="abort", error=problem)

    def abort(self, frontend: bytes, rid: str, finished: bool = False) -> ReqOutput | None:
        """End a request of `frontend` (only its owner may); `finished`: a stop string ended it
        in the frontend, so it counts as finished there and then."""
        req = self.requests.get(rid)
        if req is None or req.frontend != frontend:
            return None
        self._drop(req)
        if finished:
            self._finished(req, time.monotonic())
            return None  # the frontend has delivered its end already
        self.counts.num_aborted += 1
        return ReqOutput(rid, finish="abort")

    def abort_frontend(self, frontend: bytes) -> list[str]:
        reqs = [r for r in self.requests.values() if r.frontend == frontend]
        for req in reqs:
            self._drop(req)
        self.counts.num_aborted += len(reqs)
        return [r.rid for r in reqs]

    def _finished(self, req: Request, now: float) -> None:
        self.counts.prompt_tokens += req.num_prompt_tokens
        self.counts.num_finished += 1
        self.latency.finished(req.arrival, req.first_token_at, req.last_token_at,
                              req.num_output_tokens, now)

    def _forget(self, req: Request) -> None:
        """The request has left the scheduler: it no longer holds its adapter."""
        del self.requests[req.rid]
        if req.adapter:
            self.loras.release(req.adapter)

    def _drop(self, req: Request) -> None:
        self.scheduler.remove(req)
        self._forget(req)
        self.grammar.forget(req)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        listed = {r.rid for r in self.scheduler}
        if listed != set(self.requests):
            raise AssertionError(f"request table out of sync: {sorted(listed ^ set(self.requests))}")

    # ---- the step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> Outputs:
        refused = self._refuse_bad_grammars()
        if self.disk is not None:
            self.disk.poll()
        items = self.scheduler.schedule()
        if not items:
            return refused
        if self.drafter is not None:
            add_drafts(self.drafter, self.scheduler, items, self.context_length, self.counts.steps)
        scheduled = time.monotonic()  # queue time ends here, before the step's compute
        logits = self.runner.forward([_batch_item(it) for it in items])
        outs = [ReqOutput(it.req.rid, cached_tokens=it.req.cached_tokens) for it in items]
        sampled: Sampled = []
        drafted: list[tuple[int, ScheduledItem, ReqOutput]] = []  # (first row, item, its output)
        row = 0
        for it, out in zip(items, outs):
            n_rows = it.num_new - it.logits_start
            if it.req.pooling and n_rows:  # its last token's row: the vector or scores, nothing to sample
                out.embedding = logits[row].numpy().astype("<f4").tobytes()
            if it.req.wants_prompt_logprobs:
                first_pos = it.req.num_computed_tokens + it.logits_start
                prompt_logprobs(it.req, logits[row: row + n_rows], first_pos, out)
            if it.draft:
                drafted.append((row, it, out))
                it.req.num_computed_tokens += 1  # the last real token; drafts count once accepted
            else:
                if it.sample:
                    sampled.append((row + n_rows - 1, it.req, out))
                it.req.num_computed_tokens += it.num_new
                if it.snapshot_slot >= 0:
                    self.scheduler.kv.cache_computed(it.req, it.snapshot_slot)
                elif it.num_new > 1 and it.req.num_computed_tokens < it.req.num_tokens:
                    self.scheduler.kv.cache_computed(it.req)
            row += n_rows
        self.counts.steps += 1
        if self.on_step is not None:
            self.on_step(sum(it.num_new for it in items), logits.shape[0])
        now = time.monotonic()  # the step's time: what every latency metric is measured at
        for it in items:
            if it.req.scheduled_at is None:  # admitted this step, after its prefix-cache lookup
                it.req.scheduled_at = scheduled
                self.latency.queue.observe(scheduled - it.req.arrival)
                self.counts.prefix_cache_queries += it.req.num_prompt_tokens
                self.counts.prefix_cache_hits += it.req.cached_tokens
        if sampled:
            self._sample(logits[[r for r, _, _ in sampled]], sampled, now)
        if drafted:
            assert self.drafter is not None  # drafted rows come only with speculation on
            kept = verify(self.drafter, self.scheduler, logits, drafted,
                          lambda rows, which: self._sample(rows, which, now), self.counts.steps)
            if self.states is not None:  # a hybrid's states go back to the tokens kept
                cast(ModelRunner, self.runner).keep_drafted_rows({r.state_slot: n for r, n in kept.items()})
        outputs = self._collect(items, outs, now)
        for frontend, refusals in refused.items():
            outputs[frontend] += refusals
        return outputs

    def _refuse_bad_grammars(self) -> Outputs:
        refused: Outputs = defaultdict(list)
        for req, error in self.grammar.take_failed():
            self._drop(req)
            refused[req.frontend].append(ReqOutput(req.rid, finish="abort", error=error))
        return refused

    def _sample(self, logits: torch.Tensor, sampled: Sampled, now: float) -> None:
        result = self.sampler(logits, [req for _, req, _ in sampled])
        ttft, itl = self.latency.ttft, self.latency.itl
        for i, (_, req, out) in enumerate(sampled):
            if req.first_token_at is None:
                req.first_token_at = now
                ttft.observe(now - req.arrival)
            elif req.last_token_at is not None:  # set with the first token
                itl.observe(now - req.last_token_at)
            req.last_token_at = now
            tok = result.token_ids[i]
            req.token_ids.append(tok)
            out.token_ids.append(tok)
            if req.return_logprob and result.logprobs is not None:
                out.logprobs.append(result.logprobs[i])
                if req.top_logprobs_num and result.top_logprobs is not None:
                    out.top_logprobs.append(result.top_logprobs[i][: req.top_logprobs_num])
                row_ids = result.token_ids_logprobs[i] if result.token_ids_logprobs is not None else None
                if req.token_ids_logprob and row_ids is not None:
                    out.token_ids_logprobs.append(row_ids)
            self._check_finish(req, tok)
            if req.constrained:
                advance(req, tok)
            elif req.grammar is not None:  # reasoning: the grammar starts after its closing tokens
                after = req.params.grammar_after
                req.grammar_started = req.token_ids[-len(after):] == after
        self.counts.generation_tokens += len(sampled)

    def _check_finish(self, req: Request, tok: int) -> None:
        p = req.params
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            req.finish, req.matched = "stop", tok
        elif req.num_output_tokens >= p.max_new_tokens or req.num_tokens >= self.context_length:
            req.finish = "length"

    def _collect(self, items: list[ScheduledItem], outs: list[ReqOutput], now: float) -> Outputs:
        """Finish what ended this step; group what there is to report by frontend."""
        outputs: Outputs = defaultdict(list)
        for it, out in zip(items, outs):
            req = it.req
            if req.finish is None and req.num_computed_tokens == req.num_tokens \
                    and req.params.max_new_tokens == 0:
                req.finish = "length"  # prompt only: done once the prompt is computed
            if req.finish is not None:
                self.scheduler.finish(req)
                self._forget(req)
                self._finished(req, now)
                out.finish, out.matched, out.prompt_tokens = req.finish, req.matched, req.num_prompt_tokens
            if out.token_ids or out.finish or out.prompt_logprobs:  # not a silent mid-prompt chunk
                outputs[req.frontend].append(out)
        return outputs


def _batch_item(it: ScheduledItem) -> BatchItem:
    req, start = it.req, it.req.num_computed_tokens
    tokens = req.token_ids[start: start + it.num_new - len(it.draft)] + it.draft
    restore, req.state_restore = req.state_restore, -1  # a hit's snapshot, copied in once
    return BatchItem(tokens, start, req.block_table, it.logits_start, req.adapter, req.state_slot,
                     restore, it.snapshot_slot, drafted=bool(it.draft), images=req.images)


def _state_pools(runner: ModelRunner | None, disk: object) -> tuple[StatePool | None, StatePool | None]:
    """A hybrid model's linear-attention state slots, one per running request, and its prefix
    cache's snapshot slots (those after them); (None, None) for other models."""
    states = None if runner is None else runner.states
    if runner is None or states is None:
        return None, None
    if disk is not None:
        raise ValueError("kv_cache_dir: the disk tier does not keep linear-attention state snapshots; "
                         f"{runner.config.architecture} cannot use it yet")
    snapshots = StatePool(states.snapshots, first=states.slots) if states.snapshots else None
    return StatePool(states.slots), snapshots


def make_runner(config: EngineConfig, model_dir: str) -> ModelRunner | EncoderRunner:
    """The model's runner: an encoder's for embedding and cross-encoder models, else the decoder's.
    A task the model cannot serve is refused here, at start, naming `task`."""
    path = Path(model_dir)
    encoder = encoder_task(json.loads((path / "config.json").read_text()))
    task = model_task(path)
    # A decoder asked to embed (last-token pooling) or rerank (yes / no at the last token)
    pooled = encoder is None and config.task in ("embed", "rerank")
    if config.task not in ("auto", task) and not pooled:
        raise ValueError(f"task: this model serves {task!r}, not {config.task!r}")
    if encoder is not None:
        if config.enable_lora:
            raise ValueError("enable_lora: LoRA adapters run on decoders only, not on an encoder "
                             f"({task}) model")
        return EncoderRunner(model_dir, device=config.device, dtype=config.dtype,
                             quantization=config.quantization, num_threads=config.num_threads,
                             block_size=config.block_size, max_batch_tokens=config.chunked_prefill_size,
                             max_running=config.max_running_requests)
    return ModelRunner(
        config.model_path, model_dir=model_dir, device=config.device, dtype=config.dtype,
        quantization=config.quantization, kv_cache_dtype=config.kv_cache_dtype,
        block_size=config.block_size,
        max_total_tokens=config.max_total_tokens, num_threads=config.num_threads,
        load_format=config.load_format, kv_cache_memory_gb=config.kv_cache_memory_gb,
        mem_fraction_static=config.mem_fraction_static, state_slots=config.max_running_requests,
        # a hybrid's prefix cache keeps as many state snapshots as requests run at once
        state_snapshots=0 if config.disable_radix_cache else config.max_running_requests,
        pooling=(DecoderReranker.from_dir(path) if config.task == "rerank" else
                 DecoderPooling.from_dir(path) if task == "embed" or pooled else None),
        mmproj=config.mmproj,
    )
