"""The model cache on disk (~/.cache/unison, or UNISON_CACHE_DIR): directories built once.

A directory is built in a temp directory beside it, under a file lock, and published by an
atomic rename: other processes see either no directory or a complete one, and only one of them
does the work.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("UNISON_CACHE_DIR") or Path.home() / ".cache" / "unison")


def cached_dir(final: Path, build: Callable[[Path], None]) -> Path:
    """`final`, built by `build(empty temp dir)` if it does not exist yet."""
    from filelock import FileLock

    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if final.is_dir():  # another process finished while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name[:16]}-", dir=final.parent))
        try:
            build(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final
