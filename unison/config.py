"""EngineConfig: the one configuration object, validated once and passed everywhere."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


@dataclass
class EngineConfig:
    model_path: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    tokenizer_worker_num: int = 1  # frontends that may be attached at once, the in-process one included
    device: str = "cpu"
    dtype: str = "auto"  # fp32 on CPU; the checkpoint's dtype (or bf16) on CUDA
    load_format: str = "auto"  # "dummy": a tiny random model with the real tokenizer (benchmarks)
    # Linear weights on CPU: "auto" runs a GGUF at its own size (Q4_* as int4 blocks, the rest as
    # int8) and an HF checkpoint in float; "none" is the float reference; "int8" / "int4" quantize.
    quantization: str = "auto"
    # KV cache elements: "auto" is float16 beside quantized weights on CPU, else the model's dtype.
    kv_cache_dtype: str = "auto"
    num_threads: int | None = None  # torch threads in the core; frontends stay single-threaded
    context_length: int | None = None  # None: the model's own limit
    block_size: int = 16  # tokens per KV block
    max_total_tokens: int | None = None  # KV capacity in tokens; None: from kv_cache_memory_gb
    kv_cache_memory_gb: float | None = None  # None: a quarter of free memory (at most 8 GiB) on CPU
    max_running_requests: int = 64
    max_queued_requests: int | None = None  # waiting requests, engine-wide; past it: refused at once
    chunked_prefill_size: int = 512  # token budget of one step: long prompts are prefilled in chunks
    disable_radix_cache: bool = False  # the prefix cache reuses the KV of shared prompt prefixes
    schedule_policy: str = "fcfs"  # fcfs | lpm (longest prefix match) | fair (round-robin over frontends)
    # A frontend that has not processed its outputs for this long, or this many steps' worth,
    # has its requests aborted: the core never waits for a stalled frontend.
    frontend_max_lag_s: float = 2.0
    frontend_max_unacked: int = 64
    startup_timeout: float = 300.0  # seconds to wait for the core to load the model
    log_level: str = "warning"

    def __post_init__(self) -> None:
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
        _check(self.frontend_max_lag_s > 0, "frontend_max_lag_s", "must be > 0")
        _check(self.frontend_max_unacked >= 1, "frontend_max_unacked", "must be >= 1")
        _check(self.num_threads is None or self.num_threads >= 1, "num_threads", "must be >= 1")
        _check(self.load_format in ("auto", "dummy"), "load_format", "must be 'auto' or 'dummy'")
        _check(self.quantization in ("auto", "none", "int8", "int4"), "quantization",
               f"must be auto, none, int8 or int4, got {self.quantization!r}")
        _check(self.kv_cache_dtype in ("auto", "float32", "float16", "bfloat16"), "kv_cache_dtype",
               f"must be auto, float32, float16 or bfloat16, got {self.kv_cache_dtype!r}")
        _check(self.quantization in ("auto", "none") or self.device == "cpu", "quantization",
               f"{self.quantization!r} runs on CPU only; on {self.device} use 'none' or 'auto'")
        _check(self.schedule_policy in ("fcfs", "lpm", "fair"), "schedule_policy",
               f"must be fcfs, lpm or fair, got {self.schedule_policy!r}")
        _check(self.device == "cpu" or self.device.startswith("cuda"), "device",
               "must be 'cpu' or 'cuda[:N]'")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known options: {sorted(known)}")
        return cls(**kwargs)

    def check_model_path(self) -> None:
        """Fail at once, in the owner, on a path that is not there (the core resolves the rest)."""
        if self.model_path is not None and not Path(self.model_path).expanduser().exists():
            raise FileNotFoundError(f"model path {self.model_path!r} does not exist")


# One line of help per option: the CLI shows it (`unison serve --help`); a test checks each has one.
HELP = {
    "model_path": "HF directory or GGUF file (default: the embedded SmolLM2-135M-Instruct GGUF)",
    "tokenizer_worker_num": "frontend processes (HTTP workers) that may attach, the owner's included",
    "device": "cpu or cuda[:N]",
    "dtype": "auto (fp32 on CPU, the checkpoint's dtype or bf16 on CUDA), float32, float16, bfloat16",
    "load_format": "auto, or dummy: a tiny random model with the real tokenizer (benchmarks)",
    "quantization": "linear weights: auto (a GGUF at its own size), none (float), int8, int4",
    "kv_cache_dtype": "KV cache elements: auto (float16 beside quantized weights), float32, float16, "
                      "bfloat16",
    "num_threads": "torch threads in the core (default: torch's choice)",
    "context_length": "longest prompt + output in tokens (default: the model's own limit)",
    "block_size": "tokens per KV-cache block",
    "max_total_tokens": "KV-cache capacity in tokens (default: from kv_cache_memory_gb)",
    "kv_cache_memory_gb": "KV-cache memory (default: a quarter of free memory, at most 8 GiB, on CPU)",
    "max_running_requests": "requests decoded together at most",
    "max_queued_requests": "waiting requests the engine holds, across all frontends; past it a "
                           "request is refused at once (HTTP 503)",
    "chunked_prefill_size": "tokens per step: longer prompts are prefilled in chunks",
    "disable_radix_cache": "turn off the prefix cache that reuses shared prompt prefixes' KV",
    "schedule_policy": "fcfs, lpm (longest cached prefix first) or fair (round-robin over frontends)",
    "frontend_max_lag_s": "a frontend this far behind its outputs has its requests aborted",
    "frontend_max_unacked": "... or this many steps' outputs behind",
    "startup_timeout": "seconds to wait for the core to load the model",
    "log_level": "debug, info, warning or error",
}


def _check(ok: bool, name: str, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name} {rule}")
