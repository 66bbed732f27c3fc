"""EngineConfig: the one configuration object, validated once and passed everywhere."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from unison.compat import NO_EFFECT, SGLANG_ONLY_POLICIES, SGLANG_OPTIONS, SGLANG_SPECULATION
from unison.json_types import JSONObject

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Option = TypeVar("Option", bound="DataclassInstance")  # an option's dataclass (SpeculativeConfig, ...)



def option(default: Any, help: str) -> Any:  # Any: the field's own type, as dataclasses' field() gives
    """An option's field with its one line of help (its CLI flag's, its row in docs/options.md):
    the default, the type and the help declared together, once."""
    return field(default=default, metadata={"help": help})

# vLLM's names for a checkpoint's own multi-token-prediction head as the draft, and SGLang's.
MTP_METHODS = frozenset({"mtp", "qwen3_next_mtp", "deepseek_mtp", "glm4_moe_mtp", "ernie_mtp", "mimo_mtp"})
SGLANG_MTP = frozenset({"NEXTN", "EAGLE"})  # SGLang drafts with the MTP layers under either name
MTP_REFUSAL = ("the checkpoint's multi-token-prediction (MTP) head is not run as a draft yet: Unison "
               "skips its layers at load")


@dataclass
class SpeculativeConfig:
    """Speculative decoding, in vLLM's spelling. "ngram" (prompt lookup): the draft is what followed
    the last earlier occurrence of the sequence's last n tokens (n from prompt_lookup_max down to
    prompt_lookup_min), in the prompt or the output so far. Every draft is verified in one forward
    against what plain decoding would pick, so outputs are bit-identical to plain decoding."""

    method: str = "ngram"
    num_speculative_tokens: int = 5  # tokens drafted per request per step, at most
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # Speculation spends compute to save weight reads: it pays while a step is memory-bound. Steps
    # that decode more requests than this run without drafts (vLLM's name; measured in BENCHMARKS.md).
    disable_by_batch_size: int = 4

    def __post_init__(self) -> None:
        _check(self.method not in MTP_METHODS, "speculative_config.method",
               f"{self.method!r}: {MTP_REFUSAL}; use 'ngram'")
        _check(self.method == "ngram", "speculative_config.method",
               f"must be 'ngram' (prompt lookup; no draft model), got {self.method!r}")
        _check(_is_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= 16,
               "speculative_config.num_speculative_tokens", "must be an integer in [1, 16]")
        _check(_is_int(self.prompt_lookup_min) and self.prompt_lookup_min >= 1,
               "speculative_config.prompt_lookup_min", "must be an integer >= 1")
        _check(_is_int(self.prompt_lookup_max) and self.prompt_lookup_max >= self.prompt_lookup_min,
               "speculative_config.prompt_lookup_max", "must be an integer >= prompt_lookup_min")
        _check(_is_int(self.disable_by_batch_size) and self.disable_by_batch_size >= 1,
               "speculative_config.disable_by_batch_size", "must be an integer >= 1")

    @classmethod
    def parse(cls, given: SpeculativeConfig | dict | str) -> SpeculativeConfig:
        """From a dict or its JSON text (--speculative-config '{"method": "ngram", ...}')."""
        return _parse_option(cls, given, "speculative_config")


@dataclass
class KVEventsConfig:
    """vLLM's and SGLang's --kv-events-config. A port of "*" binds any free port (what was bound
    is in get_server_info); a numbered port is offset by the data-parallel rank, as vLLM does."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"  # zmq | null
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # a ROUTER answering replay requests
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark: past it a slow subscriber loses messages
    max_queue_size: int = 100_000  # vLLM's; accepted (Unison publishes from the step, unqueued)
    topic: str = ""
    load_endpoint: str | None = None  # load reports' PUB; None: the endpoint's host, any port
    load_interval_s: float = 0.05  # a replica's reports come at most this often

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config.enable_kv_cache_events must be true or false, got "
                             f"{self.enable_kv_cache_events!r}")
        for name in ("endpoint", "replay_endpoint", "load_endpoint"):
            value = getattr(self, name)
            if value is not None and not str(value).startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"kv_events_config.{name} must be tcp://HOST:PORT, ipc:// or "
                                 f"inproc://, got {value!r}")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config.publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.load_interval_s, (int, float)) or self.load_interval_s < 0:
            raise ValueError(f"kv_events_config.load_interval_s must be >= 0, got {self.load_interval_s!r}")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, given: KVEventsConfig | dict | str) -> KVEventsConfig:
        """From a dict or its JSON text."""
        return _parse_option(cls, given, "kv_events_config")


def _parse_option(cls: type[Option], given: Option | dict | str, name: str) -> Option:
    """An option object from itself, a dict or its JSON text; unknown keys refused by name."""
    if isinstance(given, cls):
        return given
    if isinstance(given, str):
        try:
            given = json.loads(given)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(given, dict):
        raise ValueError(f"{name} must be a dict or JSON object, got {type(given).__name__}")
    known = sorted(f.name for f in fields(cls))
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {unknown}; known: {known}")
    return cls(**given)


@dataclass(frozen=True)
class LoraModule:
    name: str
    path: str
    pinned: bool = False

    @classmethod
    def parse(cls, entry: str, where: str) -> LoraModule:
        if not isinstance(entry, str) or not entry.strip():
            raise ValueError(f"{where} must be 'name=path', a path or a dict, got {entry!r}")
        if entry.lstrip().startswith("{"):
            try:
                given = json.loads(entry)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where} is not valid JSON: {e}") from None
            name, path = given.get("lora_name", given.get("name")), given.get("lora_path", given.get("path"))
            unknown = sorted(set(given) - LORA_MODULE_KEYS)
            _check(not unknown, where, f"has unknown key(s) {unknown}")
            _check(isinstance(name, str) and isinstance(path, str), where, "needs lora_name and lora_path")
            return cls(name, path, bool(given.get("pinned", False)))
        name, sep, path = entry.partition("=")
        return cls(name, path) if sep else cls(entry, entry)  # a bare path is its own name (SGLang)


@dataclass
class EngineConfig:
    model_path: str | None = option(None, "HF directory, GGUF file, or Hugging Face id owner/name[:TAG]"
                                          "[@revision] (default: the embedded SmolLM2-135M-Instruct GGUF)")
    # A Hugging Face id is resolved once, by the process that starts the core (api/hub.py):
    revision: str | None = option(None, "the Hugging Face revision (branch, tag or commit) of a model "
                                        "named by its id (default: main)")
    download_dir: str | None = option(None, "where Hugging Face downloads go (default: huggingface_hub's "
                                            "cache, HF_HOME)")
    tokenizer_path: str | None = option(None, "the tokenizer's HF directory or id, when not the model's")
    tokenizer_worker_num: int = option(1, "frontend processes (HTTP workers) that may attach, the owner's "
                                          "included")
    # What the model serves: "auto" takes it from the model (a BertModel embeds, a cross-encoder
    # reranks, a decoder generates); naming another task than the model's is refused at start.
    task: str = option("auto", "auto (from the model), generate, embed (sentence embeddings) or rerank (a "
                               "cross-encoder)")
    device: str = option("cpu", "cpu or cuda[:N]")
    dtype: str = option("auto", "auto (fp32 on CPU, the checkpoint's dtype or bf16 on CUDA), float32, "
                                "float16, bfloat16")
    load_format: str = option("auto", "auto, or dummy: a tiny random model with the real tokenizer "
                                      "(benchmarks)")
    # Linear weights on CPU: "auto" runs a GGUF at its own size (Q4_* as int4 blocks, the rest as
    # int8) and an HF checkpoint in float; "none" is the float reference; "int8" / "int4" quantize.
    quantization: str = option("auto", "linear weights: auto (a GGUF at its own size), none (float), int8, "
                                       "int4")
    # KV cache elements: "auto" is float16 beside quantized weights on CPU, else the model's dtype.
    kv_cache_dtype: str = option("auto", "KV cache elements: auto (float16 beside quantized weights), "
                                         "float32, float16, bfloat16, int8 (llama.cpp's q8_0 blocks: 1.88x "
                                         "float16's tokens; CPU), fp8_e4m3 (or fp8) and fp8_e5m2 (vLLM's: 2x "
                                         "the tokens, scale 1.0; CPU)")
    # (frontends stay single-threaded)
    num_threads: int | None = option(None, "torch threads in the core (default: torch's choice)")
    context_length: int | None = option(None, "longest prompt + output in tokens (default: the model's own "
                                              "limit)")
    block_size: int = option(16, "tokens per KV-cache block")
    max_total_tokens: int | None = option(None, "KV-cache capacity in tokens (default: from "
                                                "kv_cache_memory_gb)")
    kv_cache_memory_gb: float | None = option(None, "KV-cache memory (default: a quarter of free memory, at "
                                                    "most 8 GiB, on CPU)")
    # SGLang's None means this default (as for the other NONE_MEANS_DEFAULT options)
    max_running_requests: int = option(64, "requests decoded together at most")
    max_queued_requests: int | None = option(None, "waiting requests the engine holds, across all frontends; "
                                                   "past it a request is refused at once (HTTP 503)")
    # a step's token budget; -1 (SGLang's): a prompt is never chunked
    chunked_prefill_size: int = option(512, "tokens per step: longer prompts are prefilled in chunks")
    disable_radix_cache: bool = option(False, "turn off the prefix cache that reuses shared prompt prefixes' "
                                              "KV")
    # The prefix cache's disk tier: cached blocks are also written under this directory, read back
    # on a prefix hit (after a restart too), kept to kv_cache_disk_gb (least recently used go).
    kv_cache_dir: str | None = option(None, "the prefix cache's disk tier: cached KV blocks are kept in files"
                                            " here and read back on a prefix hit, across restarts of the same"
                                            " model")
    kv_cache_disk_gb: float = option(16.0, "the disk tier's size; past it the least recently used blocks are "
                                           "removed")
    # A hybrid model's prefix cache keeps its linear-attention state at each cached prompt's end
    # and every this many tokens of a prompt (a hit resumes from the longest prefix with one).
    state_snapshot_interval: int = option(2048, "a linear-attention model's prefix cache keeps its state at "
                                                "each cached prompt's end and every this many prompt tokens")
    schedule_policy: str = option("fcfs", "fcfs, lpm (longest cached prefix first), fair (round-robin over "
                                          "frontends) or random")
    # A frontend that has not processed its outputs for this long, or this many steps' worth,
    # has its requests aborted: the core never waits for a stalled frontend. The age is the bound
    # that matters; the count only caps what the core holds for a frontend that stopped reading.
    # It must stay far above the steps in a scheduling hiccup: a small model steps every few ms,
    # and a count of 64 took a busy frontend's 0.3 s pause for a stall.
    frontend_max_lag_s: float = option(2.0, "a frontend this far behind its outputs has its requests parked "
                                            "(not stepped; preempted first when KV runs short) until it "
                                            "catches up")
    frontend_max_unacked: int = option(4096, "... or this many steps' outputs behind")
    frontend_max_silence_s: float = option(30.0, "a frontend that processes none of its outputs for this long"
                                                 " (stopped, wedged) has its requests ended (a 503)")
    mmproj: str | None = option(None, "llama.cpp's mmproj GGUF: the vision tower of a GGUF model (Gemma 3, "
                                      "Qwen3.5), as llama-server's --mmproj")
    # Images (a vision model's): refused past these before they are decoded in full.
    max_image_bytes: int = option(20 << 20, "an image's encoded bytes at most (a bigger one is refused)")
    max_image_pixels: int = option(33_177_600, "an image's width x height at most (7680 x 4320; a bigger "
                                               "one, or a decompression bomb, is refused before decoding)")
    # Image URLs are fetched by the frontends from these hosts only: a server that fetches any URL
    # a client names can be aimed at the hosts behind it (SSRF). Redirects are not followed.
    image_url_hosts: tuple[str, ...] = option((), "hosts whose http(s) image URLs the frontends fetch "
                                                  "(\"*\": any host); none by default: images come inline")
    image_fetch_timeout_s: float = option(10.0, "an image URL's fetch, whole, at most (then a 400)")
    startup_timeout: float = option(300.0, "seconds to wait for the core to load the model")
    log_level: str = option("warning", "debug, info, warning, error or critical")
    # SGLang's options, with SGLang's meaning:
    random_seed: int | None = option(None, "seeds the sampling seed drawn for each request that gives none "
                                           "(reproducible runs)")
    # Memory for weights + KV cache, as a fraction of the machine's (the GPU's on CUDA); the KV
    # cache gets what is left of it once the weights are loaded. None: kv_cache_memory_gb's rule.
    mem_fraction_static: float | None = option(None, "weights + KV cache as a fraction of memory (SGLang's); "
                                                     "the KV cache gets the rest after the weights")
    skip_tokenizer_init: bool = option(False, "no tokenizer: prompts are input_ids, outputs output_ids only")
    stream_output: bool = option(False, "streamed items carry only what is new, not everything so far")
    # Remote frontends: "tcp://HOST:PORT" (port * for any) makes the core also accept frontends
    # over TCP, each authenticated by ZMQ CURVE with one of the trusted client public keys (Z85).
    listen: str | None = option(None, "tcp://HOST:PORT: also accept frontends over TCP, authenticated with "
                                      "ZMQ CURVE")
    trusted_client_keys: tuple[str, ...] = option((), "the CURVE public keys (Z85) of the remote frontends "
                                                      "allowed to attach")
    # over TCP there are no pidfds: silence is the only sign that a side died
    heartbeat_timeout_s: float = option(3.0, "over TCP, a frontend or core silent this long is dead")
    # A thinking model's <think> section returned apart (the OpenAI routes' reasoning_content):
    # qwen3 | deepseek_r1 (aliases deepseek-r1, qwq); see frontend/text/reasoning.py.
    reasoning_parser: str | None = option(None, "return a thinking model's <think> section apart as "
                                                "reasoning_content: qwen3, deepseek_r1 (deepseek-r1, qwq)")
    # Speculative decoding (vLLM's option; SGLang's speculative_algorithm="NGRAM" maps onto it): a
    # SpeculativeConfig, or its dict / JSON text. None: plain decoding.
    speculative_config: SpeculativeConfig | str | None = option(
        None, "speculative decoding as JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 5}' "
              "(outputs stay bit-identical)")
    # LoRA adapters (SGLang's and vLLM's options): loaded in the core, used from every frontend.
    # lora_paths turns enable_lora on too, as in SGLang.
    enable_lora: bool = option(False, "serve LoRA adapters (load_lora_adapter, lora_path, model=<adapter>)")
    # Loaded at start: "name=path", a path, or {"lora_name", "lora_path", "pinned"} (or its JSON).
    lora_paths: tuple[str, ...] = option((), "adapters loaded at start: name=path (or a path, or JSON with "
                                             "lora_name, lora_path, pinned)")
    # (the base model not counted)
    max_loras_per_batch: int = option(8, "distinct LoRA adapters in one step")
    max_lora_rank: int = option(64, "the largest adapter rank that may be loaded")
    max_loaded_loras: int | None = option(None, "adapters kept loaded; past it idle unpinned ones are "
                                                "evicted, least recently used first (default: no limit)")
    # KV-cache events and load reports over ZMQ (vLLM's and SGLang's option): a KVEventsConfig, or
    # its dict / JSON text. None: nothing is published.
    kv_events_config: KVEventsConfig | str | None = option(None, "publish KV-cache events and load reports "
                                                                 "over ZMQ, vLLM's format, as JSON, e.g. "
                                                                 "'{\"enable_kv_cache_events\": true, "
                                                                 "\"endpoint\": \"tcp://*:5557\", "
                                                                 "\"replay_endpoint\": \"tcp://*:5558\"}'")
    data_parallel_rank: int = option(0, "this core's rank among data-parallel replicas (set by the launcher; "
                                        "offsets the KV events' ports)")
    # Set when model_path was a Hugging Face id, by the process that resolved it (not options):
    # the id as given, and the commit it resolved to (get_server_info shows both).
    model_repo: str | None = None
    model_commit: str | None = None

    def __post_init__(self) -> None:
        # SGLang's spellings: None for "the default", -1 for "no chunking", its dtype aliases.
        for f in fields(self):
            if f.name in NONE_MEANS_DEFAULT and getattr(self, f.name) is None:
                setattr(self, f.name, f.default)
        if self.chunked_prefill_size == -1:
            self.chunked_prefill_size = NO_CHUNKING
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        _check(self.tokenizer_worker_num >= 1, "tokenizer_worker_num", "must be >= 1")
        _check(self.block_size >= 1, "block_size", "must be >= 1")
        _check(self.max_running_requests >= 1, "max_running_requests", "must be >= 1")
        _check(self.max_queued_requests is None or self.max_queued_requests >= 1, "max_queued_requests",
               "must be >= 1")
        _check(self.chunked_prefill_size >= 1, "chunked_prefill_size", "must be >= 1")
        _check(self.context_length is None or self.context_length >= 2, "context_length", "must be >= 2")
        _check(self.max_total_tokens is None or self.max_total_tokens >= self.block_size,
               "max_total_tokens", f"must be >= block_size ({self.block_size})")
        _check(self.kv_cache_memory_gb is None or self.kv_cache_memory_gb > 0, "kv_cache_memory_gb",
               "must be > 0")
        _check(self.kv_cache_disk_gb > 0, "kv_cache_disk_gb", "must be > 0")
        interval = self.state_snapshot_interval
        _check(interval >= self.block_size and interval % self.block_size == 0, "state_snapshot_interval",
               f"must be a multiple of block_size ({self.block_size})")
        _check(self.kv_cache_dir is None or not self.disable_radix_cache, "kv_cache_dir",
               "the disk tier extends the prefix cache, which disable_radix_cache turns off")
        _check(self.frontend_max_lag_s > 0, "frontend_max_lag_s", "must be > 0")
        _check(self.frontend_max_unacked >= 1, "frontend_max_unacked", "must be >= 1")
        _check(self.frontend_max_silence_s > 0, "frontend_max_silence_s", "must be > 0")
        _check(self.num_threads is None or self.num_threads >= 1, "num_threads", "must be >= 1")
        _check(self.max_image_bytes >= 1 and self.max_image_pixels >= 1, "max_image_bytes",
               "max_image_bytes and max_image_pixels must be >= 1")
        if isinstance(self.image_url_hosts, str):
            self.image_url_hosts = (self.image_url_hosts,)
        _check(all(isinstance(h, str) and h and "/" not in h for h in self.image_url_hosts),
               "image_url_hosts", "must be host names (example.com, 127.0.0.1) or \"*\"")
        self.image_url_hosts = tuple(h.lower() for h in self.image_url_hosts)  # as URLs' hosts compare
        _check(self.image_fetch_timeout_s > 0, "image_fetch_timeout_s", "must be > 0")
        _check(self.load_format in ("auto", "dummy"), "load_format", "must be 'auto' or 'dummy'")
        _check(self.task in TASKS, "task", f"must be one of {', '.join(TASKS)}, got {self.task!r}")
        _check(self.quantization in ("auto", "none", "int8", "int4"), "quantization",
               f"must be auto, none, int8 or int4, got {self.quantization!r}")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
               f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        _check(self.kv_cache_dtype not in EIGHT_BIT_KV or self.device == "cpu", "kv_cache_dtype",
               f"{self.kv_cache_dtype} is read by the CPU attention kernel only; on {self.device} use "
               "float16 or bfloat16")
        _check(self.quantization in ("auto", "none") or self.device == "cpu", "quantization",
               f"{self.quantization!r} runs on CPU only; on {self.device} use 'none' or 'auto'")
        _check(self.schedule_policy in POLICIES, "schedule_policy",
               f"must be one of {', '.join(POLICIES)}, got {self.schedule_policy!r}"
               + (" (an SGLang policy Unison does not have)" if self.schedule_policy in SGLANG_ONLY_POLICIES
                  else ""))
        _check(self.log_level in LOG_LEVELS, "log_level", f"must be one of {', '.join(LOG_LEVELS)}, "
               f"got {self.log_level!r}")
        _check(self.random_seed is None or (isinstance(self.random_seed, int) and self.random_seed >= 0),
               "random_seed", "must be an integer >= 0")
        _check(self.mem_fraction_static is None or 0 < self.mem_fraction_static < 1,
               "mem_fraction_static", "must be in (0, 1)")
        self.trusted_client_keys = tuple(self.trusted_client_keys)
        _check(self.listen is None or self.listen.startswith("tcp://"), "listen",
               f"must be tcp://HOST:PORT, got {self.listen!r}")
        _check(self.listen is None or bool(self.trusted_client_keys), "trusted_client_keys",
               "must name at least one client public key when listen is set (CURVE authenticates "
               "every remote frontend)")
        _check(all(isinstance(k, str) and len(k) == 40 for k in self.trusted_client_keys),
               "trusted_client_keys", "must be Z85 CURVE public keys (40 characters each)")
        _check(self.heartbeat_timeout_s > 0, "heartbeat_timeout_s", "must be > 0")
        _check(self.device == "cpu" or self.device.startswith("cuda"), "device",
               "must be 'cpu' or 'cuda[:N]'")
        _check(self.reasoning_parser in (None, *REASONING_PARSERS), "reasoning_parser",
               f"must be one of {sorted(REASONING_PARSERS)}, got {self.reasoning_parser!r}")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.kv_events_config is not None:
            self.kv_events_config = KVEventsConfig.parse(self.kv_events_config)
        _check(_is_int(self.data_parallel_rank) and self.data_parallel_rank >= 0, "data_parallel_rank",
               "must be an integer >= 0")
        self._check_lora()

    def _check_lora(self) -> None:
        if isinstance(self.lora_paths, (str, dict)):
            self.lora_paths = (self.lora_paths,)
        self.lora_paths = tuple(json.dumps(p) if isinstance(p, dict) else p for p in self.lora_paths or ())
        modules = self.lora_modules()  # each entry checked, by its index
        names = [m.name for m in modules]
        _check(len(set(names)) == len(names), "lora_paths", f"names an adapter twice: {names}")
        self.enable_lora = bool(self.enable_lora or modules)
        _check(_is_int(self.max_loras_per_batch) and self.max_loras_per_batch >= 1, "max_loras_per_batch",
               "must be an integer >= 1")
        _check(_is_int(self.max_lora_rank) and 1 <= self.max_lora_rank <= MAX_LORA_RANK, "max_lora_rank",
               f"must be an integer in [1, {MAX_LORA_RANK}]")
        loaded = self.max_loaded_loras
        _check(loaded is None or (_is_int(loaded) and loaded >= 1), "max_loaded_loras",
               "must be an integer >= 1")
        _check(loaded is None or len(modules) <= loaded, "lora_paths",
               f"names {len(modules)} adapters, more than max_loaded_loras ({loaded})")

    def lora_modules(self) -> list[LoraModule]:
        """lora_paths as (name, path, pinned): SGLang's "name=path" / path / dict, vLLM's
        --lora-modules JSON ({"name", "path"})."""
        return [LoraModule.parse(entry, f"lora_paths[{i}]") for i, entry in enumerate(self.lora_paths)]

    @property
    def kv_events(self) -> KVEventsConfig | None:
        """The KV events' config when they are published, else None."""
        cfg = self.kv_events_config
        return cfg if isinstance(cfg, KVEventsConfig) and cfg.enabled else None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:  # Any: any field's value, checked here
        """The config from keyword options: ours, and sglang.Engine's where they mean the same
        (any other SGLang option is refused by name: ignoring it could change results)."""
        for name, allowed in NO_EFFECT.items():
            if name in kwargs and (value := kwargs.pop(name)) not in allowed:
                raise ValueError(f"{name}={value!r}: Unison runs one engine on one device; {name} may "
                                 f"only be {' or '.join(map(repr, allowed))}")
        _sglang_speculation(kwargs)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        sglang = [k for k in unknown if k in SGLANG_OPTIONS]
        if sglang:
            raise ValueError(f"SGLang option(s) {sglang} are not supported by Unison; remove them "
                             f"(Unison's options: {sorted(known)})")
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known options: {sorted(known)}")
        return cls(**kwargs)

    def check_model_path(self) -> None:
        """Fail at once, in the owner, on a path that is not there (the core resolves the rest)."""
        if self.model_path is not None and not Path(self.model_path).expanduser().exists():
            raise FileNotFoundError(f"model path {self.model_path!r} does not exist")


def _sglang_speculation(kwargs: JSONObject) -> None:
    """SGLang's NGRAM speculation options, as a speculative_config (in place)."""
    algorithm = kwargs.pop("speculative_algorithm", None)
    given = {ours: kwargs.pop(theirs) for theirs, ours in SGLANG_SPECULATION.items() if theirs in kwargs}
    if algorithm is None:
        if given:
            raise ValueError(f"{sorted(given)}: set speculative_algorithm='NGRAM' with them")
        return
    if str(algorithm).upper() in SGLANG_MTP:
        raise ValueError(f"speculative_algorithm={algorithm!r}: {MTP_REFUSAL}; "
                         "use speculative_algorithm='NGRAM'")
    if str(algorithm).upper() != "NGRAM":
        raise ValueError(f"speculative_algorithm={algorithm!r}: Unison speculates with NGRAM only (no "
                         "draft model); use speculative_algorithm='NGRAM'")
    if kwargs.get("speculative_config") is not None:
        raise ValueError("give speculative_config or speculative_algorithm, not both")
    kwargs["speculative_config"] = SpeculativeConfig(**given)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Options whose None (SGLang's spelling of "the default") means the field's own default.
NONE_MEANS_DEFAULT = ("max_running_requests", "chunked_prefill_size", "schedule_policy", "quantization")
MAX_LORA_RANK = 256
# lora_paths' dict keys: SGLang's (lora_name, lora_path, pinned) and vLLM's --lora-modules JSON's.
LORA_MODULE_KEYS = {"lora_name", "lora_path", "pinned", "name", "path", "base_model_name"}
NO_CHUNKING = 1 << 30  # chunked_prefill_size=-1 (SGLang): a prompt is prefilled in one step
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
TASKS = ("auto", "generate", "embed", "rerank")
EIGHT_BIT_KV = ("int8", "fp8", "fp8_e4m3", "fp8_e5m2")  # read by the C attention kernel only
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", *EIGHT_BIT_KV)
POLICIES = ("fcfs", "lpm", "fair", "random")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# --reasoning-parser's names, the peers' spellings, onto the two behaviours frontend/text/reasoning.py has.
REASONING_PARSERS = {"qwen3": "qwen3", "deepseek_r1": "deepseek_r1", "deepseek-r1": "deepseek_r1",
                     "qwq": "deepseek_r1"}



# One line of help per option: the CLI shows it (`unison serve --help`); a test checks each has one.
HELP = {f.name: f.metadata['help'] for f in fields(EngineConfig) if 'help' in f.metadata}


def _check(ok: bool, name: str, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name} {rule}")
