"""EncoderRunner: the core's interface to an encoder model (model/pooling/bert.py), in ModelRunner's shape.

No KV is kept: each step's sequences run whole and leave. The scheduler still accounts its
tokens in blocks (a pool with no tensors behind it), so pooling requests share its token budget,
queue limit, policies and aborts with everything else.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NoReturn

import torch
from torch import Tensor

from unison.model.kernels import cpu_kernels
from unison.model.kernels.cpu_kernels import CpuKernels
from unison.model.pooling.bert import BertEncoder
from unison.model.pooling.encoder_config import EncoderConfig
from unison.model.runner import BLOCK_SIZE, BatchItem

log = logging.getLogger(__name__)


class EncoderRunner:
    kv_dtype = torch.float32  # reported as the KV cache's; there is none
    eos_token_ids: list[int] = []
    rerank_template = ""  # a cross-encoder reads a pair as its tokenizer joins two texts
    vision = None  # it reads text only

    def __init__(self, model_dir: str | Path, *, device: str = "cpu", dtype: str = "auto",
                 quantization: str = "auto", num_threads: int | None = None, block_size: int = BLOCK_SIZE,
                 max_batch_tokens: int = 8192, max_running: int = 256) -> None:
        if device != "cpu":
            raise ValueError(f"device: encoder models run on the CPU only, got {device!r}")
        kind, kernels = _linear_kind(dtype, quantization)
        self.quantization = "int8" if kind == "int8" else "none"
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        from safetensors.torch import load_file

        self.model_dir = Path(model_dir)
        self.config = EncoderConfig.from_dir(self.model_dir)
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.model_dir} has no *.safetensors weights")
        tensors: dict[str, Tensor] = {}
        for f in files:
            tensors.update(load_file(str(f)))
        self.model = BertEncoder(self.config, tensors, kind, kernels)
        self.vocab_size = self.config.vocab_size
        self.context_length = self.config.max_positions
        # Enough blocks that admission is bounded by the token budget and max_running, never by
        # blocks: a step's requests round up to a block each, and a prompt over the budget runs alone.
        tokens = min(max_batch_tokens, max_running * self.context_length) + self.context_length
        self.num_blocks = -(-tokens // block_size) + max_running
        log.info("%s encoder (%s): %d layers, %d dims, up to %d tokens a sequence", self.config.task,
                 self.config.pooling if self.config.task == "embed" else "classifier",
                 self.config.num_layers, self.config.hidden_size, self.context_length)

    @property
    def task(self) -> str:
        return self.config.task

    @property
    def output_size(self) -> int:
        return self.config.output_size

    def warmup(self) -> None:
        self.model.forward([[0] * 8, [0] * 3])

    def forward(self, batch: list[BatchItem]) -> Tensor:
        """One row per item: its embedding or scores. Items are whole sequences (start_pos 0)."""
        for item in batch:
            if item.start_pos != 0:
                raise AssertionError("an encoder runs whole sequences: the scheduler split one")
        return self.model.forward([item.token_ids for item in batch])

    def _unsupported(self, what: str) -> NoReturn:
        raise ValueError(f"{what} is not supported for an encoder ({self.config.task}) model")

    def load_weights(self, model_path: str | Path) -> None:
        self._unsupported("updating weights")

    def update_tensors(self, path: str) -> int:
        self._unsupported("updating weights")


def _linear_kind(dtype: str, quantization: str) -> tuple[str, CpuKernels | None]:
    """What the encoder's linears run as (bert.KINDS), from the engine's dtype and quantization:
    float32 by default, bfloat16 when asked (oneDNN), int8 on Unison's kernels when asked."""
    if quantization == "int8":
        if dtype not in ("auto", "float32"):
            raise ValueError(f"dtype: quantization='int8' computes in float32; dtype={dtype!r} cannot be "
                             "combined with it")
        kernels = cpu_kernels.load()
        if kernels is None:
            raise ValueError("quantization: int8 needs Unison's CPU kernels, which are not built here")
        return "int8", kernels
    if quantization not in ("auto", "none"):
        raise ValueError(f"quantization: an encoder runs as none (float) or int8, not {quantization!r}")
    if dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"dtype: an encoder runs in float32 or bfloat16, not {dtype!r}")
    return ("bfloat16" if dtype == "bfloat16" else "float32"), None
