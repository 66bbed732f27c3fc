"""Unison: an LLM inference engine with one engine core and many frontend processes."""

from unison.engine import Engine
from unison.errors import EngineDeadError
from unison.frontend.sampling_params import SamplingParams

__all__ = ["Engine", "EngineDeadError", "SamplingParams"]
__version__ = "0.1.0"
