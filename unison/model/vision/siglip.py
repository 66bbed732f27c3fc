"""Gemma 3's vision tower (a SigLIP encoder) and its multimodal projector: an image's pixels to
the text model's soft tokens, mm_tokens_per_image rows of text_hidden_size each.

Plain torch for inference, the math of transformers' SiglipVisionModel and
Gemma3MultiModalProjector: conv patches plus learned positions, pre-norm encoder layers with
bidirectional attention, a final LayerNorm, then average pooling to a grid of tokens, Gemma's
RMSNorm and one projection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor

from unison.model.vision.attention import image_attention
from unison.model.weights.sources import WeightSource, checked_tensor

# Where a checkpoint keeps the tower: published checkpoints (and transformers 4's in-memory
# names) keep SiglipVisionModel's `vision_model.`; transformers 5 drops it, in memory and in what
# its save_pretrained writes. The first holder of the patch embedding wins.
TOWER_PREFIXES = ("vision_tower.vision_model.", "vision_tower.",
                  "model.vision_tower.vision_model.", "model.vision_tower.")
PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")

# Each field's key in config.json, for errors that name what to fix there.
_KEYS = {"hidden_size": "vision_config.hidden_size", "intermediate_size": "vision_config.intermediate_size",
         "num_layers": "vision_config.num_hidden_layers", "num_heads": "vision_config.num_attention_heads",
         "image_size": "vision_config.image_size", "patch_size": "vision_config.patch_size",
         "layer_norm_eps": "vision_config.layer_norm_eps", "text_hidden_size": "text_config.hidden_size",
         "mm_tokens_per_image": "mm_tokens_per_image", "image_token_id": "image_token_index",
         "boi_token_id": "boi_token_index", "eoi_token_id": "eoi_token_index"}


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    text_hidden_size: int
    mm_tokens_per_image: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int

    @classmethod
    def from_hf(cls, hf: dict) -> VisionConfig:
        """From a Gemma3ForConditionalGeneration config.json; absent keys take the defaults of
        transformers' Gemma3Config, SiglipVisionConfig and Gemma3TextConfig."""
        v, t = hf.get("vision_config") or {}, hf.get("text_config") or {}
        if v.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"vision_config.hidden_act must be 'gelu_pytorch_tanh', got {v['hidden_act']!r}")
        if v.get("num_channels", 3) != 3:
            raise ValueError(f"vision_config.num_channels must be 3 (RGB), got {v['num_channels']!r}")
        return cls(
            hidden_size=v.get("hidden_size", 768), intermediate_size=v.get("intermediate_size", 3072),
            num_layers=v.get("num_hidden_layers", 12), num_heads=v.get("num_attention_heads", 12),
            image_size=v.get("image_size", 224), patch_size=v.get("patch_size", 16),
            layer_norm_eps=v.get("layer_norm_eps", 1e-6), text_hidden_size=t.get("hidden_size", 2304),
            mm_tokens_per_image=hf.get("mm_tokens_per_image", 256),
            # config.json spells them *_index; transformers' attribute_map reads *_id as well
            image_token_id=hf.get("image_token_index", hf.get("image_token_id", 262_144)),
            boi_token_id=hf.get("boi_token_index", hf.get("boi_token_id", 255_999)),
            eoi_token_id=hf.get("eoi_token_index", hf.get("eoi_token_id", 256_000)))

    def __post_init__(self) -> None:
        for f in fields(self):
            value, kind = getattr(self, f.name), (int, float) if f.name == "layer_norm_eps" else int
            least = 0 if f.name.endswith("_id") else 1e-300  # token ids may be 0; sizes and eps may not
            if isinstance(value, bool) or not isinstance(value, kind) or value < least:
                raise ValueError(f"{_KEYS[f.name]} must be a {'non-negative' if least == 0 else 'positive'} "
                                 f"{f.type}, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"{_KEYS['num_heads']} ({self.num_heads}) must divide "
                             f"vision_config.hidden_size ({self.hidden_size})")
        if self.image_size % self.patch_size:
            raise ValueError(f"{_KEYS['image_size']} ({self.image_size}) must be a multiple of "
                             f"vision_config.patch_size ({self.patch_size})")
        side = math.isqrt(self.mm_tokens_per_image)
        if side * side != self.mm_tokens_per_image or self.patches_per_side % side:
            raise ValueError(f"mm_tokens_per_image ({self.mm_tokens_per_image}) must be the square of a "
                             f"divisor of the patches per side ({self.patches_per_side})")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def pool(self) -> int:  # AvgPool2d's kernel and stride: patches per token, per side
        return self.patches_per_side // math.isqrt(self.mm_tokens_per_image)


@dataclass(slots=True)
class _Layer:  # each pair: (weight, bias)
    norm1: tuple[Tensor, Tensor]
    qkv: tuple[Tensor, Tensor]  # q, k, v stacked: one GEMM instead of three
    out: tuple[Tensor, Tensor]
    norm2: tuple[Tensor, Tensor]
    fc1: tuple[Tensor, Tensor]
    fc2: tuple[Tensor, Tensor]


class Gemma3Vision:
    """pixel_values [n, 3, S, S] (already resized and normalized) -> soft tokens
    [n, mm_tokens_per_image, text_hidden_size], float32 in and out; weights and activations in
    `dtype`, the projector's RMSNorm in float32 as transformers runs it."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, tensors: dict[str, Tensor],
                 layers: list[_Layer]) -> None:
        self.cfg, self.dtype, self.t, self.layers = cfg, dtype, tensors, layers

    @classmethod
    def load(cls, weights: WeightSource, cfg: VisionConfig,
             dtype: torch.dtype = torch.float32) -> Gemma3Vision:
        tower = _prefix(weights, TOWER_PREFIXES, "embeddings.patch_embedding.weight")
        proj = _prefix(weights, PROJECTOR_PREFIXES, "mm_input_projection_weight")
        d, ff, p = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size

        def get(name: str, *shape: int, as_dtype: torch.dtype = dtype) -> Tensor:
            return checked_tensor(weights, name, shape, as_dtype)

        def pair(name: str, *shape: int) -> tuple[Tensor, Tensor]:
            return get(f"{tower}{name}.weight", *shape), get(f"{tower}{name}.bias", shape[0])

        layers = []
        for i in range(cfg.num_layers):
            n = f"encoder.layers.{i}."
            q, k, v = (pair(f"{n}self_attn.{x}_proj", d, d) for x in "qkv")
            layers.append(_Layer(
                norm1=pair(n + "layer_norm1", d), norm2=pair(n + "layer_norm2", d),
                qkv=(torch.cat([q[0], k[0], v[0]]), torch.cat([q[1], k[1], v[1]])),
                out=pair(n + "self_attn.out_proj", d, d),
                fc1=pair(n + "mlp.fc1", ff, d), fc2=pair(n + "mlp.fc2", d, ff)))
        patch_w, patch_b = pair("embeddings.patch_embedding", d, 3, p, p)
        tensors = {
            "patch_w": patch_w, "patch_b": patch_b,
            # nn.Embedding read at arange(num_patches): the table itself, row-major patch order
            "position": get(f"{tower}embeddings.position_embedding.weight", cfg.patches_per_side ** 2, d),
            "post_w": get(f"{tower}post_layernorm.weight", d),
            "post_b": get(f"{tower}post_layernorm.bias", d),
            # Gemma's RMSNorm scales by (1 + w), in float32 whatever the model's dtype
            "mm_scale": 1.0 + get(f"{proj}mm_soft_emb_norm.weight", d, as_dtype=torch.float32),
            "mm_proj": get(f"{proj}mm_input_projection_weight", d, cfg.text_hidden_size),  # [in, out]
        }
        return cls(cfg, dtype, tensors, layers)

    @property
    def nbytes(self) -> int:
        tensors = list(self.t.values()) + [w for layer in self.layers for pair in (
            layer.norm1, layer.qkv, layer.out, layer.norm2, layer.fc1, layer.fc2) for w in pair]
        return sum(w.numel() * w.element_size() for w in tensors)

    @torch.no_grad()
    def __call__(self, pixel_values: Tensor) -> Tensor:
        cfg, t = self.cfg, self.t
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, cfg.image_size, cfg.image_size):
            raise ValueError(f"pixel_values must be [n, 3, {cfg.image_size}, {cfg.image_size}], "
                             f"got {list(pixel_values.shape)}")
        # Conv2d with kernel = stride = patch: one embedding per patch, then [n, patches, hidden]
        x = F.conv2d(pixel_values.to(self.dtype), t["patch_w"], t["patch_b"], stride=cfg.patch_size)
        x = x.flatten(2).transpose(1, 2) + t["position"]
        for layer in self.layers:
            x = self._layer(x, layer)
        return self._project(self._norm(x, (t["post_w"], t["post_b"])))

    def _layer(self, x: Tensor, layer: _Layer) -> Tensor:
        n, length, d = x.shape
        heads = self.cfg.num_heads
        qkv = F.linear(self._norm(x, layer.norm1), *layer.qkv).float()
        q, k, v = qkv.view(n, length, 3, heads, -1).unbind(2)
        # every patch sees every patch of its image: no mask, no causality
        bf16, scale = self.dtype == torch.bfloat16, (d // heads) ** -0.5
        ctx = torch.stack([image_attention(q[i], k[i], v[i], scale, bf16) for i in range(n)])
        x = x + F.linear(ctx.to(self.dtype), *layer.out)
        h = F.gelu(F.linear(self._norm(x, layer.norm2), *layer.fc1), approximate="tanh")
        return x + F.linear(h, *layer.fc2)

    def _norm(self, x: Tensor, weight_bias: tuple[Tensor, Tensor]) -> Tensor:
        return F.layer_norm(x, (self.cfg.hidden_size,), *weight_bias, self.cfg.layer_norm_eps)

    def _project(self, x: Tensor) -> Tensor:
        """[n, patches, hidden] -> [n, tokens, text_hidden]: the patch grid average-pooled to
        tokens_per_side**2 tokens (row-major), RMSNorm'd, projected."""
        n, side, d = x.shape[0], self.cfg.patches_per_side, self.cfg.hidden_size
        grid = x.transpose(1, 2).reshape(n, d, side, side)
        pooled = F.avg_pool2d(grid, self.cfg.pool).flatten(2).transpose(1, 2)
        h = pooled.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.cfg.layer_norm_eps) * self.t["mm_scale"]
        return torch.matmul(h.to(self.dtype), self.t["mm_proj"]).float()


def _prefix(weights: WeightSource, prefixes: tuple[str, ...], probe: str) -> str:
    """The first of `prefixes` under which `weights` holds `probe`."""
    for prefix in prefixes:
        if prefix + probe in weights:
            return prefix
    raise ValueError(f"checkpoint is missing vision weight {prefixes[0] + probe!r} "
                     f"(looked under {', '.join(prefixes)})")
