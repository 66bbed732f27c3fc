"""Tool-call parsers for `/v1/chat/completions` with `tool_choice="auto"` (vLLM's `--tool-call-parser`).

A parser splits a model's generated text into plain content and OpenAI tool calls, either whole
(`parse`) or incrementally (`streamer().feed(...)` then `finish()`). The streaming form holds back
only text that could still become part of a call, and emits a call only once it is decided, so
for any split of the text the deltas reassemble to exactly what `parse` returns: a block that
looks like a call but turns out malformed is given back as content, never half-emitted.

- `hermes` (Qwen2.5/Qwen3 and many fine-tunes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks anywhere in the text; malformed ones stay content. An unterminated block at the end
  (max_tokens) is a call if its JSON is complete, else content.
- `llama3_json`: the whole output, after an optional `<|python_tag|>`, is `;`-separated
  `{"name": ..., "parameters": {...}}` objects. All or nothing: one bad object makes all of the
  text content, so a streamed JSON output is decided only at the end of generation.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, encoded


@dataclass(slots=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


@dataclass(slots=True)
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _make_call(obj: object, arg_keys: tuple[str, ...]) -> ToolCall | None:
    """A ToolCall from a decoded JSON value, or None if it is not a well-formed call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: object = next((obj[key] for key in arg_keys if key in obj), {})  # no arguments at all: `{}`
    if isinstance(args, str):  # some fine-tunes encode the arguments twice
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _loads_call(text: str, arg_keys: tuple[str, ...]) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return _make_call(obj, arg_keys)


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (it may still become it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def call_deltas(index: int, call: ToolCall) -> list[ToolCallDelta]:
    # OpenAI clients expect the header (id, name) in its own fragment before any arguments.
    return [ToolCallDelta(index, call.id, call.name, ""), ToolCallDelta(index, arguments=call.arguments)]


class ToolStreamer:
    """Incremental parser for one response: feed() the new text, then finish() once at the end."""

    def feed(self, text: str) -> StreamDelta:
        raise NotImplementedError

    def finish(self) -> StreamDelta:
        raise NotImplementedError


class ToolParser:
    name: str = ""

    def parse(self, text: str) -> ParsedOutput:
        raise NotImplementedError

    def streamer(self) -> ToolStreamer:
        raise NotImplementedError


# --------------------------------------------------------------------------------------- hermes

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_HERMES_KEYS = ("arguments", "parameters")
_HERMES_BLOCK = re.compile(re.escape(_OPEN) + "(.*?)" + re.escape(_CLOSE), re.DOTALL)


class HermesParser(ToolParser):
    name = "hermes"

    def parse(self, text: str) -> ParsedOutput:
        pieces: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        for m in _HERMES_BLOCK.finditer(text):
            call = _loads_call(m.group(1).strip(), _HERMES_KEYS)
            if call is None:  # not a call: the whole block, tags included, stays content
                pieces.append(text[pos : m.end()])
            else:
                pieces.append(text[pos : m.start()])
                calls.append(call)
            pos = m.end()
        tail = text[pos:]
        start = tail.find(_OPEN)  # an unterminated block, e.g. cut by max_tokens
        call = _loads_call(tail[start + len(_OPEN) :].strip(), _HERMES_KEYS) if start >= 0 else None
        if call is None:
            pieces.append(tail)
        else:
            pieces.append(tail[:start])
            calls.append(call)
        return ParsedOutput("".join(pieces).strip() or None, calls)

    def streamer(self) -> ToolStreamer:
        return HermesStreamer()


class HermesStreamer(ToolStreamer):
    """Passes text through until `<tool_call>`, then buffers the block until `</tool_call>` decides it."""

    __slots__ = ("_buf", "_in_call", "_scan", "_index")

    def __init__(self) -> None:
        self._buf = ""  # text mode: a held partial `<tool_call>`; call mode: the block after the tag
        self._in_call = False
        self._scan = 0  # where to resume searching for `</tool_call>`, so a long block costs O(n)
        self._index = 0

    def feed(self, text: str) -> StreamDelta:
        self._buf += text
        out = StreamDelta()
        while self._step(out):
            pass
        return out

    def _step(self, out: StreamDelta) -> bool:
        """Consume one decided piece of the buffer into `out`; False when the rest must wait."""
        if not self._in_call:
            start = self._buf.find(_OPEN)
            if start < 0:
                keep = _held_prefix(self._buf, _OPEN)
                out.content += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                return False
            out.content += self._buf[:start]
            self._buf, self._in_call, self._scan = self._buf[start + len(_OPEN) :], True, 0
            return True
        end = self._buf.find(_CLOSE, self._scan)
        if end < 0:
            self._scan = max(0, len(self._buf) - len(_CLOSE) + 1)
            return False
        self._close_block(self._buf[:end], _OPEN + self._buf[: end + len(_CLOSE)], out)
        self._buf, self._in_call = self._buf[end + len(_CLOSE) :], False
        return True

    def _close_block(self, inner: str, raw: str, out: StreamDelta) -> None:
        call = _loads_call(inner.strip(), _HERMES_KEYS)
        if call is None:
            out.content += raw  # not a call after all: the model's text is shown as it was
            return
        out.tool_calls += call_deltas(self._index, call)
        self._index += 1

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self._in_call:  # unterminated block (e.g. max_tokens): a call only if its JSON is complete
            self._close_block(self._buf, _OPEN + self._buf, out)
        else:
            out.content = self._buf
        self._buf, self._in_call = "", False
        return out


# ---------------------------------------------------------------------------------- llama3_json

_PYTHON_TAG = "<|python_tag|>"
_LLAMA_KEYS = ("parameters", "arguments")
_DECODER = json.JSONDecoder()
_SEPARATOR = re.compile(r"\s*;\s*")


def _llama_body(text: str) -> str:
    """The text after leading whitespace and an optional `<|python_tag|>`."""
    body = text.lstrip()
    return body[len(_PYTHON_TAG) :].lstrip() if body.startswith(_PYTHON_TAG) else body


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str) -> ParsedOutput:
        calls = self._calls(_llama_body(text))
        return ParsedOutput(None, calls) if calls else ParsedOutput(text.strip() or None, [])

    @staticmethod
    def _calls(body: str) -> list[ToolCall]:
        """The calls in `body`, or [] unless all of it is `;`-separated call objects."""
        calls: list[ToolCall] = []
        pos = 0
        while True:
            try:
                obj, pos = _DECODER.raw_decode(body, pos)
            except ValueError:
                return []
            call = _make_call(obj, _LLAMA_KEYS)
            if call is None:
                return []
            calls.append(call)
            sep = _SEPARATOR.match(body, pos)
            if sep is None:  # after the last object only whitespace may follow
                return calls if not body[pos:].strip() else []
            pos = sep.end()
            if pos == len(body):  # a trailing `;`
                return calls

    def streamer(self) -> ToolStreamer:
        return Llama3JsonStreamer(self)


class Llama3JsonStreamer(ToolStreamer):
    """Holds the start of the output until it is known whether it is JSON; JSON waits for finish()."""

    __slots__ = ("_parser", "_chunks", "_mode")

    def __init__(self, parser: Llama3JsonParser) -> None:
        self._parser = parser
        self._chunks: list[str] = []
        self._mode = "undecided"  # -> "text" (pass through) or "json" (all held: all or nothing)

    def feed(self, text: str) -> StreamDelta:
        if self._mode == "text":
            return StreamDelta(text)
        self._chunks.append(text)
        if self._mode == "undecided":
            self._mode = self._decide("".join(self._chunks))
            if self._mode == "text":
                return StreamDelta(self._take())
        return StreamDelta()

    @staticmethod
    def _decide(text: str) -> str:
        body = _llama_body(text)
        if not body or _PYTHON_TAG.startswith(text.lstrip()):
            return "undecided"  # only whitespace and maybe (part of) `<|python_tag|>` so far
        return "json" if body[0] == "{" else "text"

    def _take(self) -> str:
        text = "".join(self._chunks)
        self._chunks = []
        return text

    def finish(self) -> StreamDelta:
        text = self._take()
        if self._mode != "json":
            return StreamDelta(text)
        calls = self._parser.parse(text).tool_calls
        if not calls:  # some object was not a call: all of the text is content
            return StreamDelta(text)
        return StreamDelta("", [d for i, call in enumerate(calls) for d in call_deltas(i, call)])


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    # SGLang's names for the same formats.
    "qwen25": HermesParser,
    "llama3": Llama3JsonParser,
}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        choices = ", ".join(sorted(PARSERS))
        raise ValueError(f"unknown tool-call parser {name!r}; choose from: {choices}") from None
