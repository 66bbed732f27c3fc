"""Engine: the public Python API, shaped like sglang.Engine.

`Engine(...)` starts a core process and talks to it through an in-process TokenizerWorker that
runs on a private loop thread, so the API works from plain scripts, from threads without a loop
and from inside a running asyncio loop. `Engine.attach_tokenizer_worker(pid)` builds an Engine in
another process that owns only a frontend attached to that engine's core.
"""

from __future__ import annotations

import asyncio
import os
import threading
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from unison import registry
from unison.config import EngineConfig
from unison.core_process import CoreProcess
from unison.errors import EngineDeadError
from unison.frontend.collector import Collector
from unison.frontend.sampling_params import SamplingParams
from unison.frontend.worker import TokenizerWorker
from unison.protocol import ControlOp


class _LoopThread:
    """An asyncio loop in a daemon thread: the frontend's home behind the sync API."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="unison-frontend", daemon=True)
        self.thread.start()

    def submit(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout: float | None = None) -> Any:
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()


class _Stream:
    """A sync stream of output dicts. Closing it, or dropping it, aborts what is unfinished, even
    before the first item was read (a bare generator would not run its cleanup then)."""

    def __init__(self, gen: Iterator[dict], abort: Callable[[], None]) -> None:
        self._gen = gen
        self._finalizer = weakref.finalize(self, abort)

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> dict:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()
        self._finalizer()


class _AsyncStream:
    """The async counterpart of _Stream."""

    def __init__(self, gen: AsyncIterator[dict], abort: Callable[[], None]) -> None:
        self._gen = gen
        self._finalizer = weakref.finalize(self, abort)

    def __aiter__(self) -> _AsyncStream:
        return self

    async def __anext__(self) -> dict:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        await self._gen.aclose()
        self._finalizer()


class _Handle:
    """What an Engine owns; closed once, by shutdown(), the garbage collector, or exit."""

    def __init__(self) -> None:
        self.loop: _LoopThread | None = None
        self.worker: TokenizerWorker | None = None
        self.core: CoreProcess | None = None  # when this process owns the engine
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.worker is not None and self.loop is not None and self.loop.thread.is_alive():
            try:
                self.loop.run(self.worker.close(goodbye=True), timeout=2)
            except Exception:  # the loop is wedged or gone: nothing left to say goodbye with
                pass
        if self.core is not None:
            self.core.stop()
        if self.loop is not None:
            self.loop.stop()


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model_path=model_path, **kwargs)
        self._h = _Handle()
        self._finalizer = weakref.finalize(self, _Handle.close, self._h)
        try:
            cfg = self.config
            core = self._h.core = CoreProcess(cfg, publish=cfg.tokenizer_worker_num > 1)
            worker = TokenizerWorker(core.endpoint, core.token, core.pid)
            self._start(worker.start(cfg.startup_timeout, core.startup_problem))
        except BaseException:
            self._h.close()
            raise

    def _start(self, attaching: Coroutine[Any, Any, TokenizerWorker]) -> None:
        """Run the frontend's start (or attach) on a fresh loop thread: its home from now on."""
        h = self._h
        h.loop = _LoopThread()
        h.worker = h.loop.run(attaching)
        self.model_dir = h.worker.info.model_dir

    @classmethod
    def attach_tokenizer_worker(cls, parent_pid: int | None = None, *,
                                registry_file: str | None = None) -> Engine:
        """Attach a frontend to the engine owned by `parent_pid` (default: this process's parent).

        The returned Engine runs generate() here while prefill and decode stay on that engine's
        core; shutdown() detaches only this frontend.
        """
        pid = os.getppid() if parent_pid is None else parent_pid
        path = Path(registry_file) if registry_file else registry.registry_path(pid)
        self = cls.__new__(cls)
        self._h = _Handle()
        self._finalizer = weakref.finalize(self, _Handle.close, self._h)
        try:
            self._start(TokenizerWorker.attach(path, pid))
        except BaseException:
            self._h.close()
            raise
        self.config = self._h.worker.config
        return self

    # ---- generation --------------------------------------------------------------------------

    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict | list[dict] | SamplingParams | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, stream: bool = False,
                 return_logprob: bool = False, logprob_start_len: int = -1, top_logprobs_num: int = 0,
                 rid: str | list[str] | None = None, priority: int = 0) -> dict | list[dict] | Iterator[dict]:
        """Generate for one prompt (a dict) or a list (a flat list of P * n dicts)."""
        if _running_loop() is not None:
            warnings.warn("Engine.generate blocks the running event loop; use async_generate there",
                          RuntimeWarning, stacklevel=2)
        worker = self._worker()
        req = worker.make_request(prompt, sampling_params, input_ids, return_logprob=return_logprob,
                                  logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                                  rid=rid, priority=priority)
        collector = self._h.loop.run(worker.submit(req))
        if stream:
            return _Stream(_items(collector.follow_sync(), collector), collector.close)
        for _ in collector.follow_sync():
            pass
        return collector.results()

    async def async_generate(self, prompt: str | list[str] | None = None,
                             sampling_params: dict | list[dict] | SamplingParams | None = None,
                             input_ids: list[int] | list[list[int]] | None = None, stream: bool = False,
                             return_logprob: bool = False, logprob_start_len: int = -1,
                             top_logprobs_num: int = 0, rid: str | list[str] | None = None,
                             priority: int = 0) -> dict | list[dict] | AsyncIterator[dict]:
        """As generate(); with stream=True it returns an async iterator (`async for x in await ...`)."""
        worker = self._worker()
        # Tokenizing (a long prompt, a JSON schema's grammar) must not stall the caller's loop.
        req = await asyncio.to_thread(
            worker.make_request, prompt, sampling_params, input_ids, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num, rid=rid,
            priority=priority)
        submitted = self._h.loop.submit(worker.submit(req))
        try:
            collector = await asyncio.shield(asyncio.wrap_future(submitted))
        except asyncio.CancelledError:  # the submit finishes on its loop; then abort what it queued
            submitted.add_done_callback(lambda f: f.exception() is None and f.result().close())
            raise
        if stream:
            return _AsyncStream(_aitems(collector.follow(), collector), collector.close)
        async for _ in collector.follow():
            pass
        return collector.results()

    def abort_request(self, rid: str) -> None:
        """Abort one of this frontend's requests (a request of another frontend is never touched)."""
        self._h.loop.run(self._worker().abort(rid), timeout=5)

    # ---- engine-wide controls, acted on in the core ------------------------------------------

    def _control(self, op: ControlOp) -> Any:
        return self._h.loop.run(self._worker().control(op))

    def get_server_info(self) -> dict[str, Any]:
        """The core's engine-wide state as a dict; the model's fields at the top level, as before."""
        info = self._control(ControlOp.SERVER_INFO).to_dict()
        info["worker_id"] = self._h.worker.worker_id
        info["model_path"] = self.config.model_path
        return info

    def flush_cache(self) -> bool:
        return self._control(ControlOp.FLUSH_CACHE)

    def pause_generation(self) -> None:
        self._control(ControlOp.PAUSE)

    def continue_generation(self) -> None:
        self._control(ControlOp.CONTINUE)

    def check_integrity(self) -> None:
        """Raise if the core's KV block pool has a leaked or double-owned block."""
        self._control(ControlOp.CHECK_INTEGRITY)

    # ---- lifecycle ---------------------------------------------------------------------------

    @property
    def tokenizer(self):
        """The frontend's tokenizer (encode, decode, apply_chat_template)."""
        return self._h.worker.tokenizer

    def _worker(self) -> TokenizerWorker:
        if self._h.closed:
            raise EngineDeadError("this Engine was shut down")
        self._h.worker.check_alive()
        return self._h.worker

    def shutdown(self) -> None:
        """Owner: stop the core and clean up. Attached: detach this frontend only."""
        self._finalizer()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _items(follow: Iterator[list[int]], collector: Collector) -> Iterator[dict]:
    for changed in follow:
        yield from collector.outputs(changed)


async def _aitems(follow: AsyncIterator[list[int]], collector: Collector) -> AsyncIterator[dict]:
    async for changed in follow:
        for item in collector.outputs(changed):
            yield item


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None

