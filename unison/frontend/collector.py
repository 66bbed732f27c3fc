"""Collector: follows one call's requests for its consumer, wherever that consumer runs.

The frontend's loop updates ReqStates in place and calls each consumer's waker once per pass
over the core's messages (one step, or several when they queued up). A consumer wakes, takes
everything that changed since it last looked (merged: a consumer that fell behind by ten steps
gets one item, not ten) and goes back to waiting. One follow loop
serves the three consumers: `follow()` on any asyncio loop (the async Engine, the HTTP routes on
the frontend's own loop), `follow_sync()` in a plain thread (the sync Engine).
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

from unison.frontend.request import ReqState, finish_reason_dict
from unison.frontend.text.detokenizer import TokenIds
from unison.json_types import JSONObject


class Signal:
    """asyncio.Event for one waiter on one loop, at a fraction of its cost per wake-up (a stream's
    consumer waits on one once per token): set() must be called on the waiter's loop."""

    __slots__ = ("loop", "flag", "fut")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.flag = False
        self.fut: asyncio.Future | None = None

    def set(self) -> None:
        self.flag = True
        fut = self.fut
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def wait(self) -> None:
        """Until set() was called (returns at once if it was since the last wait)."""
        if not self.flag:
            self.fut = self.loop.create_future()
            try:
                await self.fut
            finally:
                self.fut = None
        self.flag = False


class _LoopWaker:
    """Wakes the collectors awaited on one foreign loop: one cross-thread call per step, not
    one per stream (64 streams would otherwise cost 64 self-pipe writes per step)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop_ref = weakref.ref(loop)  # weak: this is the value of a weak map keyed by the loop
        self.lock = threading.Lock()
        self.pending: list[Signal] = []

    def wake(self, event: Signal) -> None:
        with self.lock:
            self.pending.append(event)
            if len(self.pending) > 1:
                return  # a flush is scheduled already
        loop = self.loop_ref()
        if loop is None:
            raise RuntimeError("the consumer's event loop is gone")
        loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self.lock:
            events, self.pending = self.pending, []
        for event in events:
            event.set()


_loop_wakers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWaker] = weakref.WeakKeyDictionary()


def _waker_for(event: Signal, loop: asyncio.AbstractEventLoop,
               home: asyncio.AbstractEventLoop | None) -> Callable[[], None]:
    if loop is home:  # the frontend's own loop (an HTTP route): set it directly
        return event.set
    waker = _loop_wakers.get(loop)
    if waker is None:
        waker = _loop_wakers[loop] = _LoopWaker(loop)
    return lambda: waker.wake(event)


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The asyncio loop running in this thread, if any (a consumer may be on none)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class Collector:
    """The requests of one call (prompts x n), in order, and what each consumer has seen."""

    def __init__(self, states: list[ReqState], batch: bool, home: asyncio.AbstractEventLoop | None,
                 abort: Callable[[list[str]], None], incremental: bool = False) -> None:
        self.states = states
        self.batch = batch or len(states) > 1
        self.seen = [0] * len(states)  # the version of each state last handed out
        self.home = home  # the frontend's loop
        self._abort = abort  # called with the rids left unfinished when following stops
        # SGLang's stream_output: stream items carry only the text and ids new since the last
        # item of their request (these cursors), not everything so far.
        self.incremental = incremental
        self.shown = [(0, 0)] * len(states)  # (chars, ids) handed out per request

    # ---- following -------------------------------------------------------------------------

    def changed(self) -> list[int]:
        """Indices of the requests that changed since the last call (raises a request's error)."""
        out = []
        for i, state in enumerate(self.states):
            if state.version != self.seen[i]:
                self.seen[i] = state.version
                if state.error is not None:
                    raise state.error
                out.append(i)
        return out

    @property
    def done(self) -> bool:
        for s in self.states:  # (a loop, not all(): asked twice per token, mostly of one state)
            if not s.finished:
                return False
        return True

    def unfinished_rids(self) -> list[str]:
        return [s.rid for s in self.states if not s.finished]

    async def admitted(self) -> None:
        """On the frontend's loop: wait until the core has queued every request, or raise why
        it refused one (EngineOverloadedError: its queue is full). Immediate without a limit."""
        pending = [s.admission for s in self.states if s.admission is not None]
        if pending:
            await asyncio.gather(*pending)
        for state in self.states:
            if state.error is not None:
                self.close()  # the others of this call, queued, would run for nobody
                raise state.error

    def close(self) -> None:
        """Stop following: abort what has not finished (a consumer that left wants no more)."""
        rids = self.unfinished_rids()
        if rids:
            self._abort(rids)

    def _set_waker(self, waker: Callable[[], None]) -> None:
        for state in self.states:
            state.waker = waker

    def signal(self) -> Signal:
        """A Signal on the running loop that the requests' updates set."""
        loop = asyncio.get_running_loop()
        signal = Signal(loop)
        self._set_waker(_waker_for(signal, loop, self.home))
        return signal

    async def follow(self) -> AsyncIterator[list[int]]:
        """Yield the indices changed since the last item, until every request has finished."""
        signal = self.signal()
        try:
            while True:
                done = self.done  # before changed(): then that sees the final version
                changed = self.changed()
                if changed:
                    yield changed
                if done:
                    return
                await signal.wait()
        finally:
            self.close()

    def stream(self) -> AsyncOutputs:
        """The output dicts, as an async iterator (what Engine.async_generate streams)."""
        return AsyncOutputs(self)

    def follow_sync(self) -> Iterator[list[int]]:
        event = threading.Event()
        self._set_waker(event.set)
        try:
            while True:
                done = self.done
                changed = self.changed()
                if changed:
                    yield changed
                if done:
                    return
                while not event.wait(0.1):  # short waits keep Ctrl-C deliverable
                    pass
                event.clear()
        finally:
            self.close()

    # ---- sglang.Engine-shaped output dicts ---------------------------------------------------

    def output(self, i: int, indexed: bool = False, delta: bool = False) -> JSONObject:
        """Request i so far: cumulative text and ids, as sglang.Engine streams them (`delta`:
        only what is new since the last delta). No text without a tokenizer, as SGLang's."""
        s = self.states[i]
        ids = s.output_ids
        meta = {
            "id": s.rid,
            "prompt_tokens": len(s.prompt_ids),
            "completion_tokens": len(ids),
            "cached_tokens": s.cached_tokens,
            # (the call skipped for a running request: this dict is built once per token)
            "finish_reason": None if s.finish_reason is None else finish_reason_dict(s.finish_reason),
            "e2e_latency": time.monotonic() - s.created,
        }
        if s.return_logprob:
            meta["output_token_logprobs"] = list(s.logprobs)
            meta["output_top_logprobs"] = list(s.top_logprobs)
            meta["input_token_logprobs"] = list(s.prompt_logprobs)
            meta["input_top_logprobs"] = list(s.prompt_top_logprobs)
            if s.token_ids_logprob:
                meta["output_token_ids_logprobs"] = list(s.ids_logprobs)
                meta["input_token_ids_logprobs"] = list(s.prompt_ids_logprobs)
        text = s.text
        if delta:
            chars, n = self.shown[i]
            self.shown[i] = (len(text), len(ids))
            text, ids = text[chars:], ids[n:]
        out: JSONObject = {"text": text, "output_ids": list(ids), "meta_info": meta}  # JSON for the caller
        if isinstance(s.detok, TokenIds):
            del out["text"]
        if indexed:
            out["index"] = i
        return out

    def outputs(self, changed: list[int]) -> list[JSONObject]:
        """The stream items for `changed`: an `index` says which request when there are several."""
        return [self.output(i, self.batch, self.incremental) for i in changed]

    def results(self) -> JSONObject | list[JSONObject]:
        dicts = [self.output(i) for i in range(len(self.states))]
        return dicts if self.batch else dicts[0]


class AsyncOutputs:
    """The async stream of a call's output dicts: follow() and output() in one coroutine per
    item, not a chain of async generators (a stream's consumer pays it once per token). Closing
    it, cancelling the task that awaits it, an error, or dropping it aborts what is unfinished."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector
        self.items: deque[JSONObject] = deque()
        self.ended = False
        self._signal: Signal | None = None  # made on the consumer's loop, at its first item
        self._finalizer = weakref.finalize(self, collector.close)

    def __aiter__(self) -> AsyncOutputs:
        return self

    async def __anext__(self) -> JSONObject:
        items, c = self.items, self.collector
        while not items:
            if self.ended:
                raise StopAsyncIteration
            if self._signal is None:
                self._signal = c.signal()
            try:
                done = c.done  # before changed(): then that sees the final version
                changed = c.changed()
                if changed:
                    items.extend(c.outputs(changed))
                if done:
                    self.ended = True
                elif not changed:
                    await self._signal.wait()
            except BaseException:  # an error, or the awaiting task was cancelled
                self.ended = True
                self._finalizer()
                raise
        return items.popleft()

    async def aclose(self) -> None:
        self.ended = True
        self.items.clear()
        self._finalizer()
