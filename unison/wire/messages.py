"""Every message that crosses a process boundary, as msgspec Structs encoded with msgpack.

frontend -> core: Hello, Generate, Abort, Control, Ack, Goodbye, Heartbeat
core -> frontend: Welcome, Reject, StepOutputs, ControlReply

Nothing is pickled and nothing is a dict of strings: what the core reports (CoreInfo, ServerInfo)
is typed here too, and each engine-wide control is one request type that names its reply type.
The core sees token ids, never text: stop strings, detokenizing and chat templates stay in the
frontend.
"""

from __future__ import annotations

import enum
from typing import ClassVar, Generic, TypeVar, Union, cast, get_args

import msgspec

from unison.config import EngineConfig
from unison.sampling import CoreSamplingParams
from unison.version import __version__
from unison.wire.kv_events import KVEventsInfo

PROTOCOL_VERSION = "10"


# ---- frontend -> core -------------------------------------------------------------------------


class Hello(msgspec.Struct, tag=True):
    pid: int
    token: str  # the registry's (IPC); over TCP the CURVE key is the credential
    version: str = PROTOCOL_VERSION
    want_files: bool = False  # a remote frontend: send the tokenizer's files in Welcome


class Heartbeat(msgspec.Struct, tag=True):
    """A remote frontend's liveness, where no pidfd can watch it (the core's is libzmq's own
    heartbeats, answered even while a step runs)."""


class ImageInput(msgspec.Struct, frozen=True, array_like=True):
    """One image of a prompt, prepared by the frontend as the model's processor prepares it:
    float32 pixels (little-endian bytes: no pickle, no copy through Python objects), and the run
    of placeholder tokens it fills in the prompt. A fixed-size image's pixels are [channels,
    height, width]; a grid image's (ImageSpec.patches) are its patches [grid_h * grid_w,
    channels * patch * patch], in the processor's order, on the grid `grid`."""

    hash: bytes  # of the pixels and the processor's settings: the image's identity in every cache
    offset: int  # the first placeholder token's position in the prompt
    tokens: int  # placeholder tokens: the embeddings the encoder gives for it
    shape: tuple[int, ...]
    pixels: bytes
    grid: tuple[int, int, int] | None = None  # (frames, rows, columns) of patches: image_grid_thw


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
    lora_name: str | None = None  # a loaded LoRA adapter, resolved by the core (None: the base model)
    pooling: bool = False  # embed or score the prompt (an encoder model's task), no tokens generated
    images: list[ImageInput] = []  # in prompt order


class Abort(msgspec.Struct, tag=True):
    rid: str
    finished: bool = False  # a stop string ended it in the frontend: counted as finished, not aborted


class Ack(msgspec.Struct, tag=True):
    """The frontend has processed every StepOutputs up to `seq`."""

    seq: int


class Goodbye(msgspec.Struct, tag=True):
    pass


# ---- core -> frontend -------------------------------------------------------------------------


class PatchSpec(msgspec.Struct, frozen=True):
    """How a Qwen-VL-style processor cuts an image (Qwen2VLImageProcessor): resized, keeping its
    aspect, to between min_pixels and max_pixels on a grid of (patch_size * merge_size)-pixel
    cells, then cut into patch_size patches, merge_size x merge_size of them per token."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int  # frames per patch: a still image's are copies (the tower folds them)
    min_pixels: int
    max_pixels: int


class PanAndScan(msgspec.Struct, frozen=True):
    """Gemma 3's pan-and-scan (opt-in: its processor's do_pan_and_scan): a picture whose longer
    side is at least min_ratio_to_activate times its shorter one is also cut along it into 2 to
    max_num_crops crops of at least min_crop_size pixels, each seen after the whole picture as a
    picture of its own."""

    min_crop_size: int
    max_num_crops: int
    min_ratio_to_activate: float


class ImageSpec(msgspec.Struct, frozen=True):
    """How a vision model's frontends prepare an image (its Hugging Face processor's settings)
    and write it into a prompt. A fixed-size image (Gemma 3) is resized to image_size square and
    where a chat template or a prompt writes `marker`, the text becomes `expansion`, which holds
    `tokens` placeholder tokens `token_id` in a row. A grid image (`patches`: Qwen3.5, Qwen3-VL)
    takes as many placeholders as its size gives: the marker is the placeholder itself, and its
    one token becomes the image's run once the image is read."""

    image_size: int  # fixed: images are resized to image_size x image_size (grid images: 0)
    resample: int  # PIL's filter number (2: bilinear, 3: bicubic)
    rescale: float  # pixel values times this (1/255), then (x - mean) / std per channel
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    marker: str  # e.g. Gemma 3's "<start_of_image>", Qwen's "<|image_pad|>"
    expansion: str  # e.g. "\n\n<start_of_image>" + 256 x "<image_soft_token>" + "<end_of_image>\n\n"
    token_id: int
    tokens: int  # a fixed-size image's placeholders (grid images: 0, each its own)
    patches: PatchSpec | None = None
    pan_and_scan: PanAndScan | None = None  # (a fixed-size image's, where its processor asks)


class CoreInfo(msgspec.Struct):
    """What a frontend needs to know of the model and the KV cache, sent once in Welcome."""

    model_dir: str  # config and tokenizer files, resolved by the core (a GGUF's cache entry)
    tokenizer_dir: str  # the tokenizer's files: model_dir, or tokenizer_path (SGLang's option)
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
    step_bytes: int  # one decode step of one sequence moves: weights, a hybrid's state (0: not a decoder)
    max_queued_requests: int | None = None  # when set, Generate asks to hear it was queued
    tcp_address: str | None = None  # where remote frontends attach (listen), as bound
    server_key: str | None = None  # the core's CURVE public key (Z85), for them
    kv_events: KVEventsInfo | None = None  # where KV events and load reports are published, as bound
    task: str = "generate"  # generate | embed | rerank: what the model serves (EngineConfig.task)
    embedding_size: int = 0  # embed: a vector's dimensions; rerank: scores per pair
    rerank_template: str = ""  # a decoder reranker's text for a pair ({query}, {document}); "": pairs
    image: ImageSpec | None = None  # a vision model's: how its frontends prepare images (None: text only)


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
    unknown_adapter: bool = False  # refused: Generate.lora_name is not a loaded adapter
    stalled: bool = False  # ended: its frontend processed nothing for frontend_max_silence_s
    queued: bool = False  # no news but this: the request was accepted into the queue
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[float] = []  # one per token in token_ids
    top_logprobs: list[list[tuple[int, float]]] = []
    prompt_logprobs: list[float | None] = []  # from logprob_start_len; None for position 0
    prompt_top_logprobs: list[list[tuple[int, float]]] = []
    token_ids_logprobs: list[list[float]] = []  # per token in token_ids: Generate.token_ids_logprob's
    prompt_token_ids_logprobs: list[list[float] | None] = []  # per prompt position, as prompt_logprobs
    embedding: bytes = b""  # a pooling request's vector (or scores): float32, little-endian


class StepOutputs(msgspec.Struct, tag=True):
    outputs: list[ReqOutput]
    seq: int = 0  # per frontend, from 1; acknowledged with Ack so the core can see who lags


class SpecDecodeStats(msgspec.Struct):
    """vLLM's spec-decode counters: drafts verified, tokens drafted, drafted tokens accepted, and
    accepted per draft position (entry i: how often the i-th drafted token was accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = []


class EngineStats(msgspec.Struct):
    prompt_tokens: int = 0  # of finished requests
    generation_tokens: int = 0
    steps: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of them, found
    num_finished: int = 0
    num_aborted: int = 0
    spec_decode: SpecDecodeStats | None = None  # with speculative_config


class HistogramData(msgspec.Struct):
    buckets: list[float]  # upper bounds; counts[i] observations in (buckets[i-1], buckets[i]]
    counts: list[int]
    sum: float
    count: int


class FrontendInfo(msgspec.Struct):
    pid: int
    worker_id: int
    requests_in_flight: int
    remote: bool = False  # attached over TCP (CURVE keys, heartbeats), not the local IPC socket
    behind: bool = False  # behind its outputs: its requests are parked until it catches up


class RequestInfo(msgspec.Struct):
    """A request the core holds: llama-server's /slots shows them."""

    rid: str
    worker_id: int  # the frontend's that sent it (-1: one that has gone)
    running: bool  # False: waiting to be admitted
    prompt_tokens: int
    output_tokens: int
    max_new_tokens: int
    cached_tokens: int


class LoraAdapterInfo(msgspec.Struct):
    """A loaded LoRA adapter, as the core's registry holds it."""

    name: str
    id: int  # the core's; never reused
    path: str
    rank: int
    target_modules: list[str]
    pinned: bool
    running: int  # requests running with it now
    waiting: int  # ... and queued
    served: int  # requests that have come for it
    loaded_at: float  # time.time()


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
    lora_adapters: list[LoraAdapterInfo] = []

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

    @classmethod
    def from_dict(cls, info: dict[str, object]) -> ServerInfo:
        """The struct back from `to_dict()`'s JSON (/get_server_info, Engine.get_server_info), so a
        reader uses the fields this class names instead of string keys."""
        core = {name: info[name] for name in CoreInfo.__struct_fields__ if name in info}
        own = {name: info[name] for name in cls.__struct_fields__ if name in info}
        return msgspec.convert({**own, "core": core, "version": info["protocol_version"]}, cls)

    def model_info(self) -> dict:
        """SGLang's get_model_info: what is served now."""
        return {"model_path": self.config.model_path,
                "tokenizer_path": self.core.tokenizer_dir,
                "is_generation": True, "weight_version": self.weights_version,
                "load_format": self.config.load_format}


class OpResult(msgspec.Struct, tag=True):
    """The outcome of a control that can be refused for a reason (SGLang's result shapes)."""

    success: bool
    message: str = ""
    num_paused_requests: int = 0  # update_weights: requests in flight at the swap (held or paused)

    def __bool__(self) -> bool:
        return self.success


class RequestList(msgspec.Struct, tag=True):
    """The requests the core holds, running first, then waiting, in the scheduler's order."""

    requests: list[RequestInfo]


class StepShapeCounts(msgspec.Struct, tag=True):
    """How many forwards ran with each shape, as (tokens, logits rows, count) rows."""

    rows: list[tuple[int, int, int]]


# ---- engine-wide controls: frontend -> core (Control), core -> frontend (ControlReply) ---------

ReplyT = TypeVar("ReplyT")


class ControlRequest(msgspec.Struct, Generic[ReplyT], frozen=True, tag=True):
    """An engine-wide operation, acted on in the core so every frontend sees one state.

    Each subclass is one op: its tag (`op`) names it on the wire, and the type it subclasses
    ControlRequest with is what the core answers (`reply`), so `TokenizerWorker.control(req)`
    returns exactly that type. The core has one handler per subclass (core/controls.py)."""

    reply: ClassVar[type]

    def __init_subclass__(cls) -> None:  # msgspec has taken the class options (tag=...) already
        super().__init_subclass__()
        bases = cls.__dict__.get("__orig_bases__", ())  # its own: ControlRequest's would be inherited
        replies = [get_args(base)[0] for base in bases if get_args(base)]
        if len(replies) != 1 or not isinstance(replies[0], type):
            raise TypeError(f"{cls.__name__} must name its reply type: class {cls.__name__}"
                            "(ControlRequest[Reply], tag=...)")
        cls.reply = replies[0]

    @property
    def op(self) -> str:
        return str(type(self).__struct_config__.tag)

    def check_reply(self, result: ControlResult | None) -> ReplyT:
        """The core's result, if it has this request's reply type (else the two sides disagree
        on the protocol: an error, not a wrongly typed value)."""
        if not isinstance(result, self.reply):
            raise RuntimeError(f"{self.op}: the engine core answered with {type(result).__name__}, "
                               f"not {self.reply.__name__}")
        return cast(ReplyT, result)


class GetServerInfo(ControlRequest[ServerInfo], tag="server_info", frozen=True):
    """The engine's state (get_server_info, get_model_info, /metrics)."""


class FlushCache(ControlRequest[OpResult], tag="flush_cache", frozen=True):
    """Empty the prefix cache; refused (a falsy OpResult) while requests hold KV."""


class PauseMode(enum.Enum):
    """What a pause does to the requests in flight (SGLang's modes)."""

    ABORT = "abort"  # they end as aborted, their KV freed
    RETRACT = "retract"  # their KV is freed; they are recomputed after continue_generation
    IN_PLACE = "in_place"  # they keep their KV and resume where they were


class Pause(ControlRequest[OpResult], tag="pause", frozen=True):
    """Stop stepping; requests that arrive meanwhile queue (held, not refused)."""

    mode: PauseMode = PauseMode.ABORT


class Continue(ControlRequest[OpResult], tag="continue", frozen=True):
    """Step again after a pause."""


class CheckIntegrity(ControlRequest[OpResult], tag="check_integrity", frozen=True):
    """Answered with an error if the KV block pool has a leaked or double-owned block."""


class GetRequests(ControlRequest[RequestList], tag="requests", frozen=True):
    """Every request the core holds (llama-server's /slots): apart from GetServerInfo, which
    every /metrics scrape asks for, so that a long queue is listed only when asked."""


class GetStepShapes(ControlRequest[StepShapeCounts], tag="step_shapes", frozen=True):
    """Benchmarks: needs UNISON_RECORD_STEP_SHAPES=1 in the core's environment."""


class AbortRequests(ControlRequest[OpResult], tag="abort_requests", frozen=True):
    """Abort requests of any frontend (the operator's control, not a client's Abort)."""

    rid: str = ""  # a request id (its n samples too), or
    abort_all: bool = False  # every request in flight, whichever frontend sent it


class UpdateWeights(ControlRequest[OpResult], tag="update_weights", frozen=True):
    """Load a whole checkpoint (update_weights_from_disk)."""

    model_path: str  # an HF directory or a GGUF file of the same architecture and shapes
    load_format: str | None = None  # None / auto: from the path
    abort_all_requests: bool = False  # abort what is in flight instead of letting it finish


class UpdateTensors(ControlRequest[OpResult], tag="update_tensors", frozen=True):
    """Replace some of the running model's tensors (update_weights_from_tensor). They travel
    as a file, not in the message: a model's worth of bytes through the control socket would
    stall every other frontend's outputs behind it."""

    path: str  # a safetensors file on the core's host, named as the checkpoint names them
    flush_cache: bool = True  # empty the prefix cache afterwards (False: more updates follow)


class LoadLoraAdapter(ControlRequest[OpResult], tag="load_lora_adapter", frozen=True):
    """Load a PEFT adapter under a name every frontend can then use (SGLang's and vLLM's call)."""

    lora_name: str
    lora_path: str  # a PEFT directory on the core's host (adapter_config.json + safetensors)
    pinned: bool = False  # never evicted to make room (max_loaded_loras)


class UnloadLoraAdapter(ControlRequest[OpResult], tag="unload_lora_adapter", frozen=True):
    """Forget an adapter's name at once; requests in flight with it finish first."""

    lora_name: str


ControlRequests = Union[GetServerInfo, FlushCache, Pause, Continue, CheckIntegrity, GetStepShapes,
                        GetRequests, AbortRequests, UpdateWeights, UpdateTensors, LoadLoraAdapter,
                        UnloadLoraAdapter]
ControlResult = Union[ServerInfo, OpResult, StepShapeCounts, RequestList]  # every request's reply type
CONTROL_REQUESTS: tuple[type[ControlRequest], ...] = get_args(ControlRequests)


class Control(msgspec.Struct, tag=True):
    """One engine-wide control; the core answers it with a ControlReply of the same cid."""

    cid: int  # echoed in the reply
    request: ControlRequests


class ControlReply(msgspec.Struct, tag=True):
    cid: int
    result: ControlResult | None = None  # of the request's reply type; None with an error
    error: str | None = None


class ControlHead(msgspec.Struct, tag="Control"):
    """A Control read for its cid alone: a Control whose request the core cannot decode is
    still answered, with the decoder's reason (it names the field)."""

    cid: int


ToCore = Union[Hello, Generate, Abort, Control, Ack, Goodbye, Heartbeat]
ToFrontend = Union[Welcome, Reject, StepOutputs, ControlReply]

encode = msgspec.msgpack.Encoder().encode
decode_to_core = msgspec.msgpack.Decoder(ToCore).decode
decode_to_frontend = msgspec.msgpack.Decoder(ToFrontend).decode
decode_control_head = msgspec.msgpack.Decoder(ControlHead).decode


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
