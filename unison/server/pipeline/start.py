"""The one request pipeline under every API: a neutral input (pipeline/inputs.py) is checked,
rendered by the chat template, queued on a core, and handed back as an `Output` to render.

Every chat-shaped route (chat completions, Responses, Anthropic Messages, Ollama, llama-server's
templates) runs `render_chat` / `start_chat`; every completion-shaped one `start_completion`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from fastapi import Request
from pydantic import ValidationError

from unison.config import EngineConfig
from unison.errors import InvalidParam, UnknownAdapterError, check_encodable
from unison.frontend import images
from unison.frontend.collector import Collector
from unison.frontend.generate_args import GenerateArgs
from unison.frontend.pooling import expect_task
from unison.frontend.sampling_params import SamplingParams
from unison.frontend.text import harmony
from unison.frontend.text.infill import fim_tokens
from unison.frontend.text.reasoning import END as REASONING_END
from unison.frontend.text.reasoning import starts_in_reasoning
from unison.frontend.text.tokenizer import Tokenizer, normalize_messages
from unison.frontend.worker import TokenizerWorker
from unison.json_types import JSONObject
from unison.sampling import OPTIONS
from unison.server.errors import HTTPError, field_path
from unison.server.pipeline.inputs import ChatInput, TextInput
from unison.server.pipeline.output import Output
from unison.server.pipeline.tools import ToolPlan, messages_for_template, plan_tools
from unison.server.streaming import route, worker_of
from unison.wire.messages import CoreInfo, GetServerInfo, LoraAdapterInfo

RESERVED_TEMPLATE_NAMES = {"messages", "tools", "documents", "chat_template", "add_generation_prompt",
                           "continue_final_message"}
# The engine's field names as the neutral input spells them (an InvalidParam's `param`).
INPUT_NAMES = {**{o.name: o.openai for o in OPTIONS if o.openai not in (None, o.name)},
               "input_ids": "prompt", "json_schema": "response_format"}


def attached(worker: TokenizerWorker) -> tuple[Tokenizer, CoreInfo, EngineConfig]:
    """A serving worker's tokenizer, core info and engine config (set by its Welcome: a worker
    answers routes only once attached)."""
    assert worker.tokenizer is not None  # the server's engines always load one
    return worker.tokenizer, worker.info, worker.config


@dataclass
class Started:
    """A queued call: its outputs, read as typed choices, and the model it names."""

    output: Output
    model: str

    @property
    def collector(self) -> Collector:  # the call's requests, as they come from the core
        return self.output.collector


# ---- the model a request names -------------------------------------------------------------------


def model_of(request: Request, name: str | None) -> tuple[str, str | None]:
    """The model a request names and the LoRA adapter that is (None: the base model). Whether an
    adapter is loaded only the core knows: a name it lacks comes back as UnknownAdapterError,
    answered as a 404 by _submit."""
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
    served, adapter = model_of(request, name)
    if adapter is not None:
        loaded = [a.name for a in await adapters(request)]
        if adapter not in loaded:
            raise _no_model(adapter, served, loaded)
    return served if adapter is None else adapter


async def adapters(request: Request) -> list[LoraAdapterInfo]:
    """The LoRA adapters loaded in the core (the same list from any worker)."""
    if not attached(worker_of(request))[2].enable_lora:
        return []
    return (await worker_of(request).control(GetServerInfo())).lora_adapters


# ---- completions ---------------------------------------------------------------------------------


async def start_completion(body: TextInput, request: Request, default_max_tokens: int | None = 16) -> Started:
    """Check a completion, queue it, and return it started. A `suffix` makes it
    fill-in-the-middle: the prompt is the prefix, around the model's FIM tokens.
    `default_max_tokens` None: the context's rest."""
    check_encodable(body.model_dump(exclude_none=True), "")
    worker, (model, adapter) = worker_of(request), model_of(request, body.model)
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
    output = Output(collector, tokenizer, logprobs=k is not None, echo=body.echo)
    return Started(output, model)


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


def _completion_prompt(prompt) -> tuple[str | list[str] | None, list[int] | list[list[int]] | None]:
    """OpenAI's four prompt forms as (prompt, input_ids) for make_request."""
    if isinstance(prompt, str) or (prompt and all(isinstance(p, str) for p in prompt)):
        return prompt, None
    if prompt and (all(isinstance(p, int) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        return None, prompt
    raise HTTPError(400, "prompt must be a string, a list of strings, token ids, or lists of token ids",
                    param="prompt")


# ---- chats ---------------------------------------------------------------------------------------


@dataclass
class ChatPrompt:
    """A chat rendered by the chat template: its text, its token ids, its tools' plan."""

    text: str
    ids: list[int]
    tools: ToolPlan | None
    harmony: bool = False  # rendered by openai-harmony: its output is parsed by it too
    images: list[images.ImageSource] = field(default_factory=list)  # in prompt order, not yet read
    # The worker expands the images' markers in `text` and tokenizes it (pan-and-scan's text
    # depends on each picture's crops, known once it is read); `ids` then count the markers alone.
    expand_in_worker: bool = False
    # The prompt's length is known once the worker reads its pictures (pan-and-scan's crops, or a
    # grid picture's run, whose length is its size's)
    placed_in_worker: bool = False


def render_chat(body: ChatInput, request: Request, *, refuse_past_context: bool = True) -> ChatPrompt:
    """Check a chat's messages and tools and render them: the one place messages become a
    prompt (by the chat template, or by openai-harmony for a harmony model). A prompt longer than
    the context is refused unless `refuse_past_context` is off (/tokenize counts it)."""
    check_encodable(body.model_dump(exclude_none=True), "")
    tokenizer, info, _ = attached(worker_of(request))
    expect_task(info, "generate", "chat")  # before the chat template, which an encoder lacks
    limit = info.context_length if refuse_past_context else None
    messages, sources = images.take_images([m.model_dump(exclude_none=True) for m in body.messages])
    if sources and info.image is None:
        raise HTTPError(400, f"{sources[0].field}: this model takes no images (a text-only model)",
                        param=sources[0].field)
    if tokenizer.harmony is not None:
        return _render_harmony(body, request, tokenizer, limit)
    tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                       request.app.state.settings.serve.tool_call_parser)
    if tools is not None:
        messages = messages_for_template(messages)
    reserved = sorted(set(body.chat_template_kwargs or {}) & RESERVED_TEMPLATE_NAMES)
    if reserved:
        raise HTTPError(400, f"chat_template_kwargs may not set {reserved}: they are request fields",
                        param="chat_template_kwargs")
    variables: JSONObject = ({"reasoning_effort": body.reasoning_effort} if body.reasoning_effort else {}) \
        | (body.chat_template_kwargs or {})
    text = tokenizer.apply_chat_template(
        messages, **variables, add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message, tools=tools.tools if tools else None,
        chat_template=request.app.state.chat_template)
    later = bool(sources) and info.image is not None and info.image.pan_and_scan is not None
    if sources and not later:  # each image marker the template wrote becomes the image's placeholders
        assert info.image is not None  # (refused above otherwise)
        text = images.expand(text, [0] * len(sources), info.image, "messages")
    # The template writes its own special tokens: none more unless asked (vLLM's default).
    ids = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens), limit=limit,
                           field="messages")
    grid = bool(sources) and info.image is not None and info.image.patches is not None
    return ChatPrompt(text, ids, tools, images=sources, expand_in_worker=later,
                      placed_in_worker=later or grid)


async def placed_ids(prompt: ChatPrompt, body: ChatInput, request: Request) -> list[int]:
    """The ids a chat's request has once its pictures are read (/tokenize's count): each grid
    picture's marker made its run, or pan-and-scan's text expanded by its crops, as the worker
    does (the same functions, the pictures read and prepared here too)."""
    worker = worker_of(request)
    tokenizer, info, _ = attached(worker)
    spec = info.image
    if not prompt.placed_in_worker or spec is None:
        return prompt.ids  # (no picture, or a fixed run already in the text)
    args = GenerateArgs(image_data=list(prompt.images))
    await worker.fetch_image_urls(args)
    pictures = worker.prepare_images(args.image_data)
    if prompt.expand_in_worker:
        text = images.expand(prompt.text, [len(p.crops) for p in pictures], spec, "messages")
        return tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens), field="messages")
    return images.place(prompt.ids, pictures, spec, "messages")[0]


def _render_harmony(body: ChatInput, request: Request, tokenizer: Tokenizer, limit: int | None) -> ChatPrompt:
    """A harmony model's chat: openai-harmony renders it (no template), and parses its calls."""
    assert tokenizer.harmony is not None  # (the caller's test)
    if body.continue_final_message:
        raise HTTPError(400, "continue_final_message is not supported with the harmony format (gpt-oss): "
                             "its messages end on their channel's end token", param="continue_final_message")
    harmony.check_tools(body.tools)
    tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, None, native=True)
    effort = body.reasoning_effort or (body.chat_template_kwargs or {}).get("reasoning_effort")
    if effort is not None and effort not in harmony.EFFORTS:
        raise HTTPError(400, f"reasoning_effort must be one of {list(harmony.EFFORTS)}, got {effort!r}",
                        param="reasoning_effort")
    messages = normalize_messages([{**m, "role": "system"} if m["role"] == "developer" else m
                                   for m in (m.model_dump(exclude_none=True) for m in body.messages)])
    ids = harmony.render_prompt(tokenizer.harmony, messages, tools.tools if tools else None, effort,
                                body.add_generation_prompt)
    if limit is not None and len(ids) > limit:
        raise HTTPError(400, f"messages: the prompt ({len(ids)} tokens) exceeds the context length ({limit})",
                        param="messages")
    return ChatPrompt(tokenizer.decode(ids, skip_special_tokens=False), ids, tools, harmony=True)


async def start_chat(body: ChatInput, request: Request) -> Started:
    """Check a chat, queue it, and return it started."""
    worker, (model, adapter) = worker_of(request), model_of(request, body.model)
    if body.top_logprobs and not body.logprobs:
        raise HTTPError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    prompt = render_chat(body, request)
    tokenizer, info, config = attached(worker)
    text, prompt_ids, tools = prompt.text, prompt.ids, prompt.tools
    # A grid picture's run (or pan-and-scan's text) is placed by the worker, once the picture is
    # read: the prompt's length, and what the context leaves for the output, are known there.
    later = prompt.placed_in_worker
    params = body.sampling_params(None if later else max(info.context_length - len(prompt_ids), 1),
                                  request.app.state.sampling_defaults)
    if tools is not None and tools.schemas is not None:  # required / named: valid calls only
        if params.grammar_kind is not None:
            raise HTTPError(400, f"tool_choice {body.tool_choice!r} constrains the output itself; "
                                 "it cannot be combined with response_format", param="tool_choice")
        if prompt.harmony:  # a call on commentary, after any analysis
            params.ebnf = harmony.call_grammar(tools.schemas)
        else:
            params.json_schema = tools.json_schema
    parser = None if prompt.harmony else config.reasoning_parser
    if prompt.harmony:
        _harmony_params(params, tokenizer)
    elif parser and starts_in_reasoning(parser, text) and params.grammar_kind is not None:
        # the constraint holds the answer, after the reasoning section (as SGLang's)
        params.structured_after = tokenizer.encode(REASONING_END, add_special_tokens=False)
    try:
        given = {"prompt": text} if prompt.expand_in_worker else {"input_ids": prompt_ids}
        args = GenerateArgs(**given, sampling_params=params, return_logprob=body.logprobs,
                            top_logprobs_num=body.top_logprobs or 0, priority=body.priority,
                            lora_path=adapter, image_data=prompt.images or None)
        collector = await _submit(request, worker, text, args, bool(body.add_special_tokens))
    except InvalidParam as e:  # the limit came as max_completion_tokens: name that
        if e.field != "max_new_tokens" or body.max_completion_tokens is None:
            raise
        raise HTTPError(400, str(e).replace("max_new_tokens", "max_completion_tokens", 1),
                        param="max_completion_tokens") from None
    output = Output(collector, tokenizer, logprobs=body.logprobs, tools=tools,
                    reasoning=(parser, text) if parser else None, harmony=prompt.harmony)
    return Started(output, model)


def _harmony_params(params: SamplingParams, tokenizer: Tokenizer) -> None:
    """A harmony reply ends on <|call|> or <|return|> (never <|end|>, which closes its analysis),
    and a JSON schema holds its final answer, not its reasoning. A regex or a grammar holds the
    whole reply, channels and all."""
    assert tokenizer.harmony is not None  # (a harmony prompt's)
    stops = tokenizer.harmony.stop_tokens_for_assistant_actions()
    params.stop_token_ids = list(dict.fromkeys([*(params.stop_token_ids or []), *stops]))
    if params.grammar_kind == "json_schema":
        params.structured_after = tokenizer.encode(harmony.FINAL, add_special_tokens=False)


# ---- queueing and errors -------------------------------------------------------------------------


async def _submit(request: Request, worker: TokenizerWorker, text: str | None, args: GenerateArgs,
                  add_special_tokens: bool = True) -> Collector:
    """Check with any replica's frontend, then queue on the one routing picks for `text`."""
    await worker.fetch_image_urls(args)
    req = worker.make_request(args, add_special_tokens)  # an InvalidParam: the app's handler names the field
    req.batch = True  # choices are indexed whatever the prompt's form
    collector = await route(request, text, req).submit(req)
    try:
        await collector.admitted()  # a full engine queue is a 503 now, not an error inside a stream
    except UnknownAdapterError as e:  # an adapter is named as the model (vLLM's)
        raise HTTPError(404, f"model {args.lora_path!r} does not exist: {e}", param="model") from None
    return collector


def invalid_param(e: InvalidParam, input_names: bool, chat: bool = False) -> HTTPError:
    """An engine InvalidParam as a 400; with `input_names`, in the neutral input's names (as the
    /v1 routes spell them)."""
    field, message = e.field, str(e)
    if input_names:
        field = INPUT_NAMES.get(field, field)
        message = message.replace(e.field, field)  # (max_new_tokens's message names it twice)
        if chat and field == "prompt":
            field = "messages"  # the prompt is the chat template's output
    return HTTPError(400, message, param=field)


@contextmanager
def names_of(rules: list[tuple[str, str]], chat: bool = False) -> Iterator[None]:
    """The pipeline's errors (in the neutral input's field names) in another API's names: `rules`
    as HTTPError.renamed takes them. The block translates the API's body into the neutral input
    and starts it."""
    try:
        yield
    except HTTPError as e:
        raise e.renamed(rules) from None
    except InvalidParam as e:  # a sampling field, in the input's names first
        raise invalid_param(e, input_names=True, chat=chat).renamed(rules) from None
    except ValidationError as e:  # the translated body: a value past the input's own field's range
        first = e.errors()[0]
        param = field_path(first["loc"])
        raise HTTPError(400, f"{param or 'body'}: {first['msg']}", param=param).renamed(rules) from None

