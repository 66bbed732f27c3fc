"""Tool-call parsers: whole-text parsing of recorded-style model outputs, and streaming that
reassembles to the same result for any split of the text."""

from __future__ import annotations

import json
import random

import pytest

from unison.frontend.text.tool_parsers import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    ParsedOutput,
    Qwen3CoderParser,
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



def _qwen_call(name: str, **params: str) -> str:
    """A call as Qwen3-Coder's chat template writes it."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


QWEN_WEATHER = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
QWEN_TIME = _qwen_call("get_time", tz="Europe/Paris")
QWEN_WEATHER_CALL = ("get_weather", {"city": "Paris", "days": 3})
QWEN_TIME_CALL = ("get_time", {"tz": "Europe/Paris"})
CODE = 'def f(a, b):\n\n    return a < b and "<b>" != "</b>"\n'  # blank line, indent, markup, last \n

# Without tools in the request: values that are JSON numbers, bools, null, objects or arrays are those.
QWEN3_CODER_CASES = {
    "one_call": (QWEN_WEATHER, None, [QWEN_WEATHER_CALL]),
    "parallel_calls": (f"{QWEN_WEATHER}\n{QWEN_TIME}", None, [QWEN_WEATHER_CALL, QWEN_TIME_CALL]),
    "text_before_and_between": (
        f"I'll check both.\n\n{QWEN_WEATHER}\nThen the time:\n{QWEN_TIME}\n",
        "I'll check both.\n\n\nThen the time:",
        [QWEN_WEATHER_CALL, QWEN_TIME_CALL],
    ),
    "untyped_values": (
        _qwen_call("f", n="-3", x="2.5", on="true", none="null", obj='{"a": [1, 2]}', arr='[1, "b"]',
                   quoted='"hi"', zeros="007", word="True", huge="1e999", nan="NaN", text="Paris"),
        None,
        [("f", {"n": -3, "x": 2.5, "on": True, "none": None, "obj": {"a": [1, 2]}, "arr": [1, "b"],
                "quoted": '"hi"', "zeros": "007", "word": "True", "huge": "1e999", "nan": "NaN",
                "text": "Paris"})],
    ),
    # Only the template's newline after the open tag and before the close one are not the value.
    "multiline_value": (
        _qwen_call("write_file", path="a.py", content=CODE),
        None,
        [("write_file", {"path": "a.py", "content": CODE})],
    ),
    "no_parameters": ("<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
                      None, [("get_time", {})]),
    "compact": (
        "<tool_call><function=f><parameter=a>x y</parameter><parameter=b></parameter></function></tool_call>",
        None,
        [("f", {"a": "x y", "b": ""})],
    ),
    "missing_parameter_close": (  # vLLM reads these: a value ends at the next parameter or function end
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n3\n"
        "</function>\n</tool_call>",
        None,
        [QWEN_WEATHER_CALL],
    ),
    "two_functions_in_one_block": (
        QWEN_WEATHER.removesuffix("</tool_call>") + QWEN_TIME.removeprefix("<tool_call>"),
        None,
        [QWEN_WEATHER_CALL, QWEN_TIME_CALL],
    ),
    "text_in_function": (
        "Sure.\n<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>",
        "Sure.\n<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>",
        [],
    ),
    "no_function": ("<tool_call>\nget_weather(city='Paris')\n</tool_call> ok", None, []),
    "hermes_json_block": (f"<tool_call>\n{WEATHER}\n</tool_call>", None, []),
    "function_not_closed": (QWEN_WEATHER.replace("</function>\n", ""), None, []),
    "empty_name": ("<tool_call>\n<function=>\n</function>\n</tool_call>", None, []),
    "bad_then_good": (
        f"<tool_call>oops</tool_call>\n{QWEN_TIME}",
        "<tool_call>oops</tool_call>",
        [QWEN_TIME_CALL],
    ),
    "unterminated_complete": (
        "Checking.\n" + QWEN_WEATHER.removesuffix("</tool_call>"),
        "Checking.",
        [QWEN_WEATHER_CALL],
    ),
    "unterminated_in_value": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", None, []),
    "unterminated_before_function_end": (QWEN_WEATHER.removesuffix("</function>\n</tool_call>"), None, []),
    "qwen3_think": (
        f"<think>\nThe user wants the weather. I should call get_weather.\n</think>\n\n{QWEN_WEATHER}",
        "<think>\nThe user wants the weather. I should call get_weather.\n</think>",
        [QWEN_WEATHER_CALL],
    ),
    "unicode": (
        _qwen_call("translate", text="Grüße, 世界 🌍", to="ja"),
        None,
        [("translate", {"text": "Grüße, 世界 🌍", "to": "ja"})],
    ),
    "partial_tag_at_end": ("Almost a call <tool_", None, []),
}

CASES = (
    [("hermes", k, *v) for k, v in HERMES_CASES.items()]
    + [("llama3_json", k, *v) for k, v in LLAMA_CASES.items()]
    + [("qwen3_coder", k, *v) for k, v in QWEN3_CODER_CASES.items()]
)
IDS = [f"{p}-{k}" for p, k, *_ in CASES]


def _expected_content(text: str, content: str | None, calls: list) -> str | None:
    # `None` with no calls means "the whole text is content" (keeps the tables short).
    return (text.strip() or None) if content is None and not calls else content


def _check_ids(calls: list[ToolCall]) -> None:
    ids = [c.id for c in calls]
    assert len(set(ids)) == len(ids)
    assert all(i.startswith("call_") and len(i) == 29 and int(i[5:], 16) >= 0 for i in ids)


def _check_parse(parser: ToolParser, text: str, content: str | None, calls: list) -> None:
    out = parser.parse(text)
    assert out.content == _expected_content(text, content, calls)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == calls
    _check_ids(out.tool_calls)


@pytest.mark.parametrize("parser_name,key,text,content,calls", CASES, ids=IDS)
def test_parse(parser_name: str, key: str, text: str, content: str | None, calls: list) -> None:
    _check_parse(get_parser(parser_name), text, content, calls)


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
    _check_stream(get_parser(parser_name), text, f"{parser_name}-{key}")


def _check_stream(parser: ToolParser, text: str, seed: str) -> None:
    parsed = parser.parse(text)
    _assert_same(_stream(parser, [text]), parsed)
    _assert_same(_stream(parser, list(text)), parsed)  # every split position at once
    for a in range(0, len(text), 3):  # every pair of split positions (a, b), on a stride to stay fast
        for b in range(a + 1, len(text), 5):
            _assert_same(_stream(parser, [text[:a], text[a:b], text[b:]]), parsed)
    rng = random.Random(seed)
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


def test_qwen3_coder_call_waits_for_its_block_end() -> None:
    streamer = Qwen3CoderParser().streamer()
    assert streamer.feed("Checking. <tool_call>\n<function=get_time>\n").content == "Checking. "
    assert streamer.feed("</function>\n") == StreamDelta()  # more functions may follow in the block
    delta = streamer.feed("</tool_call>")
    assert delta.content == "" and [t.name for t in delta.tool_calls] == ["get_time", None]
    assert streamer.finish() == StreamDelta()


def _tool(name: str, **types: object) -> dict:
    properties = {key: {"type": kind} for key, kind in types.items()}
    parameters = {"type": "object", "properties": properties}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TOOLS = [
    _tool("get_weather", city="string", days="integer", lat="number", metric="boolean", filters="object",
          hours="array", note=["string", "null"]),
    _tool("get_time", tz="string"),
]

# With the request's tools: each value as its declared type asks, as vLLM's qwen3_coder converts it.
QWEN3_CODER_TYPED_CASES = {
    "declared_types": (
        _qwen_call("get_weather", city="42", days="3", lat="48.85", metric="True", filters='{"rain": false}',
                   hours="[6, 12]", note="7"),
        [("get_weather", {"city": "42", "days": 3, "lat": 48.85, "metric": True, "filters": {"rain": False},
                          "hours": [6, 12], "note": "7"})],
    ),
    "unparsable_values": (
        _qwen_call("get_weather", days="3.0", lat="nan", metric="yes", filters="{rain}", hours="6-12"),
        [("get_weather", {"days": "3.0", "lat": "nan", "metric": False, "filters": "{rain}",
                          "hours": "6-12"})],
    ),
    "null_for_any_type": (
        _qwen_call("get_weather", city="null", days="NULL"),
        [("get_weather", {"city": None, "days": None})],
    ),
    "undeclared": (  # a parameter or a function the tools do not declare: read as without tools
        f"{_qwen_call('get_weather', city='Paris', extra='5')}\n{_qwen_call('other', flag='true', tz='UTC')}",
        [("get_weather", {"city": "Paris", "extra": 5}), ("other", {"flag": True, "tz": "UTC"})],
    ),
}


@pytest.mark.parametrize("key", QWEN3_CODER_TYPED_CASES)
def test_qwen3_coder_types_by_schema(key: str) -> None:
    text, calls = QWEN3_CODER_TYPED_CASES[key]
    parser = get_parser("qwen3_coder", TOOLS)
    _check_parse(parser, text, None, calls)
    _check_stream(parser, text, f"qwen3_coder-typed-{key}")


def test_qwen3_coder_numbers() -> None:
    # JSON says 4 and 4.0 are equal; the arguments text shows which was written.
    parser = get_parser("qwen3_coder", TOOLS)
    assert parser.parse(_qwen_call("get_weather", lat="4.0")).tool_calls[0].arguments == '{"lat": 4}'
    big = _qwen_call("get_weather", lat="12345678901234567891")  # past a float's precision: kept exact
    assert parser.parse(big).tool_calls[0].arguments == '{"lat": 12345678901234567891}'
    assert parser.parse(_qwen_call("get_weather", lat="1e999")).tool_calls[0].arguments == '{"lat": "1e999"}'


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
    assert isinstance(get_parser("qwen3_coder"), Qwen3CoderParser)
    assert get_parser("qwen3_coder", TOOLS).tools is TOOLS
    assert set(PARSERS) == {"hermes", "qwen25", "llama3_json", "llama3", "qwen3_coder"}
    with pytest.raises(ValueError, match="hermes.*llama3_json") as err:
        get_parser("nope")
    assert "nope" in str(err.value)
