"""Ollama's API under /api/: what Open WebUI, editor plugins and LangChain's Ollama classes call.

`/api/chat` runs through the pipeline's chat and `/api/generate` through the chat template (or,
`raw`, the pipeline's completion; with a `suffix`, fill-in-the-middle). Both stream JSON lines
by default (`stream: false` answers once). `options` are Ollama's names for the sampling fields;
`format` ("json" or a JSON schema) is structured output. `/api/tags`, `/api/show`, `/api/ps` and
`/api/version` describe the one model served; `/api/embed` (and the older `/api/embeddings`)
embed with an embedding model. Errors are Ollama's {"error": "..."}, naming the field.

Models are never pulled, created, copied or deleted here: those routes do not exist.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

import msgspec
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from unison.frontend import pooling
from unison.frontend.text.infill import fim_tokens
from unison.frontend.text.tool_parsers import ToolCall, ToolCallDelta
from unison.json_types import JSONObject
from unison.sampling import MAX_TOP_LOGPROBS
from unison.server.apis.llama_cpp import LLAMA_CPP_SAMPLING, LlamaCppSampling
from unison.server.errors import HTTPError
from unison.server.pipeline.inputs import ChatInput, TextInput, json_schema_format
from unison.server.pipeline.output import Logprobs, hit_length
from unison.server.pipeline.start import (
    Started,
    attached,
    check_model,
    names_of,
    start_chat,
    start_completion,
)
from unison.server.streaming import Timer, route, stream, wait, worker_of
from unison.version import __version__

router = APIRouter()
PREFIX = "/api"
# Ollama's option names for the chat fields, and back, for the errors the pipeline raises.
SAMPLING = LLAMA_CPP_SAMPLING | {"num_predict": "max_tokens", "seed": "seed"}
RENAMED = [(chat, f"options.{name}") for name, chat in SAMPLING.items()] + [("response_format", "format"),
                                                                           ("reasoning_effort", "think"),
           (r"(messages\[\d+\])\.content\[(\d+)\]\.image_url", r"\1.images[\2]")]
# Options that would change the output but are not served: only their neutral values are accepted.
NEUTRAL = {"mirostat": 0, "tfs_z": 1.0}


class Options(LlamaCppSampling):
    """Ollama's `options`: the sampling ones mapped; the runner's own (how it loads and runs the
    model) accepted, with no effect; any other named in a 400."""

    num_predict: int | None = None  # -1, -2 (Ollama's "unbounded", "fill the context"): the context's rest
    seed: int | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    tfs_z: float | None = None
    penalize_newline: bool | None = None
    repeat_last_n: int | None = None  # the penalties here read the whole sequence, as vLLM's
    numa: bool | None = None
    num_ctx: int | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    num_thread: int | None = None
    num_keep: int | None = None
    logits_all: bool | None = None
    embedding_only: bool | None = None
    f16_kv: bool | None = None

    def sampling(self) -> JSONObject:
        """The chat fields these options set."""
        for name in ("mirostat", "tfs_z"):
            value = getattr(self, name)
            if value is not None and value != NEUTRAL[name]:
                raise HTTPError(400, f"options.{name}: {name} sampling is not served here (send "
                                     f"{NEUTRAL[name]} or leave it out)", param=f"options.{name}")
        out = self.given(SAMPLING)
        if self.num_predict is not None and self.num_predict < 0:
            if self.num_predict not in (-1, -2):
                raise HTTPError(400, "options.num_predict must be -1, -2 or at least 0, got "
                                     f"{self.num_predict}", param="options.num_predict")
            del out["max_tokens"]  # the context's rest
        return out


class _Generation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    format: str | JSONObject | None = None
    options: Options | None = None
    stream: bool = True
    keep_alive: float | str | None = None  # the model stays loaded: accepted, with no effect
    think: bool | Literal["low", "medium", "high"] | None = None  # a level: thinking on
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def fields(self) -> JSONObject:
        """The chat fields every generation sets: sampling, format, logprobs, thinking."""
        out = (self.options or Options()).sampling()
        out["response_format"] = _response_format(self.format)
        if self.think is not None:
            out["chat_template_kwargs"] = {"enable_thinking": self.think is not False}
        if isinstance(self.think, str):  # a level: how long a reasoning model thinks
            out["reasoning_effort"] = self.think
        return out


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None  # the model's own earlier reasoning, as reasoning_content
    images: list[str] | None = None
    tool_calls: list[JSONObject] | None = None
    tool_name: str | None = None


class ChatBody(_Generation):
    messages: list[Message] = []
    tools: list[JSONObject] | None = None


class GenerateBody(_Generation):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    raw: bool = False
    template: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None


class EmbedBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[str]
    truncate: bool = True  # Ollama's default: cut an input at the context's end
    dimensions: int | None = None
    options: Options | None = None
    keep_alive: float | str | None = None


class EmbeddingsBody(BaseModel):
    """/api/embeddings, Ollama's older route: one prompt."""

    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: str
    options: Options | None = None
    keep_alive: float | str | None = None


class ShowBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    name: str | None = None  # Ollama's older field
    verbose: bool = False


def _response_format(fmt: str | JSONObject | None) -> JSONObject | None:
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return json_schema_format(fmt, "format")
    raise HTTPError(400, f'format must be "json" or a JSON schema object, got {fmt!r}', param="format")


def _model(name: str) -> str:
    """Ollama's clients name models with a tag; the served model's is "latest"."""
    return name.removesuffix(":latest")


def _messages(given: list[Message]) -> list[JSONObject]:
    """Ollama's messages as chat messages: its tool calls' arguments are objects, and a tool's
    answer names the tool rather than the call."""
    out = []
    for i, m in enumerate(given):
        message: JSONObject = {"role": m.role, "content": m.content}
        if m.images:  # base64 images, before the message's text (errors name images[k]: see RENAMED)
            message["content"] = [*({"type": "image_url", "image_url": {"url": image}} for image in m.images),
                                  {"type": "text", "text": m.content or ""}]
        if m.tool_calls:
            message["tool_calls"] = [_chat_call(c, f"messages[{i}].tool_calls[{j}]", f"call_{i}_{j}")
                                     for j, c in enumerate(m.tool_calls)]
        if m.tool_name:
            message["name"] = m.tool_name
        if m.thinking:  # shown where the format keeps it (harmony: a turn that called a tool)
            message["reasoning_content"] = m.thinking
        out.append(message)
    return out


def _chat_call(call: object, field: str, call_id: str) -> JSONObject:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise HTTPError(400, f"{field} must be {{\"function\": {{\"name\": ..., \"arguments\": {{...}}}}}}",
                        param=field)
    return {"id": call_id, "type": "function",
            "function": {"name": fn["name"], "arguments": json.dumps(fn.get("arguments") or {})}}


@router.post(PREFIX + "/chat")
async def chat(body: ChatBody, request: Request):
    native = attached(worker_of(request))[0].harmony is not None  # the model's format marks its calls
    if body.tools and request.app.state.settings.serve.tool_call_parser is None and not native:
        raise HTTPError(400, "tools need the server started with --tool-call-parser (hermes, llama3_json "
                             "or qwen3_coder)", param="tools")
    with names_of(RENAMED, chat=True):
        chat = ChatInput.model_validate(dict(
            model=_model(body.model), messages=_messages(body.messages), tools=body.tools or None,
            logprobs=body.logprobs, top_logprobs=body.top_logprobs, **body.fields()))
        started = await start_chat(chat, request)
    return await _answer(request, Lines(started, "message", body.top_logprobs or 0), body.stream)


@router.post(PREFIX + "/generate")
async def generate(body: GenerateBody, request: Request):
    model = _model(body.model)
    for field in ("template", "context"):
        if getattr(body, field):
            raise HTTPError(400, f"{field} is not supported here: {_UNSUPPORTED[field]}", param=field)
    if not body.prompt and body.suffix is None:  # Ollama's way to load a model: it is loaded
        await check_model(request, model)
        return {"model": body.model, "created_at": _now(), "response": "", "done": True,
                "done_reason": "load"}
    with names_of(RENAMED):
        fields = body.fields()
    if body.images and (body.raw or body.suffix is not None):
        raise HTTPError(400, "images go through the chat template: send them without raw or suffix",
                        param="images")
    if body.raw or body.suffix is not None:
        fields.pop("chat_template_kwargs", None)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None  # a completion's top-k count
        with names_of(RENAMED):
            completion = TextInput.model_validate(dict(
                model=model, prompt=body.prompt, suffix=body.suffix, logprobs=logprobs, **fields))
            started = await start_completion(completion, request, default_max_tokens=None)
    else:
        messages = [Message(role="system", content=body.system)] if body.system else []
        with names_of(RENAMED + [(r"messages\[\d+\]\.images", "images")], chat=True):
            chat = ChatInput.model_validate(dict(
                model=model, messages=_messages(messages + [Message(role="user", content=body.prompt,
                                                                    images=body.images)]),
                logprobs=body.logprobs, top_logprobs=body.top_logprobs, **fields))
            started = await start_chat(chat, request)
    distinct = body.raw or body.suffix is not None  # a completion's top tokens: distinct texts (its shape)
    return await _answer(request, Lines(started, "response", body.top_logprobs or 0, distinct), body.stream)


_UNSUPPORTED = {"template": "the model's own chat template renders the prompt (or send raw: true)",
                "context": "it is deprecated; send the conversation to /api/chat"}


async def _answer(request: Request, lines: Lines, streaming: bool):
    if streaming:
        return stream(lines.collector, lines.lines, lines.tail, encode=_line, done=False, path=PREFIX + "/",
                      media_type="application/x-ndjson")
    await wait(request, lines.collector, lines.timer.seen)
    return lines.whole()


_encode = msgspec.json.Encoder().encode


def _line(obj: object) -> bytes:
    return _encode(obj) + b"\n"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class Lines:
    """One answer's JSON lines (streamed) or object, from the pipeline's typed output: the text
    under `message` (/api/chat) or `response` (/api/generate)."""

    def __init__(self, started: Started, field: str, top_n: int, distinct: bool = False) -> None:
        self.output, self.model = started.output, started.model
        self.collector, self.field, self.top_n = started.collector, field, top_n
        self.distinct = distinct  # top alternatives keyed by their text (one per text)
        self.timer = Timer(started.collector)
        self.calls: dict[int, ToolCall] = {}  # streamed tool calls, complete at the end

    def lines(self, changed: list[int]) -> list[JSONObject]:
        self.timer.seen(changed)
        out = []
        for delta in self.output.deltas(changed):
            for call in delta.tool_calls:
                self._add_call(call)
            logprobs = self._logprobs(delta.logprobs)
            if delta.content or delta.reasoning or logprobs:
                line = self._line(delta.content, delta.reasoning or None, None, logprobs)
                out.append(line | {"done": False})
        return out

    def tail(self) -> list[JSONObject]:
        out = self.lines([])
        calls = [_ollama_call(c) for _, c in sorted(self.calls.items())]
        if calls:
            out.append(self._line("", None, calls, None) | {"done": False})
        return out + [self._line("", None, None, None) | self._done()]

    def whole(self) -> JSONObject:
        choice = self.output.choices()[0]
        calls = [_ollama_call(c) for c in choice.tool_calls]
        return self._line(choice.content or "", choice.reasoning, calls or None,
                          self._logprobs(choice.logprobs)) | self._done()

    def _line(self, text: str, thinking: str | None, calls: list[JSONObject] | None,
              logprobs: list[JSONObject] | None) -> JSONObject:
        body: JSONObject
        if self.field == "message":
            body = {"message": {"role": "assistant", "content": text}}
            extra = body["message"]
        else:
            body = extra = {"response": text}
        if thinking:
            extra["thinking"] = thinking
        if calls:
            extra["tool_calls"] = calls
        line = {"model": self.model, "created_at": _now(), **body}
        return line | ({"logprobs": logprobs} if logprobs else {})

    def _done(self) -> JSONObject:
        """The last line's fields: why it ended, the counts, and the times in nanoseconds."""
        state, usage = self.collector.states[0], self.output.usage()
        prompt_s, output_s = self.timer.split()
        return {"done": True, "done_reason": "length" if hit_length(state.finish_reason) else "stop",
                "total_duration": _ns(prompt_s + output_s), "load_duration": 0,
                "prompt_eval_count": usage.prompt_tokens, "prompt_eval_duration": _ns(prompt_s),
                "eval_count": usage.completion_tokens, "eval_duration": _ns(output_s)}

    def _add_call(self, call: ToolCallDelta) -> None:
        known = self.calls.setdefault(call.index, ToolCall(call.id or "", call.name or "", ""))
        known.arguments += call.arguments

    def _logprobs(self, lps: Logprobs | None) -> list[JSONObject] | None:
        """Ollama's logprobs: each token with its top alternatives, best first."""
        if not lps or not lps.tokens:
            return None
        out = []
        for k, (lp, tid, _) in enumerate(lps.tokens):
            given = lps.top[k] if k < len(lps.top) else []
            top = [(self.output.token_text(tt), tl) for tl, tt, _ in given[: self.top_n]]
            if self.distinct:
                top = list(dict(top).items())
            out.append({"token": self.output.token_text(tid), "logprob": lp,
                        "top_logprobs": [{"token": t, "logprob": v} for t, v in top]})
        return out


def _ollama_call(call: ToolCall) -> JSONObject:
    return {"function": {"name": call.name, "arguments": json.loads(call.arguments or "{}")}}


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


# ---- the model's description ---------------------------------------------------------------------


def _details(request: Request) -> JSONObject:
    _, info, config = attached(worker_of(request))
    family = _model_type(info.model_dir)
    gguf = config.model_path is None or config.model_path.endswith(".gguf")  # None: the embedded GGUF
    return {"parent_model": "", "format": "gguf" if gguf else "safetensors",
            "family": family, "families": [family], "quantization_level": info.quantization}


@functools.cache
def _model_type(model_dir: str) -> str:
    """config.json's model_type ("" where this frontend has no model files: a remote one)."""
    path = Path(model_dir) / "config.json"
    return str(json.loads(path.read_text()).get("model_type", "")) if path.is_file() else ""


def _card(request: Request) -> JSONObject:
    """A model as /api/tags lists it. Its digest names the model file and its size: it changes when
    they do (hashing gigabytes per listing would not pay)."""
    name = request.app.state.settings.served_model_name
    info = attached(worker_of(request))[1]
    digest = hashlib.sha256(f"{info.model_dir}:{info.weights_bytes}".encode()).hexdigest()
    return {"name": name, "model": name, "modified_at": _now(), "size": info.weights_bytes, "digest": digest,
            "details": _details(request)}


@router.get(PREFIX + "/tags")
async def tags(request: Request):
    return {"models": [_card(request)]}


@router.get(PREFIX + "/ps")
async def ps(request: Request):
    info = attached(worker_of(request))[1]
    never = "2318-01-01T00:00:00Z"  # the model is never unloaded (Ollama's date for keep_alive -1)
    loaded = {"expires_at": never, "size_vram": 0, "context_length": info.context_length}
    return {"models": [_card(request) | loaded]}


@router.get(PREFIX + "/version")
async def version():
    return {"version": __version__}


@router.post(PREFIX + "/show")
async def show(body: ShowBody, request: Request):
    name = body.model or body.name
    if name is None:
        raise HTTPError(400, "model is required", param="model")
    await check_model(request, _model(name))
    tokenizer, info, config = attached(worker_of(request))
    capabilities = ["embedding"] if info.task != "generate" else ["completion"]
    harmony = tokenizer.harmony is not None  # gpt-oss: its own format marks calls and reasoning
    if info.task == "generate" and (request.app.state.settings.serve.tool_call_parser or harmony):
        capabilities.append("tools")
    if info.task == "generate" and (config.reasoning_parser or harmony):
        capabilities.append("thinking")
    if info.task == "generate" and fim_tokens(tokenizer) is not None:
        capabilities.append("insert")
    arch = _model_type(info.model_dir)
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    return {"modelfile": "", "parameters": "", "template": template or "", "details": _details(request),
            "model_info": {"general.architecture": arch, f"{arch}.context_length": info.context_length},
            "capabilities": capabilities, "modified_at": _now()}


# ---- embeddings ----------------------------------------------------------------------------------


async def _embed(request: Request, model: str, texts: str | list[str], field: str, truncate: bool,
                 dimensions: int | None = None) -> tuple[list[list[float]], int]:
    await check_model(request, _model(model))
    worker = worker_of(request)
    pooling.check_dimensions(worker.info, dimensions)
    limit = worker.info.context_length if truncate else None
    req = pooling.embed_request(worker.info, worker.tokenizer, texts, field, limit)
    collector = await route(request, None, req).submit(req)
    await wait(request, collector)
    results = pooling.pooled(collector)
    return [p.vector for p in results], sum(p.prompt_tokens for p in results)


@router.post(PREFIX + "/embed")
async def embed(body: EmbedBody, request: Request):
    start = time.monotonic()
    vectors, tokens = await _embed(request, body.model, body.input, "input", body.truncate, body.dimensions)
    return {"model": body.model, "embeddings": vectors, "total_duration": _ns(time.monotonic() - start),
            "load_duration": 0, "prompt_eval_count": tokens}


@router.post(PREFIX + "/embeddings")
async def embeddings(body: EmbeddingsBody, request: Request):
    vectors, _ = await _embed(request, body.model, body.prompt, "prompt", True)
    return {"embedding": vectors[0]}
