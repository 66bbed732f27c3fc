"""Every message that crosses a process boundary, as msgspec Structs encoded with msgpack.

frontend -> core: Hello, Generate, Abort, Control, RequestStats, Ack, Goodbye
core -> frontend: Welcome, Reject, StepOutputs, ControlReply

Nothing is pickled. The core sees token ids, never text: stop strings, detokenizing and chat
templates stay in the frontend.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

PROTOCOL_VERSION = "1"


class CoreSamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """The part of SamplingParams the core acts on (validated by the frontend)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = {}
    seed: int = 0  # always set: the frontend draws one when the user gives none
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    grammar: str | None = None  # llguidance grammar text (from a JSON schema, regex or EBNF)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1


# ---- frontend -> core -------------------------------------------------------------------------


class Hello(msgspec.Struct, tag=True):
    pid: int
    token: str
    version: str = PROTOCOL_VERSION


class Generate(msgspec.Struct, tag=True):
    rid: str
    input_ids: list[int]
    params: CoreSamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # >= 0: also return prompt logprobs from this position
    priority: int = 0  # higher is admitted first


class Abort(msgspec.Struct, tag=True):
    rid: str


class Control(msgspec.Struct, tag=True):
    """Engine-wide operations, acted on in the core so every frontend sees one state."""

    cid: int  # echoed in the reply
    op: str  # flush_cache | server_info | pause | continue | check_integrity


class RequestStats(msgspec.Struct, tag=True):
    """Timings of one finished request, measured where the client sees them (for /metrics)."""

    ttft: float
    tpot: float | None
    e2e: float


class Ack(msgspec.Struct, tag=True):
    """The frontend has processed every StepOutputs up to `seq`."""

    seq: int


class Goodbye(msgspec.Struct, tag=True):
    pass


# ---- core -> frontend -------------------------------------------------------------------------


class Welcome(msgspec.Struct, tag=True):
    worker_id: int
    info: dict[str, Any]  # scheduler info: context_length, vocab_size, eos_token_ids, ...


class Reject(msgspec.Struct, tag=True):
    reason: str


class ReqOutput(msgspec.Struct, omit_defaults=True, array_like=True):
    """What one request gained in one step."""

    rid: str
    token_ids: list[int] = []
    finish: str | None = None  # stop | length | abort
    matched: int | None = None  # the stop token id, when finish == "stop"
    error: str | None = None  # set with finish == "abort" when the core refused or dropped it
    refused: bool = True  # the request was invalid (ValueError), not dropped while running
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[float] = []  # one per token in token_ids
    top_logprobs: list[list[tuple[int, float]]] = []
    prompt_logprobs: list[float | None] = []  # from logprob_start_len; None for position 0
    prompt_top_logprobs: list[list[tuple[int, float]]] = []


class StepOutputs(msgspec.Struct, tag=True):
    outputs: list[ReqOutput]
    seq: int = 0  # per frontend, from 1; acknowledged with Ack so the core can see who lags


class ControlReply(msgspec.Struct, tag=True):
    cid: int
    result: Any = None
    error: str | None = None


ToCore = Union[Hello, Generate, Abort, Control, RequestStats, Ack, Goodbye]
ToFrontend = Union[Welcome, Reject, StepOutputs, ControlReply]

encode = msgspec.msgpack.Encoder().encode
decode_to_core = msgspec.msgpack.Decoder(ToCore).decode
decode_to_frontend = msgspec.msgpack.Decoder(ToFrontend).decode


# ---- owner -> core, once, on the core's stdin -------------------------------------------------


class CoreArgs(msgspec.Struct):
    config: dict[str, Any]  # EngineConfig.to_dict()
    model_dir: str
    endpoint: str  # ipc:// path inside runtime_dir
    runtime_dir: str  # private (0700); removed by the core when it exits
    token: str  # what a Hello must present
    owner_pid: int  # the core exits when this process does
    registry_path: str | None = None  # published once ready when frontends may attach
    pdeathsig: bool = True  # the owner's starting thread lives as long as the owner


class EngineInfo(msgspec.Struct):
    """The registry: what a process needs to attach a frontend to a running engine."""

    endpoint: str
    owner_pid: int
    core_pid: int
    token: str
    model_dir: str
    config: dict[str, Any]
    info: dict[str, Any]  # scheduler info, as in Welcome
    version: str = PROTOCOL_VERSION
