"""PagedAttention: the paged KV cache and the attention over it, which ModelRunner owns.

The runner flattens a batch and runs the model; this module turns the batch's block tables into
each step's attention metadata (built once, read by every layer) and runs each layer's attention:
the C kernel's paged attention on CPU, torch's SDPA over gathered blocks elsewhere.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from unison.model.families import ModelConfig
from unison.model.kernels import cpu_kernels
from unison.model.layers.key_rounding import KeyRounding
from unison.model.layers.recent_rows import Item, RecentRows, RecentStep

# Attention work per layer (query rows x the keys each sees x query heads x head_dim: QK^T's
# multiply-adds) up to which a step's attention runs on one thread: a parallel region over so
# little work costs more than it saves, and when the other cores are busy a preempted worker
# stalls every such op (50-100x slower, measured under load). That is 8,192 keys at the embedded
# model's 9 heads of 64; a Qwen3.5 layer (16 heads of 256) goes parallel past 1,152 keys (on one
# thread, its 8,000-token decode ran at 0.80 of its 500-token speed).
SERIAL_ATTENTION_WORK = 8192 * 9 * 64

# Torch's decode path (no C kernel): a decode group is split so that the K/V it gathers (8 MiB) is
# still in cache when SDPA reads it: 1.7x faster at 64 requests x 300 tokens than one gather.
DECODE_CHUNK_BYTES = 8 << 20


@dataclass(slots=True)
class _Attn:
    """One torch attention call: some rows of the flat batch and the cache blocks they attend over."""

    rows: slice | Tensor  # a prefill's row range, or the rows of a group of decodes
    blocks: Tensor | None  # [items * width] blocks to gather; None: only the new tokens
    mask: Tensor | None  # additive, [n, width] or [items, 1, 1, width]; None: plain causal


@dataclass(slots=True)
class PagedMeta:
    """The C kernel's view of a step: every row attends over its request's blocks up to itself."""

    tables: Tensor  # [items, width] int64 block tables
    row_seq: Tensor  # [N] int64: each row's item
    row_len: Tensor  # [N] int64: each row's position + 1
    recent: RecentStep | None = None  # an int8 cache's recent rows (recent_rows.py)
    ahead: Tensor | None = None  # [N] int64: keys each row sees past its own position (images')


@dataclass(slots=True)
class _TorchAttn:
    """Torch's view of a step for layers of one window (masks differ with the window)."""

    decodes: list[_Attn]  # single-token requests: grouped by context length, in chunks
    prefills: list[_Attn]  # multi-token chunks, one each
    whole: bool  # a single decode group covering the whole batch, in order


@dataclass(slots=True)
class StepMeta:
    """Per-step attention metadata, built once per forward and shared by every layer."""

    slots: Tensor  # [N] cache slot of each new token
    serial: bool  # attention on one thread (see SERIAL_ATTENTION_WORK)
    paged: PagedMeta | None = None  # the C kernel's metadata; else torch's, per window
    torch: dict[int | None, _TorchAttn] = field(default_factory=dict)


class PagedAttention:
    """A paged KV cache and the attention of a flat batch of prefill chunks and decodes over it.

    Per layer the cache is [num_blocks, block_size, kv_heads, head_dim] for K and for V; a
    request's token at position p lives in block block_table[p // block_size], row p % block_size.
    A forward opens `step(batch, positions)`; the model calls `forward` once per layer inside it.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, *, dtype: torch.dtype,
                 kv_dtype: torch.dtype, device: torch.device):
        # The runner rebinds config on a reload: the shapes stay, the attention scale may not.
        self.config, self.block_size, self.device = config, block_size, device
        self.dtype = dtype  # the model's: the masks' type
        c = config
        # int8: each head's row is q8_0 blocks, 32 values and a float16 scale (csrc/paged_attention.c),
        # of the row times a Hadamard matrix (csrc/fused_ops.c); fp8: a byte a value.
        row = kv_head_bytes(c.head_dim, kv_dtype) // kv_dtype.itemsize
        # One entry per layer that keeps KV (a hybrid's full-attention layers; every layer elsewhere)
        layers = len(c.attention_layers)
        self.windows = c.kv_windows  # each KV layer's window (a reload keeps them: the runner checks)
        shape = (layers, num_blocks, block_size, c.num_key_value_heads, row)
        self.k_cache = lazy_zeros(shape, device, kv_dtype)
        self.v_cache = lazy_zeros(shape, device, kv_dtype)
        # The C kernels when the model runs on them (the runner sets them): paged metadata and the
        # kernel's attention; None: torch's metadata and SDPA.
        self.kernel: cpu_kernels.CpuKernels | None = None
        self._group = c.num_attention_heads // c.num_key_value_heads
        self._step: StepMeta | None = None
        # int8: how keys are stored (key_rounding.py; the runner measures it at load); None: as
        # they are, rounded to nearest.
        self.key_rounding: KeyRounding | None = None
        # Each KV layer's learned sinks [heads] (gpt-oss; the runner sets them from the model), or None.
        self.sinks: list[Tensor | None] = [None] * layers
        # int8: the rows of each query's own block, read as float16 (recent_rows.py).
        self.recent = (RecentRows(layers, block_size, c.num_key_value_heads, c.head_dim)
                       if kv_dtype == torch.int8 else None)
        # Gather buffers reused across layers and steps: a fresh multi-MB tensor per layer costs
        # page faults that make decode attention 3x slower on CPU.
        self._gather_bufs = [torch.empty(0, dtype=kv_dtype, device=device) for _ in range(2)]

    def set_sinks(self, sinks: list[Tensor | None]) -> None:
        """Each KV layer's learned sinks (gpt-oss), which only the C kernel's softmax takes."""
        if self.kernel is None and any(s is not None for s in sinks):
            raise ValueError(f"{self.config.architecture}'s attention sinks run on the C kernels only (CPU, "
                             "float32); this model would run on torch's")
        self.sinks = sinks

    # --- whole blocks: the prefix cache's disk tier (core/kv/disk_cache.py) moves them ----------

    @property
    def block_nbytes(self) -> int:
        """One block's K and V over every layer, in bytes."""
        return 2 * self.k_cache[:, 0].nbytes

    def read_block(self, block: int) -> bytes:
        """One block's K, then its V, over every layer."""
        kv = torch.stack((self.k_cache[:, block], self.v_cache[:, block]))
        return kv.view(torch.uint8).cpu().numpy().tobytes()

    def copy_block(self, src: int, dst: int) -> None:
        """Block dst's K and V = block src's (the prefix cache's partial-block hits)."""
        self.k_cache[:, dst] = self.k_cache[:, src]
        self.v_cache[:, dst] = self.v_cache[:, src]

    def write_block(self, block: int, data: bytearray | memoryview) -> None:
        """Fill a block from read_block's bytes."""
        k = self.k_cache
        kv = torch.frombuffer(data, dtype=torch.uint8).view(k.dtype).view(2, *k[:, block].shape)
        k[:, block].copy_(kv[0])
        self.v_cache[:, block].copy_(kv[1])

    @contextmanager
    def step(self, batch: Sequence[Item], positions: np.ndarray,
             images: cpu_kernels.ImageRows | None = None) -> Iterator[StepMeta]:
        """This step's metadata (`positions`: each new token's, flat; `images`: the rows that see
        their whole image), which `forward` reads until the step ends."""
        self._step = self._prepare(batch, positions)
        if images is not None:
            assert self._step.paged is not None, "images run on the C attention kernel (vision/encoder.py)"
            self._step.paged.ahead = images.ahead
        try:
            yield self._step
        finally:
            self._step = None

    @property
    def _current(self) -> StepMeta:
        """This forward's attention metadata (set by step, cleared when the forward ends)."""
        assert self._step is not None
        return self._step

    # --- per-step metadata ---------------------------------------------------------------

    def _prepare(self, batch: Sequence[Item], positions: np.ndarray) -> StepMeta:
        """Each new token's cache slot, whether to attend on one thread, and the C kernel's or
        torch's view of the block tables."""
        bs = self.block_size
        slots: list[np.ndarray] = []
        row, work = 0, 0
        for item in batch:
            n, start = len(item.token_ids), item.start_pos
            pos = positions[row: row + n]
            table = np.asarray(item.block_table, dtype=np.int64)
            slots.append(table[pos // bs] * bs + pos % bs)
            row, work = row + n, work + n * (start + n)
        width = self.config.num_attention_heads * self.config.head_dim
        serial = self.device.type == "cpu" and work * width <= SERIAL_ATTENTION_WORK
        step_slots = torch.from_numpy(np.concatenate(slots)).to(self.device)
        if self.kernel is not None:
            return StepMeta(step_slots, serial, paged=self._paged_meta(batch, positions))
        return StepMeta(step_slots, serial, torch={
            w: self._torch_meta(batch, w) for w in self.config.windows})

    def _paged_meta(self, batch: Sequence[Item], positions: np.ndarray) -> PagedMeta:
        # The kernel reads each request's own blocks up to each row's own length: no padding.
        bs = self.block_size
        ends = [item.start_pos + len(item.token_ids) for item in batch]
        tables = np.zeros((len(batch), -(-max(ends) // bs)), dtype=np.int64)
        for i, (item, end) in enumerate(zip(batch, ends)):
            nb = -(-end // bs)
            tables[i, :nb] = item.block_table[:nb]
        row_seq = np.repeat(np.arange(len(batch), dtype=np.int64), [len(it.token_ids) for it in batch])
        return PagedMeta(torch.from_numpy(tables), torch.from_numpy(row_seq), torch.from_numpy(positions + 1),
                         None if self.recent is None else self.recent.step(batch))

    def _torch_meta(self, batch: Sequence[Item], window: int | None) -> _TorchAttn:
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

    def _prefill_meta(self, row: int, item: Item, window: int | None) -> _Attn:
        n, start, bs = len(item.token_ids), item.start_pos, self.block_size
        rows = slice(row, row + n)
        if start == 0 and (window is None or n <= window):
            return _Attn(rows, None, None)  # a whole prompt: attend over its own new K/V
        nblocks = -(-(start + n) // bs)
        blocks = torch.tensor(item.block_table[:nblocks], dtype=torch.int64, device=self.device)
        q_pos = torch.arange(start, start + n, device=self.device)[:, None]
        return _Attn(rows, blocks, self._mask(q_pos, nblocks * bs, window))

    def _decode_meta(self, decode: list[tuple[int, Item]], all_decode: bool,
                     window: int | None) -> list[_Attn]:
        # Contexts are padded to the longest of their group: group by length so that padding at
        # most doubles the work (or adds 256 tokens): a short request is not padded to long ones.
        bs = self.block_size
        nblocks = {row: -(-(item.start_pos + 1) // bs) for row, item in decode}
        groups: list[list[tuple[int, Item]]] = []
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
        block_bytes = 2 * self.k_cache[0, 0].nbytes  # K and V, one layer
        return max(1, DECODE_CHUNK_BYTES // (width * block_bytes))

    def _decode_chunk(self, chunk: list[tuple[int, Item]], in_order: bool,
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

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Store the step's new K/V of `layer` (its index among the layers that keep KV) in the
        cache, then attend (decoder.Attention)."""
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
            assert self.kernel is not None  # paged metadata is built only for the C kernels
            weight, mean = (None, None) if self.key_rounding is None else (
                self.key_rounding.weight[layer], self.key_rounding.mean[layer])
            p = step.paged
            recent = None if p.recent is None or self.recent is None else self.recent.layer(p.recent, layer)
            self.kernel.store_kv(k.view(n, -1), v.view(n, -1), kc, vc, step.slots, d, weight, mean, recent)
            threads = 1 if step.serial else torch.get_num_threads()
            return self.kernel.paged_attention(q.contiguous(), kc, vc, p.tables, p.row_seq, p.row_len,
                                               self.windows[layer], threads, self.config.attention_scale,
                                               mean, recent, self.sinks[layer], p.ahead).view(n, heads * d)
        assert kc.dtype not in cpu_kernels.C_ONLY_KV_DTYPES, "8-bit KV: the C kernel's only (runner refuses)"
        kc.view(-1, *kc.shape[2:]).index_copy_(0, step.slots, k.to(kc.dtype))
        vc.view(-1, *vc.shape[2:]).index_copy_(0, step.slots, v.to(vc.dtype))
        meta = step.torch[self.windows[layer]]
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


def kv_head_bytes(head_dim: int, kv_dtype: torch.dtype) -> int:
    """The bytes one head of one token takes in the cache: int8 keeps a float16 scale per 32."""
    return head_dim // 32 * 34 if kv_dtype == torch.int8 else head_dim * kv_dtype.itemsize


def lazy_zeros(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
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
