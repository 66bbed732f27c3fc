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
