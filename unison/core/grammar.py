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

    from unison.core.request import Request

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


class GrammarGate:
    """The core's constrained requests before they run: those whose grammar is compiling (not
    admitted yet) and those whose grammar failed (refused at the next step). The compiler and
    its vocabulary start with the first constrained request."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._vocab = (model_dir, vocab_size, eos_token_ids)
        self._grammars: Grammars | None = None
        self.compiling: list[Request] = []
        self.failed: list[Request] = []

    def compile(self, req: Request, grammar: str) -> None:
        if self._grammars is None:
            self._grammars = Grammars(*self._vocab)
        req.grammar = self._grammars.compile(grammar)
        self.compiling.append(req)

    def poll(self) -> None:
        """Move requests whose grammar finished compiling out of `compiling`."""
        if self.compiling:
            done = [r for r in self.compiling if _compiled(r)]
            self.failed += [r for r in done if _compile_error(r) is not None]
            self.compiling = [r for r in self.compiling if not _compiled(r)]

    def take_failed(self) -> list[tuple[Request, str]]:
        """The requests whose grammar failed, with why, each once."""
        self.poll()
        failed, self.failed = self.failed, []
        return [(req, str(_compile_error(req))) for req in failed]

    def forget(self, req: Request) -> None:
        for pending in (self.compiling, self.failed):
            if req in pending:
                pending.remove(req)

    def close(self) -> None:
        if self._grammars is not None:
            self._grammars.close()


def advance(req: Request, tok: int) -> None:
    """Feed a sampled token to the request's matcher; a finished grammar finishes the request."""
    matcher = req.matcher
    matcher.consume_token(tok)
    if matcher.is_error():  # only a masked-out token could do this: end it, say why
        log.warning("request %s: grammar rejected token %d: %s", req.rid, tok, matcher.get_error())
        req.finish = req.finish or "stop"
    elif matcher.is_stopped() and req.finish is None:
        req.finish = "stop"  # the grammar is complete: nothing more may follow


def _compiled(req: Request) -> bool:
    return req.grammar is not None and req.grammar.done()


def _compile_error(req: Request) -> BaseException | None:
    """Why a compiled grammar failed (None: it did not)."""
    assert req.grammar is not None
    return req.grammar.exception()


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
