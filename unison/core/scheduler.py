"""Scheduler: continuous batching over a paged KV cache.

There is no prefill or decode phase: each request has `num_computed_tokens` and `num_tokens`, and
every step closes part of that gap within a token budget (so long prompts are prefilled in chunks
beside running decodes). Running requests go first; when KV blocks run out the latest arrival is
preempted (its blocks freed, recomputed later); then waiting requests are admitted in the
policy's order, each starting after the longest prefix the radix cache holds (the blocks
themselves are the KV cache manager's, core/kv/cache_manager.py):

  fcfs  arrival order
  lpm   longest cached prefix first (SGLang's), then arrival
  fair  round-robin over frontends, so one that floods the engine cannot starve the others
  random  any waiting request (SGLang's; seeded by random_seed)
Within each, a higher `priority` goes first; preempted requests always go first.

A frontend that falls behind its outputs (core/frontends.py) has its requests parked: they keep
their KV but are not stepped, so nothing more piles up for it, and they are the first preempted
when KV runs short (recomputed once it has caught up and they are admitted again). Its waiting
requests are not admitted meanwhile.

A step holds at most `max_adapters` distinct LoRA adapters (the base model not counted): a
request whose adapter would be one too many waits, and others are admitted past it; once it has
been passed over LORA_PATIENCE times, admission is kept for it (and any such) until its adapter
fits, so a stream of requests for the adapters already running cannot starve it.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from unison.config import POLICIES
from unison.core.kv.block_pool import BlockPool
from unison.core.kv.cache_manager import KVCacheManager
from unison.core.kv.disk_cache import DiskCache
from unison.core.kv.radix_cache import RadixCache
from unison.core.kv.state_pool import StatePool
from unison.core.request import Request

LORA_PATIENCE = 16  # times a request may be passed over for the adapter limit

@dataclass(slots=True)
class ScheduledItem:
    req: Request
    num_new: int  # tokens computed this step
    logits_start: int  # first of the new tokens whose logits are needed (num_new = none)
    sample: bool  # this step reaches the end of the sequence: sample its next token
    draft: list[int] = field(default_factory=list)  # speculated tokens after the last real one
    # A hybrid's prefill chunk that ends where its state is kept for the prefix cache: the
    # snapshot slot the state goes to (-1: none)
    snapshot_slot: int = -1


class Scheduler:
    def __init__(self, pool: BlockPool, *, block_size: int, max_running: int, token_budget: int,
                 cache: RadixCache | None = None, policy: str = "fcfs", seed: int | None = None,
                 max_adapters: int = 8, whole_prompts: bool = False, disk: DiskCache | None = None,
                 copy_block: Callable[[int, int], None] | None = None,
                 states: StatePool | None = None, snapshot_interval: int | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"schedule_policy must be one of {POLICIES}, got {policy!r}")
        self.kv = KVCacheManager(pool, block_size, cache, disk, copy_block, states)
        # A hybrid's prefill keeps its state at these positions for the prefix cache (None: never)
        self.snapshot_interval = snapshot_interval
        self.policy = policy
        self.rng = random.Random(seed)  # the random policy's
        self.last_served: dict[bytes, int] = {}  # frontend -> admission tick (fair)
        self.ticks = itertools.count()
        self.admissions: deque[tuple[bytes, str]] = deque(maxlen=1024)  # (frontend, rid), newest last
        self.max_running = max_running
        self.token_budget = token_budget
        self.max_adapters = max_adapters
        # An encoder attends both ways over a whole sequence: a prompt is never split over steps
        # (one over the budget runs alone).
        self.whole_prompts = whole_prompts
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.parked: list[Request] = []  # running requests of frontends behind: not stepped
        self.behind: set[bytes] = set()  # those frontends
        self.num_preemptions = 0

    def __iter__(self) -> Iterator[Request]:
        yield from self.running
        yield from self.parked
        yield from self.waiting

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def holding_kv(self) -> list[Request]:
        """The requests that hold KV blocks: running and parked (waiting ones hold none)."""
        return self.running + self.parked

    def admissible(self, req: Request) -> bool:
        """A waiting request that may be admitted now: its grammar is compiled and its frontend is
        keeping up."""
        return req.ready and req.frontend not in self.behind

    def set_behind(self, frontend: bytes, behind: bool) -> None:
        """Park a frontend's running requests while it is behind its outputs; resume them when it
        has caught up."""
        if behind == (frontend in self.behind):
            return
        if behind:
            self.behind.add(frontend)
            self.parked += [r for r in self.running if r.frontend == frontend]
            self.running = [r for r in self.running if r.frontend != frontend]
        else:
            self.behind.discard(frontend)
            self.running += [r for r in self.parked if r.frontend == frontend]
            self.parked = [r for r in self.parked if r.frontend != frontend]

    def add(self, req: Request) -> None:
        need = req.num_prompt_tokens + req.params.max_new_tokens
        if need > self.kv.num_tokens:
            raise ValueError(
                f"prompt + max_new_tokens needs {need} KV tokens but the cache holds "
                f"{self.kv.num_tokens}; raise max_total_tokens or shorten the request"
            )
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.parked:
            self.parked.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req)

    def schedule(self) -> list[ScheduledItem]:
        budget, items, preemptions = self.token_budget, [], self.num_preemptions
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, budget)
            if not self._make_room(req, req.num_computed_tokens + n):
                break  # req itself was preempted: nothing after it runs this step
            items.append(self._item(req, n))
            budget -= n
            i += 1
        preempted = self.num_preemptions > preemptions  # then admitting more would only thrash
        adapters = {r.adapter for r in self.running if r.adapter}
        while self.waiting and budget > 0 and len(self.running) < self.max_running and not preempted:
            new = self._next_waiting(adapters)
            if new is None:
                break  # what waits is still compiling its grammar, or its adapter must wait
            self.kv.match_prefix(new)
            n = self._chunk(new, budget)
            if self.whole_prompts and n < new.num_tokens:
                if items:
                    break  # it waits for the next step, first in line
                n = new.num_tokens
            if not self._grow_unparking(new, new.num_computed_tokens + n):
                self.kv.free(new, cache=False)
                break
            self.waiting.remove(new)
            self.running.append(new)
            if new.adapter:
                adapters.add(new.adapter)
            self.last_served[new.frontend] = next(self.ticks)
            self.admissions.append((new.frontend, new.rid))
            items.append(self._item(new, n))
            budget -= n
        return items

    def _snapshot_point(self, req: Request) -> int | None:
        """Where a hybrid's prefill next keeps its state: every snapshot_interval tokens, and at
        the last whole block before the prompt's last token (what a repeat of the prompt can hit)."""
        if self.snapshot_interval is None:
            return None
        start, bs = req.num_computed_tokens, self.kv.block_size
        point = min((start // self.snapshot_interval + 1) * self.snapshot_interval,
                    (req.num_prompt_tokens - 1) // bs * bs)
        return point if point > start else None

    def _chunk(self, req: Request, budget: int) -> int:
        """The tokens req computes this step: what is left of it, within the budget, ending at
        the next snapshot point; and never within an image whose tokens see one another (Gemma
        3's): the chunk ends before it, or, where it starts there, takes the whole image."""
        start = req.num_computed_tokens
        n = min(req.num_tokens - start, budget)
        point = self._snapshot_point(req)
        n = n if point is None else min(n, point - start)
        span = req.image_span(start + n - 1) if req.images else None
        if span is not None and span[1] > start + n:
            n = span[0] - start if span[0] > start else span[1] - start
        return n

    def _item(self, req: Request, n: int) -> ScheduledItem:
        end = req.num_computed_tokens + n
        snapshot = end == self._snapshot_point(req)
        sample = end == req.num_tokens and req.params.max_new_tokens > 0
        logits_start = n - 1 if sample or (req.pooling and end == req.num_tokens) else n
        if req.wants_prompt_logprobs:
            # Row p gives the logprob of prompt token p + 1; position 0 has none.
            lo = max(req.next_prompt_logprob - 1, req.num_computed_tokens)
            if lo < min(end, req.num_prompt_tokens - 1):
                logits_start = min(logits_start, lo - req.num_computed_tokens)
        # a hybrid's state at a prefix the cache will keep: a snapshot slot for it (-1: none free)
        slot = self.kv.take_snapshot() if snapshot else -1
        return ScheduledItem(req, n, logits_start, sample, snapshot_slot=slot)

    def add_draft(self, item: ScheduledItem, draft: list[int]) -> int:
        """Extend a decode item by as much of `draft` as free blocks hold (a guess never evicts
        cached prefixes or preempts anyone); every row is then sampled. Returns the tokens added."""
        draft = self.kv.grow_for_draft(item.req, item.req.num_computed_tokens + item.num_new, draft)
        item.draft, item.num_new, item.logits_start = draft, item.num_new + len(draft), 0
        return len(draft)

    def _next_waiting(self, adapters: set[int]) -> Request | None:
        """The request to admit next (it stays queued until admission succeeds); `adapters`: the
        distinct LoRA adapters of the step so far."""
        def fits(r: Request) -> bool:
            return not r.adapter or r.adapter in adapters or len(adapters) < self.max_adapters

        waiting = [r for r in self.waiting if r.frontend not in self.behind] if self.behind else self.waiting
        if not waiting:
            return None
        head = waiting[0]
        if head.num_preemptions and not head.block_table:
            return head if fits(head) else None  # preempted work resumes first, whatever the policy
        candidates: Iterable[Request] = [r for r in waiting if r.ready]
        if len(adapters) >= self.max_adapters:
            passed_over = [r for r in candidates if not fits(r)]
            for r in passed_over:
                r.adapter_waits += 1
            starving = [r for r in passed_over if r.adapter_waits > LORA_PATIENCE]
            if starving:
                return None  # admit nothing else until an adapter slot frees for them
            candidates = [r for r in candidates if fits(r)]
        else:
            starving = [r for r in candidates if r.adapter_waits > LORA_PATIENCE]
            candidates = starving or candidates  # a freed slot goes to those passed over longest
        if not candidates:
            return None
        if self.policy == "fair":
            fronts = {r.frontend for r in candidates}
            turn = min(fronts, key=lambda f: self.last_served.get(f, -1))
            candidates = [r for r in candidates if r.frontend == turn]
        if self.policy == "random":
            top = max(r.priority for r in candidates)
            return self.rng.choice([r for r in candidates if r.priority == top])
        if self.policy == "lpm":
            cached = self.kv.cached_prefix_len
            return max(candidates, key=lambda r: (r.priority, cached(r), -r.arrival))
        return max(candidates, key=lambda r: (r.priority, -r.arrival))

    def _grow_unparking(self, req: Request, num_tokens: int) -> bool:
        """Grow req's blocks, preempting parked requests (the latest parked first) while that
        is what it takes."""
        while not self.kv.grow(req, num_tokens):
            if not self.parked:
                return False
            self._preempt(self.parked.pop())
        return True

    def _make_room(self, req: Request, num_tokens: int) -> bool:
        """Grow req's blocks, preempting parked requests, then the latest arrivals (never one
        scheduled already, as they come before req) until it fits; False when req itself had to
        go."""
        while not self._grow_unparking(req, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, counted: bool = True) -> None:
        self.kv.free(req)
        req.num_preemptions += 1
        self.num_preemptions += counted
        self.waiting.appendleft(req)

    def retract_all(self) -> int:
        """Free every running request's KV (offered to the prefix cache); they go back to the
        head of the queue in their order and are recomputed when admitted again."""
        retracted = len(self.holding_kv)
        while self.parked:
            self._preempt(self.parked.pop(), counted=False)
        while self.running:
            self._preempt(self.running.pop(), counted=False)
        return retracted

    def finish(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)

    def flush_cache(self) -> None:
        # Waiting requests hold no KV (check_integrity): only those holding KV share cached blocks.
        holding = len(self.holding_kv)
        if holding:
            raise RuntimeError(f"cannot flush the prefix cache while {holding} request(s) hold KV; "
                               "retry when they finish (or pause with mode='retract')")
        self.kv.reset_cache()

    def check_integrity(self) -> None:
        self.kv.check_integrity([req.block_table for req in self], [req.state_slot for req in self])
        held = [req.rid for req in self.waiting if req.block_table or req.state_slot >= 0]
        if held:
            raise AssertionError(f"waiting requests hold KV blocks: {held}")
