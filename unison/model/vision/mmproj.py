"""llama.cpp's mmproj GGUF: a vision tower and its projector in a file of their own, beside a GGUF
text model (llama-server's --mmproj). Read under the Hugging Face names siglip.py takes, with
the conventions of llama.cpp's converter undone: the projector's RMSNorm stored as (1 + w), and
in files from its older Gemma 3 script the MLP's fc1 and fc2 under each other's names (told apart
by shape, as llama.cpp's clip.cpp does). Nothing is transposed: GGUF lists a tensor's dimensions
innermost first, so numpy's shape is torch's.
"""

from __future__ import annotations

import builtins
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from unison.model.vision.siglip import VisionConfig

PROJECTORS = ("gemma3",)  # clip.projector_type values whose tower siglip.py runs
TOWER, PROJECTOR = "vision_tower.vision_model.", "multi_modal_projector."
_LAYER = {"ln1": "layer_norm1", "ln2": "layer_norm2", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_out": "self_attn.out_proj",
          "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
_GLOBAL = {"v.patch_embd": TOWER + "embeddings.patch_embedding",
           "v.position_embd": TOWER + "embeddings.position_embedding", "v.post_ln": TOWER + "post_layernorm",
           "mm.soft_emb_norm": PROJECTOR + "mm_soft_emb_norm"}
_INPUT_PROJECTION = "mm.input_projection.weight"


class MmprojWeights:
    """An mmproj file's tensors under Hugging Face names (a WeightSource), dequantized on read."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        try:
            self.reader = GGUFReader(self.path)
        except (ValueError, OSError) as e:
            raise ValueError(f"mmproj {self.path}: not a GGUF file: {e}") from None
        kind = self.field("clip.projector_type")
        if kind not in PROJECTORS:
            raise ValueError(f"mmproj {self.path}: clip.projector_type {kind!r} is not supported "
                             f"({', '.join(PROJECTORS)})")
        d = self.field("clip.vision.embedding_length")
        self.tensors = {}
        for t in self.reader.tensors:
            name = _hf_name(t.name, d, tuple(reversed([int(x) for x in t.shape])))
            if name is not None:
                self.tensors[name] = t

    def field(self, key: str, default: Any = None) -> Any:  # Any: a header field, as stored
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> set[str]:
        return set(self.tensors)

    def source_type(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(reversed([int(x) for x in self.tensors[name].shape]))

    def float(self, name: str) -> torch.Tensor:
        from gguf.quants import dequantize

        t = self.tensors[name]
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(self.shape(name))
        if name.endswith("mm_soft_emb_norm.weight"):
            w -= 1  # stored as (1 + w): siglip.py adds the 1, as transformers' Gemma RMSNorm does
        return torch.from_numpy(w)

    def quantized(self, name: str, bits: int):  # the tower's linears run in float (siglip.py)
        raise ValueError(f"mmproj {self.path}: {name} is read as float only")

    def vision_config(self, text_hidden: int) -> VisionConfig:
        """The tower's shape from clip.vision.*; its image tokens are Gemma 3's (siglip.py's defaults)."""
        def need(key: str) -> Any:  # Any: a header field, as stored
            value = self.field(f"clip.vision.{key}")
            if value is None:
                raise ValueError(f"mmproj {self.path}: clip.vision.{key} is missing")
            return value

        size, patch, projection = (int(need(k)) for k in ("image_size", "patch_size", "projection_dim"))
        if projection != text_hidden:
            raise ValueError(f"mmproj {self.path}: clip.vision.projection_dim {projection} is not the text "
                             f"model's hidden size {text_hidden}: the file is another model's")
        scale = int(self.field("clip.vision.projector.scale_factor", 4))
        return VisionConfig.from_hf({
            "vision_config": {"hidden_size": need("embedding_length"), "image_size": size,
                              "intermediate_size": need("feed_forward_length"), "patch_size": patch,
                              "num_hidden_layers": need("block_count"),
                              "num_attention_heads": need("attention.head_count"),
                              "layer_norm_eps": self.field("clip.vision.attention.layer_norm_epsilon", 1e-6)},
            "text_config": {"hidden_size": text_hidden},
            "mm_tokens_per_image": (size // patch // scale) ** 2})

    def normalization(self) -> tuple[tuple[builtins.float, ...], tuple[builtins.float, ...]]:
        """The image processor's mean and std (clip.vision.image_mean / image_std)."""
        mean, std = (self.field(f"clip.vision.image_{k}", [0.5] * 3) for k in ("mean", "std"))
        return tuple(builtins.float(x) for x in mean), tuple(builtins.float(x) for x in std)


def _hf_name(name: str, hidden: object, shape: tuple[int, ...]) -> str | None:
    """The Hugging Face name of an mmproj tensor (None: one the tower does not read)."""
    if name == _INPUT_PROJECTION:
        return PROJECTOR + "mm_input_projection_weight"
    base, _, kind = name.rpartition(".")
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{kind}"
    m = re.fullmatch(r"v\.blk\.(\d+)\.(\w+)", base)
    if m is None or m[2] not in _LAYER:
        return None
    role = _LAYER[m[2]]
    # An older converter swapped fc1 and fc2's names: fc1 is the one that takes the hidden size in.
    if role.startswith("mlp.") and kind == "weight":
        role = "mlp.fc1" if shape[-1] == hidden else "mlp.fc2"
    elif role.startswith("mlp.") and kind == "bias":
        role = "mlp.fc2" if shape[0] == hidden else "mlp.fc1"
    return f"{TOWER}encoder.layers.{m[1]}.{role}.{kind}"
