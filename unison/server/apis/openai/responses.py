"""OpenAI's Responses API, `/v1/responses`, stateless: what the OpenAI Agents SDK and Codex-style
clients call. A request becomes the pipeline's neutral chat (its input items as chat messages, its
text format as response_format, its function tools as chat tools); the typed answer comes back as
output items: `reasoning` (with a reasoning parser),
`message`, `function_call`.

Nothing is stored: `store` is accepted and ignored, and `previous_response_id` is refused (send
the conversation's items again instead, as stateless clients do).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ConfigDict

from unison.frontend.text.tool_parsers import ToolCallDelta
from unison.json_types import JSONObject
from unison.server.apis.openai.bodies import IgnoredFields
from unison.server.errors import HTTPError
from unison.server.pipeline.inputs import ChatInput
from unison.server.pipeline.output import hit_length
from unison.server.pipeline.start import Started, names_of, start_chat
from unison.server.streaming import named_event, stream, wait

router = APIRouter()
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(IgnoredFields):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[JSONObject]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: JSONObject | None = None
    tools: list[JSONObject] | None = None
    tool_choice: Any = None  # JSON: a mode's name or a function object, checked by the chat route
    parallel_tool_calls: bool | None = None
    stream: bool = False
    previous_response_id: str | None = None
    reasoning: JSONObject | None = None  # its effort: how long a reasoning model thinks
    include: list[str] | None = None
    truncation: str | None = None

    def to_chat(self) -> ChatInput:
        if self.previous_response_id is not None:
            raise HTTPError(400, "previous_response_id: this server stores no responses; send the "
                                 "conversation's items in input", param="previous_response_id")
        if self.truncation not in (None, "disabled"):
            raise HTTPError(400, f"truncation must be 'disabled', got {self.truncation!r}",
                            param="truncation")
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += _messages(self.input)
        tools = [_chat_tool(t, i) for i, t in enumerate(self.tools or [])] or None
        return ChatInput.model_validate(dict(
            model=self.model, messages=messages, max_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, tools=tools,
            tool_choice=_chat_tool_choice(self.tool_choice), parallel_tool_calls=self.parallel_tool_calls,
            response_format=_response_format(self.text),
            reasoning_effort=(self.reasoning or {}).get("effort")))


def _messages(given: str | list[JSONObject]) -> list[JSONObject]:
    """Input items as chat messages: messages, function calls (one assistant turn for a run of
    them) and their outputs (tool turns); a reasoning item is the next assistant turn's
    reasoning_content (shown where the chat template or harmony keeps it)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    out: list[JSONObject] = []
    thought = ""  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        if kind == "reasoning":
            thought += _reasoning(item)
        elif kind == "message":
            if item.get("role") not in ("user", "assistant", "system", "developer"):
                raise HTTPError(400, f"input[{i}].role must be user, assistant, system or developer, got "
                                     f"{item.get('role')!r}", param=f"input[{i}].role")
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": _content(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            last = out[-1] if out else {}
            if last.get("role") == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": _text(item.get("output"), f"input[{i}].output")})
        else:
            raise HTTPError(400, f"input[{i}].type {kind!r} is not supported: message, function_call, "
                                 "function_call_output or reasoning", param=f"input[{i}].type")
        if thought and kind != "reasoning" and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"], thought = thought, ""
    return out


def _reasoning(item: JSONObject) -> str:
    """A reasoning item's text (its reasoning_text parts, as this server writes them)."""
    parts = item.get("content")
    if not isinstance(parts, list):
        return ""
    return "".join(str(p.get("text", "")) for p in parts
                   if isinstance(p, dict) and p.get("type") == "reasoning_text")


def _content(content: object, field: str) -> str | list[JSONObject]:
    """A message's content: its text, or its text and input_image parts in order (chat parts)."""
    def image(part: object) -> bool:
        return isinstance(part, dict) and part.get("type") == "input_image"

    if isinstance(content, list) and any(image(p) for p in content):
        return [p if image(p) else {"type": "text", "text": _text([p], f"{field}[{j}]")}
                for j, p in enumerate(content)]
    return _text(content, field)


def _text(content: object, field: str) -> str:
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else None
    if parts is not None and all(isinstance(p, dict) and p.get("type") in TEXT_PARTS for p in parts):
        return "".join(str(p.get("text", "")) for p in parts)
    raise HTTPError(400, f"{field} must be text or a list of input_text and input_image parts", param=field)


def _chat_tool(tool: JSONObject, i: int) -> JSONObject:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise HTTPError(400, f"tools[{i}] must be {{\"type\": \"function\", \"name\": ..., \"parameters\": "
                             "{...}}: this server runs function tools only", param=f"tools[{i}]")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: object) -> object:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: JSONObject | None) -> JSONObject | None:
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return fmt  # json_object, or a type the chat route names as invalid


# Chat fields as this API spells them, for the errors the chat pipeline raises.
RENAMED = [("messages", "input"), ("max_tokens", "max_output_tokens"), ("response_format", "text.format"),
           ("reasoning_effort", "reasoning.effort"),
           (r"(tools\[\d+\])\.function", r"\1")]


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request):
    with names_of(RENAMED, chat=True):
        started = await start_chat(body.to_chat(), request)
    out = ResponseBuilder(body, started)
    if body.stream:
        return stream(started.collector, out.events, out.tail, encode=named_event, done=False)
    await wait(request, started.collector)
    out.items = out.final_items()
    return out.response("completed")


class ResponseBuilder:
    """One response's object and, when streamed, its events, from the pipeline's typed output."""

    def __init__(self, body: ResponsesRequest, started: Started) -> None:
        self.body, self.output, self.model = body, started.output, started.model
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.seq = 0
        self.items: list[JSONObject] = []  # output items so far (streaming: as they were added)
        self.open: JSONObject | None = None  # the item being streamed
        self.calls: dict[int, JSONObject] = {}  # tool-call index -> its function_call item

    # ---- the response object ------------------------------------------------------------------

    def response(self, status: str) -> JSONObject:
        state = self.output.states[0]
        incomplete = hit_length(state.finish_reason) and status != "in_progress"
        usage = self.output.usage() if state.finished else None
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": "incomplete" if incomplete else status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None, "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "temperature": b.temperature, "top_p": b.top_p,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "tool_choice": b.tool_choice or ("auto" if b.tools else "none"), "tools": b.tools or [],
            "text": b.text or {"format": {"type": "text"}}, "metadata": b.metadata or {}, "store": False,
            "previous_response_id": None, "reasoning": b.reasoning, "truncation": "disabled",
            "output": list(self.items) if status != "in_progress" else [],
            "usage": None if usage is None else {
                "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens_details": {"reasoning_tokens": 0}},
        }

    def final_items(self) -> list[JSONObject]:
        """The output items of a whole (not streamed) response."""
        choice = self.output.choices()[0]
        items = []
        if choice.reasoning:
            items.append(_reasoning_item(_new_id("rs"), choice.reasoning))
        if choice.content:
            items.append(_message_item(_new_id("msg"), choice.content))
        for call in choice.tool_calls:
            items.append(_call_item(_new_id("fc"), call.id, call.name, call.arguments))
        return items

    # ---- streaming: the pipeline's deltas become Responses events --------------------------------

    def events(self, changed: list[int]) -> list[JSONObject]:
        out = [] if self.seq else [self._event("response.created", response=self.response("in_progress")),
                                   self._event("response.in_progress", response=self.response("in_progress"))]
        for delta in self.output.deltas(changed):
            if delta.reasoning:
                out += self._text_delta("reasoning", delta.reasoning)
            if delta.content:
                out += self._text_delta("message", delta.content)
            for call in delta.tool_calls:
                out += self._call_delta(call)
        return out

    def tail(self) -> list[JSONObject]:
        out = self.events([]) if not self.seq else []  # a response that produced nothing at all
        out += self._close()
        return out + [self._event("response.completed", response=self.response("completed"))]

    def _text_delta(self, kind: str, text: str) -> list[JSONObject]:
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            new = _reasoning_item if kind == "reasoning" else _message_item
            item = self.open = new(_new_id("rs" if kind == "reasoning" else "msg"), "")
            item["status"] = "in_progress"
            at = len(self.items)
            out.append(self._event("response.output_item.added", output_index=at, item=_empty(item)))
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=at,
                                   content_index=0, part=dict(item["content"][0])))
        item = self.open
        item["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: JSONObject = {} if kind == "reasoning" else {"logprobs": []}
        return out + [self._event(name, item_id=item["id"], output_index=len(self.items), content_index=0,
                                  delta=text, **extra)]

    def _call_delta(self, call: ToolCallDelta) -> list[JSONObject]:
        out = []
        index = call.index
        if index not in self.calls:
            out += self._close()
            item = _call_item(_new_id("fc"), call.id, call.name, "")
            item["status"] = "in_progress"
            self.calls[index] = self.open = item
            out.append(self._event("response.output_item.added", output_index=len(self.items),
                                   item=dict(item)))
        item = self.calls[index]
        piece = call.arguments
        if piece:
            item["arguments"] += piece
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=len(self.items), delta=piece))
        return out

    def _close(self) -> list[JSONObject]:
        """The open item's done events; it joins the output."""
        item, self.open = self.open, None
        if item is None:
            return []
        at, out = len(self.items), []
        item["status"] = "completed"
        if item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=at, arguments=item["arguments"]))
        else:
            part, reasoning = item["content"][0], item["type"] == "reasoning"
            name = "response.reasoning_text.done" if reasoning else "response.output_text.done"
            extra: JSONObject = {} if reasoning else {"logprobs": []}
            out.append(self._event(name, item_id=item["id"], output_index=at, content_index=0,
                                   text=part["text"], **extra))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=at,
                                   content_index=0, part=dict(part)))
        out.append(self._event("response.output_item.done", output_index=at, item=dict(item)))
        self.items.append(item)
        return out

    def _event(self, kind: str, **fields: object) -> JSONObject:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(item_id: str, text: str) -> JSONObject:
    return {"type": "message", "id": item_id, "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(item_id: str, text: str) -> JSONObject:
    return {"type": "reasoning", "id": item_id, "status": "completed", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call_id: str | None, name: str | None, arguments: str) -> JSONObject:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": "completed"}


def _empty(item: JSONObject) -> JSONObject:
    """An item as output_item.added shows it: no content yet (content_part.added brings it)."""
    return {**item, "content": []}
