"""The API-neutral request: what every API's body is translated into before it runs.

A chat (`ChatInput`) or a completion (`TextInput`) with the sampling options. The options are
spelt as OpenAI spells them (max_tokens, stop, response_format, ...), the one spelling that every
API's translation already targets, and map onto the engine's SamplingParams here; an error in them
is renamed into the calling API's own field names (pipeline/start.py's `names_of`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from unison.errors import InvalidParam
from unison.frontend.sampling_params import SamplingParams
from unison.frontend.text.structured import JSON_OBJECT, with_additional_properties
from unison.json_types import JSONObject
from unison.sampling import MAX_TOP_LOGPROBS, OPTIONS

# generation_config.json keys that are request defaults (vLLM applies the same ones).
MODEL_DEFAULTS = tuple(o.name for o in OPTIONS if o.model_default)
# The sampling options an OpenAI request may set, under their OpenAI / vLLM names.
OPENAI_OPTIONS = {o.openai: o for o in OPTIONS if o.openai is not None}


def generation_defaults(setting: str, model_dir: str) -> JSONObject:
    """vLLM's --generation-config: "auto" reads the model's generation_config.json, "vllm" none,
    anything else is a folder holding one."""
    if setting == "vllm":
        return {}
    path = Path(model_dir if setting == "auto" else setting) / "generation_config.json"
    if not path.is_file():
        if setting != "auto":
            raise FileNotFoundError(f"--generation-config {setting}: no generation_config.json there")
        return {}
    config = json.loads(path.read_text())
    return {k: config[k] for k in (*MODEL_DEFAULTS, "max_new_tokens") if k in config}


def json_schema_format(schema: object, name: str) -> JSONObject:
    """OpenAI's response_format for a JSON schema: what the other APIs' schema fields become."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


class Strict(BaseModel):
    # An unknown field is a 400 naming it, as OpenAI answers: a misspelt option silently ignored
    # would change the output unnoticed.
    model_config = ConfigDict(extra="forbid")


def _doc(openai_name: str) -> str:
    o = OPENAI_OPTIONS[openai_name]
    return f"{o.doc} (default: {o.default})".lstrip()


class _SamplingFields(Strict):
    """One field per OpenAI sampling option (tests/e2e/test_sampling.py holds them to OPTIONS); null
    or absent means the option's default (or the model's, from generation_config.json)."""

    max_tokens: int | None = Field(default=None, description=_doc("max_tokens"))
    min_tokens: int | None = Field(default=None, description=_doc("min_tokens"))
    n: int | None = Field(default=None, description=_doc("n"))
    stop: str | list[str] | None = Field(default=None, description=_doc("stop"))
    stop_token_ids: list[int] | None = Field(default=None, description=_doc("stop_token_ids"))
    ignore_eos: bool | None = Field(default=None, description=_doc("ignore_eos"))
    include_stop_str_in_output: bool | None = Field(default=None,
                                                    description=_doc("include_stop_str_in_output"))
    temperature: float | None = Field(default=None, description=_doc("temperature"))
    top_p: float | None = Field(default=None, description=_doc("top_p"))
    top_k: int | None = Field(default=None, description=_doc("top_k"))
    min_p: float | None = Field(default=None, description=_doc("min_p"))
    typical_p: float | None = Field(default=None, description=_doc("typical_p"))
    frequency_penalty: float | None = Field(default=None, description=_doc("frequency_penalty"))
    presence_penalty: float | None = Field(default=None, description=_doc("presence_penalty"))
    repetition_penalty: float | None = Field(default=None, description=_doc("repetition_penalty"))
    logit_bias: dict[int | str, float] | None = Field(default=None, description=_doc("logit_bias"))
    seed: int | None = Field(default=None, description=_doc("seed"))
    skip_special_tokens: bool | None = Field(default=None, description=_doc("skip_special_tokens"))
    spaces_between_special_tokens: bool | None = Field(default=None,
                                                       description=_doc("spaces_between_special_tokens"))
    regex: str | None = Field(default=None, description=_doc("regex"))
    ebnf: str | None = Field(default=None, description=_doc("ebnf"))


class GenerationInput(_SamplingFields):
    """What a chat and a completion share: the model, the sampling options, the priority."""

    model: str | None = None
    priority: int = 0  # higher is admitted first (SGLang's convention)
    add_special_tokens: bool | None = None  # vLLM's defaults: true for completions, false for chat
    # Structured output: OpenAI's response_format (or SGLang's regex / ebnf, sampling options).
    response_format: JSONObject | None = None

    def sampling_params(self, default_max_tokens: int | None, defaults: JSONObject | None = None
                        ) -> SamplingParams:
        """`default_max_tokens` None: what the context leaves. `defaults`: the model's
        generation_config.json sampling values, for the fields this
        request left unset; its max_new_tokens caps every request (vLLM's --generation-config)."""
        defaults = defaults or {}
        given = {o.name: value for name, o in OPENAI_OPTIONS.items()
                 if (value := getattr(self, name)) is not None}
        values = {k: v for k, v in defaults.items() if k in MODEL_DEFAULTS} | given
        max_tokens = given.get("max_new_tokens", default_max_tokens)
        if isinstance(defaults.get("max_new_tokens"), int) and isinstance(max_tokens, int):
            max_tokens = min(max_tokens, defaults["max_new_tokens"])
        return SamplingParams(**values | {"max_new_tokens": max_tokens, "json_schema": self._json_schema()})

    def _json_schema(self) -> JSONObject | str | None:
        """OpenAI's response_format as a JSON schema (None: plain text)."""
        rf = self.response_format
        if rf is None or rf.get("type") == "text":
            return None
        if rf.get("type") == "json_object":
            return JSON_OBJECT
        if rf.get("type") == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise InvalidParam("response_format",
                                   "response_format: json_schema needs {\"name\": ..., \"schema\": {...}}")
            if spec.get("strict") is False:  # OpenAI's field: JSON Schema's own defaults, not strict
                return with_additional_properties(spec["schema"], True)
            return spec["schema"]
        raise InvalidParam("response_format", "response_format: type must be text, json_object or "
                                              f"json_schema, got {rf.get('type')!r}")


class TextInput(GenerationInput):
    """A completion: a prompt in any of OpenAI's four forms, or a fill-in-the-middle."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id: for the chat template
    role: str
    content: str | list[JSONObject] | None = None


class ChatInput(GenerationInput):
    """A chat: messages, tools, and the chat template's own variables."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[JSONObject] | None = None
    tool_choice: Any = None  # JSON: a mode's name or a function object (server/pipeline/tools.py)
    parallel_tool_calls: bool | None = None
    # vLLM's and SGLang's chat fields: the template's own variables (Qwen3's enable_thinking, ...),
    # and how the conversation ends.
    chat_template_kwargs: JSONObject | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # How long a reasoning model thinks: harmony's system message says it (gpt-oss); other
    # templates read it as a variable of that name, as vLLM passes it.
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    def sampling_params(self, default_max_tokens: int | None, defaults: JSONObject | None = None
                        ) -> SamplingParams:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens, defaults)
