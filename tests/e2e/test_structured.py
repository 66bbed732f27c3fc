"""Structured output: JSON schemas, regexes and EBNF grammars, through the Engine API and HTTP.

Every constrained output must finish with `stop` and satisfy its constraint, at temperature 0 and
1; unconstrained requests batched beside constrained ones decode as they do alone; bad
constraints are errors before anything is queued.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from tests.serving import assert_openai_error, serve
from tests.utils import assert_greedy_close
from unison import Engine

PROMPT = "Describe a person as JSON."
SCHEMAS = {
    "flat": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False},
    "enum and bounded number": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["color", "score"], "additionalProperties": False},
    "nested with arrays": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 16},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "owner": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "active": {"type": "boolean"}}, "required": ["id", "active"], "additionalProperties": False}},
        "required": ["title", "tags", "owner"], "additionalProperties": False},
    "array of objects": {"type": "array", "maxItems": 3, "minItems": 1, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["x"], "additionalProperties": False}},
}
REGEXES = [r"\d{3}-\d{4}", r"(yes|no|maybe)", r"[A-Z][a-z]{2,8} [A-Z][a-z]{2,8}"]
# Bounded (at most three terms), so that sampling at temperature 1 cannot run away.
EBNF = 'root ::= term | term "+" term | term "+" term "+" term\nterm ::= [0-9] | [0-9] [0-9]'
EBNF_LANGUAGE = re.compile(r"\d{1,2}(\+\d{1,2}){0,2}")


@pytest.fixture(scope="module")
def engine():
    with Engine(num_threads=1) as e:
        yield e


@pytest.fixture(autouse=True)
def integrity(request):
    yield
    if "engine" in request.fixturenames:
        e = request.getfixturevalue("engine")
        info = e.get_server_info()
        assert info["num_running"] == info["num_waiting"] == info["kv_blocks_used"] == 0, info
        e.check_integrity()


def params(temperature: float, **constraint) -> dict:
    return {"temperature": temperature, "max_new_tokens": 200, "sampling_seed": 7, **constraint}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(engine, temperature):
    outs = engine.generate([PROMPT] * len(SCHEMAS),
                           [params(temperature, json_schema=s) for s in SCHEMAS.values()])
    for name, schema, out in zip(SCHEMAS, SCHEMAS.values(), outs):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (name, out["text"])
        jsonschema.validate(json.loads(out["text"]), schema)
    # A schema given as a JSON string works alike.
    out = engine.generate(PROMPT, params(temperature, json_schema=json.dumps(SCHEMAS["flat"])))
    jsonschema.validate(json.loads(out["text"]), SCHEMAS["flat"])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_and_ebnf_outputs_match(engine, temperature):
    outs = engine.generate(["Answer:"] * (len(REGEXES) + 1),
                           [params(temperature, regex=r) for r in REGEXES] + [params(temperature, ebnf=EBNF)])
    for pattern, out in zip(REGEXES, outs):
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        assert re.fullmatch(pattern, out["text"]), (pattern, out["text"])
    assert outs[-1]["meta_info"]["finish_reason"]["type"] == "stop"
    assert EBNF_LANGUAGE.fullmatch(outs[-1]["text"]), outs[-1]["text"]


def test_unconstrained_requests_beside_constrained_ones_decode_as_alone(engine):
    plain = ["The capital of France is", "Once upon a time", "def add(a, b):", "1, 2, 3, 4,"]
    greedy = {"temperature": 0, "max_new_tokens": 24}
    alone = [engine.generate(p, greedy, return_logprob=True, top_logprobs_num=5) for p in plain]
    mixed = engine.generate(plain + [PROMPT] * 4, [greedy] * 4 + [params(0.0, json_schema=s)
                                                                   for s in SCHEMAS.values()],
                            return_logprob=True, top_logprobs_num=5)
    for i, (a, m) in enumerate(zip(alone, mixed[:4])):
        def tops(o):
            return [dict((t, lp) for lp, t, _ in row) for row in o["meta_info"]["output_top_logprobs"]]
        assert_greedy_close(a["output_ids"], tops(a), m["output_ids"], tops(m), name=f"prompt {i}")
    for schema, out in zip(SCHEMAS.values(), mixed[4:]):
        jsonschema.validate(json.loads(out["text"]), schema)


def test_streaming_n_and_stop_strings(engine):
    schema = SCHEMAS["nested with arrays"]
    chunks = list(engine.generate(PROMPT, {**params(1.0, json_schema=schema), "n": 2}, stream=True))
    finals = {}
    for c in chunks:
        finals[c["index"]] = c
    assert sorted(finals) == [0, 1]
    for out in finals.values():
        jsonschema.validate(json.loads(out["text"]), schema)
    # A stop string ends a constrained request early, as any other.
    out = engine.generate(PROMPT, {**params(0.0, json_schema=schema), "stop": '"tags"'})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": '"tags"'}
    assert out["text"].startswith("{") and '"tags"' not in out["text"]


BAD = [
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": {"type": "nonsense"}}, "json_schema"),
    ({"regex": "[0-9"}, "regex"),
    ({"ebnf": "root ::= ("}, "ebnf"),
    ({"regex": "a+", "json_schema": {"type": "object"}}, "at most one"),
]


@pytest.mark.parametrize("constraint, fragment", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_constraints_are_value_errors(engine, constraint, fragment):
    before = engine.get_server_info()["stats"]
    with pytest.raises(ValueError, match=fragment):
        engine.generate(PROMPT, params(0.0, **constraint))
    assert engine.get_server_info()["stats"] == before  # nothing was queued


@pytest.fixture(scope="module")
def server():
    yield from serve("structured output", "--num-threads", "1")


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_response_format_over_http(server, route):
    def body(response_format: dict) -> dict:
        base = {"max_tokens": 200, "temperature": 0, "response_format": response_format}
        if route.endswith("chat/completions"):
            return {**base, "messages": [{"role": "user", "content": PROMPT}]}
        return {**base, "prompt": PROMPT}

    def text(r: httpx.Response) -> str:
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        return choice["message"]["content"] if "message" in choice else choice["text"]

    schema = SCHEMAS["nested with arrays"]
    r = server.post(route, body({"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}))
    jsonschema.validate(json.loads(text(r)), schema)
    # Any object: unbounded, so a small model may still be writing one at max_tokens.
    choice = server.post(route, body({"type": "json_object"})).json()["choices"][0]
    out = choice["message"]["content"] if "message" in choice else choice["text"]
    assert out.lstrip().startswith("{"), out
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(out), dict)
    assert server.post(route, body({"type": "text"})).status_code == 200  # no constraint

    r = server.post(route, body({"type": "json_schema", "json_schema": {"name": "x",
                                                                        "schema": {"type": "nonsense"}}}))
    assert assert_openai_error(r, 400, "response_format is invalid", "nonsense")["param"] == "response_format"
    assert_openai_error(server.post(route, body({"type": "yaml"})), 400, "response_format")


def test_native_generate_takes_constraints(server):
    r = server.post("/generate", {"text": "Answer:", "sampling_params": {
        "regex": REGEXES[0], "temperature": 0, "max_new_tokens": 20}})
    assert r.status_code == 200, r.text
    assert re.fullmatch(REGEXES[0], r.json()["text"])
    assert_openai_error(server.post("/generate", {"text": "Answer:", "sampling_params": {"regex": "("}}),
                        400, "regex")
