"""OpenAI formatting: engine outputs as completion / chat responses, stream chunks, usage and
logprobs, and engine errors in OpenAI's field names.

The stream chunks are msgspec Structs encoded straight to JSON bytes: a streamed token costs
one small struct and one encode, not a dict tree walked by json.dumps.
"""

from __future__ import annotations

import itertools
import time

import msgspec

from unison.errors import InvalidParam
from unison.frontend.collector import Collector
from unison.frontend.reasoning import ReasoningSplitter, split_whole
from unison.frontend.request import LengthFinish, ReqState
from unison.frontend.tokenizer import Tokenizer
from unison.json_types import JSONObject
from unison.sampling import OPTIONS
from unison.server.errors import HTTPError
from unison.server.openai_tools import ToolPlan

# The engine's field names as an OpenAI request spells them (an InvalidParam's `param`).
OPENAI_NAMES = {**{o.name: o.openai for o in OPTIONS if o.openai not in (None, o.name)},
                "input_ids": "prompt", "json_schema": "response_format"}


def invalid_param(e: InvalidParam, openai: bool, chat: bool = False) -> HTTPError:
    """An engine InvalidParam as a 400, in OpenAI's names on /v1 routes."""
    field, message = e.field, str(e)
    if openai:
        field = OPENAI_NAMES.get(field, field)
        message = message.replace(e.field, field)  # (max_new_tokens's message names it twice)
        if chat and field == "prompt":
            field = "messages"  # the prompt is the chat template's output
    return HTTPError(400, message, param=field)


# ---- stream chunks --------------------------------------------------------------------------


class ChatDelta(msgspec.Struct, omit_defaults=True):
    content: str | None = None
    role: str | None = None
    tool_calls: list[JSONObject] | None = None
    reasoning_content: str | None = None  # with a reasoning parser (vLLM's and SGLang's field)


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: JSONObject | None = None


class CompletionChunkChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: JSONObject | None = None


class Chunk(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice | CompletionChunkChoice]  # one kind per chunk
    usage: JSONObject | None = None


def finish_reason(state: ReqState) -> str | None:
    """OpenAI's: "length" at max_tokens, else "stop" (an abort too, as vLLM says it)."""
    fr = state.finish_reason
    return None if fr is None else ("length" if isinstance(fr, LengthFinish) else "stop")


class Formatter:
    """One OpenAI call's outputs, read from its Collector's states with cursors of its own."""

    def __init__(self, tokenizer: Tokenizer, collector: Collector, *, chat: bool, rid: str, model: str,
                 logprobs: bool, top_n: int, echo: bool = False, tokens_as_ids: bool = False,
                 tools: ToolPlan | None = None, reasoning: tuple[str, str] | None = None) -> None:
        """`reasoning`: (parser, the rendered prompt): the output's reasoning section apart."""
        self.tokenizer, self.collector, self.chat = tokenizer, collector, chat
        self.rid, self.model = rid, model
        self.logprobs, self.top_n, self.echo = logprobs, top_n, echo
        self.tokens_as_ids = tokens_as_ids  # vLLM's return_tokens_as_token_ids
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        n = len(collector.states)
        self.sent_text = [0] * n  # characters streamed, per choice
        self.sent_lp = [0] * n  # output logprobs streamed
        self.sent_prompt_lp = [0] * n  # echo: prompt logprobs streamed (they arrive in chunks)
        self.text_offset = [0] * n  # completions: text offset of the next logprob token
        self.started = [False] * n
        self.tools = [tools.output() for _ in range(n)] if tools is not None else None
        self.reasoning = reasoning
        self.splitters = [ReasoningSplitter(*reasoning) for _ in range(n)] if reasoning else None

    def _tok(self, tid: int) -> str:
        if self.tokens_as_ids:
            return f"token_id:{tid}"
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def _chat_lp(self, tid: int, logprob: float | None) -> JSONObject:
        token = self._tok(tid)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    def _chat_lp_content(self, i: int, start: int) -> list[JSONObject]:
        state = self.collector.states[i]
        lps, tops = state.logprobs[start:], state.top_logprobs[start:]
        return [{**self._chat_lp(t, lp),
                 "top_logprobs": [self._chat_lp(tt, tl)
                                  for tl, tt, _ in (tops[k] if k < len(tops) else [])][: self.top_n]}
                for k, (lp, t, _) in enumerate(lps)]

    def _lp_content(self, i: int, start: int) -> JSONObject:
        """A completion's logprobs, in OpenAI's legacy shape."""
        state = self.collector.states[i]
        lps, tops = state.logprobs[start:], state.top_logprobs[start:]
        if self.echo:  # the echoed prompt's tokens come first, as in vLLM; the first has no logprob
            done = self.sent_prompt_lp[i]
            self.sent_prompt_lp[i] = len(state.prompt_logprobs)
            tops = state.prompt_top_logprobs[done:] + tops
            lps = state.prompt_logprobs[done:] + lps
        tokens = [self._tok(t) for _, t, _ in lps]
        offsets = list(itertools.accumulate(map(len, tokens), initial=self.text_offset[i]))
        self.text_offset[i] = offsets.pop()
        return {"tokens": tokens, "token_logprobs": [lp for lp, _, _ in lps],
                "top_logprobs": [None if lp is None else  # the echoed first token has none
                                 {self._tok(tt): tl for tl, tt, _ in
                                  (tops[k] if k < len(tops) else [])[: self.top_n]}
                                 for k, (lp, _, _) in enumerate(lps)],
                "text_offset": offsets}

    def _echo_prefix(self, i: int) -> str:
        # From the prompt itself: with chunked prefill its logprobs arrive over several chunks.
        if not self.echo:
            return ""
        return self.tokenizer.decode(self.collector.states[i].prompt_ids, skip_special_tokens=False)

    def chunks(self, changed: list[int]) -> list[Chunk]:
        """Everything new in each changed choice since its last chunk, merged: one chunk each."""
        chunks = []
        kind = self.object + (".chunk" if self.chat else "")
        for i in changed:
            state = self.collector.states[i]
            new_text = state.text[self.sent_text[i]:]
            self.sent_text[i] = len(state.text)
            lp_start, self.sent_lp[i] = self.sent_lp[i], len(state.logprobs)
            first, self.started[i] = not self.started[i], True
            if self.chat:
                logprobs = {"content": self._chat_lp_content(i, lp_start)} if self.logprobs else None
                content, finish, reasoning = new_text, finish_reason(state), None
                calls: list[JSONObject] | None = None
                if self.splitters is not None:
                    split = self.splitters[i].feed(new_text)
                    if state.finished:
                        split = split + self.splitters[i].finish()
                    content, reasoning = split.content, split.reasoning or None
                if self.tools is not None:  # calls are read from the answer, never the reasoning
                    content, calls, finish = self.tools[i].delta(content, state.finished, finish)
                shown: str | None = content
                if self.tools is not None or self.splitters is not None:
                    news = content or calls or reasoning or (logprobs and logprobs["content"])
                    if not (news or first or finish):
                        continue  # held back (a tag or a tool call's JSON still being decided)
                    if (calls or reasoning) and not content:
                        shown = None  # as OpenAI's tool-call deltas: no content key
                choice: ChatChunkChoice | CompletionChunkChoice = ChatChunkChoice(
                    i, ChatDelta(shown, "assistant" if first else None, calls or None, reasoning), finish,
                    logprobs)
            else:
                text = (self._echo_prefix(i) if first else "") + new_text
                choice = CompletionChunkChoice(i, text, finish_reason(state),
                                               self._lp_content(i, lp_start) if self.logprobs else None)
            chunks.append(Chunk(self.rid, kind, self.created, self.model, [choice]))
        return chunks

    def usage(self) -> dict:
        states = self.collector.states
        per_prompt = _n_of(states)
        prompt = sum(len(s.prompt_ids) for s in states[::per_prompt])
        completion = sum(len(s.output_ids) for s in states)
        cached = sum(s.cached_tokens for s in states[::per_prompt])
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def usage_chunk(self) -> Chunk:
        return Chunk(self.rid, self.object + (".chunk" if self.chat else ""), self.created, self.model,
                     [], self.usage())

    def final(self) -> dict:
        choices = []
        for i, state in enumerate(self.collector.states):
            if self.chat:
                text, reasoning = state.text, None
                if self.reasoning is not None:
                    split = split_whole(*self.reasoning, text)
                    text, reasoning = split.content, split.reasoning
                message: JSONObject = {"role": "assistant", "content": text}
                finish = finish_reason(state)
                if self.tools is not None:  # calls are read from the answer, never the reasoning
                    message, finish = self.tools[i].final(text, finish)
                if self.reasoning is not None:
                    message["reasoning_content"] = reasoning or None
                choice = {"index": i, "message": message, "finish_reason": finish,
                          "logprobs": {"content": self._chat_lp_content(i, 0)} if self.logprobs else None}
            else:
                choice = {"index": i, "text": self._echo_prefix(i) + state.text,
                          "finish_reason": finish_reason(state),
                          "logprobs": self._lp_content(i, 0) if self.logprobs else None}
            choices.append(choice)
        return {"id": self.rid, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}


def _n_of(states: list[ReqState]) -> int:
    """Children per prompt: the states of one prompt share its prompt_ids object."""
    n = 1
    while n < len(states) and states[n].prompt_ids is states[0].prompt_ids:
        n += 1
    return n
