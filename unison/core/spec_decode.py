"""Prompt-lookup (n-gram) drafts for speculative decoding, and the counters vLLM reports for them.

A request in decode proposes up to k tokens: the tokens that followed the latest earlier
occurrence of its last n tokens (n from prompt_lookup_max down to prompt_lookup_min), searched in
its own prompt and output. The engine core verifies the draft in the request's next forward (the
last real token and the draft as one chunk) and keeps the longest prefix that plain decoding would
have produced, plus plain decoding's own next token. Rows of a forward are computed alike whatever
the chunk's shape, so what is kept is bit for bit what plain decoding gives.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from unison.config import SpeculativeConfig
from unison.core.request import Request
from unison.protocol import SpecDecodeStats

# Where to look for a match: the last this many tokens of the sequence. Input-grounded work
# repeats nearby text; an unbounded search would cost a long request O(length) every step.
SEARCH_WINDOW = 4096
# A request whose drafts missed this many times in a row stops drafting for BACKOFF_STEPS steps:
# text its context does not predict then costs almost nothing.
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
        return [propose(r.token_ids, min(c.num_speculative_tokens, room), c.prompt_lookup_max,
                        c.prompt_lookup_min) if room > 0 and step >= r.drafts_resume_at else []
                for r, room in zip(reqs, rooms)]

    def verified(self, req: Request, draft: list[int], accepted: int, step: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += len(draft)
        s.num_accepted_tokens += accepted
        for i in range(accepted):
            s.accepted_per_pos[i] += 1
        req.draft_misses = 0 if accepted else req.draft_misses + 1
        if req.draft_misses >= MAX_MISSES:
            req.drafts_resume_at, req.draft_misses = step + BACKOFF_STEPS, 0
