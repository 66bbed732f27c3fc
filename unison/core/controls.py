"""Controls: the engine-wide operations, acted on in the core so every frontend sees one state.

One handler per control request type (HANDLERS); the request's type says which, and its reply
type is declared beside it in wire/messages.py.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import ClassVar, Protocol

from unison.config import EngineConfig
from unison.core.engine_core import EngineCore
from unison.core.frontends import Caller, Frontend, Frontends
from unison.core.metrics import StepShapes
from unison.core.request import Request
from unison.core.weight_update import WeightUpdate
from unison.wire.messages import (
    PROTOCOL_VERSION,
    AbortRequests,
    CheckIntegrity,
    Continue,
    Control,
    ControlReply,
    ControlRequest,
    ControlResult,
    CoreArgs,
    CoreInfo,
    FlushCache,
    FrontendInfo,
    GetRequests,
    GetServerInfo,
    GetStepShapes,
    LoadLoraAdapter,
    OpResult,
    Pause,
    PauseMode,
    RequestList,
    ServerInfo,
    StepShapeCounts,
    UnloadLoraAdapter,
    UpdateTensors,
    UpdateWeights,
)

log = logging.getLogger("unison.core")


class ControlHost(Protocol):
    """What the controls act on: the core loop's parts (CoreLoop is one; declared here so the
    controls need not import the server that imports them)."""

    args: CoreArgs
    config: EngineConfig
    core: EngineCore
    frontends: Frontends
    step_shapes: StepShapes | None

    def info(self) -> CoreInfo: ...

    def publish(self) -> None: ...


class Controls:
    """The core's control dispatcher and the engine-wide state the controls set (a pause, the
    weight update in progress).

    `handle` answers a Control with its handler's reply, or with an error saying what the
    handler raised: a bad control never takes the core down. A handler that returns None
    answers later: a weight update replies once it has run (`poll`, from the core's loop)."""

    def __init__(self, server: ControlHost) -> None:
        self.server = server
        self.core = server.core
        self.paused: PauseMode | None = None
        self.update = WeightUpdate(server.core)

    def handle(self, fe: Frontend, msg: Control) -> ControlReply | None:
        try:
            result = self.HANDLERS[type(msg.request)](self, msg.request, Caller(fe, msg.cid))
        except Exception as e:
            return ControlReply(msg.cid, error=f"{type(e).__name__}: {e}")
        return None if result is None else ControlReply(msg.cid, result=result)

    def poll(self) -> None:
        """Run a waiting weight update once it may, and answer whoever asked for it."""
        if self.update.ready(self.paused is not None):
            by = self.update.caller
            assert by is not None  # set while WAITING
            result = self.finish_update()
            fe = by.frontend
            if self.server.frontends.get(fe.ident) is fe:
                self.server.frontends.send(fe, ControlReply(by.cid, result=result))

    # ---- the handlers, one per request type ------------------------------------------------------

    def server_info(self, req: GetServerInfo, by: Caller) -> ServerInfo:
        server, report, frontends = self.server, self.core.report, self.server.frontends
        inflight = report.requests_per_frontend()
        return ServerInfo(
            version=PROTOCOL_VERSION, core_pid=os.getpid(), owner_pid=server.args.owner_pid,
            config=server.config, core=server.info(), paused=self.paused is not None,
            pause_mode=self.paused.value if self.paused else None, weights_version=self.update.version,
            num_running=report.num_running, num_waiting=report.num_waiting,
            kv_blocks_used=report.kv_blocks_used, kv_blocks_cached=report.cached_blocks,
            num_evicted_blocks=report.num_evicted_blocks, stats=report.stats(),
            histograms=self.core.latency.data(),
            admissions=[(frontends.worker_ids.get(f, -1), rid) for f, rid in report.admissions()],
            frontends=[FrontendInfo(fe.pid, fe.worker_id, inflight[fe.ident], fe.remote,
                                    fe.ident in self.core.scheduler.behind)
                       for fe in frontends],
            lora_adapters=report.lora_adapters(),
        )

    def flush_cache(self, req: FlushCache, by: Caller) -> OpResult:
        try:
            self.core.flush_cache()
        except RuntimeError as e:  # requests hold KV: refused, as SGLang's, not an error
            return OpResult(False, str(e))
        return OpResult(True, "the prefix cache is empty")

    def pause(self, req: Pause, by: Caller) -> OpResult:
        """Stop stepping. Requests that arrive meanwhile queue (held, not refused)."""
        affected = len(self.core.requests)
        if req.mode is PauseMode.ABORT:
            self.abort_where(lambda r: True, "aborted: generation was paused (mode='abort')")
        elif req.mode is PauseMode.RETRACT:
            self.core.retract_all()
        self.paused = req.mode
        return OpResult(True, f"generation paused (mode={req.mode.value!r}, {affected} request(s) in "
                              "flight)", num_paused_requests=len(self.core.requests))

    def continue_generation(self, req: Continue, by: Caller) -> OpResult:
        self.paused = None
        return OpResult(True, "generation continues")

    def check_integrity(self, req: CheckIntegrity, by: Caller) -> OpResult:
        self.core.check_integrity()  # raises: the reply is the error
        return OpResult(True, "no KV block is leaked or owned twice")

    def requests(self, req: GetRequests, by: Caller) -> RequestList:
        return RequestList(self.core.report.requests(self.server.frontends.worker_ids))

    def step_shapes(self, req: GetStepShapes, by: Caller) -> StepShapeCounts:
        if self.server.step_shapes is None:
            raise ValueError("step shapes are recorded only when the core starts with "
                             "UNISON_RECORD_STEP_SHAPES=1 in its environment")
        return StepShapeCounts(self.server.step_shapes.rows())

    def abort_requests(self, req: AbortRequests, by: Caller) -> OpResult:
        """Abort by id (with its n samples), or all; unlike a frontend's Abort, it reaches the
        requests of every frontend: it is the operator's control, not a client's."""
        if not req.abort_all and not req.rid:
            raise ValueError("abort_requests needs a rid or abort_all=True")
        before = len(self.core.requests)
        if req.abort_all:
            self.abort_where(lambda r: True, "aborted: abort_all")
        else:
            child = req.rid + "-"
            self.abort_where(
                lambda r: r.rid == req.rid or (r.rid.startswith(child) and r.rid[len(child):].isdigit()),
                f"aborted: abort_request(rid={req.rid!r})")
        return OpResult(True, f"aborted {before - len(self.core.requests)} request(s)")

    def update_weights(self, req: UpdateWeights | UpdateTensors, by: Caller) -> OpResult | None:
        """Load new weights now when nothing runs (or generation is paused), else once the
        requests in flight have finished; new requests wait meanwhile (SGLang's order)."""
        refused = self.update.refusal(req, by.frontend.remote)
        if refused:
            return OpResult(False, refused)
        if isinstance(req, UpdateWeights) and req.abort_all_requests:
            self.abort_where(lambda r: True,
                             "aborted: the weights are being updated (abort_all_requests=True)")
        self.update.start(by, req, paused=self.paused is not None)
        return self.finish_update() if self.update.ready(self.paused is not None) else None

    def load_lora_adapter(self, req: LoadLoraAdapter, by: Caller) -> OpResult:
        """Load an adapter every frontend can use from the next request on; a bad one is refused
        with the reason (an OpResult, as SGLang's), and nothing changes."""
        if not self.core.config.enable_lora:
            return OpResult(False, "LoRA is off: start the engine with enable_lora=True (--enable-lora)")
        try:
            return OpResult(True, self.core.loras.load(req.lora_name, req.lora_path, req.pinned))
        except Exception as e:  # a file that is not what it says (safetensors' own errors too)
            log.warning("LoRA adapter %r not loaded: %s", req.lora_name, e)
            return OpResult(False, str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}")

    def unload_lora_adapter(self, req: UnloadLoraAdapter, by: Caller) -> OpResult:
        try:
            return OpResult(True, self.core.loras.unload(req.lora_name))
        except ValueError as e:
            return OpResult(False, str(e))

    HANDLERS: ClassVar[dict[type[ControlRequest], Callable[..., ControlResult | None]]] = {
        GetServerInfo: server_info,
        FlushCache: flush_cache,
        Pause: pause,
        Continue: continue_generation,
        CheckIntegrity: check_integrity,
        GetStepShapes: step_shapes,
        GetRequests: requests,
        AbortRequests: abort_requests,
        UpdateWeights: update_weights,
        UpdateTensors: update_weights,
        LoadLoraAdapter: load_lora_adapter,
        UnloadLoraAdapter: unload_lora_adapter,
    }

    # ---- shared by the handlers ----------------------------------------------------------------

    def abort_where(self, which: Callable[[Request], bool], message: str) -> None:
        self.server.frontends.send_outputs(self.core.abort_where(which, message))

    def finish_update(self) -> OpResult:
        result = self.update.run()
        if result.success:
            try:
                self.server.publish()  # a frontend attaching later sees the model path now served
            except OSError as e:
                log.warning("could not republish the registry: %s", e)
        return result
