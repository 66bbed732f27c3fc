"""What every route shares: the app's frontend, and answering with a stream or a body."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable

import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse

from unison.errors import EngineDeadError
from unison.frontend.collector import Collector
from unison.frontend.request import GenerateRequest
from unison.frontend.worker import TokenizerWorker
from unison.server.errors import HTTPError, error_body

DISCONNECT_POLL_S = 0.5

_encode = msgspec.json.Encoder().encode


def sse(obj: object) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def stream_error(e: Exception) -> bytes:
    """A failure after the 200 status line went out is reported in the stream, as vLLM does."""
    if isinstance(e, EngineDeadError):
        return sse(error_body(503, f"the engine is not running: {e}", "service_unavailable"))
    if isinstance(e, ValueError):
        return sse(error_body(400, str(e)))
    return sse(error_body(500, f"{type(e).__name__}: {e}", "server_error"))


def worker_of(request: Request) -> TokenizerWorker:
    """A live frontend, for what every replica answers alike (tokenizing, the model's limits)."""
    try:
        return request.app.state.replicas.any
    except EngineDeadError as e:
        raise HTTPError(503, f"the engine is not running: {e}") from None


def route(request: Request, text: str | None, req: GenerateRequest | None = None) -> TokenizerWorker:
    """The frontend of the replica that serves a request whose prompt text is `text` (and, once
    tokenized, `req`: kv routing reads its token ids; nothing is tokenized twice)."""
    first = req.prompts[0] if req is not None and req.prompts else None
    try:
        return request.app.state.replicas.pick(text, first and first.input_ids, first and first.lora_name)
    except EngineDeadError as e:
        raise HTTPError(503, f"the engine is not running: {e}") from None


def stream(collector: Collector, items: Callable[[list[int]], Iterable[object]],
           tail: Callable[[], Iterable[object]] = tuple, encode: Callable[[object], bytes] = sse,
           done: bool = True) -> StreamingResponse:
    """Server-sent events: `items(changed)` per wake-up, then `tail()`, then [DONE] (unless not
    `done`: the Responses API ends with its response.completed event). A client that goes away
    closes the generator, and following's end aborts what is unfinished."""
    async def events() -> AsyncIterator[bytes]:
        try:
            async for changed in collector.follow():
                for item in items(changed):
                    yield encode(item)
            for item in tail():
                yield encode(item)
        except Exception as e:  # after the 200: said in the stream, which still ends with [DONE]
            yield stream_error(e)
        if done:
            yield b"data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


async def wait(request: Request, collector: Collector) -> None:
    """Wait for a non-streaming request, aborting it if the client disconnects meanwhile."""
    async def drain() -> None:
        async for _ in collector.follow():
            pass

    # One task runs the generator to its end; cancelling it runs follow's abort. (Closing the
    # generator from here instead fails: it is still running inside that task.)
    task = asyncio.ensure_future(drain())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise HTTPError(499, "client disconnected")
    finally:
        task.cancel()
