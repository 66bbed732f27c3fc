"""WeightUpdate: swapping the running model's weights, in SGLang's order, one update at a time."""

from __future__ import annotations

import enum
import logging
import time
from pathlib import Path
from typing import cast

from unison.core.engine_core import EngineCore
from unison.core.frontends import Caller
from unison.core.kv.disk_cache import weights_key
from unison.core.request import Request
from unison.model.runner import ModelRunner
from unison.model.weights.sources import TENSOR_FILE_DIRS, TENSOR_FILE_PREFIX
from unison.wire.messages import OpResult, UpdateTensors, UpdateWeights

log = logging.getLogger("unison.core")

LOAD_FORMATS = (None, "auto", "safetensors", "gguf")


class UpdateState(enum.Enum):
    IDLE = "idle"  # no update: new requests are admitted as they come
    WAITING = "waiting"  # taken: new requests are held while those in flight run to their end
    LOADING = "loading"  # the weights are being swapped (the core's loop does nothing else)


class WeightUpdate:
    """The weight-update sequence:

        IDLE --start--> WAITING --ready: what was in flight has finished, or a pause--> LOADING --> IDLE

    `start` takes an update that `refusal` allows, and holds new requests (queued, not
    refused) until it has run. `ready` says when it may run; `run` swaps the weights (a whole
    checkpoint, or some tensors from a file) and returns the caller's OpResult: on failure the
    old weights keep serving. A refused update leaves the state as it was."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.state = UpdateState.IDLE
        self.version = 0  # successful updates so far
        self.caller: Caller | None = None  # whom to answer, once run
        self.req: UpdateWeights | UpdateTensors | None = None
        self.waits_for: set[Request] = set()  # the requests themselves: a rid may come back, held

    def refusal(self, req: UpdateWeights | UpdateTensors, remote: bool) -> str:
        """Why this update cannot be taken ("" if it can)."""
        if self.state is not UpdateState.IDLE:
            return "another weight update is in progress"
        if isinstance(req, UpdateTensors) and remote:
            return ("update_weights_from_tensor works on the core's host only (the tensors come as "
                    "a file there); over TCP, save a checkpoint the core can read and use "
                    "update_weights_from_disk")
        if isinstance(req, UpdateWeights) and req.load_format not in LOAD_FORMATS:
            return (f"load_format={req.load_format!r} is not supported: weights load from a "
                    "safetensors directory or a GGUF file")
        return ""

    def start(self, caller: Caller, req: UpdateWeights | UpdateTensors, paused: bool) -> None:
        """IDLE -> WAITING, waiting for the requests in flight (none when paused)."""
        assert self.state is UpdateState.IDLE, self.state
        self.state, self.caller, self.req = UpdateState.WAITING, caller, req
        self.waits_for = set() if paused else set(self.core.requests.values())
        self.core.hold_new(True)
        if self.waits_for:
            log.info("weight update (%s) waits for %d request(s) in flight", _source(req),
                     len(self.waits_for))

    def ready(self, paused: bool) -> bool:
        return self.state is UpdateState.WAITING and (paused or not any(
            self.core.requests.get(r.rid) is r for r in self.waits_for))

    def run(self) -> OpResult:
        """WAITING -> LOADING -> IDLE."""
        req = self.req
        assert self.state is UpdateState.WAITING and req is not None, self.state
        self.state = UpdateState.LOADING
        held = len(self.core.requests)  # queued meanwhile, or paused: they run on the new weights
        started = time.monotonic()
        try:
            done = self._load(req)
        except Exception as e:  # refused, or failed to load: the old weights keep serving
            log.warning("weight update (%s) refused: %s", _source(req), e)
            return OpResult(False, f"the weights were not updated: {type(e).__name__}: {e}",
                            num_paused_requests=held)
        finally:
            self.core.hold_new(False)
            if isinstance(req, UpdateTensors):
                _remove_tensor_file(req.path)
            self.state, self.caller, self.req, self.waits_for = UpdateState.IDLE, None, None, set()
        self.version += 1
        result = OpResult(True, f"{done} in {time.monotonic() - started:.1f} s", num_paused_requests=held)
        log.info("%s", result.message)
        return result

    def _load(self, req: UpdateWeights | UpdateTensors) -> str:
        if isinstance(req, UpdateTensors):
            return f"{update_tensors(self.core, req.path, req.flush_cache)} tensor(s) updated"
        load_weights(self.core, req.model_path)
        return f"weights updated from {req.model_path}"


def load_weights(core: EngineCore, model_path: str) -> None:
    """Serve `model_path`'s weights from now on (ValueError: not the same shapes; the old ones
    stay). Whatever holds KV computed with the old weights is recomputed, and the prefix cache
    emptied: no token is ever computed over stale KV."""
    core.runner.load_weights(model_path)
    core.retract_all()
    core.scheduler.flush_cache()
    core.config.model_path = model_path
    if core.disk is not None:  # the new file's blocks, which an earlier run may have left
        core.disk.open(weights_key(cast(ModelRunner, core.runner), model_path))


def update_tensors(core: EngineCore, path: str, flush_cache: bool = True) -> int:
    """Replace the tensors in the safetensors file `path`, as load_weights does a whole
    checkpoint. `flush_cache=False` keeps the prefix cache (SGLang's: more updates follow, and
    the caller flushes after the last); what holds KV is recomputed either way."""
    count = core.runner.update_tensors(path)
    core.retract_all()
    if flush_cache:
        core.scheduler.flush_cache()
    if core.disk is not None:  # no file holds these weights now: nothing on disk matches them
        core.disk.retire()
    return count


def _source(req: UpdateWeights | UpdateTensors) -> str:
    return f"from {req.model_path}" if isinstance(req, UpdateWeights) else "from tensors"


def _remove_tensor_file(path: str) -> None:
    """A tensors file is spent once read. Its writer removes it when the call returns; this is
    for a writer that died waiting (only ever save_tensors' own files)."""
    file = Path(path)
    if file.parent in TENSOR_FILE_DIRS and file.name.startswith(TENSOR_FILE_PREFIX):
        file.unlink(missing_ok=True)
