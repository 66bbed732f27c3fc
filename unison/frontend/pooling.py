"""Pooling requests: embeddings (SGLang's Engine.encode, OpenAI's /v1/embeddings), and rerank
and score (a cross-encoder over (query, document) pairs). Inputs are checked and tokenized here,
naming the caller's field; the core runs them as prefill-only requests and answers each with a
float32 vector (ReqOutput.embedding), or a cross-encoder's scores."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from unison.errors import InvalidParam
from unison.frontend.request import GenerateRequest, PromptRequest
from unison.frontend.sampling_params import SamplingParams
from unison.json_types import JSONObject

if TYPE_CHECKING:
    from unison.frontend.collector import Collector
    from unison.frontend.text.tokenizer import Tokenizer
    from unison.wire.messages import CoreInfo

# What a pooling call may hold, as OpenAI's /v1/embeddings: inputs per call.
MAX_INPUTS = 2048


@dataclass(frozen=True, slots=True)
class Pooled:
    data: bytes  # an embedding, or a reranker's scores: float32, little-endian, as the core sent it
    prompt_tokens: int

    @property
    def vector(self) -> list[float]:
        return np.frombuffer(self.data, dtype="<f4").tolist()


def embed_request(info: CoreInfo, tok: Tokenizer | None, inputs: object, field: str = "input",
                  truncate_prompt_tokens: int | None = None) -> GenerateRequest:
    """An embedding call's request: `inputs` is a string, a list of strings, a list of token ids
    or a list of such lists (OpenAI's and SGLang's shapes)."""
    expect_task(info, "embed", "encode (/v1/embeddings)")
    batch, texts_or_ids = _inputs(inputs, field)
    ids = []
    for i, one in enumerate(texts_or_ids):
        where = f"{field}[{i}]" if batch else field
        if isinstance(one, str):
            if not one:
                raise InvalidParam(field, f"{where} is an empty string")
            if tok is None:
                raise InvalidParam(field, "this engine has no tokenizer (skip_tokenizer_init=True): "
                                          "give token ids")
            ids.append(tok.encode(one))
        else:
            ids.append(list(one))
        _check_ids(info, ids[-1], where, truncate_prompt_tokens)
    return _request(ids, batch)


def pair_request(info: CoreInfo, tok: Tokenizer | None, query: object, documents: object,
                 fields: tuple[str, str] = ("query", "documents")) -> GenerateRequest:
    """A reranker's (query, document) pairs, one request per document."""
    expect_task(info, "rerank", "rerank and score (/v1/rerank, /score)")
    if not isinstance(query, str) or not query:
        raise InvalidParam(fields[0], f"{fields[0]} must be a non-empty string")
    if not isinstance(documents, list) or not documents or len(documents) > MAX_INPUTS:
        raise InvalidParam(fields[1], f"{fields[1]} must be a non-empty list of at most {MAX_INPUTS} strings")
    if tok is None:
        raise InvalidParam(fields[1], "this engine has no tokenizer (skip_tokenizer_init=True)")
    ids, template = [], info.rerank_template  # a decoder reranker's prompt, else the texts as a pair
    for i, doc in enumerate(documents):
        if not isinstance(doc, str) or not doc:
            raise InvalidParam(fields[1], f"{fields[1]}[{i}] must be a non-empty string")
        ids.append(tok.encode(_fill(template, query, doc), add_special_tokens=False) if template
                   else tok.encode_pair(query, doc))
        _check_ids(info, ids[-1], f"{fields[1]}[{i}]", None)
    return _request(ids, True)


def _fill(template: str, query: str, document: str) -> str:
    """The template with both texts in, in one pass (a query holding "{document}" stays as it is)."""
    return re.sub(r"\{(query|document)\}", lambda m: query if m[1] == "query" else document, template)


def pooled(collector: Collector) -> list[Pooled]:
    """Each finished request's vector (raises the first error, as generate's results do)."""
    results = []
    for state in collector.states:
        if state.error is not None:
            raise state.error
        if not state.embedding:
            raise RuntimeError(f"request {state.rid} ended without a result ({state.finish_reason})")
        results.append(Pooled(state.embedding, len(state.prompt_ids)))
    return results


def check_dimensions(info: CoreInfo, dimensions: object) -> None:
    """OpenAI's `dimensions`: only the model's own (no model served here is Matryoshka-trained)."""
    own = info.embedding_size
    if dimensions is not None and dimensions != own:
        raise InvalidParam("dimensions", f"dimensions: this model's vectors have {own} dimensions and "
                                         "cannot be shortened (it is not a Matryoshka model); omit it")


def encode_output(p: Pooled) -> JSONObject:
    """SGLang's Engine.encode item."""
    return {"embedding": p.vector, "meta_info": {"prompt_tokens": p.prompt_tokens}}


def check_rerank(top_n: object, return_documents: object) -> None:
    if top_n is not None and not (isinstance(top_n, int) and not isinstance(top_n, bool) and top_n >= 1):
        raise InvalidParam("top_n", f"top_n must be an integer >= 1, got {top_n!r}")
    if not isinstance(return_documents, bool):
        raise InvalidParam("return_documents", "return_documents must be true or false")


def ranked(documents: list[str], scores: list[float], top_n: int | None,
           return_documents: bool) -> list[JSONObject]:
    """Cohere's and Jina's rerank results: best first, the top `top_n` (check_rerank's)."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: top_n or len(scores)]
    return [{"index": i, "relevance_score": scores[i], **({"document": {"text": documents[i]}}
                                                           if return_documents else {})} for i in order]


def expect_task(info: CoreInfo, task: str, what: str) -> None:
    served = info.task
    if served != task:
        hint = {"generate": "generate (/v1/completions, /v1/chat/completions)",
                "embed": "encode (/v1/embeddings)", "rerank": "rerank or score (/v1/rerank, /score)"}
        raise InvalidParam("model", f"{what} needs a model that serves {task!r}; this one serves "
                                    f"{served!r}: use {hint[served]} (or start the engine with "
                                    f"another model)")


def _inputs(inputs: object, field: str) -> tuple[bool, list[str | list[int]]]:
    if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and _is_id(inputs[0])):
        return False, [inputs]  # one text, or one list of token ids
    if not isinstance(inputs, list) or not inputs:
        raise InvalidParam(field, f"{field} must be a non-empty string, a list of strings or token ids")
    if len(inputs) > MAX_INPUTS:
        raise InvalidParam(field, f"{field} holds {len(inputs)} inputs; at most {MAX_INPUTS} per call")
    for i, one in enumerate(inputs):
        if not (isinstance(one, str) or (isinstance(one, list) and all(_is_id(t) for t in one))):
            raise InvalidParam(field, f"{field}[{i}] must be a string or a list of token ids")
    return True, inputs


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_ids(info: CoreInfo, ids: list[int], where: str, truncate: int | None) -> None:
    field = where.split("[")[0]
    if not ids:
        raise InvalidParam(field, f"{where} is empty")
    vocab, limit = info.vocab_size, info.context_length
    if truncate is not None:
        if not _is_id(truncate) or not 1 <= truncate <= limit:
            raise InvalidParam("truncate_prompt_tokens", f"truncate_prompt_tokens must be in [1, {limit}]")
        if len(ids) > truncate:  # as sentence-transformers truncates: the end goes, the closing [SEP] stays
            ids[:] = ids[: truncate - 1] + ids[-1:]
    if len(ids) > limit:
        raise InvalidParam(field, f"{where} has {len(ids)} tokens; this model takes at most {limit} "
                                  "(shorten it, or pass truncate_prompt_tokens)")
    for t in ids:
        if not _is_id(t) or not 0 <= t < vocab:
            raise InvalidParam(field, f"{where} must hold token ids in [0, {vocab - 1}], got {t!r}")


def _request(ids: list[list[int]], batch: bool) -> GenerateRequest:
    params = SamplingParams(max_new_tokens=0)
    return GenerateRequest([PromptRequest(one, params, 0, pooling=True) for one in ids], batch)
