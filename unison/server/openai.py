"""The OpenAI routes: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from unison.errors import InvalidParam
from unison.frontend.collector import Collector
from unison.frontend.worker import TokenizerWorker
from unison.server.openai_format import Formatter, HTTPError, invalid_param
from unison.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from unison.server.streaming import check_queue, stream, wait, worker_of

router = APIRouter()


def _check_model(request: Request, name: str | None) -> str:
    served = request.app.state.settings.served_model_name
    if name not in (None, served):
        raise HTTPError(404, f"model {name!r} does not exist; this server serves {served!r}", param="model")
    return served


@router.get("/v1/models")
async def models(request: Request):
    served = request.app.state.settings.served_model_name
    return {"object": "list", "data": [{"id": served, "object": "model", "owned_by": "unison",
                                        "created": int(time.time())}]}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    worker, model = worker_of(request), _check_model(request, body.model)
    if body.suffix or (body.best_of or 1) > 1:
        raise HTTPError(400, "suffix and best_of are not supported", param="suffix")
    prompt, input_ids = _completion_prompt(body.prompt)
    k = body.logprobs
    collector = await _submit(request, worker, chat=False, prompt=prompt, input_ids=input_ids,
                              sampling_params=body.sampling_params(default_max_tokens=16),
                              return_logprob=k is not None, logprob_start_len=0 if body.echo else -1,
                              top_logprobs_num=k or 0, priority=body.priority)
    fmt = Formatter(worker.tokenizer, collector, chat=False, rid=f"cmpl-{uuid.uuid4().hex}", model=model,
                    logprobs=k is not None, top_n=k or 0, echo=body.echo)
    return await _respond(request, collector, fmt, body.stream, body.include_usage)


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, request: Request):
    worker, model = worker_of(request), _check_model(request, body.model)
    if body.tools or body.tool_choice not in (None, "none"):
        raise HTTPError(400, "tool calling is not supported by this server yet", param="tools")
    if body.top_logprobs and not body.logprobs:
        raise HTTPError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    text = worker.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    prompt_ids = worker.tokenizer.encode(text, add_special_tokens=False)  # the template has them
    context = worker.info.context_length
    params = body.sampling_params(default_max_tokens=max(context - len(prompt_ids), 1))
    collector = await _submit(request, worker, chat=True, input_ids=prompt_ids, sampling_params=params,
                              return_logprob=body.logprobs, top_logprobs_num=body.top_logprobs or 0,
                              priority=body.priority)
    fmt = Formatter(worker.tokenizer, collector, chat=True, rid=f"chatcmpl-{uuid.uuid4().hex}",
                    model=model, logprobs=body.logprobs, top_n=body.top_logprobs or 0)
    return await _respond(request, collector, fmt, body.stream, body.include_usage)


async def _submit(request: Request, worker: TokenizerWorker, *, chat: bool, **call) -> Collector:
    try:
        req = worker.make_request(**call)
    except InvalidParam as e:
        raise invalid_param(e, openai=True, chat=chat) from None
    check_queue(request)
    req.batch = True  # choices are indexed whatever the prompt's form
    return await worker.submit(req)


async def _respond(request: Request, collector: Collector, fmt: Formatter, streaming: bool,
                   include_usage: bool):
    if streaming:
        return stream(collector, fmt.chunks, lambda: [fmt.usage_chunk()] if include_usage else [])
    await wait(request, collector)
    return fmt.final()


def _completion_prompt(prompt) -> tuple[str | list[str] | None, list[int] | list[list[int]] | None]:
    """OpenAI's four prompt forms as (prompt, input_ids) for make_request."""
    if isinstance(prompt, str) or (prompt and all(isinstance(p, str) for p in prompt)):
        return prompt, None
    if prompt and (all(isinstance(p, int) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        return None, prompt
    raise HTTPError(400, "prompt must be a string, a list of strings, token ids, or lists of token ids",
                    param="prompt")
