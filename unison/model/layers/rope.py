"""Rotary position embeddings: frequencies after each kind of scaling, as transformers computes
them, and the cos / sin of a step's positions."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from unison.json_types import JSONObject

SCALINGS = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class Rope:
    """One rotary embedding: a theta, a scaling (rope_type and its parameters), per-frequency
    divisors (GGUF's rope_freqs tensor of Llama 3.1+), and the head_dim it rotates."""

    head_dim: int
    theta: float = 10000.0
    scaling: tuple[tuple[str, Any], ...] = ()  # sorted items of an HF rope_parameters dict (JSON: Any)
    factors: tuple[float, ...] | None = None
    max_position_embeddings: int = 4096
    # Interleaved M-RoPE (Qwen3-VL, Qwen3.5): frequencies turning with an image token's row and
    # column instead of its time, (time, rows, columns) frequencies per section (see cos_sin).
    mrope_section: tuple[int, ...] = ()

    @classmethod
    def from_params(cls, head_dim: int, params: JSONObject, max_positions: int) -> Rope:
        params = dict(params)
        theta = float(params.pop("rope_theta", 10000.0))
        section = tuple(params.pop("mrope_section", None) or ())
        params.pop("mrope_interleaved", None)  # (Qwen3-VL's and Qwen3.5's are; the only ones run)
        if section and len(section) != 3:
            raise ValueError(f"rope_parameters.mrope_section must be 3 counts (time, height, width), "
                             f"got {list(section)}")
        kind = params.pop("rope_type", params.pop("type", "default"))
        if kind not in SCALINGS:
            raise ValueError(f"unsupported rope scaling {kind!r}; supported: {', '.join(SCALINGS)}")
        scaling = () if kind == "default" else tuple(sorted({**params, "rope_type": kind}.items()))
        return cls(head_dim, theta, scaling, None, max_positions, section)

    def inv_freq_and_scale(self) -> tuple[torch.Tensor, float]:
        """(inverse frequencies [head_dim / 2], the factor cos and sin are multiplied by)."""
        d = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        if self.factors is not None:
            inv_freq = inv_freq / torch.tensor(self.factors, dtype=torch.float32)
        s = dict(self.scaling)
        kind = s.get("rope_type", "default")
        if kind == "linear":
            return inv_freq / s["factor"], 1.0
        if kind == "llama3":
            return _llama3(inv_freq, s), 1.0
        if kind == "yarn":
            return _yarn(self, s)
        return inv_freq, 1.0

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim / 2] for the given positions: [N], or M-RoPE's [3, N] (time, row,
        column; a text token's three are equal, which is plain rotary)."""
        inv_freq, scale = self.inv_freq_and_scale_cached()
        inv_freq = inv_freq.to(positions.device)
        if positions.dim() == 2:  # each frequency turns with one of the three positions
            freqs = positions.to(torch.float32)[:, :, None] * inv_freq
            axes = self.mrope_axes.to(positions.device)[None, None, :].expand(1, positions.shape[1], -1)
            freqs = freqs.gather(0, axes)[0]
        else:
            freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return cos.to(dtype), sin.to(dtype)

    @functools.cached_property
    def mrope_axes(self) -> torch.Tensor:
        """[head_dim / 2]: which position each frequency turns with (0 time, 1 row, 2 column),
        interleaved as transformers' Qwen3-VL: 1, 4, 7, ... the row's, 2, 5, 8, ... the column's
        (each below 3 times its section's count, whatever the head's size), the rest the time's.
        Made once per rope (a frozen dataclass's cached property), not per step."""
        if len(self.mrope_section) != 3:
            raise ValueError("3D positions are for M-RoPE (rope_parameters.mrope_section)")
        _, rows, cols = self.mrope_section
        f = torch.arange(self.head_dim // 2)
        return torch.where((f % 3 == 1) & (f < 3 * rows), 1, torch.where((f % 3 == 2) & (f < 3 * cols), 2, 0))

    def inv_freq_and_scale_cached(self) -> tuple[torch.Tensor, float]:
        cached = _CACHE.get(self)
        if cached is None:
            cached = _CACHE[self] = self.inv_freq_and_scale()
        return cached


_CACHE: dict[Rope, tuple[torch.Tensor, float]] = {}


def _llama3(inv_freq: torch.Tensor, s: JSONObject) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: Rope, s: JSONObject) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen2.5 / Qwen3 long context): interpolated low frequencies, extrapolated high ones,
    and cos / sin scaled by the attention factor (transformers' _compute_yarn_parameters)."""
    d, base = rope.head_dim, rope.theta
    old_len = s.get("original_max_position_embeddings") or rope.max_position_embeddings
    factor = s.get("factor") or rope.max_position_embeddings / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return d * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, d, 2).float() / d)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)
