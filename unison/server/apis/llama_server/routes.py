"""llama-server's own routes: `/completion` (its field names, streamed as its chunks), `/infill`
(fill-in-the-middle from the model's FIM tokens, what editor plugins call), `/props`,
`/apply-template` and `/slots` (a read-only view of the requests the core holds).

`/completion` and `/infill` run through the pipeline's completion; their errors are OpenAI's shape,
as llama-server's, naming the field in llama-server's names.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from unison.frontend.request import LengthFinish, StopFinish
from unison.json_types import JSONObject
from unison.sampling import MAX_TOP_LOGPROBS
from unison.server.apis.llama_cpp import LLAMA_CPP_SAMPLING, LlamaCppSampling
from unison.server.errors import HTTPError
from unison.server.pipeline.inputs import ChatInput, ChatMessage, TextInput, json_schema_format
from unison.server.pipeline.output import Logprobs, stop_string
from unison.server.pipeline.start import (
    Started,
    attached,
    check_model,
    infill_prompt,
    names_of,
    render_chat,
    start_completion,
)
from unison.server.streaming import Timer, stream, wait, worker_of
from unison.version import __version__
from unison.wire.messages import GetRequests

router = APIRouter()
SAMPLING = LLAMA_CPP_SAMPLING | {"ignore_eos": "ignore_eos", "grammar": "ebnf"}
# ... and back, for the pipeline's errors.
RENAMED = [(chat, name) for name, chat in SAMPLING.items() if chat != name] + [
    ("max_tokens", "n_predict"), ("logprobs", "n_probs"), ("response_format", "json_schema")]


class CompletionBody(LlamaCppSampling):
    """llama-server's /completion: the fields it documents that change what is generated."""

    prompt: str | list[int]
    model: str | None = None
    n_predict: int = Field(default=-1, ge=-1)  # -1: until the context ends
    seed: int = -1  # -1: a random seed
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | list[tuple[int | str, float]] | None = None
    grammar: str | None = None  # GBNF
    json_schema: JSONObject | None = None
    n_probs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    stream: bool = False
    return_tokens: bool = False
    cache_prompt: bool = True  # accepted: the prefix cache is always on
    id_slot: int = -1  # accepted: the scheduler places requests, not the client

    def to_completion(self, prompt: str | list[int]) -> TextInput:
        fields = self.given(SAMPLING)
        schema = json_schema_format(self.json_schema, "output")
        bias = dict(self.logit_bias) if isinstance(self.logit_bias, list) else self.logit_bias
        return TextInput.model_validate(dict(
            model=self.model, prompt=prompt, max_tokens=None if self.n_predict == -1 else self.n_predict,
            seed=None if self.seed == -1 else self.seed, logit_bias=bias, logprobs=self.n_probs or None,
            response_format=schema if self.json_schema is not None else None, **fields))


class InfillBody(CompletionBody):
    """/infill: the gap's two sides, other files as context, and `prompt`: how the middle starts."""

    prompt: str = ""  # (text only here)
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[JSONObject] = []


class ApplyTemplateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    messages: list[ChatMessage]
    tools: list[JSONObject] | None = None
    chat_template_kwargs: JSONObject | None = None
    add_generation_prompt: bool = True


@router.post("/completion")
@router.post("/completions")
async def completion(body: CompletionBody, request: Request):
    return await _run(request, body, body.prompt)


@router.post("/infill")
async def infill(body: InfillBody, request: Request):
    model = await check_model(request, body.model)
    extra = [_extra(e, i) for i, e in enumerate(body.input_extra)]
    ids = infill_prompt(request, model, body.input_prefix, body.input_suffix, "input_prefix", body.prompt,
                        extra)
    return await _run(request, body, ids)


def _extra(chunk: JSONObject, i: int) -> tuple[str, str]:
    name, text = chunk.get("filename", ""), chunk.get("text")
    if not isinstance(name, str) or not isinstance(text, str):
        raise HTTPError(400, f"input_extra[{i}] must be {{\"filename\": ..., \"text\": ...}}",
                        param=f"input_extra[{i}]")
    return name, text


async def _run(request: Request, body: CompletionBody, prompt: str | list[int]):
    with names_of(RENAMED):
        started = await start_completion(body.to_completion(prompt), request, default_max_tokens=None)
    out = Chunks(body, started)
    if body.stream:
        return stream(started.collector, out.chunks, out.tail, done=False)
    await wait(request, started.collector, out.timer.seen)
    choice = started.output.choices()[0]
    return out.final(choice.content or "", choice.logprobs)


class Chunks:
    """One completion's chunks (streamed) or object, in llama-server's fields."""

    def __init__(self, body: CompletionBody, started: Started) -> None:
        self.body, self.output, self.model = body, started.output, started.model
        self.collector = started.collector
        self.timer = Timer(started.collector)
        self.sent_ids = 0

    def chunks(self, changed: list[int]) -> list[JSONObject]:
        self.timer.seen(changed)
        return [self._chunk(d.content, d.logprobs) | {"stop": False} for d in self.output.deltas(changed)
                if d.content or (d.logprobs and d.logprobs.tokens)]

    def tail(self) -> list[JSONObject]:
        return self.chunks([]) + [self.final("", None)]

    def _chunk(self, text: str, logprobs: Logprobs | None) -> JSONObject:
        ids = self.collector.states[0].output_ids
        new, self.sent_ids = ids[self.sent_ids:], len(ids)
        out: JSONObject = {"index": 0, "content": text, "tokens": new if self.body.return_tokens else [],
                           "id_slot": 0}
        if logprobs and logprobs.tokens:
            out["completion_probabilities"] = self._probabilities(logprobs)
        return out

    def final(self, text: str, logprobs: Logprobs | None) -> JSONObject:
        """The last chunk (streamed), or the whole answer: the text, why it stopped, the counts."""
        state = self.collector.states[0]
        reason, matched = state.finish_reason, stop_string(state.finish_reason)
        stop_type = "limit" if isinstance(reason, LengthFinish) else "word" if matched is not None \
            else "eos" if isinstance(reason, StopFinish) else "none"
        usage = self.output.usage()
        prompt_s, output_s = self.timer.split()
        return self._chunk(text, logprobs) | {
            "stop": True, "model": self.model, "stop_type": stop_type, "stopping_word": matched or "",
            "tokens_predicted": usage.completion_tokens, "tokens_evaluated": usage.prompt_tokens,
            "tokens_cached": usage.cached_tokens, "truncated": False, "has_new_line": "\n" in state.text,
            "timings": _timings(usage.prompt_tokens, prompt_s, usage.completion_tokens, output_s)}

    def _probabilities(self, lps: Logprobs) -> list[JSONObject]:
        """Logprobs as llama-server's completion_probabilities: each token with its top
        alternatives, one per distinct text, best first."""
        def entry(token: str, logprob: float | None) -> JSONObject:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
        text, top_n, out = self.output.token_text, self.body.n_probs, []
        for k, (lp, tid, _) in enumerate(lps.tokens):
            top = {text(tt): tl for tl, tt, _ in (lps.top[k] if k < len(lps.top) else [])[:top_n]}
            out.append(entry(text(tid), lp) | {"top_logprobs": [entry(t, v) for t, v in top.items()]})
        return out


def _timings(prompt_n: int, prompt_s: float, predicted_n: int, predicted_s: float) -> JSONObject:
    return {"prompt_n": prompt_n, "prompt_ms": prompt_s * 1e3,
            "prompt_per_second": prompt_n / prompt_s if prompt_s > 0 else 0.0,
            "predicted_n": predicted_n, "predicted_ms": predicted_s * 1e3,
            "predicted_per_second": predicted_n / predicted_s if predicted_s > 0 else 0.0}


@router.post("/apply-template")
async def apply_template(body: ApplyTemplateBody, request: Request):
    # The tools are rendered alike whatever the choice; "none" needs no tool-call parser.
    chat = ChatInput(messages=body.messages, tools=body.tools,
                                 tool_choice="none" if body.tools else None,
                                 chat_template_kwargs=body.chat_template_kwargs,
                                 add_generation_prompt=body.add_generation_prompt)
    return {"prompt": render_chat(chat, request).text}


@router.get("/props")
async def props(request: Request):
    tokenizer, info, config = attached(worker_of(request))
    defaults = request.app.state.sampling_defaults
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    return {"default_generation_settings": {"n_ctx": info.context_length, "params": defaults},
            "total_slots": config.max_running_requests, "model_path": config.model_path or info.model_dir,
            "model_alias": request.app.state.settings.served_model_name, "chat_template": template or "",
            "modalities": {"vision": False, "audio": False}, "build_info": f"unison {__version__}",
            "bos_token": tokenizer.bos_token or "", "eos_token": tokenizer.eos_token or "",
            "is_sleeping": False}


@router.get("/slots")
async def slots(request: Request):
    """The requests the core holds, one slot each (running, then waiting), read-only."""
    worker = worker_of(request)
    held = await worker.control(GetRequests())
    return [{"id": i, "id_task": r.rid, "n_ctx": worker.info.context_length, "is_processing": r.running,
             "worker_id": r.worker_id,
             "next_token": [{"has_next_token": r.running, "n_decoded": r.output_tokens,
                             "n_remain": r.max_new_tokens - r.output_tokens}],
             "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens}
            for i, r in enumerate(held.requests)]

