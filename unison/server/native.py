"""The native routes, in SGLang's shapes: /generate, /health, /get_server_info, /get_model_info,
/metrics, and the engine-wide controls /flush_cache, /pause_generation, /continue_generation,
/abort_request, /update_weights_from_disk (behind the API key, as every route but /health and
/metrics). Any worker answers a control: it is acted on in the core, for every frontend."""

from __future__ import annotations

import json
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from unison import registry
from unison.errors import EngineDeadError, check_encodable
from unison.protocol import AbortRequests, ControlOp, OpResult, Pause, PauseMode, UpdateWeights
from unison.server.errors import HTTPError
from unison.server.metrics import CONTENT_TYPE, render_metrics
from unison.server.replicas import Replicas
from unison.server.streaming import route, stream, wait, worker_of

router = APIRouter()

GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "stream", "return_logprob",
                   "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "rid", "priority"}


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
    indexed = await _control_all(request, ControlOp.SERVER_INFO)
    infos = [one for _, one in indexed]
    info = infos[0].to_dict()
    if replicas.replicas_path is None:
        return info
    rows = {r["index"]: r for r in replicas.replica_rows()}
    info["replicas"] = [rows[i] | {"state": one.to_dict()["internal_states"][0]} for i, one in indexed]
    info["internal_states"] = [r["state"] for r in info["replicas"]]
    for key in ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_cached"):
        info[key] = sum(getattr(one, key) for one in infos)
    info["frontends"] = [f for one in infos for f in msgspec.to_builtins(one.frontends)]
    return info


@router.get("/get_model_info")
async def model_info(request: Request):
    return (await worker_of(request).control(ControlOp.SERVER_INFO)).model_info()


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request):
    return _results(await _control_all(request, ControlOp.FLUSH_CACHE))


@router.post("/pause_generation")
async def pause_generation(request: Request):
    body = await _json_body(request, empty_ok=True)
    _only(body, {"mode"})
    mode = body.get("mode", PauseMode.ABORT.value)  # SGLang's default
    try:
        pause = Pause(PauseMode(mode))
    except ValueError:
        raise HTTPError(400, f"mode must be one of {[m.value for m in PauseMode]}, got {mode!r}",
                        param="mode") from None
    await _control_all(request, ControlOp.PAUSE, pause)
    return {"message": "Generation paused successfully.", "status": "ok"}


@router.post("/continue_generation")
async def continue_generation(request: Request):
    _only(await _json_body(request, empty_ok=True), set())
    await _control_all(request, ControlOp.CONTINUE)
    return {"message": "Generation continued successfully.", "status": "ok"}


@router.post("/abort_request")
async def abort_request(request: Request):
    body = await _json_body(request)
    _only(body, {"rid", "abort_all"})
    rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
    if not isinstance(rid, str) or not isinstance(abort_all, bool):
        raise HTTPError(400, "rid must be a string and abort_all a bool",
                        param="rid" if not isinstance(rid, str) else "abort_all")
    if not rid and not abort_all:
        raise HTTPError(400, "give a rid, or abort_all: true", param="rid")
    await _control_all(request, ControlOp.ABORT_REQUESTS, AbortRequests(rid, abort_all))
    return Response(status_code=200)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request):
    body = await _json_body(request)
    _only(body, {"model_path", "load_format", "abort_all_requests"})
    path, fmt = body.get("model_path"), body.get("load_format")
    abort_all = body.get("abort_all_requests", False)
    if not isinstance(path, str) or not path:
        raise HTTPError(400, "model_path must be the path of a model directory or GGUF file",
                        param="model_path")
    if fmt is not None and not isinstance(fmt, str):
        raise HTTPError(400, "load_format must be a string", param="load_format")
    if not isinstance(abort_all, bool):
        raise HTTPError(400, "abort_all_requests must be a bool", param="abort_all_requests")
    indexed = await _control_all(request, ControlOp.UPDATE_WEIGHTS, UpdateWeights(path, fmt, abort_all),
                                 timeout=None)
    return _results(indexed, num_paused_requests=sum(r.num_paused_requests for _, r in indexed))


async def _control_all(request: Request, op: ControlOp, arg: Any = None, timeout: float | None = 30.0):
    """A control on every replica's core (one, unless data parallel)."""
    try:
        return await request.app.state.replicas.control_all(op, arg, timeout)
    except EngineDeadError as e:
        raise HTTPError(503, f"the engine is not running: {e}") from None


def _results(indexed: list[tuple[int, OpResult]], **extra: Any) -> JSONResponse:
    """SGLang's {success, message}: 200 when every replica succeeded, else 400 saying why."""
    results = [r for _, r in indexed]
    ok = all(r.success for r in results)
    message = " | ".join(dict.fromkeys(r.message for r in results if r.success is ok))
    return JSONResponse({"success": ok, "message": message, **extra}, status_code=200 if ok else 400)


def _only(body: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise HTTPError(400, f"unknown field(s) {unknown}; allowed: {sorted(allowed)}", param=unknown[0])


@router.get("/metrics")
async def metrics(request: Request):
    replicas: Replicas = request.app.state.replicas
    indexed = await _control_all(request, ControlOp.SERVER_INFO)
    engines = [str(i) for i, _ in indexed] if replicas.replicas_path else None
    return Response(render_metrics([one for _, one in indexed], engines), media_type=CONTENT_TYPE)


@router.post("/generate")
async def generate(request: Request):
    worker, body = worker_of(request), await _json_body(request)
    check_encodable(body, "")
    unknown = sorted(set(body) - GENERATE_FIELDS)
    if unknown:
        raise HTTPError(400, f"unknown field(s) {unknown}; allowed: {sorted(GENERATE_FIELDS)}",
                        param=unknown[0])
    if "text" in body and "input_ids" in body:
        raise HTTPError(400, "give exactly one of text and input_ids")
    call = {k: v for k, v in body.items() if k != "stream"}
    call["prompt"] = call.pop("text", None)
    head = call["prompt"] if isinstance(call["prompt"], str) else None
    req = worker.make_request(**call)  # InvalidParam: the app's handler
    collector = await route(request, head).submit(req)
    await collector.admitted()
    if body.get("stream"):
        return stream(collector, collector.outputs)
    await wait(request, collector)
    return collector.results()


async def _json_body(request: Request, empty_ok: bool = False) -> dict[str, Any]:
    raw = await request.body()
    if empty_ok and not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HTTPError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    return body
