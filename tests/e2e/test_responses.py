"""What an agent framework sends first, through the official `openai` client: tool calls held to
the usual schemas (strict by default), structured output that completes, and the Responses API
(`/v1/responses`) whole, streamed, and around a function-call round trip."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.serving import assert_openai_error, serve

# The usual pair, as agent frameworks write them: no additionalProperties anywhere.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current local time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                   "required": ["timezone"]}}}
MODEL = "SmolLM2-135M-Instruct"  # the served name of the embedded model
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it in Tokyo?"}]


@pytest.fixture(scope="module")
def server():
    yield from serve("responses", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def _valid(calls: list[tuple[str, str]]) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    assert calls
    for name, arguments in calls:
        args = json.loads(arguments)
        jsonschema.validate(args, schemas[name])
        assert set(args) <= set(schemas[name]["properties"]), f"invented keys: {args}"  # strict


def _streamed(stream) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            if d.id is not None:
                calls[d.index] = [d.function.name, ""]
            calls[d.index][1] += d.function.arguments or ""
    return [(n, a) for n, a in (calls[i] for i in sorted(calls))]


@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_calls_on_the_usual_schemas(client, choice: str, stream: bool):
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = {"model": MODEL, "messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 96, "temperature": 0,
          "tool_choice": "required" if choice == "required" else named}
    if stream:
        calls = _streamed(client.chat.completions.create(stream=True, **kw))
    else:
        message = client.chat.completions.create(**kw).choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    _valid(calls)
    if choice == "named":
        assert [n for n, _ in calls] == ["get_weather"]


def test_a_json_schema_object_completes(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                               "population": {"type": "integer"}},
              "required": ["city", "country"]}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}], max_tokens=256,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    value = json.loads(r.choices[0].message.content)
    jsonschema.validate(value, schema)
    assert set(value) <= {"city", "country", "population"}


def test_a_bad_tool_schema_is_named_as_sent(server):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}
    body = {"messages": ASK, "tools": [WEATHER, bad], "tool_choice": "required"}
    r = server.post("/v1/chat/completions", body)
    assert_openai_error(r, 400, "tools[1].function.parameters")
    assert r.json()["error"]["param"] == "tools[1].function.parameters"


def test_max_completion_tokens_is_named_as_sent(server):
    r = server.post("/v1/chat/completions", {"messages": ASK, "max_completion_tokens": -1})
    assert_openai_error(r, 400, "max_completion_tokens")
    assert r.json()["error"]["param"] == "max_completion_tokens"


# ---- /v1/responses ------------------------------------------------------------------------------

def test_responses_create(client):
    question = "What is the capital of France?"
    r = client.responses.create(model=MODEL, instructions="Answer briefly.", input=question,
                                max_output_tokens=16, temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output_text and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.output_tokens <= 16 and r.usage.input_tokens > 0
    items = [{"role": "user", "content": [{"type": "input_text", "text": question}]}]
    again = client.responses.create(model=MODEL, instructions="Answer briefly.", input=items,
                                    max_output_tokens=16, temperature=0)
    assert again.output_text == r.output_text  # the same conversation, in items


def test_responses_stream_events_in_order(client):
    with client.responses.stream(model=MODEL, input="Name three colors.", max_output_tokens=24,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.index("response.output_item.added") < kinds.index("response.output_text.delta")
    assert kinds.index("response.output_text.done") < kinds.index("response.completed")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and final.output_text == deltas
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    r = client.responses.create(model=MODEL, input="What is 2 + 2?", max_output_tokens=64, temperature=0,
                                text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_function_call_round_trip(client, stream: bool):
    tools = [{"type": "function", **WEATHER["function"]}, {"type": "function", **TIME["function"]}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = {"model": MODEL, "input": ask, "tools": tools, "max_output_tokens": 64, "temperature": 0,
          "tool_choice": {"type": "function", "name": "get_weather"}}
    if stream:
        with client.responses.stream(**kw) as s:
            kinds = [e.type for e in s]
            r = s.get_final_response()
        assert "response.function_call_arguments.delta" in kinds
    else:
        r = client.responses.create(**kw)
    [call] = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    _valid([(call.name, call.arguments)])
    follow = ask + [{"type": "function_call", "call_id": call.call_id, "name": call.name,
                     "arguments": call.arguments},
                    {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, cloudy"}]
    answer = client.responses.create(model=MODEL, input=follow, tools=tools, tool_choice="none",
                                     max_output_tokens=16, temperature=0)
    assert answer.output_text and not [i for i in answer.output if i.type == "function_call"]


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object",
                                                                                      "properties": 5}}}},
     "text.format"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "x", "temprature": 0.5}, "temprature"),
])
def test_responses_bad_input_names_the_field(server, body: dict, param: str):
    r = server.post("/v1/responses", body)
    assert_openai_error(r, 400)
    assert r.json()["error"]["param"] == param, r.json()


# ---- the schema and call handling behind them, without a server ---------------------------------

def test_schemas_are_strict_unless_they_say_otherwise():
    from unison.frontend.text.structured import WHITESPACE, grammar_text
    from unison.server.apis.openai.bodies import ChatCompletionRequest

    inner, open_ = {"type": "object", "properties": {"b": {"type": "string"}}}, {"additionalProperties": True}
    schema = {"type": "object", "properties": {"a": inner, "c": {"type": "object", **open_}},
              "allOf": [{"properties": {"d": {"type": "integer"}}}]}
    [held] = json.loads(grammar_text(schema))["grammars"]
    held = held["json_schema"]
    assert held["additionalProperties"] is False and held["properties"]["a"]["additionalProperties"] is False
    assert held["properties"]["c"]["additionalProperties"] is True  # what the schema says stays
    assert "additionalProperties" not in held["allOf"][0]  # each member would forbid the others'
    assert held["x-guidance"] == {"whitespace_pattern": WHITESPACE}
    own = {**schema, "x-guidance": {"whitespace_flexible": True}}
    assert json.loads(grammar_text(own))["grammars"][0]["json_schema"]["x-guidance"] == own["x-guidance"]
    spec = {"name": "n", "schema": schema, "strict": False}
    loose = ChatCompletionRequest(messages=ASK, response_format={"type": "json_schema", "json_schema": spec})
    loose = loose._json_schema()
    assert loose["additionalProperties"] is True and loose["properties"]["a"]["additionalProperties"] is True


def test_required_calls_cut_by_max_tokens_keep_the_whole_ones():
    from unison.frontend.request import LengthFinish
    from unison.server.apis.openai.render import finish_reason
    from unison.server.pipeline.tools import plan_tools

    plan = plan_tools([WEATHER, TIME], "required", None, None)
    whole = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    _, calls, ends_in_call = plan.output().final(f'[{whole}, {{"name": "get_ti')
    assert [c.name for c in calls] == ["get_weather"]
    assert finish_reason(LengthFinish(9), ends_in_call) == "length"
    content, calls, _ = plan.output().final('[{"name": "get_wea')
    assert content == '[{"name": "get_wea' and not calls  # nothing whole
