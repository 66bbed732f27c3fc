"""The registry: /dev/shm/unison_<owner pid>, a msgpack EngineInfo, mode 0600.

A plain file in POSIX shared memory's namespace, written by atomic rename. Not
multiprocessing.shared_memory: before Python 3.13 its resource tracker unlinks a segment when any
process that merely opened it exits.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from unison.errors import EngineDeadError
from unison.wire.messages import PROTOCOL_VERSION, EngineInfo

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


def publish(path: str | Path, info: EngineInfo) -> None:
    path = Path(path)
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
    """Whether the process runs; a zombie (exited, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):  # no /proc: trust kill()
        return True


def read_for_attach(path: str | Path, pid: int) -> EngineInfo:
    """The registry of a live engine, or a clear error saying why there is none to attach to."""
    path = Path(path)
    try:
        info = read(path)
    except FileNotFoundError:
        hint = "it is not running" if not pid_alive(pid) else (
            "it publishes no registry: start it with tokenizer_worker_num > 1 to accept attached frontends")
        raise ConnectionRefusedError(f"no Unison engine to attach to in process {pid}: {hint}") from None
    except Exception as e:
        raise ConnectionRefusedError(f"unreadable engine registry {path}: {e}") from None
    if info.version != PROTOCOL_VERSION:
        raise ConnectionRefusedError(
            f"engine {pid} speaks protocol {info.version}, this Unison speaks {PROTOCOL_VERSION}")
    if not pid_alive(info.owner_pid) or not pid_alive(info.core_pid):
        raise EngineDeadError(f"stale registry {path}: engine {pid} is no longer running")
    return info
