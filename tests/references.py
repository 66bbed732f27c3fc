"""Hugging Face references kept per machine: what transformers computed once, reused by later runs.

A reference is stored in the test-model cache (tests/models.py `cache_dir()`, never in the
repository) under a key of everything that decides it: the model file's content, the versions of
transformers and torch, the code that computes it, the prompts and the token count. Anything
else is a miss, and a miss computes exactly as a run without the cache would. A reference is
written under a file lock and published by atomic rename: a concurrent run waits for it instead
of computing it twice, and never reads half a file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

from tests.models import cache_dir

Reference = list[tuple[list[int], list[dict[int, float]]]]  # per prompt: ids, top logprobs per position


def file_sha256(path: Path) -> str:
    """The file's sha256, hashed once per (path, size, mtime) in this process."""
    stat = path.stat()
    return _sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.cache
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def reference_key(model: Path, code: str, prompts_ids: list[list[int]], max_new_tokens: int) -> str:
    # Versions from the package metadata: a hit imports neither torch nor transformers.
    material = {"model": file_sha256(model), "transformers": version("transformers"),
                "torch": version("torch"), "code": code, "prompts": prompts_ids,
                "max_new_tokens": max_new_tokens}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def cached_reference(model: Path, code: str, prompts_ids: list[list[int]], max_new_tokens: int,
                     compute: Callable[[], Reference]) -> Reference:
    """The stored reference for this key, else `compute()`'s, stored for the next run. `code` is
    the source of what `compute` runs: editing it makes a new key."""
    from filelock import FileLock

    root = cache_dir() / "references"
    root.mkdir(parents=True, exist_ok=True)
    key = reference_key(model, code, prompts_ids, max_new_tokens)
    target = root / f"{key}.json"
    if not target.is_file():
        with FileLock(str(root / f".{key}.lock")):
            if not target.is_file():
                _publish(target, model, max_new_tokens, compute())
    return _read(target)


def _publish(target: Path, model: Path, max_new_tokens: int, reference: Reference) -> None:
    # Top logprobs as [token, logprob] pairs in rank order (JSON keys would be strings); a
    # Python float survives JSON exactly.
    doc = {"model": model.name, "transformers": version("transformers"), "torch": version("torch"),
           "max_new_tokens": max_new_tokens,
           "results": [{"ids": ids, "top": [list(top.items()) for top in tops]} for ids, tops in reference]}
    fd, partial = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=".partial", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(partial, target)
    except BaseException:
        os.unlink(partial)
        raise


def _read(target: Path) -> Reference:
    doc = json.loads(target.read_text())
    return [(r["ids"], [{int(t): lp for t, lp in top} for top in r["top"]]) for r in doc["results"]]
