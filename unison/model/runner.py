"""ModelRunner: the core's only interface to the model. It loads the weights, sizes the KV cache
and runs each step; the paged KV cache and the attention over it are attention.py's."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from unison.config import KV_CACHE_DTYPES, EngineConfig
from unison.model.cache_budget import CacheBudget, total_memory
from unison.model.decoder import DecoderModel, dummy_model
from unison.model.families import ModelConfig
from unison.model.kernels import cpu_kernels
from unison.model.layers import key_rounding
from unison.model.layers.attention import PagedAttention, kv_head_bytes
from unison.model.layers.linear_attention import DeltaStates
from unison.model.layers.lora import Adapter, LoraStep, LoraWeights
from unison.model.pooling.encoder_config import DecoderPooling, DecoderReranker
from unison.model.vision.encoder import Vision
from unison.model.weights.loader import open_weights, resolve_model_dir
from unison.model.weights.sources import SafetensorsWeights, overlay, resolve_quantization
from unison.wire.messages import ImageInput

BLOCK_SIZE = EngineConfig.block_size  # (the option's own default, declared once)

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class BatchItem:
    token_ids: list[int]  # the new tokens to compute this step (a prefill chunk, or 1 decode token)
    start_pos: int  # tokens of this request already in its KV cache (positions start here)
    block_table: list[int]  # KV block ids covering positions [0, start_pos + len(token_ids))
    logits_start: int  # index into token_ids from which logits are needed (len: none, 0: all)
    adapter: int = 0  # the LoRA adapter its rows run with (add_lora's id; 0: the base model)
    state_slot: int = -1  # its linear-attention state's slot (a hybrid model's; start_pos 0 zeroes it)
    state_restore: int = -1  # a snapshot slot to resume from (a prefix-cache hit), copied in first
    state_save: int = -1  # a snapshot slot to keep the state in once the step is done (the cache's)
    drafted: bool = False  # its tokens after the first are a draft: its state can be rolled back
    images: Sequence[ImageInput] = ()  # its prompt's images (vision/encoder.py puts those in its rows)


class ModelRunner:
    """Runs flat batches of prefill chunks and decode tokens against a paged KV cache (its layout
    and the attention over it: attention.PagedAttention, the runner's `attention`)."""

    # What a step gives: "generate", logits; "embed", a pooled decoder's (Qwen3-Embedding's recipe)
    # last hidden state per sequence, normalized when `normalize`; "rerank", a decoder reranker's
    # (Qwen3-Reranker's) P("yes") against "no" at the last token. (Encoders: encoder_runner.py.)
    task = "generate"
    output_size = 0  # a pooling runner's vector size; a decoder gives tokens
    normalize = True
    rerank_template = ""  # a reranker's: the text of a pair, {query} and {document} to fill in

    def __init__(self, model_path: str | Path | None, *, device: str = "cpu", dtype: str = "auto",
                 quantization: str = "auto", kv_cache_dtype: str = "auto", block_size: int = BLOCK_SIZE,
                 num_blocks: int | None = None,
                 max_total_tokens: int | None = None, num_threads: int | None = None,
                 load_format: str = "auto", kv_cache_memory_gb: float | None = None,
                 mem_fraction_static: float | None = None, model_dir: str | Path | None = None,
                 pooling: DecoderPooling | DecoderReranker | None = None, state_slots: int = 64,
                 state_snapshots: int = 0, mmproj: str | None = None):
        """`model_path`: a Hugging Face directory or a GGUF file (None: the embedded model);
        `model_dir`, when known, its resolved directory of config and tokenizer files;
        `state_slots`: the linear-attention states a hybrid model keeps (one per running request),
        and `state_snapshots` more for its prefix cache; `mmproj`: llama.cpp's vision file."""
        if block_size < 1 or (num_blocks is not None and num_blocks < 1):
            raise ValueError(f"block_size ({block_size}) and num_blocks ({num_blocks}) "
                             "must be >= 1")
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.device = torch.device(device)
        self.model_dir = Path(model_dir) if model_dir else resolve_model_dir(model_path)
        self.config = ModelConfig.from_dir(self.model_dir)
        if isinstance(pooling, DecoderPooling):
            self.task, self.output_size, self.normalize = "embed", self.config.hidden_size, pooling.normalize
        elif pooling is not None:  # a reranker: P("yes") against "no" at the last token
            self.task, self.output_size, self.labels = "rerank", 1, [pooling.no_id, pooling.yes_id]
            self.rerank_template = pooling.template
        # What the model computes in, and what its float linears run as (bf16 on CPU: see below).
        self.dtype, self.linear_dtype = _resolve_dtype(dtype, self.device, self.config)
        self._quantization_mode = quantization  # as asked: a reload resolves it for its checkpoint
        total = total_memory(self.device)  # before the weights, as SGLang measures it
        if load_format == "dummy":  # the real vocabulary, a near-free forward (frontend benchmarks)
            self.quantization = "none"
            self.config, self.model = dummy_model(self.config, self.device, self.dtype)
        else:
            self.quantization, self.model = self._load(model_path, self.model_dir, self.config)
        log.info("linears run as %s", ", ".join(sorted(set(self.model.linear_kinds().values()))))
        self.kv_dtype = resolve_kv_dtype(kv_cache_dtype, self.linear_dtype, self.quantization)
        self.vision = None if load_format == "dummy" else Vision.load(
            self.model_dir, self.model, self.linear_dtype, self.quantization, mmproj)
        if self.kv_dtype == torch.int8 and self.config.head_dim % 32:  # before a cache of no bytes is made
            raise ValueError("kv_cache_dtype='int8' keeps blocks of 32 values per head: this model's "
                             f"head_dim ({self.config.head_dim}) is not a multiple of 32; use float16")
        self.block_size = block_size
        self.vocab_size = self.config.vocab_size
        c, hybrid = self.config, self.config.linear is not None
        head = kv_head_bytes(c.head_dim, self.kv_dtype)
        slot = 0 if c.linear is None else DeltaStates.slot_bytes(c.linear, len(c.linear_layers))
        self.budget = CacheBudget(2 * len(c.attention_layers) * c.num_key_value_heads * head * block_size,
                                  slot, state_slots if hybrid else 0, state_snapshots if hybrid else 0,
                                  self.device)
        self.num_blocks = self.budget.num_blocks(block_size, num_blocks, max_total_tokens, kv_cache_memory_gb,
                                                 mem_fraction_static, total)
        self.attention = PagedAttention(self.config, self.num_blocks, block_size, dtype=self.dtype,
                                        kv_dtype=self.kv_dtype, device=self.device)
        log.info("KV cache: %d blocks of %d tokens, %s, %.2f GiB", self.num_blocks, block_size,
                 str(self.kv_dtype).removeprefix("torch."), self.num_blocks * self.bytes_per_block / 2**30)
        # A hybrid's linear-attention states, one slot per running request (the core's StatePool
        # hands them out), in the same memory budget as the KV cache.
        b = self.budget
        self.states = None if c.linear is None else DeltaStates(
            c.linear, len(c.linear_layers), b.slots, self.device, b.snapshots)
        if self.states is not None:
            log.info("linear-attention states: %d slots and %d prefix-cache snapshots of %.1f MiB",
                     b.slots, b.snapshots, b.slot_bytes / (1 << 20))
        self.loras: dict[int, Adapter] = {}  # the LoRA adapters the forward can run, by id
        self._bind_model(measure_keys=True)

    def _load(self, model_path: str | Path | None, model_dir: Path,
              config: ModelConfig) -> tuple[str, DecoderModel]:
        weights, from_gguf = open_weights(model_path, model_dir)
        # A checkpoint of block formats (a GGUF, or gpt-oss's MXFP4 experts) runs them as stored
        from_gguf = from_gguf or config.quant_method == "mxfp4"
        quantization = resolve_quantization(self._quantization_mode, self.device, from_gguf,
                                            cpu_kernels.load() is not None)
        if quantization != "none" and self.linear_dtype != torch.float32:
            raise ValueError(f"quantization={quantization!r} computes in float32 on CPU; dtype="
                             f"{str(self.linear_dtype).removeprefix('torch.')!r} cannot be combined with it")
        return quantization, DecoderModel(config, weights, self.device, self.dtype, quantization, from_gguf,
                                          linear_dtype=self.linear_dtype)

    def _bind_model(self, measure_keys: bool = False) -> None:
        """`measure_keys`: at load only. A weight update keeps how int8 keys are stored
        (key_rounding.py): the keys cached so far were stored less its mean, and the measuring
        forward would write over blocks that a prefix cache kept across the update may hold."""
        ops, attention = self.model.ops, self.attention
        kernel = ops if isinstance(ops, cpu_kernels.CpuKernels) else None
        attention.config, self._kernel = self.config, kernel  # a reload may change the attention scale
        if self.kv_dtype == torch.int8 and (kernel is None or self.config.head_dim % 32):
            raise ValueError("kv_cache_dtype='int8' is read by the C attention kernel only, in blocks of "
                             f"32 (this model: head_dim {self.config.head_dim}, C kernels "
                             f"{'on' if kernel else 'off'}); use float16")
        if self.kv_dtype in cpu_kernels.C_ONLY_KV_DTYPES and kernel is None:
            raise ValueError(f"kv_cache_dtype={str(self.kv_dtype).removeprefix('torch.')!r} is read by the C "
                             "attention kernel only, which this model does not run on; use float16")
        attention.set_sinks([layer.sinks for layer in self.model.layers if layer.delta is None])
        if measure_keys and self.kv_dtype == torch.int8 and self.task == "generate":
            attention.key_rounding = self._measure_key_rounding()
        # Quantized on CPU: each step's forward is one C call (csrc/decoder.c), the same kernels
        # in the same order as the Python forward, without its per-op cost. Pooling's rows come
        # from the Python forward (the same kernels), and so does a hybrid's drafted step, whose
        # linear layers record their inputs for the replay.
        self._compiled = (cpu_kernels.CompiledDecoder(kernel, self.model, attention.k_cache,
                                                      attention.v_cache, attention.key_rounding, self.states)
                          if kernel is not None and self.quantization != "none" and self.task == "generate"
                          else None)

    @torch.inference_mode()
    def _measure_key_rounding(self) -> key_rounding.KeyRounding | None:
        """How the int8 cache stores keys (key_rounding.py), from one forward over its fixed text,
        its keys stored as they are, to nearest; the blocks it writes are free afterwards."""
        ids = key_rounding.text_ids(self.model_dir)
        if ids is None:
            log.info("int8 KV: no tokenizer.json, so keys are stored as they are, to nearest")
            return None
        ids = ids[: self.num_blocks * self.block_size]
        cfg = self.config
        moments = key_rounding.Moments(len(cfg.attention_layers), cfg.num_key_value_heads, cfg.head_dim)
        batch = [BatchItem(ids, 0, list(range(-(-len(ids) // self.block_size))), len(ids), state_slot=0)]
        tokens, pos, logits_rows = _flat(batch, self.block_size, self.device)
        with self.attention.step(batch, pos), self._states(batch) as states:
            self.model.forward(tokens, torch.from_numpy(pos).to(self.device),
                               moments.wrap(self.attention.forward), logits_rows, None, states=states)
        return moments.rounding()

    def _states(self, batch: list[BatchItem]) -> AbstractContextManager[DeltaStates | None]:
        """A hybrid model's linear-attention states, opened for this step's items (else None)."""
        return nullcontext() if self.states is None else self.states.step(batch)

    @property
    def _kernel(self) -> cpu_kernels.CpuKernels | None:
        """The C kernels when the model runs on them, else None (torch ops). The attention holds
        them, so that setting this one switch moves LoRA and attention to torch together."""
        return self.attention.kernel

    @_kernel.setter
    def _kernel(self, kernel: cpu_kernels.CpuKernels | None) -> None:
        self.attention.kernel = kernel

    def load_weights(self, model_path: str | Path) -> None:
        """Replace the weights with `model_path`'s (an HF directory or a GGUF file of the same
        architecture and shapes), in place: the KV cache stays. A checkpoint that differs is
        refused with ValueError saying how, and the current weights keep serving. The tokenizer
        and the KV cache's contents are the caller's business (the core flushes the cache)."""
        model_dir = resolve_model_dir(model_path)
        config = ModelConfig.from_dir(model_dir)
        _check_same_shapes(self.config, config, model_path)
        weights, _ = open_weights(model_path, model_dir)
        for name in self.model.weight_shapes:
            if name not in weights:
                raise ValueError(f"{model_path} has no weight {name!r}, which the running model has")
            self._check_shape(name, weights.shape(name), model_path)
        quantization, model = self._load(model_path, model_dir, config)
        if quantization != self.quantization:  # memory and the KV cache were sized for the old
            raise ValueError(f"{model_path} would run as {quantization!r}, the running model as "
                             f"{self.quantization!r}: update from a checkpoint of the same format")
        self.model, self.config = model, config
        self._bind_model()

    def update_tensors(self, path: str | Path) -> int:
        """Replace the tensors in the safetensors file `path` (named as in the checkpoint; any
        subset), keeping the others: the model is rebuilt from its source with those swapped in,
        as the linears fuse and pack several checkpoint tensors each. Returns how many; a name
        the model does not use or a shape that differs is refused (ValueError), changing nothing."""
        if self.quantization != "none":  # re-quantizing a trainer's float tensors would change them
            raise ValueError(f"the running model is quantized ({self.quantization!r}): tensor updates "
                             "need quantization='none'; or update_weights_from_disk from a checkpoint")
        given, tensors = SafetensorsWeights(path), {}
        for name in sorted(given.names()):
            if name not in self.model.weight_shapes:
                tied = " (its LM head is the embedding, tied)" if name == "lm_head.weight" else ""
                raise ValueError(f"the running model has no weight {name!r}{tied}")
            self._check_shape(name, given.shape(name), "the given tensor")
            tensor = given.float(name)
            if not tensor.is_floating_point():
                raise ValueError(f"weight {name!r} is {tensor.dtype}: a floating-point tensor is needed")
            tensors[name] = tensor.clone()  # not the mapped file: removed once we answer
        source = overlay(self.model.source, tensors)
        self.model = DecoderModel(self.config, source, self.device, self.dtype, "none", self.model.from_gguf,
                                  linear_dtype=self.linear_dtype)
        self._bind_model()
        return len(tensors)

    def add_lora(self, adapter: int, weights: LoraWeights) -> None:
        """Make `weights` (lora.read_peft's, for this model) runnable as adapter id `adapter` >= 1."""
        if not isinstance(adapter, int) or adapter < 1:
            raise ValueError(f"a LoRA adapter id is an int >= 1 (0 is the base model), got {adapter!r}")
        if adapter in self.loras:
            raise ValueError(f"LoRA adapter id {adapter} is already loaded")
        if len(weights.layers) != self.config.num_hidden_layers:
            raise ValueError(f"the LoRA adapter has {len(weights.layers)} layers, the model "
                             f"{self.config.num_hidden_layers}")
        self.loras[adapter] = Adapter(weights, self.device)

    def remove_lora(self, adapter: int) -> None:
        """Forget adapter id `adapter`; a batch item that names it afterwards is refused."""
        if self.loras.pop(adapter, None) is None:
            raise ValueError(f"LoRA adapter id {adapter} is not loaded")

    def _check_shape(self, name: str, shape: tuple[int, ...], where: str | Path) -> None:
        if tuple(shape) != self.model.weight_shapes[name]:
            raise ValueError(f"{where}: weight {name!r} is {list(shape)}, the running model's is "
                             f"{list(self.model.weight_shapes[name])}")

    @property
    def context_length(self) -> int:
        return self.config.max_position_embeddings

    @property
    def eos_token_ids(self) -> list[int]:
        return self.config.eos_token_ids

    @property
    def bytes_per_block(self) -> int:
        return self.budget.block_bytes


    @torch.inference_mode()
    def forward(self, batch: list[BatchItem]) -> Tensor:
        """Float32 logits [sum(len(token_ids) - logits_start), vocab], rows in batch order (a
        pooled decoder's: its normalized hidden states; a reranker's: P("yes"), one column)."""
        out = self._forward(batch)
        if self.task == "rerank":
            return torch.softmax(out[:, self.labels], dim=-1)[:, 1:]
        return out

    def _forward(self, batch: list[BatchItem]) -> Tensor:
        if not batch:
            return torch.empty(0, self.vocab_size, device=self.device)
        lora = self._lora_step(batch)
        ids, pos, logits_rows = _flat(batch, self.block_size, self.device)
        positions = torch.from_numpy(self._rope_positions(batch, pos)).to(self.device)
        images = None if self.vision is None else self.vision.step_rows(batch)
        # (the attention reads only what Gemma 3's image rows see past themselves; Qwen's are causal)
        seeing = images if self.vision is not None and self.vision.patches is None else None
        with self.attention.step(batch, pos, seeing) as step, self._states(batch) as states:
            if self.task == "embed":
                hidden = self.model.forward(ids, positions, self.attention.forward, logits_rows, lora,
                                            head=False, states=states)
                return F.normalize(hidden, p=2, dim=-1) if self.normalize else hidden
            # (the compiled forward adds no DeepStack features: those steps run the same kernels from Python)
            if self._compiled is None or (states is not None and states.drafted) \
                    or (images is not None and images.deepstack):
                return self.model.forward(ids, positions, self.attention.forward, logits_rows, lora,
                                          states=states, images=images)
            p = step.paged
            assert p is not None  # the compiled forward runs on the C kernels' metadata
            cos_sin = [r.cos_sin(positions, torch.float32) for r in self.config.ropes]
            rows = self.attention.recent
            recent = None if rows is None or p.recent is None else rows.layer(p.recent, None)
            return self._compiled.forward(ids, cos_sin, step.slots, p.tables, p.row_seq, p.row_len,
                                          logits_rows, step.serial, lora, recent, images,
                                          None if states is None else states.current)

    def _rope_positions(self, batch: list[BatchItem], pos: np.ndarray) -> np.ndarray:
        """The step's rotary positions: the cache's (`pos`), or M-RoPE's [3, N] where an item's
        prompt holds a grid image (vision/encoder.py)."""
        mrope = None if self.vision is None else [self.vision.rope_positions(item) for item in batch]
        if mrope is None or all(p is None for p in mrope):
            return pos
        parts, row = [], 0
        for item, p in zip(batch, mrope):
            n = len(item.token_ids)
            parts.append(np.repeat(pos[None, row: row + n], 3, axis=0) if p is None else p)
            row += n
        return np.concatenate(parts, axis=1)

    def keep_drafted_rows(self, kept: dict[int, int]) -> None:
        """After the last step's drafts were verified: each drafted state slot keeps the state of
        its first kept[slot] rows only (a hybrid's; others keep nothing and need nothing)."""
        if self.states is not None:
            self.model.replay_states(self.states, kept)

    def _lora_step(self, batch: list[BatchItem]) -> LoraStep | None:
        if all(item.adapter == 0 for item in batch):
            return None
        rows = [item.adapter for item in batch for _ in item.token_ids]
        return LoraStep(rows, self.loras, self._kernel, self.device)

    def warmup(self) -> None:
        # Warms kernels for both paths; the blocks written are rewritten before anyone reads them.
        table = [0] * -(-9 // self.block_size)
        self.forward([BatchItem([0] * 8, 0, table, 7, state_slot=0)])
        # (two items never share a state slot: with one slot, the second is left out)
        self.forward([BatchItem([0], 8, table, 0, state_slot=0),
                      BatchItem([0], 0, table, 0, state_slot=1)][: 1 if self.budget.slots == 1 else 2])


def _flat(batch: list[BatchItem], bs: int, dev: torch.device) -> tuple[Tensor, np.ndarray, Tensor | None]:
    """The flat batch's token ids, their positions, and the rows whose logits are wanted
    (None: every row); a batch item whose blocks do not cover its tokens is refused."""
    ids: list[int] = []
    positions: list[np.ndarray] = []  # per item
    logits_rows: list[int] = []
    row = 0
    for item in batch:
        n, start = len(item.token_ids), item.start_pos
        if n == 0 or len(item.block_table) * bs < start + n:
            raise ValueError(f"bad batch item: {n} tokens at position {start} with "
                             f"{len(item.block_table)} blocks of {bs}")
        ids.extend(item.token_ids)
        positions.append(np.arange(start, start + n))
        logits_rows.extend(range(row + item.logits_start, row + n))
        row += n
    rows_t = (None if len(logits_rows) == row
              else torch.tensor(logits_rows, dtype=torch.int64, device=dev))
    return torch.tensor(ids, dtype=torch.int64, device=dev), np.concatenate(positions), rows_t

# What must be equal for weights to replace the running model's in place (the KV cache and every
# frontend's view of the model stay as they are).
_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                 "layer_window")


def _check_same_shapes(old: ModelConfig, new: ModelConfig, where: str | Path) -> None:
    if new.family != old.family:
        raise ValueError(f"{where} is a {new.family.name} model; the running model is {old.family.name}")
    for name in _SHAPE_FIELDS:
        if getattr(new, name) != getattr(old, name):
            raise ValueError(f"{where} has {name}={getattr(new, name)}; the running model has "
                             f"{getattr(old, name)}")


# vLLM's fp8 names: fp8 is fp8_e4m3. Each fp8 value is a byte, scale 1.0 (vLLM's default).
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def resolve_kv_dtype(name: str, model_dtype: torch.dtype, quantization: str) -> torch.dtype:
    """The KV cache's element type. auto: float16 beside quantized weights on CPU (the C decode
    attention reads it 20-25 % faster than float32, in half the memory); otherwise the model's
    dtype (float32 on CPU: the reference path stays exact)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {name!r}")
    if name == "auto":
        return torch.float16 if quantization != "none" else model_dtype
    return torch.int8 if name == "int8" else FP8[name] if name in FP8 else _DTYPES[name]


def _resolve_dtype(name: str, device: torch.device, cfg: ModelConfig) -> tuple[torch.dtype, torch.dtype]:
    """(what the model computes in, what its float linears run as).

    bfloat16 on CPU is vLLM's CPU dtype: the linears' weights in bf16, run by oneDNN on the CPU's
    bf16 units (AVX512-BF16, AMX-BF16), twice fp32's speed here and half its bytes; norms,
    rotary, attention and the residual stay float32 on the C kernels (bf16 there would only lose
    precision: they are not where the time goes)."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32, torch.float32  # the parity reference
        dtype = torch.float16 if cfg.torch_dtype == "float16" else torch.bfloat16
        return dtype, dtype
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use 'auto' or one of {list(_DTYPES)}")
    if device.type == "cpu" and name == "bfloat16":
        if not torch.cpu._is_avx512_bf16_supported():
            log.warning("dtype='bfloat16': this CPU has no bf16 units (AVX512-BF16 / AMX), so oneDNN "
                        "emulates them; float32 is faster here")
        return torch.float32, torch.bfloat16
    return _DTYPES[name], _DTYPES[name]
