"""The Engine's engine-wide controls, acted on in the core (SGLang's names): the prefix cache,
pausing, weight updates, LoRA adapters, the integrity check. Each is one typed Control message to
the core through the Engine's frontend."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING

from unison.errors import InvalidParam
from unison.frontend.worker import TokenizerWorker
from unison.wire.messages import (
    CheckIntegrity,
    Continue,
    ControlRequest,
    FlushCache,
    LoadLoraAdapter,
    OpResult,
    Pause,
    PauseMode,
    ReplyT,
    UnloadLoraAdapter,
    UpdateTensors,
    UpdateWeights,
)

if TYPE_CHECKING:
    import torch


class EngineControls:
    """Engine's controls; Engine gives `_control` (a Control sent, its reply awaited) and
    `_worker` (its live frontend)."""

    def _control(self, req: ControlRequest[ReplyT], timeout: float | None = 30.0) -> ReplyT:
        raise NotImplementedError

    def _worker(self) -> TokenizerWorker:
        raise NotImplementedError

    def flush_cache(self) -> OpResult:
        """Empty the prefix cache. The result is falsy, with the reason in `.message`, while
        requests hold KV (SGLang's: not an exception)."""
        return self._control(FlushCache())

    def pause_generation(self, mode: str = "abort") -> None:
        """Stop generating, engine-wide: `abort` ends what is in flight (as aborted), `retract`
        frees its KV to recompute it after continue_generation(), `in_place` keeps it as it is.
        New requests meanwhile are queued, not refused."""
        self._control(Pause(_pause_mode(mode)))

    def continue_generation(self) -> None:
        self._control(Continue())

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 abort_all_requests: bool = False) -> tuple[bool, str, int]:
        """Load new weights (a safetensors directory or a GGUF file of the same architecture and
        shapes) into the running core, as SGLang's: the requests in flight finish first (or
        are aborted, with `abort_all_requests`; at once when paused), new ones wait, the prefix
        cache is emptied, and attached frontends stay attached. Returns (success, message,
        num_paused_requests); a refused checkpoint leaves the old weights serving."""
        expect("model_path", model_path, (str, os.PathLike), "a path (an HF directory or a GGUF file)")
        expect("load_format", load_format, str, "a string", optional=True)
        expect("abort_all_requests", abort_all_requests, bool, "True or False")
        path = str(Path(model_path).expanduser().resolve())
        r = self._control(UpdateWeights(path, load_format, bool(abort_all_requests)), timeout=None)
        return r.success, r.message, r.num_paused_requests

    def update_weights_from_tensor(self, named_tensors: object, load_format: str | None = None,
                                   flush_cache: bool = True) -> tuple[bool, str]:
        """Replace some of the model's tensors, given as (name, tensor) pairs (or a dict) under
        the checkpoint's names, e.g. "model.layers.0.mlp.up_proj.weight"; as SGLang's, for a
        trainer on the core's host. Same order as update_weights_from_disk (waits for what is in
        flight); `flush_cache=False` keeps the prefix cache, for a series of updates whose last
        flushes. The tensors reach the core as a file in shared memory (on disk when that is
        full), removed on return.
        Returns (success, message); a refused update changes nothing."""
        expect("flush_cache", flush_cache, bool, "True or False")
        if not isinstance(named_tensors, (dict, list, tuple)):
            raise TypeError(f"named_tensors must be a list of (name, tensor) pairs or a dict, got "
                            f"{type(named_tensors).__name__}")
        if load_format is not None:
            raise InvalidParam("load_format", f"load_format={load_format!r} is not supported: tensors "
                               "are taken by their checkpoint names (load_format=None)")
        worker = self._worker()
        if worker.curve is not None:
            raise InvalidParam("named_tensors", "update_weights_from_tensor works on the core's host "
                               "only; over TCP, save a checkpoint there and use update_weights_from_disk")
        tensors = _named_tensors(named_tensors)
        if not tensors:
            return True, "no tensors given: nothing updated"
        from unison.model.weights.sources import (  # torch: for these callers only
            TENSOR_FILE_DIRS,
            save_tensors,
        )

        path = save_tensors(tensors, TENSOR_FILE_DIRS)
        try:
            r = self._control(UpdateTensors(str(path), bool(flush_cache)), timeout=None)
        finally:
            path.unlink(missing_ok=True)
        return r.success, r.message

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> OpResult:
        """Load a PEFT adapter (a directory on the core's host) under `lora_name`, in the core: every
        frontend of this engine can use it from the next request on (`lora_path=lora_name`, or
        `model` over HTTP). A bad adapter is refused with the reason (a falsy result), and the
        engine keeps serving as it was."""
        expect("lora_name", lora_name, str, "the adapter's name")
        expect("lora_path", lora_path, (str, os.PathLike), "a PEFT adapter's directory")
        expect("pinned", pinned, bool, "True or False")
        return self._control(LoadLoraAdapter(lora_name, str(Path(lora_path).expanduser().resolve()), pinned),
                             timeout=None)

    def unload_lora_adapter(self, lora_name: str) -> OpResult:
        """Forget `lora_name` at once, engine-wide: new requests naming it are refused, and those
        in flight with it finish with it."""
        expect("lora_name", lora_name, str, "the adapter's name")
        return self._control(UnloadLoraAdapter(lora_name))

    async def async_load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> OpResult:
        return await asyncio.to_thread(self.load_lora_adapter, lora_name, lora_path, pinned)

    async def async_unload_lora_adapter(self, lora_name: str) -> OpResult:
        return await asyncio.to_thread(self.unload_lora_adapter, lora_name)

    def check_integrity(self) -> None:
        """Raise if the core's KV block pool has a leaked or double-owned block."""
        self._control(CheckIntegrity())


def _named_tensors(given: dict | list | tuple) -> dict[str, torch.Tensor]:
    """update_weights_from_tensor's (name, tensor) pairs, checked: InvalidParam saying which."""
    import torch

    pairs = list(given.items() if isinstance(given, dict) else given)
    tensors: dict[str, torch.Tensor] = {}
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise InvalidParam("named_tensors", f"named_tensors[{i}] must be a (name, tensor) pair")
        name, tensor = pair
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise InvalidParam("named_tensors", f"named_tensors[{i}] must be (str, torch.Tensor), got "
                                                f"({type(name).__name__}, {type(tensor).__name__})")
        if not tensor.is_floating_point():
            raise InvalidParam("named_tensors", f"named_tensors[{i}] ({name!r}) is {tensor.dtype}: "
                                                "a floating-point tensor is needed")
        if name in tensors:
            raise InvalidParam("named_tensors", f"named_tensors names {name!r} twice")
        tensors[name] = tensor
    return tensors


def expect(name: str, value: object, kinds: type | tuple[type, ...], what: str,
            optional: bool = False) -> None:
    """TypeError naming the argument, before anything is sent (bool is no int here)."""
    if optional and value is None:
        return
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r:.80}")


def _pause_mode(mode: str) -> PauseMode:
    expect("mode", mode, str, f"one of {[m.value for m in PauseMode]}")
    try:
        return PauseMode(mode)
    except ValueError:
        raise ValueError(f"mode must be one of {[m.value for m in PauseMode]}, got {mode!r}") from None
