"""A request as its frontend sees it: validated once (GenerateRequest), then followed (ReqState).

ReqState accumulates what the core reports, in place: text, token ids, logprobs, and a version
number. A consumer remembers the version it last saw (collector.py; the HTTP formatter also keeps
text cursors), so however many steps passed since it last looked, it gets everything new as one
merged delta, and nothing is copied per step for a slow consumer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from unison.errors import EngineOverloadedError, FrontendStalledError, UnknownAdapterError
from unison.frontend.sampling_params import SamplingParams
from unison.frontend.text.detokenizer import IncrementalDetokenizer, StopRegex, TokenIds
from unison.frontend.text.tokenizer import Tokenizer
from unison.json_types import JSONObject
from unison.wire.messages import ImageInput, ReqOutput

Logprob = tuple[float | None, int, None]  # (logprob, token id, token text), as sglang.Engine


class StopFinish(msgspec.Struct, frozen=True, tag="stop", tag_field="type"):
    """Ended by a stop condition: `matched` is the stop token id (EOS included), or the stop
    string or stop_regex pattern that the text matched."""

    matched: int | str | None


class LengthFinish(msgspec.Struct, frozen=True, tag="length", tag_field="type"):
    """Ended at max_new_tokens (or the context's end): `length` output tokens."""

    length: int


class AbortFinish(msgspec.Struct, frozen=True, tag="abort", tag_field="type"):
    """Ended by an abort: the client's, or an engine-wide control's (`message` says which)."""

    message: str


FinishReason = StopFinish | LengthFinish | AbortFinish


def finish_reason_dict(reason: FinishReason | None) -> JSONObject | None:
    """SGLang's meta_info["finish_reason"]: {"type": "stop", "matched": ...}, {"type": "length",
    "length": ...} or {"type": "abort", "message": ...}."""
    return None if reason is None else msgspec.to_builtins(reason)


@dataclass(slots=True)
class PromptRequest:
    """One prompt of a call, tokenized and checked; it runs params.n times."""

    input_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # params.max_new_tokens, None resolved to what the context leaves
    rid: str | None = None  # None: a fresh id
    return_logprob: bool = False
    logprob_start_len: int = -1  # >= 0: prompt logprobs from this position
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None  # these ids' logprobs at every position
    lora_name: str | None = None  # a LoRA adapter loaded in the core (None: the base model)
    pooling: bool = False  # embed or score it (frontend/pooling.py): the core answers with a vector
    images: list[ImageInput] = field(default_factory=list)  # prepared (frontend/images.py), in order


@dataclass(slots=True)
class GenerateRequest:
    """One call's prompts: what TokenizerWorker.submit queues as is."""

    prompts: list[PromptRequest]
    batch: bool  # the caller gave lists: results come back as a list
    priority: int = 0


class ReqState:
    """One request (one of n samples): what the core has reported for it so far."""

    __slots__ = ("rid", "prompt_ids", "return_logprob", "logprob_start_len", "token_ids_logprob",
                 "detok", "stop_regex", "created", "text", "logprobs", "top_logprobs", "prompt_logprobs",
                 "prompt_top_logprobs", "ids_logprobs", "prompt_ids_logprobs", "cached_tokens",
                 "finish_reason", "error", "version", "finished", "waker", "stopped_here", "admission",
                 "embedding")

    def __init__(self, rid: str, prompt: PromptRequest, tokenizer: Tokenizer | None,
                 admission: asyncio.Future | None = None) -> None:
        params = prompt.params
        self.rid = rid
        self.prompt_ids = prompt.input_ids
        self.return_logprob = prompt.return_logprob
        self.logprob_start_len = prompt.logprob_start_len
        self.token_ids_logprob = prompt.token_ids_logprob if prompt.return_logprob else None
        self.detok = TokenIds() if tokenizer is None else IncrementalDetokenizer(
            tokenizer, skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop=params.stop_strings, no_stop_trim=params.no_stop_trim, prompt_ids=prompt.input_ids,
        )
        self.stop_regex = StopRegex(params.stop_regexes) if params.stop_regex else None
        self.created = time.monotonic()
        self.text = ""
        self.logprobs: list[Logprob] = []
        self.top_logprobs: list[list[Logprob]] = []
        self.prompt_logprobs: list[Logprob] = []
        self.prompt_top_logprobs: list[list[Logprob]] = []
        self.ids_logprobs: list[list[Logprob]] = []  # token_ids_logprob's, per output token
        self.prompt_ids_logprobs: list[list[Logprob] | None] = []  # ... per prompt position
        self.cached_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.error: BaseException | None = None
        self.version = 0  # bumped by every change: a consumer has seen it all when it has seen this
        # update() sets it last, after `version`: a consumer in another thread that sees it
        # finished has the final version to see too.
        self.finished = False
        self.waker: Callable[[], None] | None = None  # the consumer's, called once per step
        self.stopped_here = False  # a stop string ended it here: the core must be told
        # Resolved when the core has queued or refused it (only when the engine has a queue limit,
        # or the request names a LoRA adapter: only the core knows whether it is loaded).
        self.admission = admission
        self.embedding = b""  # a pooling request's result (float32 bytes), once finished

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
        text = detok.add(out.token_ids) if self.stop_regex is None else self._add_checking_regex(out)
        if out.finish is None and detok.stop_matched is None and not self.return_logprob \
                and out.error is None:  # a plain decode step: most calls
            self.text += text
            self.version += 1
            return
        stopped = self.detok.stop_matched is not None
        if (out.finish is not None or stopped) and not detok.finished:
            text += self._checked(detok.flush(), [text])
        self.text += text
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        self.embedding = out.embedding or self.embedding
        if self.return_logprob:
            self._logprobs(out, max(len(self.detok.output_ids) - before, 0))
            # A stop string may end the request before a token whose logprob came earlier.
            n = len(self.detok.output_ids)
            del self.logprobs[n:], self.top_logprobs[n:], self.ids_logprobs[n:]
        if self.detok.stop_matched is not None:
            self.finish_reason = StopFinish(self.detok.stop_matched)
            self.stopped_here = out.finish is None
        elif out.error is not None:
            self.error = (EngineOverloadedError(out.error) if out.overloaded
                          else FrontendStalledError(out.error) if out.stalled
                          else UnknownAdapterError(f"lora_path: {out.error}") if out.unknown_adapter
                          else ValueError(out.error) if out.refused else RuntimeError(out.error))
        elif out.finish == "length":
            self.finish_reason = LengthFinish(len(self.detok.output_ids))
        elif out.finish == "abort":
            self.finish_reason = AbortFinish(out.message or "Aborted")
        elif out.finish is not None:  # "stop": a stop token id, EOS included
            self.finish_reason = StopFinish(out.matched)
        self.version += 1
        self.finished = self.finish_reason is not None or self.error is not None
        if self.finished:
            self._admitted()  # ended before the core's "queued" came (an abort): nobody waits on

    def _add_checking_regex(self, out: ReqOutput) -> str:
        """Add tokens one by one, so that none follows the one that completes a stop_regex match."""
        parts: list[str] = []
        for token in out.token_ids:
            if self.detok.finished:
                break
            parts.append(self._checked(self.detok.add([token]), parts))
        return "".join(parts)

    def _checked(self, delta: str, parts: Sequence[str] = ()) -> str:
        """`delta` (after self.text and `parts`), cut at the end of a stop_regex match, which
        then ends the request."""
        if self.stop_regex is None or not delta or self.detok.finished:
            return delta
        end = self.stop_regex.search(self.text + "".join(parts) if parts else self.text, delta)
        if end is None:
            return delta
        self.detok.flush()  # nothing after the match is shown
        self.detok.stop_matched = self.stop_regex.matched
        return delta[:end]

    def _logprobs(self, out: ReqOutput, kept: int) -> None:
        ids = out.token_ids[:kept]  # a stop string drops the tokens after it
        self.logprobs += [(lp, t, None) for lp, t in zip(out.logprobs, ids)]
        self.top_logprobs += [[(lp, t, None) for t, lp in top] for top in out.top_logprobs[:kept]]
        wanted = self.token_ids_logprob
        if wanted:
            self.ids_logprobs += [list(zip(lps, wanted, [None] * len(wanted)))
                                  for lps in out.token_ids_logprobs[:kept]]
            self.prompt_ids_logprobs += [None if lps is None else list(zip(lps, wanted, [None] * len(wanted)))
                                         for lps in out.prompt_token_ids_logprobs]
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
