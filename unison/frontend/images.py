"""Images in: read, checked and prepared in the frontend, as the model's Hugging Face processor
prepares them, then sent to the core once as float32 pixels (wire.messages.ImageInput).

Decoding, resizing and normalizing are per-request Python work: they belong to the frontend
processes, as tokenizing does (SGLang does them in its tokenizer manager too). The core gets
pixels and runs the vision encoder.

The steps are transformers' PIL backend's (`Gemma3ImageProcessorPil`, `Qwen2VLImageProcessorPil`),
op for op, so the pixels are its bits: convert to RGB (transparency composited onto white),
resize with PIL (to a square, or to a Qwen grid of the image's own aspect), times `rescale` in
float64 then float32, then (x - mean) / std in float32, and a grid image cut into patches. Only
pillow and numpy run here: a frontend imports neither torch nor transformers.

An image's identity (`ImageInput.hash`) is a hash of its pixels and the settings that made
them: the prefix cache, KV events and the core's encoder cache all know a picture by it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import numpy as np

from unison.errors import InvalidParam
from unison.frontend.text.tokenizer import IMAGE
from unison.json_types import JSONObject
from unison.wire.messages import ImageInput, ImageSpec, PanAndScan, PatchSpec

if TYPE_CHECKING:
    from PIL import Image

# The formats a browser or a phone sends; anything else is refused before it is decoded.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,", re.ASCII)
URL_SCHEMES = ("http://", "https://")  # what a frontend may fetch (image_url_hosts)


@dataclass(frozen=True)
class ImageLimits:
    """What one image may be: its encoded bytes and its pixels (width x height)."""

    max_bytes: int
    max_pixels: int


@dataclass(frozen=True)
class ImageSource:
    """An image as a request gives it, with the request field it came in (errors name it)."""

    data: object  # bytes, a data: URL or base64 text, a PIL image (read_paths reads a caller's files)
    field: str


def _pil() -> object:
    try:
        from PIL import Image
    except ImportError:
        raise InvalidParam("image_data", "images need pillow: pip install pillow") from None
    # PIL's own bomb check would refuse a huge header with an error that names no limit; ours
    # (max_image_pixels, from the header too, before any decoding) is the one that applies.
    Image.MAX_IMAGE_PIXELS = None
    return Image


def read(source: ImageSource, limits: ImageLimits) -> Image.Image:
    """The image `source` holds, decoded and checked; InvalidParam naming its field otherwise.
    (A file path is never read here: a frontend serves HTTP clients too. The Python API reads
    its caller's files first, `read_paths`.)"""
    Image = _pil()
    data, field = source.data, source.field
    if isinstance(data, Image.Image):  # type: ignore[attr-defined]
        _check_pixels(data.size, limits, field)
        return data
    raw = _bytes(data, field, limits)
    try:
        image = Image.open(io.BytesIO(raw), formats=FORMATS)  # type: ignore[attr-defined]
    except Exception as e:  # noqa: BLE001 - PIL raises many kinds for a bad file
        raise InvalidParam(field, f"{field}: not an image in a supported format ({', '.join(FORMATS)}): "
                                  f"{type(e).__name__}") from None
    # Only the header is read so far: a decompression bomb is refused before it is decoded.
    _check_pixels(image.size, limits, field)
    try:
        image.load()
    except Exception as e:  # noqa: BLE001
        raise InvalidParam(field, f"{field}: the image does not decode: {e}") from None
    return image


def _bytes(data: object, field: str, limits: ImageLimits) -> bytes:
    if isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytes(data)
    elif isinstance(data, str):
        raw = _text_bytes(data, field)
    else:
        raise InvalidParam(field, f"{field}: an image must be bytes, a data: URL or base64 text, got "
                                  f"{type(data).__name__}")
    if len(raw) > limits.max_bytes:
        raise InvalidParam(field, f"{field}: the image is {len(raw)} bytes, over max_image_bytes "
                                  f"({limits.max_bytes})")
    return raw


def _text_bytes(text: str, field: str) -> bytes:
    if text.startswith(URL_SCHEMES):
        raise InvalidParam(field, f"{field}: image URLs are not fetched; send the image inline as a "
                                  "data: URL (data:image/png;base64,...), or allow its host with "
                                  "--image-url-hosts")
    if text.startswith("data:"):
        head = _DATA_URL.match(text)
        if head is None:
            raise InvalidParam(field, f"{field}: a data URL must be data:image/<format>;base64,<data>")
        text = text[head.end():]
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidParam(field, f"{field}: not base64 image data") from None


@dataclass(frozen=True)
class UrlPolicy:
    """Which image URLs a frontend fetches (image_url_hosts; "*": any) and within what."""

    hosts: tuple[str, ...]
    timeout_s: float
    max_bytes: int


async def fetch_urls(image_data: object, policy: UrlPolicy, field: str = "image_data") -> object:
    """image_data (values, lists of them, or a chat's ImageSources) with each http(s) URL whose
    host `policy` allows replaced by the bytes it names; InvalidParam naming the field for a host
    it does not allow, or a fetch that fails. Without hosts, URLs stay (read() refuses them)."""
    if isinstance(image_data, list):
        return [await fetch_urls(x, policy, f"{field}[{i}]") for i, x in enumerate(image_data)]
    if isinstance(image_data, ImageSource):
        fetched = await fetch_urls(image_data.data, policy, image_data.field)
        return image_data if fetched is image_data.data else ImageSource(fetched, image_data.field)
    if not policy.hosts or not isinstance(image_data, str) or not image_data.startswith(URL_SCHEMES):
        return image_data
    host = (urlsplit(image_data).hostname or "").lower()
    if "*" not in policy.hosts and host not in policy.hosts:
        raise InvalidParam(field, f"{field}: image URLs from {host!r} are not fetched (image_url_hosts: "
                                  f"{', '.join(policy.hosts)})")
    try:
        return await asyncio.wait_for(_get(image_data, field, policy), policy.timeout_s)
    except TimeoutError:
        raise InvalidParam(field, f"{field}: fetching the image took over image_fetch_timeout_s "
                                  f"({policy.timeout_s:g} s)") from None


async def _get(url: str, field: str, policy: UrlPolicy) -> bytes:
    import httpx

    too_big = f"{field}: the image is over max_image_bytes ({policy.max_bytes})"
    try:
        async with httpx.AsyncClient(follow_redirects=False) as client, client.stream("GET", url) as reply:
            if reply.status_code != 200:
                raise InvalidParam(field, f"{field}: fetching the image gave HTTP {reply.status_code}")
            if int(reply.headers.get("content-length") or 0) > policy.max_bytes:
                raise InvalidParam(field, too_big)
            body = bytearray()
            async for chunk in reply.aiter_bytes():  # a server that sends more than it declared
                body += chunk
                if len(body) > policy.max_bytes:
                    raise InvalidParam(field, too_big)
            return bytes(body)
    except httpx.HTTPError as e:
        raise InvalidParam(field, f"{field}: the image could not be fetched: {type(e).__name__}") from None


def read_paths(image_data: object) -> object:
    """The Python API's image_data with each string that names a local file replaced by the
    file's bytes (in the caller's process: frontends read no paths), lists kept as given."""
    if isinstance(image_data, list):
        return [read_paths(x) for x in image_data]
    if isinstance(image_data, str) and not image_data.startswith(("data:", *URL_SCHEMES)) \
            and len(image_data) < 4096 and Path(image_data).is_file():
        return Path(image_data).read_bytes()
    return image_data


def _check_pixels(size: tuple[int, int], limits: ImageLimits, field: str) -> None:
    width, height = size
    if width * height > limits.max_pixels:
        raise InvalidParam(field, f"{field}: the image is {width}x{height} pixels, over max_image_pixels "
                                  f"({limits.max_pixels})")
    if width < 1 or height < 1:
        raise InvalidParam(field, f"{field}: the image is empty ({width}x{height})")


@dataclass(frozen=True)
class Prepared:
    """An image as its model's processor gives it: float32 `pixels`, [3, size, size] for a
    fixed-size image, a grid image's patches [rows * columns, 3 * patch * patch] on `grid`
    (frames, rows, columns) otherwise; pan-and-scan's `crops` of it, each [3, size, size]."""

    pixels: np.ndarray
    grid: tuple[int, int, int] | None = None
    crops: tuple[np.ndarray, ...] = ()

    def views(self) -> list[Prepared]:
        """What the encoder sees, in the prompt's order: the image, then each crop."""
        return [Prepared(self.pixels, self.grid), *(Prepared(c) for c in self.crops)]

    def tokens(self, spec: ImageSpec) -> int:
        """The placeholders the image fills."""
        if self.grid is None or spec.patches is None:
            return spec.tokens
        return self.grid[1] * self.grid[2] // spec.patches.merge_size ** 2


def prepare(image: Image.Image, spec: ImageSpec, field: str = "image_data") -> Prepared:
    """The pixels the model's processor gives, bit for bit: resized to the tower's square
    (Gemma3ImageProcessor), or to its grid and cut into patches (Qwen2VLImageProcessor)."""
    rgb = _rgb(image)
    if spec.patches is None:
        size = (spec.image_size, spec.image_size)
        boxes = crop_boxes(rgb.width, rgb.height, spec.pan_and_scan) if spec.pan_and_scan else []
        return Prepared(_normalized(rgb, size, spec), crops=tuple(_normalized(rgb.crop(b), size, spec)
                                                                   for b in boxes))
    p = spec.patches
    height, width = grid_size(rgb.height, rgb.width, p, field)
    return Prepared(patchify(_normalized(rgb, (width, height), spec), p),
                    (1, height // p.patch_size, width // p.patch_size))


def _rgb(image: Image.Image) -> Image.Image:
    """RGB, transparency composited onto white (as transformers' convert_rgb)."""
    Image = _pil()
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))  # type: ignore[attr-defined]
        return Image.alpha_composite(white, rgba).convert("RGB")  # type: ignore[attr-defined]
    return image.convert("RGB")


def _normalized(rgb: Image.Image, size: tuple[int, int], spec: ImageSpec) -> np.ndarray:
    """[3, height, width] float32: resized by PIL to `size` (width, height), times `rescale` in
    float64 then float32, then (x - mean) / std in float32, transformers' PIL backend's steps."""
    resized = np.asarray(rgb.resize(size, resample=spec.resample))
    scaled = (resized.astype(np.float64) * spec.rescale).astype(np.float32)
    x = (scaled - np.asarray(spec.mean, np.float32)) / np.asarray(spec.std, np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1), dtype=np.float32)


def crop_boxes(width: int, height: int, pas: PanAndScan) -> list[tuple[int, int, int, int]]:
    """Pan-and-scan's crops (left, top, right, bottom), as Gemma3ImageProcessor cuts them: none
    for a picture nearer square than min_ratio_to_activate; else along its longer side, about
    one per multiple of its shorter one (2 to max_num_crops, each at least min_crop_size), the last
    cut at the picture's edge."""
    long, short = max(width, height), min(width, height)
    if long / short < pas.min_ratio_to_activate:
        return []
    n = min(int(math.floor(long / pas.min_crop_size)), int(math.floor(long / short + 0.5)))
    n = min(pas.max_num_crops, max(2, n))
    step = int(math.ceil(long / n))
    if min(step, short) < pas.min_crop_size:
        return []
    if width >= height:
        return [(i * step, 0, min((i + 1) * step, width), height) for i in range(n)]
    return [(0, i * step, width, min((i + 1) * step, height)) for i in range(n)]


def grid_size(height: int, width: int, p: PatchSpec, field: str) -> tuple[int, int]:
    """The size (height, width) a grid image is resized to: Qwen2-VL's smart_resize, the aspect
    kept as closely as multiples of patch * merge pixels allow, between min and max pixels."""
    factor = p.patch_size * p.merge_size
    if max(height, width) / min(height, width) > 200:
        raise InvalidParam(field, f"{field}: the image is {width}x{height}; its aspect ratio must be "
                                  "under 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > p.max_pixels:
        beta = math.sqrt(height * width / p.max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < p.min_pixels:
        beta = math.sqrt(p.min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def patchify(x: np.ndarray, p: PatchSpec) -> np.ndarray:
    """[3, H, W] -> patches [H / P * W / P, 3 * P * P]: merge x merge blocks of patches row by row,
    and the patches of a block row by row, each patch's floats channel by channel. Qwen2-VL's
    processor repeats each patch over temporal_patch_size frames as well; a still image's frames
    are the same, so that copy is not made or sent: the tower sums its weights over frames."""
    c, height, width = x.shape
    s, m = p.patch_size, p.merge_size
    blocks = x.reshape(c, height // (s * m), m, s, width // (s * m), m, s).transpose(1, 4, 2, 5, 0, 3, 6)
    return np.ascontiguousarray(blocks.reshape(height // s * (width // s), c * s * s))


def identity(image: Prepared, spec: ImageSpec) -> bytes:
    """An image's hash: its pixels and every setting that made them or places them."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((spec.image_size, spec.resample, spec.rescale, spec.mean, spec.std, spec.token_id,
                   spec.tokens, spec.patches, image.pixels.shape, image.grid)).encode())
    h.update(image.pixels.tobytes())
    return h.digest()


def expand(text: str, crops: list[int], spec: ImageSpec, field: str) -> str:
    """`text` with each image marker made the image's placeholder run, as the model's processor
    writes it (a grid image's: later, by place(), once its size is known; an image with
    pan-and-scan's `crops`: the processor's words around its run and one run per crop); its
    markers must be as many as the images."""
    found = text.count(spec.marker)
    if found != len(crops):
        raise InvalidParam(field, f"{field}: the prompt has {found} image marker(s) {spec.marker!r} for "
                                  f"{len(crops)} image(s)")
    if spec.patches is not None:
        return text
    parts = text.split(spec.marker)
    return parts[0] + "".join(_expansion(spec, n) + part for n, part in zip(crops, parts[1:]))


def _expansion(spec: ImageSpec, crops: int) -> str:
    """One image's text, as Gemma3Processor writes it (with pan-and-scan's crops, its words)."""
    if not crops:
        return spec.expansion
    return (f"Here is the original image {spec.expansion} and here are some crops to help you see better "
            + " ".join([spec.expansion] * crops))


def place(ids: list[int], prepared: list[Prepared], spec: ImageSpec,
          field: str) -> tuple[list[int], list[ImageInput]]:
    """The prompt's ids with each image's placeholders in place, and the images as the core
    takes them, each at its run of placeholders (in order). The runs must be as many as the
    images, each as long as its image's placeholders; a grid image's run may be its one marker
    token, which becomes the whole run here (as its processor expands the text)."""
    prepared = [view for image in prepared for view in image.views()]  # (pan-and-scan: a run per crop)
    starts = [i for i, t in enumerate(ids) if t == spec.token_id and (i == 0 or ids[i - 1] != spec.token_id)]
    runs = [(s, next((j for j in range(s, len(ids)) if ids[j] != spec.token_id), len(ids)) - s)
            for s in starts]
    wanted = [image.tokens(spec) for image in prepared]
    grid = spec.patches is not None
    if len(runs) != len(prepared) or any(n != k and not (grid and n == 1) for (_, n), k in zip(runs, wanted)):
        one = f" (or one {spec.marker} each)" if grid else ""
        raise InvalidParam(field, f"{field}: the prompt's image placeholders (runs of {[n for _, n in runs]} "
                                  f"tokens {spec.token_id}) do not fit {len(prepared)} image(s) of "
                                  f"{wanted} tokens{one}")
    out, placed, shift = list(ids), [], 0
    for (start, n), k, image in zip(runs, wanted, prepared):
        start += shift
        out[start: start + n] = [spec.token_id] * k
        shift += k - n
        placed.append(ImageInput(identity(image, spec), start, k, tuple(image.pixels.shape),
                                 image.pixels.tobytes(), image.grid))
    return out, placed


# Chat content parts that carry an image: OpenAI chat's image_url, the Responses API's input_image
# (the other APIs' routes translate theirs into these).
IMAGE_PARTS = ("image_url", "input_image")


def take_images(messages: list[JSONObject]) -> tuple[list[JSONObject], list[ImageSource]]:
    """Chat messages with each image part made {"type": "image"}, the part chat templates write
    the image marker for, and the images they carried, in order."""
    out, found = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_is_image(p) for p in content):
            out.append(message)
            continue
        parts: list[object] = []
        for j, part in enumerate(content):
            if _is_image(part):
                field = f"messages[{i}].content[{j}].image_url"
                url = part.get("image_url")
                found.append(ImageSource(url.get("url") if isinstance(url, dict) else url, field))
                parts.append(IMAGE)
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, found


def _is_image(part: object) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PARTS
