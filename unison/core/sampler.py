"""Sampler: per-request sampling parameters applied to a batch of logits.

Randomness depends only on (seed, output position): each row draws its exponential noise from a
generator seeded by both, and samples argmax(p / noise) (equivalent to sampling from p), so a
seeded request gives the same output whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unison.core.grammar import apply_masks
from unison.core.request import Request
from unison.wire.messages import ReqOutput

Sampled = list[tuple[int, Request, ReqOutput]]  # rows to sample: (logits row, request, its output)

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, position) over the seed space


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # log p(token) under the model's own distribution
    top_logprobs: list[list[tuple[int, float]]] | None
    token_ids_logprobs: list[list[float] | None] | None = None  # each row's requested ids


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    vals, ids = logprobs.topk(k, dim=-1)
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]


def prompt_logprobs(req: Request, logits: torch.Tensor, first_row_pos: int, out: ReqOutput) -> None:
    """Add to `out` the prompt logprobs a chunk's logits give: the row at position p scores prompt
    token p + 1 (token 0 has no logprob); `first_row_pos` is the position of the first row."""
    if req.next_prompt_logprob == 0:
        out.prompt_logprobs.append(None)
        if req.top_logprobs_num:
            out.prompt_top_logprobs.append([])
        if req.token_ids_logprob:
            out.prompt_token_ids_logprobs.append(None)
        req.next_prompt_logprob = 1
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


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SampleResult:
        logits = logits.float()  # a copy the core gathered for sampling: ours to change
        raw_logprobs = None
        if any(r.return_logprob for r in reqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_penalties_and_bias(logits, reqs)
        constrained = [i for i, r in enumerate(reqs) if r.constrained]
        if constrained:
            apply_masks(logits, constrained, [reqs[i].matcher for i in constrained])
        tokens = logits.argmax(dim=-1)
        rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rows:
            tokens[rows] = self._sample(logits[rows], [reqs[i] for i in rows])
        token_list = tokens.tolist()
        if raw_logprobs is None:
            return SampleResult(token_list, None, None)
        chosen = raw_logprobs.gather(1, tokens.view(-1, 1)).view(-1).tolist()
        k = max(r.top_logprobs_num for r in reqs)
        by_id = [raw_logprobs[i, r.token_ids_logprob].tolist() if r.token_ids_logprob else None
                 for i, r in enumerate(reqs)]
        return SampleResult(token_list, chosen, top_logprobs(raw_logprobs, k) if k else None,
                            by_id if any(x is not None for x in by_id) else None)

    def _apply_penalties_and_bias(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        cloned = False
        for i, r in enumerate(reqs):
            p = r.params
            suppress = self._suppressed(r)
            if not (p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
                    or p.logit_bias or suppress):
                continue
            if not cloned:
                logits, cloned = logits.clone(), True
            row = logits[i]
            if p.frequency_penalty or p.presence_penalty:
                out = torch.tensor(r.output_ids, dtype=torch.long, device=row.device)
                counts = torch.bincount(out, minlength=self.vocab_size)[: row.numel()].to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.token_ids)), dtype=torch.long, device=row.device)
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            for tid, bias in p.logit_bias.items():
                row[tid] += bias
            if suppress:
                row[list(suppress)] = -float("inf")
        return logits

    def _suppressed(self, r: Request) -> set[int]:
        """Tokens that would end the request before min_new_tokens."""
        if r.num_output_tokens >= r.params.min_new_tokens:
            return set()
        ids = set(r.params.stop_token_ids)
        if not r.params.ignore_eos:
            ids |= self.eos_token_ids
        return {t for t in ids if t < self.vocab_size}

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in reqs], device=logits.device)
        logits = logits / temps.unsqueeze(1)
        top_k = [r.params.top_k for r in reqs]
        if any(k > 0 for k in top_k):
            k_max = min(max(top_k), logits.shape[1])
            kth = logits.topk(k_max, dim=-1).values
            idx = torch.tensor([(k if k > 0 else k_max) - 1 for k in top_k], device=logits.device)
            cutoff = kth.gather(1, idx.clamp(max=k_max - 1).view(-1, 1))
            no_k = torch.tensor([k <= 0 for k in top_k], device=logits.device).view(-1, 1)
            logits = logits.masked_fill((logits < cutoff) & ~no_k, -float("inf"))
        probs = torch.softmax(logits, dim=-1)
        top_p = torch.tensor([r.params.top_p for r in reqs], device=logits.device)
        if (top_p < 1).any():
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop_sorted = sorted_p.cumsum(-1) - sorted_p > top_p.unsqueeze(1)  # keeps the first token
            probs = probs.masked_fill(drop_sorted.scatter(1, order, drop_sorted), 0.0)
        min_p = torch.tensor([r.params.min_p for r in reqs], device=logits.device)
        if (min_p > 0).any():
            floor = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        typical_p = torch.tensor([r.params.typical_p for r in reqs], device=logits.device)
        if (typical_p < 1).any():
            probs = _typical(probs, typical_p)
        noise = torch.empty_like(probs)
        for i, r in enumerate(reqs):
            gen = torch.Generator(device=probs.device)
            gen.manual_seed((r.params.seed * _MIX + r.num_output_tokens) % 2**63)
            noise[i].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)


def _typical(probs: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (Meister et al. 2022), as transformers' TypicalLogitsWarper: keep
    the tokens whose surprise is closest to the distribution's entropy, fewest first, until they
    hold `mass` of the probability; rows with mass 1 are kept whole."""
    p = probs / probs.sum(-1, keepdim=True)  # what earlier filters left, renormalized
    logp = p.log()
    entropy = -(p * logp).nansum(-1, keepdim=True)
    distance = (-logp - entropy).abs()  # inf for tokens already filtered out: sorted last
    sorted_distance, order = distance.sort(dim=-1)
    cumulative = p.gather(-1, order).cumsum(-1)
    last = (cumulative < mass.unsqueeze(1)).sum(-1, keepdim=True).clamp(max=p.shape[-1] - 1)
    drop_sorted = sorted_distance > sorted_distance.gather(-1, last)
    drop = drop_sorted.scatter(-1, order, drop_sorted) & (mass < 1).unsqueeze(1)
    return probs.masked_fill(drop, 0.0)
