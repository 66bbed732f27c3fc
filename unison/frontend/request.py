"""A request as its frontend sees it: validated once (GenerateRequest), then followed (ReqState).

ReqState accumulates what the core reports, in place: text, token ids, logprobs, and a version
number. A consumer remembers the version it last saw (collector.py; the HTTP formatter also keeps
text cursors), so however many steps passed since it last looked, it gets everything new as one
merged delta, and nothing is copied per step for a slow consumer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unison.errors import EngineOverloadedError
from unison.frontend.detokenizer import IncrementalDetokenizer
from unison.frontend.sampling_params import SamplingParams
from unison.frontend.tokenizer import Tokenizer
from unison.protocol import ReqOutput

Logprob = tuple[float | None, int, None]  # (logprob, token id, token text), as sglang.Engine


@dataclass(slots=True)
class GenerateRequest:
    """One call's prompts, tokenized and checked: what TokenizerWorker.submit queues as is."""

    input_ids: list[list[int]]  # per prompt
    params: list[SamplingParams]  # per prompt; each runs params.n times
    rids: list[str | None]  # per prompt; None: a fresh id
    batch: bool  # the caller gave lists: results come back as a list
    return_logprob: bool = False
    logprob_start_len: int = -1  # >= 0: prompt logprobs from this position
    top_logprobs_num: int = 0
    priority: int = 0


class ReqState:
    """One request (one of n samples): what the core has reported for it so far."""

    __slots__ = ("rid", "prompt_ids", "return_logprob", "logprob_start_len", "detok", "created",
                 "text", "logprobs", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs",
                 "cached_tokens", "finish_reason", "error", "version", "finished", "waker", "stopped_here",
                 "admission")

    def __init__(self, rid: str, prompt_ids: list[int], params: SamplingParams, tokenizer: Tokenizer,
                 return_logprob: bool, logprob_start_len: int,
                 admission: asyncio.Future | None = None) -> None:
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.detok = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop=params.stop_strings, no_stop_trim=params.no_stop_trim, prompt_ids=prompt_ids,
        )
        self.created = time.monotonic()
        self.text = ""
        self.logprobs: list[Logprob] = []
        self.top_logprobs: list[list[Logprob]] = []
        self.prompt_logprobs: list[Logprob] = []
        self.prompt_top_logprobs: list[list[Logprob]] = []
        self.cached_tokens = 0
        self.finish_reason: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.version = 0  # bumped by every change: a consumer has seen it all when it has seen this
        # update() sets it last, after `version`: a consumer in another thread that sees it
        # finished has the final version to see too.
        self.finished = False
        self.waker: Callable[[], None] | None = None  # the consumer's, called once per step
        self.stopped_here = False  # a stop string ended it here: the core must be told
        # Resolved when the core has queued or refused it (only when the engine has a queue limit).
        self.admission = admission

    @property
    def output_ids(self) -> list[int]:
        return self.detok.output_ids

    def update(self, out: ReqOutput) -> None:
        """Apply one step's output for this request."""
        if out.queued or out.error is not None:
            self._admitted()
            if out.queued:
                return
        detok = self.detok
        before = len(detok.output_ids)
        text = detok.add(out.token_ids)
        if out.finish is None and detok.stop_matched is None and not self.return_logprob \
                and out.error is None:  # a plain decode step: most calls
            self.text += text
            self.version += 1
            return
        stopped = self.detok.stop_matched is not None
        if out.finish is not None or stopped:
            text += self.detok.flush()
        self.text += text
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        if self.return_logprob:
            self._logprobs(out, max(len(self.detok.output_ids) - before, 0))
            # A stop string may end the request before a token whose logprob came earlier.
            del self.logprobs[len(self.detok.output_ids):], self.top_logprobs[len(self.detok.output_ids):]
        if stopped:
            self.finish_reason = {"type": "stop", "matched": self.detok.stop_matched}
            self.stopped_here = out.finish is None
        elif out.error is not None:
            self.error = (EngineOverloadedError(out.error) if out.overloaded
                          else ValueError(out.error) if out.refused else RuntimeError(out.error))
        elif out.finish is not None:
            self.finish_reason = {"type": out.finish, "matched": out.matched}
        self.version += 1
        self.finished = self.finish_reason is not None or self.error is not None
        if self.finished:
            self._admitted()  # ended before the core's "queued" came (an abort): nobody waits on

    def _logprobs(self, out: ReqOutput, kept: int) -> None:
        ids = out.token_ids[:kept]  # a stop string drops the tokens after it
        self.logprobs += [(lp, t, None) for lp, t in zip(out.logprobs, ids)]
        self.top_logprobs += [[(lp, t, None) for t, lp in top] for top in out.top_logprobs[:kept]]
        if out.prompt_logprobs:
            start = max(self.logprob_start_len, 0) + len(self.prompt_logprobs)
            ids = self.prompt_ids[start: start + len(out.prompt_logprobs)]
            self.prompt_logprobs += [(lp, t, None) for lp, t in zip(out.prompt_logprobs, ids)]
            self.prompt_top_logprobs += [[(lp, t, None) for t, lp in top]
                                         for top in out.prompt_top_logprobs]

    def _admitted(self) -> None:
        if self.admission is not None and not self.admission.done():
            self.admission.set_result(None)

    def fail(self, error: BaseException) -> None:
        if not self.finished:
            self.error = error
            self.version += 1
            self.finished = True
            self._admitted()
            self.wake()

    def wake(self) -> None:
        if self.waker is not None:
            try:
                self.waker()
            except RuntimeError:  # the consumer's event loop is closed: nobody is waiting
                self.waker = None
