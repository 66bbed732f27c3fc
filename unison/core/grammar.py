"""Constrained decoding in the core, with llguidance.

A request's grammar arrives as llguidance's grammar text (the frontend turned a JSON schema, regex
or EBNF into it and validated it). The core builds a matcher for it on a background thread, so a
request whose grammar is still compiling never stalls the batch: it simply is not admitted yet.
Compiled matchers are cached by grammar text; each request gets a copy. Every step, each
constrained row's logits are masked to the tokens its grammar allows; after sampling, the token
advances the request's matcher. Unconstrained rows are never touched.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

log = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first


class GrammarError(ValueError):
    pass


class Grammars:
    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.model_dir, self.vocab_size, self.eos = model_dir, vocab_size, sorted(eos_token_ids)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="unison-grammar")
        self._tokenizer: Future | None = None
        self._compiled: OrderedDict[str, Future] = OrderedDict()

    def compile(self, grammar: str) -> Future:
        """A future matcher for `grammar`, fresh for one request (raises GrammarError when bad)."""
        if self._tokenizer is None:  # the first constrained request pays for the vocabulary once
            self._tokenizer = self._pool.submit(self._load_tokenizer)
        template = self._compiled.get(grammar)
        if template is None:
            template = self._compiled[grammar] = self._pool.submit(self._build, grammar)
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(grammar)
        fresh: Future = Future()
        template.add_done_callback(lambda t: _copy_into(t, fresh))
        return fresh

    def _load_tokenizer(self) -> LLTokenizer:
        import llguidance

        text = (Path(self.model_dir) / "tokenizer.json").read_text()
        return llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.eos)

    def _build(self, grammar: str) -> LLMatcher:
        import llguidance

        assert self._tokenizer is not None  # submitted by compile before any grammar
        matcher = llguidance.LLMatcher(self._tokenizer.result(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid grammar: {matcher.get_error()}")
        return matcher

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _copy_into(template: Future, fresh: Future) -> None:
    try:
        fresh.set_result(template.result().deep_copy())
    except Exception as e:  # the compile failed: every request waiting on it learns why
        fresh.set_exception(e)


def apply_masks(logits: torch.Tensor, rows: list[int], matchers: list[LLMatcher]) -> None:
    """Masks, in place, logits[row] to the tokens each matcher allows next."""
    vocab = logits.shape[1]
    for row, matcher in zip(rows, matchers):
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        banned = bits[:vocab] == 0
        if logits.device.type == "cpu":
            # numpy, on this thread: a torch op this size opens a parallel region, and on a busy
            # machine one preempted worker stalls it for milliseconds (measured: 38 µs -> 15 ms).
            logits[row].numpy()[banned] = -np.inf
        else:
            logits[row].masked_fill_(torch.from_numpy(banned).to(logits.device), float("-inf"))
