"""GenerateArgs: one generate call's arguments, declared once.

The names and shapes are sglang.Engine.generate's: each per-prompt field is one value for every
prompt or a list of one per prompt, None meaning the default. Everything else derives from this
class: Engine.generate and async_generate take its fields as keywords (their help shows them),
the native /generate body is built from its fields (server/apis/sglang/bodies.py), and
TokenizerWorker.make_request checks and tokenizes one, prompt by prompt (`split`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from unison.errors import InvalidParam
from unison.frontend.sampling_params import SamplingParams
from unison.json_types import JSONObject

# The three arguments sglang.Engine.generate also takes positionally.
Prompt = str | list[str] | None
InputIds = list[int] | list[list[int]] | None
# A JSON object of sampling options (sampling.OPTIONS names), or one per prompt.
SamplingArg = JSONObject | list[JSONObject] | SamplingParams | list[SamplingParams] | None


@dataclass(kw_only=True, slots=True)
class GenerateArgs:
    """What one generate call asks for; values are checked by make_request, which names the
    field of anything wrong (callers from Python or JSON may pass any type)."""

    prompt: Prompt = None
    sampling_params: SamplingArg = None
    input_ids: InputIds = None
    return_logprob: bool | list[bool] | None = False
    logprob_start_len: int | list[int] | None = None  # -1 (None): logprobs of generated tokens only
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None  # one list for all, or one per prompt
    rid: str | list[str] | None = None
    priority: int | None = None  # one for the whole call
    lora_path: str | list[str | None] | None = None  # a loaded adapter's name, or one per prompt
    # A prompt's images (each where its prompt writes the model's image marker): one image or a
    # list of them for one prompt; for a list of prompts, one such entry per prompt. An image is
    # bytes, a data: URL, base64 text, a PIL image or (from Python) a file path.
    image_data: object = None

    def split(self) -> tuple[bool, list[GenerateArgs]]:
        """(whether the call was a batch, one GenerateArgs of single values per prompt)."""
        batch, prompts, id_lists = self._prompts()
        n = len(prompts) or len(id_lists)
        by_id: object = self.token_ids_logprob
        if batch and isinstance(by_id, list) and not any(isinstance(x, list) or x is None for x in by_id):
            by_id = [by_id] * n  # one list of ids for every prompt
        per = {f: _per_prompt(getattr(self, f), n, f) for f in _PER_PROMPT}
        per["token_ids_logprob"] = _per_prompt(by_id, n, "token_ids_logprob") if batch else [by_id]
        per["image_data"] = _per_prompt(self.image_data, n, "image_data") if batch else [self.image_data]
        return batch, [GenerateArgs(prompt=prompts[i] if prompts else None,
                                    input_ids=id_lists[i] if id_lists else None, priority=self.priority,
                                    **{f: values[i] for f, values in per.items()})
                       for i in range(n)]

    def _prompts(self) -> tuple[bool, list[str], list[list[int]]]:
        prompt, input_ids = self.prompt, self.input_ids
        if (prompt is None) == (input_ids is None):
            raise InvalidParam("prompt", "give exactly one of prompt and input_ids")
        if prompt is not None:
            if isinstance(prompt, str):
                return False, [prompt], []
            if isinstance(prompt, list) and prompt:
                return True, prompt, []
            raise InvalidParam("prompt", "prompt must be a string or a non-empty list of strings")
        if isinstance(input_ids, list) and input_ids and all(isinstance(x, list) for x in input_ids):
            return True, [], cast(list[list[int]], input_ids)
        if isinstance(input_ids, list):
            return False, [], [cast(list[int], input_ids)]
        raise InvalidParam("input_ids", "input_ids must be a list of token ids or a list of such lists")


FIELDS = tuple(f.name for f in dataclasses.fields(GenerateArgs))
# One value per prompt (or one for all); prompt and input_ids say how many prompts there are.
_PER_PROMPT = tuple(f for f in FIELDS if f not in ("prompt", "input_ids", "priority", "token_ids_logprob",
                                                   "image_data"))


def _per_prompt(value: object, n: int, name: str) -> list[Any]:  # Any: each field's own type
    if isinstance(value, list):  # one entry per prompt
        if len(value) != n:
            raise InvalidParam(name, f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


F = TypeVar("F", bound=Callable[..., object])


def with_generate_args(fn: F) -> F:
    """Show GenerateArgs' fields in `fn`'s signature (help(), inspect): `fn` takes the first ones
    positionally and the rest through **kwargs, which it hands to GenerateArgs."""
    sig = inspect.signature(fn)
    own = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    named = {p.name for p in own}
    extra = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
             for f in dataclasses.fields(GenerateArgs) if f.name not in named]
    rest = [p for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD]
    fn.__signature__ = sig.replace(parameters=own + extra + rest)  # type: ignore[attr-defined]
    return fn
