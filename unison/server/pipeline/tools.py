"""Tool calling, as OpenAI's chat completions define it and vLLM serves it, for every API.

- `tool_choice="none"`: the tools are shown to the template, the answer is plain content.
- `"auto"` (the default with tools): the model's text is read by the server's tool-call parser
  (`--tool-call-parser`, unison/frontend/text/tool_parsers.py); calls found become `tool_calls`.
- `"required"` and a named function: the output is constrained by the structured-output engine,
  so it is valid on any model: a JSON list of `{"name", "parameters"}` objects for "required"
  (vLLM's schema), the function's arguments object for a named one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from unison.frontend.text.structured import grammar_text, with_additional_properties
from unison.frontend.text.tool_parsers import (
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStreamer,
    call_deltas,
    get_parser,
    new_call_id,
)
from unison.json_types import JSONObject
from unison.server.errors import HTTPError

ANY_OBJECT = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    mode: str  # none | auto | required | named
    tools: list[JSONObject]  # as the request gave them: what the chat template is shown
    parallel: bool  # parallel_tool_calls: false allows at most one call
    name: str | None = None  # the named function
    parser: ToolParser | None = None  # auto
    json_schema: JSONObject | None = None  # required, named: what the output is held to
    schemas: dict[str, JSONObject] | None = None  # required, named: each callable function's parameters

    def output(self) -> ToolOutput:
        return ToolOutput(self)


def plan_tools(tools: list[JSONObject] | None, tool_choice: object, parallel: bool | None,
               parser_name: str | None, native: bool = False) -> ToolPlan | None:
    """Check tools and tool_choice; None when the request has no tools. `native`: the model's
    own format marks its calls (harmony), so "auto" needs no parser."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise HTTPError(400, "tool_choice needs tools", param="tool_choice")
        return None
    functions = [_function(t, i) for i, t in enumerate(tools)]
    schemas = {fn["name"]: _parameters(fn, i) for i, fn in enumerate(functions)}  # by name
    parallel = parallel is not False
    if tool_choice in (None, "auto"):
        if native:
            return ToolPlan("auto", tools, parallel)
        if parser_name is None:
            raise HTTPError(400, 'tool_choice "auto" needs the server started with --tool-call-parser '
                                 "(hermes, llama3_json or qwen3_coder; or send tool_choice \"required\" "
                                 "or a named function)", param="tool_choice")
        return ToolPlan("auto", tools, parallel, parser=get_parser(parser_name, tools))
    if tool_choice == "none":
        return ToolPlan("none", tools, parallel)
    if tool_choice == "required":
        return ToolPlan("required", tools, parallel, json_schema=_required_schema(schemas, parallel),
                        schemas=schemas)
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise HTTPError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                             f'"function": {{"name": ...}}}}, got {tool_choice!r:.80}', param="tool_choice")
    if name not in schemas:
        raise HTTPError(400, f"tool_choice names {name!r}, which is not among the tools "
                             f"{sorted(schemas)}", param="tool_choice")
    return ToolPlan("named", tools, parallel, name=name, json_schema=schemas[name],
                    schemas={name: schemas[name]})


def _function(tool: object, i: int) -> JSONObject:
    fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise HTTPError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": "
                             "..., \"parameters\": {...}}}}", param=f"tools[{i}]")
    if not isinstance(fn.get("parameters", {}), dict):
        raise HTTPError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                        param=f"tools[{i}].function.parameters")
    return fn


def _parameters(fn: JSONObject, i: int) -> JSONObject:
    """The function's parameters schema as the output is held to it: strict unless the function
    says `strict: false` (OpenAI's field), and checked here, so that a bad one is named as the
    field the client sent."""
    schema = fn.get("parameters") or ANY_OBJECT
    if fn.get("strict") is False:
        schema = with_additional_properties(schema, True)
    try:
        grammar_text(json_schema=schema)
    except ValueError as e:
        field = f"tools[{i}].function.parameters"
        raise HTTPError(400, f"{field}: {e}", param=field) from None
    return schema


def _required_schema(schemas: dict[str, JSONObject], parallel: bool) -> JSONObject:
    """vLLM's: a non-empty list of calls, each one of the tools with its own parameters."""
    calls = [{"type": "object", "required": ["name", "parameters"],
              "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params}}
             for name, params in schemas.items()]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return schema | ({"maxItems": 1} if not parallel else {})


def messages_for_template(messages: list[JSONObject]) -> list[JSONObject]:
    """Assistant tool calls carry their arguments as JSON strings; HF templates expect dicts. A
    turn that only calls tools gets empty content: templates without tool support read it."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_with_dict_arguments(c, i, j) for j, c in enumerate(calls)],
                 "content": m.get("content") or ""}
        out.append(m)
    return out


def _with_dict_arguments(call: object, i: int, j: int) -> object:
    fn = call.get("function") if isinstance(call, dict) else None
    args = fn.get("arguments") if isinstance(fn, dict) else None
    if isinstance(call, dict) and isinstance(fn, dict) and isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            raise HTTPError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: {e}",
                            param=f"messages[{i}].tool_calls[{j}]") from None
        return {**call, "function": {**fn, "arguments": args}}
    return call


def _complete_items(text: str) -> list[Any]:  # Any: JSON values, read as calls by the caller
    """The items of a JSON array, or of as much of it as is whole: max_tokens may cut the last
    call, and the ones before it are still valid calls."""
    decoder, at = json.JSONDecoder(), text.find("[") + 1
    if at == 0:
        return []
    items: list[Any] = []  # (JSON values)
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] == "]":
            return items
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            return items
        items.append(item)


class ToolOutput:
    """One choice's text as content and tool calls: whole (`final`) or as stream deltas."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.streamer: ToolStreamer | None = plan.parser.streamer() if plan.parser else None
        self.named_id = new_call_id()
        self.buffer = ""  # required: the JSON list, decided at the end
        self.found_calls = False

    def _calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        plan = self.plan
        if plan.mode == "named":
            assert plan.name is not None  # (a named plan names its function)
            return None, [ToolCall(self.named_id, plan.name, text)]
        if plan.mode == "required":
            try:
                calls = [ToolCall(new_call_id(), c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                         for c in _complete_items(text)]
            except (TypeError, KeyError):
                calls = []
            return (None, calls) if calls else (text, [])  # nothing whole (max_tokens): content
        if plan.mode == "auto":
            assert plan.parser is not None  # (an auto plan has its parser)
            parsed = plan.parser.parse(text)
            return parsed.content, parsed.tool_calls
        return text, []

    def _ends_turn(self, has_calls: bool) -> bool:
        """Whether calls end the turn ("tool_calls"): a named function's call ends as "stop", as
        OpenAI's does."""
        return has_calls and self.plan.mode in ("auto", "required")

    def final(self, text: str) -> tuple[str | None, list[ToolCall], bool]:
        """The content (None: calls only), the calls, and whether they end the turn."""
        content, calls = self._calls(text)
        if not self.plan.parallel:
            calls = calls[:1]
        return content, calls, self._ends_turn(bool(calls))

    def delta(self, new_text: str, finished: bool) -> tuple[str, list[ToolCallDelta], bool]:
        """(content, tool-call deltas, whether calls end the turn) for this chunk. A call's first
        delta carries its id and name, the later ones pieces of its arguments."""
        mode = self.plan.mode
        if mode == "named":  # the arguments stream as they come, after the call's header
            deltas = [] if self.found_calls else [ToolCallDelta(0, self.named_id, self.plan.name, "")]
            self.found_calls = True
            if new_text:
                deltas.append(ToolCallDelta(0, arguments=new_text))
            return "", deltas, False
        if mode == "required":
            self.buffer += new_text
            if not finished:
                return "", [], False
            content, calls = self._calls(self.buffer)
            calls = calls if self.plan.parallel else calls[:1]
            deltas = [d for i, c in enumerate(calls) for d in call_deltas(i, c)]
            return content or "", deltas, self._ends_turn(bool(calls))
        if mode == "auto":
            assert self.streamer is not None  # (an auto plan has its parser)
            out = self.streamer.feed(new_text)
            if finished:
                end = self.streamer.finish()
                out = StreamDelta(out.content + end.content, out.tool_calls + end.tool_calls)
            deltas = [d for d in out.tool_calls if self.plan.parallel or d.index == 0]
            self.found_calls = self.found_calls or bool(deltas)
            return out.content, deltas, self._ends_turn(self.found_calls)
        return new_text, [], False
