"""The clients people already use, against one server: Anthropic's SDK on /v1/messages, Ollama's
on /api/, and llama-server's own routes over HTTP; each API's error shape naming the field; and
schemathesis over all of them, which must find no 5xx."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import anthropic
import httpx
import jsonschema
import ollama
import pytest
import schemathesis
import tokenizers
from hypothesis import HealthCheck, given, settings

from tests.serving import serve
from tests.utils import HTTP
from unison.frontend.text.infill import STYLES, fim_tokens
from unison.frontend.text.tokenizer import Tokenizer

MODEL = "SmolLM2-135M-Instruct"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": CITY}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server():
    # A short context bounds what any request (schemathesis's too) may generate.
    yield from serve("clients", "--tool-call-parser", "hermes", "--context-length", "512", api_key="sk-test")


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key="sk-test", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def llama(server):
    return ollama.Client(host=server.url, headers={"Authorization": "Bearer sk-test"}, timeout=60)


# ---- Anthropic Messages ------------------------------------------------------------------------


def test_messages_whole_and_streamed_agree(claude):
    kw = {"model": MODEL, "max_tokens": 12, "messages": [{"role": "user", "content": "Say hi"}],
          "system": "Be brief.", "extra_body": GREEDY}
    whole = claude.messages.create(**kw)
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    with claude.messages.stream(**kw) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    # Anthropic counts the cached prompt apart; the two add up to the prompt's tokens.
    count = claude.messages.count_tokens(model=MODEL, messages=kw["messages"], system="Be brief.")
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == count.input_tokens
    assert final.usage.cache_read_input_tokens > 0  # the second time, the prompt came from the prefix cache


def test_messages_stop_sequence(claude):
    ask = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    m = claude.messages.create(model=MODEL, max_tokens=40, stop_sequences=[" 5"], extra_body=GREEDY,
                               messages=ask)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == " 5", m
    assert " 5" not in m.content[0].text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_messages_tool_round_trip(claude, stream: bool):
    kw = {"model": MODEL, "max_tokens": 60, "messages": ASK, "tools": [WEATHER], "extra_body": GREEDY,
          "tool_choice": {"type": "tool", "name": "get_weather"} if stream else {"type": "any"}}
    if stream:
        with claude.messages.stream(**kw) as s:
            types = [e.type for e in s]
            m = s.get_final_message()
        assert types[0] == "message_start" and types[-1] == "message_stop"
        assert "content_block_start" in types and "content_block_stop" in types
    else:
        m = claude.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    use = m.content[-1]
    assert use.type == "tool_use" and use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER["input_schema"])
    text = [{"type": "text", "text": "sunny, 21 C"}]
    result = {"type": "tool_result", "tool_use_id": use.id, "content": text}
    answer = claude.messages.create(model=MODEL, max_tokens=24, tools=[WEATHER], extra_body=GREEDY, messages=[
        *ASK, {"role": "assistant", "content": m.content}, {"role": "user", "content": [result]}])
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"


def test_messages_errors_in_anthropics_shape(server, claude):
    def post(body: dict, headers: dict | None = None) -> httpx.Response:
        return HTTP.post(f"{server.url}/v1/messages", json=body, timeout=30,
                          headers={"x-api-key": "sk-test"} if headers is None else headers)

    base = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ({k: v for k, v in base.items() if k != "max_tokens"}, 400, "invalid_request_error", "max_tokens"),
        (base | {"temperature": -1}, 400, "invalid_request_error", "temperature"),
        (base | {"stop_sequences": "x"}, 400, "invalid_request_error", "stop_sequences"),
        (base | {"model": "nope"}, 404, "not_found_error", "model"),
        (base | {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
         "invalid_request_error", "messages[0].content[0].source"),
        (base | {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400,
         "invalid_request_error", "messages[0].content[0].type"),
        (base | {"tool_choice": {"type": "sometimes"}}, 400, "invalid_request_error", "tool_choice.type"),
        (base | {"top_k": 1, "bogus": 1}, 400, "invalid_request_error", "bogus"),
    ]
    for body, status, kind, field in cases:
        r = post(body)
        assert r.status_code == status, (body, r.text)
        assert r.json() == {"type": "error", "error": {"type": kind, "message": r.json()["error"]["message"]}}
        assert field in r.json()["error"]["message"], (field, r.text)
    r = post(base, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(**base)


# ---- Ollama ------------------------------------------------------------------------------------


def test_ollama_chat_whole_and_streamed_agree(llama):
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}],
          "options": {"num_predict": 10, "temperature": 0, "seed": 1}}
    whole = llama.chat(**kw)
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 10
    assert whole.prompt_eval_count > 0 and whole.total_duration >= whole.eval_duration > 0
    parts = list(llama.chat(**kw, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].eval_count == 10
    assert "".join(p.message.content for p in parts) == whole.message.content
    tagged = llama.chat(**kw | {"model": MODEL + ":latest"})  # Ollama's clients add a tag
    assert tagged.message.content == whole.message.content


def test_ollama_generate_templated_raw_and_loaded(llama):
    greedy = {"num_predict": 6, "temperature": 0}
    templated = llama.generate(model=MODEL, prompt="Say hi", system="Be brief.", options=greedy)
    assert templated.done and templated.response and templated.prompt_eval_count > 10  # the template's tokens
    raw = llama.generate(model=MODEL, prompt="The capital of France is", raw=True, options=greedy)
    assert raw.prompt_eval_count == 5 and "Paris" in raw.response
    parts = llama.generate(model=MODEL, prompt="The capital of France is", raw=True, options=greedy,
                           stream=True)
    streamed = "".join(p.response for p in parts)
    assert streamed == raw.response
    loaded = llama.generate(model=MODEL, prompt="")  # how Ollama's clients load a model
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    stopped = llama.generate(model=MODEL, prompt="1, 2, 3,", raw=True,
                             options={"num_predict": 30, "temperature": 0, "stop": [" 6"]})
    assert stopped.done_reason == "stop" and " 6" not in stopped.response and " 5" in stopped.response


def test_ollama_format_is_structured_output(llama):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"]}
    ask = [{"role": "user", "content": "Describe Paris as JSON."}]
    r = llama.chat(model=MODEL, messages=ask, format=schema, options={"num_predict": 120, "temperature": 0})
    jsonschema.validate(json.loads(r.message.content), schema)
    r = llama.generate(model=MODEL, prompt="Describe Paris as JSON.", format="json",
                       options={"num_predict": 120, "temperature": 0})
    assert isinstance(json.loads(r.response), dict)


def test_ollama_tool_round_trip(llama):
    tool = {"type": "function", "function": {k if k != "input_schema" else "parameters": v
                                             for k, v in WEATHER.items()}}
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    r = llama.chat(model=MODEL, tools=[tool], options={"num_predict": 24, "temperature": 0}, messages=[
        *ASK, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"}])
    assert r.done and r.message.role == "assistant" and r.message.content


def test_ollama_describes_the_model(llama, server):
    tags = llama.list()
    assert [m.model for m in tags.models] == [MODEL]
    assert tags.models[0].details.format == "gguf" and tags.models[0].size > 0
    ps = llama.ps()
    assert ps.models[0].name == MODEL and ps.models[0].context_length == 512
    shown = llama.show(MODEL)
    assert "completion" in shown.capabilities and "tools" in shown.capabilities
    assert "insert" not in shown.capabilities  # SmolLM2 has no FIM tokens
    assert "im_start" in shown.template and shown.modelinfo["llama.context_length"] == 512
    assert HTTP.get(f"{server.url}/api/version", headers=server.headers).json()["version"]


def test_ollama_errors_in_ollamas_shape(server, llama):
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False}
    cases = [
        (base | {"options": {"bogus": 1}}, 400, "options.bogus"),
        (base | {"options": {"temperature": -1}}, 400, "options.temperature"),
        (base | {"options": {"num_predict": 100000}}, 400, "options.num_predict"),
        (base | {"options": {"mirostat": 2}}, 400, "options.mirostat"),
        (base | {"format": "yaml"}, 400, "format"),
        (base | {"model": "nope"}, 404, "model"),
        (base | {"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, 400,
         "messages[0].images"),
        ({k: v for k, v in base.items() if k != "model"}, 400, "model"),
        (base | {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
        (base | {"logprobs": True, "top_logprobs": 1000}, 400, "top_logprobs"),
    ]
    for body, status, field in cases:
        r = HTTP.post(f"{server.url}/api/chat", json=body, headers=server.headers, timeout=30)
        assert r.status_code == status, (body, r.text)
        assert set(r.json()) == {"error"} and field in r.json()["error"], (field, r.text)
    with pytest.raises(ollama.ResponseError) as e:
        llama.generate(model=MODEL, prompt="def f(", suffix="    return 1")
    assert e.value.status_code == 400 and "suffix" in e.value.error and MODEL in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        llama.embed(model=MODEL, input="hi")  # a generator: /api/embed needs an embedding model
    assert e.value.status_code == 400 and "embed" in e.value.error


# ---- llama-server's routes ---------------------------------------------------------------------


def test_completion_whole_and_streamed(server):
    body = {"prompt": "The capital of France is", "n_predict": 6, "temperature": 0, "n_probs": 2,
            "return_tokens": True}
    whole = server.post("/completion", body).json()
    assert whole["stop"] and whole["stop_type"] == "limit" and whole["tokens_predicted"] == 6
    assert whole["tokens_evaluated"] == 5 and len(whole["tokens"]) == 6 and "Paris" in whole["content"]
    assert len(whole["completion_probabilities"]) == 6
    assert all(len(p["top_logprobs"]) == 2 for p in whole["completion_probabilities"])
    with HTTP.stream("POST", f"{server.url}/completion", json=body | {"stream": True},
                      headers=server.headers, timeout=30) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c["content"] for c in chunks) == whole["content"]
    assert sum((c["tokens"] for c in chunks), []) == whole["tokens"]
    stopped = server.post("/completion", {"prompt": "1, 2, 3,", "n_predict": 30, "temperature": 0,
                                          "stop": [" 6"]}).json()
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == " 6"
    for bad, field in [({"n_probs": 10_000}, "n_probs"), ({"n_predict": -3}, "n_predict"),
                       ({"repeat_penalty": -1}, "repeat_penalty"), ({"mirostat": 2}, "mirostat")]:
        err = server.post("/completion", {"prompt": "Hi"} | bad).json()["error"]
        assert err["param"] == field and field in err["message"], (bad, err)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    shaped = server.post("/completion", {"prompt": "Paris as JSON:", "n_predict": 60, "temperature": 0,
                                         "json_schema": schema}).json()
    jsonschema.validate(json.loads(shaped["content"]), schema)
    digits = server.post("/completion", {"prompt": "Count:", "n_predict": 4, "temperature": 0,
                                         "grammar": "root ::= [0-9]+"}).json()
    assert digits["content"].isdigit()


def test_infill_refused_by_name_without_fim_tokens(server):
    r = server.post("/infill", {"input_prefix": "def f(", "input_suffix": "    return 1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_prefix"
    assert MODEL in r.json()["error"]["message"] and "fill-in-the-middle" in r.json()["error"]["message"]
    r = server.post("/v1/completions", {"prompt": "def f(", "suffix": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


@pytest.fixture(scope="module")
def fim_server(tmp_path_factory):
    """A tiny random model whose vocabulary has StarCoder's FIM tokens (three of SmolLM2's
    specials renamed): the infill routes end to end."""
    from unison.bench.model import write_model

    pre, suf, mid, _ = STYLES[1]
    renames = {"<jupyter_start>": pre, "<jupyter_text>": suf, "<jupyter_code>": mid}
    shape = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 128}
    path = write_model(shape, tmp_path_factory.mktemp("fim") / "fim.gguf", renames=renames)
    yield from serve("fim", str(path), "--context-length", "256")


def test_infill_on_a_model_with_fim_tokens(fim_server):
    body = {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n\nprint(add(1, 2))\n",
            "input_extra": [{"filename": "util.py", "text": "import math\n"}], "n_predict": 6,
            "temperature": 0}
    r = fim_server.post("/infill", body)
    assert r.status_code == 200, r.text
    infilled = r.json()
    assert infilled["tokens_predicted"] == 6 or infilled["stop_type"] == "eos"
    # <file_sep> name text, then PRE prefix SUF suffix MID: four special tokens and the texts' own.
    def tokenize(text: str) -> int:
        return fim_server.post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()["count"]

    texts = ["util.py\n", "import math\n", body["input_prefix"], body["input_suffix"]]
    assert infilled["tokens_evaluated"] == 4 + sum(map(tokenize, texts))
    completion = fim_server.post("/v1/completions", {"prompt": body["input_prefix"], "max_tokens": 4,
                                                      "suffix": body["input_suffix"], "temperature": 0})
    assert completion.status_code == 200 and completion.json()["usage"]["prompt_tokens"] == \
        3 + tokenize(body["input_prefix"]) + tokenize(body["input_suffix"])
    ollama_fim = fim_server.post("/api/generate", {"model": "fim.gguf", "prompt": body["input_prefix"],
                                                   "suffix": body["input_suffix"], "stream": False,
                                                   "options": {"num_predict": 4}})
    assert ollama_fim.status_code == 200 and ollama_fim.json()["done"], ollama_fim.text
    assert "insert" in fim_server.post("/api/show", {"model": "fim.gguf"}).json()["capabilities"]


def test_fim_prompt_from_the_models_tokens(server):
    """A vocabulary with StarCoder's FIM tokens (SmolLM2's, three of its specials renamed): the
    prompt is [file_sep name text] PRE prefix SUF suffix MID middle, as llama.cpp writes it."""
    path = Path(server.get("/get_model_info").json()["tokenizer_path"]) / "tokenizer.json"
    source = json.loads(path.read_text())
    pre, suf, mid, sep = STYLES[1]
    renames = {"<jupyter_start>": pre, "<jupyter_text>": suf, "<jupyter_code>": mid}
    for token in source["added_tokens"]:
        token["content"] = renames.get(token["content"], token["content"])
    vocab = source["model"]["vocab"]
    for old, new in renames.items():
        vocab[new] = vocab.pop(old)
    tok = Tokenizer(tokenizers.Tokenizer.from_str(json.dumps(source)), {})
    fim = fim_tokens(tok)
    assert fim is not None and fim.file_sep == tok.token_id(sep)
    ids = fim.prompt(tok, "def f(", "    return 1", "x", [("a.py", "import os")])
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    assert ids == ([fim.file_sep] + enc("a.py\n") + enc("import os") + [fim.prefix] + enc("def f(")
                   + [fim.suffix] + enc("    return 1") + [fim.middle] + enc("x"))


def test_props_template_and_slots(server):
    props = server.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 512 and props["model_alias"] == MODEL
    messages = [{"role": "user", "content": "hi"}]
    prompt = server.post("/apply-template", {"messages": messages}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = server.post("/tokenize", {"messages": messages}).json()["tokens"]
    assert ids == server.post("/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()["tokens"]
    assert server.get("/slots").json() == []
    seen: list = []

    def read() -> None:
        with HTTP.stream("POST", f"{server.url}/completion", headers=server.headers, timeout=60,
                          json={"prompt": "Once upon a time", "n_predict": 200, "ignore_eos": True,
                                "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and not seen:
                    seen.append(server.get("/slots").json())
    reader = threading.Thread(target=read)
    reader.start()
    reader.join(60)
    assert seen and len(seen[0]) == 1
    slot = seen[0][0]
    assert slot["is_processing"] and slot["prompt_tokens"] == 4 and slot["n_ctx"] == 512
    assert slot["next_token"][0]["n_remain"] + slot["next_token"][0]["n_decoded"] == 200


# ---- the one pipeline: disconnects and metrics -------------------------------------------------


# A string the model cannot end early: the stream is still running when its client leaves.
LONG = {"type": "object", "properties": {"story": {"type": "string", "minLength": 4000}},
        "required": ["story"]}


@pytest.mark.parametrize("path, body", [
    ("/v1/messages", {"max_tokens": 400, "stream": True,
                      "output_config": {"format": {"type": "json_schema", "schema": LONG}}}),
    ("/api/chat", {"model": MODEL, "options": {"num_predict": 400}, "format": LONG}),
    ("/completion", {"prompt": "Once upon a time", "n_predict": 400, "ignore_eos": True, "stream": True}),
], ids=["anthropic", "ollama", "llama-server"])
def test_a_client_that_leaves_mid_stream_frees_its_request(server, path: str, body: dict):
    messages = {"messages": [{"role": "user", "content": "Tell me a long story."}]}
    body = body if "prompt" in body else messages | body
    aborted = server.server_info()["stats"]["num_aborted"]
    with HTTP.stream("POST", server.url + path, json=body, headers=server.headers, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # (one iterator: dropping it would close the response here)
        next(lines)
        server.wait_running(1)
    server.wait_freed(timeout=10)  # the abort reached the core: no 400 tokens generated for nobody
    assert server.server_info()["stats"]["num_aborted"] == aborted + 1


def test_metrics_count_every_api(server):
    def generated() -> float:
        line = next(x for x in server.get("/metrics").text.splitlines()
                    if x.startswith("unison:generation_tokens_total"))
        return float(line.split()[-1])
    before = generated()
    server.post("/v1/messages", {"max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
    server.post("/api/generate", {"model": MODEL, "prompt": "hi", "stream": False,
                                  "options": {"num_predict": 3}})
    server.post("/completion", {"prompt": "hi", "n_predict": 3})
    assert generated() - before == 9


# ---- no 5xx anywhere --------------------------------------------------------------------------

NEW_ROUTES = r"^/(v1/messages|api/|completion|infill|apply-template|props|slots)"
SHORT = {"/api/chat": ("options", {"num_predict": 16}), "/api/generate": ("options", {"num_predict": 16}),
         "/completion": ("n_predict", 16), "/completions": ("n_predict", 16), "/infill": ("n_predict", 16)}


def test_schemathesis_finds_no_server_error(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=server.headers)
    operations = [op.ok() for op in schema.include(path_regex=NEW_ROUTES).get_all_operations()]
    assert len(operations) >= 14, [o.label for o in operations]
    for op in operations:
        @given(case=op.as_strategy())
        @settings(max_examples=20, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def no_5xx(case) -> None:
            if isinstance(case.body, dict):
                if "model" in case.body:
                    case.body["model"] = MODEL  # past the model check (a wrong name's 404 is tested above)
                key, cap = SHORT.get(case.path, (None, None))
                if key is not None:  # a length left unset means the context's rest: seconds per case
                    case.body.setdefault(key, cap)
            r = case.call(base_url=server.url, headers=server.headers, timeout=60)
            assert r.status_code < 500, (case.method, case.path, case.body, r.status_code, r.text[:500])
        no_5xx()
