"""The native routes, in SGLang's shapes: /generate, /health, /get_server_info, /get_model_info,
/metrics, and the engine-wide controls /flush_cache, /pause_generation, /continue_generation,
/abort_request, /update_weights_from_disk, and the LoRA adapters' /load_lora_adapter and
/unload_lora_adapter (SGLang's; vLLM's under /v1/ too), all behind the API key, as every route but
/health and /metrics. Any worker answers a control: it is acted on in the core, for every
frontend (and on every replica's core, data parallel)."""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from unison.deploy.replicas import Replicas
from unison.errors import EngineDeadError, check_encodable
from unison.server.apis.sglang.bodies import (
    AbortBody,
    BodyT,
    ContinueBody,
    GenerateBody,
    LoadLoraBody,
    PauseBody,
    UnloadLoraBody,
    UpdateWeightsBody,
)
from unison.server.errors import HTTPError
from unison.server.metrics import CONTENT_TYPE, render_metrics
from unison.server.pipeline.start import check_model
from unison.server.streaming import route, stream, wait, worker_of
from unison.wire import registry
from unison.wire.messages import (
    AbortRequests,
    Continue,
    ControlRequest,
    FlushCache,
    GetServerInfo,
    LoadLoraAdapter,
    OpResult,
    Pause,
    ReplyT,
    UnloadLoraAdapter,
    UpdateWeights,
)

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    """200 while any replica serves."""
    replicas: Replicas = request.app.state.replicas
    ok = any(w.curve is not None or registry.pid_alive(w.core_pid) for _, w in replicas.live)
    return Response(status_code=200 if ok else 503)


@router.get("/get_server_info")
async def server_info(request: Request):
    """One engine: its state. Data parallel: the first live replica's keys, the counts summed,
    and each replica under `replicas` (its core's pid, host and own state; `internal_states`
    has one entry per replica, as SGLang's per DP rank)."""
    replicas: Replicas = request.app.state.replicas
    indexed = await _control_all(request, GetServerInfo())
    infos = [one for _, one in indexed]
    info = infos[0].to_dict()
    if replicas.replicas_path is None:
        return info
    rows = replicas.replica_rows(indexed)
    info["replicas"] = msgspec.to_builtins(rows)
    info["internal_states"] = [r.state for r in rows]
    for key in ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_cached"):
        info[key] = sum(getattr(one, key) for one in infos)
    info["frontends"] = [f for one in infos for f in msgspec.to_builtins(one.frontends)]
    return info


@router.get("/get_model_info")
async def model_info(request: Request):
    return (await worker_of(request).control(GetServerInfo())).model_info()


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request):
    return _results(await _control_all(request, FlushCache()))


@router.post("/pause_generation")
async def pause_generation(request: Request, body: PauseBody | None = None):
    body = await _checked(request, body or PauseBody())
    await _control_all(request, Pause(body.mode))
    return {"message": "Generation paused successfully.", "status": "ok"}


@router.post("/continue_generation")
async def continue_generation(request: Request, body: ContinueBody | None = None):
    await _checked(request, body or ContinueBody())
    await _control_all(request, Continue())
    return {"message": "Generation continued successfully.", "status": "ok"}


@router.post("/abort_request")
async def abort_request(body: AbortBody, request: Request):
    await _checked(request, body)
    if not body.rid and not body.abort_all:
        raise HTTPError(400, "give a rid, or abort_all: true", param="rid")
    await _control_all(request, AbortRequests(body.rid, body.abort_all))
    return Response(status_code=200)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: UpdateWeightsBody, request: Request):
    await _checked(request, body)
    if not body.model_path:
        raise HTTPError(400, "model_path must be the path of a model directory or GGUF file",
                        param="model_path")
    update = UpdateWeights(body.model_path, body.load_format, body.abort_all_requests)
    indexed = await _control_all(request, update, timeout=None)
    return _results(indexed, num_paused_requests=sum(r.num_paused_requests for _, r in indexed))


@router.post("/load_lora_adapter")
@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraBody, request: Request):
    """Loaded in the core (each replica's), so every worker serves it from the next request on."""
    await _checked(request, body)
    if body.load_inplace:
        await _control_all(request, UnloadLoraAdapter(body.lora_name))  # vLLM's in-place reload
    load = LoadLoraAdapter(body.lora_name, body.lora_path, body.pinned)
    return _results(await _control_all(request, load, timeout=None))


@router.post("/unload_lora_adapter")
@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraBody, request: Request):
    await _checked(request, body)
    return _results(await _control_all(request, UnloadLoraAdapter(body.lora_name)))


async def _checked(request: Request, body: BodyT) -> BodyT:
    """A body that names a model must name this one (a server of several models has handed it here)."""
    if body.model is not None:
        await check_model(request, body.model)
    return body


async def _control_all(request: Request, req: ControlRequest[ReplyT],
                       timeout: float | None = 30.0) -> list[tuple[int, ReplyT]]:
    """A control on every replica's core (one, unless data parallel): (replica index, reply)."""
    replicas: Replicas = request.app.state.replicas
    try:
        return await replicas.control_all(req, timeout)
    except EngineDeadError as e:
        raise HTTPError(503, f"the engine is not running: {e}") from None


def _results(indexed: list[tuple[int, OpResult]], **extra: object) -> JSONResponse:
    """SGLang's {success, message}: 200 when every replica succeeded, else 400 saying why."""
    results = [r for _, r in indexed]
    ok = all(r.success for r in results)
    message = " | ".join(dict.fromkeys(r.message for r in results if r.success is ok))
    return JSONResponse({"success": ok, "message": message, **extra}, status_code=200 if ok else 400)


@router.get("/metrics")
async def metrics(request: Request):
    replicas: Replicas = request.app.state.replicas
    indexed = await _control_all(request, GetServerInfo())
    labels = [{"engine": str(i)} for i, _ in indexed] if replicas.replicas_path else None
    return Response(render_metrics([one for _, one in indexed], labels), media_type=CONTENT_TYPE)


@router.post("/generate")
async def generate(body: GenerateBody, request: Request):
    check_encodable(body.model_dump(exclude_none=True), "")
    await _checked(request, body)
    if body.text is not None and body.input_ids is not None:
        raise HTTPError(400, "give exactly one of text and input_ids", param="text")
    args = body.args()
    await worker_of(request).fetch_image_urls(args)
    req = worker_of(request).make_request(args)  # InvalidParam: the app's handler
    collector = await route(request, body.text if isinstance(body.text, str) else None, req).submit(req)
    await collector.admitted()
    if body.stream:
        return stream(collector, collector.outputs)
    await wait(request, collector)
    return collector.results()
