"""gpt-oss's harmony format, through openai-harmony (its Rust renderer and parser), not by hand.

A harmony model answers in messages on channels: `analysis` (its reasoning), `commentary` (tool
calls, addressed `to=functions.NAME`, and preambles) and `final` (the answer). A prompt is
rendered as the reference renderer does: a system message (reasoning effort, today's date), a
developer message (the client's system prompt as instructions, its tools as the `functions`
namespace), then the turns, earlier tool calls and their results included. The output is parsed
token by token into the API-neutral pieces every API renders: reasoning, content and tool calls.

openai-harmony loads o200k_base's ranks from `TIKTOKEN_ENCODINGS_BASE`, else downloads them. A
harmony model's own tokenizer holds the same ranks (its first 199,998 tokens), so the file is
written from it once, checked against the SHA-256 that openai-harmony pins, and nothing is
fetched: a model that loads offline also renders offline.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from unison.errors import InvalidParam
from unison.frontend.text.tool_parsers import ToolCall, ToolCallDelta, call_deltas, new_call_id
from unison.json_types import JSONObject

if TYPE_CHECKING:
    from openai_harmony import HarmonyEncoding, Message

# Harmony's markers at their o200k_harmony ids: a vocabulary with all of them speaks harmony.
MARKERS = {"<|return|>": 200002, "<|channel|>": 200005, "<|start|>": 200006, "<|end|>": 200007,
           "<|message|>": 200008, "<|call|>": 200012}
O200K_TOKENS = 199_998
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
EFFORTS = ("low", "medium", "high")
FINAL = "<|channel|>final<|message|>"  # where a reply's answer starts (a JSON schema holds it from there)
BUILT_IN_TOOLS = ("browser", "python")  # harmony's own namespaces: not run here
_ENDS = frozenset(MARKERS[t] for t in ("<|end|>", "<|call|>", "<|return|>"))  # a message's last token


def speaks_harmony(token_id: dict[str, int | None]) -> bool:
    """Whether a vocabulary (token -> id, None where absent) has harmony's markers at their ids."""
    return all(token_id.get(token) == i for token, i in MARKERS.items())


def load_encoding(vocab: dict[str, int]) -> HarmonyEncoding:
    """openai-harmony's gpt-oss encoding, its o200k_base ranks written from `vocab` (the model's
    byte-level tokenizer) where TIKTOKEN_ENCODINGS_BASE names no folder of them."""
    try:
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    except ImportError:
        raise ImportError("this model speaks the harmony format (gpt-oss), which needs openai-harmony: "
                          "pip install openai-harmony") from None
    if not os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(_o200k_folder(vocab))
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def _o200k_folder(vocab: dict[str, int]) -> Path:
    folder = Path.home() / ".cache" / "unison" / "tiktoken"
    path = folder / "o200k_base.tiktoken"
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == O200K_SHA256:
        return folder
    chars = {c: b for b, c in byte_chars().items()}
    ranks = sorted((i, t) for t, i in vocab.items() if i < O200K_TOKENS)
    lines = b"".join(base64.b64encode(bytes(chars[c] for c in t)) + b" %d\n" % i for i, t in ranks)
    if hashlib.sha256(lines).hexdigest() != O200K_SHA256:
        raise ValueError("this model's tokenizer has harmony's markers but not o200k_base's tokens; set "
                         "TIKTOKEN_ENCODINGS_BASE to a folder holding o200k_base.tiktoken")
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, delete=False) as f:
        f.write(lines)
    os.replace(f.name, path)
    return folder


def byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character tokenizer.json writes for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


# ---- prompts -------------------------------------------------------------------------------------


def render_prompt(encoding: HarmonyEncoding, messages: list[JSONObject], tools: list[JSONObject] | None,
                  effort: str | None, add_generation_prompt: bool = True) -> list[int]:
    """The prompt's token ids for `messages` (as tokenizer.normalize_messages makes them: checked,
    text parts joined, a developer message as a system one) and function `tools`, as openai-harmony
    renders them. An earlier turn's analysis is dropped unless that turn ended in a tool call
    (openai-harmony's own rule keeps it whenever the conversation has not ended on an answer)."""
    from openai_harmony import Conversation, Role

    conversation = Conversation.from_messages(_messages(messages, tools, effort))
    if add_generation_prompt:
        return encoding.render_conversation_for_completion(conversation, Role.ASSISTANT)
    return encoding.render_conversation(conversation)


def _messages(messages: list[JSONObject], tools: list[JSONObject] | None,
              effort: str | None) -> list[Message]:
    from openai_harmony import (
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )

    system = SystemContent.new().with_conversation_start_date(datetime.date.today().isoformat())
    if effort is not None:
        system = system.with_reasoning_effort(ReasoningEffort(effort.capitalize()))
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    first = 0
    developer = DeveloperContent.new()
    if messages and messages[0].get("role") == "system":
        developer, first = developer.with_instructions(_text(messages[0])), 1
    if tools:
        developer = developer.with_function_tools([
            ToolDescription.new(fn["name"], fn.get("description") or "", parameters=fn.get("parameters"))
            for fn in (t["function"] for t in tools)])
    if first or tools:
        out.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    calls: dict[str, str] = {}  # tool_call_id -> function name, for the tool results
    # An answered turn's reasoning is dropped; a turn still calling tools keeps its own.
    answered = max((i for i, m in enumerate(messages) if m.get("role") == "assistant" and _text(m)
                    and not m.get("tool_calls")), default=-1)
    for i, m in enumerate(messages[first:], first):
        out += _turn(m, i, calls, keep_reasoning=i > answered)
    return out


def _turn(m: JSONObject, i: int, calls: dict[str, str], keep_reasoning: bool) -> list[Message]:
    """One OpenAI message as harmony messages: an assistant turn's reasoning on analysis (where
    kept), its tool calls on commentary, its answer on final; a tool result from `functions.NAME`."""
    from openai_harmony import Author, Message, Role

    role = m.get("role")
    if role == "system":  # later ones: instructions in place
        return [Message.from_role_and_content(Role.DEVELOPER, _text(m))]
    if role == "user":
        return [Message.from_role_and_content(Role.USER, _text(m))]
    if role == "tool":
        call_id = m.get("tool_call_id")
        name = calls.get(call_id) if isinstance(call_id, str) else m.get("name")
        if not isinstance(name, str):
            field = f"messages[{i}].tool_call_id"
            raise InvalidParam(field, f"{field} {call_id!r} names no earlier assistant tool call")
        author = Author.new(Role.TOOL, f"functions.{name}")
        return [Message.from_author_and_content(author, _text(m)).with_channel("commentary")
                .with_recipient("assistant")]
    out = []  # (an assistant's: normalize_messages checked the roles)
    reasoning = m.get("reasoning_content") or m.get("reasoning")
    if isinstance(reasoning, str) and reasoning and keep_reasoning:
        out.append(Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis"))
    text = _text(m)
    tool_calls = m.get("tool_calls") or []
    if text:  # beside tool calls, a preamble on commentary; else the answer
        channel = "commentary" if tool_calls else "final"
        out.append(Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel))
    for j, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidParam(f"messages[{i}].tool_calls[{j}]", f"messages[{i}].tool_calls[{j}] needs "
                               "function.name")
        args = fn.get("arguments", "{}")
        calls[call.get("id") or fn["name"]] = fn["name"]
        text = args if isinstance(args, str) else json.dumps(args)
        out.append(Message.from_role_and_content(Role.ASSISTANT, text).with_channel("commentary")
                   .with_recipient(f"functions.{fn['name']}").with_content_type("json"))
    return out


def _text(m: JSONObject) -> str:
    return str(m.get("content") or "")  # (normalize_messages joined any text parts)


def check_tools(tools: list[JSONObject] | None) -> None:
    """Harmony's built-in tools are not run here: a function that takes their name is refused."""
    for i, tool in enumerate(tools or []):
        name = (tool.get("function") or {}).get("name")
        if name in BUILT_IN_TOOLS:
            raise InvalidParam(f"tools[{i}]", f"tools[{i}]: {name!r} is harmony's built-in {name} tool, "
                               "which this server does not run; give your function another name")


def call_grammar(schemas: dict[str, JSONObject]) -> str:
    """llguidance's grammar for a reply that calls one of `schemas`' functions (tool_choice
    "required" or a named function): any analysis first, then the call on commentary, its
    arguments held to the function's parameters."""
    header = '<|channel|> "commentary json" <|message|>'
    calls = " | ".join(f'" to=functions.{name}" {header} %json{json.dumps(_strict(s))}'
                       for name, s in schemas.items())
    return ("start: analysis? call <|call|>\n"
            'analysis: <|channel|> "analysis" <|message|> /(.|\\n)*/ <|end|> <|start|> "assistant"\n'
            f"call: {calls}\n")


def _strict(schema: JSONObject) -> JSONObject:
    from unison.frontend.text.structured import WHITESPACE, with_additional_properties

    return {**with_additional_properties(schema, False), "x-guidance": {"whitespace_pattern": WHITESPACE}}


# ---- outputs -------------------------------------------------------------------------------------


@dataclass(slots=True)
class Parsed:
    """What some tokens of one choice added: its answer, its reasoning, its tool calls."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class HarmonyStream:
    """One choice's output, parsed as it comes: analysis is reasoning, final (and commentary
    with no recipient) content, commentary to `functions.NAME` a tool call. A call is given
    whole when its message ends, and only if its arguments are JSON (else its text is content).
    Tokens that are not harmony (a model off its format) are content, as text, from there on.

    Where a message starts and ends is read from the tokens themselves (<|message|>, and <|end|>,
    <|call|> or <|return|>), its channel and recipient once at its start: the parser's `state`
    and `messages` serialize everything parsed so far, which would cost hundreds of us a token."""

    def __init__(self, encoding: HarmonyEncoding, calls_allowed: bool = True) -> None:
        from openai_harmony import Role, StreamableParser

        self.encoding, self.calls_allowed = encoding, calls_allowed
        self.parser = StreamableParser(encoding, Role.ASSISTANT)
        self.in_body = False  # past the current message's <|message|>
        self.header: list[int] = []  # tokens of a header being read (content if it goes wrong)
        self.channel: str | None = None  # the current message's, read at its <|message|>
        self.recipient: str | None = None
        self.body = ""  # the current call's arguments so far
        self.broken = False
        self.calls: list[ToolCall] = []

    def feed(self, ids: list[int], finished: bool = False) -> Parsed:
        out = Parsed()
        for token in ids:
            if self.broken:
                out.content += self.encoding.decode([token])
                continue
            self._token(token, out)
        if finished:
            self._finish(out)
        return out

    def _token(self, token: int, out: Parsed) -> None:
        from openai_harmony import HarmonyError

        parser = self.parser
        try:
            parser.process(token)
        except HarmonyError:
            self.broken = True
            out.content += self.encoding.decode(self._text_tokens(self.header + [token]))
            return
        if not self.in_body:
            self.header.append(token)
            if token == MARKERS["<|message|>"]:  # the header is whole: what this message is
                self.in_body, self.header, self.body = True, [], ""
                self.channel, self.recipient = parser.current_channel, parser.current_recipient
            return
        if token in _ENDS:
            self.in_body = False
            if _call_name(self.recipient) is not None:
                self._call(self.recipient or "", self.body, out)
            return
        delta = parser.last_content_delta or ""
        if _call_name(self.recipient) is not None:
            self.body += delta  # a call's arguments: given whole when its message ends
            return
        if self.channel == "analysis":
            out.reasoning += delta
        else:
            out.content += delta

    def _text_tokens(self, ids: list[int]) -> list[int]:
        return [i for i in ids if i not in MARKERS.values()]

    def _call(self, recipient: str, arguments: str, out: Parsed) -> None:
        name = _call_name(recipient)
        try:
            json.loads(arguments)
        except ValueError:
            out.content += arguments  # not a call that a client could run: its text, as content
            return
        if not self.calls_allowed or name is None:
            out.content += arguments
            return
        call = ToolCall(new_call_id(), name, arguments)
        index = len(self.calls)
        self.calls.append(call)
        out.tool_calls += call_deltas(index, call)

    def _finish(self, out: Parsed) -> None:
        """The choice ended (a stop token, max_tokens, an abort): what is left unsaid is content."""
        if self.broken:
            return
        if not self.in_body and self.header:  # cut inside a header: its text
            out.content += self.encoding.decode(self._text_tokens(self.header))
        elif self.in_body and _call_name(self.recipient) is not None:  # cut inside a call: its arguments
            out.content += self.body
        self.broken = True  # nothing more comes


def _call_name(recipient: str | None) -> str | None:
    if recipient and recipient.startswith("functions.") and len(recipient) > len("functions."):
        return recipient.removeprefix("functions.").split(" ")[0]
    return None
