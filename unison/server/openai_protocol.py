"""OpenAI request bodies (pydantic, as FastAPI wants) and their mapping onto SamplingParams."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from unison.errors import InvalidParam
from unison.frontend.sampling_params import SamplingParams
from unison.frontend.structured import JSON_OBJECT, with_additional_properties

# generation_config.json keys that are request defaults (vLLM applies the same ones).
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(setting: str, model_dir: str) -> dict[str, Any]:
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
    return {k: config[k] for k in (*SAMPLING_DEFAULTS, "max_new_tokens") if k in config}


class _Base(BaseModel):
    # An unknown field is a 400 naming it, as OpenAI answers: a misspelt option silently ignored
    # would change the output unnoticed.
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    # Standard fields that do not change the output: accepted and ignored.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Extra sampling fields, as vLLM and SGLang accept them.
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    priority: int = 0  # higher is admitted first (SGLang's convention)
    include_stop_str_in_output: bool = False  # vLLM's: keep the matched stop string in the text
    return_tokens_as_token_ids: bool = False  # vLLM's: logprob tokens as "token_id:<id>"
    add_special_tokens: bool | None = None  # vLLM's defaults: true for completions, false for chat
    # Structured output: OpenAI's response_format, or SGLang's regex / ebnf.
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None

    def sampling_params(self, default_max_tokens: int, defaults: dict[str, Any] | None = None
                        ) -> SamplingParams:
        """`defaults`: the model's generation_config.json sampling values, for the fields this
        request left unset; its max_new_tokens caps every request (vLLM's --generation-config)."""
        defaults = defaults or {}
        unset = {k: v for k, v in defaults.items()
                 if k in SAMPLING_DEFAULTS and k not in self.model_fields_set}
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        if isinstance(defaults.get("max_new_tokens"), int):
            max_tokens = min(max_tokens, defaults["max_new_tokens"])
        params = SamplingParams(
            json_schema=self._json_schema(), regex=self.regex, ebnf=self.ebnf,
            max_new_tokens=max_tokens, min_new_tokens=self.min_tokens, n=self.n, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k, min_p=self.min_p,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias,
            sampling_seed=self.seed, skip_special_tokens=self.skip_special_tokens,
            no_stop_trim=self.include_stop_str_in_output,
        )
        for name, value in unset.items():
            setattr(params, name, value)
        return params

    def _json_schema(self) -> dict[str, Any] | str | None:
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

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Base):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id: for the chat template
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Base):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # vLLM's and SGLang's chat fields: the template's own variables (Qwen3's enable_thinking, ...),
    # and how the conversation ends.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def sampling_params(self, default_max_tokens: int, defaults: dict[str, Any] | None = None
                        ) -> SamplingParams:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens, defaults)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template first."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
