"""gpt-oss's harmony format through every API, on tiny models with gpt-oss's own vocabulary.

Each model is scripted (tests/models.py): whatever the chat, its greedy reply is one harmony
completion, an answer after some analysis, or a tool call after some analysis. A grammar (the
chat route's `ebnf`) forces other replies: a call with arguments that are not JSON, a reply cut
mid-channel. The prompts are checked against openai-harmony's own rendering, built here from
its objects rather than from the OpenAI messages the server translates.
"""

from __future__ import annotations

import datetime
import json

import anthropic
import ollama
import openai
import pytest
from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    HarmonyEncodingName,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
    load_harmony_encoding,
)

from tests.models import harmony_dir
from tests.serving import assert_openai_error, serve
from unison.frontend.text.tokenizer import Tokenizer

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function",
        "function": {"name": "get_weather", "description": "Current weather", "parameters": CITY}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0, "max_tokens": 64}


@pytest.fixture(scope="module")
def answering():
    yield from serve("harmony answer", str(harmony_dir("answer")), "--served-model-name", "m")


@pytest.fixture(scope="module")
def calling():
    yield from serve("harmony call", str(harmony_dir("call")), "--served-model-name", "m")


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def encoding():
    """openai-harmony's encoding, its o200k_base written from the model's tokenizer (offline)."""
    encoding = Tokenizer.from_dir(harmony_dir()).harmony
    assert encoding is not None
    assert encoding.name == load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS).name
    return encoding


# ---- prompts ---------------------------------------------------------------------------------


def reference(encoding, messages: list[Message]) -> list[int]:
    system = SystemContent.new().with_conversation_start_date(datetime.date.today().isoformat())
    effort = [m for m in messages if m.author.role == Role.SYSTEM]
    convo = Conversation.from_messages(effort or [Message.from_role_and_content(Role.SYSTEM, system)])
    rest = [m for m in messages if m.author.role != Role.SYSTEM]
    convo = Conversation.from_messages([*convo.messages, *rest])
    return encoding.render_conversation_for_completion(convo, Role.ASSISTANT)


def tokenize(server, messages: list[dict], **extra) -> list[int]:
    r = server.post("/tokenize", {"messages": messages, **extra})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_a_plain_chat_renders_as_harmony_does(answering, encoding):
    msgs = [{"role": "system", "content": "Be brief."}, *ASK]
    want = reference(encoding, [
        Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions("Be brief.")),
        Message.from_role_and_content(Role.USER, ASK[0]["content"])])
    assert tokenize(answering, msgs) == want


def test_a_tool_round_trip_renders_as_harmony_does(answering, encoding):
    """Tools as the functions namespace; an answered turn's analysis dropped; the turn that
    called a tool keeps its analysis, its call and the result; the effort in the system message."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [*ASK, {"role": "assistant", "reasoning_content": "Easy.", "content": "Let me look."},
            {"role": "user", "content": "And now?"},
            {"role": "assistant", "reasoning_content": "Need the tool.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    tools = [ToolDescription.new("get_weather", "Current weather", parameters=CITY)]
    system = SystemContent.new().with_conversation_start_date(datetime.date.today().isoformat()) \
        .with_reasoning_effort(ReasoningEffort.HIGH)
    assistant = Role.ASSISTANT
    want = reference(encoding, [
        Message.from_role_and_content(Role.SYSTEM, system),
        Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_function_tools(tools)),
        Message.from_role_and_content(Role.USER, ASK[0]["content"]),
        Message.from_role_and_content(assistant, "Let me look.").with_channel("final"),
        Message.from_role_and_content(Role.USER, "And now?"),
        Message.from_role_and_content(assistant, "Need the tool.").with_channel("analysis"),
        Message.from_role_and_content(assistant, '{"city": "Paris"}').with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), '{"temp": 21}')
        .with_channel("commentary").with_recipient("assistant")])
    assert tokenize(answering, msgs, tools=[TOOL], chat_template_kwargs={"reasoning_effort": "high"}) == want
    r = answering.post("/v1/chat/completions", {"messages": msgs, "tools": [TOOL], "reasoning_effort": "high",
                                                "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(want)
    text = encoding.decode(want)
    assert "<|call|>" in text and "<|return|>" not in text  # an earlier answer ends on <|end|>


def test_refusals_name_their_field(answering):
    cases = [({"messages": ASK, "tools": [{"type": "function", "function": {"name": "python"}}]}, "tools[0]"),
             ({"messages": ASK, "reasoning_effort": "extreme"}, "reasoning_effort"),
             ({"messages": [*ASK, {"role": "tool", "tool_call_id": "nope", "content": "x"}]},
              "messages[1].tool_call_id"),
             ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
              "messages[0].content[0].image_url"),
             ({"messages": [*ASK, {"role": "assistant", "content": "Sun"}], "continue_final_message": True,
               "add_generation_prompt": False}, "continue_final_message")]
    for body, field in cases:
        err = assert_openai_error(answering.post("/v1/chat/completions", body), 400)
        assert err["param"] == field, err


# ---- outputs, through each API ------------------------------------------------------------------


def test_chat_splits_reasoning_from_the_answer_whole_and_streamed(answering):
    c = client(answering)
    whole = c.chat.completions.create(model="m", messages=ASK, **GREEDY)
    m = whole.choices[0]
    assert (m.message.reasoning_content, m.message.content, m.finish_reason) == \
        ("Let me think.", "Hello there!", "stop")
    assert m.message.tool_calls is None
    reasoning, content, finish = "", "", None
    for chunk in c.chat.completions.create(model="m", messages=ASK, stream=True, **GREEDY):
        d = chunk.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        assert not (getattr(d, "reasoning_content", None) and d.content)  # the channels never mix
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, content, finish) == ("Let me think.", "Hello there!", "stop")


def test_chat_tool_calls_whole_and_streamed(calling):
    c = client(calling)
    whole = c.chat.completions.create(model="m", messages=ASK, tools=[TOOL], **GREEDY).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert whole.message.reasoning_content == "Need the weather."
    [call] = whole.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    names, args, finish = [], "", None
    for chunk in c.chat.completions.create(model="m", messages=ASK, tools=[TOOL], stream=True, **GREEDY):
        for d in chunk.choices[0].delta.tool_calls or []:
            names += [d.function.name] if d.function.name else []
            args += d.function.arguments or ""
        assert not chunk.choices[0].delta.content
        finish = chunk.choices[0].finish_reason or finish
    assert (names, json.loads(args), finish) == (["get_weather"], {"city": "Paris"}, "tool_calls")
    # tool_choice "none": the same reply is not a call, and says so as content
    none = c.chat.completions.create(model="m", messages=ASK, tools=[TOOL], tool_choice="none",
                                     **GREEDY).choices[0]
    assert none.message.tool_calls is None and json.loads(none.message.content) == {"city": "Paris"}


def test_a_forced_call_that_is_not_json_and_a_cut_reply_are_content(answering):
    """Forced by a grammar over harmony's tokens: a 200 with the text, never a 500."""
    bad = ('start: <|channel|> "analysis" <|message|> "Hm." <|end|> <|start|> '
           '"assistant to=functions.get_weather" <|channel|> "commentary json" <|message|> '
           '"{city: Paris" <|call|>')
    r = answering.post("/v1/chat/completions", {"messages": ASK, "tools": [TOOL], "ebnf": bad, **GREEDY})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "{city: Paris" and not choice["message"].get("tool_calls")
    assert choice["message"]["reasoning_content"] == "Hm." and choice["finish_reason"] == "stop"
    cut = client(answering).chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=15)
    assert (cut.choices[0].message.content, cut.choices[0].finish_reason) == ("Hello", "length")


def test_tool_choice_required_is_a_valid_call_on_commentary(answering):
    """The answering model would not call: "required" holds its reply to a call of a given tool
    (its city an enum: the scripted model would write a free string forever)."""
    c = client(answering)
    params = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": params}}
    choice = c.chat.completions.create(model="m", messages=ASK, tools=[tool], tool_choice="required",
                                       temperature=0, max_tokens=120).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)


def test_responses_items_whole_and_streamed(calling, answering):
    whole = client(answering).responses.create(model="m", input="Hi", temperature=0,
                                               reasoning={"effort": "low"})
    assert [i.type for i in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "Let me think." and whole.output_text == "Hello there!"
    events = list(client(calling).responses.create(model="m", input="Weather?", tools=[
        {"type": "function", "name": "get_weather", "parameters": CITY}], temperature=0, stream=True))
    done = events[-1].response
    assert [i.type for i in done.output] == ["reasoning", "function_call"]
    assert done.output[1].name == "get_weather" and json.loads(done.output[1].arguments) == {"city": "Paris"}


def test_anthropic_thinking_and_tool_use(answering, calling):
    with anthropic.Anthropic(base_url=answering.url, api_key="x", max_retries=0) as claude:
        m = claude.messages.create(model="m", max_tokens=64, messages=ASK, extra_body={"temperature": 0},
                                   output_config={"effort": "low"})
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == \
            [("thinking", "Let me think."), ("text", "Hello there!")]
        assert m.stop_reason == "end_turn"
    tool = {"name": "get_weather", "description": "Current weather", "input_schema": CITY}
    with anthropic.Anthropic(base_url=calling.url, api_key="x", max_retries=0) as claude:
        with claude.messages.stream(model="m", max_tokens=64, messages=ASK, tools=[tool],
                                    extra_body={"temperature": 0}) as s:
            m = s.get_final_message()
        assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.stop_reason == "tool_use"
        assert (m.content[1].name, m.content[1].input) == ("get_weather", {"city": "Paris"})


def test_ollama_thinking_and_tool_calls(answering, calling):
    r = ollama.Client(host=answering.url).chat(model="m", messages=ASK, think="high",
                                               options={"temperature": 0})
    assert (r.message.thinking, r.message.content) == ("Let me think.", "Hello there!")
    chunks = list(ollama.Client(host=calling.url).chat(model="m", messages=ASK, stream=True,
                                                      tools=[TOOL], options={"temperature": 0}))
    calls = [c for chunk in chunks for c in chunk.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == \
        [("get_weather", {"city": "Paris"})]
    assert "".join(chunk.message.thinking or "" for chunk in chunks) == "Need the weather."


def test_every_api_renders_a_tool_round_trip_as_harmony_does(answering):
    """The turn that called the tool keeps its analysis in every API's shape of it: OpenAI's
    reasoning_content, a Responses reasoning item, an Anthropic thinking block, Ollama's thinking."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    chat = [*ASK, {"role": "assistant", "reasoning_content": "Need the weather.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    ids = tokenize(answering, chat, tools=[TOOL])
    want = len(ids)
    assert "Need the weather." in Tokenizer.from_dir(harmony_dir()).decode(ids)
    one = {"temperature": 0, "max_tokens": 1}
    r = answering.post("/v1/chat/completions", {"messages": chat, "tools": [TOOL], **one})
    assert r.json()["usage"]["prompt_tokens"] == want
    items = [{"role": "user", "content": ASK[0]["content"]},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Need the weather."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 21}'}]
    tool = {"type": "function", "name": "get_weather", "description": "Current weather", "parameters": CITY}
    r = answering.post("/v1/responses", {"input": items, "tools": [tool], "temperature": 0,
                                         "max_output_tokens": 1})
    assert r.json()["usage"]["input_tokens"] == want, r.text
    claude = [*ASK, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Need the weather.", "signature": ""},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                      "content": '{"temp": 21}'}]}]
    r = answering.post("/v1/messages", {"messages": claude, "max_tokens": 1, "temperature": 0, "tools": [
        {"name": "get_weather", "description": "Current weather", "input_schema": CITY}]})
    usage = r.json()["usage"]  # Anthropic's input_tokens leave out what the cache held
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == want, r.text
    llama = [*ASK, {"role": "assistant", "content": "", "thinking": "Need the weather.",
                    "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "content": '{"temp": 21}', "tool_name": "get_weather"}]
    r = answering.post("/api/chat", {"model": "m", "messages": llama, "tools": [TOOL], "stream": False,
                                     "options": {"temperature": 0, "num_predict": 1}})
    assert r.json()["prompt_eval_count"] == want, r.text
