"""llama.cpp's mmproj GGUF: a vision tower and its projector in a file of their own, beside a GGUF
text model (llama-server's --mmproj). Read under the Hugging Face names the towers take
(siglip.py, qwen_vision.py), with the conventions of llama.cpp's converter undone:
- Gemma 3 (projector "gemma3"): the projector's RMSNorm stored as (1 + w), and in files from its
  older script the MLP's fc1 and fc2 under each other's names (told apart by shape, as llama.cpp's
  clip.cpp does);
- Qwen3.5 / Qwen3-VL ("qwen3vl_merger"): the Conv3d patch embedding split into one Conv2d per
  frame (v.patch_embd.weight and .weight.1, stacked back), DeepStack's mergers under the absolute
  index of the block they read (v.deepstack.N), the merger's MLP as mm.0 and mm.2.
Nothing is transposed: GGUF lists a tensor's dimensions innermost first, so numpy's shape is torch's.
"""

from __future__ import annotations

import builtins
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from unison.model.vision.qwen_vision import QwenVisionConfig
from unison.model.vision.siglip import VisionConfig
from unison.model.weights.gguf_header import MMPROJ_PROJECTORS

PROJECTORS = tuple(sorted(set(MMPROJ_PROJECTORS.values())))  # clip.projector_type values run here
TOWER, PROJECTOR = "vision_tower.vision_model.", "multi_modal_projector."
_LAYER = {"ln1": "layer_norm1", "ln2": "layer_norm2", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_out": "self_attn.out_proj",
          "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
_GLOBAL = {"v.patch_embd": TOWER + "embeddings.patch_embedding",
           "v.position_embd": TOWER + "embeddings.position_embedding", "v.post_ln": TOWER + "post_layernorm",
           "mm.soft_emb_norm": PROJECTOR + "mm_soft_emb_norm"}
_INPUT_PROJECTION = "mm.input_projection.weight"
QWEN = "model.visual."
_QWEN_LAYER = {"ln1": "norm1", "ln2": "norm2", "attn_qkv": "attn.qkv", "attn_out": "attn.proj",
               "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}
_QWEN_GLOBAL = {"v.patch_embd": "patch_embed.proj", "v.position_embd": "pos_embed",
                "v.post_ln": "merger.norm", "mm.0": "merger.linear_fc1", "mm.2": "merger.linear_fc2"}
_QWEN_DEEPSTACK = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}
_SECOND_FRAME = "v.patch_embd.weight.1"  # the Conv3d's second frame, stacked back under the first's name


class MmprojWeights:
    """An mmproj file's tensors under Hugging Face names (a WeightSource), dequantized on read."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        try:
            self.reader = GGUFReader(self.path)
        except (ValueError, OSError) as e:
            raise ValueError(f"mmproj {self.path}: not a GGUF file: {e}") from None
        self.kind = kind = self.field("clip.projector_type")
        if kind not in PROJECTORS:
            raise ValueError(f"mmproj {self.path}: clip.projector_type {kind!r} is not supported "
                             f"({', '.join(PROJECTORS)})")
        d = self.field("clip.vision.embedding_length")
        self.deepstack = [i for i, on in enumerate(self.field("clip.vision.is_deepstack_layers") or []) if on]
        self.tensors = {}
        for t in self.reader.tensors:
            shape = _torch_shape(t)
            name = _hf_name(t.name, d, shape) if kind == "gemma3" else _qwen_name(t.name, self.deepstack)
            if name is not None:
                self.tensors[name] = t
        self._second_frame = next((t for t in self.reader.tensors if t.name == _SECOND_FRAME), None)

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
        shape = _torch_shape(self.tensors[name])
        if self._frames(name):  # [d, 3, P, P] per frame: HF's [d, 3, frames, P, P]
            return (shape[0], shape[1], 2, *shape[2:])
        return shape

    def float(self, name: str) -> torch.Tensor:
        if self._frames(name):
            assert self._second_frame is not None  # (_frames says so)
            first, second = self._read(self.tensors[name]), self._read(self._second_frame)
            return torch.from_numpy(np.stack([first, second], axis=2))
        w = self._read(self.tensors[name])
        if name.endswith("mm_soft_emb_norm.weight"):
            w -= 1  # stored as (1 + w): siglip.py adds the 1, as transformers' Gemma RMSNorm does
        return torch.from_numpy(w)

    def _read(self, t: Any) -> np.ndarray:  # Any: a GGUFReader tensor
        from gguf.quants import dequantize

        return np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(_torch_shape(t))

    def _frames(self, name: str) -> bool:
        """Whether `name` is Qwen's Conv3d patch weight, stored as one Conv2d per frame."""
        return name == QWEN + "patch_embed.proj.weight" and self._second_frame is not None

    def quantized(self, name: str, bits: int):  # the tower's linears run in float (siglip.py)
        raise ValueError(f"mmproj {self.path}: {name} is read as float only")

    def _need(self, key: str) -> Any:  # Any: a header field, as stored
        """clip.vision.`key`; a ValueError naming it where the file lacks it."""
        value = self.field(f"clip.vision.{key}")
        if value is None:
            raise ValueError(f"mmproj {self.path}: clip.vision.{key} is missing")
        return value

    def vision_config(self, text_hidden: int) -> VisionConfig:
        """The tower's shape from clip.vision.*; its image tokens are Gemma 3's (siglip.py's defaults)."""
        keys = ("image_size", "patch_size", "projection_dim")
        size, patch, projection = (int(self._need(k)) for k in keys)
        if projection != text_hidden:
            raise ValueError(f"mmproj {self.path}: clip.vision.projection_dim {projection} is not the text "
                             f"model's hidden size {text_hidden}: the file is another model's")
        scale = int(self.field("clip.vision.projector.scale_factor", 4))
        return VisionConfig.from_hf({
            "vision_config": {"hidden_size": self._need("embedding_length"), "image_size": size,
                              "intermediate_size": self._need("feed_forward_length"), "patch_size": patch,
                              "num_hidden_layers": self._need("block_count"),
                              "num_attention_heads": self._need("attention.head_count"),
                              "layer_norm_eps": self.field("clip.vision.attention.layer_norm_epsilon", 1e-6)},
            "text_config": {"hidden_size": text_hidden},
            "mm_tokens_per_image": (size // patch // scale) ** 2})

    def qwen_config(self, text_hidden: int, token_ids: dict[str, int]) -> QwenVisionConfig:
        """A qwen3vl_merger tower's shape from clip.vision.* and its tensors; its image tokens by
        name from the text model's tokenizer (`token_ids`)."""
        if self._second_frame is None:
            raise ValueError(f"mmproj {self.path}: {_SECOND_FRAME} is missing (a still image's two frames)")
        projection = int(self._need("projection_dim"))
        if projection != text_hidden:
            raise ValueError(f"mmproj {self.path}: clip.vision.projection_dim {projection} is not the text "
                             f"model's hidden size {text_hidden}: the file is another model's")
        if "<|image_pad|>" not in token_ids:
            raise ValueError("the text model's tokenizer lacks the image token <|image_pad|>")
        return QwenVisionConfig.from_hf({
            "vision_config": {
                "depth": self._need("block_count"), "hidden_size": self._need("embedding_length"),
                "intermediate_size": self._need("feed_forward_length"),
                "num_heads": self._need("attention.head_count"), "patch_size": self._need("patch_size"),
                "spatial_merge_size": self._need("spatial_merge_size"),
                "out_hidden_size": projection, "deepstack_visual_indexes": self.deepstack,
                "num_position_embeddings": self.shape(QWEN + "pos_embed.weight")[0]},
            "image_token_id": token_ids["<|image_pad|>"]}, text_hidden, deepstack=bool(self.deepstack))

    def processor(self) -> dict[str, Any]:
        """The image processor's settings the file keeps, as a preprocessor_config.json names them:
        its mean and std (clip.vision.image_mean / image_std), and pixel bounds where it has them."""
        mean, std = (self.field(f"clip.vision.image_{k}", [0.5] * 3) for k in ("mean", "std"))
        out: dict[str, Any] = {"image_mean": [builtins.float(x) for x in mean],
                               "image_std": [builtins.float(x) for x in std]}
        for key in ("min_pixels", "max_pixels"):
            if self.field(f"clip.vision.image_{key}") is not None:
                out[key] = int(self.field(f"clip.vision.image_{key}"))
        return out


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


def _qwen_name(name: str, deepstack: list[int]) -> str | None:
    """The Hugging Face name of a qwen3vl_merger tensor (None: one the tower does not read)."""
    base, _, kind = name.rpartition(".")
    if name == _SECOND_FRAME:
        return None  # read with the first frame's
    if base in _QWEN_GLOBAL:
        return f"{QWEN}{_QWEN_GLOBAL[base]}.{kind}"
    m = re.fullmatch(r"v\.blk\.(\d+)\.(\w+)", base)
    if m is not None and m[2] in _QWEN_LAYER:
        return f"{QWEN}blocks.{m[1]}.{_QWEN_LAYER[m[2]]}.{kind}"
    m = re.fullmatch(r"v\.deepstack\.(\d+)\.(\w+)", base)
    if m is not None and m[2] in _QWEN_DEEPSTACK and int(m[1]) in deepstack:
        return f"{QWEN}deepstack_merger_list.{deepstack.index(int(m[1]))}.{_QWEN_DEEPSTACK[m[2]]}.{kind}"
    return None


def _torch_shape(t: Any) -> tuple[int, ...]:  # Any: a GGUFReader tensor
    """A GGUF tensor's shape in torch's order (GGUF lists the innermost dimension first)."""
    return tuple(reversed([int(x) for x in t.shape]))
