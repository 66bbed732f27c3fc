"""A vision model's image side in the core: its encoder, how its frontends prepare an image
(wire.messages.ImageSpec, from the checkpoint's processor settings), the encoder's outputs for a
step's rows, cached by image, and (Qwen) the rotary positions of a prompt with images.

An image request's prompt holds a run of placeholder tokens per image (its frontend wrote them,
frontend/images.py). The core runs the encoder once per image and puts its embeddings at those
positions in place of the placeholders' own; the cache keeps them by the image's hash, so a
follow-up turn with the same picture (or a prefill chunk after the image's first) does not
encode it again.

Two kinds of tower:
- Gemma 3 (siglip.py): a fixed-size square image, 256 tokens, which see each other both ways
  (its rows see keys ahead of them, to their image's end);
- Qwen3.5 and Qwen3-VL (qwen_vision.py): an image at its own aspect on a grid of patches, a
  token per 2x2 patches, causal like text; M-RoPE gives an image token the position (start,
  start + row, start + column) and the text after the image continues from start + max(rows,
  columns), so a token's rotary position is not its index (`rope_positions`); Qwen3-VL's
  DeepStack features are added to the image's rows after the first text layers.
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
from unison.model.families import FAMILIES, ModelConfig
from unison.model.kernels.cpu_kernels import CpuKernels, ImageRows
from unison.model.vision.mmproj import MmprojWeights
from unison.model.vision.qwen_vision import QwenVision, QwenVisionConfig
from unison.model.vision.siglip import Gemma3Vision, VisionConfig
from unison.model.weights.gguf_header import MMPROJ_PROJECTORS
from unison.model.weights.sources import WeightSource
from unison.wire.messages import ImageInput, ImageSpec, PanAndScan, PatchSpec

# The architectures whose images Unison reads, and the tower each loads.
GEMMA3_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
DEEPSTACK_ARCHITECTURES = ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")
QWEN_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                      *DEEPSTACK_ARCHITECTURES)
VISION_ARCHITECTURES = GEMMA3_ARCHITECTURES + QWEN_ARCHITECTURES
GGUF_NAMES = {f.name: f.gguf_architecture for f in FAMILIES if f.gguf_architecture}  # family -> GGUF's
# Encoder outputs kept: a Gemma 3 4B image is 256 x 2,560 floats (2.6 MB); an 896x896 picture for
# Qwen3.5-35B-A3B 784 x 2,048 (6.4 MB); Qwen3-VL's DeepStack triples to quadruples that.
ENCODER_CACHE_BYTES = 256 << 20
# Qwen2VLImageProcessor's defaults (OPENAI_CLIP_MEAN / _STD, its size), where the checkpoint's
# preprocessor_config.json says nothing
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 56 * 56, 28 * 28 * 1280


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

    def __init__(self, tower: Gemma3Vision | QwenVision, spec: ImageSpec):
        self.tower, self.spec = tower, spec
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._cached_bytes = 0
        self.encoded = 0  # images run through the tower (the tests count cache hits by it)

    @classmethod
    def load(cls, model_dir: Path, model: TextModel, linear_dtype: torch.dtype, quantization: str,
             mmproj: str | None = None) -> Vision | None:
        """The checkpoint's vision tower (None: a text-only model), read from the text `model`'s
        source, or from `mmproj` (llama.cpp's file for a GGUF model). Gemma 3's image rows see
        their whole image through the C attention kernel (the model's ops).
        Its linears run as the text model's float linears do (`linear_dtype`), or, beside quantized
        text linears, in bfloat16 where the CPU has bf16 units (1.4x float32's speed at Gemma 3's
        tower here); float32 is the parity reference."""
        hf = _read(model_dir / "config.json")
        architectures = set(hf.get("architectures") or [])
        arch = GGUF_NAMES.get(model.cfg.family.name, "")  # (a checkpoint's family too: Gemma 3's)
        if mmproj is not None and arch not in MMPROJ_PROJECTORS:
            raise ValueError(f"mmproj: a {model.cfg.family.name} model takes no vision tower (the GGUF "
                             f"architectures {', '.join(MMPROJ_PROJECTORS)} do)")
        if mmproj is None and not architectures & set(VISION_ARCHITECTURES):
            return None
        gemma = MMPROJ_PROJECTORS.get(arch) == "gemma3" if mmproj \
            else bool(architectures & set(GEMMA3_ARCHITECTURES))
        if gemma and not isinstance(model.ops, CpuKernels):  # (Qwen's image rows are causal: any ops do)
            raise ValueError("Gemma 3's images run on the C attention kernel (CPU, float32), whose rows see "
                             "their whole image: this model's device and dtype do not run it")
        bf16 = quantization != "none" and torch.cpu._is_avx512_bf16_supported()
        dtype = torch.bfloat16 if bf16 else linear_dtype
        if mmproj is not None:
            return cls._from_mmproj(MmprojWeights(mmproj), arch, model_dir, model.cfg.hidden_size, dtype)
        if architectures & set(QWEN_ARCHITECTURES):
            deepstack = bool(architectures & set(DEEPSTACK_ARCHITECTURES))
            qwen = QwenVisionConfig.from_hf(hf, model.cfg.hidden_size, deepstack)
            return cls(QwenVision.load(model.source, qwen, dtype), qwen_image_spec(model_dir, qwen))
        cfg = VisionConfig.from_hf(hf)
        return cls(Gemma3Vision.load(model.source, cfg, dtype), image_spec(model_dir, cfg))

    @classmethod
    def _from_mmproj(cls, file: MmprojWeights, arch: str, model_dir: Path, text_hidden: int,
                     dtype: torch.dtype) -> Vision:
        """The tower in llama.cpp's mmproj `file`, beside a GGUF text model of architecture `arch`
        (its image tokens named in the tokenizer of `model_dir`)."""
        if file.kind != MMPROJ_PROJECTORS[arch]:
            raise ValueError(f"mmproj {file.path}: clip.projector_type {file.kind!r} is not a {arch} model's "
                             f"({MMPROJ_PROJECTORS[arch]!r})")
        if file.kind == "qwen3vl_merger":
            names = {name: i for i, name in _token_names(model_dir).items()}
            qwen = file.qwen_config(text_hidden, names)
            return cls(QwenVision.load(file, qwen, dtype), qwen_image_spec(model_dir, qwen, file.processor()))
        cfg = file.vision_config(text_hidden)
        return cls(Gemma3Vision.load(file, cfg, dtype), image_spec(model_dir, cfg, file.processor()))

    @property
    def patches(self) -> PatchSpec | None:
        """A grid tower's patching (Qwen: M-RoPE, causal image rows); None for Gemma 3's."""
        return self.spec.patches

    def embeddings(self, image: ImageInput) -> torch.Tensor:
        """The image's embeddings [1 + DeepStack layers, tokens, hidden], from the cache or the tower."""
        hit = self._cache.get(image.hash)
        if hit is not None and hit.shape[1] == image.tokens:  # (a hash that lies about its image misses)
            self._cache.move_to_end(image.hash)
            return hit
        pixels = torch.from_numpy(np.frombuffer(image.pixels, dtype="<f4").reshape(image.shape).copy())
        if isinstance(self.tower, QwenVision):
            assert image.grid is not None  # (check_images refused a grid image without one)
            out = self.tower(pixels, (image.grid[1], image.grid[2]))
        else:
            out = self.tower(pixels[None])
        self.encoded += 1
        if hit is not None:
            self._cached_bytes -= hit.nbytes
        self._cache[image.hash] = out
        self._cached_bytes += out.nbytes
        while self._cached_bytes > ENCODER_CACHE_BYTES and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= old.nbytes
        return out

    def step_rows(self, batch: Sequence[ImageItem]) -> ImageRows | None:
        """A step's rows at image positions, their embeddings (and DeepStack features), and what
        each row sees past its own position (Gemma 3's image tokens see their whole image);
        None where no row is an image's."""
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
                    values.append(self.embeddings(image)[:, lo - image.offset: hi - image.offset])
                    if self.patches is None:
                        ahead[rows[-1]] = image.offset + image.tokens - 1 - np.arange(lo, hi)
            base += n
        if not rows:
            return None
        stacked = torch.cat(values, dim=1)
        return ImageRows(torch.from_numpy(np.concatenate(rows)), stacked[0], torch.from_numpy(ahead),
                         tuple(stacked[1:]))

    def rope_positions(self, item: ImageItem) -> np.ndarray | None:
        """M-RoPE's positions [3, tokens] (time, row, column) of the item's rows, or None where
        they are its indices (no grid tower, or no image). As transformers' get_rope_index: an
        image at `start` (its first placeholder's index, moved by the images before it) gives its
        token (r, c) the positions (start, start + r, start + c); the text after it continues
        from start + max(rows, columns)."""
        if self.patches is None or not item.images:
            return None
        index = np.arange(item.start_pos, item.start_pos + len(item.token_ids))
        pos = np.repeat(index[None], 3, axis=0)
        m, shift = self.patches.merge_size, 0  # shift: what the images so far moved the text by
        for image in item.images:  # in prompt order
            assert image.grid is not None  # (check_images refused a grid image without one)
            rows, cols = image.grid[1] // m, image.grid[2] // m
            start, end = image.offset + shift, image.offset + image.tokens
            inside = (index >= image.offset) & (index < end)
            k = index[inside] - image.offset
            pos[:, inside] = np.stack([np.full_like(k, start), start + k // cols, start + k % cols])
            moved = max(rows, cols) - image.tokens
            pos[:, index >= end] += moved
            shift += moved
        return pos


def image_spec(model_dir: Path, cfg: VisionConfig,
               fallback: JSONObject | None = None) -> ImageSpec:
    """How the checkpoint's processor prepares an image (preprocessor_config.json, else its
    processor class's defaults; an mmproj file's settings, `fallback`) and writes it
    into a prompt (Gemma3Processor's text)."""
    pre = _read(model_dir / "preprocessor_config.json") or fallback or {}
    size = pre.get("size") or {}
    if pre.get("do_resize") is False or size.get("height", cfg.image_size) != cfg.image_size \
            or size.get("width", cfg.image_size) != cfg.image_size:
        raise ValueError(f"preprocessor_config.json: images must be resized to the tower's "
                         f"{cfg.image_size}x{cfg.image_size}, got size {size}, "
                         f"do_resize {pre.get('do_resize')}")
    names = _token_names(model_dir)
    boi, image, eoi = (names.get(i) for i in (cfg.boi_token_id, cfg.image_token_id, cfg.eoi_token_id))
    if boi is None or image is None or eoi is None:
        raise ValueError(f"the tokenizer lacks the image tokens {cfg.boi_token_id}, {cfg.image_token_id}, "
                         f"{cfg.eoi_token_id} (boi_token_index, image_token_index, eoi_token_index)")
    rescale, mean, std = _scaling(pre, (0.5,) * 3, (0.5,) * 3)
    return ImageSpec(image_size=cfg.image_size, resample=int(pre.get("resample", 2)), rescale=rescale,
                     mean=mean, std=std, marker=boi,
                     expansion=f"\n\n{boi}{image * cfg.mm_tokens_per_image}{eoi}\n\n",
                     token_id=cfg.image_token_id, tokens=cfg.mm_tokens_per_image,
                     pan_and_scan=_pan_and_scan(pre))


def _pan_and_scan(pre: JSONObject) -> PanAndScan | None:
    """Gemma3ImageProcessor's pan-and-scan settings where its config turns it on (its
    Gemma3Processor's defaults where a setting is null)."""
    if not pre.get("do_pan_and_scan"):
        return None
    size, crops = pre.get("pan_and_scan_min_crop_size") or 256, pre.get("pan_and_scan_max_num_crops") or 4
    ratio = pre.get("pan_and_scan_min_ratio_to_activate") or 1.2
    if not (isinstance(size, int) and size > 0 and isinstance(crops, int) and crops >= 2
            and isinstance(ratio, (int, float)) and ratio >= 1):
        raise ValueError(f"preprocessor_config.json: pan_and_scan_min_crop_size ({size!r}) must be > 0, "
                         f"pan_and_scan_max_num_crops ({crops!r}) >= 2, pan_and_scan_min_ratio_to_activate "
                         f"({ratio!r}) >= 1")
    return PanAndScan(size, crops, float(ratio))


def qwen_image_spec(model_dir: Path, cfg: QwenVisionConfig,
                    fallback: JSONObject | None = None) -> ImageSpec:
    """How Qwen2VLImageProcessor (Qwen3.5's and Qwen3-VL's) prepares an image for the checkpoint's
    tower: preprocessor_config.json, else the class's defaults, but the patch size the tower's
    (the class says 14, Qwen3-VL's and Qwen3.5's towers take 16). The chat template writes
    <|vision_start|><|image_pad|><|vision_end|>; the one <|image_pad|> becomes the image's run.
    (`fallback`: an mmproj file's settings, where there is no preprocessor_config.json; its pixel
    bounds where it has them, else the class's: at most 1,003,520 pixels, 980 tokens.)"""
    pre = _read(model_dir / "preprocessor_config.json") or fallback or {}
    if pre.get("do_resize") is False:
        raise ValueError("preprocessor_config.json: do_resize false is not supported (images are resized "
                         "to the tower's grid)")
    for key, want in (("patch_size", cfg.patch_size), ("merge_size", cfg.spatial_merge_size),
                      ("temporal_patch_size", cfg.temporal_patch_size)):
        if pre.get(key, want) != want:
            raise ValueError(f"preprocessor_config.json: {key} {pre[key]!r} is not the vision tower's "
                             f"({want}, vision_config)")
    size = pre.get("size") or {}
    low = pre.get("min_pixels") or size.get("shortest_edge") or QWEN_MIN_PIXELS
    high = pre.get("max_pixels") or size.get("longest_edge") or QWEN_MAX_PIXELS
    if not (isinstance(low, int) and isinstance(high, int) and 0 < low <= high):
        raise ValueError(f"preprocessor_config.json: size must hold 0 < shortest_edge <= longest_edge "
                         f"(pixels), got {low!r} and {high!r}")
    marker = _token_names(model_dir).get(cfg.image_token_id)
    if marker is None:
        raise ValueError(f"the tokenizer lacks the image token {cfg.image_token_id} (image_token_id)")
    patches = PatchSpec(cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size, low, high)
    rescale, mean, std = _scaling(pre, CLIP_MEAN, CLIP_STD)
    return ImageSpec(image_size=0, resample=int(pre.get("resample", 3)), rescale=rescale, mean=mean, std=std,
                     marker=marker, expansion=marker, token_id=cfg.image_token_id, tokens=0, patches=patches)


Channels = tuple[float, float, float]


def _scaling(pre: JSONObject, mean: Channels, std: Channels) -> tuple[float, Channels, Channels]:
    """(rescale, mean, std) from a processor's settings; `mean`, `std`: its class's defaults."""
    if pre.get("do_normalize", True) is False:
        mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    else:
        mean, std = pre.get("image_mean", mean), pre.get("image_std", std)
    if len(mean) != 3 or len(std) != 3:
        raise ValueError(f"preprocessor_config.json: image_mean and image_std must hold 3 channels, "
                         f"got {mean!r} and {std!r}")
    rescale = float(pre.get("rescale_factor", 1 / 255)) if pre.get("do_rescale", True) is not False else 1.0
    m, s = [float(x) for x in mean], [float(x) for x in std]
    return rescale, (m[0], m[1], m[2]), (s[0], s[1], s[2])


def _read(path: Path) -> JSONObject:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_names(model_dir: Path) -> dict[int, str]:
    """The tokenizer's added tokens by id (tokenizer.json)."""
    added = _read(model_dir / "tokenizer.json").get("added_tokens") or []
    return {t["id"]: t["content"] for t in added if isinstance(t, dict)}
