"""Unison: an LLM inference engine with one engine core and many frontend processes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from unison.errors import EngineDeadError, EngineOverloadedError, FrontendStalledError
from unison.version import __version__ as __version__

if TYPE_CHECKING:
    from unison.api.core_process import curve_keypair
    from unison.api.engine import Engine
    from unison.frontend.sampling_params import SamplingParams

__all__ = ["Engine", "EngineDeadError", "EngineOverloadedError", "FrontendStalledError", "SamplingParams",
           "curve_keypair"]

# Imported on first use (PEP 562): every process imports this package, and the core process, which
# never builds an Engine, would otherwise load the whole frontend for it (0.2 s of CPU a core start).
_LAZY = {"Engine": "unison.api.engine", "SamplingParams": "unison.frontend.sampling_params",
         "curve_keypair": "unison.api.core_process"}


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'unison' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # the next use is a plain attribute
    return value
