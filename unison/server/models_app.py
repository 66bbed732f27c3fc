"""The HTTP worker when `unison serve` serves several models: each request goes to its model's app.

A model's app is the one-model app of app.py, attached to that model's core: every route, LoRA,
structured output and control works per model as it does on a one-model server. This router adds
what spans the models: it reads the model a request names (the JSON body's `model`, Ollama's
`name`, or `?model=` for a GET), holds it in the launcher's pool while requests for it are in
flight (wire/pool.py), attaches to its core on first use, and answers the routes about all of
them itself: /v1/models, /models/load and /models/unload (llama-server's), /get_server_info,
/metrics (each model's, labelled model_name as vLLM's), Ollama's /api/tags and /api/ps, /health
and the web page.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qs

import msgspec
import zmq
import zmq.asyncio
from fastapi import FastAPI
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict
from starlette.types import Message, Receive, Scope, Send

from unison.deploy.model_pool import unknown_model
from unison.errors import EngineDeadError
from unison.server.app import ENV, Gate, add_error_handlers, add_ui, create_app, max_body_of
from unison.server.errors import HTTPError, error_response
from unison.server.metrics import CONTENT_TYPE, render_metrics
from unison.server.settings import WorkerSettings
from unison.version import __version__
from unison.wire import pool as pp
from unison.wire.messages import GetServerInfo, LoraAdapterInfo, ServerInfo

log = logging.getLogger("unison.server")

# Answered here, about every model (a request to any other path is a model's).
OWN_PATHS = {"/health", "/version", "/v1/models", "/models", "/models/load", "/models/unload",
             "/get_server_info", "/metrics", "/api/tags", "/api/ps", "/api/version", "/"}
POOL_TIMEOUT_S = 10.0  # a call that loads nothing (list, unload): the launcher answers at once


class _Named(msgspec.Struct):
    """The fields of a request body that name its model: OpenAI's and most APIs' `model`, and
    Ollama's older `name`; the rest of the body is left to the model's app."""

    model: str | None = None
    name: str | None = None


@dataclass
class _Model:
    """A model as this worker serves it: its app, attached to one core."""

    app: FastAPI
    core_pid: int
    stack: contextlib.AsyncExitStack  # the app's lifespan: closing it detaches

    @property
    def alive(self) -> bool:
        return bool(self.app.state.replicas.live)

    async def server_info(self) -> ServerInfo:
        return await self.app.state.replicas.any.control(GetServerInfo())


class PoolClient:
    """This worker's calls to the launcher's model pool (a DEALER on the server's loop)."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.ids = itertools.count()
        self.pending: dict[int, asyncio.Future[pp.FromPool]] = {}
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        while True:
            reply = pp.decode_from_pool(await self.sock.recv())
            if (future := self.pending.pop(reply.call_id, None)) is not None and not future.done():
                future.set_result(reply)

    async def call(self, make: Callable[[int], pp.ToPool], timeout: float | None) -> pp.FromPool:
        call_id = next(self.ids)
        future = self.pending[call_id] = asyncio.get_running_loop().create_future()
        await self.sock.send(pp.encode(make(call_id)))
        try:
            reply = await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise HTTPError(503, "the server's model pool did not answer") from None
        finally:
            self.pending.pop(call_id, None)
        if isinstance(reply, pp.PoolError):
            raise HTTPError(reply.status, reply.message, param="model")
        return reply

    async def row(self, make: Callable[[int], pp.ToPool], timeout: float | None) -> pp.ModelRow:
        reply = await self.call(make, timeout)
        assert isinstance(reply, (pp.Ready, pp.Done))  # (what Acquire, Load and Unload answer)
        return reply.row

    async def rows(self) -> list[pp.ModelRow]:
        reply = await self.call(pp.ListModels, POOL_TIMEOUT_S)
        assert isinstance(reply, pp.Rows)
        return reply.rows

    def release(self, model: str) -> None:
        self.sock.send(pp.encode(pp.Release(model, os.getpid())))

    def close(self) -> None:
        self.reader.cancel()
        self.sock.close()
        self.ctx.term()


class ModelsRouter:
    """The ASGI app of an HTTP worker serving several models."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings, self.names = settings, list(settings.models)
        self.load_timeout = settings.serve.model_load_timeout + POOL_TIMEOUT_S
        self.models: dict[str, _Model] = {}
        self.in_flight: dict[str, int] = dict.fromkeys(self.names, 0)  # held in the pool while > 0
        self.locks = {name: asyncio.Lock() for name in self.names}
        self.pool: PoolClient | None = None
        self.own = self._own_routes()

    # ---- one request --------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OWN_PATHS or path.startswith(("/ui/", "/v1/models/")):
            return await self.own(scope, receive, send)
        try:
            name, receive = await self._model_named(scope, receive)
            await self._serve(name, scope, receive, send)
        except HTTPError as e:
            await error_response(e.status, e.message, e.kind, e.param, path)(scope, receive, send)

    async def _model_named(self, scope: Scope, receive: Receive) -> tuple[str, Receive]:
        """The model a request names (`?model=`, else the body's), and the body to replay to it."""
        query = parse_qs(scope.get("query_string", b"").decode())
        body, receive = await _read_body(receive)
        named = query.get("model", [None])[0]
        if named is None and body:
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                fields = msgspec.json.decode(body, type=_Named)
                named = fields.model or fields.name
        if named is None:
            if len(self.names) == 1:
                return self.names[0], receive
            raise HTTPError(400, f"model is required: this server serves {self.names}", param="model")
        try:
            return self._resolve(named), receive
        except HTTPError:
            if (base := await self._base_of_adapter(named)) is None:
                raise
            return base, receive  # its app finds the adapter by the name the body gives

    def _resolve(self, name: str) -> str:
        if name in self.names:
            return name
        if name.removesuffix(":latest") in self.names:  # Ollama's clients tag names
            return name.removesuffix(":latest")
        raise HTTPError(404, unknown_model(name, self.names), param="model")

    async def _base_of_adapter(self, name: str) -> str | None:
        """The loaded model that has a LoRA adapter called `name` (its core lost it if unloaded)."""
        for model, info in (await self._loaded_infos()).items():
            if any(a.name == name for a in info.lora_adapters):
                return model
        return None

    async def _serve(self, name: str, scope: Scope, receive: Receive, send: Send) -> None:
        """Hold `name` while this request runs (the pool stops no core a worker holds)."""
        self.in_flight[name] += 1
        held = True

        def finish() -> None:  # once: this request holds the model no more
            nonlocal held
            if held:
                held = False
                self.in_flight[name] -= 1
                if self.in_flight[name] == 0 and self.pool is not None:
                    self.pool.release(name)

        async def sending(message: Message) -> None:
            # Released before the response's last bytes leave: the client's next request, for
            # another model through any worker, must find this one idle (not held: a 503).
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                finish()
            await send(message)

        try:
            model = self.models.get(name)
            if self.in_flight[name] == 1 or model is None or not model.alive:
                model = await self._acquired(name)
            await model.app(scope, receive, sending)
        finally:
            finish()

    async def _acquired(self, name: str, hold: bool = True) -> _Model:
        """`name`'s app, attached to its core as the pool has it now: loading it if need be and
        held for a request; else (`hold` False) only if it is loaded."""
        assert self.pool is not None  # (the lifespan's)
        pid = os.getpid()
        make: Callable[[int], pp.ToPool] = (lambda i: pp.Acquire(i, name, pid)) if hold \
            else (lambda i: pp.Load(i, name, if_loaded=True))
        row = await self.pool.row(make, self.load_timeout)
        async with self.locks[name]:
            model = self.models.get(name)
            if model is None or model.core_pid != row.core_pid or not model.alive:
                model = await self._attach(name, row, model)
            return model

    async def _attach(self, name: str, row: pp.ModelRow, old: _Model | None) -> _Model:
        if old is not None:
            self.models.pop(name, None)
            await old.stack.aclose()
        assert row.registry_path is not None and row.core_pid is not None  # (loaded)
        settings = WorkerSettings(self.settings.serve, name, row.registry_path, self.settings.owner_pid)
        app = create_app(settings, embedded=True)
        stack = contextlib.AsyncExitStack()
        try:
            await stack.enter_async_context(app.router.lifespan_context(app))
        except (OSError, TimeoutError, EngineDeadError) as e:  # the core went away meanwhile
            raise HTTPError(503, f"model {name!r}: its engine core did not take this worker: {e}",
                            param="model") from None
        model = self.models[name] = _Model(app, row.core_pid, stack)
        return model

    # ---- what spans the models ----------------------------------------------------------------

    def _own_routes(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI):
            self.pool = PoolClient(self.settings.pool_endpoint or "")
            log.info("worker %d serves models %s", os.getpid(), self.names)
            try:
                yield
            finally:
                for model in list(self.models.values()):
                    await model.stack.aclose()
                self.pool.close()

        app = FastAPI(title="Unison", lifespan=lifespan)
        app.state.settings = self.settings
        add_error_handlers(app)
        if not self.settings.serve.disable_ui:
            add_ui(app)
        self._add_model_routes(app)
        self._add_engine_routes(app)
        return app

    def _pool(self) -> PoolClient:
        assert self.pool is not None  # (the lifespan's)
        return self.pool

    def _add_model_routes(self, app: FastAPI) -> None:
        @app.get("/v1/models")
        @app.get("/models")
        async def models():
            """Every model, then every LoRA adapter of a loaded one (vLLM's card, `parent` its model)."""
            infos = await self._loaded_infos()
            adapters = [_adapter_card(name, a) for name, info in infos.items() for a in info.lora_adapters]
            return {"object": "list", "data": [_card(row) for row in await self._pool().rows()] + adapters}

        @app.get("/v1/models/{model:path}")
        async def model(model: str):
            try:
                name = self._resolve(model)
            except HTTPError:
                for base, info in (await self._loaded_infos()).items():
                    if adapter := next((a for a in info.lora_adapters if a.name == model), None):
                        return _adapter_card(base, adapter)
                raise
            return _card(next(r for r in await self._pool().rows() if r.name == name))

        @app.post("/models/load")
        async def load(body: _ModelBody):
            name = self._resolve(body.model)
            row = await self._pool().row(lambda i: pp.Load(i, name), self.load_timeout)
            return {"success": True, "model": _card(row)}

        @app.post("/models/unload")
        async def unload(body: _ModelBody):
            name = self._resolve(body.model)
            row = await self._pool().row(lambda i: pp.Unload(i, name), POOL_TIMEOUT_S)
            return {"success": True, "model": _card(row)}

        @app.get("/api/tags")
        async def tags():
            return {"models": [_ollama_card(r) for r in await self._pool().rows()]}

        @app.get("/api/ps")
        async def ps():
            return {"models": [_ollama_card(r) for r in await self._pool().rows() if r.state == "loaded"]}

        @app.get("/version")
        @app.get("/api/version")
        async def version():
            return {"version": __version__}

    def _add_engine_routes(self, app: FastAPI) -> None:
        @app.get("/health")
        async def health():
            return Response(status_code=200)  # the router serves; each model loads when asked for

        @app.get("/get_server_info")
        async def server_info():
            """Every model's row; a loaded one's core's state under `server_info`."""
            infos = await self._loaded_infos()
            return {"version": __version__, "models": [
                {**msgspec.to_builtins(row), "server_info": infos[row.name].to_dict() if row.name in infos
                 else None} for row in await self._pool().rows()]}

        @app.get("/metrics")
        async def metrics():
            infos = await self._loaded_infos()
            return Response(render_metrics(list(infos.values()), [{"model_name": n} for n in infos]),
                            media_type=CONTENT_TYPE)

    async def _loaded_infos(self) -> dict[str, ServerInfo]:
        """Each loaded model's core's ServerInfo (attaching to those this worker has not served)."""
        rows = [r for r in await self._pool().rows() if r.state == "loaded"]

        async def info(row: pp.ModelRow) -> ServerInfo | None:
            try:
                model = self.models.get(row.name)
                if model is None or model.core_pid != row.core_pid or not model.alive:
                    model = await self._acquired(row.name, hold=False)
                return await model.server_info()
            except (HTTPError, EngineDeadError, TimeoutError):  # unloaded meanwhile
                return None
        found = await asyncio.gather(*(info(r) for r in rows))
        return {r.name: i for r, i in zip(rows, found) if i is not None}


class _ModelBody(BaseModel):
    """/models/load and /models/unload (llama-server's)."""

    model_config = ConfigDict(extra="forbid")
    model: str


def _card(row: pp.ModelRow) -> dict:
    """vLLM's model card, with the model's state (and llama-server's router's `status`)."""
    return {"id": row.name, "object": "model", "owned_by": "unison", "created": int(row.last_used),
            "root": row.path, "parent": None, "task": row.task, "state": row.state,
            "status": {"value": row.state}, "core_pid": row.core_pid, "error": row.error}


def _adapter_card(model: str, adapter: LoraAdapterInfo) -> dict:
    return {"id": adapter.name, "object": "model", "owned_by": "unison", "created": int(adapter.loaded_at),
            "root": adapter.path, "parent": model, "task": "generate", "state": "loaded",
            "status": {"value": "loaded"}}


def _ollama_card(row: pp.ModelRow) -> dict:
    """A model as Ollama's /api/tags lists it: its digest names its file and size."""
    try:
        size = os.path.getsize(row.path) if os.path.isfile(row.path) else 0
        mtime = os.path.getmtime(row.path)
    except OSError:  # the file went away since the server started: listed, and failing to load
        size, mtime = 0, 0.0
    digest = hashlib.sha256(f"{row.path}:{size}:{mtime}".encode()).hexdigest()
    return {"name": row.name, "model": row.name, "size": size, "digest": digest,
            "modified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(mtime))}


async def _read_body(receive: Receive) -> tuple[bytes, Receive]:
    """The whole request body, and a receive that hands it on as one message (later receives go to
    the client's: a disconnect still shows)."""
    parts = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            first: list[Message] = [message]
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            first = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]
            break
    body = first[0].get("body", b"") if first[0]["type"] == "http.request" else b""

    async def replay() -> Message:
        return first.pop() if first else await receive()
    return body, replay


def create_models_app(settings: WorkerSettings | None = None) -> Gate:
    settings = settings or WorkerSettings.from_json(os.environ[ENV])
    serve = settings.serve
    return Gate(ModelsRouter(settings), api_key=serve.api_key, max_body=lambda: max_body_of(serve),
                ui=not serve.disable_ui)

