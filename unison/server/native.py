"""The native routes, in SGLang's shapes: /generate, /health, /get_server_info, /flush_cache,
/metrics."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from unison import registry
from unison.errors import check_encodable
from unison.frontend.worker import TokenizerWorker
from unison.protocol import ControlOp
from unison.server.metrics import CONTENT_TYPE, render_metrics
from unison.server.openai_format import HTTPError
from unison.server.streaming import stream, wait, worker_of

router = APIRouter()

GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "stream", "return_logprob",
                   "logprob_start_len", "top_logprobs_num", "rid", "priority"}


@router.get("/health")
async def health(request: Request):
    worker: TokenizerWorker = request.app.state.worker
    ok = worker.dead is None and registry.pid_alive(worker.core_pid)
    return Response(status_code=200 if ok else 503)


@router.get("/get_server_info")
async def server_info(request: Request):
    return (await worker_of(request).control(ControlOp.SERVER_INFO)).to_dict()


@router.post("/flush_cache")
async def flush_cache(request: Request):
    return {"success": await worker_of(request).control(ControlOp.FLUSH_CACHE)}


@router.get("/metrics")
async def metrics(request: Request):
    info = await worker_of(request).control(ControlOp.SERVER_INFO)
    return Response(render_metrics(info), media_type=CONTENT_TYPE)


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
    collector = await worker.submit(worker.make_request(**call))  # InvalidParam: the app's handler
    await collector.admitted()
    if body.get("stream"):
        return stream(collector, collector.outputs)
    await wait(request, collector)
    return collector.results()


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HTTPError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    return body
