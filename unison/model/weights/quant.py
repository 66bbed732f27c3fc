"""Quantized weights for CPUs: our int4 / int8 records for csrc/quant_linear.c, and the layer.

A weight matrix [n, k] is held as blocks of 32 along k, w = d * q + m per block and output row:
int4 (q in 0..15, fp16 d and m: 5 bits per weight) or int8 (q in -127..127, fp16 d and m: 9 bits).
A float checkpoint is quantized into them; GGUF's Q4_0 and Q4_1 map onto int4 exactly, at their own
bytes. GGUF's other block formats keep their own layout (gguf_blocks.py); a QuantWeight holds either.

Why our own kernel: the kept int8 libraries (fbgemm's dynamic Linear, oneDNN's qlinear) take one
activation scale per call, so a row's result depends on the rest of its batch; torch's weight-only
int8/int4 ops are batch-invariant but run at a tenth of fp32's speed at batch 1 here. The kernel
quantizes activations per row and block, as llama.cpp does (see the C file for the layout).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

QBLOCK = 32  # weights and activations share 32-element blocks along k
TILE = 8  # output rows packed side by side
RECORD = {4: 160, 8: 288}  # bytes per (tile, block): see csrc/quant_linear.c
# int4 records without m, where m = -8 d (GGUF's Q4_0): a Q4_0 file runs at its own 4.5 bits.
# The kernels tell the formats apart by their record's size.
INT4_SYM_RECORD = 144
# GGUF types the int4 records hold at their own bytes (the others: gguf_blocks.py).
GGUF_INT4_TYPES = ("Q4_0", "Q4_1")
# GGUF block formats run as stored (gguf_blocks.py): format codes 4096 + the GGML type id.
GGUF_FORMAT_BASE = 4096
GGML_TYPE_IDS = {"Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20,
                 "IQ4_XS": 23, "MXFP4": 39}
CHUNK_ELEMENTS = 1 << 20  # rows converted at a time: bounds the temporaries to a few MiB


@dataclass(slots=True)
class BlockQuant:
    """Rows of a weight matrix in 32-blocks, before packing: w = d * q + m."""

    bits: int
    q: np.ndarray  # [rows, kp] uint8 (int4: 0..15) or int8
    d: np.ndarray  # [rows, kp / 32] float16
    m: np.ndarray | None  # [rows, kp / 32] float16; None: 0 for int8, -8 d for int4 (Q4_0's blocks)

    def dequantize(self, k: int) -> np.ndarray:
        d = np.repeat(self.d.astype(np.float32), QBLOCK, axis=1)
        w = d * self.q.astype(np.float32)
        m = self.min()
        if m is not None:
            w += np.repeat(m.astype(np.float32), QBLOCK, axis=1)
        return w[:, :k]

    def min(self) -> np.ndarray | None:
        """m as stored, or -8 d for int4 blocks without one (exact: d times a power of two)."""
        if self.m is None and self.bits == 4:
            return (self.d.astype(np.float32) * -8).astype(np.float16)
        return self.m


@dataclass(slots=True)
class QuantWeight:
    """A [n, k] matrix packed for the kernel: uint8 records [n_padded / 8, kp / 32, record], or
    for a GGUF block format [n_padded / 8, k / its block, record] (gguf_blocks.py)."""

    bits: int  # int4 / int8; for a GGUF block format, its bits per weight rounded
    packed: torch.Tensor
    n: int
    k: int
    gguf_type: str | None = None  # a GGUF block format run as stored (gguf_blocks.py), or our records

    @property
    def kind(self) -> str:
        return self.gguf_type.lower() if self.gguf_type else f"int{self.bits}"

    @property
    def format(self) -> int:
        """The format as the kernels name it: bytes per (tile, block) record for our records
        (144, 160, 288), 4096 + the GGML type id for a GGUF block format."""
        return GGUF_FORMAT_BASE + GGML_TYPE_IDS[self.gguf_type] if self.gguf_type else self.packed.shape[-1]

    @property
    def kp(self) -> int:
        return _round_up(self.k, QBLOCK)

    @property
    def n_padded(self) -> int:
        return _round_up(self.n, TILE)

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


# ---- packing ----------------------------------------------------------------------------------

def pack_rows(bq: BlockQuant) -> np.ndarray:
    """[rows / 8, nb, record] uint8 for rows that are a multiple of 8 (see csrc/quant_linear.c)."""
    rows, kp = bq.q.shape
    tiles, nb = rows // TILE, kp // QBLOCK
    d = _tiled(bq.d, tiles, nb)
    m = _tiled(bq.m if bq.m is not None else np.zeros_like(bq.d), tiles, nb)  # int8's m=None: 0
    if bq.bits == 8:  # k-major: each k's 8 columns side by side
        q = bq.q.astype(np.int8).view(np.uint8).reshape(tiles, TILE, nb, QBLOCK).transpose(0, 2, 3, 1)
        return np.concatenate([q.reshape(tiles, nb, 256), d, m], axis=2)
    q = bq.q.reshape(tiles, TILE, nb, 4, 2, 4).transpose(0, 2, 3, 4, 1, 5)  # t, b, c, half, col, j
    nibbles = q[:, :, :, 0] | (q[:, :, :, 1] << np.uint8(4))
    if bq.m is None:  # m = -8 d, left for the kernel to compute: INT4_SYM_RECORD
        return np.concatenate([nibbles.reshape(tiles, nb, 128), d], axis=2)
    return np.concatenate([nibbles.reshape(tiles, nb, 128), d, m], axis=2)


def _tiled(scales: np.ndarray, tiles: int, nb: int) -> np.ndarray:
    """[rows, nb] fp16 -> [tiles, nb, 16] bytes: each block's 8 column scales side by side."""
    t = scales.astype(np.float16).reshape(tiles, TILE, nb).transpose(0, 2, 1)
    return np.ascontiguousarray(t).view(np.uint8).reshape(tiles, nb, 16)


def pack(n: int, k: int, bits: int, rows: Callable[[int, int], BlockQuant], symmetric: bool = False
         ) -> QuantWeight:
    """Pack an [n, k] matrix whose rows [r0, r1) `rows` converts, a slice at a time (`symmetric`:
    int4 blocks whose m is -8 d, which `rows` returns as m=None, packed without it)."""
    nb = _round_up(k, QBLOCK) // QBLOCK
    record = INT4_SYM_RECORD if symmetric else RECORD[bits]
    out = np.empty((_round_up(n, TILE) // TILE, nb, record), dtype=np.uint8)
    step = max(TILE, CHUNK_ELEMENTS // max(k, 1) // TILE * TILE)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        bq = rows(r0, r1)
        if r1 - r0 < step and (r1 - r0) % TILE:  # the last tile: zero rows to a multiple of 8
            bq = _pad_rows(bq, _round_up(r1 - r0, TILE))
        out[r0 // TILE: r0 // TILE + bq.q.shape[0] // TILE] = pack_rows(bq)
    return QuantWeight(bits, torch.from_numpy(out), n, k)


def _pad_rows(bq: BlockQuant, rows: int) -> BlockQuant:
    def pad(a: np.ndarray) -> np.ndarray:
        return np.concatenate([a, np.zeros((rows - a.shape[0], a.shape[1]), a.dtype)])
    return BlockQuant(bq.bits, pad(bq.q), pad(bq.d), None if bq.m is None else pad(bq.m))


# ---- quantizing floats --------------------------------------------------------------------------

def _blocks(w: np.ndarray) -> np.ndarray:
    """[rows, k] float -> [rows, nb, 32] float32, zero-padded to whole blocks."""
    rows, k = w.shape
    kp = _round_up(k, QBLOCK)
    if kp != k:
        w = np.concatenate([w, np.zeros((rows, kp - k), dtype=w.dtype)], axis=1)
    return np.asarray(w, dtype=np.float32).reshape(rows, kp // QBLOCK, QBLOCK)


def quantize_int8(w: np.ndarray) -> BlockQuant:
    """Symmetric int8 per block: d = max|w| / 127, q = round(w / d)."""
    b = _blocks(w)
    d = (np.abs(b).max(axis=2) / 127).astype(np.float16)
    df = d.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(df > 0, np.rint(b / df), 0)
    return BlockQuant(8, np.clip(q, -127, 127).astype(np.int8).reshape(w.shape[0], -1), d, None)


def quantize_int4(w: np.ndarray) -> BlockQuant:
    """Asymmetric 4-bit per block (Q4_1's scheme): d = (max - min) / 15, m = min."""
    b = _blocks(w)
    lo, hi = b.min(axis=2), b.max(axis=2)
    d = ((hi - lo) / 15).astype(np.float16)
    m = lo.astype(np.float16)
    df, mf = d.astype(np.float32)[..., None], m.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(df > 0, np.rint((b - mf) / df), 0)
    return BlockQuant(4, np.clip(q, 0, 15).astype(np.uint8).reshape(w.shape[0], -1), d, m)


QUANTIZERS = {4: quantize_int4, 8: quantize_int8}


def quantize(w: torch.Tensor | np.ndarray, bits: int) -> QuantWeight:
    """Pack a float matrix (an HF checkpoint's weight) as int4 or int8."""
    w = w.float().numpy() if isinstance(w, torch.Tensor) else w
    n, k = w.shape
    return pack(n, k, bits, lambda r0, r1: QUANTIZERS[bits](w[r0:r1]))


def concat(parts: Sequence[QuantWeight]) -> QuantWeight:
    """Rows of several matrices of the same kind and k (q, k, v into one QKV)."""
    first = parts[0]
    assert all(p.format == first.format and p.k == first.k and p.n % TILE == 0 for p in parts[:-1])
    return QuantWeight(first.bits, torch.cat([p.packed for p in parts]), sum(p.n for p in parts), first.k,
                       first.gguf_type)


def stack(parts: Sequence[QuantWeight]) -> QuantWeight:
    """Matrices of one kind and shape as one weight [len(parts), ...] (a mixture's experts, each
    run on its own): `n` and `k` stay each matrix's."""
    first = parts[0]
    assert all(p.format == first.format and p.n == first.n and p.k == first.k for p in parts)
    return QuantWeight(first.bits, torch.stack([p.packed for p in parts]), first.n, first.k, first.gguf_type)
