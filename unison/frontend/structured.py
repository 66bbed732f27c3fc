"""Structured output, the frontend's half: a JSON schema, a regex or an EBNF grammar becomes
llguidance's grammar text, checked here so that a bad one is a ValueError before anything is
queued. The core compiles the text against the vocabulary (unison/core/grammar.py).

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

KINDS = ("json_schema", "regex", "ebnf")
JSON_OBJECT = {"type": "object"}  # response_format {"type": "json_object"}: any JSON object


def grammar_text(json_schema: str | dict[str, Any] | None = None, regex: str | None = None,
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
    return json.dumps(spec)
