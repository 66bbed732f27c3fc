"""The messages between the HTTP workers and the launcher's model pool (`unison serve` with several
models), msgpack over one ZMQ socket: a worker's DEALER, the pool's ROUTER.

A worker holds a model while it has requests for it in flight: Acquire when its count goes from 0
to 1 (answered once the model's core is up, which may mean loading it), Release when it is back
at 0 (no answer). The pool never stops a core that a live worker holds, so the steady state of a
busy model costs no message at all.
"""

from __future__ import annotations

import msgspec

MODEL_STATES = ("unloaded", "loading", "loaded", "failed")


class Acquire(msgspec.Struct, tag=True):
    """Hold `model` for requests (load it first if needed); answered by Ready or PoolError."""

    call_id: int
    model: str
    pid: int  # the worker's: a holder that died holds nothing


class Release(msgspec.Struct, tag=True):
    model: str
    pid: int


class Load(msgspec.Struct, tag=True):
    """Load `model` without holding it (/models/load, --preload); answered by Ready or PoolError.
    `if_loaded`: only say where it is, loading nothing (a listing attaches to what runs)."""

    call_id: int
    model: str
    if_loaded: bool = False


class Unload(msgspec.Struct, tag=True):
    """Stop `model`'s core unless a request is in flight there; answered by Done or PoolError."""

    call_id: int
    model: str


class ListModels(msgspec.Struct, tag=True):
    call_id: int


ToPool = Acquire | Release | Load | Unload | ListModels


class ModelRow(msgspec.Struct, frozen=True):
    """One model as /v1/models and /get_server_info list it."""

    name: str
    path: str
    state: str  # one of MODEL_STATES
    task: str  # generate | embed | rerank: the core's once loaded, else read from the model's config
    core_pid: int | None = None
    registry_path: str | None = None  # where its frontends attach (loaded)
    holders: int = 0  # HTTP workers with requests in flight there
    last_used: float = 0.0  # time.time() of the last Acquire or Release
    error: str | None = None  # why its last load failed, or why its core exited
    progress: float | None = None  # loading: the share of its Hugging Face download done (None: unknown)


class Ready(msgspec.Struct, tag=True):
    call_id: int
    row: ModelRow


class Done(msgspec.Struct, tag=True):
    call_id: int
    row: ModelRow


class Rows(msgspec.Struct, tag=True):
    call_id: int
    rows: list[ModelRow]


class PoolError(msgspec.Struct, tag=True):
    """Why a call failed, as the HTTP status it becomes (404 unknown model, 409 busy, 500 a failed
    load, 503 the --models-max limit, 504 the load timeout)."""

    call_id: int
    status: int
    message: str


FromPool = Ready | Done | Rows | PoolError

encode = msgspec.msgpack.Encoder().encode
decode_to_pool = msgspec.msgpack.Decoder(ToPool).decode
decode_from_pool = msgspec.msgpack.Decoder(FromPool).decode
