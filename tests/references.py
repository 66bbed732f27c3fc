"""Hugging Face references kept per machine: what transformers computed once, reused by later runs.

A reference (greedy continuations, or the tensors transformers' GGUF loader builds) is stored in
the test-model cache (tests/models.py `cache_dir()`, never in the repository) under a key of
everything that decides it: the model file's content, the versions of transformers and torch,
the code that computes it and its inputs. Anything else is a miss, and a miss computes exactly as
a run without the cache would. A reference is written under a file lock and published by atomic
rename: a concurrent run waits for it instead of computing it twice, and never reads half a file.

On a machine without them (a CI runner, every time), a test session starts a warmer: a
background process at the lowest priority that computes the references of the selected modules
(each declares them in `hf_references()`, or computes other kinds in `warm_references()`) in the
CPU time the other tests leave idle. A test that needs one waits for it, or, when the warmer holds
it too long (starved by other work on the machine), stops the warmer and computes it itself.

    python -m tests.references tests.e2e.test_engine ...   # the warmer, by hand
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

from tests.models import cache_dir

Reference = list[tuple[list[int], list[dict[int, float]]]]  # per prompt: ids, top logprobs per position
WARMER_GRACE_S = 120.0  # a test waits this long for a reference the warmer is computing
_warmer: subprocess.Popen | None = None


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


def reference_key(model: Path, code: str, inputs: dict[str, Any]) -> str:
    # Versions from the package metadata: a hit imports neither torch nor transformers.
    material = {"model": file_sha256(model), "transformers": version("transformers"),
                "torch": version("torch"), "code": code, "inputs": inputs}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def cached_reference(model: Path, code: str, prompts_ids: list[list[int]], max_new_tokens: int,
                     compute: Callable[[], Reference]) -> Reference:
    """Greedy continuations: the stored ones for this key, else `compute()`'s, stored for the next
    run. `code` is the source of what `compute` runs: editing it makes a new key."""
    key = reference_key(model, code, {"prompts": prompts_ids, "max_new_tokens": max_new_tokens})
    return _cached(key, ".json", lambda path: _write_json(path, compute()), _read_json)


def cached_json(model: Path, code: str, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A JSON document (a model's config), as cached_reference."""
    return _cached(reference_key(model, code, {"json": True}), ".json",
                   lambda path: path.write_text(json.dumps(compute())),
                   lambda path: json.loads(path.read_text()))


def cached_tensors(model: Path, code: str, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A state dict (name -> torch tensor), as cached_reference; tied tensors are stored once and
    come back tied."""
    return _cached(reference_key(model, code, {}), ".safetensors",
                   lambda path: _write_tensors(path, compute()), _read_tensors)


def _cached(key: str, suffix: str, write: Callable[[Path], None], read: Callable[[Path], Any]) -> Any:
    from filelock import FileLock

    root = cache_dir() / "references"
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{key}{suffix}"
    if not target.is_file():
        with _locked(FileLock(str(root / f".{key}.lock"))):
            if not target.is_file():
                fd, partial = tempfile.mkstemp(prefix=f".{key}.", suffix=".partial", dir=root)
                os.close(fd)
                try:
                    write(Path(partial))
                    os.replace(partial, target)
                except BaseException:
                    os.unlink(partial)
                    raise
    return read(target)  # what a miss computed comes back the way a hit does


@contextlib.contextmanager
def _locked(lock):
    from filelock import Timeout

    try:
        lock.acquire(timeout=WARMER_GRACE_S if _warmer is not None else -1)
    except Timeout:
        stop_warmer()  # the lock dies with it; what it was computing is computed here instead
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def start_warmer(modules: list[str]) -> None:
    """Computes the modules' references in a background process, if any is missing. Its
    environment lacks the test session's mark: it is the session's, not a test's, to stop."""
    global _warmer
    if not modules or _warmer is not None:
        return
    env = {k: v for k, v in os.environ.items() if k != "UNISON_TEST_SESSION"}
    root = cache_dir() / "references"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "warmer.log", "w") as log:
        _warmer = subprocess.Popen([sys.executable, "-m", "tests.references", *modules], env=env,
                                   cwd=Path(__file__).parent.parent, stdout=log, stderr=log)


def stop_warmer() -> None:
    global _warmer
    if _warmer is not None:
        _warmer.kill()
        _warmer.wait()
        _warmer = None


def warm(modules: list[str]) -> None:
    from tests.utils import hf_reference

    os.nice(19)  # only what the tests leave idle
    for name in modules:
        module = importlib.import_module(name)
        for path, prompts_ids, max_new_tokens in getattr(module, "hf_references", list)():
            hf_reference(prompts_ids, max_new_tokens, path)
        if hasattr(module, "warm_references"):  # references of another kind (transformers + PEFT)
            module.warm_references()


def _write_json(path: Path, reference: Reference) -> None:
    # Top logprobs as [token, logprob] pairs in rank order (JSON keys would be strings); a
    # Python float survives JSON exactly.
    results = [{"ids": ids, "top": [list(top.items()) for top in tops]} for ids, tops in reference]
    path.write_text(json.dumps({"transformers": version("transformers"), "results": results}))


def _read_json(path: Path) -> Reference:
    doc = json.loads(path.read_text())
    return [(r["ids"], [{int(t): lp for t, lp in top} for top in r["top"]]) for r in doc["results"]]


def _write_tensors(path: Path, tensors: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    stored: dict[str, Any] = {}
    aliases: dict[str, str] = {}  # a tied tensor's name -> the name it is stored under
    first: dict[tuple, str] = {}
    for name, tensor in tensors.items():
        where = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if where in first:
            aliases[name] = first[where]
        else:
            first[where], stored[name] = name, tensor.contiguous()
    save_file(stored, path, metadata={"aliases": json.dumps(aliases), "order": json.dumps(list(tensors))})


def _read_tensors(path: Path) -> dict[str, Any]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, "pt") as f:
        meta = f.metadata()
    stored, aliases = load_file(path), json.loads(meta["aliases"])
    return {name: stored[aliases.get(name, name)] for name in json.loads(meta["order"])}


if __name__ == "__main__":
    warm(sys.argv[1:])
