"""The registry: /dev/shm/unison_<owner pid>, a msgpack EngineInfo, mode 0600.

A plain file in POSIX shared memory's namespace, written by atomic rename. Not
multiprocessing.shared_memory: before Python 3.13 its resource tracker unlinks a segment when any
process that merely opened it exits.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from unison.protocol import EngineInfo

REGISTRY_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
PREFIX = "unison_"


def registry_path(owner_pid: int, suffix: int = 0) -> Path:
    return REGISTRY_DIR / f"{PREFIX}{owner_pid}{f'_{suffix}' if suffix else ''}"


def free_registry_path(owner_pid: int) -> Path:
    """The first unused name for this owner: a second engine in one process gets a suffix."""
    suffix = 0
    while registry_path(owner_pid, suffix).exists():
        suffix += 1
    return registry_path(owner_pid, suffix)


def publish(path: Path, info: EngineInfo) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.msgpack.encode(info))
    os.rename(tmp, path)


def read(path: Path) -> EngineInfo:
    return msgspec.msgpack.decode(path.read_bytes(), type=EngineInfo)


def unlink(path: str | Path | None) -> None:
    if path:
        Path(path).unlink(missing_ok=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
