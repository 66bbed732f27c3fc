"""The HTTP worker: a FastAPI app whose lifespan attaches one TokenizerWorker to the core.

Every uvicorn worker process runs this app; its frontend lives on the server's own event loop,
so requests never cross threads. OpenAI routes, the native /generate, health, info and metrics.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import os
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import fields
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from unison import registry
from unison.errors import EngineDeadError
from unison.frontend.worker import TokenizerWorker
from unison.output import Collector
from unison.sampling_params import SamplingParams
from unison.server.metrics import render_metrics
from unison.server.openai_protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("unison.server")

ENV = "UNISON_SERVER"  # JSON: registry path, owner pid, api key, served model name
MAX_REQUEST_BYTES = 32 << 20  # the default of --max-request-bytes

# The engine's names in a ValueError, as an OpenAI request spells them; and the names that make a
# message's first word the field it is about (its `param`).
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed",
                 "input_ids": "prompt", "json_schema": "response_format"}
_NATIVE_NAME = re.compile(r"\b(" + "|".join(_OPENAI_NAMES) + r")\b")
_FIELDS = ({f.name for f in fields(SamplingParams)} | set(_OPENAI_NAMES.values())
           | {"prompt", "input_ids", "text", "messages", "rid", "sampling_params", "response_format"})
_UNION_TAG = re.compile(r"(str|int|float|bool|list\[.*\]|dict\[.*\])$")  # in pydantic's error locations


def _kind(status: int) -> str:
    return {401: "authentication_error", 404: "not_found_error",
            503: "service_unavailable"}.get(status, "invalid_request_error")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or _kind(status)


def error_body(status: int, message: str, kind: str = "invalid_request_error",
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, kind, param), status_code=status)


def create_app(settings: dict[str, Any] | None = None) -> FastAPI:
    settings = settings or json.loads(os.environ[ENV])
    api_key: str | None = settings.get("api_key")
    served_name: str = settings["served_model_name"]
    max_queued: int | None = settings.get("max_queued_requests")
    max_body = settings.get("max_request_bytes")
    max_body = MAX_REQUEST_BYTES if max_body is None else max_body

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        info = registry.read_for_attach(settings["registry_path"], settings["owner_pid"])
        worker = TokenizerWorker(info.model_dir, info.endpoint, info.token, info.core_pid)
        await worker.start(5.0)
        worker.on_dead = _exit_when_engine_dies
        app.state.worker = worker
        log.info("worker %d attached as frontend %d", os.getpid(), worker.worker_id)
        try:
            yield
        finally:
            await worker.close()

    app = FastAPI(title="Unison", lifespan=lifespan)

    def worker_of(request: Request) -> TokenizerWorker:
        worker: TokenizerWorker = request.app.state.worker
        if worker.dead is not None:
            raise HTTPError(503, f"the engine is not running: {worker.dead}")
        return worker

    app.add_middleware(_Gate, api_key=api_key, max_body=max_body)

    @app.exception_handler(HTTPError)
    async def _http_error(_: Request, e: HTTPError):
        return error_response(e.status, e.message, e.kind, e.param)

    @app.exception_handler(StarletteHTTPException)
    async def _starlette_error(_: Request, e: StarletteHTTPException):
        # FastAPI's own errors (unknown route, wrong method, an unparsable body) in OpenAI's shape.
        message = str(e.detail)
        if isinstance(e.__cause__, UnicodeDecodeError):
            message = f"the request body is not valid UTF-8 JSON: {e.__cause__}"
        return error_response(e.status_code, message, _kind(e.status_code))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON")
        param = _field_path(first.get("loc", ()))
        if first.get("type") == "extra_forbidden":
            return error_response(400, f"unknown field {param!r}", param=param)
        return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param=param)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, e: ValueError):
        # The engine validates and names its own fields: say them as the request spelt them.
        message, path = str(e), request.url.path
        if path.startswith("/v1/"):
            message = _NATIVE_NAME.sub(lambda m: _OPENAI_NAMES[m[0]], message)
        head = re.match(r"([a-z_]+)(\[\d+\])*", message)
        param = head[0] if head and head[1] in _FIELDS else None
        if param == "prompt" and path == "/v1/chat/completions":
            param = "messages"  # the prompt is the chat template's output
        return error_response(400, message, param=param)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, e: EngineDeadError):
        return error_response(503, f"the engine is not running: {e}", "service_unavailable")

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):
        # A bug here: still an OpenAI-shaped body (uvicorn logs the traceback).
        return error_response(500, f"internal server error: {type(e).__name__}: {e}",
                              "server_error")

    def check_model(name: str | None) -> None:
        if name not in (None, served_name):
            raise HTTPError(404, f"model {name!r} does not exist; this server serves {served_name!r}",
                            param="model")

    def check_queue(worker: TokenizerWorker) -> None:
        if max_queued is not None and len(worker.states) >= max_queued:
            raise HTTPError(503, f"the server is overloaded: {len(worker.states)} requests queued "
                                 f"(max_queued_requests={max_queued}); retry later")

    # ---- routes ------------------------------------------------------------------------------

    @app.get("/health")
    async def health(request: Request):
        worker: TokenizerWorker = request.app.state.worker
        ok = worker.dead is None and registry.pid_alive(worker.core_pid)
        return Response(status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_name, "object": "model", "owned_by": "unison",
                                            "created": int(time.time())}]}

    @app.get("/get_server_info")
    async def server_info(request: Request):
        return await worker_of(request).control("server_info")

    @app.post("/flush_cache")
    async def flush_cache(request: Request):
        return {"success": await worker_of(request).control("flush_cache")}

    @app.get("/metrics")
    async def metrics(request: Request):
        info = await worker_of(request).control("server_info")
        return PlainTextResponse(render_metrics(info), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        worker = worker_of(request)
        check_model(body.model)
        if body.suffix or (body.best_of or 1) > 1:
            raise HTTPError(400, "suffix and best_of are not supported", param="suffix")
        prompts = _completion_prompts(body.prompt)
        params = body.sampling_params(default_max_tokens=16)
        k = body.logprobs
        ids = [worker.prepare(*p, params) for p in prompts]
        return await _run(request, worker, ids, params, body, kind="text_completion",
                          logprobs=k is not None, top_n=k or 0, echo=body.echo)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        worker = worker_of(request)
        check_model(body.model)
        if body.tools or body.tool_choice not in (None, "none"):
            raise HTTPError(400, "tool calling is not supported by this server yet", param="tools")
        if body.top_logprobs and not body.logprobs:
            raise HTTPError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        text = worker.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        params = body.sampling_params(default_max_tokens=worker.info["context_length"])
        prompt_ids = worker.tokenizer.encode(text, add_special_tokens=False)  # the template has them
        if body.max_tokens is None and body.max_completion_tokens is None:
            params.max_new_tokens = max(worker.info["context_length"] - len(prompt_ids), 1)
        ids = [worker.prepare(None, prompt_ids, params)]
        return await _run(request, worker, ids, params, body, kind="chat.completion",
                          logprobs=body.logprobs, top_n=body.top_logprobs or 0)

    @app.post("/generate")
    async def generate(request: Request):
        worker = worker_of(request)
        body = await _json_body(request)
        allowed = {"text", "input_ids", "sampling_params", "stream", "return_logprob",
                   "logprob_start_len", "top_logprobs_num", "rid", "priority"}
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise HTTPError(400, f"unknown field(s) {unknown}; allowed: {sorted(allowed)}", param=unknown[0])
        params = SamplingParams.from_any(body.get("sampling_params"))
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise HTTPError(400, "give exactly one of text and input_ids")
        ids = [worker.prepare(text, input_ids, params)]
        rid, rlp = body.get("rid"), bool(body.get("return_logprob", False))
        if rid is not None and not isinstance(rid, str):
            raise HTTPError(400, f"rid must be a string, got {rid!r}", param="rid")
        start = _int_field(body, "logprob_start_len", -1, lo=-1)
        top_n = _int_field(body, "top_logprobs_num", 0, lo=0, hi=20)
        priority = _int_field(body, "priority", 0)
        check_queue(worker)
        try:
            states = await worker.submit(ids, [params], [rid], rlp, start, top_n, priority)
        except ValueError as e:  # its one check: the rid is in flight already
            raise HTTPError(400, f"rid: {e}", param="rid") from None
        collector = Collector(states, batch=False)
        if body.get("stream"):
            async def sse() -> AsyncIterator[bytes]:
                try:
                    async for chunks in _follow(worker, collector):
                        for c in chunks:
                            yield _sse(c)
                except (EngineDeadError, ValueError) as e:
                    yield _stream_error(e)
                yield b"data: [DONE]\n\n"
            return StreamingResponse(sse(), media_type="text/event-stream")
        await _wait(request, worker, collector)
        return collector.results()

    async def _run(request: Request, worker: TokenizerWorker, ids: list[list[int]], params: SamplingParams,
                   body: Any, *, kind: str, logprobs: bool, top_n: int, echo: bool = False):
        check_queue(worker)
        states = await worker.submit(ids, [params] * len(ids), [None] * len(ids), logprobs,
                                     0 if echo else -1, top_n, body.priority)
        collector = Collector(states, batch=True)
        rid = f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex}"
        fmt = _Formatter(worker, kind, rid, served_name, logprobs, top_n, echo,
                         [s.prompt_ids for s in states])
        if body.stream:
            async def sse() -> AsyncIterator[bytes]:
                try:
                    async for chunks in _follow(worker, collector):
                        for c in chunks:
                            yield _sse(fmt.chunk(c))
                    if body.include_usage:
                        yield _sse(fmt.usage_chunk(collector))
                except (EngineDeadError, ValueError) as e:
                    yield _stream_error(e)
                yield b"data: [DONE]\n\n"
            return StreamingResponse(sse(), media_type="text/event-stream")
        await _wait(request, worker, collector)
        return fmt.final(collector)

    return app


class _Gate:
    """Checks the API key and the body size; tags every response with this worker's pid.

    Plain ASGI rather than @app.middleware("http"): Starlette's BaseHTTPMiddleware hides the
    client's disconnect from Request.is_disconnected(), so an abandoned non-streaming request
    would run on to its last token.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_body: int) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body
        self.pid = str(os.getpid()).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      (b"x-unison-worker-pid", self.pid)]
            await send(message)

        headers = dict(scope["headers"])
        if self.api_key and scope["path"] != "/health":
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                response = error_response(401, "missing or invalid API key; send 'Authorization: "
                                               "Bearer <key>'", "authentication_error")
                return await response(scope, receive, tagged)
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body:  # refused unread (uvicorn drains it)
            return await self.too_large(int(length))(scope, receive, tagged)
        if not length and b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            buffered = await self.read_body(receive)
            if buffered is None:
                return await self.too_large(None)(scope, receive, tagged)
            receive = buffered
        await self.app(scope, receive, tagged)

    def too_large(self, length: int | None) -> Response:
        size = "" if length is None else f" ({length} bytes)"
        return error_response(413, f"the request body{size} exceeds the limit of {self.max_body} "
                                   "bytes (max_request_bytes)")

    async def read_body(self, receive: Receive) -> Receive | None:
        """A body of unknown length, read up to the limit (None past it) and handed on whole; later
        receives go to the client's, where the app looks for a disconnect."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client left: the app sees that
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.max_body:
                return None
            if not message.get("more_body", False):
                message = {"type": "http.request", "body": b"".join(parts), "more_body": False}
                break
        first = [message]

        async def replay() -> Message:
            return first.pop() if first else await receive()
        return replay


def _exit_when_engine_dies() -> None:
    # The core is gone: this worker can serve nothing. Stop it; the launcher reports why.
    os.kill(os.getpid(), signal.SIGTERM)


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HTTPError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    return body


def _int_field(body: dict[str, Any], name: str, default: int, lo: int | None = None,
               hi: int | None = None) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not (lo is None or value >= lo) \
            or not (hi is None or value <= hi):
        bounds = f" in [{lo}, {'inf' if hi is None else hi}]" if lo is not None else ""
        raise HTTPError(400, f"{name} must be an integer{bounds}, got {value!r}", param=name)
    return value


def _field_path(loc: Any) -> str | None:
    """pydantic's error location as a field path, `messages[0].role`, without its union-member tags."""
    path = ""
    for x in loc:
        if isinstance(x, int):
            path += f"[{x}]"
        elif x != "body" and not _UNION_TAG.match(x):
            path += f".{x}" if path else x
    return path or None


def _completion_prompts(prompt: Any) -> list[tuple[str | None, list[int] | None]]:
    if isinstance(prompt, str):
        return [(prompt, None)]
    if prompt and all(isinstance(p, str) for p in prompt):
        return [(p, None) for p in prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [(None, list(prompt))]
    if prompt and all(isinstance(p, list) for p in prompt):
        return [(None, p) for p in prompt]
    raise HTTPError(400, "prompt must be a string, a list of strings, token ids, or lists of token ids",
                    param="prompt")


async def _follow(worker: TokenizerWorker, collector: Collector) -> AsyncIterator[list[dict]]:
    """Yield each batch of changed outputs; aborting what is left if the client goes away."""
    wake = asyncio.Event()
    collector.set_waker(wake.set)
    try:
        while True:
            chunks = collector.drain()
            if chunks:
                yield chunks
            if collector.done:
                return
            await wake.wait()
            wake.clear()
    finally:
        for rid in collector.unfinished_rids():
            await worker.abort(rid)


async def _wait(request: Request, worker: TokenizerWorker, collector: Collector) -> None:
    """Wait for a non-streaming request, aborting it if the client disconnects meanwhile."""
    async def drain() -> None:
        async for _ in _follow(worker, collector):
            pass

    # One task runs the generator to its end; cancelling it runs _follow's abort. (Closing the
    # generator from here instead fails: it is still running inside that task.)
    task = asyncio.ensure_future(drain())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise HTTPError(499, "client disconnected")
    finally:
        task.cancel()


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _stream_error(e: Exception) -> bytes:
    """A failure after the 200 status line went out is reported in the stream, as vLLM does."""
    if isinstance(e, EngineDeadError):
        return _sse(error_body(503, f"the engine is not running: {e}", "service_unavailable"))
    return _sse(error_body(400, str(e)))


class _Formatter:
    """Engine outputs -> OpenAI completion / chat responses and stream chunks."""

    def __init__(self, worker: TokenizerWorker, kind: str, rid: str, model: str, logprobs: bool,
                 top_n: int, echo: bool, prompt_ids: list[list[int]]) -> None:
        self.worker, self.kind, self.rid, self.model = worker, kind, rid, model
        self.logprobs, self.top_n, self.echo = logprobs, top_n, echo
        self.prompt_ids = prompt_ids  # per choice index
        self.created = int(time.time())
        self.sent: dict[int, int] = {}  # index -> characters of text already streamed
        self.sent_lp: dict[int, int] = {}
        self.sent_prompt_lp: dict[int, int] = {}  # echo: prompt logprobs streamed, chunk by chunk
        self.text_offset: dict[int, int] = {}  # index -> text offset of the next logprob token
        self.started: set[int] = set()

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    def _finish(self, out: dict) -> str | None:
        fr = out["meta_info"]["finish_reason"]
        return None if fr is None else ("length" if fr["type"] == "length" else "stop")

    def _tok(self, tid: int) -> str:
        return self.worker.tokenizer.decode([tid], skip_special_tokens=False)

    def _chat_lp(self, tid: int, logprob: float) -> dict:
        token = self._tok(tid)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    def _lp_content(self, out: dict, i: int, start: int) -> list[dict] | dict:
        lps = out["meta_info"].get("output_token_logprobs", [])[start:]
        tops = out["meta_info"].get("output_top_logprobs", [])[start:]
        if self.chat:
            return [{**self._chat_lp(t, lp),
                     "top_logprobs": [self._chat_lp(tt, tl)
                                      for tl, tt, _ in (tops[k] if k < len(tops) else [])][: self.top_n]}
                    for k, (lp, t, _) in enumerate(lps)]
        if self.echo:  # the echoed prompt's tokens come first, as in vLLM; the first has no logprob
            plps = out["meta_info"].get("input_token_logprobs", [])
            done = self.sent_prompt_lp.get(i, 0)
            self.sent_prompt_lp[i] = len(plps)
            tops = out["meta_info"].get("input_top_logprobs", [])[done:] + tops
            lps = plps[done:] + lps
        tokens = [self._tok(t) for _, t, _ in lps]
        offsets = list(itertools.accumulate(map(len, tokens), initial=self.text_offset.get(i, 0)))
        self.text_offset[i] = offsets.pop()
        return {"tokens": tokens, "token_logprobs": [lp for lp, _, _ in lps],
                "top_logprobs": [None if lp is None else  # the echoed first token has none
                                 {self._tok(tt): tl for tl, tt, _ in
                                  (tops[k] if k < len(tops) else [])[: self.top_n]}
                                 for k, (lp, _, _) in enumerate(lps)],
                "text_offset": offsets}

    def _echo_prefix(self, i: int) -> str:
        # From the prompt itself: with chunked prefill its logprobs arrive over several chunks.
        if not self.echo:
            return ""
        return self.worker.tokenizer.decode(self.prompt_ids[i], skip_special_tokens=False)

    def chunk(self, out: dict) -> dict:
        i = out["index"]
        new_text = out["text"][self.sent.get(i, 0):]
        self.sent[i] = len(out["text"])
        lp_start = self.sent_lp.get(i, 0)
        self.sent_lp[i] = len(out["output_ids"])
        first = i not in self.started
        self.started.add(i)
        if self.chat:
            delta: dict[str, Any] = {"content": new_text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": i, "delta": delta, "finish_reason": self._finish(out),
                      "logprobs": ({"content": self._lp_content(out, i, lp_start)}
                                   if self.logprobs else None)}
            return {"id": self.rid, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model, "choices": [choice]}
        text = (self._echo_prefix(i) if first else "") + new_text
        choice = {"index": i, "text": text, "finish_reason": self._finish(out),
                  "logprobs": self._lp_content(out, i, lp_start) if self.logprobs else None}
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [choice]}

    def usage(self, collector: Collector) -> dict:
        outs = [o.to_dict() for o in collector.outputs]
        prompt = sum(len(o.state.prompt_ids) for o in collector.outputs[:: max(1, _n_of(collector))])
        completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
        cached = sum(o["meta_info"]["cached_tokens"] for o in outs[:: max(1, _n_of(collector))])
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def usage_chunk(self, collector: Collector) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage(collector)}

    def final(self, collector: Collector) -> dict:
        choices = []
        for i, o in enumerate(collector.outputs):
            out = o.to_dict()
            if self.chat:
                choice = {"index": i, "message": {"role": "assistant", "content": out["text"]},
                          "finish_reason": self._finish(out),
                          "logprobs": ({"content": self._lp_content(out, i, 0)}
                                       if self.logprobs else None)}
            else:
                choice = {"index": i, "text": self._echo_prefix(i) + out["text"],
                          "finish_reason": self._finish(out),
                          "logprobs": self._lp_content(out, i, 0) if self.logprobs else None}
            choices.append(choice)
        return {"id": self.rid, "object": self.kind, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage(collector)}


def _n_of(collector: Collector) -> int:
    """Children per prompt: states of one prompt share its prompt_ids object."""
    outs = collector.outputs
    n = 1
    while n < len(outs) and outs[n].state.prompt_ids is outs[0].state.prompt_ids:
        n += 1
    return n
