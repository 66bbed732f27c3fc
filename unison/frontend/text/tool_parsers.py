"""Tool-call parsers for `/v1/chat/completions` with `tool_choice="auto"` (vLLM's `--tool-call-parser`).

A parser splits a model's generated text into plain content and OpenAI tool calls, either whole
(`parse`) or incrementally (`streamer().feed(...)` then `finish()`). The streaming form holds back
only text that could still become part of a call, and emits a call only once it is decided, so
for any split of the text the deltas reassemble to exactly what `parse` returns: a block that
looks like a call but turns out malformed is given back as content, never half-emitted.

- `hermes` (Qwen2.5/Qwen3 and many fine-tunes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks anywhere in the text; malformed ones stay content. An unterminated block at the end
  (max_tokens) is a call if its JSON is complete, else content.
- `qwen3_coder` (Qwen3-Coder, Qwen3-Coder-Next, Qwen3.5): `<tool_call>` blocks holding
  `<function=NAME>` with `<parameter=KEY>` raw-text values, typed by the request's tool schema as
  vLLM's parser types them (undeclared: a JSON number/bool/null/object/array as such, else a string).
  Malformed blocks stay content; an unterminated one at the end is a call if it is whole up to
  its last `</function>`, else content.
- `llama3_json`: the whole output, after an optional `<|python_tag|>`, is `;`-separated
  `{"name": ..., "parameters": {...}}` objects. All or nothing: one bad object makes all of the
  text content, so a streamed JSON output is decided only at the end of generation.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from unison.json_types import JSONObject


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

    def __init__(self, tools: list[JSONObject] | None = None) -> None:
        # The request's `tools` (OpenAI's shape): qwen3_coder types its raw-text arguments by their schemas.
        self.tools = tools or []

    def parse(self, text: str) -> ParsedOutput:
        raise NotImplementedError

    def streamer(self) -> ToolStreamer:
        raise NotImplementedError


# ----------------------------------------------------------------- <tool_call> blocks: hermes, qwen3_coder

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(_OPEN) + "(.*?)" + re.escape(_CLOSE), re.DOTALL)


class BlockParser(ToolParser):
    """Calls in `<tool_call>...</tool_call>` blocks anywhere in the text; subclasses read a block."""

    def decode(self, inner: str) -> list[ToolCall] | None:
        """The calls in one block's inside, or None if it is not well-formed (then it stays content)."""
        raise NotImplementedError

    def parse(self, text: str) -> ParsedOutput:
        pieces: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        for m in _BLOCK.finditer(text):
            found = self.decode(m.group(1))
            if found is None:  # not a call: the whole block, tags included, stays content
                pieces.append(text[pos : m.end()])
            else:
                pieces.append(text[pos : m.start()])
                calls += found
            pos = m.end()
        tail = text[pos:]
        start = tail.find(_OPEN)  # an unterminated block, e.g. cut by max_tokens
        found = self.decode(tail[start + len(_OPEN) :]) if start >= 0 else None
        if found is None:
            pieces.append(tail)
        else:
            pieces.append(tail[:start])
            calls += found
        return ParsedOutput("".join(pieces).strip() or None, calls)

    def streamer(self) -> ToolStreamer:
        return BlockStreamer(self.decode)


class BlockStreamer(ToolStreamer):
    """Passes text through until `<tool_call>`, then buffers the block until `</tool_call>` decides it."""

    __slots__ = ("_decode", "_buf", "_in_call", "_scan", "_index")

    def __init__(self, decode: Callable[[str], list[ToolCall] | None]) -> None:
        self._decode = decode
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
        calls = self._decode(inner)
        if calls is None:
            out.content += raw  # not a call after all: the model's text is shown as it was
            return
        for call in calls:
            out.tool_calls += call_deltas(self._index, call)
            self._index += 1

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self._in_call:  # unterminated block (e.g. max_tokens): calls only if the block is complete
            self._close_block(self._buf, _OPEN + self._buf, out)
        else:
            out.content = self._buf
        self._buf, self._in_call = "", False
        return out


# --------------------------------------------------------------------------------------- hermes

_HERMES_KEYS = ("arguments", "parameters")


class HermesParser(BlockParser):
    name = "hermes"

    def decode(self, inner: str) -> list[ToolCall] | None:
        call = _loads_call(inner.strip(), _HERMES_KEYS)
        return None if call is None else [call]


# ---------------------------------------------------------------------------------- qwen3_coder

# A block holds one or more functions (vLLM reads several); only whitespace may lie between the tags.
_FUNCTION = re.compile(r"\s*<function=([^<>\n]*)>(.*?)</function>", re.DOTALL)
# vLLM's reading: a value without `</parameter>` ends where the next parameter or the function does.
_PARAMETER = re.compile(r"\s*<parameter=([^<>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)
_BLANK = re.compile(r"\s*\Z")
_INT_TYPES = ("int", "uint", "long", "short", "unsigned")  # vLLM's prefixes, as is "num"/"float" below


class Qwen3CoderParser(BlockParser):
    """`<function=NAME>` with `<parameter=KEY>` raw-text values, typed by the request's tool schemas."""

    name = "qwen3_coder"

    def decode(self, inner: str) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        pos = 0
        while not _BLANK.match(inner, pos):
            m = _FUNCTION.match(inner, pos)
            call = self._call(m.group(1).strip(), m.group(2)) if m else None
            if m is None or call is None:
                return None
            calls.append(call)
            pos = m.end()
        return calls or None  # an empty block is no call

    def _call(self, name: str, body: str) -> ToolCall | None:
        if not name:
            return None
        properties = _properties(self.tools, name)
        args: dict[str, object] = {}
        pos = 0
        while not _BLANK.match(body, pos):
            m = _PARAMETER.match(body, pos)
            key = m.group(1).strip() if m else ""
            if m is None or not key:
                return None
            args[key] = _typed_value(_trim_newlines(m.group(2)), _declared_type(properties.get(key)))
            pos = m.end()
        return ToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False))


def _properties(tools: list[JSONObject], function: str) -> JSONObject:
    """The `properties` of `function`'s parameters schema among the request's tools ({} if none)."""
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == function:
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            return props if isinstance(props, dict) else {}
    return {}


def _declared_type(schema: object) -> str | None:
    """A property's `type`, lower-cased; of `["integer", "null"]` the non-null one; None if undeclared."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return str(kind).strip().lower() if kind is not None else None


def _trim_newlines(value: str) -> str:
    # The template writes the value between a newline after `<parameter=KEY>` and one before the close.
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _typed_value(raw: str, kind: str | None) -> object:
    """A parameter's raw text as the JSON value its declared type asks for (vLLM's conversions)."""
    if raw.lower() == "null":  # for every type, as vLLM reads it
        return None
    if kind is None:  # no schema to go by: JSON scalars and containers as such, other text as a string
        value = _json_or(raw, raw)
        return raw if isinstance(value, str) else value
    if kind.startswith(_INT_TYPES):
        return _int_or(raw, raw)
    if kind.startswith(("num", "float")):
        return _number_or_text(raw)
    if kind in ("boolean", "bool", "binary"):
        return raw.strip().lower() == "true"  # anything else is false, as in vLLM
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        return _json_or(raw, raw)
    return raw  # string, and types this parser does not know


def _int_or(raw: str, default: object) -> object:
    try:
        return int(raw)
    except ValueError:
        return default


def _number_or_text(raw: str) -> object:
    try:
        value = float(raw)
    except ValueError:
        return raw
    if not math.isfinite(value):  # JSON has no NaN or infinity
        return raw
    # An integral number is written as an integer (vLLM's rule); int() first keeps large ones exact.
    return _int_or(raw, int(value)) if value.is_integer() else value


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # `1e999`: json.dumps would write `Infinity`, which is not JSON
        raise ValueError(f"{text} is out of range")
    return value


def _not_json(text: str) -> object:
    raise ValueError(f"{text} is not JSON")  # NaN, Infinity: Python's json module accepts them


def _json_or(raw: str, default: object) -> object:
    try:
        return json.loads(raw, parse_float=_finite_float, parse_constant=_not_json)
    except ValueError:
        return default


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
    "qwen3_coder": Qwen3CoderParser,
    # SGLang's names for the same formats.
    "qwen25": HermesParser,
    "llama3": Llama3JsonParser,
}


def get_parser(name: str, tools: list[JSONObject] | None = None) -> ToolParser:
    """A parser for one request; `tools` are the request's, which some parsers read (see ToolParser)."""
    try:
        return PARSERS[name](tools)
    except KeyError:
        choices = ", ".join(sorted(PARSERS))
        raise ValueError(f"unknown tool-call parser {name!r}; choose from: {choices}") from None
