"""Every message that crosses a process boundary, as msgspec Structs encoded with msgpack.

frontend -> core: Hello, Generate, Abort, Control, Ack, Goodbye, Heartbeat
core -> frontend: Welcome, Reject, StepOutputs, ControlReply

Nothing is pickled and nothing is a dict of strings: what the core reports (CoreInfo, ServerInfo)
is typed here too. The core sees token ids, never text: stop strings, detokenizing and chat
templates stay in the frontend.
"""

from __future__ import annotations

import enum
from typing import Union

import msgspec

from unison.config import EngineConfig
from unison.version import __version__

PROTOCOL_VERSION = "4"


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
    # With a reasoning parser: the tokens that close the reasoning section (</think>). The grammar
    # holds the output only after them, as SGLang constrains reasoning models.
    grammar_after: list[int] = []

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1


# ---- frontend -> core -------------------------------------------------------------------------


class Hello(msgspec.Struct, tag=True):
    pid: int
    token: str  # the registry's (IPC); over TCP the CURVE key is the credential
    version: str = PROTOCOL_VERSION
    want_files: bool = False  # a remote frontend: send the tokenizer's files in Welcome


class Heartbeat(msgspec.Struct, tag=True):
    """A remote frontend's liveness, where no pidfd can watch it (the core's is libzmq's own
    heartbeats, answered even while a step runs)."""


class Generate(msgspec.Struct, tag=True):
    rid: str
    input_ids: list[int]
    params: CoreSamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # >= 0: also return prompt logprobs from this position
    priority: int = 0  # higher is admitted first
    report_queued: bool = False  # answer with ReqOutput(queued=True) once queued (see CoreInfo)
    token_ids_logprob: list[int] = []  # with return_logprob: these ids' logprobs at every position


class Abort(msgspec.Struct, tag=True):
    rid: str
    finished: bool = False  # a stop string ended it in the frontend: counted as finished, not aborted


class ControlOp(enum.Enum):
    """Engine-wide operations, acted on in the core so every frontend sees one state."""

    SERVER_INFO = "server_info"
    FLUSH_CACHE = "flush_cache"
    PAUSE = "pause"
    CONTINUE = "continue"
    CHECK_INTEGRITY = "check_integrity"
    STEP_SHAPES = "step_shapes"  # benchmarks: needs UNISON_RECORD_STEP_SHAPES=1 in the core's env
    ABORT_REQUESTS = "abort_requests"  # engine-wide, any frontend's requests (arg: AbortRequests)
    UPDATE_WEIGHTS = "update_weights"  # arg: UpdateWeights


class PauseMode(enum.Enum):
    """What a pause does to the requests in flight (SGLang's modes)."""

    ABORT = "abort"  # they end as aborted, their KV freed
    RETRACT = "retract"  # their KV is freed; they are recomputed after continue_generation
    IN_PLACE = "in_place"  # they keep their KV and resume where they were


class Pause(msgspec.Struct, tag=True, frozen=True):
    mode: PauseMode = PauseMode.ABORT


class AbortRequests(msgspec.Struct, tag=True, frozen=True):
    rid: str = ""  # a request id (its n samples too), or
    abort_all: bool = False  # every request in flight, whichever frontend sent it


class UpdateWeights(msgspec.Struct, tag=True, frozen=True):
    model_path: str  # an HF directory or a GGUF file of the same architecture and shapes
    load_format: str | None = None  # None / auto: from the path
    abort_all_requests: bool = False  # abort what is in flight instead of letting it finish


class UpdateTensors(msgspec.Struct, tag=True, frozen=True):
    """Replace some of the running model's tensors (update_weights_from_tensor). They travel
    as a file, not in the message: a model's worth of bytes through the control socket would
    stall every other frontend's outputs behind it."""

    path: str  # a safetensors file on the core's host, named as the checkpoint names them
    flush_cache: bool = True  # empty the prefix cache afterwards (False: more updates follow)


class Control(msgspec.Struct, tag=True):
    cid: int  # echoed in the reply
    op: ControlOp
    arg: Pause | AbortRequests | UpdateWeights | UpdateTensors | None = None


class Ack(msgspec.Struct, tag=True):
    """The frontend has processed every StepOutputs up to `seq`."""

    seq: int


class Goodbye(msgspec.Struct, tag=True):
    pass


# ---- core -> frontend -------------------------------------------------------------------------


class CoreInfo(msgspec.Struct):
    """What a frontend needs to know of the model and the KV cache, sent once in Welcome."""

    model_dir: str  # config and tokenizer files, resolved by the core (a GGUF's cache entry)
    context_length: int
    max_req_input_len: int
    vocab_size: int
    eos_token_ids: list[int]
    block_size: int
    num_blocks: int
    max_total_tokens: int
    quantization: str
    kv_cache_dtype: str
    weights: dict[str, str]  # linear -> what it runs as (float32, int8, int4, ...)
    weights_bytes: int
    max_queued_requests: int | None = None  # when set, Generate asks to hear it was queued
    tcp_address: str | None = None  # where remote frontends attach (listen), as bound
    server_key: str | None = None  # the core's CURVE public key (Z85), for them


class Welcome(msgspec.Struct, tag=True):
    worker_id: int
    info: CoreInfo
    config: EngineConfig
    core_pid: int
    heartbeat_s: float = 0.0  # > 0 (TCP): send a Heartbeat this often; silence for 3x it is death
    files: dict[str, bytes] = {}  # the tokenizer's files, when Hello asked for them


class Reject(msgspec.Struct, tag=True):
    reason: str


class ReqOutput(msgspec.Struct, omit_defaults=True, array_like=True):
    """What one request gained in one step."""

    rid: str
    token_ids: list[int] = []
    finish: str | None = None  # stop | length | abort
    matched: int | None = None  # the stop token id, when finish == "stop"
    error: str | None = None  # set with finish == "abort" when the core refused or dropped it
    message: str | None = None  # finish == "abort" by an engine-wide control: why (no error)
    refused: bool = True  # the request was invalid (ValueError), not dropped while running
    overloaded: bool = False  # refused: the engine's queue is full (max_queued_requests)
    queued: bool = False  # no news but this: the request was accepted into the queue
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[float] = []  # one per token in token_ids
    top_logprobs: list[list[tuple[int, float]]] = []
    prompt_logprobs: list[float | None] = []  # from logprob_start_len; None for position 0
    prompt_top_logprobs: list[list[tuple[int, float]]] = []
    token_ids_logprobs: list[list[float]] = []  # per token in token_ids: Generate.token_ids_logprob's
    prompt_token_ids_logprobs: list[list[float] | None] = []  # per prompt position, as prompt_logprobs


class StepOutputs(msgspec.Struct, tag=True):
    outputs: list[ReqOutput]
    seq: int = 0  # per frontend, from 1; acknowledged with Ack so the core can see who lags


class EngineStats(msgspec.Struct):
    prompt_tokens: int = 0  # of finished requests
    generation_tokens: int = 0
    steps: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of them, found
    num_finished: int = 0
    num_aborted: int = 0


class HistogramData(msgspec.Struct):
    buckets: list[float]  # upper bounds; counts[i] observations in (buckets[i-1], buckets[i]]
    counts: list[int]
    sum: float
    count: int


class FrontendInfo(msgspec.Struct):
    pid: int
    worker_id: int
    requests_in_flight: int


class ServerInfo(msgspec.Struct, tag=True):
    """The core's engine-wide state, the same whichever frontend asks."""

    version: str
    core_pid: int
    owner_pid: int
    config: EngineConfig
    core: CoreInfo
    paused: bool
    pause_mode: str | None  # of the pause in effect
    weights_version: int  # weight updates so far
    num_running: int
    num_waiting: int
    kv_blocks_used: int  # held by requests
    kv_blocks_cached: int  # held only by the prefix cache: evictable
    num_evicted_blocks: int
    stats: EngineStats
    histograms: dict[str, HistogramData]  # latency, measured at the core's step times
    admissions: list[tuple[int, str]]  # (worker id, rid) in admission order, the last few
    frontends: list[FrontendInfo]

    def to_dict(self) -> dict:
        """Plain JSON-able values in SGLang's top-level keys (its options, the scheduler's
        status / max_total_num_tokens / max_req_input_len, internal_states, version), then
        ours: the model's fields at the top level, the state, `config` as it was given."""
        info = msgspec.to_builtins(self)
        info.pop("type")  # the message's tag
        config, core = info["config"], info.pop("core")
        state = {k: info[k] for k in ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_cached",
                                      "paused", "pause_mode", "weights_version", "stats")}
        state["model_path"] = config["model_path"]  # what it serves now (a weight update changes it)
        sglang = {**config, "status": "ready", "max_total_num_tokens": core["max_total_tokens"],
                  "max_req_input_len": core["max_req_input_len"], "internal_states": [state],
                  "version": __version__}
        return {**sglang, **core, **info, "protocol_version": self.version, "version": __version__}

    def model_info(self) -> dict:
        """SGLang's get_model_info: what is served now."""
        return {"model_path": self.config.model_path, "tokenizer_path": self.core.model_dir,
                "is_generation": True, "weight_version": self.weights_version,
                "load_format": self.config.load_format}


class OpResult(msgspec.Struct, tag=True):
    """The outcome of a control that can be refused for a reason (SGLang's result shapes)."""

    success: bool
    message: str = ""
    num_paused_requests: int = 0  # update_weights: requests in flight at the swap (held or paused)

    def __bool__(self) -> bool:
        return self.success


class ControlReply(msgspec.Struct, tag=True):
    cid: int
    result: ServerInfo | OpResult | list[tuple[int, int, int]] | bool | None = None
    error: str | None = None


ToCore = Union[Hello, Generate, Abort, Control, Ack, Goodbye, Heartbeat]
ToFrontend = Union[Welcome, Reject, StepOutputs, ControlReply]

encode = msgspec.msgpack.Encoder().encode
decode_to_core = msgspec.msgpack.Decoder(ToCore).decode
decode_to_frontend = msgspec.msgpack.Decoder(ToFrontend).decode


# ---- owner -> core, once, on the core's stdin -------------------------------------------------


class CoreArgs(msgspec.Struct):
    config: EngineConfig
    endpoint: str  # ipc:// path inside runtime_dir
    runtime_dir: str  # private (0700); removed by the core when it exits
    token: str  # what a Hello must present
    owner_pid: int  # the core exits when this process does
    registry_path: str | None = None  # published once ready when frontends may attach
    pdeathsig: bool = True  # the owner's starting thread lives as long as the owner
    curve_secret_key: str | None = None  # with config.listen: the core's CURVE key (never published)


class EngineInfo(msgspec.Struct):
    """The registry: what a process needs to attach a frontend to a running engine."""

    endpoint: str
    owner_pid: int
    core_pid: int
    token: str
    config: EngineConfig
    info: CoreInfo  # as in Welcome
    version: str = PROTOCOL_VERSION
