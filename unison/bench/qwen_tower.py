"""`unison bench vision` with a Qwen3.5 text model: Qwen3.5's vision tower (Qwen/Qwen3.5-35B-A3B's
vision_config: 27 blocks of 1,152, patches of 16, a 2x2 merger to the text model's width) for one
896 x 896 picture (56 x 56 patches, 784 tokens), random weights, beside llama.cpp's
(`llama-mtmd-cli --mmproj`) and transformers' on the same weights.

The mmproj file is written here as llama.cpp's converter writes a Qwen3.5 / Qwen3-VL one
(`write_mmproj`: projector qwen3vl_merger, the Conv3d patch embedding as one Conv2d per frame,
the merger as mm.0 / mm.2, DeepStack's mergers as v.deepstack.N, F16 linears), since the
converter needs llama.cpp's source tree, which is not installed here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # (torch loads inside the command: `unison serve` imports the bench's parsers)
    import torch

    from unison.model.vision.qwen_vision import QwenVisionConfig

PREFIX = "model.visual."
QWEN35_TOWER = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                "num_position_embeddings": 2304}
GRID = (56, 56)  # an 896 x 896 picture's patches (896 is a multiple of 16 x 2: no resize)


def qwen35_tower(text_hidden: int, layers: int | None = None) -> QwenVisionConfig:
    from unison.model.vision.qwen_vision import QwenVisionConfig

    shape = QWEN35_TOWER | {"out_hidden_size": text_hidden} | ({"depth": layers} if layers else {})
    return QwenVisionConfig.from_hf({"vision_config": shape}, text_hidden)


def random_tower(cfg: QwenVisionConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights for `cfg`, under the published checkpoints' names."""
    import torch

    g = torch.Generator().manual_seed(seed)
    d, ff, p, merged, t = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size, \
        cfg.hidden_size * cfg.spatial_merge_size ** 2, {}

    def add(name: str, *shape: int, scale: float = 0.02) -> None:
        t[PREFIX + name] = torch.randn(*shape, generator=g) * scale

    def linear(name: str, rows: int, cols: int) -> None:
        add(f"{name}.weight", rows, cols)
        add(f"{name}.bias", rows)

    def norm(name: str, width: int) -> None:
        add(f"{name}.weight", width, scale=1.0)
        add(f"{name}.bias", width)

    add("patch_embed.proj.weight", d, 3, cfg.temporal_patch_size, p, p)
    add("patch_embed.proj.bias", d)
    add("pos_embed.weight", cfg.num_position_embeddings, d)
    for i in range(cfg.depth):
        b = f"blocks.{i}."
        for name in ("norm1", "norm2"):
            norm(b + name, d)
        for name, rows, cols in [("attn.qkv", 3 * d, d), ("attn.proj", d, d), ("mlp.linear_fc1", ff, d),
                                 ("mlp.linear_fc2", d, ff)]:
            linear(b + name, rows, cols)
    deepstack = [f"deepstack_merger_list.{j}" for j in range(len(cfg.deepstack_layers))]
    for k, name in enumerate(["merger", *deepstack]):
        norm(f"{name}.norm", merged if k else d)  # (DeepStack's mergers norm after the 2x2 concatenation)
        linear(f"{name}.linear_fc1", merged, merged)
        linear(f"{name}.linear_fc2", cfg.out_hidden_size, merged)
    return t


_LAYER = {"norm1": "ln1", "norm2": "ln2", "attn.qkv": "attn_qkv", "attn.proj": "attn_out",
          "mlp.linear_fc1": "ffn_up", "mlp.linear_fc2": "ffn_down"}
_MERGER = {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}
_DEEPSTACK = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}


def write_mmproj(tensors: dict[str, torch.Tensor], cfg: QwenVisionConfig, out: Path,
                 mean: tuple[float, ...] = (0.5, 0.5, 0.5), std: tuple[float, ...] = (0.5, 0.5, 0.5),
                 float16: bool = True, pixels: tuple[int, int] | None = None) -> Path:
    """The tower (`tensors` under the published names) as llama.cpp's converter writes a
    qwen3vl_merger mmproj file (`float16` False: its --outtype f32; `pixels`: the processor's
    min and max pixels, which the converter of a derived model writes, Qwen's does not)."""
    from gguf import GGUFWriter

    w = GGUFWriter(out, "clip")
    w.add_type("mmproj")
    w.add_string("clip.projector_type", "qwen3vl_merger")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", True)
    side = round(cfg.num_position_embeddings ** 0.5)
    for key, value in [("image_size", side * cfg.patch_size), ("patch_size", cfg.patch_size),
                       ("embedding_length", cfg.hidden_size), ("feed_forward_length", cfg.intermediate_size),
                       ("block_count", cfg.depth), ("projection_dim", cfg.out_hidden_size),
                       ("attention.head_count", cfg.num_heads),
                       ("spatial_merge_size", cfg.spatial_merge_size)]:
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", list(mean))
    w.add_array("clip.vision.image_std", list(std))
    if pixels is not None:
        w.add_vision_min_pixels(pixels[0])
        w.add_vision_max_pixels(pixels[1])
    if cfg.deepstack_layers:
        w.add_array("clip.vision.is_deepstack_layers", [i in cfg.deepstack_layers for i in range(cfg.depth)])
    for name, tensor in tensors.items():
        for gguf_name, data in _gguf_tensors(name.removeprefix(PREFIX), tensor.float().numpy(), cfg):
            # linears in F16; the patch and position embeddings F32, as the converter forces them
            embedding = gguf_name.startswith(("v.patch_embd", "v.position_embd"))
            half = float16 and data.ndim == 2 and not embedding
            w.add_tensor(gguf_name, data.astype(np.float16) if half else data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _gguf_tensors(name: str, data: np.ndarray, cfg: QwenVisionConfig) -> list[tuple[str, np.ndarray]]:
    """A published name's mmproj tensors (the patch weight: one per frame)."""
    stem, kind = name.rsplit(".", 1)
    if stem == "patch_embed.proj":
        if kind == "bias":
            return [("v.patch_embd.bias", data)]
        return [("v.patch_embd.weight", np.ascontiguousarray(data[:, :, 0])),
                ("v.patch_embd.weight.1", np.ascontiguousarray(data[:, :, 1]))]
    if stem == "pos_embed":
        return [("v.position_embd.weight", data)]
    if stem.startswith("merger."):
        return [(f"{_MERGER[stem.removeprefix('merger.')]}.{kind}", data)]
    m = re.fullmatch(r"deepstack_merger_list\.(\d+)\.(\w+)", stem)
    if m is not None:
        return [(f"v.deepstack.{cfg.deepstack_layers[int(m[1])]}.{_DEEPSTACK[m[2]]}.{kind}", data)]
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", stem)
    assert m is not None, name
    return [(f"v.blk.{m[1]}.{_LAYER[m[2]]}.{kind}", data)]


def our_encoder(cfg: QwenVisionConfig, tensors: dict[str, torch.Tensor],
                dtype: torch.dtype) -> Callable[[], object]:
    """One 896 x 896 picture through QwenVision."""
    import torch

    from unison.model.vision.qwen_vision import QwenVision
    from unison.model.weights.sources import DictWeights

    tower = QwenVision.load(DictWeights(tensors), cfg, dtype)
    patches = torch.rand(GRID[0] * GRID[1], cfg.patch_dim) * 2 - 1
    return lambda: tower(patches, GRID)


def transformers_encoder(cfg: QwenVisionConfig, tensors: dict[str, torch.Tensor]) -> Callable[[], object]:
    """One 896 x 896 picture through transformers' Qwen3.5 tower (float32, sdpa)."""
    import torch
    import transformers

    config = transformers.Qwen3_5VisionConfig(
        depth=cfg.depth, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_heads=cfg.num_heads, patch_size=cfg.patch_size, spatial_merge_size=cfg.spatial_merge_size,
        temporal_patch_size=cfg.temporal_patch_size, out_hidden_size=cfg.out_hidden_size,
        num_position_embeddings=cfg.num_position_embeddings)
    model = transformers.Qwen3_5VisionModel(config).eval()
    model.load_state_dict({k.removeprefix(PREFIX): v for k, v in tensors.items()})
    pixels = torch.rand(GRID[0] * GRID[1], 3 * cfg.temporal_patch_size * cfg.patch_size ** 2) * 2 - 1
    grid = torch.tensor([[1, *GRID]])
    return torch.no_grad()(lambda: model(pixels, grid_thw=grid))


VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
# ChatML, with Qwen's markers for a picture part (as Qwen3.5's published template writes them)
CHATML_WITH_IMAGES = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
    "{% else %}{% for part in m.content %}{% if part.type == 'image' %}<|vision_start|><|image_pad|>"
    "<|vision_end|>{% elif part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def grown_qwen35(text_model: Path, out: Path) -> Path:
    """A copy of the Qwen3.5 text GGUF `text_model` (`make-model`'s: the embedded vocabulary) grown
    by Qwen's three vision tokens (control tokens, zero embedding and output rows) with a ChatML
    template that writes them for a picture: a text model that takes pictures, for the served
    figures."""
    from gguf import GGUFWriter

    from unison.bench.model import copy_fields, write_grown_tensors
    from unison.model.weights.gguf_header import read_fields

    fields = read_fields(text_model)
    arch = fields.pop("general.architecture").value
    fields.pop(f"{arch}.vocab_size", None)
    fields.pop("tokenizer.chat_template", None)
    writer = GGUFWriter(out, arch)  # (the writer's own field)
    extra = len(VISION_TOKENS)
    writer.add_vocab_size(len(fields["tokenizer.ggml.tokens"].value) + extra)
    writer.add_chat_template(CHATML_WITH_IMAGES)
    copy_fields(writer, fields, extend={"tokenizer.ggml.tokens": VISION_TOKENS,
                                        "tokenizer.ggml.scores": [0.0] * extra,
                                        "tokenizer.ggml.token_type": [3] * extra})  # 3: control
    return write_grown_tensors(writer, text_model, extra, out)
