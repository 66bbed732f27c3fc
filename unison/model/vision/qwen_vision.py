"""Qwen3.5's and Qwen3-VL's vision tower: an image of any size, cut into patches by its frontend
(frontend/images.py, as Qwen2VLImageProcessor cuts it), to one text-model embedding per 2x2 block
of patches, and (Qwen3-VL) the DeepStack features added to the first text layers.

Plain torch for inference, the math of transformers' Qwen3_5VisionModel and Qwen3VLVisionModel:
- each patch (3 channels x P x P) is one linear: the Conv3d whose kernel is its stride, over
  the 2 frames a still image repeats, is its weights summed over the frames;
- the learned position table (a square grid) is resampled bilinearly to the image's grid;
- 2D rotary: half of each head rotates by the patch's row, half by its column;
- pre-norm blocks with bidirectional attention over the image's patches;
- the merger: LayerNorm, then each 2x2 block of patches (adjacent in the frontend's order)
  concatenated and run through an MLP to the text model's width;
- DeepStack (Qwen3-VL): after chosen blocks, a merger of its own (normed after the 2x2
  concatenation) gives features that the text model adds to the image's rows after its first
  layers (decoder.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from unison.json_types import JSONObject
from unison.model.vision.attention import image_attention
from unison.model.weights.sources import WeightSource, checked_tensor

TOWER_PREFIXES = ("model.visual.", "visual.")  # transformers 5's names; Qwen2.5-VL-era checkpoints'
LAYER_NORM_EPS = 1e-6  # the tower's LayerNorms (fixed in transformers, not in the config)


@dataclass(frozen=True)
class QwenVisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_layers: tuple[int, ...]  # blocks whose output feeds a DeepStack merger (Qwen3-VL)
    rope_theta: float
    image_token_id: int  # <|image_pad|>: each picture's run of placeholders

    @classmethod
    def from_hf(cls, hf: JSONObject, text_hidden_size: int, deepstack: bool = False) -> QwenVisionConfig:
        """From a Qwen3_5(Moe)ForConditionalGeneration or (`deepstack`) Qwen3VLForConditionalGeneration
        config.json; absent keys take transformers' defaults (Qwen3-VL's DeepStack after blocks 8,
        16 and 24; Qwen3.5's tower has none, whatever its config says)."""
        v = hf.get("vision_config") or {}
        for key, want in (("hidden_act", "gelu_pytorch_tanh"), ("in_channels", 3)):
            if v.get(key, want) != want:
                raise ValueError(f"vision_config.{key} must be {want!r}, got {v[key]!r}")
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") not in ("axial", "default"):
            raise ValueError("vision_config.rope_parameters.rope_type must be 'axial', got "
                             f"{rope['rope_type']!r}")
        cfg = cls(
            depth=_int(v, "depth", 27), hidden_size=_int(v, "hidden_size", 1152),
            intermediate_size=_int(v, "intermediate_size", 4304), num_heads=_int(v, "num_heads", 16),
            patch_size=_int(v, "patch_size", 16), temporal_patch_size=_int(v, "temporal_patch_size", 2),
            spatial_merge_size=_int(v, "spatial_merge_size", 2),
            out_hidden_size=_int(v, "out_hidden_size", 3584),
            num_position_embeddings=_int(v, "num_position_embeddings", 2304),
            deepstack_layers=tuple(v.get("deepstack_visual_indexes", (8, 16, 24))) if deepstack else (),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            image_token_id=_int(hf, "image_token_id", 151_655, least=0))
        if cfg.out_hidden_size != text_hidden_size:
            raise ValueError(f"vision_config.out_hidden_size ({cfg.out_hidden_size}) must be the text "
                             f"model's hidden_size ({text_hidden_size})")
        if cfg.hidden_size % cfg.num_heads or (cfg.hidden_size // cfg.num_heads) % 4:
            raise ValueError(f"vision_config.num_heads ({cfg.num_heads}) must divide "
                             f"vision_config.hidden_size ({cfg.hidden_size}) into heads of a multiple of 4 "
                             "(2D rotary)")
        side = round(cfg.num_position_embeddings ** 0.5)
        if side * side != cfg.num_position_embeddings:
            raise ValueError(f"vision_config.num_position_embeddings ({cfg.num_position_embeddings}) must be "
                             "a square (a grid of positions)")
        bad = [i for i in cfg.deepstack_layers if not (isinstance(i, int) and 0 <= i < cfg.depth)]
        if bad:
            raise ValueError(f"vision_config.deepstack_visual_indexes must be blocks in [0, {cfg.depth}), "
                             f"got {bad}")
        return cfg

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:  # the frontend's floats per patch: one frame (frontend/images.py)
        return 3 * self.patch_size * self.patch_size


def _int(d: JSONObject, key: str, default: int, least: int = 1) -> int:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        where = "" if key.endswith("token_id") else "vision_config."
        raise ValueError(f"{where}{key} must be an integer >= {least}, got {value!r}")
    return value


@dataclass(slots=True)
class _Block:  # each pair: (weight, bias)
    norm1: tuple[Tensor, Tensor]
    qkv: tuple[Tensor, Tensor]
    proj: tuple[Tensor, Tensor]
    norm2: tuple[Tensor, Tensor]
    fc1: tuple[Tensor, Tensor]
    fc2: tuple[Tensor, Tensor]


@dataclass(slots=True)
class _Merger:
    norm: tuple[Tensor, Tensor]
    fc1: tuple[Tensor, Tensor]
    fc2: tuple[Tensor, Tensor]
    after_shuffle: bool  # normed after the 2x2 concatenation (DeepStack's) or before (the last's)


class QwenVision:
    """patches [grid_h * grid_w, patch_dim] of one image (the frontend's order) and its grid ->
    [1 + len(deepstack_layers), tokens, out_hidden_size] float32: the image's embeddings, then each
    DeepStack layer's features. Linears in `dtype`; attention and rotary in float32."""

    def __init__(self, cfg: QwenVisionConfig, dtype: torch.dtype, patch: tuple[Tensor, Tensor],
                 position: Tensor, blocks: list[_Block], mergers: list[_Merger]) -> None:
        self.cfg, self.dtype, self.patch, self.position = cfg, dtype, patch, position
        self.blocks, self.mergers = blocks, mergers  # mergers: the last's, then DeepStack's in order
        dim = cfg.head_dim // 2
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))

    @classmethod
    def load(cls, weights: WeightSource, cfg: QwenVisionConfig,
             dtype: torch.dtype = torch.float32) -> QwenVision:
        prefix = next((p for p in TOWER_PREFIXES if p + "patch_embed.proj.weight" in weights), None)
        if prefix is None:
            raise ValueError(f"checkpoint is missing vision weight {TOWER_PREFIXES[0]}patch_embed.proj."
                             f"weight (looked under {', '.join(TOWER_PREFIXES)})")
        d, ff, merged = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size * cfg.spatial_merge_size ** 2

        def get(name: str, *shape: int, as_dtype: torch.dtype = dtype) -> Tensor:
            return checked_tensor(weights, prefix + name, shape, as_dtype)

        def pair(name: str, *shape: int) -> tuple[Tensor, Tensor]:
            return get(f"{name}.weight", *shape), get(f"{name}.bias", shape[0])

        def merger(name: str, after_shuffle: bool) -> _Merger:
            return _Merger(pair(f"{name}.norm", merged if after_shuffle else d),
                           pair(f"{name}.linear_fc1", merged, merged),
                           pair(f"{name}.linear_fc2", cfg.out_hidden_size, merged), after_shuffle)

        p, t = cfg.patch_size, cfg.temporal_patch_size
        # The Conv3d over a whole patch is a linear over its floats. A still image's frames are
        # copies, so the frontend sends one and the frames' weights are summed (in float32).
        w = get("patch_embed.proj.weight", d, 3, t, p, p, as_dtype=torch.float32).sum(2).reshape(d, -1)
        w, b = w.to(dtype).contiguous(), get("patch_embed.proj.bias", d)
        blocks = [_Block(pair(f"blocks.{i}.norm1", d), pair(f"blocks.{i}.attn.qkv", 3 * d, d),
                         pair(f"blocks.{i}.attn.proj", d, d), pair(f"blocks.{i}.norm2", d),
                         pair(f"blocks.{i}.mlp.linear_fc1", ff, d), pair(f"blocks.{i}.mlp.linear_fc2", d, ff))
                  for i in range(cfg.depth)]
        mergers = [merger("merger", False)] + [merger(f"deepstack_merger_list.{k}", True)
                                               for k in range(len(cfg.deepstack_layers))]
        position = get("pos_embed.weight", cfg.num_position_embeddings, d, as_dtype=torch.float32)
        return cls(cfg, dtype, (w, b), position, blocks, mergers)

    @property
    def nbytes(self) -> int:
        tensors = [*self.patch, self.position] + [x for blk in self.blocks for pair in (
            blk.norm1, blk.qkv, blk.proj, blk.norm2, blk.fc1, blk.fc2) for x in pair] + [
            x for m in self.mergers for pair in (m.norm, m.fc1, m.fc2) for x in pair]
        return sum(x.numel() * x.element_size() for x in tensors)

    @torch.no_grad()
    def __call__(self, patches: Tensor, grid: tuple[int, int]) -> Tensor:
        cfg = self.cfg
        rows, cols = grid
        m = cfg.spatial_merge_size
        if rows % m or cols % m or tuple(patches.shape) != (rows * cols, cfg.patch_dim):
            raise ValueError(f"an image's patches must be [{rows} * {cols}, {cfg.patch_dim}] on a grid of "
                             f"multiples of {m}, got {list(patches.shape)} on {rows} x {cols}")
        row, col = _block_order(rows, cols, m)
        x = F.linear(patches.to(self.dtype), *self.patch)
        x = x + self._positions(row, col, rows, cols).to(x.dtype)
        cos, sin = self._rotary(row, col)
        features = []
        for i, block in enumerate(self.blocks):
            x = self._block(x, block, cos, sin)
            if i in cfg.deepstack_layers:
                features.append(self._merge(x, self.mergers[1 + cfg.deepstack_layers.index(i)]))
        return torch.stack([self._merge(x, self.mergers[0]), *features]).float()

    def _positions(self, row: Tensor, col: Tensor, rows: int, cols: int) -> Tensor:
        """The learned positions resampled to the image's grid: bilinear, corners aligned (each
        patch's four nearest table entries, weighted), as transformers' F.interpolate-equivalent
        gather does."""
        side = round(self.cfg.num_position_embeddings ** 0.5)
        h_taps, h_weights = _taps(row, rows, side)
        w_taps, w_weights = _taps(col, cols, side)
        index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        weight = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
        return (self.position[index] * weight[:, :, None]).sum(1)

    def _rotary(self, row: Tensor, col: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [patches, head_dim]: the first quarter of frequencies turn with the row, the
        next with the column, and the second half of the head repeats the first."""
        angles = torch.cat([row[:, None].float() * self.inv_freq, col[:, None].float() * self.inv_freq], -1)
        angles = torch.cat([angles, angles], -1)
        return angles.cos(), angles.sin()

    def _block(self, x: Tensor, block: _Block, cos: Tensor, sin: Tensor) -> Tensor:
        n, heads = x.shape[0], self.cfg.num_heads
        qkv = F.linear(self._norm(x, block.norm1), *block.qkv).float().view(n, 3, heads, -1)
        q, k, v = (_rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2])
        ctx = image_attention(q, k, v, self.cfg.head_dim ** -0.5, bf16=self.dtype == torch.bfloat16)
        x = x + F.linear(ctx.to(self.dtype), *block.proj)
        h = F.gelu(F.linear(self._norm(x, block.norm2), *block.fc1), approximate="tanh")
        return x + F.linear(h, *block.fc2)

    def _merge(self, x: Tensor, merger: _Merger) -> Tensor:
        """Each 2x2 block of patches (consecutive in the frontend's order) to one embedding."""
        merged = self.cfg.hidden_size * self.cfg.spatial_merge_size ** 2
        if merger.after_shuffle:
            x = F.layer_norm(x.reshape(-1, merged), (merged,), *merger.norm, LAYER_NORM_EPS)
        else:
            x = self._norm(x, merger.norm).reshape(-1, merged)
        return F.linear(F.gelu(F.linear(x, *merger.fc1)), *merger.fc2)

    def _norm(self, x: Tensor, weight_bias: tuple[Tensor, Tensor]) -> Tensor:
        return F.layer_norm(x, (self.cfg.hidden_size,), *weight_bias, LAYER_NORM_EPS)


def _block_order(rows: int, cols: int, m: int) -> tuple[Tensor, Tensor]:
    """Each patch's (row, column) in the frontend's order: m x m blocks row by row, and the
    patches of a block row by row within it."""
    i = torch.arange(rows * cols)
    in_col, in_row = i % m, (i // m) % m
    block_col, block_row = (i // (m * m)) % (cols // m), i // (m * m * (cols // m))
    return block_row * m + in_row, block_col * m + in_col


def _taps(index: Tensor, size: int, side: int) -> tuple[Tensor, Tensor]:
    """Bilinear taps (2 per axis) into a `side`-long table for `index` on an axis of `size`,
    corners aligned, and their weights."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [patches, heads, head_dim] turned by rotate-half rotary (cos, sin [patches, head_dim])."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None] + turned * sin[:, None]
