"""gpt-oss's fused experts, presented one expert at a time as every other MoE family stores them.

A gpt-oss checkpoint holds each layer's experts in two tensors: `mlp.experts.gate_up_proj`
[experts, hidden, 2 * inter], whose columns interleave gate (even) and up (odd), and
`mlp.experts.down_proj` [experts, inter, hidden], each with its bias ([experts, 2 * inter],
[experts, hidden]). `FusedExperts` reads them as `mlp.experts.E.gate_proj.weight` [inter, hidden]
and so on, so that decoder.load_moe loads and quantizes them as it does Qwen3-MoE's.
"""

from __future__ import annotations

import re

import torch

from . import quant
from .quant import QuantWeight
from .weights import WeightSource

_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$")
_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|bias)$")


class FusedExperts:
    """`base` with each layer's fused experts split per expert (a view: nothing is copied until a
    tensor is asked for, and the fused tensor last read is kept for its other experts)."""

    def __init__(self, base: WeightSource) -> None:
        self.base = base
        self._experts = {m.group(1): base.shape(n)[0] for n in base.names()
                         if (m := _FUSED.match(n)) and m.group(2) == "down_proj" and not m.group(3)}
        self._cached: tuple[str, torch.Tensor] | None = None

    def _split(self, name: str) -> tuple[str, int, str, str] | None:
        """(the fused tensor's name, expert, projection, weight or bias) of a per-expert name."""
        m = _EXPERT.match(name)
        if m is None or m.group(1) not in self._experts or int(m.group(2)) >= self._experts[m.group(1)]:
            return None
        fused = f"{m.group(1)}.{'down_proj' if m.group(3) == 'down' else 'gate_up_proj'}"
        return fused + ("_bias" if m.group(4) == "bias" else ""), int(m.group(2)), m.group(3), m.group(4)

    def __contains__(self, name: str) -> bool:
        split = self._split(name)
        return split[0] in self.base if split else name in self.base

    def names(self) -> set[str]:
        own = {n for n in self.base.names() if not _FUSED.match(n)}
        return own | {f"{prefix}.{e}.{p}_proj.{kind}" for prefix, experts in self._experts.items()
                      for e in range(experts) for p in ("gate", "up", "down") for kind in ("weight", "bias")}

    def source_type(self, name: str) -> str:
        split = self._split(name)
        return self.base.source_type(split[0] if split else name)

    def shape(self, name: str) -> tuple[int, ...]:
        split = self._split(name)
        if split is None:
            return self.base.shape(name)
        fused, _, proj, kind = split
        shape = self.base.shape(fused)  # [E, hidden, 2 inter] / [E, inter, hidden]; biases [E, n]
        if kind == "bias":
            return (shape[1] // 2,) if proj != "down" else (shape[1],)
        return (shape[2] // 2, shape[1]) if proj != "down" else (shape[2], shape[1])

    def float(self, name: str) -> torch.Tensor:
        split = self._split(name)
        if split is None:
            return self.base.float(name)
        fused, e, proj, kind = split
        if self._cached is None or self._cached[0] != fused:
            self._cached = (fused, self.base.float(fused))
        t = self._cached[1][e]
        if proj != "down":  # gate: the even columns, up: the odd ones
            t = t[..., 0::2] if proj == "gate" else t[..., 1::2]
        return (t if kind == "bias" else t.T).contiguous()

    def quantized(self, name: str, bits: int) -> QuantWeight:
        if self._split(name) is None:
            return self.base.quantized(name, bits)
        return quant.quantize(self.float(name), bits)
