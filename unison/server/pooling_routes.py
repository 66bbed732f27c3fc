"""The pooling routes: OpenAI's /v1/embeddings; Cohere's and Jina's rerank (/v1/rerank, /rerank,
/v2/rerank); vLLM's /score. Thin mappings onto frontend/pooling.py, which checks every input."""

from __future__ import annotations

import base64
import uuid

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from unison.frontend import pooling
from unison.frontend.request import GenerateRequest
from unison.server.errors import HTTPError
from unison.server.streaming import route, wait, worker_of

router = APIRouter()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is a 400 naming it


class EmbeddingRequest(_Strict):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: str = "float"  # float | base64 (float32 little-endian, as OpenAI's)
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep at most this many tokens


class RerankRequest(_Strict):
    query: str
    documents: list[str]
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = True  # Jina's and vLLM's default


class ScoreRequest(_Strict):
    text_1: str
    text_2: str | list[str]
    model: str | None = None


def _check_model(request: Request, name: str | None) -> str:
    served = request.app.state.settings.served_model_name
    if name not in (None, served):
        raise HTTPError(404, f"model {name!r} does not exist; this server serves {served!r}", param="model")
    return served


async def _run(request: Request, req: GenerateRequest) -> list[pooling.Pooled]:
    worker = route(request, None, req)
    collector = await worker.submit(req)
    await wait(request, collector)
    return pooling.pooled(collector)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    model, worker = _check_model(request, body.model), worker_of(request)
    if body.encoding_format not in ("float", "base64"):
        raise HTTPError(400, f"encoding_format must be 'float' or 'base64', got {body.encoding_format!r}",
                        param="encoding_format")
    pooling.check_dimensions(worker.info, body.dimensions)
    req = pooling.embed_request(worker.info, worker.tokenizer, body.input, "input",
                                body.truncate_prompt_tokens)
    results = await _run(request, req)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(p.vector, body.encoding_format)}
            for i, p in enumerate(results)]
    tokens = sum(p.prompt_tokens for p in results)
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


@router.post("/v1/rerank")
@router.post("/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankRequest, request: Request):
    model, worker = _check_model(request, body.model), worker_of(request)
    pooling.check_rerank(body.top_n, body.return_documents)
    req = pooling.pair_request(worker.info, worker.tokenizer, body.query, body.documents)
    results = await _run(request, req)
    ranked = pooling.ranked(body.documents, [p.vector[0] for p in results], body.top_n, body.return_documents)
    tokens = sum(p.prompt_tokens for p in results)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": ranked,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


@router.post("/score")
@router.post("/v1/score")
async def score(body: ScoreRequest, request: Request):
    model, worker = _check_model(request, body.model), worker_of(request)
    docs = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    req = pooling.pair_request(worker.info, worker.tokenizer, body.text_1, docs, ("text_1", "text_2"))
    results = await _run(request, req)
    tokens = sum(p.prompt_tokens for p in results)
    return {"object": "list", "model": model,
            "data": [{"object": "score", "index": i, "score": p.vector[0]} for i, p in enumerate(results)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
