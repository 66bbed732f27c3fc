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
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from unison.api.core_process import CoreProcess
from unison.api.engine_controls import EngineControls, expect
from unison.api.hub import locate_config
from unison.compat import SGLANG_METHODS, SGLANG_NO_EFFECT, SGLANG_UNSUPPORTED
from unison.config import EngineConfig
from unison.errors import EngineDeadError, InvalidParam
from unison.frontend import pooling
from unison.frontend.collector import Collector, running_loop
from unison.frontend.generate_args import (
    FIELDS,
    GenerateArgs,
    InputIds,
    Prompt,
    SamplingArg,
    with_generate_args,
)
from unison.frontend.images import read_paths
from unison.frontend.request import GenerateRequest
from unison.frontend.worker import TokenizerWorker
from unison.json_types import JSONObject
from unison.wire import registry
from unison.wire.messages import (
    ControlRequest,
    GetServerInfo,
    ReplyT,
    ServerInfo,
)

if TYPE_CHECKING:
    pass

T = TypeVar("T")


class _LoopThread:
    """An asyncio loop in a daemon thread: the frontend's home behind the sync API."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="unison-frontend", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[object, object, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[object, object, T], timeout: float | None = None) -> T:
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

    def __init__(self, gen: Generator[dict, None, None], abort: Callable[[], None]) -> None:
        self._gen = gen
        self._finalizer = weakref.finalize(self, abort)

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> dict:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()
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


class Engine(EngineControls):
    def __init__(self, model_path: str | None = None, *, curve_secret_key: str | None = None,
                 **kwargs: Any) -> None:  # Any: EngineConfig's options, checked by from_kwargs
        """Start an engine core and attach this process's frontend. `listen="tcp://HOST:PORT"`
        (with `trusted_client_keys`) lets remote frontends attach too; the core's CURVE key is
        `curve_secret_key`, or a fresh one (its public half: `server_key`)."""
        config = EngineConfig.from_kwargs(model_path=model_path, **kwargs)
        # A Hugging Face id becomes a local path here, once, before the core starts.
        self.config = locate_config(config, quiet=config.log_level in ("error", "critical"))
        self._h = _Handle()
        self._finalizer = weakref.finalize(self, _Handle.close, self._h)
        try:
            cfg = self.config
            publish = cfg.tokenizer_worker_num > 1
            core = self._h.core = CoreProcess(cfg, publish, curve_secret_key)
            worker = TokenizerWorker(core.endpoint, core.token, core.pid)
            self._start(worker.start(cfg.startup_timeout, core.startup_problem))
        except BaseException:
            self._h.close()
            raise

    def _start(self, attaching: Coroutine[object, object, TokenizerWorker]) -> None:
        """Run the frontend's start (or attach) on a fresh loop thread: its home from now on."""
        h = self._h
        h.loop = _LoopThread()
        h.worker = h.loop.run(attaching)
        self.model_dir = h.worker.info.model_dir

    @property
    def tcp_address(self) -> str | None:
        """Where remote frontends attach (with `listen`), as the core bound it."""
        return self._frontend.info.tcp_address

    @property
    def server_key(self) -> str | None:
        """The core's CURVE public key, which remote frontends need (with `listen`)."""
        return self._frontend.info.server_key

    @classmethod
    def attach_tokenizer_worker(cls, parent_pid: int | None = None, *,
                                registry_file: str | os.PathLike | None = None,
                                address: str | None = None, server_key: str | None = None,
                                client_key: str | None = None, heartbeat_timeout_s: float = 3.0) -> Engine:
        """Attach a frontend to the engine owned by `parent_pid` (default: this process's parent),
        or, with `address`, to the core listening there over TCP, from any host (`server_key`:
        its public key; `client_key`: this frontend's CURVE secret key, whose public key the
        engine trusts; a core silent for `heartbeat_timeout_s` is dead).

        The returned Engine runs generate() here while prefill and decode stay on that engine's
        core; shutdown() detaches only this frontend.
        """
        expect("parent_pid", parent_pid, int, "a process id", optional=True)
        expect("registry_file", registry_file, (str, os.PathLike), "a path", optional=True)
        for name, value in {"address": address, "server_key": server_key, "client_key": client_key}.items():
            expect(name, value, str, "a string", optional=True)
        expect("heartbeat_timeout_s", heartbeat_timeout_s, (int, float), "a number of seconds")
        if heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s!r}")
        if address is not None:
            if not server_key or not client_key:
                raise ValueError("attaching by address needs server_key (the core's public key) and "
                                 "client_key (this frontend's secret key)")
            attaching = TokenizerWorker.connect(address, server_key, client_key, heartbeat_timeout_s)
        else:
            pid = os.getppid() if parent_pid is None else parent_pid
            path = Path(registry_file) if registry_file else registry.registry_path(pid)
            attaching = TokenizerWorker.attach(path, pid)
        self = cls.__new__(cls)
        self._h = _Handle()
        self._finalizer = weakref.finalize(self, _Handle.close, self._h)
        try:
            self._start(attaching)
        except BaseException:
            self._h.close()
            raise
        self.config = self._frontend.config
        return self

    # ---- generation --------------------------------------------------------------------------
    # The signatures are sglang.Engine's (SGLang commit 001067ff): its first four parameters
    # positionally, in its order; the rest keyword-only, None meaning the default. Its arguments
    # for features Unison lacks are accepted at their defaults and refused by name otherwise.

    @with_generate_args
    def generate(self, prompt: Prompt = None, sampling_params: SamplingArg = None, input_ids: InputIds = None,
                 image_data: object = None, *, stream: bool = False,
                 **kwargs: Any) -> dict | list[dict] | Iterator[dict]:  # Any: GenerateArgs' fields
        """Generate for one prompt (a dict) or a list (a flat list of P * n dicts). The keywords are
        GenerateArgs' fields (frontend/generate_args.py) and SGLang's that Unison accepts unset."""
        if running_loop() is not None:
            warnings.warn("Engine.generate blocks the running event loop; use async_generate there",
                          RuntimeWarning, stacklevel=2)
        args = _generate_args(prompt, sampling_params, input_ids, image_data, stream, kwargs)
        worker = self._worker()
        if args.image_data is not None:  # (a hop to the frontend's loop: only where there are images)
            self._loop.run(worker.fetch_image_urls(args))
        collector = self._loop.run(worker.submit(worker.make_request(args)))
        if stream:
            return _Stream(_items(collector.follow_sync(), collector), collector.close)
        for _ in collector.follow_sync():
            pass
        return collector.results()

    @with_generate_args
    async def async_generate(self, prompt: Prompt = None, sampling_params: SamplingArg = None,
                             input_ids: InputIds = None, image_data: object = None, *, stream: bool = False,
                             **kwargs: Any) -> dict | list[dict] | AsyncIterator[dict]:  # as generate
        """As generate(); with stream=True it returns an async iterator (`async for x in await ...`)."""
        args = _generate_args(prompt, sampling_params, input_ids, image_data, stream, kwargs)
        worker = self._worker()
        await worker.fetch_image_urls(args)
        # Tokenizing (a long prompt, a JSON schema's grammar) must not stall the caller's loop.
        req = await asyncio.to_thread(worker.make_request, args)
        submitted = self._loop.submit(worker.submit(req))
        try:
            collector = await asyncio.shield(asyncio.wrap_future(submitted))
        except asyncio.CancelledError:  # the submit finishes on its loop; then abort what it queued
            submitted.add_done_callback(_close_if_submitted)
            raise
        if stream:
            return collector.stream()
        async for _ in collector.follow():
            pass
        return collector.results()

    # ---- pooling: embeddings, rerank and score (frontend/pooling.py) -------------------------

    def encode(self, prompt: str | list[str] | list[int] | list[list[int]], *, dimensions: int | None = None,
               truncate_prompt_tokens: int | None = None) -> dict | list[dict]:
        """SGLang's Engine.encode: an embedding model's vector for a text, token ids, or a list of
        either: {"embedding": [...], "meta_info": {"prompt_tokens": n}} (a list for a list)."""
        return self._loop.run(self.async_encode(prompt, dimensions=dimensions,
                                                truncate_prompt_tokens=truncate_prompt_tokens))

    async def async_encode(self, prompt: str | list[str] | list[int] | list[list[int]], *,
                           dimensions: int | None = None,
                           truncate_prompt_tokens: int | None = None) -> dict | list[dict]:
        worker = self._worker()
        pooling.check_dimensions(worker.info, dimensions)
        req = await asyncio.to_thread(pooling.embed_request, worker.info, worker.tokenizer, prompt, "prompt",
                                      truncate_prompt_tokens)
        results = [pooling.encode_output(p) for p in await self._pool(worker, req)]
        return results if req.batch else results[0]

    def rerank(self, query: str, documents: list[str], *, top_n: int | None = None,
               return_documents: bool = False) -> list[dict]:
        """A cross-encoder's relevance of each document to `query`, best first (Cohere's and
        Jina's shape): [{"index", "relevance_score", "document"?}], the top `top_n` of them."""
        pooling.check_rerank(top_n, return_documents)
        worker = self._worker()
        req = pooling.pair_request(worker.info, worker.tokenizer, query, documents)
        pairs = self._loop.run(self._pool(worker, req))
        return pooling.ranked(documents, [p.vector[0] for p in pairs], top_n, return_documents)

    def score(self, text_1: str, text_2: str | list[str]) -> list[float]:
        """vLLM's LLM.score: the cross-encoder's score of `text_1` with each of `text_2`."""
        return self._loop.run(self.async_score(text_1, text_2))

    async def async_score(self, text_1: str, text_2: str | list[str]) -> list[float]:
        worker, docs = self._worker(), [text_2] if isinstance(text_2, str) else text_2
        req = pooling.pair_request(worker.info, worker.tokenizer, text_1, docs, ("text_1", "text_2"))
        return [p.vector[0] for p in await self._pool(worker, req)]

    async def _pool(self, worker: TokenizerWorker, req: GenerateRequest) -> list[pooling.Pooled]:
        """Run a pooling request on the frontend's loop, to its end."""
        async def run() -> list[pooling.Pooled]:
            collector = await worker.submit(req)
            async for _ in collector.follow():
                pass
            return pooling.pooled(collector)

        return await asyncio.wrap_future(self._loop.submit(run()))

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort one of this frontend's requests, or all of them (another frontend's requests
        are never touched here; the HTTP route /abort_request is the engine-wide one)."""
        expect("rid", rid, str, "a request id string")
        expect("abort_all", abort_all, bool, "True or False")
        worker = self._worker()
        rids = list(worker.states) if abort_all else [rid]
        for r in rids:
            self._loop.run(worker.abort(r), timeout=5)

    # ---- engine-wide controls, acted on in the core ------------------------------------------

    def _control(self, req: ControlRequest[ReplyT], timeout: float | None = 30.0) -> ReplyT:
        return self._loop.run(self._worker().control(req, timeout))

    def get_server_info(self) -> JSONObject:
        """The engine's state, every frontend seeing the same: SGLang's keys (its options, then
        status, max_total_num_tokens, max_req_input_len, internal_states, version), and ours."""
        info = self._control(GetServerInfo()).to_dict()
        info["worker_id"] = self._frontend.worker_id
        return info

    def server_info(self) -> ServerInfo:
        """get_server_info()'s state as the typed struct it is made from (protocol.ServerInfo)."""
        return self._control(GetServerInfo())

    def get_model_info(self) -> JSONObject:
        """What is served now (a weight update changes model_path), in SGLang's keys."""
        return self._control(GetServerInfo()).model_info()

    def get_all_child_pids(self) -> list[int]:
        """The processes this Engine started: its core (none when attached)."""
        return [self._h.core.pid] if self._h.core is not None else []

    def __getattr__(self, name: str) -> object:
        # sglang.Engine's other methods: say why there is none, rather than a bare AttributeError.
        if name in SGLANG_METHODS:
            raise AttributeError(f"Engine.{name} (an sglang.Engine method) is not supported by Unison: "
                                 f"{SGLANG_METHODS[name]}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ---- lifecycle ---------------------------------------------------------------------------

    @property
    def tokenizer(self):
        """The frontend's tokenizer (encode, decode, apply_chat_template)."""
        return self._frontend.tokenizer

    def _worker(self) -> TokenizerWorker:
        if self._h.closed:
            raise EngineDeadError("this Engine was shut down")
        self._frontend.check_alive()
        return self._frontend

    @property
    def _frontend(self) -> TokenizerWorker:
        assert self._h.worker is not None  # attached by _start, before anything else runs
        return self._h.worker

    @property
    def _loop(self) -> _LoopThread:
        assert self._h.loop is not None  # the frontend's loop, from _start on
        return self._h.loop

    def shutdown(self) -> None:
        """Owner: stop the core and clean up. Attached: detach this frontend only."""
        self._finalizer()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _items(follow: Iterator[list[int]], collector: Collector) -> Generator[dict, None, None]:
    for changed in follow:
        yield from collector.outputs(changed)


def _generate_args(prompt: Prompt, sampling_params: SamplingArg, input_ids: InputIds, image_data: object,
                   stream: bool, kwargs: dict[str, Any]) -> GenerateArgs:  # Any: as generate's
    """generate()'s arguments as GenerateArgs, SGLang's unserved ones refused by name."""
    expect("stream", stream, bool, "True or False")
    _refuse_unsupported(**{k: v for k, v in kwargs.items() if k not in FIELDS})
    return GenerateArgs(prompt=prompt, sampling_params=sampling_params, input_ids=input_ids,
                        image_data=read_paths(image_data), **{k: v for k, v in kwargs.items() if k in FIELDS})


def _refuse_unsupported(**args: object) -> None:
    for name, value in args.items():
        if name in SGLANG_NO_EFFECT:
            if name.endswith("dp_rank") and value not in (None, 0):
                raise InvalidParam(name, f"{name}={value!r}: this engine has one data-parallel rank (0)")
            continue
        if name not in SGLANG_UNSUPPORTED:
            raise TypeError(f"generate() got an unexpected keyword argument {name!r}")
        if value != SGLANG_UNSUPPORTED[name] and value is not None:
            raise InvalidParam(name, f"{name} is not supported by Unison (no audio or video, no "
                                     "custom logit processors, sessions or disaggregation); "
                                     "leave it unset")


def _close_if_submitted(submitted: Future[Collector]) -> None:
    if submitted.exception() is None:
        submitted.result().close()
