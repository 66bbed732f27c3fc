"""A GGUF file's header, read without torch and without the gguf package's reader.

GGUFReader builds a numpy view per vocabulary string (3 s for a 49k vocabulary here, 16 s for
Gemma's 262k): the core needs only the scalar fields and the tensor table, read here in ~0.1 s.
The owner process reads a file's architecture here too (it imports no torch), and the tokenizer
conversion keys its cache on the file's fields (`fields_digest`) less those that describe only its
weights, so files that differ in their weights alone (two quantizations of one model) convert
their tokenizer once.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unison.json_types import JSONObject

# The vision towers Unison runs from an mmproj file, by the text model's general.architecture: the
# clip.projector_type its mmproj must have (model/vision/mmproj.py). Here, torch-free, for the
# launcher's choice of a repository's files too.
MMPROJ_PROJECTORS = {"gemma3": "gemma3", "qwen35": "qwen3vl_merger", "qwen35moe": "qwen3vl_merger",
                     "qwen3vl": "qwen3vl_merger", "qwen3vlmoe": "qwen3vl_merger"}

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# Array fields read whole with the header (the others: their length): M-RoPE's sections
WHOLE_ARRAYS = (".rope.dimension_sections",)


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    type_id: int  # a GGMLQuantizationType value
    dims: tuple[int, ...]  # GGUF's order: innermost first
    offset: int  # from the start of the file


@dataclass(slots=True)
class GGUFHeader:
    fields: JSONObject  # scalar and string fields; arrays as their length (WHOLE_ARRAYS: values)
    tensors: list[TensorInfo]
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # each field's bytes in the file


@dataclass(frozen=True, slots=True)
class Field:
    """A field's whole value and its GGUF type (GGUFValueType's numbers; `elem_type` for arrays)."""

    kind: int
    value: Any  # Any: a scalar, a string, or a list of them, as the type says
    elem_type: int | None = None


def open_gguf(path: Path) -> GGUFHeader:
    """The header of the GGUF file `path`, or ValueError naming the file when it is not one."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic bytes)")
    return read_header(path)


def read_header(path: Path) -> GGUFHeader:
    """The GGUF file's scalar fields and tensor table; ValueError naming the file if malformed."""
    with _mapped(path) as buf:
        try:
            return _parse_header(buf)
        except (struct.error, UnicodeDecodeError, IndexError, ValueError) as e:
            raise ValueError(f"{path} is a corrupt or truncated GGUF file: {e}") from None


def read_fields(path: Path, prefix: str = "") -> dict[str, Field]:
    """The whole values of the fields whose keys start with `prefix`, arrays included (a
    tokenizer's vocabulary, scores and merges, to copy it into another file)."""
    header = read_header(path)
    out = {}
    with _mapped(path) as buf:
        for key, (start, _) in header.spans.items():
            if not key.startswith(prefix):
                continue
            kind_at = start + 8 + len(key.encode())  # after the key's length and bytes
            (kind,) = struct.unpack_from("<I", buf, kind_at)
            if kind != _ARRAY:
                out[key] = Field(kind, header.fields[key])
                continue
            try:
                elem, values = _array(buf, kind_at + 4)
            except (struct.error, UnicodeDecodeError) as e:
                raise ValueError(f"{path} is a corrupt or truncated GGUF file: {key}: {e}") from None
            out[key] = Field(kind, values, elem)
    return out


def fields_digest(path: Path, header: GGUFHeader, keep: Callable[[str], bool]) -> str:
    """SHA-256 of the bytes of the fields whose keys `keep` keeps, as the file stores them (key,
    type and value), in file order."""
    h = hashlib.sha256()
    with _mapped(path) as buf:
        for key, (start, end) in header.spans.items():
            if keep(key):
                h.update(buf[start:end])
    return h.hexdigest()


class _mapped:
    """The file as a read-only mmap, closed on exit."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> mmap.mmap:
        with open(self.path, "rb") as f:
            try:
                self.buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file
                raise ValueError(f"{self.path} is not a GGUF file (empty)") from None
        return self.buf

    def __exit__(self, *exc: object) -> None:
        self.buf.close()


def _string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8: pos + 8 + n]).decode(), pos + 8 + n


def _skip_value(buf: mmap.mmap, kind: int, pos: int, whole: bool = False) -> tuple[Any, int]:
    """A scalar or string value and the position after it; an array as its length (skipped), or
    (`whole`, numbers) as its values."""
    if kind == _STRING:
        return _string(buf, pos)
    if kind == _ARRAY:
        elem, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if elem == _STRING:
            for _ in range(count):  # skipped: only the tokenizer's conversion reads these
                pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        elif elem in _SCALARS:
            if whole:
                return list(struct.unpack_from(f"<{count}{_SCALARS[elem][1]}", buf, pos)), \
                    pos + count * struct.calcsize(_SCALARS[elem])
            pos += count * struct.calcsize(_SCALARS[elem])
        else:
            raise ValueError(f"unsupported array element type {elem}")
        return count, pos
    if kind not in _SCALARS:
        raise ValueError(f"unknown field type {kind}")
    return struct.unpack_from(_SCALARS[kind], buf, pos)[0], pos + struct.calcsize(_SCALARS[kind])


def _array(buf: mmap.mmap, pos: int) -> tuple[int, list[Any]]:
    """An array's element type and values."""
    elem, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if elem == _STRING:
        values = []
        for _ in range(count):
            value, pos = _string(buf, pos)
            values.append(value)
        return elem, values
    return elem, list(struct.unpack_from(f"<{count}{_SCALARS[elem][1]}", buf, pos))


def _parse_header(buf: mmap.mmap) -> GGUFHeader:
    if buf[:4] != b"GGUF":
        raise ValueError("bad magic bytes")
    version = struct.unpack_from("<I", buf, 4)[0]
    if version < 2:
        raise ValueError(f"GGUF version {version} is too old (2 or later is needed)")
    n_tensors, n_fields = struct.unpack_from("<QQ", buf, 8)
    pos, fields, spans = 24, {}, {}
    for _ in range(n_fields):
        start = pos
        key, pos = _string(buf, pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        fields[key], pos = _skip_value(buf, kind, pos + 4, key.endswith(WHOLE_ARRAYS))
        spans[key] = (start, pos)
    infos = []
    for _ in range(n_tensors):
        name, pos = _string(buf, pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        type_id, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, type_id, dims, offset))
    align = int(fields.get("general.alignment", 32))
    start = -(-pos // align) * align
    return GGUFHeader(fields, [TensorInfo(n, t, tuple(d), start + o) for n, t, d, o in infos], spans)
