"""TokenizerWorker: one frontend. Tokenizes, talks to the core, detokenizes, feeds request streams.

It lives on one asyncio loop (a private thread behind the Engine API, or an HTTP worker's own
loop) and imports neither torch nor transformers. Per-request results cross to their consumer as
deltas in a thread-safe deque with one wake-up per core step, not one per token.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from unison.errors import EngineDeadError
from unison.frontend.detokenizer import IncrementalDetokenizer
from unison.frontend.tokenizer import Tokenizer
from unison.protocol import (
    Abort,
    Ack,
    Control,
    ControlReply,
    Generate,
    Goodbye,
    Hello,
    Reject,
    ReqOutput,
    RequestStats,
    StepOutputs,
    Welcome,
    decode_to_frontend,
    encode,
)
from unison.registry import pid_alive
from unison.sampling_params import SamplingParams


@dataclass(slots=True)
class Delta:
    """What one request gained since the consumer last looked."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, int, None]] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int, None]]] = field(default_factory=list)
    prompt_logprobs: list[tuple[float | None, int, None]] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[float, int, None]]] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    cached_tokens: int = 0
    error: BaseException | None = None


class ReqState:
    """One request as its frontend sees it; `deltas` is read by the consumer, from any thread."""

    def __init__(self, rid: str, prompt_ids: list[int], params: SamplingParams, tokenizer: Tokenizer,
                 return_logprob: bool, logprob_start_len: int) -> None:
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.detok = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop=params.stop_strings, no_stop_trim=params.no_stop_trim, prompt_ids=prompt_ids,
        )
        self.created = time.monotonic()
        self.first_token_at: float | None = None
        self.num_prompt_logprobs = 0
        self.finished = False
        self.deltas: deque[Delta] = deque()
        self.waker: Callable[[], None] | None = None

    def push(self, delta: Delta) -> None:
        self.deltas.append(delta)
        if self.waker is not None:
            try:
                self.waker()
            except RuntimeError:  # the consumer's event loop is closed: nobody is waiting
                self.waker = None

    def update(self, out: ReqOutput) -> bool:
        """Apply one core output; returns True when a stop string ended the request here."""
        if out.token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        before = len(self.detok.output_ids)
        text = self.detok.add(out.token_ids)
        stopped = self.detok.stop_matched is not None
        if out.finish is not None or stopped:
            text += self.detok.flush()
        new_ids = self.detok.output_ids[before:]
        delta = Delta(text=text, token_ids=new_ids, cached_tokens=out.cached_tokens)
        if self.return_logprob:
            self._logprobs(out, delta, len(new_ids))
        if stopped:
            delta.finish_reason = {"type": "stop", "matched": self.detok.stop_matched}
        elif out.error is not None:
            delta.error = ValueError(out.error) if out.refused else RuntimeError(out.error)
        elif out.finish is not None:
            delta.finish_reason = {"type": out.finish, "matched": out.matched}
        self.finished = delta.finish_reason is not None or delta.error is not None
        self.push(delta)
        return stopped and out.finish is None

    def _logprobs(self, out: ReqOutput, delta: Delta, kept: int) -> None:
        ids = out.token_ids[:kept]
        delta.logprobs = [(lp, t, None) for lp, t in zip(out.logprobs, ids)]
        delta.top_logprobs = [[(lp, t, None) for t, lp in top] for top in out.top_logprobs[:kept]]
        if out.prompt_logprobs:
            start = max(self.logprob_start_len, 0) + self.num_prompt_logprobs
            ids = self.prompt_ids[start: start + len(out.prompt_logprobs)]
            delta.prompt_logprobs = [(lp, t, None) for lp, t in zip(out.prompt_logprobs, ids)]
            delta.prompt_top_logprobs = [[(lp, t, None) for t, lp in top]
                                         for top in out.prompt_top_logprobs]
            self.num_prompt_logprobs += len(out.prompt_logprobs)

    def stats(self) -> RequestStats:
        now, n = time.monotonic(), len(self.detok.output_ids)
        tpot = (now - self.first_token_at) / (n - 1) if n > 1 else None
        return RequestStats(ttft=self.first_token_at - self.created, tpot=tpot, e2e=now - self.created)

    def fail(self, error: BaseException) -> None:
        if not self.finished:
            self.finished = True
            self.push(Delta(error=error))


log = logging.getLogger("unison.frontend")

GOODBYE_LINGER_MS = 200


class TokenizerWorker:
    def __init__(self, model_dir: str | Path, endpoint: str, token: str, core_pid: int) -> None:
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.endpoint = endpoint
        self.token = token
        self.core_pid = core_pid
        self.info: dict[str, Any] = {}
        self.worker_id = -1
        self.states: dict[str, ReqState] = {}
        self.dead: EngineDeadError | None = None
        self._controls: dict[int, asyncio.Future] = {}
        self._cids = itertools.count()
        self._sock: zmq.asyncio.Socket | None = None
        self._recv_task: asyncio.Task | None = None
        self._pidfd: int | None = None
        self.on_dead: Callable[[], None] | None = None  # e.g. an HTTP worker stops serving

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self, timeout: float, alive: Callable[[], str | None] = lambda: None) -> None:
        """Connect and say Hello; `alive` returns why the engine cannot answer, or None."""
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.endpoint)
        await self._sock.send(encode(Hello(pid=os.getpid(), token=self.token)))
        reply = await self._await_welcome(timeout, alive)
        if isinstance(reply, Reject):
            self._close_socket()
            raise ConnectionRefusedError(f"the engine refused this frontend: {reply.reason}")
        self.worker_id, self.info = reply.worker_id, reply.info
        self._watch_core()
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def _await_welcome(self, timeout: float, alive: Callable[[], str | None]) -> Welcome | Reject:
        deadline = time.monotonic() + timeout
        while True:
            if await self._sock.poll(100):
                msg = decode_to_frontend(await self._sock.recv())
                if isinstance(msg, (Welcome, Reject)):
                    return msg
            problem = alive()
            if problem is None and not pid_alive(self.core_pid):
                problem = f"the core (pid {self.core_pid}) is not running"
            if problem:
                self._close_socket()
                raise EngineDeadError(problem)
            if time.monotonic() > deadline:
                self._close_socket()
                raise TimeoutError(f"the engine did not answer within {timeout:.0f} s")

    def _watch_core(self) -> None:
        try:
            self._pidfd = os.pidfd_open(self.core_pid)
        except (ProcessLookupError, OSError):
            self._mark_dead(f"the engine core (pid {self.core_pid}) exited")
            return
        asyncio.get_running_loop().add_reader(
            self._pidfd, self._mark_dead, f"the engine core (pid {self.core_pid}) exited")

    def _mark_dead(self, why: str) -> None:
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
                await self._sock.send(encode(Goodbye()), zmq.NOBLOCK)
                linger = GOODBYE_LINGER_MS  # let it leave: the core frees our slot at once
            except zmq.ZMQError:
                pass
        self._mark_dead(why)
        if self._recv_task is not None:
            self._recv_task.cancel()
        self._close_socket(linger)

    def _close_socket(self, linger: int = 0) -> None:
        if self._sock is not None:
            self._sock.close(linger=linger)
            self._ctx.term()
            self._sock = None

    # ---- requests ----------------------------------------------------------------------------

    def check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))

    def prepare(self, prompt: str | None, input_ids: list[int] | None, params: SamplingParams) -> list[int]:
        """Tokenize and validate one prompt; raises ValueError before anything is queued."""
        if input_ids is None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            if not prompt:
                raise ValueError("prompt is empty")
            input_ids = self.tokenizer.encode(prompt)
        vocab = self.info["vocab_size"]
        if not isinstance(input_ids, list) or not input_ids:
            raise ValueError("input_ids must be a non-empty list of token ids")
        for t in input_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"input_ids must hold token ids in [0, {vocab - 1}], got {t!r}")
        params.validate(vocab_size=vocab, context_length=self.info["context_length"],
                        prompt_len=len(input_ids))
        return input_ids

    async def submit(self, prompt_ids: list[list[int]], params: list[SamplingParams],
                     rids: list[str | None], return_logprob: bool = False,
                     logprob_start_len: int = -1, top_logprobs_num: int = 0,
                     priority: int = 0) -> list[ReqState]:
        """Queue validated prompts (each expanded n times); returns their states in order."""
        self.check_alive()
        states, msgs = [], []
        for ids, sp, rid in zip(prompt_ids, params, rids):
            base = rid or uuid.uuid4().hex
            for i in range(sp.n):
                child = base if sp.n == 1 else f"{base}-{i}"
                states.append(ReqState(child, ids, sp, self.tokenizer, return_logprob, logprob_start_len))
                msgs.append(Generate(child, ids, sp.to_core(self.info["vocab_size"], i), return_logprob,
                                     top_logprobs_num, logprob_start_len if return_logprob else -1,
                                     priority))
        counts = Counter(s.rid for s in states)
        clash = sorted(r for r, c in counts.items() if c > 1 or r in self.states)
        if clash:
            raise ValueError(f"request id(s) {clash} already in flight")
        for state, msg in zip(states, msgs):
            self.states[state.rid] = state
            await self._sock.send(encode(msg))
        return states

    async def abort(self, rid: str) -> None:
        state = self.states.pop(rid, None)
        if state is not None and self.dead is None:
            state.update(ReqOutput(rid, finish="abort"))
            await self._sock.send(encode(Abort(rid)))

    async def control(self, op: str, timeout: float = 30.0) -> Any:
        self.check_alive()
        cid = next(self._cids)
        fut = asyncio.get_running_loop().create_future()
        self._controls[cid] = fut
        await self._sock.send(encode(Control(cid, op)))
        try:
            reply: ControlReply = await asyncio.wait_for(fut, timeout)
        finally:
            self._controls.pop(cid, None)
        if reply.error:
            raise RuntimeError(f"{op} failed in the engine core: {reply.error}")
        return reply.result

    # ---- core -> frontend --------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        while True:
            msg = decode_to_frontend(await self._sock.recv())
            if isinstance(msg, StepOutputs):
                await self._on_outputs(msg.outputs)
                await self._sock.send(encode(Ack(msg.seq)))
            elif isinstance(msg, ControlReply):
                fut = self._controls.get(msg.cid)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    async def _on_outputs(self, outputs: list[ReqOutput]) -> None:
        for out in outputs:
            state = self.states.get(out.rid)
            if state is None:
                continue  # finished here already (a stop string, an abort)
            try:
                stopped_here = state.update(out)
            except Exception as e:  # one request's failure must not end the receive loop
                log.exception("request %s failed in the frontend", out.rid)
                state.fail(e)
                del self.states[out.rid]
                await self._sock.send(encode(Abort(out.rid)))
                continue
            if state.finished:
                del self.states[out.rid]
                if state.first_token_at is not None:
                    await self._sock.send(encode(state.stats()))
            if stopped_here:
                await self._sock.send(encode(Abort(out.rid)))

