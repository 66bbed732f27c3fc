"""Unison: an LLM inference engine with one engine core and many frontend processes."""

from unison.api.core_process import curve_keypair
from unison.api.engine import Engine
from unison.errors import EngineDeadError, EngineOverloadedError, FrontendStalledError
from unison.frontend.sampling_params import SamplingParams
from unison.version import __version__ as __version__

__all__ = ["Engine", "EngineDeadError", "EngineOverloadedError", "FrontendStalledError", "SamplingParams",
           "curve_keypair"]
