"""SGLang's request bodies for the native routes (pydantic, as FastAPI wants).

Each holds the fields of SGLang's own input struct that Unison acts on, in SGLang's names and
shapes (one value, or one per prompt). Any other field is a 400 naming it: SGLang would accept
and ignore it, but an option silently ignored (a misspelling, a feature not served here) would
change the output unnoticed.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, TypeVar, get_type_hints

from pydantic import BaseModel, ConfigDict, create_model

from unison.frontend.generate_args import GenerateArgs, InputIds, Prompt
from unison.wire.messages import PauseMode


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None  # which model (a server of several hands the request to it); checked


BodyT = TypeVar("BodyT", bound=_Body)


class _GenerateBase(_Body):
    stream: bool = False
    if TYPE_CHECKING:  # derived from GenerateArgs below; declared here for what the route reads
        text: Prompt
        input_ids: InputIds

    def args(self) -> GenerateArgs:
        values = self.model_dump(exclude={"stream", "model"})
        values["prompt"] = values.pop("text")
        return GenerateArgs(**values)


def _generate_fields() -> dict[str, Any]:  # Any: pydantic's (type, default) pairs
    """GenerateArgs' fields in SGLang's wire names: `text` is the prompt, and sampling options
    are JSON objects (a SamplingParams object is the Python API's alone)."""
    hints = get_type_hints(GenerateArgs)
    fields = {f.name: (hints[f.name], f.default) for f in dataclasses.fields(GenerateArgs)}
    fields["sampling_params"] = (dict[str, Any] | list[dict[str, Any]] | None, None)  # JSON objects
    return {"text": fields.pop("prompt"), **fields}


# /generate: SGLang's GenerateReqInput, the fields sglang.Engine.generate takes, plus `stream`.
if TYPE_CHECKING:
    GenerateBody = _GenerateBase
else:
    GenerateBody = create_model("GenerateBody", __base__=_GenerateBase, **_generate_fields())


class LoadLoraBody(_Body):
    """/load_lora_adapter (SGLang) and /v1/load_lora_adapter (vLLM)."""

    lora_name: str
    lora_path: str  # a PEFT directory on the engine's host
    pinned: bool = False
    load_inplace: bool = False  # vLLM's: replace an adapter of the same name


class UnloadLoraBody(_Body):
    """/unload_lora_adapter and /v1/unload_lora_adapter."""

    lora_name: str
    lora_int_id: int | None = None  # vLLM's, accepted and unused: names identify adapters here


class PauseBody(_Body):
    """/pause_generation: what happens to the requests in flight (SGLang's default: abort)."""

    mode: PauseMode = PauseMode.ABORT


class ContinueBody(_Body):
    """/continue_generation takes no field."""


class AbortBody(_Body):
    """/abort_request: one request id (and its n samples), or every request in flight."""

    rid: str = ""
    abort_all: bool = False


class UpdateWeightsBody(_Body):
    """/update_weights_from_disk: an HF directory or GGUF file of the served model's shapes."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
