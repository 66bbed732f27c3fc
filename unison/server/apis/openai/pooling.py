"""The pooling routes: OpenAI's /v1/embeddings; Cohere's and Jina's rerank (/v1/rerank, /rerank,
/v2/rerank); vLLM's /score. Thin mappings onto frontend/pooling.py, which checks every input."""

from __future__ import annotations

import base64
import uuid

from fastapi import APIRouter, Request

from unison.frontend import pooling
from unison.frontend.request import GenerateRequest
from unison.server.apis.openai.bodies import EmbeddingRequest, RerankRequest, ScoreRequest
from unison.server.errors import HTTPError
from unison.server.pipeline.start import check_model
from unison.server.streaming import route, wait, worker_of

router = APIRouter()


async def _run(request: Request, req: GenerateRequest) -> list[pooling.Pooled]:
    worker = route(request, None, req)
    collector = await worker.submit(req)
    await wait(request, collector)
    return pooling.pooled(collector)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    model, worker = await check_model(request, body.model), worker_of(request)
    if body.encoding_format not in ("float", "base64"):
        raise HTTPError(400, f"encoding_format must be 'float' or 'base64', got {body.encoding_format!r}",
                        param="encoding_format")
    pooling.check_dimensions(worker.info, body.dimensions)
    req = pooling.embed_request(worker.info, worker.tokenizer, body.input, "input",
                                body.truncate_prompt_tokens)
    results = await _run(request, req)
    data = [{"object": "embedding", "index": i,
             "embedding": p.vector if body.encoding_format == "float" else base64.b64encode(p.data).decode()}
            for i, p in enumerate(results)]
    tokens = sum(p.prompt_tokens for p in results)
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


@router.post("/v1/rerank")
@router.post("/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankRequest, request: Request):
    model, worker = await check_model(request, body.model), worker_of(request)
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
    model, worker = await check_model(request, body.model), worker_of(request)
    docs = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    req = pooling.pair_request(worker.info, worker.tokenizer, body.text_1, docs, ("text_1", "text_2"))
    results = await _run(request, req)
    tokens = sum(p.prompt_tokens for p in results)
    return {"object": "list", "model": model,
            "data": [{"object": "score", "index": i, "score": p.vector[0]} for i, p in enumerate(results)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

