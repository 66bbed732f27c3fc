"""Engine: the public Python API, shaped like sglang.Engine.

`Engine(...)` starts a core process and talks to it through an in-process TokenizerWorker that
runs on a private loop thread, so the API works from plain scripts, from threads without a loop
and from inside a running asyncio loop. `Engine.attach_tokenizer_worker(pid)` builds an Engine in
another process that owns only a frontend attached to that engine's core.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from unison import registry
from unison.config import EngineConfig
from unison.core_process import CoreProcess
from unison.errors import EngineDeadError
from unison.frontend.worker import ReqState, TokenizerWorker
from unison.output import Collector
from unison.sampling_params import SamplingParams

ATTACH_TIMEOUT = 5.0


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


class _LoopWaker:
    """Wakes the streams awaited on one caller loop: one cross-thread call per burst of tokens,
    not one per stream (64 streams would otherwise cost 64 self-pipe writes per step)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list[asyncio.Event] = []

    def wake(self, event: asyncio.Event) -> None:
        with self.lock:
            self.pending.append(event)
            if len(self.pending) > 1:
                return  # a flush is scheduled already
        self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self.lock:
            events, self.pending = self.pending, []
        for event in events:
            event.set()


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


def _abort(h: _Handle, collector: Collector) -> None:
    for rid in collector.unfinished_rids():
        if not h.closed and h.loop.thread.is_alive():
            h.loop.submit(h.worker.abort(rid))


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
        self._wakers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._finalizer = weakref.finalize(self, _Handle.close, self._h)
        try:
            self._start_owner()
        except BaseException:
            self._h.close()
            raise

    def _start_owner(self) -> None:
        from unison.model.loader import resolve_model_dir  # converts a GGUF once, into the cache

        cfg = self.config
        self.model_dir = str(resolve_model_dir(cfg.model_path))
        core = self._h.core = CoreProcess(cfg, self.model_dir, publish=cfg.tokenizer_worker_num > 1)
        self._connect(core.endpoint, core.token, core.pid, cfg.startup_timeout, core.startup_problem)

    def _connect(self, endpoint: str, token: str, core_pid: int, timeout: float, alive) -> None:
        h = self._h
        h.loop = _LoopThread()
        h.worker = TokenizerWorker(self.model_dir, endpoint, token, core_pid)
        h.loop.run(h.worker.start(timeout, alive))

    @classmethod
    def attach_tokenizer_worker(cls, parent_pid: int | None = None, *,
                                registry_file: str | None = None) -> Engine:
        """Attach a frontend to the engine owned by `parent_pid` (default: this process's parent).

        The returned Engine runs generate() here while prefill and decode stay on that engine's
        core; shutdown() detaches only this frontend.
        """
        pid = os.getppid() if parent_pid is None else parent_pid
        path = Path(registry_file) if registry_file else registry.registry_path(pid)
        info = registry.read_for_attach(path, pid)
        self = cls.__new__(cls)
        self.config = EngineConfig(**info.config)
        self.model_dir = info.model_dir
        self._h = _Handle()
        self._wakers = weakref.WeakKeyDictionary()
        self._finalizer = weakref.finalize(self, _Handle.close, self._h)
        try:
            self._connect(info.endpoint, info.token, info.core_pid, ATTACH_TIMEOUT, lambda: None)
        except BaseException:
            self._h.close()
            raise
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
        batch, states = self._submit(prompt, sampling_params, input_ids, return_logprob,
                                     logprob_start_len, top_logprobs_num, rid, priority)
        collector = Collector(states, batch)
        if stream:
            return _Stream(self._stream_sync(collector), self._aborter(collector))
        for _ in self._stream_sync(collector):
            pass
        return collector.results()

    async def async_generate(self, prompt: str | list[str] | None = None,
                             sampling_params: dict | list[dict] | SamplingParams | None = None,
                             input_ids: list[int] | list[list[int]] | None = None, stream: bool = False,
                             return_logprob: bool = False, logprob_start_len: int = -1,
                             top_logprobs_num: int = 0, rid: str | list[str] | None = None,
                             priority: int = 0) -> dict | list[dict] | AsyncIterator[dict]:
        """As generate(); with stream=True it returns an async iterator (`async for x in await ...`)."""
        batch, states = await asyncio.to_thread(
            self._submit, prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
            top_logprobs_num, rid, priority)
        collector = Collector(states, batch)
        if stream:
            return _AsyncStream(self._stream_async(collector), self._aborter(collector))
        async for _ in self._stream_async(collector):
            pass
        return collector.results()

    def _submit(self, prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                top_logprobs_num, rid, priority) -> tuple[bool, list[ReqState]]:
        worker = self._worker()
        batch, prompts, id_lists = _normalize_prompts(prompt, input_ids)
        params = _per_prompt(sampling_params, len(prompts) or len(id_lists), "sampling_params")
        params = [SamplingParams.from_any(p) for p in params]
        rids = _per_prompt(rid, len(params), "rid")
        if not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= 20:
            raise ValueError(f"top_logprobs_num must be an integer in [0, 20], got {top_logprobs_num!r}")
        if not isinstance(logprob_start_len, int) or logprob_start_len < -1:
            raise ValueError(f"logprob_start_len must be -1 (none) or >= 0, got {logprob_start_len!r}")
        ids = [worker.prepare(p, i, sp) for p, i, sp in
               zip(prompts or [None] * len(id_lists), id_lists or [None] * len(prompts), params)]
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        states = self._h.loop.run(worker.submit(ids, params, rids, return_logprob, logprob_start_len,
                                                top_logprobs_num, priority))
        return batch, states

    def _stream_sync(self, collector: Collector) -> Iterator[dict]:
        wake = threading.Event()
        collector.set_waker(wake.set)
        try:
            while True:
                yield from collector.drain()
                if collector.done:
                    return
                while not wake.wait(0.1):  # short waits keep Ctrl-C deliverable
                    pass
                wake.clear()
        finally:
            self._abort_unfinished(collector)

    async def _stream_async(self, collector: Collector) -> AsyncIterator[dict]:
        loop, wake = asyncio.get_running_loop(), asyncio.Event()
        waker = self._wakers.get(loop)
        if waker is None:
            waker = self._wakers[loop] = _LoopWaker(loop)
        collector.set_waker(functools.partial(waker.wake, wake))
        try:
            while True:
                for chunk in collector.drain():
                    yield chunk
                if collector.done:
                    return
                await wake.wait()
                wake.clear()
        finally:
            self._abort_unfinished(collector)

    def _abort_unfinished(self, collector: Collector) -> None:
        _abort(self._h, collector)

    def _aborter(self, collector: Collector) -> Callable[[], None]:
        return functools.partial(_abort, self._h, collector)

    def abort_request(self, rid: str) -> None:
        """Abort one of this frontend's requests (a request of another frontend is never touched)."""
        self._h.loop.run(self._worker().abort(rid), timeout=5)

    # ---- engine-wide controls, acted on in the core ------------------------------------------

    def _control(self, op: str) -> Any:
        return self._h.loop.run(self._worker().control(op))

    def get_server_info(self) -> dict[str, Any]:
        info = self._control("server_info")
        info["worker_id"] = self._h.worker.worker_id
        info["model_path"] = self.config.model_path
        info["model_dir"] = self.model_dir
        return info

    def flush_cache(self) -> bool:
        return self._control("flush_cache")

    def pause_generation(self) -> None:
        self._control("pause")

    def continue_generation(self) -> None:
        self._control("continue")

    def check_integrity(self) -> None:
        """Raise if the core's KV block pool has a leaked or double-owned block."""
        self._control("check_integrity")

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


def _normalize_prompts(prompt, input_ids) -> tuple[bool, list[str], list[list[int]]]:
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of prompt and input_ids")
    if prompt is not None:
        if isinstance(prompt, str):
            return False, [prompt], []
        if isinstance(prompt, list) and prompt:
            return True, prompt, []
        raise ValueError("prompt must be a string or a non-empty list of strings")
    if isinstance(input_ids, list) and input_ids and all(isinstance(x, list) for x in input_ids):
        return True, [], input_ids
    if isinstance(input_ids, list):
        return False, [], [input_ids]
    raise ValueError("input_ids must be a list of token ids or a list of such lists")


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):  # one entry per prompt
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None

