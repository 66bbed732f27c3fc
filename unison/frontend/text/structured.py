"""Structured output, the frontend's half: a JSON schema, a regex or an EBNF grammar becomes
llguidance's grammar text, checked here so that a bad one is a ValueError before anything is
queued. The core compiles the text against the vocabulary (unison/core/grammar.py).

JSON schemas are strict by default, as xgrammar compiles them: an object schema that does not set
additionalProperties gets false, and whitespace between tokens is bounded. A schema sets
additionalProperties (or llguidance's top-level "x-guidance") itself to have it otherwise; the
OpenAI routes do so for `strict: false`.

llguidance rather than xgrammar, measured here (SmolLM2's 49k vocabulary, a nested test schema):
it installs as one wheel with no dependencies (xgrammar 0.2.8 declares triton, torch and
transformers, so it needs a --no-deps install and a hand-pinned apache-tvm-ffi); it compiles the
schema in 2 ms against xgrammar's 190 ms; its mask costs about 40 µs per constrained request per
step (xgrammar: 3 µs), nothing beside CPU steps of 30-150 ms.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from unison.json_types import JSONObject

KINDS = ("json_schema", "regex", "ebnf")
JSON_OBJECT = {"type": "object", "additionalProperties": True}  # response_format json_object: any
# Between JSON tokens: at most one space, as in `{"a": 1, "b": 2}`. llguidance's default allows
# any whitespace, and small models take it: pretty-printed calls spend a third of max_tokens on
# indentation, and a run of newlines can fill it.
WHITESPACE = r"[\x20]?"

# Where a JSON schema holds subschemas: one, a map of them, or a list of them.
_SUBSCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "not", "if", "then", "else",
              "contains", "propertyNames", "additionalItems", "unevaluatedItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")  # not allOf: see with_additional_properties


def with_additional_properties(schema: Any, allowed: bool) -> Any:  # Any: JSON, returned in its shape
    """A copy of `schema` where every object schema that does not say whether it allows
    properties it does not name says `allowed`. Strict (False) is what xgrammar, the default of
    vLLM and SGLang, compiles by default, and what OpenAI's `strict: true` requires: without it a
    small model goes on inventing keys until max_tokens cuts the JSON. allOf members are left as
    they are: each would forbid the others' properties."""
    if isinstance(schema, list):
        return [with_additional_properties(s, allowed) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict | list):
            out[key] = with_additional_properties(out[key], allowed)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: with_additional_properties(v, allowed) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = with_additional_properties(out[key], allowed)
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in out
    if is_object and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = allowed
    return out


def grammar_text(json_schema: str | JSONObject | None = None, regex: str | None = None,
                 ebnf: str | None = None) -> str | None:
    """llguidance grammar text for at most one constraint; ValueError naming the problem."""
    given = {k: v for k, v in zip(KINDS, (json_schema, regex, ebnf)) if v is not None}
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"{sorted(given)[0]}: at most one of json_schema, regex and ebnf may be given, "
                         f"got {sorted(given)}")
    [(kind, spec)] = given.items()
    if kind == "json_schema" and isinstance(spec, dict):
        spec = json.dumps(spec)  # hashable, for the cache
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{kind} is invalid: " + ("a JSON schema must be an object" if kind == "json_schema"
                                                   else f"{kind} must be a non-empty string"))
    return _convert(kind, spec)


@functools.lru_cache(maxsize=256)
def _convert(kind: str, spec: str) -> str:
    """Conversion and validation cost milliseconds (6-16 ms for the nested test schema): done
    once per distinct constraint, which clients tend to send again and again."""
    from llguidance import LLMatcher

    try:
        if kind == "json_schema":
            grammar = LLMatcher.grammar_from_json_schema(_schema(spec))
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(spec)
        else:
            from llguidance.gbnf_to_lark import any_to_lark

            grammar = LLMatcher.grammar_from_lark(any_to_lark(spec))
    except Exception as e:  # the converters' own errors for a malformed spec (GbnfToLarkError, ...)
        raise ValueError(f"{kind} is invalid: {e}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"{kind} is invalid: {error}")
    return grammar


def _schema(spec: str) -> str:
    try:
        spec = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError("a JSON schema must be an object")
    spec = with_additional_properties(spec, False)
    spec.setdefault("x-guidance", {"whitespace_pattern": WHITESPACE})  # unless the schema sets its own
    return json.dumps(spec)
