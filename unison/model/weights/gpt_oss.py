"""Fused experts (gpt-oss's, Qwen3-VL-MoE's), presented one expert at a time as every other MoE
family stores them.

A gpt-oss checkpoint holds each layer's experts in two tensors: `mlp.experts.gate_up_proj`
[experts, hidden, 2 * inter], whose columns interleave gate (even) and up (odd), and
`mlp.experts.down_proj` [experts, inter, hidden], each with its bias ([experts, 2 * inter],
[experts, hidden]). The published checkpoints store both in MXFP4 instead: `*_blocks` [experts,
rows, k / 32, 16] (two e2m1 values a byte, adjacent elements low nibble first) and `*_scales`
[experts, rows, k / 32] (e8m0), rows being the output features (gate and up interleaved).
`FusedExperts` reads them as `mlp.experts.E.gate_proj.weight` [inter, hidden] and so on, so that
decoder.load_moe loads them as it does Qwen3-MoE's; MXFP4 ones as GGUF's MXFP4 blocks (the same
bytes, the nibbles reordered to element j and j + 16 a byte), which run as stored.

Qwen3-VL-MoE's are the same two tensors without biases, gate and up as halves (gate first): the
published checkpoints store them [experts, in, out] as gpt-oss does, transformers 5 saves them
[experts, out, in] (a Linear's); told apart by where the hidden size is, as transformers' loader
tells them (a square gate_up, which no published model has, is read as published).
"""

from __future__ import annotations

import re
import threading

import numpy as np
import torch

from unison.model.weights import gguf_blocks, quant
from unison.model.weights.quant import QuantWeight
from unison.model.weights.sources import WeightSource

_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|bias)$")
MXFP4_BLOCK, MXFP4_BYTES = 32, 17  # values a block; GGUF's bytes a block (an e8m0 scale, 16 of nibbles)


class FusedExperts:
    """`base` with each layer's fused experts split per expert (a view: nothing is copied until a
    tensor is asked for, and the fused tensor last read is kept for its other experts)."""

    def __init__(self, base: WeightSource, layout: str, hidden_size: int) -> None:
        """`layout`: gate and up "interleaved" (gpt-oss) or as "halves" (Qwen3-VL-MoE)."""
        self.base, self.interleaved, self.hidden = base, layout == "interleaved", hidden_size
        self._experts: dict[str, int] = {}  # a layer's experts' prefix -> how many
        for name in base.names():
            if (m := _FUSED.match(name)) and m.group(2) == "down_proj" and m.group(3) in (None, "_blocks"):
                self._experts[m.group(1)] = base.shape(name)[0]
        self._cached: tuple[str, torch.Tensor] | None = None
        self._lock = threading.Lock()

    def _split(self, name: str) -> tuple[str, int, str, str] | None:
        """(the fused tensor's name, expert, projection, weight or bias) of a per-expert name."""
        m = _EXPERT.match(name)
        if m is None or m.group(1) not in self._experts or int(m.group(2)) >= self._experts[m.group(1)]:
            return None
        fused = f"{m.group(1)}.{'down_proj' if m.group(3) == 'down' else 'gate_up_proj'}"
        return fused + ("_bias" if m.group(4) == "bias" else ""), int(m.group(2)), m.group(3), m.group(4)

    def _mxfp4(self, split: tuple[str, int, str, str]) -> bool:
        return split[3] == "weight" and split[0] + "_blocks" in self.base

    def __contains__(self, name: str) -> bool:
        split = self._split(name)
        if split is None:
            return name in self.base
        return split[0] + "_blocks" in self.base if self._mxfp4(split) else split[0] in self.base

    def names(self) -> set[str]:
        own = {n for n in self.base.names() if not _FUSED.match(n)}
        return own | {f"{prefix}.{e}.{p}_proj.{kind}" for prefix, experts in self._experts.items()
                      for e in range(experts) for p in ("gate", "up", "down") for kind in ("weight", "bias")}

    def source_type(self, name: str) -> str:
        split = self._split(name)
        if split is not None and self._mxfp4(split):
            return "MXFP4"
        return self.base.source_type(split[0] if split else name)

    def shape(self, name: str) -> tuple[int, ...]:
        split = self._split(name)
        if split is None:
            return self.base.shape(name)
        fused, _, proj, kind = split
        if self._mxfp4(split):  # blocks [E, rows, k / 32, 16], rows the outputs (gate, up interleaved)
            _, rows, blocks, _ = self.base.shape(fused + "_blocks")
            return (rows // 2 if proj != "down" else rows, blocks * MXFP4_BLOCK)
        shape = self.base.shape(fused)  # [E, hidden, 2 inter] / [E, inter, hidden]; biases [E, n]
        if kind == "bias":
            return (shape[1] // 2,) if proj != "down" else (shape[1],)
        k, n = (shape[1], shape[2]) if self._in_out(fused) else (shape[2], shape[1])
        return (n // 2, k) if proj != "down" else (n, k)

    def _in_out(self, fused: str) -> bool:
        """Whether a layer's fused weights are stored [experts, in, out] (else [experts, out, in]):
        told by its gate_up (hidden first), for its down too (whose shape is square where the
        experts' size is the hidden size)."""
        if self.interleaved:
            return True
        return self.base.shape(fused.rsplit(".", 1)[0] + ".gate_up_proj")[1] == self.hidden

    def _fused(self, name: str) -> torch.Tensor:
        # one read of a fused tensor for all of its experts, whose linears load on several threads
        with self._lock:
            if self._cached is None or self._cached[0] != name:
                self._cached = (name, self.base.float(name) if not name.endswith(("_blocks", "_scales"))
                                else self._raw(name))
            return self._cached[1]

    def _raw(self, name: str) -> torch.Tensor:
        """An MXFP4 checkpoint's blocks and scales as GGUF's MXFP4 rows [E, rows, k / 32 * 17]."""
        fused = name.removesuffix("_blocks").removesuffix("_scales")
        blocks = self.base.float(fused + "_blocks").to(torch.uint8).numpy()
        scales = self.base.float(fused + "_scales").to(torch.uint8).numpy()
        low, high = blocks & 15, blocks >> 4  # element 2i, 2i + 1
        values = np.stack([low, high], axis=-1).reshape(*blocks.shape[:-1], MXFP4_BLOCK)
        packed = values[..., :16] | (values[..., 16:] << 4)  # GGUF's: element j low, j + 16 high
        raw = np.concatenate([scales[..., None], packed], axis=-1)
        return torch.from_numpy(np.ascontiguousarray(raw.reshape(*raw.shape[:2], -1)))

    def _rows(self, split: tuple[str, int, str, str]) -> np.ndarray:
        """An MXFP4 expert projection's GGUF rows [n, k / 32 * 17]."""
        fused, e, proj, _ = split
        raw = self._fused(fused + "_blocks")[e].numpy()
        return raw if proj == "down" else raw[0::2] if proj == "gate" else raw[1::2]

    def float(self, name: str) -> torch.Tensor:
        split = self._split(name)
        if split is None:
            return self.base.float(name)
        if self._mxfp4(split):
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            return torch.from_numpy(np.array(dequantize(self._rows(split), GGMLQuantizationType.MXFP4)))
        fused, e, proj, kind = split
        t = self._fused(fused)[e]
        if kind == "weight" and not self._in_out(fused):
            t = t.T  # [in, out], as the published ones
        if proj != "down" and self.interleaved:  # gate: the even columns, up: the odd ones
            t = t[..., 0::2] if proj == "gate" else t[..., 1::2]
        elif proj != "down":  # the halves, gate first
            half = t.shape[-1] // 2
            t = t[..., :half] if proj == "gate" else t[..., half:]
        return (t if kind == "bias" else t.T).contiguous()

    def quantized(self, name: str, bits: int) -> QuantWeight:
        """MXFP4 experts as stored (whatever `bits`); float ones quantized to `bits`."""
        split = self._split(name)
        if split is None:
            return self.base.quantized(name, bits)
        if self._mxfp4(split):
            rows = np.ascontiguousarray(self._rows(split))
            n, k = self.shape(name)
            return gguf_blocks.pack("MXFP4", n, k, lambda r0, r1: rows[r0:r1])
        return quant.quantize(self.float(name), bits)
