"""The OpenAI routes: /v1/completions, /v1/chat/completions, /v1/models; and vLLM's /tokenize,
/detokenize and /version beside them."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from unison.errors import check_encodable
from unison.frontend.text.tokenizer import Tokenizer
from unison.json_types import JSONObject
from unison.server.apis.openai.bodies import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from unison.server.apis.openai.render import Renderer
from unison.server.errors import HTTPError
from unison.server.pipeline.inputs import ChatInput
from unison.server.pipeline.start import (
    Started,
    adapters,
    attached,
    check_model,
    placed_ids,
    render_chat,
    start_chat,
    start_completion,
)
from unison.server.streaming import stream, wait, worker_of
from unison.version import __version__
from unison.wire.messages import LoraAdapterInfo

router = APIRouter()


def _model_card(request: Request, name: str, adapter: LoraAdapterInfo | None = None) -> dict:
    """vLLM's model card: an adapter's names its path as `root` and the base model as `parent`."""
    served = request.app.state.settings.served_model_name
    return {"id": name, "object": "model", "owned_by": "unison",
            "created": int(adapter.loaded_at if adapter else time.time()),
            "root": adapter.path if adapter else served, "parent": served if adapter else None,
            "max_model_len": attached(worker_of(request))[1].context_length,
            "task": attached(worker_of(request))[1].task}  # generate | embed | rerank


@router.get("/v1/models")
async def models(request: Request):
    """The base model, then every LoRA adapter loaded in the core (the same list from any worker)."""
    cards = [_model_card(request, request.app.state.settings.served_model_name)]
    cards += [_model_card(request, a.name, a) for a in await adapters(request)]
    return {"object": "list", "data": cards}


@router.get("/v1/models/{model:path}")
async def model(model: str, request: Request):
    name = await check_model(request, model)
    adapter = next((a for a in await adapters(request) if a.name == name), None)
    return _model_card(request, name, adapter)


@router.get("/version")
async def version():
    return {"version": __version__}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    check_encodable(body.model_dump(exclude_none=True), "")
    tokenizer, info, _ = attached(worker_of(request))
    await check_model(request, body.model)
    if body.content is not None:
        return _llama_tokenize(body, tokenizer)
    if (body.prompt is None) == (body.messages is None):
        raise HTTPError(400, "give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:  # rendered as a chat request's are (the template writes its own specials)
        chat = ChatInput(messages=body.messages, add_generation_prompt=body.add_generation_prompt,
                         add_special_tokens=body.add_special_tokens, tools=body.tools, tool_choice="none"
                         if body.tools else None, chat_template_kwargs=body.chat_template_kwargs)
        tokens = await placed_ids(render_chat(chat, request, refuse_past_context=False), chat, request)
    else:
        assert body.prompt is not None  # (exactly one of the two: checked above)
        tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    strs = [tokenizer.decode([t], skip_special_tokens=False) for t in tokens] \
        if body.return_token_strs else None
    return {"count": len(tokens), "max_model_len": info.context_length, "tokens": tokens,
            "token_strs": strs}


def _llama_tokenize(body: TokenizeRequest, tokenizer: Tokenizer) -> JSONObject:
    """llama-server's /tokenize: {"tokens": [ids]}, or with_pieces [{"id", "piece"}]."""
    assert body.content is not None  # (its body)
    if body.prompt is not None or body.messages is not None:
        raise HTTPError(400, "give content (llama-server's body) or prompt / messages (vLLM's), not both",
                        param="content")
    if not body.parse_special:
        raise HTTPError(400, "parse_special false is not supported: special tokens in the text are read "
                             "as special tokens", param="parse_special")
    tokens = tokenizer.encode(body.content, add_special_tokens=body.add_special)
    if not body.with_pieces:
        return {"tokens": tokens}
    return {"tokens": [{"id": t, "piece": tokenizer.decode([t], skip_special_tokens=False)} for t in tokens]}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    tokenizer, info, _ = attached(worker_of(request))
    await check_model(request, body.model)
    vocab = info.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise HTTPError(400, f"tokens must hold token ids in [0, {vocab - 1}], got {bad}", param="tokens")
    text = tokenizer.decode(body.tokens, skip_special_tokens=False)
    # The two servers take the same body and name the text differently: vLLM "prompt",
    # llama-server "content". Both keys answer either client.
    return {"prompt": text, "content": text}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    return await _respond(request, await start_completion(body, request), body, "cmpl", body.logprobs)


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, request: Request):
    return await _respond(request, await start_chat(body, request), body, "chatcmpl", body.top_logprobs)


async def _respond(request: Request, started: Started, body: CompletionRequest | ChatCompletionRequest,
                   kind: str, top_n: int | None):
    out = Renderer(started, chat=kind == "chatcmpl", rid=f"{kind}-{uuid.uuid4().hex}", top_n=top_n or 0,
                   tokens_as_ids=body.return_tokens_as_token_ids)
    if body.stream:
        tail = (lambda: [out.usage_chunk()]) if body.include_usage else list
        return stream(started.collector, out.chunks, tail)
    await wait(request, started.collector)
    return out.final()
