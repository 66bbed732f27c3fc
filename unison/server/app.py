"""The HTTP worker: a FastAPI app whose lifespan attaches one TokenizerWorker to the core.

Every uvicorn worker process runs this app; its frontend lives on the server's own event loop,
so requests never cross threads. The routes are the APIs' (apis/, over the pipeline in
pipeline/); this file holds the app, its errors, its gate (API key, body size) and the web page
(static files in ui/, no build step: `/` and `/ui/*`, open like /health since they hold no data;
every API call the page makes sends the key).
"""

from __future__ import annotations

import hmac
import logging
import os
import signal
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from unison.deploy.replicas import Replicas
from unison.errors import EngineDeadError, EngineOverloadedError, InvalidParam
from unison.server.apis import ROUTERS
from unison.server.errors import HTTPError, error_kind, error_response, field_path
from unison.server.pipeline.inputs import generation_defaults
from unison.server.pipeline.start import invalid_param
from unison.server.settings import ServeSettings, WorkerSettings
from unison.wire.messages import CoreInfo

log = logging.getLogger("unison.server")

ENV = "UNISON_SERVER"  # JSON: the WorkerSettings of every worker
# The default of --max-request-bytes, derived from the model's context: room for every token of a
# context at more bytes a token than any text takes (JSON escapes included), plus tools, schemas
# and JSON's own syntax; a body past it could only be refused later, after seconds of parsing and
# tokenizing. Before a model is known (several models behind one address): a fixed 32 MiB.
REQUEST_BYTES_BASE = 4 << 20
REQUEST_BYTES_PER_TOKEN = 64
MAX_REQUEST_BYTES = 32 << 20
OPEN_ROUTES = ("/health", "/metrics")  # no API key, as in vLLM: for probes and scrapers
UI_DIR = Path(__file__).with_name("ui")
# The page's scripts and styles are its own files: nothing inline, nothing from elsewhere.
UI_POLICY = "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'"


def create_app(settings: WorkerSettings | None = None, embedded: bool = False) -> FastAPI:
    """One model's app. `embedded`: a model's among several (models_app.py), which answers the API
    key, the page and the engine's death itself."""
    settings = settings or WorkerSettings.from_json(os.environ[ENV])
    serve = settings.serve

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if settings.replicas_path:  # data parallel: every replica's core, over TCP
            replicas = await Replicas.remote(settings.replicas_path, serve.routing)
        else:
            # One model's core among several: its requests fail, and the next one starts it again.
            on_dead = (lambda: None) if embedded else _exit_when_engine_dies
            replicas = await Replicas.local(settings.registry_path, settings.owner_pid, on_dead)
        app.state.replicas = replicas
        worker = replicas.any
        app.state.context_length = worker.info.context_length
        app.state.image_bytes = image_body_bytes(worker.info, worker.config.max_image_bytes)
        app.state.sampling_defaults = generation_defaults(serve.generation_config, worker.info.model_dir)
        app.state.chat_template = _template_text(serve.chat_template)
        log.info("worker %d attached as frontend %d of %d replica(s)", os.getpid(), worker.worker_id,
                 len(replicas.workers))
        try:
            yield
        finally:
            await replicas.close()

    app = FastAPI(title="Unison", lifespan=lifespan)
    app.state.settings = settings
    if not embedded:
        app.add_middleware(Gate, api_key=serve.api_key, ui=not serve.disable_ui,
                           max_body=lambda: max_body_of(serve, getattr(app.state, "context_length", None),
                                                        getattr(app.state, "image_bytes", 0)))
    add_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    if not serve.disable_ui and not embedded:
        add_ui(app)
    return app


def max_body_of(serve: ServeSettings, context_length: int | None = None, image_bytes: int = 0) -> int:
    """--max-request-bytes, or the default for a model of `context_length` tokens (and
    `image_bytes` for the images its context holds, a vision model's)."""
    if serve.max_request_bytes is not None:
        return serve.max_request_bytes
    if context_length is None:
        return MAX_REQUEST_BYTES
    return REQUEST_BYTES_BASE + REQUEST_BYTES_PER_TOKEN * context_length + image_bytes


def image_body_bytes(info: CoreInfo, max_image_bytes: int) -> int:
    """Body room for a vision model's images: as many as its context holds (at most 16; a grid
    image takes at least its min_pixels' tokens), each up to max_image_bytes, base64-encoded (4
    characters per 3 bytes)."""
    spec = info.image
    if spec is None:
        return 0
    p = spec.patches
    fewest = spec.tokens if p is None else max(1, p.min_pixels // (p.patch_size * p.merge_size) ** 2)
    return min(info.context_length // fewest, 16) * -(-max_image_bytes * 4 // 3)


def add_ui(app: FastAPI) -> None:
    """The web page: chat, and the engine with its frontends, from the routes above."""
    app.mount("/ui", StaticFiles(directory=UI_DIR), name="ui")

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(UI_DIR / "index.html", headers={"Content-Security-Policy": UI_POLICY})


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, e: HTTPError):
        return error_response(e.status, e.message, e.kind, e.param, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _starlette_error(request: Request, e: StarletteHTTPException):
        # FastAPI's own errors (unknown route, wrong method, an unparsable body) in the route's shape.
        message = str(e.detail)
        if isinstance(e.__cause__, UnicodeDecodeError):
            message = f"the request body is not valid UTF-8 JSON: {e.__cause__}"
        return error_response(e.status_code, message, error_kind(e.status_code), path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        first, path = e.errors()[0] if e.errors() else {}, request.url.path
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON", path=path)
        param = field_path(first.get("loc", ()))
        if first.get("type") == "extra_forbidden":
            return error_response(400, f"unknown field {param!r}", param=param, path=path)
        return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param=param,
                              path=path)

    @app.exception_handler(InvalidParam)
    async def _invalid(request: Request, e: InvalidParam):
        path = request.url.path
        err = invalid_param(e, input_names=path.startswith("/v1/"), chat=path == "/v1/chat/completions")
        return error_response(err.status, err.message, param=err.param, path=path)

    @app.exception_handler(jinja2.TemplateError)
    async def _template_error(request: Request, e: jinja2.TemplateError):
        # The chat template refused these messages (its raise_exception, e.g. roles that do not
        # alternate): the request's fault, as vLLM answers it.
        return error_response(400, f"the chat template refused the messages: {e}", param="messages",
                              path=request.url.path)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, e: ValueError):
        # a bad request the checks above did not name a field of
        return error_response(400, str(e), path=request.url.path)

    @app.exception_handler(EngineOverloadedError)
    async def _overloaded(request: Request, e: EngineOverloadedError):
        return error_response(503, str(e), "service_unavailable", path=request.url.path)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, e: EngineDeadError):
        return error_response(503, f"the engine is not running: {e}", "service_unavailable",
                              path=request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        # A bug here: still an error body of the route's API (uvicorn logs the traceback).
        return error_response(500, f"internal server error: {type(e).__name__}: {e}", "server_error",
                              path=request.url.path)


class Gate:
    """Checks the API key and the body size; tags every response with this worker's pid.

    Plain ASGI rather than @app.middleware("http"): Starlette's BaseHTTPMiddleware hides the
    client's disconnect from Request.is_disconnected(), so an abandoned non-streaming request
    would run on to its last token.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_body: Callable[[], int],
                 ui: bool = False) -> None:
        """`max_body`: the largest body, in bytes (a function: it is known once a model is)."""
        self.app, self.api_key, self._max_body, self.ui = app, api_key, max_body, ui
        self.pid = str(os.getpid()).encode()

    def is_open(self, path: str) -> bool:
        """Needs no key: the probes' routes, and the page's static files (the page asks for the key)."""
        return path in OPEN_ROUTES or (self.ui and (path == "/" or path.startswith("/ui/")))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      (b"x-unison-worker-pid", self.pid)]
            await send(message)

        headers, path = dict(scope["headers"]), scope["path"]
        if self.api_key and not self.is_open(path) and not self.has_key(headers):
            response = error_response(401, "missing or invalid API key; send 'Authorization: Bearer <key>' "
                                           "(or 'x-api-key: <key>')", "authentication_error", path=path)
            return await response(scope, receive, tagged)
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body:  # refused unread (uvicorn drains it)
            return await self.too_large(int(length), path)(scope, receive, tagged)
        if not length and b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            buffered = await self.read_body(receive)
            if buffered is None:
                return await self.too_large(None, path)(scope, receive, tagged)
            receive = buffered
        await self.app(scope, receive, tagged)

    @property
    def max_body(self) -> int:
        return self._max_body()

    def has_key(self, headers: dict[bytes, bytes]) -> bool:
        """The key as OpenAI's clients send it (a bearer token) or as Anthropic's (x-api-key)."""
        assert self.api_key is not None
        bearer = hmac.compare_digest(headers.get(b"authorization", b""), f"Bearer {self.api_key}".encode())
        return bearer or hmac.compare_digest(headers.get(b"x-api-key", b""), self.api_key.encode())

    def too_large(self, length: int | None, path: str) -> Response:
        size = "" if length is None else f" ({length} bytes)"
        return error_response(413, f"the request body{size} exceeds the limit of {self.max_body} "
                                   "bytes (max_request_bytes)", path=path)

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


def _template_text(value: str | None) -> str | None:
    """--chat-template: a file's contents, or the template itself."""
    if value is not None and "{" not in value and Path(value).is_file():
        return Path(value).read_text()
    return value


def _exit_when_engine_dies() -> None:
    # The core is gone: this worker can serve nothing. Stop it; the launcher reports why.
    os.kill(os.getpid(), signal.SIGTERM)
