"""Anthropic's Messages API: `/v1/messages` and `/v1/messages/count_tokens`, what the Anthropic SDK
and the coding agents built on it call (vLLM and llama-server serve it too).

A request becomes the pipeline's neutral chat (its system prompt and content blocks as chat
messages, its tools as function tools, its tool_choice as the chat's); the typed answer comes back
as content blocks: `thinking` (with a reasoning parser), `text`, `tool_use`. Streamed, the
pipeline's deltas become Anthropic's events. Images and documents
are refused by field: this server reads text.
"""

from __future__ import annotations

import json
import uuid
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from unison.frontend.text.tool_parsers import ToolCallDelta
from unison.json_types import JSONObject
from unison.server.errors import HTTPError
from unison.server.pipeline.inputs import ChatInput, json_schema_format
from unison.server.pipeline.output import hit_length, stop_string
from unison.server.pipeline.start import Started, check_model, names_of, render_chat, start_chat
from unison.server.streaming import named_event, stream, wait

router = APIRouter()
PATH = "/v1/messages"
# Chat fields as this API spells them, for the errors the chat pipeline raises.
RENAMED = [("stop", "stop_sequences"), ("response_format", "output_config.format"),
           ("reasoning_effort", "output_config.effort"),
           (r"(tools\[\d+\])\.function\.parameters", r"\1.input_schema"),
           (r"(tools\[\d+\])\.function", r"\1"),
           (r"(messages\[\d+\]\.content\[\d+\])\.image_url", r"\1.source")]
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and "tool": a named function


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[JSONObject]


class CountTokensRequest(BaseModel):
    """/v1/messages/count_tokens: the prompt's fields of a Messages request."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[Message]
    system: str | list[JSONObject] | None = None
    tools: list[JSONObject] | None = None
    tool_choice: JSONObject | None = None
    thinking: JSONObject | None = None

    def to_chat(self, **sampling: object) -> ChatInput:
        messages = [{"role": "system", "content": _text(self.system, "system")}] if self.system else []
        messages += _messages(self.messages)
        tools = [_chat_tool(t, i) for i, t in enumerate(self.tools or [])] or None
        choice, parallel = _tool_choice(self.tool_choice)
        kwargs = None if self.thinking is None else {"enable_thinking": _thinking(self.thinking)}
        return ChatInput.model_validate(dict(
            model=self.model, messages=messages, tools=tools, tool_choice=choice,
            parallel_tool_calls=parallel, chat_template_kwargs=kwargs, **sampling))


class MessagesRequest(CountTokensRequest):
    max_tokens: int  # required, as Anthropic's API has it
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    output_config: JSONObject | None = None  # its format: structured output; its effort: how long to think
    # Accepted, with no effect here: the prefix cache is automatic, nothing runs in containers
    # of Anthropic's.
    cache_control: JSONObject | None = None
    container: JSONObject | str | None = None
    diagnostics: JSONObject | None = None
    inference_geo: str | None = None
    metadata: JSONObject | None = None
    service_tier: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    def to_sampled_chat(self) -> ChatInput:
        return self.to_chat(max_tokens=self.max_tokens, stop=self.stop_sequences,
                            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                            response_format=_response_format(self.output_config),
                            reasoning_effort=_effort(self.output_config))


def _effort(config: JSONObject | None) -> str | None:
    """Anthropic's effort as the neutral input's: its "max" is the most a model here is asked."""
    effort = (config or {}).get("effort")
    return "high" if effort == "max" else effort


def _response_format(config: JSONObject | None) -> JSONObject | None:
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    schema = fmt.get("schema") if isinstance(fmt, dict) and fmt.get("type") == "json_schema" else None
    if not isinstance(schema, dict):
        raise HTTPError(400, 'output_config.format must be {"type": "json_schema", "schema": {...}}',
                        param="output_config.format")
    return json_schema_format(schema, "output")


def _messages(given: list[Message]) -> list[JSONObject]:
    """Anthropic's turns as chat messages: a user turn's tool_result blocks become tool turns
    (before its text), an assistant turn's tool_use blocks its tool_calls, its thinking blocks its
    reasoning_content (which the chat template or harmony shows where its format keeps it)."""
    out: list[JSONObject] = []
    for i, m in enumerate(given):
        role, content = m.role, m.content
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        texts, calls, results, thoughts = [], [], [], []
        parts: list[JSONObject] = []
        for j, block in enumerate(content):
            field = f"messages[{i}].content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(_text(block, field))
                parts.append({"type": "text", "text": texts[-1]})
            elif kind == "image" and role == "user":
                parts.append({"type": "image_url", "image_url": {"url": _image_url(block, field)}})
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": _str(block, "id", field), "type": "function", "function": {
                    "name": _str(block, "name", field), "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result" and role == "user":
                result = block.get("content")
                results.append({"role": "tool", "tool_call_id": _str(block, "tool_use_id", field),
                                "content": "" if result is None else _text(result, f"{field}.content")})
            elif kind == "thinking" and isinstance(block.get("thinking"), str):
                thoughts.append(block["thinking"])
            elif kind not in ("thinking", "redacted_thinking"):
                raise HTTPError(400, f"{field}.type {kind!r} is not supported in a {role} turn: text, "
                                     "image (user), tool_use (assistant), tool_result (user) or thinking",
                                param=f"{field}.type")
        out += results
        reasoning = {"reasoning_content": "".join(thoughts)} if thoughts and role == "assistant" else {}
        if calls:
            out.append({"role": role, "content": "".join(texts), "tool_calls": calls, **reasoning})
        elif len(parts) > len(texts):  # images among the text, in their order
            out.append({"role": role, "content": parts})
        elif texts or not results:
            out.append({"role": role, "content": "".join(texts), **reasoning})
    return out


def _image_url(block: JSONObject, field: str) -> str:
    """An image block's source as a data: URL (a URL source is passed on: the frontend fetches it
    where --image-url-hosts allows its host, and refuses it by name otherwise)."""
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str) \
            and isinstance(source.get("media_type"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise HTTPError(400, f"{field}.source must be {{\"type\": \"base64\", \"media_type\": ..., "
                         "\"data\": ...} or {\"type\": \"url\", \"url\": ...}", param=f"{field}.source")


def _text(content: object, field: str) -> str:
    """A string, a text block, or a list of text blocks, as one string."""
    if isinstance(content, str):
        return content
    blocks = content if isinstance(content, list) else [content]
    if all(isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
           for b in blocks):
        return "".join(b["text"] for b in blocks)  # type: ignore[index]
    raise HTTPError(400, f"{field} must be text or text blocks ({{\"type\": \"text\", \"text\": ...}}); "
                         "this server reads text only", param=field)


def _str(block: JSONObject, key: str, field: str) -> str:
    value = block.get(key)
    if not isinstance(value, str) or not value:
        raise HTTPError(400, f"{field}.{key} must be a non-empty string", param=f"{field}.{key}")
    return value


def _chat_tool(tool: JSONObject, i: int) -> JSONObject:
    if tool.get("type") not in (None, "custom") or not isinstance(tool.get("name"), str):
        raise HTTPError(400, f"tools[{i}] must be {{\"name\": ..., \"input_schema\": {{...}}}}: this server "
                             f"runs client tools only, not {tool.get('type')!r}", param=f"tools[{i}]")
    fn = {"name": tool["name"], "parameters": tool.get("input_schema")}
    return {"type": "function", "function": fn | ({"description": tool["description"]}
                                                 if "description" in tool else {})}


def _tool_choice(choice: JSONObject | None) -> tuple[object, bool | None]:
    """Anthropic's tool_choice as the chat's, and parallel_tool_calls."""
    if choice is None:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise HTTPError(400, "tool_choice.name must name a tool", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    if kind not in TOOL_CHOICES:
        raise HTTPError(400, f"tool_choice.type must be auto, any, tool or none, got {kind!r}",
                        param="tool_choice.type")
    return TOOL_CHOICES[kind], parallel


def _thinking(thinking: JSONObject) -> bool:
    """Whether the chat template is asked to think (Qwen3's enable_thinking, and templates alike)."""
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive", "between_tools"):
        raise HTTPError(400, "thinking.type must be enabled, disabled, adaptive or between_tools, got "
                             f"{kind!r}",
                        param="thinking.type")
    return kind != "disabled"


@router.post(PATH)
async def messages(body: MessagesRequest, request: Request):
    with names_of(RENAMED, chat=True):
        started = await start_chat(body.to_sampled_chat(), request)
    out = MessageBuilder(started)
    if body.stream:
        return stream(started.collector, out.events, out.tail, encode=named_event, done=False, path=PATH)
    await wait(request, started.collector)
    return out.whole()


@router.post(PATH + "/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request):
    await check_model(request, body.model)
    with names_of(RENAMED, chat=True):
        chat = body.to_chat()
        if chat.tools:  # rendered alike whatever the choice; "none" needs no tool-call parser
            chat.tool_choice = "none"
        prompt = render_chat(chat, request)
    return {"input_tokens": len(prompt.ids)}


class MessageBuilder:
    """One message's object and, streamed, its events, from the pipeline's typed output."""

    def __init__(self, started: Started) -> None:
        self.output, self.model = started.output, started.model
        self.id = f"msg_{uuid.uuid4().hex}"
        self.started = False
        self.blocks: list[str] = []  # the types of the content blocks streamed so far
        self.open = False  # the last of them is open
        self.calls: dict[int, int] = {}  # tool-call index -> its block's index
        self.called = False

    def message(self, content: list[JSONObject], final: bool) -> JSONObject:
        stop_reason, stop_sequence = self._stop() if final else (None, None)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": self._usage()}

    def whole(self) -> JSONObject:
        choice = self.output.choices()[0]
        content: list[JSONObject] = []
        if choice.reasoning:
            content.append({"type": "thinking", "thinking": choice.reasoning, "signature": ""})
        if choice.content:
            content.append({"type": "text", "text": choice.content})
        for call in choice.tool_calls:
            content.append({"type": "tool_use", "id": call.id, "name": call.name,
                            "input": json.loads(call.arguments or "{}")})
        self.called = bool(choice.tool_calls)
        return self.message(content, final=True)

    def _stop(self) -> tuple[str, str | None]:
        """Anthropic's stop_reason and stop_sequence."""
        finish = self.output.states[0].finish_reason
        if self.called:
            return "tool_use", None
        if hit_length(finish):
            return "max_tokens", None
        if (matched := stop_string(finish)) is not None:
            return "stop_sequence", matched
        return "end_turn", None

    def _usage(self) -> JSONObject:
        """Anthropic counts cached prompt tokens apart from the input tokens."""
        usage = self.output.usage()
        return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
                "output_tokens": usage.completion_tokens,
                "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}

    # ---- streaming: the pipeline's deltas become Anthropic's events ------------------------------

    def events(self, changed: list[int]) -> list[JSONObject]:
        out = []
        if not self.started:
            self.started = True
            out.append({"type": "message_start", "message": self.message([], final=False)})
        for delta in self.output.deltas(changed):
            if delta.reasoning:
                out += self._delta("thinking", {"type": "thinking_delta", "thinking": delta.reasoning})
            if delta.content:
                out += self._delta("text", {"type": "text_delta", "text": delta.content})
            for call in delta.tool_calls:
                out += self._call_delta(call)
        return out

    def tail(self) -> list[JSONObject]:
        out = self.events([]) + self._close()
        stop_reason, stop_sequence = self._stop()
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        return out + [{"type": "message_delta", "delta": delta, "usage": self._usage()},
                      {"type": "message_stop"}]

    def _delta(self, kind: str, delta: JSONObject) -> list[JSONObject]:
        out = []
        if not self.open or self.blocks[-1] != kind:
            block: JSONObject = {"type": "text", "text": ""} if kind == "text" else \
                {"type": "thinking", "thinking": "", "signature": ""}
            out += self._start(block)
        return out + [{"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}]

    def _call_delta(self, call: ToolCallDelta) -> list[JSONObject]:
        out = []
        if call.index not in self.calls:
            self.called = True
            out += self._start({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
            self.calls[call.index] = len(self.blocks) - 1
        if call.arguments:
            out.append({"type": "content_block_delta", "index": self.calls[call.index],
                        "delta": {"type": "input_json_delta", "partial_json": call.arguments}})
        return out

    def _start(self, block: JSONObject) -> list[JSONObject]:
        out = self._close()
        self.blocks.append(block["type"])
        self.open = True
        return out + [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": block}]

    def _close(self) -> list[JSONObject]:
        if not self.open:
            return []
        self.open = False
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]
