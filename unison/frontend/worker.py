"""TokenizerWorker: one frontend. Attaches to the core, checks and tokenizes requests, follows
their outputs, detokenizes.

It lives on one asyncio loop (a private thread behind the Engine API, or an HTTP worker's own
loop) and imports neither torch nor transformers. The Engine and the HTTP routes are thin
adapters over it: they build one GenerateRequest through `make_request` (errors are
InvalidParam naming the field), `submit` it, and read the Collector it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
import tempfile
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import zmq

from unison import registry
from unison.config import EngineConfig
from unison.errors import EngineDeadError, InvalidParam, check_encodable
from unison.frontend.collector import Collector
from unison.frontend.request import GenerateRequest, PromptRequest, ReqState
from unison.frontend.sampling_params import SamplingParams
from unison.frontend.tokenizer import Tokenizer
from unison.protocol import (
    Abort,
    Ack,
    Control,
    ControlReply,
    ControlRequest,
    CoreInfo,
    Generate,
    Goodbye,
    Heartbeat,
    Hello,
    Reject,
    ReplyT,
    ReqOutput,
    StepOutputs,
    Welcome,
    decode_to_frontend,
    encode,
)
from unison.registry import pid_alive

ATTACH_TIMEOUT = 5.0  # an attaching frontend talks to a core that is up already
MAX_TOP_LOGPROBS = 20
MAX_TOKEN_IDS_LOGPROB = 256  # logprobs of given ids, per position
MAX_MESSAGES_PER_WAKE = 64  # messages taken in one pass when they queue up
RETRY_SEND_S = 0.001  # while the pipe to the core is full

log = logging.getLogger("unison.frontend")

GOODBYE_LINGER_MS = 200
HANDSHAKE_EVENTS_NAMES = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
                          zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed: protocol",
                          zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake failed: key not trusted"}
# The connection's events, watched over TCP: a refused handshake while attaching, and after it a
# lost connection (a dead core's host resets it at once, well before a heartbeat would be missed).
HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | sum(HANDSHAKE_EVENTS_NAMES)


class TokenizerWorker:
    def __init__(self, endpoint: str, token: str, core_pid: int,
                 curve: tuple[str, str] | None = None) -> None:
        """`curve`: (the core's public key, this frontend's secret key) to attach over TCP."""
        self.endpoint = endpoint
        self.curve = curve
        self.token = token
        self.core_pid = core_pid
        self.tokenizer: Tokenizer | None = None  # loaded from the directory Welcome names
        self.info: CoreInfo | None = None
        self.config: EngineConfig | None = None  # the engine's, from Welcome
        self.rng = random.Random()  # draws unseeded requests' sampling seeds (see random_seed)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.worker_id = -1
        self.states: dict[str, ReqState] = {}
        self.dead: EngineDeadError | None = None
        self._controls: dict[int, asyncio.Future] = {}
        self._cids = itertools.count()
        self._sock: zmq.Socket | None = None
        self._outbox: deque[bytes] = deque()  # encoded, waiting for room in the pipe to the core
        self._retry: asyncio.TimerHandle | None = None
        self._read_scheduled = False
        self._pidfd: int | None = None
        self._monitor: zmq.Socket | None = None  # CURVE handshake events, while attaching
        self.heartbeat_timeout_s = 3.0  # over TCP: a core silent this long is dead
        self._beat: asyncio.TimerHandle | None = None
        self.on_dead: Callable[[], None] | None = None  # e.g. an HTTP worker stops serving

    # ---- lifecycle ---------------------------------------------------------------------------

    @classmethod
    async def attach(cls, registry_path: str | Path, owner_pid: int) -> TokenizerWorker:
        """A frontend for the running engine that `registry_path` describes (owned by `owner_pid`)."""
        info = registry.read_for_attach(registry_path, owner_pid)
        worker = cls(info.endpoint, info.token, info.core_pid)
        return await worker.start(ATTACH_TIMEOUT)

    @classmethod
    async def connect(cls, address: str, server_key: str, client_key: str,
                      heartbeat_timeout_s: float = 3.0, timeout: float = ATTACH_TIMEOUT) -> TokenizerWorker:
        """A frontend for the engine core listening at `address` (tcp://, maybe on another host):
        `server_key` is the core's CURVE public key, `client_key` this frontend's secret key
        (its public key must be one the engine trusts). The tokenizer comes over the connection.
        A core silent for `heartbeat_timeout_s` (or whose connection drops) is dead."""
        if not address.startswith("tcp://"):
            raise ValueError(f"address must be tcp://HOST:PORT, got {address!r}")
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE support, which attaching over TCP needs")
        if not heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s}")
        worker = cls(address, "", 0, curve=(server_key, client_key))
        worker.heartbeat_timeout_s = heartbeat_timeout_s
        return await worker.start(timeout)

    async def start(self, timeout: float,
                    alive: Callable[[], str | None] = lambda: None) -> TokenizerWorker:
        """Connect and say Hello; `alive` returns why the engine cannot answer, or None."""
        self.loop = asyncio.get_running_loop()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            server_key, secret = (k.encode() for k in self.curve)
            self._sock.curve_serverkey = server_key
            self._sock.curve_secretkey = secret
            self._sock.curve_publickey = zmq.curve_public(secret)
            # A refused key shows only as a handshake event: watched until Welcome comes.
            self._monitor = self._sock.get_monitor_socket(HANDSHAKE_EVENTS)
            # The core's liveness: ZMTP heartbeats, answered by libzmq's I/O thread, so a long
            # step or a weight load is not silence; a stopped or unreachable core is, and its
            # connection is closed after the timeout (then EVENT_DISCONNECTED: _on_monitor).
            ms = int(self.heartbeat_timeout_s * 1000)
            self._sock.setsockopt(zmq.HEARTBEAT_IVL, max(ms // 3, 1))
            self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ms)
            self._sock.setsockopt(zmq.HEARTBEAT_TTL, ms)
        self._sock.connect(self.endpoint)
        # A plain socket read from the loop's own reader: every message is taken as it comes,
        # without a future or a task per message. ZMQ's FD is edge-triggered, so every send and
        # receive is followed by a look at what is pending (_check_pending).
        self._fd = self._sock.getsockopt(zmq.FD)
        self.loop.add_reader(self._fd, self._on_readable)
        self._welcome = self.loop.create_future()
        self._send(Hello(pid=os.getpid(), token=self.token, want_files=self.curve is not None))
        reply = await self._await_welcome(timeout, alive)
        if isinstance(reply, Reject):
            self._close_socket()
            raise ConnectionRefusedError(f"the engine refused this frontend: {reply.reason}")
        self.worker_id, self.info, self.config = reply.worker_id, reply.info, reply.config
        self.core_pid = reply.core_pid
        cfg = self.config
        if cfg is not None and cfg.random_seed is not None:
            # Each frontend its own stream, reproducible per frontend.
            self.rng = random.Random(f"{cfg.random_seed}:{reply.worker_id}")
        if not cfg.skip_tokenizer_init:
            try:
                self.tokenizer = (_tokenizer_from_files(reply.files) if reply.files
                                  else Tokenizer.from_dir(reply.info.model_dir))
            except BaseException:
                await self.close()
                raise
        if reply.heartbeat_s > 0:  # over TCP: no pidfd across hosts
            self._beat = self.loop.call_later(reply.heartbeat_s, self._heartbeat, reply.heartbeat_s)
            if self._monitor is not None:
                self.loop.add_reader(self._monitor.getsockopt(zmq.FD), self._on_monitor)
                self._on_monitor()
        else:
            self._watch_core()
        self._check_pending()
        return self

    def _heartbeat(self, interval: float) -> None:
        """Tell the core this frontend is alive (from the loop: a stopped or wedged frontend
        stays silent, and the core drops it and frees its requests)."""
        self._send(Heartbeat())
        self._beat = self.loop.call_later(interval, self._heartbeat, interval)

    def _monitor_events(self) -> Iterator[dict]:
        """The connection's events that have come (over TCP), oldest first."""
        from zmq.utils.monitor import recv_monitor_message

        while self._monitor is not None:
            try:
                yield recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return

    def _on_monitor(self) -> None:
        """Attached over TCP: a lost connection is a dead engine (ZMQ would reconnect under a new
        identity, which the core has never welcomed)."""
        for event in self._monitor_events():
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._mark_dead(f"the connection to the engine core at {self.endpoint} was lost (closed, "
                                f"or silent past the {self.heartbeat_timeout_s:g} s heartbeat timeout)")
                return

    def _stop_monitor(self) -> None:
        if self._monitor is not None:
            with contextlib.suppress(ValueError, OSError):
                self.loop.remove_reader(self._monitor.getsockopt(zmq.FD))
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None

    def _handshake_refused(self) -> str | None:
        """Why the CURVE handshake failed, if it did (from the socket's monitor events)."""
        for event in self._monitor_events():
            if event["event"] != zmq.EVENT_HANDSHAKE_SUCCEEDED:
                kind = HANDSHAKE_EVENTS_NAMES.get(event["event"], "disconnected")
                return (f"the engine at {self.endpoint} refused the connection ({kind}, code "
                        f"{event['value']}): check server_key, and that this frontend's public key is "
                        "among the engine's trusted_client_keys")
        return None

    async def _await_welcome(self, timeout: float, alive: Callable[[], str | None]) -> Welcome | Reject:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(self._welcome), 0.1)
            except asyncio.TimeoutError:
                pass
            refused = self._handshake_refused()
            if refused:
                self._close_socket()
                raise ConnectionRefusedError(refused)
            problem = alive()
            if problem is None and self.curve is None and not pid_alive(self.core_pid):
                problem = f"the core (pid {self.core_pid}) is not running"
            if problem:
                self._close_socket()
                raise EngineDeadError(problem)
            if time.monotonic() > deadline:
                self._close_socket()
                where = f" at {self.endpoint} (check the address and server_key)" if self.curve else ""
                raise TimeoutError(f"the engine{where} did not answer within {timeout:.0f} s")

    def _watch_core(self) -> None:
        try:
            self._pidfd = os.pidfd_open(self.core_pid)
        except (ProcessLookupError, OSError):
            self._mark_dead(f"the engine core (pid {self.core_pid}) exited")
            return
        asyncio.get_running_loop().add_reader(
            self._pidfd, self._mark_dead, f"the engine core (pid {self.core_pid}) exited")

    def _mark_dead(self, why: str) -> None:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._beat is not None:
            self._beat.cancel()
            self._beat = None
        self._outbox.clear()  # nobody will read it
        if self.dead is None:
            self.dead = EngineDeadError(why)
            if self.on_dead is not None:
                self.on_dead()
        self._unwatch_core()
        for state in list(self.states.values()):
            state.fail(self.dead)
        self.states.clear()
        for fut in self._controls.values():
            if not fut.done():
                fut.set_exception(self.dead)
        self._controls.clear()

    def _unwatch_core(self) -> None:
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    async def close(self, goodbye: bool = True, why: str = "this frontend was shut down") -> None:
        self.on_dead = None  # a chosen end, not a death to react to
        linger = 0
        if goodbye and self.dead is None and self._sock is not None:
            try:
                self._sock.send(encode(Goodbye()), zmq.NOBLOCK)
                linger = GOODBYE_LINGER_MS  # let it leave: the core frees our slot at once
            except zmq.ZMQError:
                pass
        self._mark_dead(why)
        self._close_socket(linger)

    def _close_socket(self, linger: int = 0) -> None:
        if self._sock is not None:
            self._stop_monitor()
            self.loop.remove_reader(self._fd)
            if self._retry is not None:
                self._retry.cancel()
            self._sock.close(linger=linger)
            self._ctx.term()
            self._sock = None

    # ---- requests ----------------------------------------------------------------------------

    def check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))

    def make_request(self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None, *,
                     return_logprob: Any = False, logprob_start_len: Any = None,
                     top_logprobs_num: Any = None, token_ids_logprob: Any = None, rid: Any = None,
                     priority: int | None = None, add_special_tokens: bool = True) -> GenerateRequest:
        """Check and tokenize one call (one prompt or a list, sglang.Engine's arguments: each of
        them one value for all prompts or a list of one per prompt, None for the default);
        raises InvalidParam naming the field, before anything is queued. Thread-safe: it only
        reads."""
        check_encodable(prompt, "prompt")
        check_encodable(sampling_params if isinstance(sampling_params, (dict, list)) else None,
                        "sampling_params")
        batch, prompts, id_lists = _normalize_prompts(prompt, input_ids)
        n = len(prompts) or len(id_lists)
        if prompts and self.tokenizer is None:
            raise InvalidParam("prompt", "this engine has no tokenizer (skip_tokenizer_init=True): "
                                         "give input_ids")
        params = [SamplingParams.from_any(p) for p in _per_prompt(sampling_params, n, "sampling_params")]
        by_id = token_ids_logprob
        if batch and isinstance(by_id, list) and not any(isinstance(x, list) or x is None for x in by_id):
            by_id = [by_id] * n  # one list of ids for every prompt
        per = zip(prompts or [None] * n, id_lists or [None] * n, params, _per_prompt(rid, n, "rid"),
                  _per_prompt(return_logprob, n, "return_logprob"),
                  _per_prompt(logprob_start_len, n, "logprob_start_len"),
                  _per_prompt(top_logprobs_num, n, "top_logprobs_num"),
                  _per_prompt(by_id, n, "token_ids_logprob") if batch else [by_id])
        priority = 0 if priority is None else priority
        _check_int("priority", priority)
        return GenerateRequest([self._prompt(*args, add_special_tokens) for args in per], batch, priority)

    def _prompt(self, prompt: str | None, input_ids: list[int] | None, params: SamplingParams,
                rid: Any, return_logprob: Any, logprob_start_len: Any, top_logprobs_num: Any,
                token_ids_logprob: Any, add_special_tokens: bool) -> PromptRequest:
        if rid is not None and not isinstance(rid, str):
            raise InvalidParam("rid", f"rid must be a string, got {rid!r}")
        if not isinstance(return_logprob, bool):
            raise InvalidParam("return_logprob", f"return_logprob must be a bool, got {return_logprob!r}")
        start = -1 if logprob_start_len is None else logprob_start_len
        top = 0 if top_logprobs_num is None else top_logprobs_num
        _check_int("logprob_start_len", start, -1)
        _check_int("top_logprobs_num", top, 0, MAX_TOP_LOGPROBS)
        vocab = self.info.vocab_size
        if token_ids_logprob is not None:
            if not isinstance(token_ids_logprob, list) or len(token_ids_logprob) > MAX_TOKEN_IDS_LOGPROB:
                raise InvalidParam("token_ids_logprob", "token_ids_logprob must be a list of at most "
                                   f"{MAX_TOKEN_IDS_LOGPROB} token ids (or one such list per prompt)")
            for t in token_ids_logprob:
                _check_int("token_ids_logprob", t, 0, vocab - 1)
        if self.tokenizer is None and (params.stop is not None or params.stop_regex is not None):
            field = "stop" if params.stop is not None else "stop_regex"
            raise InvalidParam(field, f"{field} needs a tokenizer; this engine has none "
                                      "(skip_tokenizer_init=True): use stop_token_ids")
        ids = self._prompt_ids(prompt, input_ids, params, add_special_tokens)
        info = self.info
        max_new = params.max_tokens(len(ids), min(info.context_length, info.max_total_tokens))
        return PromptRequest(ids, params, max_new, rid, return_logprob, start, top, token_ids_logprob)

    def _prompt_ids(self, prompt: str | None, input_ids: list[int] | None, params: SamplingParams,
                    add_special_tokens: bool = True) -> list[int]:
        if input_ids is None:
            if not isinstance(prompt, str):
                raise InvalidParam("prompt", f"prompt must be a string, got {type(prompt).__name__}")
            if not prompt:
                raise InvalidParam("prompt", "prompt is empty")
            input_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        vocab = self.info.vocab_size
        if not isinstance(input_ids, list) or not input_ids:
            raise InvalidParam("input_ids", "input_ids must be a non-empty list of token ids")
        for t in input_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidParam("input_ids", f"input_ids must hold token ids in [0, {vocab - 1}], "
                                                f"got {t!r}")
        params.validate(vocab_size=vocab, context_length=self.info.context_length,
                        prompt_len=len(input_ids),
                        room=min(self.info.context_length, self.info.max_total_tokens))
        return input_ids

    async def submit(self, req: GenerateRequest) -> Collector:
        """Queue a checked request (each prompt n times); returns the Collector that follows it."""
        self.check_alive()
        states, msgs = [], []
        limited = self.info.max_queued_requests is not None  # then hear that each was queued
        for p in req.prompts:
            base, sp = p.rid or uuid.uuid4().hex, p.params
            for i in range(sp.n):
                child = base if sp.n == 1 else f"{base}-{i}"
                states.append(ReqState(child, p, self.tokenizer,
                                       self.loop.create_future() if limited else None))
                msgs.append(Generate(
                    child, p.input_ids, sp.to_core(self.info.vocab_size, p.max_new_tokens, i, self.rng),
                    p.return_logprob, p.top_logprobs_num, p.logprob_start_len if p.return_logprob else -1,
                    req.priority, report_queued=limited,
                    token_ids_logprob=(p.token_ids_logprob or []) if p.return_logprob else []))
        counts = Counter(s.rid for s in states)
        clash = sorted(r for r, c in counts.items() if c > 1 or r in self.states)
        if clash:
            raise InvalidParam("rid", f"rid: request id(s) {clash} already in flight")
        for state, msg in zip(states, msgs):
            self.states[state.rid] = state
            self._send(msg)
        return Collector(states, req.batch, self.loop, self.abort_soon,
                         incremental=self.config.stream_output)

    def abort_soon(self, rids: list[str]) -> None:
        """Abort from any thread (a consumer that stopped following): done on the frontend's loop."""
        if self.loop is None or self.loop.is_closed():
            return
        for rid in rids:
            coro = self.abort(rid)
            try:
                if _running_loop() is self.loop:
                    self.loop.create_task(coro)
                else:
                    asyncio.run_coroutine_threadsafe(coro, self.loop)
            except RuntimeError:  # the loop is shutting down: the core frees on detach
                coro.close()

    async def abort(self, rid: str) -> None:
        state = self.states.pop(rid, None)
        if state is not None and self.dead is None:
            state.update(ReqOutput(rid, finish="abort"))
            state.wake()
            self._send(Abort(rid))

    async def control(self, req: ControlRequest[ReplyT], timeout: float | None = 30.0) -> ReplyT:
        """An engine-wide operation, done in the core, answered with the request's reply type;
        None timeout: as long as it takes (a weight update waits for the requests in flight),
        unless the core dies."""
        self.check_alive()
        cid = next(self._cids)
        fut = asyncio.get_running_loop().create_future()
        self._controls[cid] = fut
        self._send(Control(cid, req))
        try:
            reply: ControlReply = await asyncio.wait_for(fut, timeout)
        finally:
            self._controls.pop(cid, None)
        if reply.error:
            raise RuntimeError(f"{req.op} failed in the engine core: {reply.error}")
        return req.check_reply(reply.result)

    # ---- core -> frontend --------------------------------------------------------------------

    def _send(self, msg: Any) -> None:
        """Send now, or, while the pipe to the core is full, in order as soon as it has room."""
        if self._sock is None:
            return
        self._outbox.append(encode(msg))
        if self._retry is None:  # else a retry is due: it sends this one in order
            self._flush()

    def _flush(self) -> None:
        self._retry = None
        while self._outbox and self._sock is not None:
            try:
                self._sock.send(self._outbox[0], zmq.NOBLOCK)
            except zmq.Again:
                self._retry = self.loop.call_later(RETRY_SEND_S, self._flush)
                break
            self._outbox.popleft()
        self._check_pending()

    def _check_pending(self) -> None:
        """After a send: messages that arrived meanwhile raise no new edge on the FD; look."""
        if self._sock is not None and not self._read_scheduled \
                and self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._read_scheduled = True
            self.loop.call_soon(self._on_readable)

    def _on_readable(self) -> None:
        self._read_scheduled = False
        try:
            self._receive()
        except Exception as e:  # a bug: fail every request loudly rather than hang them
            log.exception("the frontend failed to process the core's messages")
            self._mark_dead(f"this frontend failed: {e!r}")

    def _receive(self) -> None:
        """Take what has arrived, up to a batch: a frontend behind the core applies several
        steps in one pass, wakes each consumer once and acknowledges them with one Ack."""
        batch = []
        while len(batch) < MAX_MESSAGES_PER_WAKE and self._sock is not None:
            try:
                batch.append(self._sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
        seq, outputs = 0, []
        for data in batch:
            msg = decode_to_frontend(data)
            if isinstance(msg, StepOutputs):
                outputs += msg.outputs
                seq = msg.seq
            elif isinstance(msg, ControlReply):
                fut = self._controls.get(msg.cid)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, (Welcome, Reject)) and not self._welcome.done():
                self._welcome.set_result(msg)
        if outputs:
            for reply in self._on_outputs(outputs):
                self._send(reply)
        if seq:
            self._send(Ack(seq))
        if len(batch) == MAX_MESSAGES_PER_WAKE:  # more may wait: let the consumers run first
            self._read_scheduled = True
            self.loop.call_soon(self._on_readable)
        else:
            self._check_pending()

    def _on_outputs(self, outputs: list[ReqOutput]) -> list[Abort]:
        """Apply a batch of outputs to the states, wake each consumer once; returns what the
        core must be told (requests a stop string or a failure ended here)."""
        wakers: dict[Callable[[], None], None] = {}  # one call per consumer, in order
        replies = []
        for out in outputs:
            state = self.states.get(out.rid)
            if state is None:
                continue  # finished here already (a stop string, an abort)
            try:
                state.update(out)
            except Exception as e:  # one request's failure must not end the receive loop
                log.exception("request %s failed in the frontend", out.rid)
                state.fail(e)
                del self.states[out.rid]
                replies.append(Abort(out.rid))
                continue
            if out.queued:
                continue
            if state.waker is not None:
                wakers[state.waker] = None
            if state.finished:
                del self.states[out.rid]
                if state.stopped_here:
                    replies.append(Abort(out.rid, finished=True))
        for wake in wakers:
            try:
                wake()
            except RuntimeError:  # its event loop is closed: nobody is waiting there
                pass
        return replies


def _tokenizer_from_files(files: dict[str, bytes]) -> Tokenizer:
    """A remote frontend's tokenizer, from the files its core sent (read once, then deleted)."""
    with tempfile.TemporaryDirectory(prefix="unison-tokenizer-") as tmp:
        for name, data in files.items():
            path = Path(tmp, name)
            if Path(tmp).resolve() not in path.resolve().parents:
                raise ValueError(f"the core sent a file outside the tokenizer directory: {name!r}")
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(data)
        return Tokenizer.from_dir(tmp)


def _normalize_prompts(prompt: Any, input_ids: Any) -> tuple[bool, list[str], list[list[int]]]:
    if (prompt is None) == (input_ids is None):
        raise InvalidParam("prompt", "give exactly one of prompt and input_ids")
    if prompt is not None:
        if isinstance(prompt, str):
            return False, [prompt], []
        if isinstance(prompt, list) and prompt:
            return True, prompt, []
        raise InvalidParam("prompt", "prompt must be a string or a non-empty list of strings")
    if isinstance(input_ids, list) and input_ids and all(isinstance(x, list) for x in input_ids):
        return True, [], input_ids
    if isinstance(input_ids, list):
        return False, [], [input_ids]
    raise InvalidParam("input_ids", "input_ids must be a list of token ids or a list of such lists")


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):  # one entry per prompt
        if len(value) != n:
            raise InvalidParam(name, f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def _check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo) \
            or (hi is not None and value > hi):
        bounds = f" in [{lo}, {'inf' if hi is None else hi}]" if lo is not None else ""
        raise InvalidParam(name, f"{name} must be an integer{bounds}, got {value!r}")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
