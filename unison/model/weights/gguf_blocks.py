"""GGUF's block formats run as the file stores them: regrouped 8 columns to a record, at the file's bytes.

Q4_K, Q5_K, Q6_K, Q8_0, Q5_0, Q5_1, IQ4_NL, IQ4_XS and MXFP4 (gpt-oss's experts: 32 e2m1 values
and an e8m0 scale, 4.25 bits a weight) tensors keep every stored field: the kernel
(csrc/gguf_blocks.h, which documents the records) computes with llama.cpp's own dequantized values,
nothing rounded and nothing quantized a second time. Only the order of the bytes changes, so that a
register holds 8 columns side by side. Q4_0 and Q4_1 already run at their own size on the int4
records (quant.py), float tensors are quantized; any other type is refused by name (RUNNABLE
lists what runs), never requantized.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from unison.model.weights.quant import GGUF_INT4_TYPES, TILE, QuantWeight

FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True, slots=True)
class BlockFormat:
    block: int  # k per file block (and per record)
    file_bytes: int  # bytes per file block (one column)
    record: int  # bytes per record (8 columns)


FORMATS = {
    "Q4_K": BlockFormat(256, 144, 1152),
    "Q5_K": BlockFormat(256, 176, 1408),
    "Q6_K": BlockFormat(256, 210, 1680),
    "Q8_0": BlockFormat(32, 34, 272),
    "Q5_0": BlockFormat(32, 22, 176),
    "Q5_1": BlockFormat(32, 24, 192),
    "IQ4_NL": BlockFormat(32, 18, 144),
    "IQ4_XS": BlockFormat(256, 136, 1088),
    "MXFP4": BlockFormat(32, 17, 136),
}
# (the kernels' format codes: quant.GGML_TYPE_IDS)
RUNNABLE = (*FLOAT_TYPES, *GGUF_INT4_TYPES, *FORMATS)
CHUNK_BYTES = 4 << 20  # file bytes regrouped at a time: bounds the temporaries


def refusal(tensor: str, type_name: str) -> ValueError:
    return ValueError(f"GGUF tensor {tensor!r} has type {type_name}, which Unison does not run; the "
                      f"types that run are {', '.join(RUNNABLE)} (re-quantize the file, e.g. to Q4_K_M)")


def pack(type_name: str, n: int, k: int, rows: Callable[[int, int], np.ndarray]) -> QuantWeight:
    """The [n, k] tensor whose raw rows [r0, r1) `rows` returns, as the kernel's records."""
    fmt = FORMATS[type_name]
    blocks = k // fmt.block
    out = np.empty((-(-n // TILE), blocks, fmt.record), dtype=np.uint8)
    step = max(TILE, CHUNK_BYTES // max(blocks * fmt.file_bytes, 1) // TILE * TILE)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        raw = np.asarray(rows(r0, r1)).reshape(r1 - r0, blocks, fmt.file_bytes)
        if (r1 - r0) % TILE:  # the last tile: zero rows (d = 0) to a multiple of 8
            raw = np.concatenate([raw, np.zeros((TILE - (r1 - r0) % TILE, blocks, fmt.file_bytes), np.uint8)])
        out[r0 // TILE: r0 // TILE + raw.shape[0] // TILE] = _REGROUP[type_name](raw)
    bits = round(fmt.file_bytes * 8 / fmt.block)
    return QuantWeight(bits, torch.from_numpy(out), n, k, gguf_type=type_name)


# ---- the file's fields, per column --------------------------------------------------------------

def _tiles(x: np.ndarray) -> np.ndarray:
    """[rows, blocks, ...] -> [tiles, blocks, 8, ...]: each block's 8 columns side by side."""
    rows, blocks = x.shape[:2]
    t = x.reshape(rows // TILE, TILE, blocks, *x.shape[2:])
    return np.moveaxis(t, 1, 2)


def _bytes(x: np.ndarray) -> np.ndarray:
    """[tiles, blocks, ...] -> [tiles, blocks, bytes]."""
    return np.ascontiguousarray(x).view(np.uint8).reshape(x.shape[0], x.shape[1], -1)


def _field(raw: np.ndarray, start: int, size: int) -> np.ndarray:
    """Bytes [start, start + size) of every file block, 8 columns side by side: [tiles, blocks, 8 size]."""
    return _bytes(_tiles(raw[:, :, start: start + size]))


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Values [rows, blocks, K] (their low 4 bits) as nibble registers: [tiles, blocks, K / 32 * 128].
    Byte 32c + 4 col + j of a 32-block holds k = 8c + j (low) and 8c + 4 + j (high)."""
    rows, blocks, k = q.shape
    t = _tiles(q.reshape(rows, blocks, k // 32, 4, 2, 4) & 15)  # [t, b, col, sub, c, half, j]
    t = t.transpose(0, 1, 3, 4, 5, 2, 6)  # [t, b, sub, c, half, col, j]
    return _bytes(t[:, :, :, :, 0] | (t[:, :, :, :, 1] << 4))


def _plane(q: np.ndarray, bit: int) -> np.ndarray:
    """Bit `bit` of values [rows, blocks, K] as planes [tiles, blocks, K / 32 * 32]: bit i of byte
    4 col + j of a 32-block is that bit of k = 4i + j."""
    rows, blocks, k = q.shape
    bits = (_tiles(q.reshape(rows, blocks, k // 32, 8, 4)) >> bit) & 1  # [t, b, col, sub, i, j]
    packed = (bits.astype(np.uint8) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=4, dtype=np.uint8)
    return _bytes(packed.transpose(0, 1, 3, 2, 4))  # [t, b, sub, col, j]


def _crumbs(q: np.ndarray) -> np.ndarray:
    """Bits 4, 5 of values [rows, blocks, K] as [tiles, blocks, K / 32 * 64]: bits 2i, 2i + 1 of
    byte 32 p + 4 col + j of a 32-block are those of k = 16 p + 4 i + j."""
    rows, blocks, k = q.shape
    c = (_tiles(q.reshape(rows, blocks, k // 32, 2, 4, 4)) >> 4) & 3  # [t, b, col, sub, p, i, j]
    packed = (c.astype(np.uint8) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(axis=5, dtype=np.uint8)
    return _bytes(packed.transpose(0, 1, 3, 4, 2, 5))  # [t, b, sub, p, col, j]


def _quads(q: np.ndarray) -> np.ndarray:
    """Bytes [rows, blocks, 32] with byte 32 i + 4 col + j holding k = 4 i + j: [tiles, blocks, 256]."""
    rows, blocks, _ = q.shape
    return _bytes(_tiles(q.reshape(rows, blocks, 8, 4)).transpose(0, 1, 3, 2, 4))


def _low_high(qs: np.ndarray) -> np.ndarray:
    """16 bytes per 32 values (Q4_0's order: value j in the low nibble of byte j, j + 16 in the high)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _bit_of(word: np.ndarray, count: int) -> np.ndarray:
    """Bits 0 .. count - 1 of little-endian uint32 words [..., 4 bytes] as [..., count] 0 / 1."""
    w = np.ascontiguousarray(word).view("<u4")
    return ((w >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


# ---- the regrouping of each type: raw [rows, blocks, file bytes] -> records ----------------------

def _k4_values(raw: np.ndarray, qs_at: int) -> np.ndarray:
    """Q4_K / Q5_K low nibbles in element order: 32 bytes per 64 values, low nibbles first."""
    qs = raw[:, :, qs_at: qs_at + 128].reshape(*raw.shape[:2], 4, 1, 32)
    return np.concatenate([qs & 15, qs >> 4], axis=3).reshape(*raw.shape[:2], 256)


def _k4_header(raw: np.ndarray) -> np.ndarray:
    """d, dmin, then each column's 12 scale bytes as 3 words (word w of column col at 32 w + 4 col)."""
    words = _tiles(raw[:, :, 4:16].reshape(*raw.shape[:2], 3, 4)).transpose(0, 1, 3, 2, 4)
    return np.concatenate([_field(raw, 0, 2), _field(raw, 2, 2), _bytes(words)], axis=2)


def _blocks(parts: list[np.ndarray], per: int) -> np.ndarray:
    """Per-32-block parts [tiles, blocks, per * size_i] interleaved block by block."""
    t, b = parts[0].shape[:2]
    return np.concatenate([p.reshape(t, b, per, -1) for p in parts], axis=3).reshape(t, b, -1)


def _q4_k(raw: np.ndarray) -> np.ndarray:
    return np.concatenate([_k4_header(raw), _nibbles(_k4_values(raw, 16))], axis=2)


def _q5_k(raw: np.ndarray) -> np.ndarray:
    q = _k4_values(raw, 48)
    # value 64 j + l takes bit 2 j of qh[l], value 64 j + 32 + l bit 2 j + 1
    shifts = np.arange(8, dtype=np.uint8).reshape(4, 2, 1)
    q = q | ((((raw[:, :, None, None, 16:48] >> shifts) & 1).reshape(q.shape)) << 4)
    return np.concatenate([_k4_header(raw), _blocks([_nibbles(q), _plane(q, 4)], 8)], axis=2)


def _q6_k(raw: np.ndarray) -> np.ndarray:
    ql = raw[:, :, :128].reshape(*raw.shape[:2], 2, 64)
    qh = raw[:, :, 128:192].reshape(*raw.shape[:2], 2, 1, 32)
    # value 128 n + 32 g + l: g = 0, 1 the low nibbles of ql[l], ql[l + 32]; g = 2, 3 their high
    low = np.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=3)
    high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3  # [r, b, n, g, 32]
    q = (low | (high << 4)).reshape(*raw.shape[:2], 256)
    scales = _bytes(_tiles(raw[:, :, 192:208]).transpose(0, 1, 3, 2))  # [t, b, scale, col]
    blocks = _blocks([_nibbles(q), _crumbs(q)], 8)
    return np.concatenate([_field(raw, 208, 2), scales, blocks], axis=2)


def _q8_0(raw: np.ndarray) -> np.ndarray:
    return np.concatenate([_field(raw, 0, 2), _quads(raw[:, :, 2:])], axis=2)


def _q5_values(raw: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 values 0..31: nibbles as Q4_0's, bit 4 of value j in bit j of the word qh."""
    return _low_high(raw[:, :, -16:]) | (_bit_of(raw[:, :, -20:-16], 32) << 4)


def _q5_0(raw: np.ndarray) -> np.ndarray:
    q = _q5_values(raw)
    return np.concatenate([_field(raw, 0, 2), _plane(q, 4), _nibbles(q)], axis=2)


def _q5_1(raw: np.ndarray) -> np.ndarray:
    q = _q5_values(raw)
    return np.concatenate([_field(raw, 0, 2), _field(raw, 2, 2), _plane(q, 4), _nibbles(q)], axis=2)


def _iq4_nl(raw: np.ndarray) -> np.ndarray:
    return np.concatenate([_field(raw, 0, 2), _nibbles(_low_high(raw[:, :, 2:]))], axis=2)


def _iq4_xs(raw: np.ndarray) -> np.ndarray:
    q = _low_high(raw[:, :, 8:].reshape(*raw.shape[:2], 8, 16)).reshape(*raw.shape[:2], 256)
    return np.concatenate([_field(raw, 0, 2), _field(raw, 2, 2), _field(raw, 4, 4), _nibbles(q)], axis=2)


def _mxfp4(raw: np.ndarray) -> np.ndarray:
    return np.concatenate([_field(raw, 0, 1), _nibbles(_low_high(raw[:, :, 1:]))], axis=2)


_REGROUP = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "Q8_0": _q8_0, "Q5_0": _q5_0, "Q5_1": _q5_1,
            "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs, "MXFP4": _mxfp4}
