"""ModelRunner: the core's only interface to the model. Paged KV cache + batched attention."""

from __future__ import annotations

import logging
import math
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from . import cpu_kernels
from .decoder import DecoderModel, dummy_model
from .families import ModelConfig
from .loader import open_weights, resolve_model_dir
from .lora import Adapter, LoraStep, LoraWeights
from .weights import SafetensorsWeights, overlay, resolve_quantization

log = logging.getLogger(__name__)

# Attention work (query rows x context tokens, summed) up to which a step's attention runs on one
# thread: a parallel region over so little work costs more than it saves, and when the other
# cores are busy a preempted worker stalls every such op (50-100x slower, measured under load).
SERIAL_ATTENTION_WORK = 8192

# Torch's decode path (no C kernel): a decode group is split so that the K/V it gathers (8 MiB) is
# still in cache when SDPA reads it: 1.7x faster at 64 requests x 300 tokens than one gather.
DECODE_CHUNK_BYTES = 8 << 20

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class BatchItem:
    token_ids: list[int]  # the new tokens to compute this step (a prefill chunk, or 1 decode token)
    start_pos: int  # tokens of this request already in its KV cache (positions start here)
    block_table: list[int]  # KV block ids covering positions [0, start_pos + len(token_ids))
    logits_start: int  # index into token_ids from which logits are needed (len: none, 0: all)
    adapter: int = 0  # the LoRA adapter its rows run with (add_lora's id; 0: the base model)


@dataclass(slots=True)
class _Attn:
    """One torch attention call: some rows of the flat batch and the cache blocks they attend over."""

    rows: slice | Tensor  # a prefill's row range, or the rows of a group of decodes
    blocks: Tensor | None  # [items * width] blocks to gather; None: only the new tokens
    mask: Tensor | None  # additive, [n, width] or [items, 1, 1, width]; None: plain causal


@dataclass(slots=True)
class _Paged:
    """The C kernel's view of a step: every row attends over its request's blocks up to itself."""

    tables: Tensor  # [items, width] int64 block tables
    row_seq: Tensor  # [N] int64: each row's item
    row_len: Tensor  # [N] int64: each row's position + 1


@dataclass(slots=True)
class _TorchAttn:
    """Torch's view of a step for layers of one window (masks differ with the window)."""

    decodes: list[_Attn]  # single-token requests: grouped by context length, in chunks
    prefills: list[_Attn]  # multi-token chunks, one each
    whole: bool  # a single decode group covering the whole batch, in order


@dataclass(slots=True)
class _Step:
    """Per-step attention metadata, built once per forward and shared by every layer."""

    slots: Tensor  # [N] cache slot of each new token
    serial: bool  # attention on one thread (see SERIAL_ATTENTION_WORK)
    paged: _Paged | None = None  # the C kernel's metadata; else torch's, per window
    torch: dict[int | None, _TorchAttn] = field(default_factory=dict)


class ModelRunner:
    """Runs flat batches of prefill chunks and decode tokens against a paged KV cache.

    Per layer the cache is [num_blocks, block_size, kv_heads, head_dim] for K and for V; a
    request's token at position p lives in block block_table[p // block_size], row p % block_size.
    """

    def __init__(self, model_path: str | Path | None, *, device: str = "cpu", dtype: str = "auto",
                 quantization: str = "auto", kv_cache_dtype: str = "auto", block_size: int = 16,
                 num_blocks: int | None = None,
                 max_total_tokens: int | None = None, num_threads: int | None = None,
                 load_format: str = "auto", kv_cache_memory_gb: float | None = None,
                 mem_fraction_static: float | None = None, model_dir: str | Path | None = None):
        """`model_path`: a Hugging Face directory or a GGUF file (None: the embedded model);
        `model_dir`, when known, its resolved directory of config and tokenizer files."""
        if block_size < 1 or (num_blocks is not None and num_blocks < 1):
            raise ValueError(f"block_size ({block_size}) and num_blocks ({num_blocks}) "
                             "must be >= 1")
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.device = torch.device(device)
        self.model_dir = Path(model_dir) if model_dir else resolve_model_dir(model_path)
        self.config = ModelConfig.from_dir(self.model_dir)
        # What the model computes in, and what its float linears run as (bf16 on CPU: see below).
        self.dtype, self.linear_dtype = _resolve_dtype(dtype, self.device, self.config)
        self._quantization_mode = quantization  # as asked: a reload resolves it for its checkpoint
        total_memory = _total_memory(self.device)  # before the weights, as SGLang measures it
        if load_format == "dummy":  # the real vocabulary, a near-free forward (frontend benchmarks)
            self.quantization = "none"
            self.config, self.model = dummy_model(self.config, self.device, self.dtype)
        else:
            self.quantization, self.model = self._load(model_path, self.model_dir, self.config)
        log.info("linears run as %s", ", ".join(sorted(set(self.model.linear_kinds().values()))))
        self.kv_dtype = _resolve_kv_dtype(kv_cache_dtype, self.linear_dtype, self.quantization)
        self.block_size = block_size
        self.vocab_size = self.config.vocab_size
        if num_blocks is None:
            if max_total_tokens:
                num_blocks = -(-max_total_tokens // block_size)
            elif kv_cache_memory_gb:
                num_blocks = max(1, int(kv_cache_memory_gb * (1 << 30)) // self.bytes_per_block)
            elif mem_fraction_static:
                num_blocks = self._blocks_for_fraction(mem_fraction_static, total_memory)
            else:
                num_blocks = self._default_num_blocks()
        self._check_fits(num_blocks)
        self.num_blocks = num_blocks
        c = self.config
        shape = (c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        self.k_cache = _zeros(shape, self.kv_dtype, self.device)
        self.v_cache = _zeros(shape, self.kv_dtype, self.device)
        log.info("KV cache: %d blocks of %d tokens, %s, %.2f GiB", num_blocks, block_size,
                 str(self.kv_dtype).removeprefix("torch."), num_blocks * self.bytes_per_block / (1 << 30))
        self._group = c.num_attention_heads // c.num_key_value_heads
        self.loras: dict[int, Adapter] = {}  # the LoRA adapters the forward can run, by id
        self._bind_model()
        self._step: _Step | None = None
        # Gather buffers reused across layers and steps: a fresh multi-MB tensor per layer costs
        # page faults that make decode attention 3x slower on CPU.
        self._gather_bufs = [torch.empty(0, dtype=self.kv_dtype, device=self.device) for _ in range(2)]

    def _load(self, model_path: str | Path | None, model_dir: Path,
              config: ModelConfig) -> tuple[str, DecoderModel]:
        weights, from_gguf = open_weights(model_path, model_dir)
        quantization = resolve_quantization(self._quantization_mode, self.device, from_gguf,
                                            cpu_kernels.load() is not None)
        if quantization != "none" and self.linear_dtype != torch.float32:
            raise ValueError(f"quantization={quantization!r} computes in float32 on CPU; dtype="
                             f"{str(self.linear_dtype).removeprefix('torch.')!r} cannot be combined with it")
        return quantization, DecoderModel(config, weights, self.device, self.dtype, quantization, from_gguf,
                                          linear_dtype=self.linear_dtype)

    def _bind_model(self) -> None:
        ops = self.model.ops
        self._kernel = ops if isinstance(ops, cpu_kernels.CpuKernels) else None
        # Quantized on CPU: each step's forward is one C call (csrc/decoder.c), the same kernels
        # in the same order as the Python forward, without its per-op cost.
        self._compiled = (cpu_kernels.CompiledDecoder(self._kernel, self.model, self.k_cache, self.v_cache)
                          if self._kernel is not None and self.quantization != "none" else None)

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
        c = self.config
        per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim
        return per_token * self.block_size * self.kv_dtype.itemsize

    def _check_fits(self, num_blocks: int) -> None:
        """Fail at start, with the numbers, rather than by the OOM killer in the middle of a run."""
        need = num_blocks * self.bytes_per_block
        free = _free_memory(self.device)
        if need > free:
            raise ValueError(
                f"the KV cache ({num_blocks * self.block_size} tokens, {need / (1 << 30):.2f} GiB) does "
                f"not fit in the {free / (1 << 30):.2f} GiB left after loading the model; lower "
                "max_total_tokens or kv_cache_memory_gb")

    def _blocks_for_fraction(self, fraction: float, total: int) -> int:
        """SGLang's mem_fraction_static: weights + KV cache take `fraction` of the memory there
        was before loading, so the KV cache gets what is free now less the (1 - fraction) kept."""
        free = _free_memory(self.device)
        rest = free - total * (1 - fraction)
        if rest < self.bytes_per_block:
            raise ValueError(
                f"mem_fraction_static={fraction} leaves no memory for the KV cache: "
                f"{free / (1 << 30):.2f} GiB free of {total / (1 << 30):.2f} GiB after loading the "
                f"weights, {(1 - fraction) * total / (1 << 30):.2f} GiB to keep; raise it")
        return int(rest) // self.bytes_per_block

    def _default_num_blocks(self) -> int:
        # CPU: a quarter of available memory, at most 8 GiB (pages are touched only when used).
        # CUDA: most of what is free once the weights are loaded.
        if self.device.type == "cuda":
            budget = int(torch.cuda.mem_get_info(self.device)[0] * 0.85)
        else:
            budget = min(_available_memory() // 4, 8 << 30)
        return max(1, budget // self.bytes_per_block)

    @torch.inference_mode()
    def forward(self, batch: list[BatchItem]) -> Tensor:
        """Float32 logits [sum(len(token_ids) - logits_start), vocab], rows in batch order."""
        if not batch:
            return torch.empty(0, self.vocab_size, device=self.device)
        lora = self._lora_step(batch)
        ids, positions, logits_rows = self._prepare(batch)
        try:
            if self._compiled is not None:
                step, cfg = self._current, self.config
                p = step.paged
                assert p is not None  # the compiled forward runs on the C kernels' metadata
                cos_sin = [r.cos_sin(positions, torch.float32) for r in cfg.ropes]
                return self._compiled.forward(ids, cos_sin, step.slots, p.tables, p.row_seq, p.row_len,
                                              logits_rows, step.serial, lora)
            return self.model.forward(ids, positions, self._attention, logits_rows, lora)
        finally:
            self._step = None

    @property
    def _current(self) -> _Step:
        """This forward's attention metadata (set by _prepare, cleared when the forward ends)."""
        assert self._step is not None
        return self._step

    def _lora_step(self, batch: list[BatchItem]) -> LoraStep | None:
        if all(item.adapter == 0 for item in batch):
            return None
        rows = [item.adapter for item in batch for _ in item.token_ids]
        return LoraStep(rows, self.loras, self._kernel, self.device)

    def warmup(self) -> None:
        # Warms kernels for both paths; the blocks written are rewritten before anyone reads them.
        table = [0] * -(-9 // self.block_size)
        self.forward([BatchItem([0] * 8, 0, table, 7)])
        self.forward([BatchItem([0], 8, table, 0), BatchItem([0], 0, table, 0)])

    # --- per-step metadata ---------------------------------------------------------------

    def _prepare(self, batch: list[BatchItem]) -> tuple[Tensor, Tensor, Tensor | None]:
        bs, dev = self.block_size, self.device
        ids: list[int] = []
        positions: list[np.ndarray] = []  # per item
        slots: list[np.ndarray] = []
        logits_rows: list[int] = []
        row, work = 0, 0
        for item in batch:
            n, start = len(item.token_ids), item.start_pos
            if n == 0 or len(item.block_table) * bs < start + n:
                raise ValueError(f"bad batch item: {n} tokens at position {start} with "
                                 f"{len(item.block_table)} blocks of {bs}")
            pos = np.arange(start, start + n)
            table = np.asarray(item.block_table, dtype=np.int64)
            ids.extend(item.token_ids)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            logits_rows.extend(range(row + item.logits_start, row + n))
            work += n * (start + n)
            row += n
        serial = dev.type == "cpu" and work <= SERIAL_ATTENTION_WORK
        step_slots = torch.from_numpy(np.concatenate(slots)).to(dev)
        pos_all = np.concatenate(positions)
        if self._kernel is not None:
            self._step = _Step(step_slots, serial, paged=self._paged_meta(batch, pos_all))
        else:
            self._step = _Step(step_slots, serial, torch={
                w: self._torch_meta(batch, w) for w in self.config.windows})
        rows_t = (None if len(logits_rows) == row
                  else torch.tensor(logits_rows, dtype=torch.int64, device=dev))
        return (torch.tensor(ids, dtype=torch.int64, device=dev), torch.from_numpy(pos_all).to(dev), rows_t)

    def _paged_meta(self, batch: list[BatchItem], positions: np.ndarray) -> _Paged:
        # The kernel reads each request's own blocks up to each row's own length: no padding.
        bs = self.block_size
        ends = [item.start_pos + len(item.token_ids) for item in batch]
        tables = np.zeros((len(batch), -(-max(ends) // bs)), dtype=np.int64)
        for i, (item, end) in enumerate(zip(batch, ends)):
            nb = -(-end // bs)
            tables[i, :nb] = item.block_table[:nb]
        row_seq = np.repeat(np.arange(len(batch), dtype=np.int64), [len(it.token_ids) for it in batch])
        return _Paged(torch.from_numpy(tables), torch.from_numpy(row_seq), torch.from_numpy(positions + 1))

    def _torch_meta(self, batch: list[BatchItem], window: int | None) -> _TorchAttn:
        decode, prefills, row = [], [], 0
        for item in batch:
            if len(item.token_ids) == 1:
                decode.append((row, item))
            else:
                prefills.append(self._prefill_meta(row, item, window))
            row += len(item.token_ids)
        decodes = self._decode_meta(decode, len(decode) == row, window)
        only = decodes[0].rows if len(decodes) == 1 else None
        whole = isinstance(only, slice) and only == slice(0, row)
        return _TorchAttn(decodes, prefills, whole)

    def _prefill_meta(self, row: int, item: BatchItem, window: int | None) -> _Attn:
        n, start, bs = len(item.token_ids), item.start_pos, self.block_size
        rows = slice(row, row + n)
        if start == 0 and (window is None or n <= window):
            return _Attn(rows, None, None)  # a whole prompt: attend over its own new K/V
        nblocks = -(-(start + n) // bs)
        blocks = torch.tensor(item.block_table[:nblocks], dtype=torch.int64, device=self.device)
        q_pos = torch.arange(start, start + n, device=self.device)[:, None]
        return _Attn(rows, blocks, self._mask(q_pos, nblocks * bs, window))

    def _decode_meta(self, decode: list[tuple[int, BatchItem]], all_decode: bool,
                     window: int | None) -> list[_Attn]:
        # Contexts are padded to the longest of their group: group by length so that padding at
        # most doubles the work (or adds 256 tokens): a short request is not padded to long ones.
        bs = self.block_size
        nblocks = {row: -(-(item.start_pos + 1) // bs) for row, item in decode}
        groups: list[list[tuple[int, BatchItem]]] = []
        for row, item in sorted(decode, key=lambda d: -nblocks[d[0]]):
            nb = nblocks[row]
            if not groups or nblocks[groups[-1][0][0]] - nb > max(nb, 256 // bs):
                groups.append([])
            groups[-1].append((row, item))
        in_order = all_decode and len(groups) == 1  # rows 0..N-1: chunks are row ranges
        chunks = []
        for group in groups:
            group.sort(key=lambda d: d[0])
            cap = self._decode_chunk_rows(max(nblocks[row] for row, _ in group))
            chunks += [self._decode_chunk(group[i: i + cap], in_order, window)
                       for i in range(0, len(group), cap)]
        return chunks

    def _decode_chunk_rows(self, width: int) -> int:
        if self.device.type != "cpu":
            return 1 << 30
        block_bytes = self.bytes_per_block // self.config.num_hidden_layers  # K and V, one layer
        return max(1, DECODE_CHUNK_BYTES // (width * block_bytes))

    def _decode_chunk(self, chunk: list[tuple[int, BatchItem]], in_order: bool,
                      window: int | None) -> _Attn:
        bs = self.block_size
        nblocks = [-(-(item.start_pos + 1) // bs) for _, item in chunk]
        blocks = np.zeros((len(chunk), max(nblocks)), dtype=np.int64)  # padding: block 0, masked
        for i, ((_, item), nb) in enumerate(zip(chunk, nblocks)):
            blocks[i, :nb] = item.block_table[:nb]
        q_pos = torch.tensor([item.start_pos for _, item in chunk], device=self.device)[:, None]
        rows = (slice(chunk[0][0], chunk[-1][0] + 1) if in_order
                else torch.tensor([row for row, _ in chunk], dtype=torch.int64, device=self.device))
        return _Attn(rows, torch.from_numpy(blocks.reshape(-1)).to(self.device),
                     self._mask(q_pos, max(nblocks) * bs, window)[:, None, None])

    # --- attention, called by the model for each layer ------------------------------------

    def _attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if not self._current.serial:
            return self._attend(layer, q, k, v)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._attend(layer, q, k, v)
        finally:
            torch.set_num_threads(threads)

    def _attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        step, (n, heads, d) = self._current, q.shape
        kc, vc = self.k_cache[layer], self.v_cache[layer]  # [blocks, block_size, kv_heads, d]
        if step.paged is not None:
            assert self._kernel is not None  # paged metadata is built only for the C kernels
            self._kernel.store_kv(k.view(n, -1), v.view(n, -1), kc, vc, step.slots)
            p = step.paged
            threads = 1 if step.serial else torch.get_num_threads()
            return self._kernel.paged_attention(q.contiguous(), kc, vc, p.tables, p.row_seq, p.row_len,
                                                self.config.layer_window[layer], threads,
                                                self.config.attention_scale).view(n, heads * d)
        kc.view(-1, *kc.shape[2:]).index_copy_(0, step.slots, k.to(kc.dtype))
        vc.view(-1, *vc.shape[2:]).index_copy_(0, step.slots, v.to(vc.dtype))
        meta = step.torch[self.config.layer_window[layer]]
        if meta.whole:  # the common all-decode step: no scatter needed
            return self._decode(meta.decodes[0], q, kc, vc).view(n, heads * d)
        out = torch.empty_like(q)
        for a in meta.decodes:
            if isinstance(a.rows, slice):
                out[a.rows] = self._decode(a, q[a.rows], kc, vc)
            else:
                out.index_copy_(0, a.rows, self._decode(a, q.index_select(0, a.rows), kc, vc))
        for a in meta.prefills:
            out[a.rows] = self._prefill(a, q[a.rows], k[a.rows], v[a.rows], kc, vc)
        return out.view(n, heads * d)

    def _decode(self, a: _Attn, q: Tensor, kc: Tensor, vc: Tensor) -> Tensor:
        # One SDPA for a group of single-token requests, contexts padded and masked. Each kv
        # head's query group stands in for the query length, so K/V are never repeated.
        b, heads, d = q.shape
        kv_heads = kc.shape[2]
        assert a.blocks is not None  # decodes always read the cache
        keys = self._gather(0, kc, a.blocks).view(b, -1, kv_heads, d).transpose(1, 2).to(q.dtype)
        values = self._gather(1, vc, a.blocks).view(b, -1, kv_heads, d).transpose(1, 2).to(q.dtype)
        o = F.scaled_dot_product_attention(q.view(b, kv_heads, self._group, d), keys, values,
                                           attn_mask=a.mask, scale=self.config.attention_scale)
        return o.view(b, heads, d)

    def _prefill(self, a: _Attn, q: Tensor, k: Tensor, v: Tensor,
                 kc: Tensor, vc: Tensor) -> Tensor:
        if a.blocks is None:  # rounded as the cache holds them: the same values a later chunk reads
            keys, values = k.to(kc.dtype).to(q.dtype), v.to(vc.dtype).to(q.dtype)
        else:
            keys = self._gather(0, kc, a.blocks).flatten(0, 1).to(q.dtype)
            values = self._gather(1, vc, a.blocks).flatten(0, 1).to(q.dtype)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=a.mask, is_causal=a.mask is None, enable_gqa=True, scale=self.config.attention_scale)
        return o[0].transpose(0, 1)

    def _mask(self, q_pos: Tensor, width: int, window: int | None) -> Tensor:
        """[len(q_pos), width] additive mask: causal over positions, within any sliding window.

        Additive (0 / -inf) rather than bool, so SDPA does not convert it again in every layer.
        """
        k_pos = torch.arange(width, device=self.device)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~allowed, -math.inf)

    def _gather(self, which: int, cache: Tensor, blocks: Tensor) -> Tensor:
        """cache[blocks] into a reused buffer (index_select: 5x faster than advanced indexing)."""
        shape = (len(blocks), *cache.shape[1:])
        need = math.prod(shape)
        if self._gather_bufs[which].numel() < need:
            self._gather_bufs[which] = torch.empty(need, dtype=cache.dtype, device=cache.device)
        return torch.index_select(cache, 0, blocks, out=self._gather_bufs[which][:need].view(shape))


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    # Unwritten cache slots are read by torch's path (padded and masked), so they must hold finite
    # values. On CPU an anonymous mmap gives lazily zeroed 4 KiB pages: a large cache costs
    # nothing until used, and memory grows with the tokens held. (numpy would madvise huge pages
    # for a buffer this size: each layer's first token would then take 2 MiB of K and of V.
    # Huge pages, tried: 5% faster decode attention alone, no gain end to end, since the
    # kernel's compaction on first touch costs what the TLB saves.)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


def _free_memory(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else _available_memory()


def _total_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:  # a container's limit, when it has one
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        return min(total, int(limit)) if limit.isdigit() else total
    except OSError:
        return total


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


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")


def _resolve_kv_dtype(name: str, model_dtype: torch.dtype, quantization: str) -> torch.dtype:
    """The KV cache's element type. auto: float16 beside quantized weights on CPU (the C decode
    attention reads it 20-25 % faster than float32, in half the memory); otherwise the model's
    dtype (float32 on CPU: the reference path stays exact)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {name!r}")
    if name == "auto":
        return torch.float16 if quantization != "none" else model_dtype
    return _DTYPES[name]


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
