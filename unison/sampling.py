"""The sampling schema: every option a request may set, declared once in OPTIONS.

From this one table come
- the user's `SamplingParams` and its checks (frontend/sampling_params.py), errors naming the field;
- `CoreSamplingParams`, the wire struct the core acts on, and the core's re-check (`core_problem`);
- the sampling fields of the OpenAI request bodies, under OpenAI's / vLLM's names
  (server/pipeline/inputs.py);
- the fuzz strategy that throws hostile values at the core (tests/e2e/test_protocol_fuzz.py).

A new option is one line here, its field in SamplingParams (and in CoreSamplingParams when the core
acts on it: both are plain classes a type checker reads, held to this table by tests/e2e/test_sampling.py),
and its effect in core/sampler.py (or the frontend, for options the core never sees). This module
imports nothing of the frontend, the core or the server: all three read it.
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import dataclass
from typing import Any

import msgspec

from unison.json_types import JSONObject

# Limits, named once and used by every layer that checks them.
MAX_N = 128  # samples per prompt
MAX_STOP_STRINGS = 32  # stop strings, and stop regexes, per request
MAX_TOP_LOGPROBS = 20  # top logprobs per position (OpenAI's limit)
MAX_LOGIT_BIAS = 100.0  # |bias| per token (OpenAI's limit)
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class Option:
    """One sampling option: its type and default, the numeric range it must lie in, the name an
    OpenAI request gives it, and whether it travels to the core unchanged."""

    name: str
    type: Any  # a type form (int | None, list[str] | None): typing has no type for those
    default: object
    lo: float | None = None  # bounds of numbers; None: unbounded on that side
    hi: float | None = None
    lo_open: bool = False  # lo itself is out of range
    forbid: tuple[float, ...] = ()  # values inside the range that are still refused (top_k=0)
    openai: str | None = None  # the OpenAI / vLLM request field; None: not an OpenAI field
    core: bool = False  # a field of CoreSamplingParams, as given (else the frontend derives it)
    model_default: bool = False  # generation_config.json may set its default (as vLLM reads it)
    doc: str = ""

    @property
    def numeric(self) -> bool:
        return self.lo is not None or self.hi is not None

    def problem(self, value: object) -> str | None:
        """Why `value` is not allowed, in the user's words; None when it is. Numbers only: options
        of other types are checked by SamplingParams (their rules are not ranges)."""
        kind = "integer" if _base(self.type) is int else "number"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                (kind == "integer" and not isinstance(value, int)):
            return f"must be {'an integer' if kind == 'integer' else 'a number'}, got {value!r}"
        low_bad = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        if math.isnan(value) or low_bad or (self.hi is not None and value > self.hi) or value in self.forbid:
            return f"must be in {self.range_text()}, got {value}"
        return None

    def range_text(self) -> str:
        left = "(" if self.lo_open else "["
        lo = "-inf" if self.lo is None else self.lo
        hi = "inf" if self.hi is None else self.hi
        excluded = f" except {', '.join(map(str, self.forbid))}" if self.forbid else ""
        return f"{left}{lo}, {hi}]{excluded}"


def _base(tp: object) -> object:
    """int for `int | None`, and so on: the type a present value has."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if isinstance(tp, types.UnionType) and len(args) == 1 else tp


OPTIONS: tuple[Option, ...] = (
    # How long: None = as many tokens as the context (and the KV cache) allow.
    Option("max_new_tokens", int | None, 128, lo=0, openai="max_tokens"),
    Option("min_new_tokens", int, 0, lo=0, openai="min_tokens", core=True),
    Option("n", int, 1, lo=1, hi=MAX_N, openai="n"),
    # When to stop. stop_regex: searched in the output text, SGLang's (finish_reason "matched").
    Option("stop", str | list[str] | None, None, openai="stop"),
    Option("stop_token_ids", list[int] | None, None, openai="stop_token_ids"),
    Option("stop_regex", str | list[str] | None, None),
    Option("ignore_eos", bool, False, openai="ignore_eos", core=True),
    Option("no_stop_trim", bool, False, openai="include_stop_str_in_output",
           doc="keep the matched stop string in the text"),
    # What to sample: temperature, then top_k, top_p, min_p, typical_p on the probabilities.
    Option("temperature", float, 1.0, lo=0.0, openai="temperature", core=True, model_default=True),
    Option("top_p", float, 1.0, lo=0.0, hi=1.0, lo_open=True, openai="top_p", core=True, model_default=True),
    Option("top_k", int, -1, lo=-1, forbid=(0,), openai="top_k", core=True, model_default=True,
           doc="-1: all tokens"),
    Option("min_p", float, 0.0, lo=0.0, hi=1.0, openai="min_p", core=True, model_default=True),
    Option("typical_p", float, 1.0, lo=0.0, hi=1.0, lo_open=True, openai="typical_p", core=True,
           model_default=True, doc="locally typical sampling, as transformers and llama.cpp"),
    Option("frequency_penalty", float, 0.0, lo=-2.0, hi=2.0, openai="frequency_penalty", core=True),
    Option("presence_penalty", float, 0.0, lo=-2.0, hi=2.0, openai="presence_penalty", core=True),
    Option("repetition_penalty", float, 1.0, lo=0.0, hi=2.0, lo_open=True, openai="repetition_penalty",
           core=True, model_default=True),
    Option("logit_bias", dict[int | str, float] | None, None, openai="logit_bias", doc="token id -> bias"),
    Option("sampling_seed", int | None, None, lo=0, hi=MAX_SEED, openai="seed"),
    # How the text reads.
    Option("skip_special_tokens", bool, True, openai="skip_special_tokens"),
    Option("spaces_between_special_tokens", bool, True, openai="spaces_between_special_tokens"),
    # Structured output, at most one (SGLang's names): a JSON Schema (dict or string), a regex the
    # whole output must match, or an EBNF grammar (GBNF or Lark). OpenAI's response_format maps
    # onto json_schema in the server.
    Option("json_schema", str | JSONObject | None, None),  # a JSON Schema: arbitrary JSON
    Option("regex", str | None, None, openai="regex"),
    Option("ebnf", str | None, None, openai="ebnf"),
    # Token ids after which the constraint holds (a reasoning model's "</think>"): the output is
    # free until they appear. The OpenAI routes set it with a reasoning parser.
    Option("structured_after", list[int] | None, None),
)
BY_NAME = {o.name: o for o in OPTIONS}
CORE_OPTIONS = tuple(o for o in OPTIONS if o.core)


class CoreSamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """The part of SamplingParams the core acts on: the fields the frontend derives from the
    user's options, then every `core` option as given (tests/e2e/test_sampling.py holds them to
    OPTIONS' types and defaults)."""

    max_new_tokens: int = 128  # None resolved against the context
    logit_bias: dict[int, float] = {}  # keys as token ids
    seed: int = 0  # always set: the frontend draws one when the user gives none
    stop_token_ids: list[int] = []
    grammar: str | None = None  # llguidance grammar text (from a JSON schema, regex or EBNF)
    # With a reasoning parser: the tokens that close the reasoning section (</think>). The grammar
    # holds the output only after them, as SGLang constrains reasoning models.
    grammar_after: list[int] = []
    # The `core` options, in OPTIONS' order.
    min_new_tokens: int = 0
    ignore_eos: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    typical_p: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1


def core_problem(p: CoreSamplingParams) -> str | None:
    """The core's re-check of a CoreSamplingParams (whoever sent it: a frontend may be buggy or not
    ours): every core option in its declared range, every number finite, a seed it can use."""
    for o in CORE_OPTIONS:
        value = getattr(p, o.name)
        if o.numeric and (problem := o.problem(value)) is not None:
            return f"{o.name} {problem}"
    if not all(math.isfinite(b) for b in p.logit_bias.values()):
        return "logit_bias values must be finite numbers"
    if not 0 <= p.seed <= MAX_SEED:
        return f"seed must be in [0, {MAX_SEED}]"
    return None
