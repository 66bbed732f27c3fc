"""A vision model's image side in the core: its encoder, how its frontends prepare an image
(wire.messages.ImageSpec, from the checkpoint's processor settings), and the encoder's outputs
for a step's rows, cached by image.

An image request's prompt holds a run of placeholder tokens per image (its frontend wrote them,
frontend/images.py). The core runs the encoder once per image and puts its embeddings at those
positions in place of the placeholders' own; the cache keeps them by the image's hash, so a
follow-up turn with the same picture (or a prefill chunk after the image's first) does not
encode it again.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from unison.json_types import JSONObject
from unison.model.families import ModelConfig
from unison.model.kernels.cpu_kernels import CpuKernels, ImageRows
from unison.model.vision.mmproj import MmprojWeights
from unison.model.vision.siglip import Gemma3Vision, VisionConfig
from unison.model.weights.sources import WeightSource
from unison.wire.messages import ImageInput, ImageSpec

# The architectures whose images Unison reads, and the tower each loads.
VISION_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
MMPROJ_FAMILIES = ("gemma3",)  # text families an mmproj file's tower attaches to
ENCODER_CACHE_BYTES = 256 << 20  # encoder outputs kept (a Gemma 3 image: 256 x 2560 floats, 2.6 MB)


class ImageItem(Protocol):
    """What a step's item says of its images (runner.BatchItem has these)."""

    token_ids: list[int]
    start_pos: int
    images: Sequence[ImageInput]


class TextModel(Protocol):
    """What the vision tower reads of the text model (decoder.DecoderModel has these)."""

    @property
    def source(self) -> WeightSource: ...
    @property
    def ops(self) -> object: ...
    @property
    def cfg(self) -> ModelConfig: ...


class Vision:
    """A loaded vision tower and what its frontends need to know of it."""

    def __init__(self, tower: Gemma3Vision, cfg: VisionConfig, spec: ImageSpec):
        self.tower, self.cfg, self.spec = tower, cfg, spec
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._cached_bytes = 0
        self.encoded = 0  # images run through the tower (the tests count cache hits by it)

    @classmethod
    def load(cls, model_dir: Path, model: TextModel, linear_dtype: torch.dtype, quantization: str,
             mmproj: str | None = None) -> Vision | None:
        """The checkpoint's vision tower (None: a text-only model), read from the text `model`'s
        source, or from `mmproj` (llama.cpp's file for a GGUF model). Its image rows see their
        whole image through the C attention kernel (the model's ops).
        Its linears run as the text model's float linears do (`linear_dtype`), or, beside quantized
        text linears, in bfloat16 where the CPU has bf16 units (1.4x float32's speed at Gemma 3's
        tower here); float32 is the parity reference."""
        hf = _read(model_dir / "config.json")
        if mmproj is not None and model.cfg.family.name not in MMPROJ_FAMILIES:
            raise ValueError(f"mmproj: a {model.cfg.family.name} model takes no vision tower "
                             f"({', '.join(MMPROJ_FAMILIES)} do)")
        if mmproj is None and not set(hf.get("architectures") or []) & set(VISION_ARCHITECTURES):
            return None
        if not isinstance(model.ops, CpuKernels):
            raise ValueError("images run on the C attention kernel (CPU, float32): this model's device "
                             "and dtype do not run it")
        source: WeightSource = model.source
        normalization = None
        if mmproj is not None:
            source = file = MmprojWeights(mmproj)
            cfg, normalization = file.vision_config(model.cfg.hidden_size), file.normalization()
        else:
            cfg = VisionConfig.from_hf(hf)
        bf16 = quantization != "none" and torch.cpu._is_avx512_bf16_supported()
        tower = Gemma3Vision.load(source, cfg, torch.bfloat16 if bf16 else linear_dtype)
        return cls(tower, cfg, image_spec(model_dir, cfg, normalization))

    def embeddings(self, image: ImageInput) -> torch.Tensor:
        """The image's embeddings [tokens, hidden], from the cache or the tower."""
        hit = self._cache.get(image.hash)
        if hit is not None:
            self._cache.move_to_end(image.hash)
            return hit
        pixels = torch.from_numpy(np.frombuffer(image.pixels, dtype="<f4").reshape(image.shape).copy())
        out = self.tower(pixels[None])[0].contiguous()
        self.encoded += 1
        self._cache[image.hash] = out
        self._cached_bytes += out.nbytes
        while self._cached_bytes > ENCODER_CACHE_BYTES and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= old.nbytes
        return out

    def step_rows(self, batch: Sequence[ImageItem]) -> ImageRows | None:
        """A step's rows at image positions, their embeddings, and what each row sees past its own
        position (Gemma 3's image tokens see their whole image); None where no row is an image's."""
        rows: list[np.ndarray] = []
        values: list[torch.Tensor] = []
        ahead = np.zeros(sum(len(item.token_ids) for item in batch), dtype=np.int64)
        base = 0
        for item in batch:
            start, n = item.start_pos, len(item.token_ids)
            for image in item.images:
                lo, hi = max(image.offset, start), min(image.offset + image.tokens, start + n)
                if lo < hi:
                    rows.append(np.arange(lo, hi) - start + base)
                    values.append(self.embeddings(image)[lo - image.offset: hi - image.offset])
                    ahead[rows[-1]] = image.offset + image.tokens - 1 - np.arange(lo, hi)
            base += n
        if not rows:
            return None
        return ImageRows(torch.from_numpy(np.concatenate(rows)), torch.cat(values), torch.from_numpy(ahead))


def image_spec(model_dir: Path, cfg: VisionConfig,
               normalization: tuple[tuple[float, ...], tuple[float, ...]] | None = None) -> ImageSpec:
    """How the checkpoint's processor prepares an image (preprocessor_config.json, else its
    processor class's defaults; an mmproj file's `normalization`, mean and std) and writes it
    into a prompt (Gemma3Processor's text)."""
    pre = _read(model_dir / "preprocessor_config.json")
    if normalization is not None and not pre:
        pre = {"image_mean": list(normalization[0]), "image_std": list(normalization[1])}
    if pre.get("do_pan_and_scan"):
        raise ValueError("preprocessor_config.json: do_pan_and_scan is not supported (images are "
                         "taken whole)")
    size = pre.get("size") or {}
    if pre.get("do_resize") is False or size.get("height", cfg.image_size) != cfg.image_size \
            or size.get("width", cfg.image_size) != cfg.image_size:
        raise ValueError(f"preprocessor_config.json: images must be resized to the tower's "
                         f"{cfg.image_size}x{cfg.image_size}, got size {size}, "
                         f"do_resize {pre.get('do_resize')}")
    normalize = pre.get("do_normalize", True) is not False
    mean = tuple(pre.get("image_mean", [0.5] * 3)) if normalize else (0.0, 0.0, 0.0)
    std = tuple(pre.get("image_std", [0.5] * 3)) if normalize else (1.0, 1.0, 1.0)
    rescale = float(pre.get("rescale_factor", 1 / 255)) if pre.get("do_rescale", True) is not False else 1.0
    names = _token_names(model_dir)
    boi, image, eoi = (names.get(i) for i in (cfg.boi_token_id, cfg.image_token_id, cfg.eoi_token_id))
    if boi is None or image is None or eoi is None:
        raise ValueError(f"the tokenizer lacks the image tokens {cfg.boi_token_id}, {cfg.image_token_id}, "
                         f"{cfg.eoi_token_id} (boi_token_index, image_token_index, eoi_token_index)")
    return ImageSpec(image_size=cfg.image_size, resample=int(pre.get("resample", 2)), rescale=rescale,
                     mean=mean, std=std, marker=boi,
                     expansion=f"\n\n{boi}{image * cfg.mm_tokens_per_image}{eoi}\n\n",
                     token_id=cfg.image_token_id, tokens=cfg.mm_tokens_per_image)


def _read(path: Path) -> JSONObject:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_names(model_dir: Path) -> dict[int, str]:
    """The tokenizer's added tokens by id (tokenizer.json)."""
    added = _read(model_dir / "tokenizer.json").get("added_tokens") or []
    return {t["id"]: t["content"] for t in added if isinstance(t, dict)}
