"""The OpenAI routes: /v1/completions, /v1/chat/completions, /v1/models; and vLLM's /tokenize,
/detokenize and /version beside them."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from fastapi import APIRouter, Request
from pydantic import ValidationError

from unison.config import EngineConfig
from unison.errors import InvalidParam, UnknownAdapterError, check_encodable
from unison.frontend.collector import Collector
from unison.frontend.generate_args import GenerateArgs
from unison.frontend.infill import fim_tokens
from unison.frontend.pooling import expect_task
from unison.frontend.reasoning import END as REASONING_END
from unison.frontend.reasoning import starts_in_reasoning
from unison.frontend.tokenizer import Tokenizer
from unison.frontend.worker import TokenizerWorker
from unison.protocol import CoreInfo, GetServerInfo, LoraAdapterInfo
from unison.server.errors import HTTPError, field_path
from unison.server.openai_format import Formatter, invalid_param
from unison.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from unison.server.openai_tools import ToolPlan, messages_for_template, plan_tools
from unison.server.streaming import route, stream, wait, worker_of
from unison.version import __version__

router = APIRouter()
RESERVED_TEMPLATE_NAMES = {"messages", "tools", "documents", "chat_template", "add_generation_prompt",
                           "continue_final_message"}


def attached(worker: TokenizerWorker) -> tuple[Tokenizer, CoreInfo, EngineConfig]:
    """A serving worker's tokenizer, core info and engine config (set by its Welcome: a worker
    answers routes only once attached)."""
    assert worker.tokenizer is not None  # the server's engines always load one
    return worker.tokenizer, worker.info, worker.config


def _model_of(request: Request, name: str | None) -> tuple[str, str | None]:
    """The model a request names and the LoRA adapter that is (None: the base model). Whether an
    adapter is loaded only the core knows: a name it lacks comes back as UnknownAdapterError,
    answered as this 404 by _submit."""
    served = request.app.state.settings.served_model_name
    if name in (None, served):
        return served, None
    if not attached(worker_of(request))[2].enable_lora:
        raise _no_model(name, served)
    return name, name


def _no_model(name: str, served: str, adapters: list[str] | None = None) -> HTTPError:
    also = f" and the LoRA adapters {adapters}" if adapters is not None else ""
    return HTTPError(404, f"model {name!r} does not exist; this server serves {served!r}{also}",
                     param="model")


async def check_model(request: Request, name: str | None) -> str:
    """The model a request names, checked now (routes that queue nothing in the core)."""
    served, adapter = _model_of(request, name)
    if adapter is not None:
        loaded = [a.name for a in await _adapters(request)]
        if adapter not in loaded:
            raise _no_model(adapter, served, loaded)
    return served if adapter is None else adapter


async def _adapters(request: Request) -> list[LoraAdapterInfo]:
    if not attached(worker_of(request))[2].enable_lora:
        return []
    return (await worker_of(request).control(GetServerInfo())).lora_adapters


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
    cards += [_model_card(request, a.name, a) for a in await _adapters(request)]
    return {"object": "list", "data": cards}


@router.get("/v1/models/{model:path}")
async def model(model: str, request: Request):
    name = await check_model(request, model)
    adapter = next((a for a in await _adapters(request) if a.name == name), None)
    return _model_card(request, name, adapter)


@router.get("/version")
async def version():
    return {"version": __version__}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    check_encodable(body.model_dump(exclude_none=True), "")
    tokenizer, info, _ = attached(worker_of(request))
    await check_model(request, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise HTTPError(400, "give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        text = tokenizer.apply_chat_template([m.model_dump(exclude_none=True) for m in body.messages],
                                             add_generation_prompt=body.add_generation_prompt,
                                             chat_template=request.app.state.chat_template)
        special = bool(body.add_special_tokens)  # the template writes its own
    else:
        assert body.prompt is not None  # (exactly one of the two: checked above)
        text, special = body.prompt, body.add_special_tokens is not False
    tokens = tokenizer.encode(text, add_special_tokens=special)
    strs = [tokenizer.decode([t], skip_special_tokens=False) for t in tokens] \
        if body.return_token_strs else None
    return {"count": len(tokens), "max_model_len": info.context_length, "tokens": tokens,
            "token_strs": strs}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    tokenizer, info, _ = attached(worker_of(request))
    await check_model(request, body.model)
    vocab = info.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise HTTPError(400, f"tokens must hold token ids in [0, {vocab - 1}], got {bad}", param="tokens")
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    collector, fmt = await start_completion(body, request)
    return await _respond(request, collector, fmt, body.stream, body.include_usage)


async def start_completion(body: CompletionRequest, request: Request, default_max_tokens: int | None = 16
                           ) -> tuple[Collector, Formatter]:
    """Check a completion request, queue it, and return its outputs' collector and formatter (the
    Ollama and llama-server routes run on this too). A `suffix` makes it fill-in-the-middle: the
    prompt is the prefix, around the model's FIM tokens. `default_max_tokens` None: the context's
    rest."""
    check_encodable(body.model_dump(exclude_none=True), "")
    worker, (model, adapter) = worker_of(request), _model_of(request, body.model)
    tokenizer = attached(worker)[0]
    if (body.best_of or 1) > 1:
        raise HTTPError(400, "best_of is not supported (send n)", param="best_of")
    prompt, input_ids = _completion_prompt(body.prompt)
    if body.suffix is not None:
        if not isinstance(prompt, str):
            raise HTTPError(400, "with a suffix, prompt must be one string: the text before the gap",
                            param="prompt")
        input_ids = infill_prompt(request, model, prompt, body.suffix, "suffix")
        prompt = None
    k = body.logprobs
    head = prompt if isinstance(prompt, str) else prompt[0] if prompt else None
    params = body.sampling_params(default_max_tokens, request.app.state.sampling_defaults)
    args = GenerateArgs(prompt=prompt, input_ids=input_ids, sampling_params=params,
                        return_logprob=k is not None, logprob_start_len=0 if body.echo else -1,
                        top_logprobs_num=k or 0, priority=body.priority, lora_path=adapter)
    collector = await _submit(request, worker, head, args, body.add_special_tokens is not False)
    fmt = Formatter(tokenizer, collector, chat=False, rid=f"cmpl-{uuid.uuid4().hex}", model=model,
                    logprobs=k is not None, top_n=k or 0, echo=body.echo,
                    tokens_as_ids=body.return_tokens_as_token_ids)
    return collector, fmt


def infill_prompt(request: Request, model: str, prefix: str, suffix: str, field: str, middle: str = "",
                  extra: list[tuple[str, str]] | None = None) -> list[int]:
    """A fill-in-the-middle prompt's ids; refused, naming the model and `field`, for a model
    without FIM tokens."""
    tokenizer = attached(worker_of(request))[0]
    fim = fim_tokens(tokenizer)
    if fim is None:
        raise HTTPError(400, f"{field}: model {model!r} has no fill-in-the-middle tokens (such as "
                             "<|fim_prefix|>, <fim_prefix>); infill needs a model trained for it",
                        param=field)
    return fim.prompt(tokenizer, prefix, suffix, middle, extra)


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, request: Request):
    collector, fmt = await start_chat(body, request)
    return await _respond(request, collector, fmt, body.stream, body.include_usage)


@dataclass
class ChatPrompt:
    """A chat request rendered by the chat template: its text, its token ids, its tools' plan."""

    text: str
    ids: list[int]
    tools: ToolPlan | None


def render_chat(body: ChatCompletionRequest, request: Request) -> ChatPrompt:
    """Check a chat request's messages and tools and render them: the one place every chat-shaped
    route (chat completions, Responses, Anthropic Messages, Ollama, llama-server's templates)
    turns messages into a prompt."""
    check_encodable(body.model_dump(exclude_none=True), "")
    tokenizer, info, _ = attached(worker_of(request))
    expect_task(info, "generate", "chat")  # before the chat template, which an encoder lacks
    tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                       request.app.state.settings.serve.tool_call_parser)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    if tools is not None:
        messages = messages_for_template(messages)
    reserved = sorted(set(body.chat_template_kwargs or {}) & RESERVED_TEMPLATE_NAMES)
    if reserved:
        raise HTTPError(400, f"chat_template_kwargs may not set {reserved}: they are request fields",
                        param="chat_template_kwargs")
    text = tokenizer.apply_chat_template(
        messages, **(body.chat_template_kwargs or {}), add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message, tools=tools.tools if tools else None,
        chat_template=request.app.state.chat_template)
    # The template writes its own special tokens: none more unless asked (vLLM's default).
    return ChatPrompt(text, tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens)), tools)


async def start_chat(body: ChatCompletionRequest, request: Request) -> tuple[Collector, Formatter]:
    """Check a chat request, queue it, and return its outputs' collector and formatter (the
    Responses, Anthropic and Ollama routes run on this too)."""
    worker, (model, adapter) = worker_of(request), _model_of(request, body.model)
    if body.top_logprobs and not body.logprobs:
        raise HTTPError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    prompt = render_chat(body, request)
    tokenizer, info, config = attached(worker)
    text, prompt_ids, tools = prompt.text, prompt.ids, prompt.tools
    context = info.context_length
    params = body.sampling_params(max(context - len(prompt_ids), 1), request.app.state.sampling_defaults)
    if tools is not None and tools.json_schema is not None:  # required / named: valid calls only
        if params.grammar_kind is not None:
            raise HTTPError(400, f"tool_choice {body.tool_choice!r} constrains the output itself; "
                                 "it cannot be combined with response_format", param="tool_choice")
        params.json_schema = tools.json_schema
    parser = config.reasoning_parser
    if parser and starts_in_reasoning(parser, text) and params.grammar_kind is not None:
        # the constraint holds the answer, after the reasoning section (as SGLang's)
        params.structured_after = tokenizer.encode(REASONING_END, add_special_tokens=False)
    try:
        args = GenerateArgs(input_ids=prompt_ids, sampling_params=params, return_logprob=body.logprobs,
                            top_logprobs_num=body.top_logprobs or 0, priority=body.priority,
                            lora_path=adapter)
        collector = await _submit(request, worker, text, args)
    except InvalidParam as e:  # the limit came as max_completion_tokens: name that
        if e.field != "max_new_tokens" or body.max_completion_tokens is None:
            raise
        raise HTTPError(400, str(e).replace("max_new_tokens", "max_completion_tokens", 1),
                        param="max_completion_tokens") from None
    fmt = Formatter(tokenizer, collector, chat=True, rid=f"chatcmpl-{uuid.uuid4().hex}",
                    model=model, logprobs=body.logprobs, top_n=body.top_logprobs or 0,
                    tokens_as_ids=body.return_tokens_as_token_ids, tools=tools,
                    reasoning=(parser, text) if parser else None)
    return collector, fmt


@contextmanager
def names_of(rules: list[tuple[str, str]], chat: bool = False) -> Iterator[None]:
    """Errors of the pipeline (in the chat or completion fields' names) in another API's names:
    `rules` as HTTPError.renamed takes them. The block translates the API's body into the chat's
    or the completion's and starts it."""
    try:
        yield
    except HTTPError as e:
        raise e.renamed(rules) from None
    except InvalidParam as e:  # a sampling field, in OpenAI's names first
        raise invalid_param(e, openai=True, chat=chat).renamed(rules) from None
    except ValidationError as e:  # the translated body: a value past the chat's own field's range
        first = e.errors()[0]
        param = field_path(first["loc"])
        raise HTTPError(400, f"{param or 'body'}: {first['msg']}", param=param).renamed(rules) from None


async def _submit(request: Request, worker: TokenizerWorker, text: str | None, args: GenerateArgs,
                  add_special_tokens: bool = True) -> Collector:
    """Check with any replica's frontend, then queue on the one routing picks for `text`."""
    req = worker.make_request(args, add_special_tokens)  # an InvalidParam: the app's handler names the field
    req.batch = True  # choices are indexed whatever the prompt's form
    collector = await route(request, text, req).submit(req)
    try:
        await collector.admitted()  # a full engine queue is a 503 now, not an error inside a stream
    except UnknownAdapterError as e:  # OpenAI names an adapter as the model (vLLM's)
        raise HTTPError(404, f"model {args.lora_path!r} does not exist: {e}", param="model") from None
    return collector


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
