"""Where a model's tensors come from, and which of its linears run quantized.

A weight source serves tensors by their Hugging Face names, one at a time: as float, or already
converted into the quantized kernel's blocks. `SafetensorsWeights` reads a Hugging Face directory,
`gguf.GGUFWeights` a GGUF file, `DictWeights` tensors in memory (tests, the dummy model),
`OverlayWeights` a source with some tensors replaced (update_weights_from_tensor),
`RenamedWeights` a source under other names (a multimodal checkpoint's text model).
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Protocol

import torch

from unison.model.weights import quant
from unison.model.weights.quant import QuantWeight

QUANTIZATIONS = ("auto", "none", "int8", "int4")
TENSOR_FILE_PREFIX = "unison_tensors_"  # save_tensors' files: the core removes them once read
# Where they are written: shared memory, or disk when it has no room.
TENSOR_FILE_DIRS = [d for d in (Path("/dev/shm"), Path(tempfile.gettempdir())) if d.is_dir()]


class WeightSource(Protocol):
    def __contains__(self, name: str) -> bool: ...
    def names(self) -> set[str]: ...
    def source_type(self, name: str) -> str: ...  # "F32", "BF16", "Q4_K", ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def float(self, name: str) -> torch.Tensor: ...
    def quantized(self, name: str, bits: int) -> QuantWeight: ...


class DictWeights:
    """Tensors already in memory."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> set[str]:
        return set(self.tensors)

    def source_type(self, name: str) -> str:
        return _TYPE_NAMES.get(self._get(name).dtype, str(self._get(name).dtype))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._get(name).shape)

    def _get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"checkpoint is missing weight {name!r}")
        return self.tensors[name]

    def float(self, name: str) -> torch.Tensor:
        return self._get(name)

    def quantized(self, name: str, bits: int) -> QuantWeight:
        return quant.quantize(self._get(name), bits)


class SafetensorsWeights(DictWeights):
    """A Hugging Face directory's *.safetensors (or one such file), each tensor read when first
    asked for."""

    def __init__(self, model_dir: str | Path) -> None:
        from safetensors import SafetensorError, safe_open

        path = Path(model_dir)
        files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weight files in {model_dir}")
        self._files: dict[str, safe_open] = {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
                names = list(handle.keys())
            except (SafetensorError, OSError, RuntimeError) as e:
                raise ValueError(f"cannot read weight file {f} (corrupt or truncated?): {e}") from e
            self._files.update(dict.fromkeys(names, handle))
        super().__init__({})

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def names(self) -> set[str]:
        return set(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._files:
            raise ValueError(f"checkpoint is missing weight {name!r}")
        return tuple(self._files[name].get_slice(name).get_shape())

    def _get(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise ValueError(f"checkpoint is missing weight {name!r}")
        return self._files[name].get_tensor(name)


class OverlayWeights:
    """`base`'s tensors, except those in `tensors`: what the model is rebuilt from when some of
    its tensors are replaced in place."""

    def __init__(self, base: WeightSource, tensors: dict[str, torch.Tensor]) -> None:
        self.base, self.own = base, DictWeights(tensors)

    def _of(self, name: str) -> WeightSource:
        return self.own if name in self.own else self.base

    def __contains__(self, name: str) -> bool:
        return name in self.own or name in self.base

    def names(self) -> set[str]:
        return self.base.names() | self.own.names()

    def source_type(self, name: str) -> str:
        return self._of(name).source_type(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._of(name).shape(name)

    def float(self, name: str) -> torch.Tensor:
        return self._of(name).float(name)

    def quantized(self, name: str, bits: int) -> QuantWeight:
        return self._of(name).quantized(name, bits)


class RenamedWeights:
    """`base`'s tensors under other names: `prefix` + rest is base's `base_prefix` + rest (a
    multimodal checkpoint's text model, read under the text model's own names)."""

    def __init__(self, base: WeightSource, prefix: str, base_prefix: str) -> None:
        self.base, self.prefix, self.base_prefix = base, prefix, base_prefix

    def _name(self, name: str) -> str:
        return self.base_prefix + name.removeprefix(self.prefix) if name.startswith(self.prefix) else name

    def __contains__(self, name: str) -> bool:
        return self._name(name) in self.base

    def names(self) -> set[str]:
        return {self.prefix + n.removeprefix(self.base_prefix) if n.startswith(self.base_prefix) else n
                for n in self.base.names()}

    def source_type(self, name: str) -> str:
        return self.base.source_type(self._name(name))

    def shape(self, name: str) -> tuple[int, ...]:
        return self.base.shape(self._name(name))

    def float(self, name: str) -> torch.Tensor:
        return self.base.float(self._name(name))

    def quantized(self, name: str, bits: int) -> QuantWeight:
        return self.base.quantized(self._name(name), bits)


def checked_tensor(weights: WeightSource, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                   what: str = "vision weight") -> torch.Tensor:
    """`name` as `dtype`, contiguous; a ValueError naming it where the checkpoint lacks it or its
    shape is not the config's `shape`."""
    if name not in weights:
        raise ValueError(f"checkpoint is missing {what} {name!r}")
    if tuple(weights.shape(name)) != shape:
        raise ValueError(f"{what} {name!r} has shape {tuple(weights.shape(name))}, "
                         f"the config makes it {shape}")
    return weights.float(name).to(dtype).contiguous()


def save_tensors(tensors: dict[str, torch.Tensor], directories: list[Path]) -> Path:
    """Write `tensors` as a private safetensors file in the first of `directories` with room
    (update_weights_from_tensor hands them to the core this way); the caller removes it.
    Tensors that share memory (one tensor given under several names, views of one buffer) are
    written as copies."""
    seen: set[int] = set()
    own: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        t = tensor.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() != t.nbytes:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        own[name] = t
    for directory in directories[:-1]:
        try:
            return _save_file(own, directory)
        except OSError as e:
            if e.errno != errno.ENOSPC:  # else: a container's /dev/shm is often 64 MiB
                raise
    return _save_file(own, directories[-1])


def _save_file(tensors: dict[str, torch.Tensor], directory: Path) -> Path:
    from safetensors.torch import save_file

    fd, path = tempfile.mkstemp(prefix=TENSOR_FILE_PREFIX, suffix=".safetensors", dir=directory)
    os.close(fd)
    try:
        save_file(tensors, path)
    except BaseException:
        os.unlink(path)
        raise
    return Path(path)


def overlay(source: WeightSource, tensors: dict[str, torch.Tensor]) -> OverlayWeights:
    """`source` with `tensors` replacing its own, one level deep however many updates came
    before: a tensor updated again lets go of its previous value."""
    if isinstance(source, OverlayWeights):
        return OverlayWeights(source.base, source.own.tensors | tensors)
    return OverlayWeights(source, tensors)


_TYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def resolve_quantization(mode: str, device: torch.device, from_gguf: bool, kernels: bool) -> str:
    """What `mode` means for this model here: none, int8 or int4 (auto: a GGUF's own types on
    CPU, the checkpoint's float weights otherwise)."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {mode!r}")
    if mode == "auto":
        return "int4" if from_gguf and device.type == "cpu" and kernels else "none"
    if mode != "none" and device.type != "cpu":
        raise ValueError(f"quantization={mode!r} runs on CPU only; on {device.type} use "
                         "'none' (or 'auto', which keeps the checkpoint's float weights there)")
    if mode != "none" and not kernels:
        raise ValueError(f"quantization={mode!r} needs the CPU kernels, which could not be built "
                         "here (no C compiler, or UNISON_CPU_KERNELS=0); use quantization='none'")
    return mode


def linear_bits(mode: str, source_type: str, *, head: bool, from_gguf: bool) -> int | None:
    """Bits a weight runs at under the resolved `mode` (None: float). A GGUF's block formats run
    as stored whatever this says (gguf_blocks.py); int4 keeps its Q4_0 / Q4_1 at 4 bits and its
    float tensors go to 8; a float checkpoint under int4 goes to 4 bits, but its embedding and LM
    head to 8 (as llama.cpp's Q4_K_M keeps its output tensor wider)."""
    if mode == "none":
        return None
    if mode == "int8":
        return 8
    if from_gguf:
        return 4 if source_type in quant.GGUF_INT4_TYPES else 8
    return 8 if head else 4
