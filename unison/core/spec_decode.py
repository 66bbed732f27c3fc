"""Prompt-lookup (n-gram) drafts for speculative decoding, and the counters vLLM reports for them.

A request in decode proposes up to k tokens: the tokens that followed the latest earlier
occurrence of its last n tokens (n from prompt_lookup_max down to prompt_lookup_min), searched in
its own prompt and output. The engine core verifies the draft in the request's next forward (the
last real token and the draft as one chunk) and keeps the longest prefix that plain decoding would
have produced, plus plain decoding's own next token. Rows of a forward are computed alike whatever
the chunk's shape, so what is kept is bit for bit what plain decoding gives.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from unison.config import SpeculativeConfig
from unison.core.request import Request
from unison.core.sampler import Sampled
from unison.core.scheduler import ScheduledItem, Scheduler
from unison.wire.messages import ReqOutput, SpecDecodeStats

# Where to look for a match: the last this many tokens of the sequence. Input-grounded work
# repeats nearby text; an unbounded search would cost a long request O(length) every step.
SEARCH_WINDOW = 4096
# A request whose drafts missed this many times in a row stops drafting for BACKOFF_STEPS steps:
# text its context does not predict then costs almost nothing. Between misses, each request's
# draft length follows its acceptance: one past what its last draft kept, one longer after a
# draft kept whole (up to num_speculative_tokens), so a rejected tail is short.
MAX_MISSES = 2
BACKOFF_STEPS = 8


def propose(token_ids: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the last n tokens (longest n first)."""
    tokens = np.asarray(token_ids[-SEARCH_WINDOW:], dtype=np.int64)
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        windows = sliding_window_view(tokens[:-1], n)  # every n-gram with a token after it
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start: start + k].tolist()
    return []


class Drafter:
    """Proposes a step's drafts and counts how they fare.

    Contract: `drafts(reqs, rooms, batch_size, step)` gives one draft per request (possibly empty,
    at most its room), all empty when the step holds more than `disable_by_batch_size` requests;
    `verified(req, draft, accepted, step)` is told the outcome of each non-empty draft."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * config.num_speculative_tokens)

    def drafts(self, reqs: list[Request], rooms: list[int], batch_size: int, step: int) -> list[list[int]]:
        c = self.config
        if batch_size > c.disable_by_batch_size:
            return [[] for _ in reqs]
        return [propose(r.token_ids, min(r.draft_length or c.num_speculative_tokens, room),
                        c.prompt_lookup_max, c.prompt_lookup_min)
                if room > 0 and step >= r.drafts_resume_at else [] for r, room in zip(reqs, rooms)]

    def verified(self, req: Request, draft: list[int], accepted: int, step: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += len(draft)
        s.num_accepted_tokens += accepted
        for i in range(accepted):
            s.accepted_per_pos[i] += 1
        req.draft_misses = 0 if accepted else req.draft_misses + 1
        whole = accepted == len(draft)
        req.draft_length = min(self.config.num_speculative_tokens, accepted + 1 + whole)
        if req.draft_misses >= MAX_MISSES:
            req.drafts_resume_at, req.draft_misses = step + BACKOFF_STEPS, 0


def add_drafts(drafter: Drafter, scheduler: Scheduler, items: list[ScheduledItem], context_length: int,
               step: int) -> None:
    """Give a step's decoding requests their drafts, within the step's token budget."""
    decoding = [it for it in items if it.sample and it.num_new == 1 and it.req.num_output_tokens > 0]
    if not decoding:
        return
    reqs = [it.req for it in decoding]
    # Room: tokens that could still be kept (the step's own token comes on top of a draft).
    rooms = [min(r.params.max_new_tokens - r.num_output_tokens, context_length - r.num_tokens) - 1
             for r in reqs]
    budget = scheduler.token_budget - sum(it.num_new for it in items)
    for it, draft in zip(decoding, drafter.drafts(reqs, rooms, len(items), step)):
        if draft and budget > 0:
            budget -= scheduler.add_draft(it, draft[:budget])


def verify(drafter: Drafter, scheduler: Scheduler, logits: torch.Tensor,
           drafted: list[tuple[int, ScheduledItem, ReqOutput]],
           sample: Callable[[torch.Tensor, Sampled], None], step: int) -> dict[Request, int]:
    """Sample each drafted request's rows in order, exactly as plain decoding samples its steps
    (penalties, grammar and seeded noise see the tokens kept so far), and keep drafted tokens
    while they are what was sampled. Row i's logits are plain decoding's at that position, so
    the tokens kept are plain decoding's, bit for bit; the first differing sample is kept too.
    Returns each request's rows kept: its real token and the draft tokens accepted."""
    pending = [(row, it.req, out, it.draft) for row, it, out in drafted]
    kept: dict[Request, int] = {}
    pos = 0
    while pending:
        rows = [row + pos for row, *_ in pending]
        sample(logits[rows], [(r, req, out) for r, (_, req, out, _) in zip(rows, pending)])
        still = []
        for row, req, out, draft in pending:
            if pos < len(draft) and req.finish is None and req.token_ids[-1] == draft[pos]:
                req.num_computed_tokens += 1  # the drafted token's KV, written this step, holds
                still.append((row, req, out, draft))
            else:
                drafter.verified(req, draft, pos, step)
                scheduler.kv.trim(req)
                kept[req] = pos + 1
        pending, pos = still, pos + 1
    return kept
