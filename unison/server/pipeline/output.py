"""A request's result, typed and API-neutral: what every API renders, whole or as stream deltas.

`Output` reads one call's choices from its Collector (the per-request states the frontend keeps)
with cursors of its own, and splits each choice's text into reasoning, content and tool calls. A
`Delta` is what one choice added since its last delta; a `Choice` is a whole choice. Each API
(server/apis/*) turns these into its own JSON; none of them reads another API's JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from unison.frontend.collector import Collector
from unison.frontend.request import FinishReason, LengthFinish, Logprob, ReqState, StopFinish
from unison.frontend.text.harmony import HarmonyStream, Parsed
from unison.frontend.text.reasoning import ReasoningSplitter, split_whole
from unison.frontend.text.tokenizer import Tokenizer
from unison.frontend.text.tool_parsers import ToolCall, ToolCallDelta
from unison.server.pipeline.tools import ToolOutput, ToolPlan


@dataclass(slots=True)
class Logprobs:
    """Token logprobs: per token (logprob, token id, text), and the top alternatives at each."""

    tokens: list[Logprob]
    top: list[list[Logprob]]


@dataclass(slots=True)
class Delta:
    """What one choice added since its last delta."""

    index: int
    first: bool  # the choice's first delta
    content: str
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    logprobs: Logprobs | None = None  # None: not asked for
    prompt_logprobs: Logprobs | None = None  # echo: the prompt's, before the output's
    token_ids: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    ends_in_call: bool = False  # the tool calls end the turn (OpenAI's finish_reason "tool_calls")


@dataclass(slots=True)
class Choice:
    """One whole choice."""

    index: int
    content: str | None  # None: only tool calls
    reasoning: str | None  # None: no reasoning parser; "" : none produced
    tool_calls: list[ToolCall]
    logprobs: Logprobs | None
    prompt_logprobs: Logprobs | None
    token_ids: list[int]
    finish: FinishReason | None
    ends_in_call: bool


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # of the prompt tokens, found in the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def stop_string(finish: FinishReason | None) -> str | None:
    """The stop string that ended a choice (None: a token, a limit, or not ended)."""
    return finish.matched if isinstance(finish, StopFinish) and isinstance(finish.matched, str) else None


def hit_length(finish: FinishReason | None) -> bool:
    return isinstance(finish, LengthFinish)


class Output:
    """One call's choices, as deltas (streamed) or whole."""

    def __init__(self, collector: Collector, tokenizer: Tokenizer, *, logprobs: bool = False,
                 echo: bool = False, tools: ToolPlan | None = None,
                 reasoning: tuple[str, str] | None = None, harmony: bool = False) -> None:
        """`echo`: a completion's prompt comes first (text and logprobs). `reasoning`: (parser, the
        rendered prompt): the output's reasoning section apart. `harmony`: the output's tokens are
        harmony messages (gpt-oss), whose channels say what is reasoning, answer and tool call."""
        self.collector, self.tokenizer = collector, tokenizer
        self.logprobs, self.echo, self.reasoning = logprobs, echo, reasoning
        n = len(collector.states)
        self.sent_text = [0] * n  # characters delivered, per choice
        self.sent_lp = [0] * n  # output logprobs delivered
        self.sent_prompt_lp = [0] * n  # echo: prompt logprobs delivered (they arrive in chunks)
        self.sent_ids = [0] * n
        self.started = [False] * n
        self.tools: list[ToolOutput] | None = [tools.output() for _ in range(n)] if tools else None
        self.splitters = [ReasoningSplitter(*reasoning) for _ in range(n)] if reasoning else None
        self.harmony = [self._harmony_stream() for _ in range(n)] if harmony else None

    def _harmony_stream(self) -> HarmonyStream:
        assert self.tokenizer.harmony is not None  # (asked for a harmony model's output only)
        calls = self.tools is not None and self.tools[0].plan.mode != "none"
        return HarmonyStream(self.tokenizer.harmony, calls_allowed=calls)

    @property
    def states(self) -> list[ReqState]:
        return self.collector.states

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens spelt out: what every API's logprobs show."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def deltas(self, changed: list[int]) -> list[Delta]:
        """Everything new in each changed choice, merged: one delta each. A choice whose news is
        held back (a reasoning tag or a tool call's JSON still being decided) gives none."""
        out = []
        for i in changed:
            state = self.collector.states[i]
            new_text = state.text[self.sent_text[i]:]
            self.sent_text[i] = len(state.text)
            first, self.started[i] = not self.started[i], True
            ids, self.sent_ids[i] = state.output_ids[self.sent_ids[i]:], len(state.output_ids)
            delta = Delta(i, first, (self._echo_prefix(i) if first else "") + new_text, token_ids=ids,
                          finish=state.finish_reason, logprobs=self._new_logprobs(i))
            if self.echo and self.logprobs:
                delta.prompt_logprobs = self._new_prompt_logprobs(i)
            if self.harmony is not None:
                if not self._channels(delta, self.harmony[i].feed(ids, state.finished)):
                    continue
            elif (self.splitters or self.tools) and not self._split(delta, state):
                continue
            out.append(delta)
        return out

    def _split(self, delta: Delta, state: ReqState) -> bool:
        """Take the delta's reasoning and tool calls out of its content; False: nothing to say."""
        i = delta.index
        if self.splitters is not None:
            split = self.splitters[i].feed(delta.content)
            if state.finished:
                split = split + self.splitters[i].finish()
            delta.content, delta.reasoning = split.content, split.reasoning
        if self.tools is not None:  # calls are read from the answer, never the reasoning
            delta.content, delta.tool_calls, delta.ends_in_call = self.tools[i].delta(
                delta.content, state.finished)
        news = delta.content or delta.tool_calls or delta.reasoning \
            or (delta.logprobs and delta.logprobs.tokens)
        return bool(news or delta.first or delta.finish)

    def _channels(self, delta: Delta, parsed: Parsed) -> bool:
        """A harmony delta's pieces from its channels; False: nothing to say."""
        parallel = self.tools is None or self.tools[0].plan.parallel
        calls = [c for c in parsed.tool_calls if parallel or c.index == 0]
        delta.content, delta.reasoning, delta.tool_calls = parsed.content, parsed.reasoning, calls
        delta.ends_in_call = self._harmony_ends_in_call(delta.index)
        news = delta.content or calls or delta.reasoning or (delta.logprobs and delta.logprobs.tokens)
        return bool(news or delta.first or delta.finish)

    def _harmony_ends_in_call(self, i: int) -> bool:
        assert self.harmony is not None
        return bool(self.harmony[i].calls) and self.tools is not None and self.tools[0].plan.mode != "named"

    def _new_logprobs(self, i: int) -> Logprobs | None:
        if not self.logprobs:
            return None
        state = self.collector.states[i]
        start, self.sent_lp[i] = self.sent_lp[i], len(state.logprobs)
        return Logprobs(state.logprobs[start:], state.top_logprobs[start:])

    def _new_prompt_logprobs(self, i: int) -> Logprobs:
        state = self.collector.states[i]
        start, self.sent_prompt_lp[i] = self.sent_prompt_lp[i], len(state.prompt_logprobs)
        return Logprobs(state.prompt_logprobs[start:], state.prompt_top_logprobs[start:])

    def _echo_prefix(self, i: int) -> str:
        # From the prompt itself: with chunked prefill its logprobs arrive over several chunks.
        if not self.echo:
            return ""
        return self.tokenizer.decode(self.collector.states[i].prompt_ids, skip_special_tokens=False)

    def choices(self) -> list[Choice]:
        """Every choice, whole (once the call has finished)."""
        out = []
        for i, state in enumerate(self.collector.states):
            if self.harmony is not None:
                out.append(self._harmony_choice(i, state))
                continue
            text, reasoning = self._echo_prefix(i) + state.text, None
            if self.reasoning is not None:
                split = split_whole(*self.reasoning, text)
                text, reasoning = split.content, split.reasoning
            content: str | None = text
            calls: list[ToolCall] = []
            ends_in_call = False
            if self.tools is not None:  # calls are read from the answer, never the reasoning
                content, calls, ends_in_call = self.tools[i].final(text)
            logprobs = Logprobs(state.logprobs, state.top_logprobs) if self.logprobs else None
            prompt = Logprobs(state.prompt_logprobs, state.prompt_top_logprobs) \
                if self.logprobs and self.echo else None
            out.append(Choice(i, content, reasoning, calls, logprobs, prompt, state.output_ids,
                              state.finish_reason, ends_in_call))
        return out

    def _harmony_choice(self, i: int, state: ReqState) -> Choice:
        assert self.harmony is not None
        self.harmony[i] = stream = self._harmony_stream()
        parsed = stream.feed(state.output_ids, finished=True)
        calls = stream.calls if self.tools is None or self.tools[0].plan.parallel else stream.calls[:1]
        logprobs = Logprobs(state.logprobs, state.top_logprobs) if self.logprobs else None
        return Choice(i, parsed.content if parsed.content or not calls else None, parsed.reasoning, calls,
                      logprobs, None, state.output_ids, state.finish_reason, self._harmony_ends_in_call(i))

    def usage(self) -> Usage:
        states = self.collector.states
        per_prompt = _n_of(states)
        return Usage(sum(len(s.prompt_ids) for s in states[::per_prompt]),
                     sum(len(s.output_ids) for s in states),
                     sum(s.cached_tokens for s in states[::per_prompt]))


def _n_of(states: list[ReqState]) -> int:
    """Children per prompt: the states of one prompt share its prompt_ids object."""
    n = 1
    while n < len(states) and states[n].prompt_ids is states[0].prompt_ids:
        n += 1
    return n
