"""TokenizerWorker: one frontend. Checks and tokenizes requests, sends them to the core over its
CoreConnection (connection.py), and fans the core's outputs out to each request's consumer.

It lives on one asyncio loop (a private thread behind the Engine API, or an HTTP worker's own
loop) and imports neither torch nor transformers. The Engine and the HTTP routes are thin
adapters over it: they build one GenerateRequest through `make_request` (errors are
InvalidParam naming the field), `submit` it, and read the Collector it returns.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import tempfile
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import cast

from unison.config import EngineConfig
from unison.errors import EngineDeadError, InvalidParam, check_encodable
from unison.frontend import images
from unison.frontend.collector import Collector, running_loop
from unison.frontend.connection import CoreConnection
from unison.frontend.fanout import fan_out
from unison.frontend.generate_args import GenerateArgs
from unison.frontend.pooling import expect_task
from unison.frontend.request import GenerateRequest, PromptRequest, ReqState
from unison.frontend.sampling_params import SamplingParams
from unison.frontend.text.tokenizer import Tokenizer
from unison.sampling import MAX_TOP_LOGPROBS
from unison.wire import registry
from unison.wire.messages import (
    Abort,
    Control,
    ControlReply,
    ControlRequest,
    ControlRequests,
    CoreInfo,
    Generate,
    ImageInput,
    ReplyT,
    ReqOutput,
    StepOutputs,
    ToCore,
    Welcome,
)

ATTACH_TIMEOUT = 5.0  # an attaching frontend talks to a core that is up already

MAX_TOKEN_IDS_LOGPROB = 256  # logprobs of given ids, per position


class TokenizerWorker:
    """A frontend of one engine core, used from its own asyncio loop (`make_request` alone is
    thread-safe). Every request it accepted ends exactly once for its consumer: finished,
    aborted, or failed with EngineDeadError when the core dies or the worker closes. Requests
    are keyed by rid in `states` while in flight; a request a stop string ends here is aborted
    in the core too."""

    def __init__(self, endpoint: str, token: str, core_pid: int,
                 curve: tuple[str, str] | None = None, heartbeat_timeout_s: float = 3.0) -> None:
        """`curve`: (the core's public key, this frontend's secret key) to attach over TCP."""
        self.conn = CoreConnection(endpoint, token, core_pid, curve, self._on_messages, self._fail_all,
                                   heartbeat_timeout_s)
        self.tokenizer: Tokenizer | None = None  # loaded from the directory Welcome names
        self._welcome: Welcome | None = None  # the core's, once attached
        self.rng = random.Random()  # draws unseeded requests' sampling seeds (see random_seed)
        self.worker_id = -1
        self.states: dict[str, ReqState] = {}
        self._controls: dict[int, asyncio.Future] = {}
        self._cids = itertools.count()
        self.on_dead: Callable[[], None] | None = None  # e.g. an HTTP worker stops serving

    @property
    def dead(self) -> EngineDeadError | None:
        """Why this frontend can take no more requests (the core died, or it was closed)."""
        return self.conn.dead

    @property
    def curve(self) -> tuple[str, str] | None:
        """The CURVE keys of a frontend attached over TCP; None over IPC."""
        return self.conn.curve

    @property
    def core_pid(self) -> int:
        return self.conn.core_pid

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
        worker = cls(address, "", 0, curve=(server_key, client_key), heartbeat_timeout_s=heartbeat_timeout_s)
        return await worker.start(timeout)

    async def start(self, timeout: float,
                    alive: Callable[[], str | None] = lambda: None) -> TokenizerWorker:
        """Connect and say Hello; `alive` returns why the engine cannot answer, or None."""
        reply = await self.conn.open(timeout, alive)
        self.worker_id, self._welcome = reply.worker_id, reply
        if self.config.random_seed is not None:  # each frontend its own stream, reproducible
            self.rng = random.Random(f"{self.config.random_seed}:{self.worker_id}")
        if not self.config.skip_tokenizer_init:
            try:
                # (a frontend on the core's host reads the files in place)
                self.tokenizer = (_tokenizer_from_files(reply.files) if reply.files
                                  else Tokenizer.from_dir(reply.info.tokenizer_dir))
            except BaseException:
                await self.close()
                raise
        return self

    @property
    def info(self) -> CoreInfo:
        """The model and KV cache, as the core described them when this frontend attached."""
        assert self._welcome is not None, "the frontend is not attached"
        return self._welcome.info

    @property
    def config(self) -> EngineConfig:
        """The engine's configuration, from the same Welcome."""
        assert self._welcome is not None, "the frontend is not attached"
        return self._welcome.config

    async def close(self, goodbye: bool = True, why: str = "this frontend was shut down") -> None:
        self.on_dead = None  # a chosen end, not a death to react to
        self.conn.close(goodbye, why)

    def _fail_all(self, dead: EngineDeadError) -> None:
        """The connection ended: every request and control in flight fails with `dead`."""
        if self.on_dead is not None:
            self.on_dead()
        for state in list(self.states.values()):
            state.fail(dead)
        self.states.clear()
        for fut in self._controls.values():
            if not fut.done():
                fut.set_exception(dead)
        self._controls.clear()

    # ---- requests ----------------------------------------------------------------------------

    def check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))

    def make_request(self, args: GenerateArgs, add_special_tokens: bool = True) -> GenerateRequest:
        """Check and tokenize one call (one prompt or a list); raises InvalidParam naming the
        field, before anything is queued. Thread-safe: it only reads."""
        expect_task(self.info, "generate", "generate")
        check_encodable(args.prompt, "prompt")
        check_encodable(args.sampling_params if isinstance(args.sampling_params, (dict, list)) else None,
                        "sampling_params")
        batch, per = args.split()
        prompts = [self._prompt(one, add_special_tokens) for one in per]
        priority = 0 if args.priority is None else args.priority
        _check_int("priority", priority)
        return GenerateRequest(prompts, batch, priority)

    def _prompt(self, one: GenerateArgs, add_special_tokens: bool) -> PromptRequest:
        """One prompt's request, from `one`'s single values."""
        if one.prompt is not None and self.tokenizer is None:
            raise InvalidParam("prompt", "this engine has no tokenizer (skip_tokenizer_init=True): "
                                         "give input_ids")
        params = SamplingParams.from_any(one.sampling_params)
        rid, lora_path, return_logprob = one.rid, one.lora_path, one.return_logprob
        if rid is not None and not isinstance(rid, str):
            raise InvalidParam("rid", f"rid must be a string, got {rid!r}")
        if lora_path is not None and (not isinstance(lora_path, str) or not lora_path):
            raise InvalidParam("lora_path", f"lora_path must be a loaded adapter's name (or a list of "
                                            f"one per prompt), got {lora_path!r}")
        if lora_path is not None and not self.config.enable_lora:
            raise InvalidParam("lora_path", "lora_path: LoRA is off; start the engine with "
                                            "enable_lora=True (--enable-lora)")
        return_logprob = False if return_logprob is None else return_logprob
        if not isinstance(return_logprob, bool):
            raise InvalidParam("return_logprob", f"return_logprob must be a bool, got {return_logprob!r}")
        given_start = one.logprob_start_len
        start = _check_int("logprob_start_len", -1 if given_start is None else given_start, -1)
        top = _check_int("top_logprobs_num", 0 if one.top_logprobs_num is None else one.top_logprobs_num, 0,
                         MAX_TOP_LOGPROBS)
        by_id = cast(list[int] | None, one.token_ids_logprob)  # split() made it one prompt's list
        vocab = self.info.vocab_size
        if by_id is not None:
            if not isinstance(by_id, list) or len(by_id) > MAX_TOKEN_IDS_LOGPROB:
                raise InvalidParam("token_ids_logprob", "token_ids_logprob must be a list of at most "
                                   f"{MAX_TOKEN_IDS_LOGPROB} token ids (or one such list per prompt)")
            for t in by_id:
                _check_int("token_ids_logprob", t, 0, vocab - 1)
        if self.tokenizer is None and (params.stop is not None or params.stop_regex is not None):
            field = "stop" if params.stop is not None else "stop_regex"
            raise InvalidParam(field, f"{field} needs a tokenizer; this engine has none "
                                      "(skip_tokenizer_init=True): use stop_token_ids")
        pixels = self.prepare_images(one.image_data)
        prompt = cast(str | None, one.prompt)
        if pixels and prompt is not None:  # each image marker becomes its run of placeholders
            assert self.info.image is not None  # prepare_images refused images to a text-only model
            prompt = images.expand(prompt, [len(p.crops) for p in pixels], self.info.image, "prompt")
        ids = self._prompt_ids(prompt, cast(list[int] | None, one.input_ids), add_special_tokens)
        info = self.info
        placed: list[ImageInput] = []
        if info.image is not None:  # (a grid image's one marker token becomes its whole run here)
            ids, placed = images.place(ids, pixels, info.image, "prompt" if prompt else "input_ids")
        room = min(info.context_length, info.max_total_tokens)
        params.validate(vocab_size=vocab, context_length=info.context_length, prompt_len=len(ids), room=room)
        max_new = params.max_tokens(len(ids), room)
        return PromptRequest(ids, params, max_new, rid, return_logprob, start, top, by_id, lora_path,
                             images=placed)

    async def fetch_image_urls(self, args: GenerateArgs) -> None:
        """Fetches the image URLs among args.image_data that image_url_hosts allows (in place),
        before make_request reads the images: waiting on a remote host never blocks this loop."""
        config = self.config
        if args.image_data is not None and config.image_url_hosts:
            policy = images.UrlPolicy(config.image_url_hosts, config.image_fetch_timeout_s,
                                      config.max_image_bytes)
            args.image_data = await images.fetch_urls(args.image_data, policy)

    def prepare_images(self, data: object) -> list[images.Prepared]:
        """One prompt's images (image_data's, or a chat's ImageSources), read and prepared."""
        if data is None or (isinstance(data, list) and not data):
            return []
        if self.info.image is None:
            raise InvalidParam("image_data", "this model takes no images (a text-only model)")
        given = data if isinstance(data, list) else [data]
        sources = [s if isinstance(s, images.ImageSource) else
                   images.ImageSource(s, f"image_data[{i}]" if isinstance(data, list) else "image_data")
                   for i, s in enumerate(given)]
        limits = images.ImageLimits(self.config.max_image_bytes, self.config.max_image_pixels)
        return [images.prepare(images.read(s, limits), self.info.image, s.field) for s in sources]

    def _prompt_ids(self, prompt: str | None, input_ids: list[int] | None,
                    add_special_tokens: bool = True) -> list[int]:
        given = input_ids is not None
        if input_ids is None:
            if not isinstance(prompt, str):
                raise InvalidParam("prompt", f"prompt must be a string, got {type(prompt).__name__}")
            if not prompt:
                raise InvalidParam("prompt", "prompt is empty")
            assert self.tokenizer is not None  # _prompt refused a text prompt without one
            input_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens,
                                              limit=self.info.context_length)
        vocab = self.info.vocab_size
        if not isinstance(input_ids, list) or not input_ids:
            raise InvalidParam("input_ids", "input_ids must be a non-empty list of token ids")
        # The caller's ids are checked one by one; the tokenizer's are ints, only their range is
        # (a tokenizer may hold more tokens than the model: its added ones).
        for t in input_ids if given else (max(input_ids),):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidParam("input_ids", f"input_ids must hold token ids in [0, {vocab - 1}], "
                                                f"got {t!r}")
        return input_ids

    async def submit(self, req: GenerateRequest) -> Collector:
        """Queue a checked request (each prompt n times); returns the Collector that follows it."""
        self.check_alive()
        loop, states, msgs = asyncio.get_running_loop(), [], []  # this worker's loop
        limited = self.info.max_queued_requests is not None  # then hear that each was queued
        for p in req.prompts:
            base, sp = p.rid or uuid.uuid4().hex, p.params
            confirm = limited or p.lora_name is not None  # ... or that its adapter is loaded
            for i in range(sp.n):
                child = base if sp.n == 1 else f"{base}-{i}"
                states.append(ReqState(child, p, self.tokenizer,
                                       loop.create_future() if confirm else None))
                msgs.append(Generate(
                    child, p.input_ids, sp.to_core(self.info.vocab_size, p.max_new_tokens, i, self.rng),
                    p.return_logprob, p.top_logprobs_num, p.logprob_start_len if p.return_logprob else -1,
                    req.priority, report_queued=confirm,
                    token_ids_logprob=(p.token_ids_logprob or []) if p.return_logprob else [],
                    lora_name=p.lora_name, pooling=p.pooling, images=p.images))
        counts = Counter(s.rid for s in states)
        clash = sorted(r for r, c in counts.items() if c > 1 or r in self.states)
        if clash:
            raise InvalidParam("rid", f"rid: request id(s) {clash} already in flight")
        for state, msg in zip(states, msgs):
            self.states[state.rid] = state
            self._send(msg)
        return Collector(states, req.batch, loop, self.abort_soon,
                         incremental=self.config.stream_output)

    def abort_soon(self, rids: list[str]) -> None:
        """Abort from any thread (a consumer that stopped following): done on the frontend's loop."""
        loop = self.conn.loop
        if loop is None or loop.is_closed():
            return
        for rid in rids:
            coro = self.abort(rid)
            try:
                if running_loop() is loop:
                    loop.create_task(coro)
                else:
                    asyncio.run_coroutine_threadsafe(coro, loop)
            except RuntimeError:  # the loop is shutting down: the core frees on detach
                coro.close()

    async def abort(self, rid: str) -> None:
        state = self.states.pop(rid, None)
        if state is not None and self.dead is None:
            state.update(ReqOutput(rid, finish="abort"))
            state.wake()
            self._send(Abort(rid))

    async def control(self, req: ControlRequest[ReplyT], timeout: float | None = 30.0) -> ReplyT:
        """An engine-wide operation, done in the core, answered with the request's reply type; None
        timeout: as long as it takes (a weight update waits for those in flight), unless the core dies."""
        self.check_alive()
        cid = next(self._cids)
        fut = asyncio.get_running_loop().create_future()
        self._controls[cid] = fut
        self._send(Control(cid, cast(ControlRequests, req)))  # every ControlRequest is one of them
        try:
            reply: ControlReply = await asyncio.wait_for(fut, timeout)
        finally:
            self._controls.pop(cid, None)
        if reply.error:
            raise RuntimeError(f"{req.op} failed in the engine core: {reply.error}")
        return req.check_reply(reply.result)

    # ---- core -> frontend --------------------------------------------------------------------

    def _send(self, msg: ToCore) -> None:
        self.conn.send(msg)

    def _on_messages(self, messages: list[StepOutputs | ControlReply]) -> None:
        """A batch of the core's messages (several steps when this frontend fell behind)."""
        outputs = []
        for msg in messages:
            if isinstance(msg, StepOutputs):
                outputs += msg.outputs
            else:
                fut = self._controls.get(msg.cid)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        for reply in fan_out(self.states, outputs):
            self._send(reply)


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


def _check_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> int:
    """`value`, if it is an integer within the bounds; else InvalidParam naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo) \
            or (hi is not None and value > hi):
        bounds = f" in [{lo}, {'inf' if hi is None else hi}]" if lo is not None else ""
        raise InvalidParam(name, f"{name} must be an integer{bounds}, got {value!r}")
    return value
