"""SamplingParams: what a user may ask of one request, named and bounded as in SGLang."""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, fields
from typing import Any

from unison.errors import InvalidParam
from unison.frontend.structured import grammar_text
from unison.protocol import CoreSamplingParams

MAX_N = 128
MAX_STOP_STRINGS = 32


@dataclass
class SamplingParams:
    max_new_tokens: int | None = 128  # None: as many as the context (and the KV cache) allow
    min_new_tokens: int = 0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    # Regular expressions searched in the output text; the first match ends the request, the
    # text kept up to the match's end (finish_reason "matched": the pattern, as SGLang's).
    stop_regex: str | list[str] | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[Any, float] | None = None
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Structured output, at most one (SGLang's names): a JSON Schema (dict or string), a regex the
    # whole output must match, or an EBNF grammar (GBNF or Lark syntax).
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    # Token ids after which the constraint holds (a reasoning model's "</think>"): the output is
    # free until they appear. The OpenAI routes set it with a reasoning parser.
    structured_after: list[int] | None = None

    @classmethod
    def from_any(cls, params: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return params
        if not isinstance(params, dict):
            raise InvalidParam("sampling_params", "sampling_params must be a dict or SamplingParams, "
                               f"got {type(params).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise InvalidParam(unknown[0], f"unknown sampling parameter(s) {unknown}; "
                               f"allowed: {sorted(known)}")
        return cls(**params)

    @property
    def grammar_kind(self) -> str | None:
        """Which constraint is given (json_schema, regex or ebnf), if any."""
        return next((k for k in ("json_schema", "regex", "ebnf") if getattr(self, k) is not None), None)

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def stop_regexes(self) -> list[str]:
        return [self.stop_regex] if isinstance(self.stop_regex, str) else list(self.stop_regex or [])

    def max_tokens(self, prompt_len: int, room: int) -> int:
        """max_new_tokens, None read as everything `room` (tokens of context, or KV) leaves."""
        return room - prompt_len if self.max_new_tokens is None else self.max_new_tokens

    def validate(self, *, vocab_size: int, context_length: int, prompt_len: int,
                 room: int | None = None) -> None:
        """Raise InvalidParam naming the field and the allowed range; nothing is queued before this.
        `room`: the tokens one request may reach (context and KV cache), for max_new_tokens=None."""
        if self.max_new_tokens is not None:
            _int("max_new_tokens", self.max_new_tokens, lo=0)
        max_new = self.max_tokens(prompt_len, context_length if room is None else room)
        _int("min_new_tokens", self.min_new_tokens, lo=0, hi=max(max_new, 0))
        _int("n", self.n, lo=1, hi=MAX_N)
        _float("temperature", self.temperature, lo=0.0)
        _float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _int("top_k", self.top_k, lo=-1)
        if self.top_k == 0:
            raise InvalidParam("top_k", "top_k must be -1 (all tokens) or >= 1, got 0")
        _float("min_p", self.min_p, lo=0.0, hi=1.0)
        _float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _float("repetition_penalty", self.repetition_penalty, lo=0.0, hi=2.0, lo_open=True)
        for name in ("ignore_eos", "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParam(name, f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.sampling_seed is not None:
            _int("sampling_seed", self.sampling_seed, lo=0, hi=2**63 - 1)
        self._validate_stop()
        self._grammar()
        for tid in self.stop_token_ids or []:
            _int("stop_token_ids", tid, lo=0, hi=vocab_size - 1)
        if self.structured_after is not None:
            if not isinstance(self.structured_after, list) or not self.structured_after:
                raise InvalidParam("structured_after", "structured_after must be a non-empty list of "
                                                       "token ids")
            if self.grammar_kind is None:
                raise InvalidParam("structured_after", "structured_after needs json_schema, regex or ebnf")
            for tid in self.structured_after:
                _int("structured_after", tid, lo=0, hi=vocab_size - 1)
        self._bias_items(vocab_size)
        if prompt_len > context_length:
            raise InvalidParam("prompt", f"prompt ({prompt_len} tokens) exceeds the context length "
                                         f"({context_length})")
        if self.max_new_tokens is None and max_new < 1:
            raise InvalidParam("max_new_tokens", f"max_new_tokens=None: the prompt ({prompt_len} tokens) "
                               "leaves no room to generate")
        if prompt_len + max_new > context_length:
            raise InvalidParam(
                "max_new_tokens",
                f"max_new_tokens ({max_new}) + the prompt ({prompt_len} tokens) exceeds the "
                f"context length ({context_length}); lower max_new_tokens to at most "
                f"{context_length - prompt_len} or shorten the prompt"
            )

    def _validate_stop(self) -> None:
        if self.stop is not None and not isinstance(self.stop, (str, list)):
            raise InvalidParam("stop", "stop must be a string or a list of strings, "
                                       f"got {type(self.stop).__name__}")
        stops = self.stop_strings
        if len(stops) > MAX_STOP_STRINGS:
            raise InvalidParam("stop", f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} "
                                       "are allowed")
        for s in stops:
            if not isinstance(s, str) or not s:
                raise InvalidParam("stop", f"stop strings must be non-empty strings, got {s!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, list):
            raise InvalidParam("stop_token_ids", "stop_token_ids must be a list of token ids")
        if self.stop_regex is not None and not isinstance(self.stop_regex, (str, list)):
            raise InvalidParam("stop_regex", "stop_regex must be a string or a list of strings")
        if len(self.stop_regexes) > MAX_STOP_STRINGS:
            raise InvalidParam("stop_regex", f"stop_regex has {len(self.stop_regexes)} patterns; at most "
                                             f"{MAX_STOP_STRINGS} are allowed")
        for pattern in self.stop_regexes:
            if not isinstance(pattern, str) or not pattern:
                raise InvalidParam("stop_regex", f"stop_regex patterns must be non-empty strings, "
                                                 f"got {pattern!r}")
            try:
                re.compile(pattern)
            except re.error as e:
                raise InvalidParam("stop_regex", f"stop_regex {pattern!r} is not a valid regular "
                                                 f"expression: {e}") from None

    def _grammar(self) -> str | None:
        """The constraint as llguidance grammar text (converted once per distinct spec)."""
        try:
            return grammar_text(self.json_schema, self.regex, self.ebnf)
        except ValueError as e:
            raise InvalidParam(self.grammar_kind, str(e)) from None  # (only a given one is converted)

    def _bias_items(self, vocab_size: int) -> dict[int, float]:
        if self.logit_bias is None:
            return {}
        if not isinstance(self.logit_bias, dict):
            raise InvalidParam("logit_bias", "logit_bias must be a dict of token id -> bias")
        out = {}
        for key, bias in self.logit_bias.items():
            try:
                tid = int(key)
            except (TypeError, ValueError):
                raise InvalidParam("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None
            _int("logit_bias", tid, lo=0, hi=vocab_size - 1, what="logit_bias token id")
            _float("logit_bias", bias, lo=-100.0, hi=100.0, what=f"logit_bias[{tid}]")
            out[tid] = float(bias)
        return out

    def to_core(self, vocab_size: int, max_new_tokens: int, index: int = 0,
                rng: random.Random | None = None) -> CoreSamplingParams:
        """The core's view; `index` is the child number when n > 1 (child i uses seed + i);
        `rng` draws the seed when none is given (seeded by the engine's random_seed)."""
        if self.sampling_seed is None:
            seed = (rng or random).getrandbits(63)
        else:
            seed = self.sampling_seed + index
        return CoreSamplingParams(
            max_new_tokens=max_new_tokens, min_new_tokens=self.min_new_tokens,
            temperature=float(self.temperature), top_p=float(self.top_p), top_k=self.top_k,
            min_p=float(self.min_p), repetition_penalty=float(self.repetition_penalty),
            frequency_penalty=float(self.frequency_penalty), presence_penalty=float(self.presence_penalty),
            logit_bias=self._bias_items(vocab_size), seed=seed % 2**63,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            grammar=self._grammar(), grammar_after=list(self.structured_after or []),
        )


def _int(name: str, value: Any, lo: int | None = None, hi: int | None = None, what: str = "") -> None:
    what = what or name
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParam(name, f"{what} must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise InvalidParam(name, f"{what} must be in [{lo}, {'inf' if hi is None else hi}], got {value}")


def _float(name: str, value: Any, lo: float, hi: float = math.inf, lo_open: bool = False,
           what: str = "") -> None:
    what = what or name
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParam(name, f"{what} must be a number, got {value!r}")
    bad_lo = value <= lo if lo_open else value < lo
    if math.isnan(value) or bad_lo or value > hi:
        left = "(" if lo_open else "["
        raise InvalidParam(name, f"{what} must be in {left}{lo}, {hi}], got {value}")
