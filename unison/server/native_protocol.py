"""SGLang's request bodies for the native routes (pydantic, as FastAPI wants).

Each holds the fields of SGLang's own input struct that Unison acts on, in SGLang's names and
shapes (one value, or one per prompt). Any other field is a 400 naming it: SGLang would accept
and ignore it, but an option silently ignored (a misspelling, a feature not served here) would
change the output unnoticed.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from unison.protocol import PauseMode


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerateBody(_Body):
    """/generate: SGLang's GenerateReqInput, the fields sglang.Engine.generate takes."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None
    rid: str | list[str] | None = None
    priority: int | None = None
    lora_path: str | list[str | None] | None = None  # a loaded adapter's name, or one per prompt


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
