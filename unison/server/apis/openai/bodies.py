"""OpenAI's request bodies (pydantic, as FastAPI wants): the neutral inputs and OpenAI's own
fields, and vLLM's /tokenize, /detokenize and the pooling routes' bodies."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from unison.json_types import JSONObject
from unison.server.pipeline.inputs import ChatInput, ChatMessage, Strict, TextInput


class IgnoredFields(BaseModel):
    """OpenAI's standard fields that do not change the output: accepted and ignored (nothing is
    stored)."""

    user: str | None = None
    metadata: JSONObject | None = None
    store: bool | None = None
    service_tier: str | None = None


class _OpenAIFields(IgnoredFields):
    stream: bool = False
    stream_options: JSONObject | None = None
    return_tokens_as_token_ids: bool = False  # vLLM's: logprob tokens as "token_id:<id>"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(TextInput, _OpenAIFields):
    pass


class ChatCompletionRequest(ChatInput, _OpenAIFields):
    pass


class TokenizeRequest(BaseModel):
    """/tokenize: vLLM's body (a prompt, or chat messages rendered by the chat template first), or
    llama-server's (`content`), which the same path serves and answers in its own shape."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt, false for messages
    add_generation_prompt: bool = True
    tools: list[JSONObject] | None = None  # what the chat template is shown beside messages
    chat_template_kwargs: JSONObject | None = None
    return_token_strs: bool = False
    # llama-server's: the text, whether to add BOS, special tokens read as such, each id's piece
    content: str | None = None
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


# ---- pooling bodies (apis/openai/pooling.py) ----------------------------------------------


class EmbeddingRequest(Strict):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: str = "float"  # float | base64 (float32 little-endian, as OpenAI's)
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep at most this many tokens


class RerankRequest(Strict):
    query: str
    documents: list[str]
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = True  # Jina's and vLLM's default


class ScoreRequest(Strict):
    text_1: str
    text_2: str | list[str]
    model: str | None = None
