"""EngineCore: schedule, run the model, sample, update. No sockets here (see server.py)."""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable

import msgspec
import torch

from unison.config import EngineConfig
from unison.core.block_pool import BlockPool
from unison.core.grammar import Grammars
from unison.core.kv_publisher import EventLog
from unison.core.lora import LoraRegistry
from unison.core.metrics import LatencyMetrics
from unison.core.radix_cache import RadixCache
from unison.core.request import Request
from unison.core.sampler import Sampler, top_logprobs
from unison.core.scheduler import ScheduledItem, Scheduler
from unison.core.spec_decode import Drafter
from unison.model.loader import default_gguf_path
from unison.model.runner import BatchItem, ModelRunner
from unison.protocol import CoreInfo, EngineStats, Generate, LoraAdapterInfo, ReqOutput
from unison.sampling import MAX_TOP_LOGPROBS, core_problem

log = logging.getLogger(__name__)

Outputs = dict[bytes, list[ReqOutput]]  # per frontend identity


class EngineCore:
    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        self.config = config
        self.runner = ModelRunner(
            config.model_path, model_dir=model_dir, device=config.device, dtype=config.dtype,
            quantization=config.quantization, kv_cache_dtype=config.kv_cache_dtype,
            block_size=config.block_size,
            max_total_tokens=config.max_total_tokens, num_threads=config.num_threads,
            load_format=config.load_format, kv_cache_memory_gb=config.kv_cache_memory_gb,
            mem_fraction_static=config.mem_fraction_static,
        )
        if config.model_path is None:  # what is served, so that SGLang's idiom
            # update_weights_from_disk(get_server_info()["model_path"]) works on the embedded model
            config.model_path = str(default_gguf_path())
        model_limit = self.runner.context_length
        self.context_length = min(config.context_length or model_limit, model_limit)
        self.eos_token_ids = frozenset(self.runner.eos_token_ids)
        self.pool = BlockPool(self.runner.num_blocks)
        # The radix cache's changes as KV events, when they are published (core/kv_publisher.py)
        self.kv_events = EventLog(config.block_size) if config.kv_events is not None else None
        cache = None if config.disable_radix_cache else \
            RadixCache(self.pool, config.block_size, self.kv_events)
        self.scheduler = Scheduler(
            self.pool, block_size=config.block_size, max_running=config.max_running_requests,
            token_budget=config.chunked_prefill_size, cache=cache,
            policy=config.schedule_policy, seed=config.random_seed,
            max_adapters=config.max_loras_per_batch,
        )
        self.loras = LoraRegistry(self.runner, max_rank=config.max_lora_rank,
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
        self.model_dir = model_dir
        self.grammars: Grammars | None = None  # started by the first constrained request
        self.compiling: list[Request] = []  # waiting for their grammar's matcher
        self.bad_grammars: list[Request] = []  # compiled with an error: refused next step
        self.holding = False  # a weight update waits: new requests queue, unadmitted, until it is done
        self._stats = EngineStats()
        self.latency = LatencyMetrics()
        # Instrumentation for benchmarks (see metrics.StepShapes): called with each forward's
        # (tokens, logits rows) when set, and only then.
        self.on_step: Callable[[int, int], None] | None = None

    @property
    def has_work(self) -> bool:
        """Something to step: a running request, a waiting one that can be admitted (its grammar
        compiled), or a request to refuse. Call poll_grammars() first to see finished compiles."""
        sched = self.scheduler
        return bool(sched.running) or bool(self.bad_grammars) or any(r.ready for r in sched.waiting)

    def poll_grammars(self) -> None:
        """Move requests whose grammar finished compiling out of `compiling` (failures are refused
        at the next step)."""
        if self.compiling:
            done = [r for r in self.compiling if _compiled(r)]
            self.bad_grammars += [r for r in done if _grammar_error(r) is not None]
            self.compiling = [r for r in self.compiling if not _compiled(r)]

    @property
    def cached_blocks(self) -> int:
        """Blocks only the prefix cache holds: free to evict when requests need room."""
        cache = self.scheduler.cache
        return 0 if cache is None else sum(1 for b in cache.blocks() if self.pool.refcount(b) == 1)

    def info(self) -> CoreInfo:
        return CoreInfo(
            model_dir=self.model_dir, context_length=self.context_length,
            max_req_input_len=self.context_length - 1, vocab_size=self.runner.vocab_size,
            eos_token_ids=sorted(self.eos_token_ids), block_size=self.config.block_size,
            num_blocks=self.pool.num_blocks, max_total_tokens=self.pool.num_blocks * self.config.block_size,
            quantization=self.runner.quantization,
            kv_cache_dtype=str(self.runner.kv_dtype).removeprefix("torch."),
            weights=self.runner.model.linear_kinds(), weights_bytes=self.runner.model.weights_bytes(),
            max_queued_requests=self.config.max_queued_requests,
        )

    # ---- what the server reports and controls (so it never reaches into the parts) --------------

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def kv_blocks_used(self) -> int:
        return self.pool.num_used - self.cached_blocks

    @property
    def num_evicted_blocks(self) -> int:
        return self.scheduler.cache.num_evicted if self.scheduler.cache else 0

    def load(self) -> tuple[int, int, int, int, float, dict[str, int]]:
        """A load report's fields: running, waiting, KV blocks used and total, prefix-cache hit rate,
        and the loaded LoRA adapters' ids (a router hashes an adapter's prompts with it).
        Blocks used are those the running requests hold, counted from their tables (the cache may
        be far larger: kv_blocks_used walks it, too slow for every report)."""
        stats = self._stats
        rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        used = len({b for req in self.scheduler.running for b in req.block_table})
        lora_ids = {name: adapter.id for name, adapter in self.loras.by_name.items()}
        return self.num_running, self.num_waiting, used, self.num_blocks, rate, lora_ids

    def admissions(self) -> list[tuple[bytes, str]]:
        """(frontend, rid) of the latest admissions, oldest first."""
        return list(self.scheduler.admissions)

    def lora_adapters(self) -> list[LoraAdapterInfo]:
        sched = self.scheduler
        return self.loras.infos(Counter(r.adapter for r in sched.running),
                                Counter(r.adapter for r in sched.waiting))

    def requests_per_frontend(self) -> Counter[bytes]:
        return Counter(req.frontend for req in self.requests.values())

    def flush_cache(self) -> None:
        """Empty the prefix cache; RuntimeError while requests hold KV (they may share its blocks)."""
        self.scheduler.flush_cache()

    def load_weights(self, model_path: str) -> None:
        """Serve `model_path`'s weights from now on (ValueError: not the same shapes; the old ones
        stay). Whatever holds KV computed with the old weights is recomputed, and the prefix
        cache emptied: no token is ever computed over stale KV."""
        self.runner.load_weights(model_path)
        self.retract_all()
        self.scheduler.flush_cache()
        self.config.model_path = model_path

    def update_tensors(self, path: str, flush_cache: bool = True) -> int:
        """Replace the tensors in the safetensors file `path`, as load_weights does a whole
        checkpoint. `flush_cache=False` keeps the prefix cache (SGLang's: more updates follow,
        and the caller flushes after the last); what holds KV is recomputed either way."""
        count = self.runner.update_tensors(path)
        self.retract_all()
        if flush_cache:
            self.scheduler.flush_cache()
        return count

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
            self._stats.num_aborted += 1
            outputs[req.frontend].append(ReqOutput(req.rid, finish="abort", message=message))
        return outputs

    def close(self) -> None:
        if self.grammars is not None:
            self.grammars.close()

    def stats(self) -> EngineStats:
        spec = None if self.drafter is None else msgspec.structs.replace(
            self.drafter.stats, accepted_per_pos=list(self.drafter.stats.accepted_per_pos))
        return msgspec.structs.replace(self._stats, num_preemptions=self.scheduler.num_preemptions,
                                       spec_decode=spec)

    def add(self, frontend: bytes, msg: Generate) -> ReqOutput | None:
        """Queue a request; returns a refusal instead when it cannot be served (or, when the
        frontend asked, word that it was queued)."""
        if msg.rid in self.requests:
            return ReqOutput(msg.rid, finish="abort", error=f"request id {msg.rid!r} is already in flight")
        limit = self.config.max_queued_requests
        if limit is not None and self.num_waiting >= limit:
            return ReqOutput(msg.rid, finish="abort", overloaded=True,
                             error=f"the engine is overloaded: {self.num_waiting} requests waiting "
                                   f"(max_queued_requests={limit}); retry later")
        problem = self._check(msg)
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
                    self._compile(req, msg.params.grammar)
                return ReqOutput(msg.rid, queued=True) if msg.report_queued else None
        return ReqOutput(msg.rid, finish="abort", error=problem)

    def _check(self, msg: Generate) -> str | None:
        """The frontend validates for its users; the core re-checks everything that could crash a
        step or corrupt its state, since a frontend may be buggy or not ours."""
        n, vocab, p = len(msg.input_ids), self.runner.vocab_size, msg.params
        if n == 0:
            return "input_ids is empty"
        if not 0 <= p.max_new_tokens <= self.context_length - n:
            return (f"prompt ({n} tokens) + max_new_tokens ({p.max_new_tokens}) exceeds the "
                    f"context length ({self.context_length})")
        ids = [*msg.input_ids, *p.stop_token_ids, *p.logit_bias, *msg.token_ids_logprob]
        if min(ids) < 0 or max(ids) >= vocab:
            return f"token ids must be in [0, {vocab - 1}]"
        if (problem := core_problem(p)) is not None:
            return problem
        if not 0 <= msg.top_logprobs_num <= MAX_TOP_LOGPROBS or msg.logprob_start_len < -1:
            return f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}] and logprob_start_len >= -1"
        return None

    def _compile(self, req: Request, grammar: str) -> None:
        if self.grammars is None:
            self.grammars = Grammars(self.model_dir, self.runner.vocab_size, self.eos_token_ids)
        req.grammar = self.grammars.compile(grammar)
        self.compiling.append(req)

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
        self._stats.num_aborted += 1
        return ReqOutput(rid, finish="abort")

    def abort_frontend(self, frontend: bytes) -> list[str]:
        reqs = [r for r in self.requests.values() if r.frontend == frontend]
        for req in reqs:
            self._drop(req)
        self._stats.num_aborted += len(reqs)
        return [r.rid for r in reqs]

    def _finished(self, req: Request, now: float) -> None:
        self._stats.prompt_tokens += req.num_prompt_tokens
        self._stats.num_finished += 1
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
        for pending in (self.compiling, self.bad_grammars):
            if req in pending:
                pending.remove(req)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        listed = {r.rid for r in self.scheduler}
        if listed != set(self.requests):
            raise AssertionError(f"request table out of sync: {sorted(listed ^ set(self.requests))}")

    # ---- the step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> Outputs:
        refused = self._refuse_bad_grammars()
        items = self.scheduler.schedule()
        if not items:
            return refused
        if self.drafter is not None:
            self._add_drafts(items)
        scheduled = time.monotonic()  # queue time ends here, before the step's compute
        logits = self.runner.forward([self._batch_item(it) for it in items])
        outs = [ReqOutput(it.req.rid, cached_tokens=it.req.cached_tokens) for it in items]
        sampled: list[tuple[int, Request, ReqOutput]] = []  # (logits row, request, its output)
        drafted: list[tuple[int, ScheduledItem, ReqOutput]] = []  # (first row, item, its output)
        row = 0
        for it, out in zip(items, outs):
            n_rows = it.num_new - it.logits_start
            if it.req.wants_prompt_logprobs:
                self._prompt_logprobs(it, logits[row: row + n_rows], out)
            if it.draft:
                drafted.append((row, it, out))
                it.req.num_computed_tokens += 1  # the last real token; drafts count once accepted
            else:
                if it.sample:
                    sampled.append((row + n_rows - 1, it.req, out))
                it.req.num_computed_tokens += it.num_new
                if it.num_new > 1 and it.req.num_computed_tokens < it.req.num_tokens:
                    self.scheduler.cache_computed(it.req)
            row += n_rows
        self._stats.steps += 1
        if self.on_step is not None:
            self.on_step(sum(it.num_new for it in items), logits.shape[0])
        now = time.monotonic()  # the step's time: what every latency metric is measured at
        for it in items:
            if it.req.scheduled_at is None:  # admitted this step, after its prefix-cache lookup
                it.req.scheduled_at = scheduled
                self.latency.queue.observe(scheduled - it.req.arrival)
                self._stats.prefix_cache_queries += it.req.num_prompt_tokens
                self._stats.prefix_cache_hits += it.req.cached_tokens
        if sampled:
            self._sample(logits[[r for r, _, _ in sampled]], sampled, now)
        if drafted:
            self._verify(logits, drafted, now)
        outputs = self._collect(items, outs, now)
        for frontend, refusals in refused.items():
            outputs[frontend] += refusals
        return outputs

    # ---- speculative decoding ---------------------------------------------------------------

    def _add_drafts(self, items: list[ScheduledItem]) -> None:
        """Give decoding requests their drafts, within the step's token budget."""
        decoding = [it for it in items if it.sample and it.num_new == 1 and it.req.num_output_tokens > 0]
        if not decoding:
            return
        reqs = [it.req for it in decoding]
        # Room: tokens that could still be kept (the step's own token comes on top of a draft).
        rooms = [min(r.params.max_new_tokens - r.num_output_tokens, self.context_length - r.num_tokens) - 1
                 for r in reqs]
        budget = self.scheduler.token_budget - sum(it.num_new for it in items)
        assert self.drafter is not None  # called with speculation on
        for it, draft in zip(decoding, self.drafter.drafts(reqs, rooms, len(items), self._stats.steps)):
            if draft and budget > 0:
                budget -= self.scheduler.add_draft(it, draft[:budget])

    def _verify(self, logits: torch.Tensor, drafted: list[tuple[int, ScheduledItem, ReqOutput]],
                now: float) -> None:
        """Sample each drafted request's rows in order, exactly as plain decoding samples its steps
        (penalties, grammar and seeded noise see the tokens kept so far), and keep drafted tokens
        while they are what was sampled. Row i's logits are plain decoding's at that position, so
        the tokens kept are plain decoding's, bit for bit; the first differing sample is kept too."""
        assert self.drafter is not None  # drafted rows come only with speculation on
        drafter = self.drafter
        pending = [(row, it.req, out, it.draft) for row, it, out in drafted]
        pos = 0
        while pending:
            self._sample(logits[[row + pos for row, *_ in pending]],
                         [(row + pos, req, out) for row, req, out, _ in pending], now)
            still = []
            for row, req, out, draft in pending:
                if pos < len(draft) and req.finish is None and req.token_ids[-1] == draft[pos]:
                    req.num_computed_tokens += 1  # the drafted token's KV, written this step, holds
                    still.append((row, req, out, draft))
                else:
                    drafter.verified(req, draft, pos, self._stats.steps)
                    self.scheduler.trim(req)
            pending, pos = still, pos + 1

    def _refuse_bad_grammars(self) -> Outputs:
        refused: Outputs = defaultdict(list)
        self.poll_grammars()
        while self.bad_grammars:
            req = self.bad_grammars[0]
            self._drop(req)
            error = str(_grammar_error(req))
            refused[req.frontend].append(ReqOutput(req.rid, finish="abort", error=error))
        return refused

    def _batch_item(self, it: ScheduledItem) -> BatchItem:
        start = it.req.num_computed_tokens
        tokens = it.req.token_ids[start: start + it.num_new - len(it.draft)] + it.draft
        return BatchItem(tokens, start, it.req.block_table, it.logits_start, it.req.adapter)

    def _prompt_logprobs(self, it: ScheduledItem, logits: torch.Tensor, out: ReqOutput) -> None:
        """Row p of the chunk's logits scores prompt token p + 1; token 0 has no logprob."""
        req = it.req
        if req.next_prompt_logprob == 0:
            out.prompt_logprobs.append(None)
            if req.top_logprobs_num:
                out.prompt_top_logprobs.append([])
            if req.token_ids_logprob:
                out.prompt_token_ids_logprobs.append(None)
            req.next_prompt_logprob = 1
        first_row_pos = req.num_computed_tokens + it.logits_start
        lo = max(req.next_prompt_logprob - 1, first_row_pos)
        hi = min(first_row_pos + logits.shape[0], req.num_prompt_tokens - 1)  # rows [lo, hi)
        if lo >= hi:
            return
        rows = torch.log_softmax(logits[lo - first_row_pos: hi - first_row_pos].float(), dim=-1)
        nxt = torch.tensor(req.token_ids[lo + 1: hi + 1], device=rows.device)
        out.prompt_logprobs.extend(rows.gather(1, nxt.view(-1, 1)).view(-1).tolist())
        if req.top_logprobs_num:
            out.prompt_top_logprobs.extend(top_logprobs(rows, req.top_logprobs_num))
        if req.token_ids_logprob:
            out.prompt_token_ids_logprobs.extend(rows[:, req.token_ids_logprob].tolist())
        req.next_prompt_logprob = hi + 1

    def _sample(self, logits: torch.Tensor, sampled: list[tuple[int, Request, ReqOutput]],
                now: float) -> None:
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
                self._advance_grammar(req, tok)
            elif req.grammar is not None:  # reasoning: the grammar starts after its closing tokens
                after = req.params.grammar_after
                req.grammar_started = req.token_ids[-len(after):] == after
        self._stats.generation_tokens += len(sampled)

    def _advance_grammar(self, req: Request, tok: int) -> None:
        matcher = req.matcher
        matcher.consume_token(tok)
        if matcher.is_error():  # only a masked-out token could do this: end it, say why
            log.warning("request %s: grammar rejected token %d: %s", req.rid, tok, matcher.get_error())
            req.finish = req.finish or "stop"
        elif matcher.is_stopped() and req.finish is None:
            req.finish = "stop"  # the grammar is complete: nothing more may follow

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


def _compiled(req: Request) -> bool:
    return req.grammar is not None and req.grammar.done()


def _grammar_error(req: Request) -> BaseException | None:
    """Why a compiled grammar failed (None: it did not)."""
    assert req.grammar is not None
    return req.grammar.exception()
