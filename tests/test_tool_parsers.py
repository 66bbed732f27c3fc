"""Tool-call parsers: whole-text parsing of recorded-style model outputs, and streaming that
reassembles to the same result for any split of the text."""

from __future__ import annotations

import json
import random

import pytest

from unison.frontend.tool_parsers import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    ParsedOutput,
    StreamDelta,
    ToolCall,
    ToolParser,
    get_parser,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'

# (text, expected content, expected [(name, arguments dict)])
HERMES_CASES = {
    "one_call": (
        f"<tool_call>\n{WEATHER}\n</tool_call>",
        None,
        [("get_weather", {"city": "Paris", "unit": "celsius"})],
    ),
    "two_calls_with_text": (
        f"Let me check both.\n<tool_call>\n{WEATHER}\n</tool_call>\n"
        f"And the time:\n<tool_call>{TIME}</tool_call>",
        "Let me check both.\n\nAnd the time:",
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "Europe/Paris"})],
    ),
    "plain": ("The capital of France is Paris. Use <b>tags</b> < freely.", None, []),
    "malformed": (
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',
        [],
    ),
    "missing_name": (
        '<tool_call>{"arguments": {"x": 1}}</tool_call> done',
        '<tool_call>{"arguments": {"x": 1}}</tool_call> done',
        [],
    ),
    "bad_then_good": (
        f"<tool_call>oops</tool_call>\n<tool_call>{TIME}</tool_call>",
        "<tool_call>oops</tool_call>",
        [("get_time", {"tz": "Europe/Paris"})],
    ),
    "unterminated_complete": (
        f"Checking.\n<tool_call>\n{WEATHER}\n",
        "Checking.",
        [("get_weather", {"city": "Paris", "unit": "celsius"})],
    ),
    "unterminated_truncated": (
        '<tool_call>\n{"name": "get_weather", "argum',
        '<tool_call>\n{"name": "get_weather", "argum',
        [],
    ),
    "qwen3_think": (
        "<think>\nThe user wants the weather. I should call get_weather.\n</think>\n\n"
        f"<tool_call>\n{WEATHER}\n</tool_call>",
        "<think>\nThe user wants the weather. I should call get_weather.\n</think>",
        [("get_weather", {"city": "Paris", "unit": "celsius"})],
    ),
    "unicode": (
        '<tool_call>{"name": "translate", "arguments": {"text": "Grüße, 世界 🌍", "to": "ja"}}</tool_call>',
        None,
        [("translate", {"text": "Grüße, 世界 🌍", "to": "ja"})],
    ),
    "partial_tag_at_end": ("Almost a call <tool_", None, []),
}

LLAMA_CASES = {
    "one_call": (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    "python_tag": (
        '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}',
        None,
        [("get_time", {"tz": "UTC"})],
    ),
    "two_calls": (
        '\n{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": [1, 2]}}\n',
        None,
        [("a", {"x": 1}), ("b", {"y": [1, 2]})],
    ),
    "plain": ("I can answer that directly: it is sunny {mostly}.", None, []),
    "malformed": ('{"name": "get_weather", "parameters": {"city": "Par', None, []),
    "not_a_call": ('{"a": 1}', None, []),
    "second_bad": ('{"name": "a", "parameters": {}}; {"b": 2}', None, []),
    "trailing_text": ('{"name": "a", "parameters": {}} and more', None, []),
    "tag_then_text": ("<|python_tag|>print('hi')", None, []),
    "unicode": (
        '{"name": "say", "parameters": {"msg": "héllo 世界"}}',
        None,
        [("say", {"msg": "héllo 世界"})],
    ),
}

CASES = [("hermes", k, *v) for k, v in HERMES_CASES.items()] + [
    ("llama3_json", k, *v) for k, v in LLAMA_CASES.items()
]
IDS = [f"{p}-{k}" for p, k, *_ in CASES]


def _expected_content(text: str, content: str | None, calls: list) -> str | None:
    # `None` with no calls means "the whole text is content" (keeps the tables short).
    return (text.strip() or None) if content is None and not calls else content


def _check_ids(calls: list[ToolCall]) -> None:
    ids = [c.id for c in calls]
    assert len(set(ids)) == len(ids)
    assert all(i.startswith("call_") and len(i) == 29 and int(i[5:], 16) >= 0 for i in ids)


@pytest.mark.parametrize("parser_name,key,text,content,calls", CASES, ids=IDS)
def test_parse(parser_name: str, key: str, text: str, content: str | None, calls: list) -> None:
    out = get_parser(parser_name).parse(text)
    assert out.content == _expected_content(text, content, calls)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == calls
    _check_ids(out.tool_calls)


def test_arguments_keep_unicode() -> None:
    out = HermesParser().parse(HERMES_CASES["unicode"][0])
    assert "世界" in out.tool_calls[0].arguments


def _stream(parser: ToolParser, chunks: list[str]) -> ParsedOutput:
    streamer = parser.streamer()
    deltas: list[StreamDelta] = [streamer.feed(c) for c in chunks] + [streamer.finish()]
    content = "".join(d.content for d in deltas)
    calls: dict[int, ToolCall] = {}
    for frag in (f for d in deltas for f in d.tool_calls):
        if frag.index not in calls:
            # The first fragment of a call carries its id and name, and no arguments yet.
            assert frag.id is not None and frag.name is not None and frag.arguments == ""
            assert frag.index == len(calls)
            calls[frag.index] = ToolCall(frag.id, frag.name, "")
        else:
            assert frag.id is None and frag.name is None
            calls[frag.index].arguments += frag.arguments
    return ParsedOutput(content.strip() or None, list(calls.values()))


def _assert_same(streamed: ParsedOutput, parsed: ParsedOutput) -> None:
    assert streamed.content == parsed.content
    assert [(c.name, c.arguments) for c in streamed.tool_calls] == [
        (c.name, c.arguments) for c in parsed.tool_calls
    ]
    _check_ids(streamed.tool_calls)


def _random_chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("parser_name,key,text,content,calls", CASES, ids=IDS)
def test_stream_matches_parse(
    parser_name: str, key: str, text: str, content: str | None, calls: list
) -> None:
    parser = get_parser(parser_name)
    parsed = parser.parse(text)
    _assert_same(_stream(parser, [text]), parsed)
    _assert_same(_stream(parser, list(text)), parsed)  # every split position at once
    for a in range(0, len(text), 3):  # every pair of split positions (a, b), on a stride to stay fast
        for b in range(a + 1, len(text), 5):
            _assert_same(_stream(parser, [text[:a], text[a:b], text[b:]]), parsed)
    rng = random.Random(f"{parser_name}-{key}")
    for _ in range(20):
        _assert_same(_stream(parser, _random_chunks(text, rng)), parsed)


def test_content_is_streamed_early() -> None:
    streamer = HermesParser().streamer()
    assert streamer.feed("Hello wor").content == "Hello wor"
    assert streamer.feed("ld <tool").content == "ld "  # `<tool` may start a call: held back
    delta = streamer.feed(f"_call>{TIME}</tool_call>")
    assert delta.content == "" and [t.name for t in delta.tool_calls] == ["get_time", None]
    assert streamer.feed(" bye").content == " bye"
    assert streamer.finish() == StreamDelta()


def test_llama3_holds_only_what_could_be_json() -> None:
    streamer = Llama3JsonParser().streamer()
    assert streamer.feed("  <|python").content == ""
    assert streamer.feed("_tag|>Sure").content == "  <|python_tag|>Sure"
    assert streamer.feed(", here.").content == ", here."
    streamer = Llama3JsonParser().streamer()
    assert streamer.feed('{"name": "a", "parameters": {}}').tool_calls == []  # `;` might follow
    assert [t.name for t in streamer.finish().tool_calls] == ["a", None]


def test_get_parser() -> None:
    assert isinstance(get_parser("hermes"), HermesParser)
    assert isinstance(get_parser("qwen25"), HermesParser)
    assert isinstance(get_parser("llama3_json"), Llama3JsonParser)
    assert isinstance(get_parser("llama3"), Llama3JsonParser)
    assert set(PARSERS) == {"hermes", "qwen25", "llama3_json", "llama3"}
    with pytest.raises(ValueError, match="hermes.*llama3_json") as err:
        get_parser("nope")
    assert "nope" in str(err.value)
