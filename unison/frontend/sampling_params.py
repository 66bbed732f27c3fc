"""SamplingParams: what a user may ask of one request, named and bounded as in SGLang.

Its fields are the options of unison/sampling.py (declared there with their bounds; tests/e2e/test_sampling.py
holds these fields to that table); this file holds the checks that are more than a range, and the
mapping onto the core's wire struct.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, fields

from unison.errors import InvalidParam
from unison.frontend.text.structured import grammar_text
from unison.json_types import JSONObject
from unison.sampling import MAX_LOGIT_BIAS, MAX_STOP_STRINGS, OPTIONS, CoreSamplingParams

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")


@dataclass
class SamplingParams:
    """What one request asks for; every field is an option of unison/sampling.py, in its order."""

    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    typical_p: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int | str, float] | None = None
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    json_schema: str | JSONObject | None = None  # a JSON Schema: arbitrary JSON
    regex: str | None = None
    ebnf: str | None = None
    structured_after: list[int] | None = None

    @classmethod
    def from_any(cls, params: object) -> SamplingParams:
        """A SamplingParams, a dict of its fields, or None (the defaults)."""
        if params is None:
            return SamplingParams()
        if isinstance(params, SamplingParams):
            return params
        if not isinstance(params, dict):
            raise InvalidParam("sampling_params", "sampling_params must be a dict or SamplingParams, "
                               f"got {type(params).__name__}")
        known = {f.name for f in fields(SamplingParams)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise InvalidParam(unknown[0], f"unknown sampling parameter(s) {unknown}; "
                               f"allowed: {sorted(known)}")
        return SamplingParams(**params)

    @property
    def grammar_kind(self) -> str | None:
        """Which constraint is given (json_schema, regex or ebnf), if any."""
        return next((k for k in GRAMMAR_KINDS if getattr(self, k) is not None), None)

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
        self._check_declared()
        max_new = self.max_tokens(prompt_len, context_length if room is None else room)
        if self.min_new_tokens > max(max_new, 0):
            raise InvalidParam("min_new_tokens", f"min_new_tokens must be in [0, {max(max_new, 0)}], "
                                                 f"got {self.min_new_tokens}")
        self._validate_stop()
        self._grammar()
        for tid in self.stop_token_ids or []:
            _token_id("stop_token_ids", tid, vocab_size)
        self._validate_structured_after(vocab_size)
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

    def _check_declared(self) -> None:
        """Every option's declared rule: numbers in range, flags bools."""
        for o in OPTIONS:
            value = getattr(self, o.name)
            if o.numeric and value is not None and (problem := o.problem(value)) is not None:
                raise InvalidParam(o.name, f"{o.name} {problem}")
            if o.type is bool and not isinstance(value, bool):
                raise InvalidParam(o.name, f"{o.name} must be a bool, got {value!r}")

    def _validate_stop(self) -> None:
        if self.stop is not None and not isinstance(self.stop, (str, list)):
            raise InvalidParam("stop", "stop must be a string or a list of strings, "
                                       f"got {type(self.stop).__name__}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, list):
            raise InvalidParam("stop_token_ids", "stop_token_ids must be a list of token ids")
        if self.stop_regex is not None and not isinstance(self.stop_regex, (str, list)):
            raise InvalidParam("stop_regex", "stop_regex must be a string or a list of strings")
        for name, values, what in (("stop", self.stop_strings, "strings"),
                                   ("stop_regex", self.stop_regexes, "patterns")):
            if len(values) > MAX_STOP_STRINGS:
                raise InvalidParam(name, f"{name} has {len(values)} {what}; at most {MAX_STOP_STRINGS} "
                                         "are allowed")
            for s in values:
                if not isinstance(s, str) or not s:
                    raise InvalidParam(name, f"{name} entries must be non-empty strings, got {s!r}")
        for pattern in self.stop_regexes:
            try:
                re.compile(pattern)
            except re.error as e:
                raise InvalidParam("stop_regex", f"stop_regex {pattern!r} is not a valid regular "
                                                 f"expression: {e}") from None

    def _validate_structured_after(self, vocab_size: int) -> None:
        if self.structured_after is None:
            return
        if not isinstance(self.structured_after, list) or not self.structured_after:
            raise InvalidParam("structured_after", "structured_after must be a non-empty list of token ids")
        if self.grammar_kind is None:
            raise InvalidParam("structured_after", "structured_after needs json_schema, regex or ebnf")
        for tid in self.structured_after:
            _token_id("structured_after", tid, vocab_size)

    def _grammar(self) -> str | None:
        """The constraint as llguidance grammar text (converted once per distinct spec)."""
        try:
            return grammar_text(self.json_schema, self.regex, self.ebnf)
        except ValueError as e:
            assert self.grammar_kind is not None  # only a given constraint is converted
            raise InvalidParam(self.grammar_kind, str(e)) from None

    def _bias_items(self, vocab_size: int) -> dict[int, float]:
        if self.logit_bias is None:
            return {}
        if not isinstance(self.logit_bias, dict):
            raise InvalidParam("logit_bias", "logit_bias must be a dict of token id -> bias")
        out: dict[int, float] = {}
        for key, bias in self.logit_bias.items():
            try:
                tid = int(key)
            except (TypeError, ValueError):
                raise InvalidParam("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None
            _token_id("logit_bias", tid, vocab_size)
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not \
                    -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidParam("logit_bias", f"logit_bias[{tid}] must be a number in "
                                                 f"[{-MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {bias!r}")
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
        # The `core` options as given, an int given for a float travelling as one.
        return CoreSamplingParams(
            max_new_tokens=max_new_tokens, logit_bias=self._bias_items(vocab_size), seed=seed % 2**63,
            stop_token_ids=list(self.stop_token_ids or []), grammar=self._grammar(),
            grammar_after=list(self.structured_after or []),
            min_new_tokens=self.min_new_tokens, ignore_eos=self.ignore_eos,
            temperature=float(self.temperature), top_p=float(self.top_p), top_k=self.top_k,
            min_p=float(self.min_p), typical_p=float(self.typical_p),
            frequency_penalty=float(self.frequency_penalty), presence_penalty=float(self.presence_penalty),
            repetition_penalty=float(self.repetition_penalty),
        )


def _token_id(name: str, tid: object, vocab_size: int) -> None:
    if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < vocab_size:
        raise InvalidParam(name, f"{name}: token ids must be integers in [0, {vocab_size - 1}], "
                                 f"got {tid!r}")

