"""The pipeline's typed output as OpenAI's completion / chat responses, stream chunks, usage and
logprobs.

The stream chunks are msgspec Structs encoded straight to JSON bytes: a streamed token costs
one small struct and one encode, not a dict tree walked by json.dumps.
"""

from __future__ import annotations

import itertools
import time

import msgspec

from unison.frontend.request import FinishReason, LengthFinish, Logprob
from unison.frontend.text.tool_parsers import ToolCall, ToolCallDelta
from unison.json_types import JSONObject
from unison.server.pipeline.output import Logprobs, Usage
from unison.server.pipeline.start import Started

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


def finish_reason(finish: FinishReason | None, ends_in_call: bool = False) -> str | None:
    """OpenAI's: "length" at max_tokens, "tool_calls" when calls end the turn, else "stop" (an
    abort too, as vLLM says it)."""
    if finish is None:
        return None
    if isinstance(finish, LengthFinish):
        return "length"
    return "tool_calls" if ends_in_call else "stop"


def usage_dict(usage: Usage) -> JSONObject:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def call_dict(call: ToolCall) -> JSONObject:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def call_delta_dict(d: ToolCallDelta) -> JSONObject:
    """A call's stream delta in OpenAI's shape: the header (id, type, name) first, then arguments."""
    if d.id is not None:
        return {"index": d.index, "id": d.id, "type": "function",
                "function": {"name": d.name, "arguments": d.arguments}}
    return {"index": d.index, "function": {"arguments": d.arguments}}


class Renderer:
    """One OpenAI call's responses and chunks, from the pipeline's typed output."""

    def __init__(self, started: Started, *, chat: bool, rid: str, top_n: int,
                 tokens_as_ids: bool = False) -> None:
        self.output, self.model = started.output, started.model
        self.chat, self.rid, self.top_n = chat, rid, top_n
        self.tokens_as_ids = tokens_as_ids  # vLLM's return_tokens_as_token_ids
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        self.text_offset = [0] * len(started.collector.states)  # completions: of the next logprob token

    def _tok(self, tid: int) -> str:
        if self.tokens_as_ids:
            return f"token_id:{tid}"
        return self.output.token_text(tid)

    def _chat_lp(self, tid: int, logprob: float | None) -> JSONObject:
        token = self._tok(tid)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    def _chat_logprobs(self, lps: Logprobs) -> JSONObject:
        tops = lps.top
        return {"content": [{**self._chat_lp(t, lp),
                             "top_logprobs": [self._chat_lp(tt, tl) for tl, tt, _ in
                                              (tops[k] if k < len(tops) else [])][: self.top_n]}
                            for k, (lp, t, _) in enumerate(lps.tokens)]}

    def _completion_logprobs(self, i: int, lps: Logprobs, prompt: Logprobs | None) -> JSONObject:
        """A completion's logprobs, in OpenAI's legacy shape; with echo, the prompt's tokens come
        first, as in vLLM (the first has no logprob)."""
        tokens_lp: list[Logprob] = lps.tokens if prompt is None else prompt.tokens + lps.tokens
        tops = lps.top if prompt is None else prompt.top + lps.top
        tokens = [self._tok(t) for _, t, _ in tokens_lp]
        offsets = list(itertools.accumulate(map(len, tokens), initial=self.text_offset[i]))
        self.text_offset[i] = offsets.pop()
        return {"tokens": tokens, "token_logprobs": [lp for lp, _, _ in tokens_lp],
                "top_logprobs": [None if lp is None else  # the echoed first token has none
                                 {self._tok(tt): tl for tl, tt, _ in
                                  (tops[k] if k < len(tops) else [])[: self.top_n]}
                                 for k, (lp, _, _) in enumerate(tokens_lp)],
                "text_offset": offsets}

    def chunks(self, changed: list[int]) -> list[Chunk]:
        """Everything new in each changed choice since its last chunk, merged: one chunk each."""
        chunks = []
        kind = self.object + (".chunk" if self.chat else "")
        for d in self.output.deltas(changed):
            finish = finish_reason(d.finish, d.ends_in_call)
            choice: ChatChunkChoice | CompletionChunkChoice
            if self.chat:
                calls = [call_delta_dict(c) for c in d.tool_calls] or None
                # as OpenAI's tool-call deltas: no content key beside calls or reasoning alone
                shown = None if (calls or d.reasoning) and not d.content else d.content
                choice = ChatChunkChoice(d.index, ChatDelta(shown, "assistant" if d.first else None, calls,
                                                            d.reasoning or None), finish,
                                         self._chat_logprobs(d.logprobs) if d.logprobs else None)
            else:
                lps = self._completion_logprobs(d.index, d.logprobs, d.prompt_logprobs) \
                    if d.logprobs else None
                choice = CompletionChunkChoice(d.index, d.content, finish, lps)
            chunks.append(Chunk(self.rid, kind, self.created, self.model, [choice]))
        return chunks

    def usage_chunk(self) -> Chunk:
        return Chunk(self.rid, self.object + (".chunk" if self.chat else ""), self.created, self.model,
                     [], usage_dict(self.output.usage()))

    def final(self) -> JSONObject:
        choices = []
        for c in self.output.choices():
            finish = finish_reason(c.finish, c.ends_in_call)
            if self.chat:
                message: JSONObject = {"role": "assistant", "content": c.content}
                if c.tool_calls:
                    message["tool_calls"] = [call_dict(call) for call in c.tool_calls]
                if c.reasoning is not None:
                    message["reasoning_content"] = c.reasoning or None
                choice = {"index": c.index, "message": message, "finish_reason": finish,
                          "logprobs": self._chat_logprobs(c.logprobs) if c.logprobs else None}
            else:
                choice = {"index": c.index, "text": c.content, "finish_reason": finish,
                          "logprobs": self._completion_logprobs(c.index, c.logprobs, c.prompt_logprobs)
                          if c.logprobs else None}
            choices.append(choice)
        return {"id": self.rid, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_dict(self.output.usage())}
