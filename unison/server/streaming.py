"""What every route shares: the app's frontend, and answering with a stream or a body."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse

from unison.errors import EngineDeadError, EngineOverloadedError
from unison.frontend.collector import Collector
from unison.frontend.request import GenerateRequest
from unison.frontend.worker import TokenizerWorker
from unison.json_types import JSONObject
from unison.server.errors import HTTPError, error_body

DISCONNECT_POLL_S = 0.5

_encode = msgspec.json.Encoder().encode


def sse(obj: object) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def named_event(event: JSONObject) -> bytes:
    """An event named by its `type`, as the Responses and Anthropic APIs send them (an error body
    of OpenAI's shape has none: "error")."""
    return b"event: " + str(event.get("type", "error")).encode() + b"\ndata: " + _encode(event) + b"\n\n"


def stream_error(e: Exception, path: str = "") -> JSONObject:
    """A failure after the 200 status line went out is reported in the stream, as vLLM does, in
    the error shape of the route at `path`."""
    if isinstance(e, EngineDeadError):
        return error_body(503, f"the engine is not running: {e}", "service_unavailable", path=path)
    if isinstance(e, EngineOverloadedError):  # its queue is full, or this frontend stalled
        return error_body(503, str(e), "service_unavailable", path=path)
    if isinstance(e, ValueError):
        return error_body(400, str(e), path=path)
    return error_body(500, f"{type(e).__name__}: {e}", "server_error", path=path)


class Timer:
    """When a request started and when its first output came: the timings Ollama's and
    llama-server's answers carry. `seen` is a wake-up's callback (stream's items, wait's seen)."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector
        self.start = time.monotonic()
        self.first: float | None = None

    def seen(self, changed: list[int]) -> None:
        if self.first is None and self.collector.states[0].output_ids:
            self.first = time.monotonic()

    def split(self) -> tuple[float, float]:
        """Seconds to the first output (the prompt's), and from it to now (the output's)."""
        end = time.monotonic()
        first = self.first or end
        return first - self.start, end - first


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
           tail: Callable[[], Iterable[object]] = tuple, encode: Callable[[Any], bytes] = sse,
           done: bool = True, path: str = "", media_type: str = "text/event-stream") -> StreamingResponse:
    """Server-sent events: `items(changed)` per wake-up, then `tail()`, then [DONE] (unless not
    `done`: the Responses and Anthropic APIs end with events of their own). `encode` writes each
    item, and an error in the shape of the route at `path` (Ollama's streams are JSON lines). A
    client that goes away closes the generator, and following's end aborts what is unfinished."""
    async def events() -> AsyncIterator[bytes]:
        try:
            async for changed in collector.follow():
                data = b"".join(map(encode, items(changed)))  # one write per wake-up, not per event
                if data:
                    yield data
            for item in tail():
                yield encode(item)
        except Exception as e:  # after the 200: said in the stream, which still ends with [DONE]
            yield encode(stream_error(e, path))
        if done:
            yield b"data: [DONE]\n\n"
    return StreamingResponse(events(), media_type=media_type)


async def wait(request: Request, collector: Collector,
               seen: Callable[[list[int]], None] | None = None) -> None:
    """Wait for a non-streaming request, aborting it if the client disconnects meanwhile;
    `seen(changed)` is told of each wake-up (Ollama's answers time the first token)."""
    async def drain() -> None:
        async for changed in collector.follow():
            if seen is not None:
                seen(changed)

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
